"""The A16W4 MoE main loop, written as stage 2 (down projection): BF16 activations x pre-shuffled
MXFP4 expert weights.
Stage 1 (gate/up projection, activation fused) is the same builder and main loop with
Gemm2Config.stage = 1: other A rows (x[token]), (gate, up) block pairs per wave and its own
epilogue (kernels/_a16w4_stage1_epilogue.py; the launcher and STAGE1_DOC in kernels/moe_gemm1_a16w4.py). This
module is the kernel both stages launch; kernels/_a16w4_common.py holds its constants and helpers.

Math. For every sorted row r that holds a routing pair (token t, top-k slot k) of expert e
(moe_sorting's output: ids (k << 24) | t, one expert per block of block_m rows):

    out[t, n] += w_r * (sum_i a2[t * topk + k, i] * W2[e][n, i] + bias[e, n])

with W2[e][n, i] = fp4(n, i) * 2^(scale(n, i // 32) - 127) (E2M1 two per byte, E8M0 per 32
along inter_dim), w_r the routing weight (1 when apply_weights is off), the bias term only when a
bias is given. Products are exact in FP32 and accumulated in FP32 by MFMA; the FP4 -> BF16
conversion is exact (E2M1 has 2 significant bits). The only roundings are FP32 accumulation,
the contribution's rounding to the output dtype and the output's atomic accumulation.

Data layout (aiter's shuffles, flyquant.layouts): the weight of expert e is (N0, K0, 4, 16, 16)
bytes: for each 16-row block of N and 128-wide block of K, lane (kl, nl) of a wave reads the 16
bytes = 32 FP4 values of row 16 * n0 + nl, k = 128 * k0 + 32 * kl + [0, 32). The scales are
(N1, K1, 4, 16, 2, 2) bytes: lane (kl, nl)'s dword holds rows 32 * n1 + {nl, nl + 16} x k-chunks
256 * k1 + 128 * {0, 1} + 32 * kl, byte = 2 * k-half + n-half.

Work split. Grid (m-slots, n-tiles, k_batch); a workgroup computes a tile_m x tile_n tile of the
output over inter_dim / k_batch of K with wn x wk waves (1, 2 or 4 in all; default_layout,
default_waves): each wave takes all tile_m rows x tile_n / wn columns over 1/wk of the
workgroup's K range (in 256-wide iterations), and the wk partial sums meet in LDS. Per 128-wide
K step, lane (kl, l16) of a wave loads straight from global memory into registers (no LDS in
the main loop):
  - A: for each 16-row block of the tile, 64 bytes of row l16 at k = 32 * kl + [0, 32);
  - B: for each 16-column block, the 16 bytes of the pre-shuffled weight (coalesced 1 KiB/wave);
  - scales: one dword per 32 columns per 256-wide K iteration.
The MFMA operand of lane (kl, l16) for its k-chunk: A and B use the same k order, so any order
of the 32 values inside the chunk works as long as both follow it.
  - gfx950: v_cvt_scalef32_pk_bf16_fp4 converts 2 FP4 to BF16 with the scale applied (exactly,
    in range), feeding v_mfma_f32_16x16x32_bf16 (4 per 128-wide step and 16x16 block).
  - gfx942: software unpack by byte lookups (v_perm_b32) in tables built per scale, feeding
    v_mfma_f32_16x16x16_bf16 (8 per step and block); see _unpack_sw.

Pipeline. Each wave walks its K iterations last first, two 128-wide steps each: the loads of a
step (B, scales, and A for one-row-block tiles) are issued before the previous step computes;
larger tiles (registers for two workgroups per CU) load a step's A just before issuing the
next step's loads, so the one vmcnt wait per step still leaves those in flight. The loop
carries the iteration's scalar offsets. The global last iteration, the only one that can reach
past inter_dim, comes first and is peeled (masked, its first MFMAs start from a constant 0);
the final iteration prefetches nothing. When every K worker walks the same number of
iterations (inter_dim's iterations a multiple of k_batch * wk), that number is a compile-time
constant: 1 or 2 iterations (split K at small token counts) compile to straight-line code.
Within a step, block nb + 1 is unpacked before block nb's MFMAs, so no MFMA waits on a fresh
conversion; scheduling barriers pin that order.

Which m-tiles work. Without a host synchronisation the grid is sized by an upper bound on the
m-tiles that can hold a routing pair (from T, topk, experts: at most T * topk, and at most
T * topk / tile_m + min(E, T * topk)); when that bound is below the number of m-tiles in the
sorted arrays, m-slot s scans the sorted ids (64 tiles per wave step: ballot + popcount; the
first step straight-line, a loop only past 64 tiles in use) for the s-th m-tile whose first row
holds a pair (pairs come first in every block, so such a tile is exactly one with work).
Otherwise m-slot s is m-tile s. Either way a workgroup without work (no such tile, a tile past
num_valid_ids[0], or a tile of padding rows) exits before any weight or activation load: after a
few scalar loads and compares (20 to 26 wave-instructions), plus its scan when compact (a vector
load, ballots and popcounts per 64 tiles); num_valid_ids is read on the device (a negative count
is 0 rows, a count past R is R).

Untrusted routing values (defined behaviour, never a read outside a tensor): a block whose expert
id is outside [0, E) is dropped (its workgroups exit before building a weight buffer); a row whose
slot is not below topk is dropped like a padding row (no a2 read, no output).

Output. The MFMAs compute out^T blocks (weights as the A operand), so after the K loop lane
(kl, l16) holds token row l16 and the four consecutive columns 4 kl .. 4 kl + 3 of every 16x16
block. The waves of K group 0 add the bias (once per contribution: only the k-split 0
workgroup adds it; packed adds, _a16w4_common.bias_blocks), multiply by the routing weight and
atomically add into out: fp32 by
buffer_atomic_add_f32 per element, bf16 by buffer_atomic_pk_add_bf16 per column pair (gfx942,
which has no buffer form: global_atomic_pk_add_bf16 at a 64-bit address), straight from
registers. Rows of padding (token id >= T) and columns >= model_dim are never written.

Memory safety. Every vector load goes through a buffer resource sized to its tensor (a2: its bytes;
each expert's weights up to model_dim's last 16-row block, its scales; the sorted arrays; the bias
row of model_dim elements), with the VGPR and instruction offsets covering every per-lane and
per-block part; only the K iteration sits in the scalar offset (which the range check may or may not
include: flyquant.emu.isa_mem's two readings), and it stays below the tensor's K by construction.
The three scalar loads (num_valid_ids, a tile's first id and its expert id) index below
min(num_valid_ids[0], R) by construction. The output atomics go through a buffer sized to out's rows
too (gfx942 bf16: global atomics), only for live rows (token in range, slot below topk) and
16-column blocks below model_dim. A buffer addresses < 2^32 bytes, and A's (a2, or stage 1's x) and
out's must end below OOB (2 GiB - 16, so that masked lanes read 0): larger ones are computed in
token windows (token_windows: one launch each, A's and out's base moved to the window on the host in
64 bits, tokens outside the window skipped), so sizes have no limit but the 2^24 tokens of the
sorted ids.

Constraints (checked by the launcher): inter_dim and model_dim are the true sizes, multiples of
32 and 16; the weights' K (padded inter_dim) a multiple of 256 and N (padded model_dim) of 32
(stage 1: 64, gate and up halves of 32-row scale groups); block_m a positive multiple of tile_m;
k_batch * wk <= ceil(inter_dim / 256); one expert's weights below 1 GiB; at most 2^30 - 1 sorted
rows; out 4-byte aligned (bf16 pairs; stage 1's a2 has no atomics: any even byte) and disjoint
from every input. Not detectable: weights that were not shuffled (shuffle_weight_a16w4) give
wrong values. Weight bytes beyond the true inter_dim are never read as data (masked in the last K
step); columns beyond model_dim are not loaded. Both arches' unpacks are exact for every E8M0
code, 0 (2^-127: subnormal BF16 weights) to 254 (products past BF16's range inf), 255 NaN.
"""

from __future__ import annotations

import torch

import flydsl.compiler as flyc
import flydsl.expr as fx
from flydsl._mlir import ir
from flydsl._mlir.dialects import llvm
from flydsl.expr import const_expr, gpu, range_constexpr, rocdl
from flydsl.expr.typing import T
from flydsl.expr.typing import Vector as Vec

from flyquant import toolchain
from flyquant.arch import arch_info

from . import _mx_common as mx
from ._a16w4_common import (
    A_BYTES_PER_LANE, K_CHUNK, K_STEP, KT, MFMA_MN, OOB, S_TILE_BYTES, TOKEN_BITS, TOKEN_MASK, W_PAST_END,
    W_TILE_BYTES, WAVE, Gemm2Config, _a_operands_sw, _ballot, _lanes_below, _load, _rsrc,
    _scalar_load, _scale_f32, _sw_tables, _udiv, _unpack_hw, _unpack_sw, _vec_i32, _zext, bias_blocks, wave_fits,
)
from ._a16w4_stage1_epilogue import bias_cols, stage1_epilogue

# ---- kernel builder ----------------------------------------------------------------------------


def build_moe_gemm2_a16w4(cfg: Gemm2Config):
    """A fresh @flyc.jit launcher for `cfg` (uncached: compile_only needs a fresh one)."""
    info = arch_info(cfg.arch)
    hw_unpack, hw_bf16 = info.hw_fp4_to_bf16, info.hw_f32_to_bf16
    WN, WK = cfg.wn, cfg.wk
    STAGE1 = cfg.stage == 1  # A rows x[token], activation epilogue (STAGE1_DOC)
    # the config as scalar closure values: FlyDSL's compile cache keys on those, not on cfg (a field read
    # through cfg in the kernel would share one binary between configs: tests/test_kernel_cache_keys.py)
    ACT, ALPHA, LIMIT, APPLY_W, W_N = cfg.activation, cfg.alpha, cfg.limit, cfg.apply_weights, cfg.w_n
    TILE_M, TILE_N = cfg.tile_m, cfg.tile_n
    WAVE_N = TILE_N // WN
    MB = TILE_M // MFMA_MN  # 16-row blocks per tile
    NB = WAVE_N // MFMA_MN  # 16-column blocks per wave
    NP = max(1, NB // 2)  # 32-column scale groups per wave
    N_KT = cfg.n_kt
    K_SPLIT = cfg.k_batch * WK  # K workers per output tile
    TOPK, BLOCK_M = cfg.topk, cfg.block_m
    N_TILES, K_BATCH, THREADS = cfg.n_tiles, cfg.k_batch, cfg.waves * WAVE
    MODEL_DIM, INTER_DIM = cfg.model_dim, cfg.inter_dim
    A_ROW_BYTES = cfg.a_stride * 2
    NBLK_BYTES = cfg.w_k // K_STEP * W_TILE_BYTES  # one 16-row block of N, all of K
    NPAIR_BYTES = cfg.w_k // KT * S_TILE_BYTES  # one 32-row scale group, all of K
    EXPERT_W_BYTES = cfg.w_n * cfg.w_k // 2
    EXPERT_S_BYTES = cfg.w_n * cfg.w_k // K_CHUNK
    HAS_BIAS = cfg.bias_dtype is not None
    WINDOWED = cfg.windowed
    BIAS_BYTES = 0 if not HAS_BIAS else (2 if cfg.bias_dtype == torch.bfloat16 else 4)
    OUT_F32 = cfg.out_dtype == torch.float32
    OUT_ELEM = 4 if OUT_F32 else 2
    # out through a buffer sized to it (range-checked atomics), but for bf16 on an arch without
    # buffer_atomic_pk_add_bf16 (gfx942): global atomics at a 64-bit address
    BUFFER_OUT = OUT_F32 or info.buffer_pk_add_bf16
    TAIL = INTER_DIM % KT != 0  # the last K iteration is partly past inter_dim
    N_TAIL = MODEL_DIM % TILE_N != 0  # the last n-tile is partly past model_dim
    LDS_BYTES = cfg.reduce_lds_bytes  # the wk reduction's
    SPARSE_BYTES = cfg.sparse_lds_bytes  # stage 1's sparse epilogue (kernels/_a16w4_stage1_epilogue.py)
    OUT_ROW_BYTES = cfg.out_stride * 2  # stage 1: a2's row pitch
    LOG_WAVE, LOG_MFMA = WAVE.bit_length() - 1, MFMA_MN.bit_length() - 1
    LOG_TILE_M, LOG_WN = TILE_M.bit_length() - 1, WN.bit_length() - 1
    # Larger tiles load a step's A just before the next step's prefetch (not a step ahead with B):
    # registers for 2 WGs/CU, and the step's one wait still leaves the prefetch in flight.
    PREFETCH_A = MB == 1
    LOADS_SUB1 = NB + (4 * MB if PREFETCH_A else 0)  # vector loads of a step's prefetch group
    LOADS_SUB0 = LOADS_SUB1 + NP  # ... plus the scale dwords with step 0
    UNIFORM_ITERS = cfg.n_kt % (cfg.k_batch * WK) == 0  # every K worker walks the same number of iterations
    if K_SPLIT > N_KT or not wave_fits(TILE_M, TILE_N, WN, WK, STAGE1) or (STAGE1 and cfg.k_batch != 1):
        raise ValueError(f"{cfg}: no valid wave split (k_batch * wk must be <= {N_KT} K steps of {KT})")

    def mfma(acc, a_words, b_words):
        """acc += the 16x16 block of out^T: the weights go in as the MFMA's A operand (rows = output
        columns) and the activations as B (columns = token rows), so lane (kl, l16) ends up with
        token row l16 and four consecutive output columns 4 kl .. 4 kl + 3: the epilogue adds
        column pairs straight from registers, with no exchange between lanes."""
        if const_expr(hw_unpack):
            return rocdl.mfma_f32_16x16x32_bf16(T.vec(4, T.f32), [_vec_i32(b_words).bitcast(fx.BFloat16), _vec_i32(a_words).bitcast(fx.BFloat16), acc])
        a16 = _vec_i32(a_words).bitcast(fx.Int16)
        b16 = _vec_i32(b_words).bitcast(fx.Int16)
        return rocdl.mfma_f32_16x16x16bf16_1k(T.vec(4, T.f32), [b16, a16, acc])

    @flyc.kernel(name=cfg.name, known_block_size=[THREADS, 1, 1])
    def gemm2_kernel(
        a2: fx.Int64,  # (T * topk, a_stride) bf16, row t * topk + slot
        a2_bytes: fx.Int64,  # the bytes a2's elements span (< 2^32)
        w2: fx.Int64,  # (E, w_n, w_k / 2) FP4, shuffle_weight_a16w4
        w2_scale: fx.Int64,  # (E * w_n, w_k / 32) E8M0, shuffle_scale_a16w4
        sorted_ids: fx.Int64,  # (R,) int32 (slot << 24) | token
        sorted_weights: fx.Int64,  # (R,) f32
        sorted_expert_ids: fx.Int64,  # (R / block_m,) int32
        num_valid_ids: fx.Int64,  # (2,) int32: [rows in use, T]
        out: fx.Int64,  # (T, model_dim) bf16/f32
        out_bytes: fx.Int64,  # the bytes of out's rows of this launch (< 2^31)
        bias: fx.Int64,  # (E, bias_stride) or unused; bias_stride >= model_dim
        bias_stride: fx.Int32,
        tokens: fx.Int32,  # T (windowed: the tokens of this launch's window)
        n_rows: fx.Int32,  # R
        n_experts: fx.Int32,  # E: blocks of another expert id are dropped
        compact: fx.Int32,  # 1: m-slot s = the s-th tile with work (scan); 0: m-tile s
        tok_base: fx.Int32,  # windowed: the window's first token (a2, out start at its rows)
        tokens_all: fx.Int32,  # windowed: T
    ):
        tid = fx.Int32(gpu.thread_id("x"))
        lane = tid & (WAVE - 1)
        t_all = tokens_all if const_expr(WINDOWED) else tokens  # which tiles have work at all
        wave = fx.Int32(rocdl.readfirstlane(T.i32, tid.shrui(fx.Int32(LOG_WAVE)).ir_value()))
        m_slot = fx.Int32(gpu.block_id("x"))
        n_tile = fx.Int32(gpu.block_id("y"))
        k_split = fx.Int32(gpu.block_id("z"))

        ids_bytes = _zext(n_rows << 2)
        ids_rsrc = _rsrc(sorted_ids, ids_bytes)
        # clamped to [0, R]: a negative count means no rows (as in the reference)
        rows_used = fx.max(fx.min(_scalar_load(num_valid_ids), n_rows), fx.Int32(0))
        n_used = rows_used.shrui(fx.Int32(LOG_TILE_M))  # m-tiles in use (block_m is a multiple of tile_m)

        # ---- which m-tile: direct, or the m_slot-th tile with work -------------------------
        def scan_chunk(base, target, found):
            """Tiles base .. base + 63: (target - their tiles with work, found or the tile index
            when the target-th tile with work is among them)."""
            idx = base + lane
            first = _load(ids_rsrc, idx << (LOG_TILE_M + 2), 0, 1)  # OOB past R reads 0
            # ballots of single compares, and-ed as scalars: a ballot of an and costs a select
            # and a compare per lane
            mask = _ballot(idx < n_used) & _ballot((first & TOKEN_MASK) < t_all)
            hit = mask & _ballot(_lanes_below(mask) == target)
            count = fx.Int32(fx.math.ctpop(mask))
            first_hit = fx.Int32(llvm.intr_cttz(hit.ir_value(), True))  # used only when hit != 0
            return target - count, (hit != 0).select(base + first_hit, found)

        tile = m_slot
        if compact != 0:
            # the first 64 m-tiles straight-line (at small token counts they are all), a loop over
            # the others (a slot found among the first has a negative target there: no more hits)
            target, tile = scan_chunk(fx.Int32(0), m_slot, fx.Int32(-1))
            if n_used > WAVE:
                chunks = (n_used + (WAVE - 1)).shrui(fx.Int32(LOG_WAVE))
                for c_idx, state in range(1, chunks, 1, init=[target, tile]):
                    results = yield list(scan_chunk(fx.Int32(c_idx) << LOG_WAVE, *state))
                tile = results[1]
        # tile < n_used, unsigned: also false for "not found" (-1); idle slots exit here
        if fx.Uint32(tile) < fx.Uint32(n_used):
            row0 = tile << LOG_TILE_M
            tok0 = _scalar_load(sorted_ids + _zext(row0 << 2)) & TOKEN_MASK
            if tok0 < t_all:  # a tile of padding rows (CK-style empty-expert block) has no work
                expert = _scalar_load(sorted_expert_ids + _zext(_udiv(row0, BLOCK_M) << 2))
                # nor one of an expert id outside [0, E): dropped, nothing of w2 or its scales is read
                work = fx.Uint32(expert) < fx.Uint32(n_experts)
                if const_expr(WINDOWED):  # nor, in this launch, a tile without a token in the window
                    row_id = _load(ids_rsrc, (row0 + lane) << 2, 0, 1)  # lanes past the tile: masked below
                    in_window = fx.Uint32((row_id & TOKEN_MASK) - tok_base) < fx.Uint32(tokens)
                    work = work & (_ballot(in_window) & ((1 << TILE_M) - 1 if TILE_M < WAVE else -1) != 0)
                if work:
                    # the buffer ends at the first 16-row block past model_dim: loads of the padding
                    # rows read 0 without a per-block select (the range check leaves out the scalar
                    # offset, i.e. the K iteration: it sees the block's offset and the step's only)
                    w_rsrc = _rsrc(w2 + fx.Int64(expert) * EXPERT_W_BYTES, MODEL_DIM // MFMA_MN * NBLK_BYTES)
                    s_rsrc = _rsrc(w2_scale + fx.Int64(expert) * EXPERT_S_BYTES, EXPERT_S_BYTES)
                    a_rsrc = _rsrc(a2, a2_bytes)
                    wn_i = wave & (WN - 1)
                    wk_i = wave.shrui(fx.Int32(LOG_WN))
                    kl = lane.shrui(fx.Int32(LOG_MFMA))
                    l16 = lane & (MFMA_MN - 1)
                    col_wave = n_tile * TILE_N + wn_i * WAVE_N
                    blk_wave = col_wave.shrui(fx.Int32(LOG_MFMA))  # first 16-column block of the wave
                    worker = k_split * WK + wk_i
                    if const_expr(UNIFORM_ITERS):
                        n_iters = N_KT // K_SPLIT  # compile-time: no branch on it, a loop only when needed
                        kt_end = (worker + 1) * n_iters
                    else:
                        kt_end = _udiv((worker + 1) * N_KT, K_SPLIT)
                        n_iters = kt_end - _udiv(worker * N_KT, K_SPLIT)

                    # A: per 16-row block, this lane's row (l16) at its k-chunk (kl); padding rows OOB.
                    # A row whose slot is not below topk is dropped like padding (its token taken as T).
                    a_off = []
                    toks = []  # this lane's token per 16-row block (the epilogue's too)
                    rids = []  # ... and its sorted id (stage 1's epilogue takes the slot from it)
                    live = []  # ... and whether its row holds a pair (token < T, slot < topk)
                    for mb in range_constexpr(MB):
                        rid = _load(ids_rsrc, (row0 + mb * MFMA_MN + l16) << 2, 0, 1)
                        tok = rid & TOKEN_MASK
                        if const_expr(WINDOWED):  # relative to the window (a2 and out start there)
                            tok = tok - tok_base
                            live.append((fx.Uint32(tok) < fx.Uint32(tokens)) & (fx.Uint32(rid) < fx.Uint32(TOPK << TOKEN_BITS)))
                        else:
                            live.append((tok < tokens) & (fx.Uint32(rid) < fx.Uint32(TOPK << TOKEN_BITS)))
                        toks.append(tok)
                        rids.append(rid)
                        if const_expr(STAGE1):  # the token's x row
                            a_row = tok
                        else:
                            a_row = tok * TOPK + rid.shrui(fx.Int32(TOKEN_BITS))
                        a_off.append(live[mb].select(a_row * A_ROW_BYTES + kl * A_BYTES_PER_LANE, OOB))
                    # B: per 16-column block; blocks past model_dim are past w_rsrc's end (read as 0).
                    b_off = [(blk_wave + nb) * NBLK_BYTES + lane * 16 for nb in range_constexpr(NB)]
                    s_off = [(blk_wave.shrui(fx.Int32(1)) + p) * NPAIR_BYTES + lane * 4 for p in range_constexpr(NP)]
                    # A wave of one 16-column block may start at the odd half of a 32-row scale group:
                    # shift its scale dwords so that byte 2 * step is always its own.
                    half_shift = (blk_wave & 1) << 3

                    def chunk_ok(kt, sub):
                        """This lane's 32-wide k-chunk of step `sub` of iteration kt lies below inter_dim."""
                        return kt * KT + sub * K_STEP + kl * K_CHUNK < INTER_DIM

                    # Per-lane offsets stay fixed: the iteration's offset is wave-uniform (the scalar
                    # offset), the step and 16-byte piece offsets are constants (the instruction's
                    # immediate offset), so loads need no per-iteration VALU address math.
                    ITER_BYTES = (2 * W_TILE_BYTES, S_TILE_BYTES, KT * 2)  # weights, scales, a2 per iteration

                    def at_iter(kt):
                        """Iteration kt: (kt, its scalar byte offsets in the weights, scales and a2)."""
                        return (kt,) + tuple(kt * b for b in ITER_BYTES)

                    def prev_iter(it):
                        """The iteration before `it`, by three adds (no kt: only unmasked ones use it)."""
                        return (None,) + tuple(o - b for o, b in zip(it[1:], ITER_BYTES))

                    def load_a(it, sub, masked):
                        voff = a_off
                        if const_expr(masked):
                            voff = [chunk_ok(it[0], sub).select(v, OOB) for v in voff]
                        return [[_load(a_rsrc, voff[mb] + (sub * (K_STEP * 2) + j * 16), it[3], 4) for j in range_constexpr(4)] for mb in range_constexpr(MB)]

                    def load_step(it, sub, masked):
                        """Issue the prefetched loads of one 128-wide K step of iteration `it`: the B
                        chunks, with sub 0 the iteration's scale dwords, and A when PREFETCH_A. `masked`:
                        chunks at k >= inter_dim read as 0 (offset past the buffer end), scales as 0."""
                        kt = it[0]
                        voff = b_off
                        if const_expr(masked):
                            past = chunk_ok(kt, sub).select(fx.Int32(0), fx.Int32(W_PAST_END))
                            voff = [v | past for v in voff]
                        b = [_load(w_rsrc, voff[nb] + sub * W_TILE_BYTES, it[1], 4) for nb in range_constexpr(NB)]
                        sc = []
                        if const_expr(sub == 0):
                            sc = [_load(s_rsrc, s_off[p], it[2], 1) for p in range_constexpr(NP)]
                            if const_expr(masked):
                                keep = chunk_ok(kt, 0).select(fx.Int32(0xFFFF), fx.Int32(0)) | chunk_ok(kt, 1).select(fx.Int32(mx.i32_bits(0xFFFF0000)), fx.Int32(0))
                                sc = [v & keep for v in sc]
                            if const_expr(NB == 1):
                                sc = [v.shrui(half_shift) for v in sc]
                        a = load_a(it, sub, masked) if const_expr(PREFETCH_A) else []
                        return a, b, sc

                    def step_a(it, sub, masked, a):
                        """A of a step: prefetched with its B, or (larger tiles) loaded now."""
                        return a if const_expr(PREFETCH_A) else load_a(it, sub, masked)

                    def scale_operands(sc):
                        """Per step of an iteration, what its blocks' unpack needs from the scale dwords:
                        gfx950: the NB scale operands, all computed as soon as the dwords arrive (they are
                        then dead, so the next iteration's scale loads reuse their registers, and no
                        conversion reads a scale just written: no hazard wait states); gfx942: the dwords
                        themselves (each block's 4 table registers are built at use)."""
                        if const_expr(hw_unpack):
                            return [[_scale_f32(sc[nb // 2], 2 * sub + nb % 2) for nb in range_constexpr(NB)] for sub in range_constexpr(2)]
                        return [sc, sc]

                    def unpack_block(b, ops, sub, nb, tables):
                        """The BF16 B operands of 16-column block nb for the 4 MFMA k-slices of step sub.
                        gfx942: blocks 2i and 2i + 1 take bytes 2 sub and 2 sub + 1 of scale dword i, their
                        tables built together at block 2i (`tables`: the step's, by block)."""
                        if const_expr(hw_unpack):
                            return [_unpack_hw(b[nb][j], ops[nb]) for j in range_constexpr(4)]
                        if const_expr(nb % 2 == 0):
                            tables[nb:nb + 2] = _sw_tables(ops[nb // 2], 2 * sub)[:NB - nb]
                        return [_unpack_sw(b[nb][j], tables[nb]) for j in range_constexpr(4)]

                    def compute_step(a, b, ops, sub, accs):
                        """Unpack the B chunks of one K step and issue its MFMAs into accs (ops: the step's
                        scale_operands). Instruction order, pinned by scheduling barriers: unpack block
                        0; then unpack block nb + 1 before the MFMAs of block nb, so an MFMA never reads a
                        conversion just issued (no hazard wait states) and at most two blocks of BF16 are
                        live. Each accumulator's MFMAs of a block run back to back (a chain on one
                        accumulator needs no wait states; alternating two chains made the register
                        allocator swap them through a temporary, with hazard nops)."""
                        accs = list(accs)
                        if const_expr(not hw_unpack):
                            a_ops = [[_a_operands_sw([a[mb][j][q] for q in range_constexpr(4)]) for j in range_constexpr(4)] for mb in range_constexpr(MB)]
                        tables = [None] * NB
                        words = unpack_block(b, ops, sub, 0, tables)
                        for nb in range_constexpr(NB):
                            rocdl.sched_barrier(0)
                            nxt = unpack_block(b, ops, sub, nb + 1, tables) if const_expr(nb + 1 < NB) else None
                            rocdl.sched_barrier(0)
                            for mb in range_constexpr(MB):
                                for j in range_constexpr(4):
                                    i = mb * NB + nb
                                    if const_expr(hw_unpack):
                                        accs[i] = mfma(accs[i], [a[mb][j][q] for q in range_constexpr(4)], words[j])
                                    else:
                                        even, odd = a_ops[mb][j]
                                        accs[i] = mfma(accs[i], even, words[j][0:2])
                                        accs[i] = mfma(accs[i], odd, words[j][2:4])
                            words = nxt
                        return accs

                    def flat(a, b, sc):
                        return [v.ir_value() for row in a for v in row] + [v.ir_value() for v in b] + [v.ir_value() for v in sc]

                    def unflat(vals):
                        n_a = 4 * MB if PREFETCH_A else 0
                        a = [[Vec(vals[mb * 4 + j]) for j in range_constexpr(4)] for mb in range_constexpr(n_a // 4)]
                        b = [Vec(vals[n_a + nb]) for nb in range_constexpr(NB)]
                        sc = [fx.Int32(v) for v in vals[n_a + NB:]]
                        return a, b, sc

                    # Software pipeline over this worker's iterations, last one first: loads of one
                    # 128-wide step are in flight while the previous step computes. Only the global last
                    # iteration can reach past inter_dim, and it comes first here (peeled, masked when
                    # TAIL, its first MFMAs starting from a constant 0), so the other iterations never
                    # need masking; the final iteration prefetches nothing. Scheduling barriers keep
                    # the compiler from sinking the loads into the math.
                    n_acc = MB * NB
                    zero = Vec.filled(4, 0.0, fx.Float32).ir_value()
                    kt_first = kt_end - 1
                    it = at_iter(kt_first)
                    a0, b0, sc = load_step(it, 0, masked=TAIL)
                    # without a next iteration nothing reads the prefetch: poison, not a copy of live registers
                    pre = [mx.poison(v.type) for v in flat(a0, b0, sc)]
                    a0 = step_a(it, 0, TAIL, a0)
                    rocdl.sched_barrier(0)  # step 0's loads issue first: the wait below counts on it
                    a1, b1, _ = load_step(it, 1, masked=TAIL)
                    rocdl.s_waitcnt(vmcnt=LOADS_SUB1)
                    ops = scale_operands(sc)
                    rocdl.sched_barrier(0)
                    accs = compute_step(a0, b0, ops[0], 0, [zero] * n_acc)
                    rocdl.sched_barrier(0)
                    a1 = step_a(it, 1, TAIL, a1)
                    more = n_iters > 1
                    it = prev_iter(it)
                    # step 1 in each branch, after its own wait: past a join the compiler waits per use
                    if more:
                        pre = flat(*load_step(it, 0, masked=False))
                        rocdl.s_waitcnt(vmcnt=LOADS_SUB0)
                        rocdl.sched_barrier(0)
                        accs = compute_step(a1, b1, ops[1], 1, accs)
                    else:
                        rocdl.s_waitcnt(vmcnt=0)
                        accs = compute_step(a1, b1, ops[1], 1, accs)
                    rocdl.sched_barrier(0)
                    def iterate(cur, a0, b0, sc, accs, prefetch):
                        """One unmasked iteration `cur` from its prefetched step 0 (a0, b0, sc): its accs,
                        and with `prefetch` the next iteration and its step 0, issued while step 1
                        computes. One wait per step for everything issued before its successor's
                        prefetch group (in issue order, that group may stay in flight), not one per use."""
                        a0 = step_a(cur, 0, False, a0)
                        rocdl.sched_barrier(0)
                        a1, b1, _ = load_step(cur, 1, masked=False)
                        rocdl.s_waitcnt(vmcnt=LOADS_SUB1)
                        ops = scale_operands(sc)
                        rocdl.sched_barrier(0)
                        accs = compute_step(a0, b0, ops[0], 0, accs)
                        if const_expr(not prefetch):
                            a1 = step_a(cur, 1, False, a1)
                            rocdl.s_waitcnt(vmcnt=0)
                            return compute_step(a1, b1, ops[1], 1, accs), None, None
                        rocdl.sched_barrier(0)
                        a1 = step_a(cur, 1, False, a1)
                        rocdl.sched_barrier(0)  # in issue order before the prefetch group it waits behind
                        nxt = prev_iter(cur)
                        pre = load_step(nxt, 0, masked=False)
                        rocdl.s_waitcnt(vmcnt=LOADS_SUB0)
                        rocdl.sched_barrier(0)
                        accs = compute_step(a1, b1, ops[1], 1, accs)
                        rocdl.sched_barrier(0)
                        return accs, pre, nxt

                    if more:
                        # the loop carries the iteration's scalar offsets (three adds per iteration)
                        for i, state in range(0, n_iters - 2, 1, init=accs + pre + [v.ir_value() for v in it[1:]]):
                            cur = (None,) + tuple(fx.Int32(v) for v in state[-3:])
                            accs, pre_next, nxt = iterate(cur, *unflat(list(state[n_acc:-3])), list(state[:n_acc]), True)
                            results = yield accs + flat(*pre_next) + [v.ir_value() for v in nxt[1:]]
                        last = (None,) + tuple(fx.Int32(v) for v in results[-3:])
                        accs, _, _ = iterate(last, *unflat(list(results[n_acc:-3])), list(results[:n_acc]), False)

                    # ---- reduce the wk partial sums in LDS ---------------------------------------
                    if const_expr(LDS_BYTES + SPARSE_BYTES > 0):  # one allocation: the reduction's, then the sparse epilogue's
                        lds = fx.SharedAllocator().allocate(LDS_BYTES + SPARSE_BYTES, alignment=16)
                        lds_base = fx.Int32(fx.ptrtoint(lds.peek().ptr))
                    if const_expr(WK > 1):
                        p3 = ir.Type.parse("!llvm.ptr<3>")

                        def lds_ptr(group, i):
                            # a constant GEP per block off one base: the offset folds into ds_read/ds_write
                            base = llvm.inttoptr(p3, (lds_base + ((group * WN + wn_i) * (MB * NB * WAVE) + lane) * 16).ir_value())
                            return llvm.GEPOp(p3, base, [], [i * WAVE * 16], T.i8, None).result

                        if wk_i > 0:
                            for i in range_constexpr(MB * NB):
                                llvm.StoreOp(accs[i], lds_ptr(wk_i - 1, i), alignment=16)
                        gpu.barrier()
                        if wk_i == 0:
                            for g in range_constexpr(WK - 1):
                                for i in range_constexpr(MB * NB):
                                    part = llvm.load(T.vec(4, T.f32), lds_ptr(g, i), alignment=16)
                                    accs[i] = (Vec(accs[i]) + Vec(part)).ir_value()

                    # ---- epilogue: bias, routing weight, atomic add into out ---------------------
                    # Lane (kl, l16) holds token row l16 of each 16-row block and columns 4 kl .. 4 kl + 3
                    # of each 16-column block (see mfma): one row predicate per block row covers all the
                    # wave's atomics, and a 16-column block is wholly inside or outside model_dim.
                    def with_bias(accs):
                        """accs + the bias (packed adds); only k-split 0 adds it (the others get an
                        empty buffer: loads read 0)."""
                        if const_expr(not HAS_BIAS):
                            return accs
                        bias_v = bias_blocks(bias, bias_stride, expert, k_split == 0, col_wave, kl, NB, STAGE1,
                                             W_N if STAGE1 else MODEL_DIM, BIAS_BYTES)
                        return [(Vec(a) + Vec(bias_v[i % NB])).ir_value() for i, a in enumerate(accs)]

                    if const_expr(STAGE1):
                        wave_lds = lds_base + (LDS_BYTES + wn_i * (SPARSE_BYTES // WN)) if const_expr(SPARSE_BYTES) else None
                        b_cols = bias_cols(bias, bias_stride, expert, col_wave, W_N, BIAS_BYTES) if const_expr(HAS_BIAS) else None
                        if wk_i == 0:
                            stage1_epilogue(accs, with_bias, toks, rids, live, lane, col_wave, kl, l16, wave_lds, sorted_weights,
                                            row0, ids_bytes, out, out_bytes, b_cols, MB, NB, TOPK, MODEL_DIM, N_TAIL,
                                            OUT_ROW_BYTES, APPLY_W, ACT, ALPHA, LIMIT, hw_bf16, info.ieee_minmax_f32)
                    else:
                        if wk_i == 0:
                            accs = with_bias(accs)
                            lane_col = col_wave + kl * 4
                            if const_expr(APPLY_W):
                                w_rsrc_rows = _rsrc(sorted_weights, ids_bytes)
                            p1 = ir.Type.parse("!llvm.ptr<1>")
                            if const_expr(BUFFER_OUT):
                                out_rsrc = _rsrc(out, out_bytes)
                            for mb in range_constexpr(MB):
                                tok = toks[mb]
                                if const_expr(APPLY_W):
                                    wt = _load(w_rsrc_rows, (row0 + mb * MFMA_MN + l16) << 2, 0, 1).bitcast(fx.Float32)
                                vals = []  # vals[nb][i]: column 4 kl + i of block nb
                                for nb in range_constexpr(NB):
                                    acc = Vec(accs[mb * NB + nb])
                                    v = [fx.Float32(acc[i]) for i in range_constexpr(4)]
                                    if const_expr(APPLY_W):
                                        v = [x * wt for x in v]
                                    vals.append(v)
                                if live[mb]:
                                    if const_expr(BUFFER_OUT):  # a launch's out rows fit its buffer (< 2^31 bytes)
                                        row_off = tok * (MODEL_DIM * OUT_ELEM) + lane_col * OUT_ELEM
                                    else:  # 64-bit: T * model_dim may pass 2^31 elements
                                        row_addr = out + (_zext(tok) * MODEL_DIM + _zext(lane_col)) * OUT_ELEM
                                    for nb in range_constexpr(NB):

                                        def add_block(nb=nb):
                                            """out[tok, block nb's 4 columns] += vals[nb] (agent scope): fp32 one
                                            element per atomic, bf16 a column pair per atomic."""
                                            if const_expr(OUT_F32):
                                                parts = [(i, vals[nb][i]) for i in range_constexpr(4)]
                                            else:
                                                parts = [(2 * h, Vec.from_elements(vals[nb][2 * h : 2 * h + 2], fx.Float32).to(fx.BFloat16))
                                                         for h in range_constexpr(2)]
                                            for i, value in parts:
                                                if const_expr(BUFFER_OUT):  # the column's offset in the instruction's
                                                    rocdl.raw_ptr_buffer_atomic_fadd(value, out_rsrc, row_off + (nb * MFMA_MN + i) * OUT_ELEM,
                                                                                     fx.Int32(0), 0)
                                                else:
                                                    addr = row_addr + fx.Int64((nb * MFMA_MN + i) * OUT_ELEM)
                                                    fx.atomic_add(llvm.inttoptr(p1, addr.ir_value()), value, syncscope=rocdl.SyncScope.Agent)

                                        if const_expr(N_TAIL):
                                            if col_wave + nb * MFMA_MN < MODEL_DIM:  # wave-uniform
                                                add_block()
                                        else:
                                            add_block()

    @flyc.jit
    def launch(
        a2: fx.Int64,
        a2_bytes: fx.Int64,
        w2: fx.Int64,
        w2_scale: fx.Int64,
        sorted_ids: fx.Int64,
        sorted_weights: fx.Int64,
        sorted_expert_ids: fx.Int64,
        num_valid_ids: fx.Int64,
        out: fx.Int64,
        out_bytes: fx.Int64,
        bias: fx.Int64,
        bias_stride: fx.Int32,
        tokens: fx.Int32,
        n_rows: fx.Int32,
        n_experts: fx.Int32,
        grid_m: fx.Int32,
        compact: fx.Int32,
        tok_base: fx.Int32,
        tokens_all: fx.Int32,
        stream: fx.Stream = fx.Stream(None),
    ):
        gemm2_kernel(
            a2, a2_bytes, w2, w2_scale, sorted_ids, sorted_weights, sorted_expert_ids, num_valid_ids,
            out, out_bytes, bias, bias_stride, tokens, n_rows, n_experts, compact, tok_base, tokens_all,
        ).launch(grid=(grid_m, N_TILES, K_BATCH), block=(THREADS, 1, 1), stream=stream)

    return launch


@toolchain.launcher_cache
def _cached_launcher(cfg: Gemm2Config):
    return build_moe_gemm2_a16w4(cfg)
