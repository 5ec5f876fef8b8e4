"""The MXFP8 grouped GEMMs' FlyDSL kernel (mxfp8_grouped_mm.py: the math, the work split, the
configuration and the launchers).

MFMA orientation. The weights go in as the MFMA's A operand and the tokens as B, so lane (c, r)
(c = lane / 16, r = lane % 16) ends up holding token row r of its block and the four consecutive
output columns 4c .. 4c + 3: each lane stores 8 (bf16) or 16 (fp32) contiguous bytes.
- gfx950: v_mfma_scale_f32_16x16x128_f8f6f4 per 128-wide K step: lane (c, r) supplies the 16
  bytes of its row at k = 128 s + 16 c and the 16 at 128 s + 64 + 16 c (the instruction's 8-bit
  operand layout, CK's mx_mfma_op test) and the E8M0 scale of block c (k = 128 s + 32 c), which
  the hardware applies to that block wherever its bytes sit. Scales are loaded into registers.
  Row-major: one byte load per row block and step. In aiter's e8m0_shuffle layout ("mfma", what
  the quantize ops write with scale_layout="mfma"): one dword per lane per pair of row blocks
  (rows r, r + 16) and pair of steps, the byte picked by the MFMA's op_sel, so the main loop
  walks step pairs. The operands come one of two ways (GroupedMMConfig.lds_stage; the selector
  stages on the 192x256 tile with "mfma" scales, select_grouped_mm.grouped_mm_lds_stage):
  - direct: each wave loads its own row blocks, two 16-byte loads per block and step (a row's 4
    lanes read 64 contiguous bytes per instruction: half of each 128-byte line it touches; the
    second's +64 in the vector offset, or on the wide tiles with row-major scales (more than 8
    row blocks per wave), where a VGPR per block would spill, in the scalar offset). Software
    pipeline: a step's loads (scales first) are issued before the previous step's MFMAs, one
    wait per step.
  - staged in LDS: a step's tile rows (A's tile_m, then B's tile_n, 128 bytes each) go to one of
    two LDS stages by direct-to-LDS loads (buffer_load_dwordx4 ... lds, no VGPRs). A load moves
    8 whole rows (lane l: row l / 8, 16-byte chunk (l % 8) ^ (l / 8), landing at slot l % 8 of
    its row: the same chunk of 8 consecutive rows sits in 8 different slots, so the 8 lanes that
    read it hit different LDS banks; flyquant.emu does not model bank conflicts), so every load
    uses whole 128-byte lines, and each row is read from memory once per workgroup instead of
    once per wave that uses it. Wave w stages tile_m / (8 waves) A groups and tile_n / (8 waves)
    B groups; four consecutive groups share one LDS address (M0), 1024 bytes apart through the
    instruction's offset field, which moves the global address too: their vector offsets take it
    back, and A's and B's buffers start DMA_SHIFT bytes before the tensors so that those offsets
    stay non-negative. Lane (c, r) reads its two 16 bytes with ds_read_b128. Software pipeline:
    while step s's MFMAs run, step s + 1's operands are read from the other stage as step s's
    stop being used, step s + 1's scales are loaded and step s + 2's rows staged into step s's
    stage; one barrier per step. It costs about 0.5 wave-instructions per MFMA more than direct
    loads on the 192x256 tile (the fragment reads outnumber the loads saved).
- gfx942 (no MX MFMA; FP8 is the FNUZ format there): v_mfma_f32_16x16x32_fp8_fp8 per 32-wide
  scale block, lane (c, r) supplying bytes 8c .. 8c + 7 of the block (an 8-byte load). OCP E4M3
  codes read as FNUZ are worth exactly half (exponent bias 8 instead of 7), except -0 (0x80, NaN in
  FNUZ: rewritten to +0 in registers, three bit operations per dword in the forward, four in
  the weight gradient: mx.unsign_zeros) and NaN (0x7F/0xFF, +-240 in
  FNUZ: a wave-uniform check per step, and a rare branch that rewrites them to FNUZ's NaN). Each
  block's partial product starts from 0 and is added to the accumulator times sa * sb (packed
  FMAs); the final sum is multiplied by 4 (the two halvings). sa * sb is FP32: codes whose
  exponents sum past 127 make it inf (a finite result becomes inf, or NaN where the block's
  products cancel), below FP32's smallest value it is 0 (a tiny finite result becomes 0);
  gfx950 has no such product. The step's scales are converted to f32 once per workgroup into
  LDS ([row][block] for A: a lane reads its row's four at once; [block][column] for B: its four
  output columns at once).

Memory safety. Every access goes through a buffer resource sized to its tensor (a and a_scale: M
rows; b and b_scale: the group's expert; out: M rows), masked rows and K chunks at an offset past
every buffer's end (loads read 0, stores are dropped; gfx942's weight gradient re-reads its step's
first chunk for a chunk past the group, with both of that chunk's scales masked); only the K step
sits in the scalar offset (inside or outside the range check: flyquant.emu.isa_mem's two readings
agree on every access) and it stays below K (wgrad: the step's first row of M, the gfx942 block's
too, inside the group for every chunk; the pipeline reloads the last step rather than read past it).
Staged, gfx950's A and B buffers start DMA_SHIFT (3072) bytes before their tensors and end at the
tensors' ends: every lane that is not masked reads at or past the start (its vector offset plus the
offset field is its row's offset plus DMA_SHIFT), and a masked lane's offset, 2^32 - 8192
(DATA_OOB), is past the end of any buffer below 2 GiB + DMA_SHIFT with any field added (the usual
OOB, 2^31 - 16, plus a field of up to 3072 would land inside a tensor of nearly 2 GiB: a K tail's
masked chunk once read the tensor's last bytes there). The group loop indexes offs below E; any offs
values (unsorted, negative, past M) keep every access inside the tensors (rows are clamped to
[0, M)); with offs that are not non-decreasing, rows at or past offs[E - 1] are still written as 0,
but a workgroup's count of its groups (which assumes sorted ends) may miss a group holding some of
its rows: those rows are not written.
"""

from __future__ import annotations

import torch

import flydsl.compiler as flyc
import flydsl.expr as fx
from flydsl._mlir import ir
from flydsl._mlir.dialects import arith, llvm
from flydsl.expr import const_expr, gpu, range_constexpr, rocdl
from flydsl.expr.typing import T
from flydsl.expr.typing import Vector as Vec

from flyquant.arch import arch_info
from flyquant.formats import MX_BLOCK as BLOCK

from . import _mx_common as mx
from ._a16w4_common import MFMA_MN, OOB, WAVE, _ballot, _load, _rsrc, _scalar_load, _zext
from ._mxfp8_gfx942 import _cat, _e8m0_f32, _fnuz_operands, scaled_sums

K_STEP = 128  # K per main-loop step: one scaled MFMA (gfx950), four FP8 MFMAs (gfx942)
HALF_STEP = K_STEP // 2  # gfx950: a lane's second 16 bytes of a step (the scaled MFMA's 8-bit operand layout)


def _byte(rsrc, voffset, soffset):
    """buffer_load_ubyte: one zero-extended byte per lane."""
    v = rocdl.raw_ptr_buffer_load(T.i8, rsrc, fx.Int32(voffset).ir_value(), fx.Int32(soffset).ir_value(), 0)
    return fx.Int32(arith.extui(T.i32, v))


def build_grouped_mm(cfg):
    """A fresh @flyc.jit launcher for `cfg`."""
    info = arch_info(cfg.arch)
    SCALED = info.name == "gfx950"
    STAGED = SCALED and cfg.lds_stage
    N, K, E = cfg.n, cfg.k, cfg.experts
    KB = K // BLOCK  # scale bytes per row
    TILE_M, TILE_N = cfg.tile_m, cfg.tile_n
    WAVES = cfg.waves_m * cfg.waves_n
    WM, WN = TILE_M // cfg.waves_m, TILE_N // cfg.waves_n
    MB, NB = WM // MFMA_MN, WN // MFMA_MN
    N_STEPS = -(-K // K_STEP)
    TAIL_CHUNKS = (K % K_STEP) // BLOCK  # valid 32-wide chunks of a partial last step (0: none)
    FULL_STEPS = N_STEPS - (1 if TAIL_CHUNKS else 0)
    SCALE_MFMA = cfg.scale_layout == "mfma"
    PCOLS = -(-KB // 8) * 8  # "mfma" layout: scale columns padded to 8
    OUT_F32 = cfg.out_dtype == torch.float32
    WGRAD = cfg.wgrad
    SIGNED_ZEROS = cfg.signed_zeros  # a local: FlyDSL's cache keys the kernel on the values it closes over
    COLS = K if WGRAD else N  # output columns: the B operand's rows
    N_TAIL = COLS % TILE_N != 0  # the last n-tile has columns past COLS (masked)
    # the tile's A rows can be masked: the forward's (other groups, past M) or the wgrad's past N
    A_MASKED = not WGRAD or N % TILE_M != 0
    OUT_ELEM = 4 if OUT_F32 else 2
    if TILE_M % (cfg.waves_m * MFMA_MN) or TILE_N % (cfg.waves_n * MFMA_MN) or COLS % MFMA_MN or (K % BLOCK and not WGRAD):
        raise ValueError(f"{cfg}: tiles must split into 16x16 blocks per wave; the output's columns a multiple of 16, "
                         "the forward's K of 32")
    # gfx950 stages a step's rows in LDS, 8-row groups of 128 bytes, each wave the same number of A's and B's
    A_GROUPS, B_GROUPS = TILE_M // (8 * WAVES), TILE_N // (8 * WAVES)
    GROUP_BYTES = 8 * K_STEP
    A_BYTES = TILE_M * K_STEP
    STAGE = (TILE_M + TILE_N) * K_STEP
    DMA_RUN = 4  # loads sharing one LDS address: their offset fields (< 4096) 0, 1024, 2048, 3072 apart
    DMA_SHIFT = (DMA_RUN - 1) * GROUP_BYTES if STAGED else 0  # A's and B's buffers start this far before them
    # a masked lane's operand offset: past its buffer whatever offset field it carries. Staged, the buffers
    # reach 2 GiB + DMA_SHIFT, past OOB (2 GiB - 16) plus a field: 2^32 - 8192 (an i32's -8192), no field wraps it
    DATA_OOB = -8192 if STAGED else OOB
    if cfg.lds_stage and (not SCALED or WGRAD):
        raise ValueError(f"{cfg}: only gfx950's forward stages its operands in LDS")
    if STAGED and (TILE_M % (8 * WAVES) or TILE_N % (8 * WAVES) or 2 * STAGE > info.lds_bytes_per_cu):
        raise ValueError(f"{cfg}: gfx950 stages each step's tile rows in LDS in 8-row groups, as many per wave: tile_m "
                         f"and tile_n must be multiples of {8 * WAVES}, and two steps' rows fit {info.lds_bytes_per_cu} bytes")
    if WGRAD and SCALE_MFMA:
        raise ValueError(f"{cfg}: the weight-gradient GEMM reads row-major scales")
    if SCALE_MFMA and (MB % 2 or NB % 2):
        raise ValueError(f"{cfg}: \"mfma\" scales come a dword per pair of 16-row blocks: each wave's rows and "
                         "columns must be a multiple of 32")
    if not SCALED and (TILE_M * 4 % (WAVES * WAVE) or TILE_N * 4 % (WAVES * WAVE)):
        raise ValueError(f"{cfg}: gfx942 stages a step's 4 scales per tile row and column one per thread: tile_m and "
                         f"tile_n must be multiples of {WAVES * WAVE // 4}")
    if not SCALED and not WGRAD and 3 * KB + 3 >= 4096:
        raise ValueError(f"{cfg}: K = {K} too large for gfx942's scale offsets (immediate offsets < 4096)")

    @flyc.kernel(name=cfg.name, known_block_size=[WAVES * WAVE, 1, 1])
    def grouped_mm_kernel(
        a: fx.Int64,  # (M, K) e4m3fn
        a_scale: fx.Int64,  # (M, K / 32) e8m0
        b: fx.Int64,  # (E, N, K) e4m3fn
        b_scale: fx.Int64,  # (E, N, K / 32) e8m0
        offs: fx.Int64,  # (E,) int32
        out: fx.Int64,  # (M, N) bf16 / f32
        m_rows: fx.Int32,  # M
        bs_expert_bytes: fx.Int32,  # b_scale's bytes per expert
    ):
        tid = fx.Int32(gpu.thread_id("x"))
        lane = tid & (WAVE - 1)
        wave = fx.Int32(rocdl.readfirstlane(T.i32, tid.shrui(fx.Int32(6)).ir_value()))
        wm_i = wave % cfg.waves_m
        wn_i = wave // cfg.waves_m
        c = lane.shrui(fx.Int32(4))
        r = lane & (MFMA_MN - 1)
        row0 = fx.Int32(gpu.block_id("x")) * TILE_M
        col_wave = fx.Int32(gpu.block_id("y")) * TILE_N + wn_i * WN  # the wave's first column
        row_end = fx.min(row0 + TILE_M, fx.Int32(N) if const_expr(WGRAD) else m_rows)
        if const_expr(WGRAD):  # this workgroup's group: block z; its rows of M, clamped to [0, M]
            g_w = fx.Int32(gpu.block_id("z"))
            start = _scalar_load(offs + _zext(fx.max(g_w - 1, fx.Int32(0)) << 2))
            lo_w = fx.min(fx.max((g_w > 0).select(start, fx.Int32(0)), fx.Int32(0)), m_rows)
            hi_w = fx.min(fx.max(_scalar_load(offs + _zext(g_w << 2)), lo_w), m_rows)
            A_PITCH, AS_PITCH = m_rows, m_rows.shrui(fx.Int32(5))  # both operands: (rows, M) and (rows, M / 32)
            D_BASE, S_BASE = lo_w, lo_w.shrui(fx.Int32(5))  # the group's first step, in the scalar offsets
        else:
            A_PITCH, AS_PITCH, D_BASE, S_BASE = K, KB, 0, 0

        # ---- the groups overlapping [row0, row_end): one ballot per 64 groups --------------
        offs_rsrc = _rsrc(offs, E * 4)  # (forward only: the wgrad's group is its block z)
        g0 = fx.Int32(0)  # groups ending at or before row0
        g1 = fx.Int32(0)  # groups ending before row_end
        for j in range_constexpr(-(-E // WAVE)):
            end = _load(offs_rsrc, (lane + j * WAVE) << 2, 0, 1)
            live = (1 << min(WAVE, E - j * WAVE)) - 1
            live = -1 if live == (1 << 64) - 1 else live
            g0 = g0 + fx.Int32(fx.math.ctpop(_ballot(end <= row0) & live))
            g1 = g1 + fx.Int32(fx.math.ctpop(_ballot(end < row_end) & live))
        g1 = fx.min(g1 + 1, fx.Int32(E))  # ... and the group that contains row_end - 1

        if const_expr(WGRAD):  # a: y^T (N, M), out: the group's (N, K)
            a_rsrc = _rsrc(a, _zext(m_rows) * N, "a")
            as_rsrc = _rsrc(a_scale, _zext(AS_PITCH) * N, "a_scale")
            out_rsrc = _rsrc(out + _zext(g_w) * (N * K * OUT_ELEM), N * K * OUT_ELEM)
        else:
            a_rsrc = _rsrc(a - DMA_SHIFT, _zext(m_rows) * K + DMA_SHIFT, "a")
            if const_expr(SCALE_MFMA):  # rows padded to 256
                as_rsrc = _rsrc(a_scale, _zext((m_rows + 255) & ~255) * PCOLS, "a_scale")
            else:
                as_rsrc = _rsrc(a_scale, _zext(m_rows) * KB, "a_scale")
            out_rsrc = _rsrc(out, _zext(m_rows) * (N * OUT_ELEM))
        rows = [row0 + wm_i * WM + mb * MFMA_MN + r for mb in range_constexpr(MB)]
        cols = [col_wave + nb * MFMA_MN for nb in range_constexpr(NB)]  # each block's first column
        zero4 = Vec.filled(4, 0.0, fx.Float32).ir_value()
        col_tile = fx.Int32(gpu.block_id("y")) * TILE_N
        if const_expr(STAGED):  # two stages of a step's rows, A's then B's, 128 bytes each (the docstring)
            lds = fx.SharedAllocator().allocate(2 * STAGE, alignment=16)
        elif const_expr(not SCALED):  # a step's scales as f32
            lds = fx.SharedAllocator().allocate((TILE_M + TILE_N) * 4 * 4, alignment=16)
        if const_expr(STAGED or not SCALED):
            lds_base = fx.Int32(fx.ptrtoint(lds.peek().ptr))

        if const_expr(STAGED):  # (scaled_offsets, fragments)
            stage_row = lane.shrui(fx.Int32(3))
            stage_chunk = (lane & 7) ^ stage_row
            a_stage = _uniform(lds_base + wave * (A_GROUPS * GROUP_BYTES))  # the wave's first group in a stage
            b_stage = _uniform(lds_base + A_BYTES + wave * (B_GROUPS * GROUP_BYTES))
            frag_lo = (c ^ (r & 7)) << 4  # chunk c's slot in its row; chunk 4 + c's is slot ^ 4
            a_row0 = lds_base + (wm_i * WM + r) * K_STEP  # the lane's row of the wave's first row block
            b_row0 = lds_base + A_BYTES + (wn_i * WN + r) * K_STEP
            p3 = ir.Type.parse("!llvm.ptr<3>")
            a_lo, a_hi, b_lo, b_hi = (llvm.inttoptr(p3, (x + y).ir_value())
                                      for x in (a_row0, b_row0) for y in (frag_lo, frag_lo ^ 64))

        def store(accs, lo, hi, scale):
            """out[rows in [lo, hi), this lane's 4 columns of every block] = accs (* scale)."""
            for mb in range_constexpr(MB):
                base = rows[mb] * (COLS * OUT_ELEM) + c * (4 * OUT_ELEM)
                if const_expr(A_MASKED):
                    base = ((rows[mb] >= lo) & (rows[mb] < hi)).select(base, fx.Int32(OOB))
                for nb in range_constexpr(NB):
                    v = Vec(accs[mb * NB + nb])
                    if const_expr(scale != 1.0):
                        v = v * Vec.filled(4, scale, fx.Float32)
                    off = (cols[nb] < COLS).select(base, fx.Int32(OOB)) if const_expr(N_TAIL) else base
                    words = v.bitcast(fx.Int32) if const_expr(OUT_F32) else v.to(fx.BFloat16).bitcast(fx.Int32)
                    rocdl.raw_ptr_buffer_store(words.ir_value(), out_rsrc, off.ir_value(),
                                               fx.Int32(cols[nb] * OUT_ELEM).ir_value())

        def setup(g, lo, hi):
            """Buffers and per-lane offsets of the tile's rows of group g (rows [lo, hi)) times expert
            g's weights: masked rows (other groups, past hi) and columns (past N) get OOB."""
            if const_expr(WGRAD):  # b: x^T (K, M)
                b_rsrc = _rsrc(b, _zext(m_rows) * K, "b")
                bs_rsrc = _rsrc(b_scale, _zext(AS_PITCH) * K, "b_scale")
            else:
                b_rsrc = _rsrc(b + _zext(g) * (N * K) - DMA_SHIFT, N * K + DMA_SHIFT, "b")
                bs_rsrc = _rsrc(b_scale + _zext(g) * _zext(bs_expert_bytes), _zext(bs_expert_bytes), "b_scale")
            a_row = [in_group(x, lo, hi) for x in rows]
            b_row = [(cols[nb] < COLS).select(cols[nb] + r, fx.Int32(-1)) if const_expr(N_TAIL) else cols[nb] + r
                     for nb in range_constexpr(NB)]
            return b_rsrc, bs_rsrc, a_row, b_row

        def in_group(row, lo, hi):
            """An A row, or -1 where it is masked (outside [lo, hi): other groups, past M or N)."""
            return ((row >= lo) & (row < hi)).select(row, fx.Int32(-1)) if const_expr(A_MASKED) else row

        def off(row, pitch, extra, masked, oob=OOB):
            """row's offset, or `oob` where `masked` (compile-time: the row may be -1) and it is -1."""
            return (row >= 0).select(row * pitch + extra, fx.Int32(oob)) if const_expr(masked) else row * pitch + extra

        def scale_src(row, kb_lo):
            """Where scale (row, 4 s + kb_lo) of step s is: (per-lane byte offset, the step's scalar
            offset as a function of s). Plain: row-major bytes. "mfma": aiter's e8m0_shuffle, whose
            dword at (32-row tile, 8-block column tile, kb_lo, row % 16) holds byte
            2 ((kb / 4) % 2) + (row / 16) % 2: rows row, row + 16 of two consecutive steps."""
            if const_expr(SCALE_MFMA):  # the layout's fields of kb = 4 s + kb_lo separate: kb_lo per lane, s scalar
                def at(r, kb):
                    return fx.Int32(mx.scale_offset("mfma", r, kb, PCOLS // 8))

                return at(row, kb_lo), lambda s: at(fx.Int32(0), s << 2)
            return row * AS_PITCH + kb_lo, lambda s: s * (K_STEP // BLOCK) + S_BASE

        def scaled_offsets(a_row, b_row, lo, hi):
            """gfx950: where the lane's operand bytes of a step are, then where its block c's scales
            are (plain, one byte per row block; "mfma", one dword per pair of row blocks: rows r,
            r + 16). Staged: its 16 bytes of each 8-row group of A and B it stages (wave w stages
            A's groups w * A_GROUPS .. and B's w * B_GROUPS ..: lane / 8 the group's row, chunk
            (lane % 8) ^ (lane / 8) of it). Direct: its first 16 bytes of each of its row blocks'
            rows (16 c; the second 16 at + HALF_STEP). Rows of other groups and past N at
            DATA_OOB."""
            if const_expr(STAGED):
                a_rows = [row0 + (wave * A_GROUPS + i) * 8 + stage_row for i in range_constexpr(A_GROUPS)]
                b_rows = [col_tile + (wave * B_GROUPS + i) * 8 + stage_row for i in range_constexpr(B_GROUPS)]
                a_rows = [in_group(x, lo, hi) for x in a_rows]
                b_rows = [(x < COLS).select(x, fx.Int32(-1)) if const_expr(N_TAIL) else x for x in b_rows]
                # the offset field that moves a load's LDS address moves its global one too: taken back here
                at = [stage_chunk * 16 + (DMA_SHIFT - i % DMA_RUN * GROUP_BYTES) for i in range_constexpr(max(A_GROUPS, B_GROUPS))]
                data = [off(x, A_PITCH, at[i], A_MASKED, DATA_OOB) for i, x in enumerate(a_rows)], \
                       [off(x, A_PITCH, at[i], N_TAIL, DATA_OOB) for i, x in enumerate(b_rows)]
            else:
                data = [off(x, A_PITCH, c * 16, A_MASKED) for x in a_row], [off(x, A_PITCH, c * 16, N_TAIL) for x in b_row]
            if const_expr(SCALE_MFMA):  # rows of other groups and columns past N: harmless, never stored
                a_sc = [scale_src(rows[2 * p], c)[0] & ~3 for p in range_constexpr(MB // 2)]
                b_sc = [scale_src(cols[2 * q] + r, c)[0] & ~3 for q in range_constexpr(NB // 2)]
            else:
                a_sc = [off(x, AS_PITCH, c, A_MASKED) for x in a_row]
                b_sc = [off(x, AS_PITCH, c, N_TAIL) for x in b_row]
            return data + (a_sc, b_sc)

        def direct_load(s, o, b_rsrc, bs_rsrc, scales=True, hi_kept=None):
            """gfx950, direct: issue the loads of step s: per row block the lane's two 16 bytes
            (scaled_offsets), then (`scales`) its scale bytes or dwords (scale_loads). A flat list.
            hi_kept (a partial step's): whether the lane's second 16 bytes are read (else OOB: 0)."""
            sc = scale_loads(s, o, bs_rsrc) if const_expr(scales) else []
            # scales first: a wait for them (a copy at the loop's end) leaves the data in flight
            rocdl.sched_barrier(0)
            sd = _uniform(s * K_STEP + D_BASE)
            if const_expr(hi_kept is not None):
                hi = lambda o: (hi_kept.select(o + HALF_STEP, fx.Int32(OOB)), sd)  # noqa: E731
            elif const_expr(MB + NB > 8 and not SCALE_MFMA):  # the second 16 bytes through the scalar offset (the docstring)
                sd_hi = _uniform(sd + HALF_STEP)
                hi = lambda o: (o, sd_hi)  # noqa: E731
            else:
                hi = lambda o: (o + HALF_STEP, sd)  # noqa: E731
            av = [_cat(_load(a_rsrc, x, sd, 4), _load(a_rsrc, *hi(x), 4)) for x in o[0]]
            bv = [_cat(_load(b_rsrc, x, sd, 4), _load(b_rsrc, *hi(x), 4)) for x in o[1]]
            return av + bv + sc

        def scale_loads(s, o, bs_rsrc):
            """gfx950: step s's scale bytes (plain) or its step pair's dwords ("mfma"; the parity is the
            MFMA's byte select) into registers, a flat list (scaled_offsets)."""
            aso, bso = o[2:]
            if const_expr(SCALE_MFMA):
                ss = _uniform(s.shrui(fx.Int32(1)) * 256)
                return [_load(as_rsrc, x, ss, 1).ir_value() for x in aso] + [_load(bs_rsrc, x, ss, 1).ir_value() for x in bso]
            ss = _uniform(s * (K_STEP // BLOCK) + S_BASE)
            return [_byte(as_rsrc, x, ss).ir_value() for x in aso] + [_byte(bs_rsrc, x, ss).ir_value() for x in bso]

        def stage_step(s, o, b_rsrc, stage):
            """gfx950: step s's rows into LDS stage `stage`: the lane's 16 bytes of each row group it
            stages (scaled_offsets), straight to LDS (buffer_load ... lds: lane l's bytes land at the
            group's 1024 + 16 l)."""
            sd = _uniform(s * K_STEP + D_BASE).ir_value()
            for rsrc, offsets, first in ((a_rsrc, o[0], a_stage), (b_rsrc, o[1], b_stage)):
                for i, x in enumerate(offsets):  # DMA_RUN groups per LDS address (M0), apart by the offset field
                    dst = mx.lds_ptr(first + (stage * STAGE + i // DMA_RUN * DMA_RUN * GROUP_BYTES))
                    rocdl.raw_ptr_buffer_load_lds(rsrc, dst, 16, x.ir_value(), sd, i % DMA_RUN * GROUP_BYTES, 0)

        def fragments(stage):
            """gfx950: the wave's MFMA operands of the step in LDS stage `stage`: lane (c, r)'s 16 bytes
            at k = 16 c and at 64 + 16 c of its row of each row block (the scaled MFMA's 8-bit operand
            layout, CK's mx_mfma_op test), stored as chunks c and 4 + c of the row, each at slot
            chunk ^ (row % 8)."""
            return ([fragment(stage, a_lo, a_hi, j) for j in range_constexpr(MB)]
                    + [fragment(stage, b_lo, b_hi, j) for j in range_constexpr(NB)])

        def fragment(stage, lo, hi, j):
            """Row block j's operand (A's: lo, hi = a_lo, a_hi; B's: b_lo, b_hi) from LDS stage `stage`."""
            def read(base):  # a constant offset from one base pointer: it folds into ds_read_b128
                at = llvm.GEPOp(p3, base, [], [stage * STAGE + j * (MFMA_MN * K_STEP)], T.i8, None).result
                return llvm.load(T.vec(4, T.i32), at, alignment=16)

            return _cat(read(lo), read(hi))

        def scaled_compute(accs, data, scales, parity, read=None):
            """gfx950: one v_mfma_scale_f32_16x16x128_f8f6f4 per block pair of a loaded step; `scales`
            the step's (plain) or its step pair's ("mfma", byte 2 parity + row-block parity) words.
            `read` (an LDS stage): the next step's operands are read from it as this step's stop
            being used (A's row block after its row of MFMAs, B's column blocks in the last row),
            so the two steps' operands are hardly live at once; returns (accs, those operands)."""
            av, bv = data[:MB], data[MB:MB + NB]
            if const_expr(SCALE_MFMA):
                asc, bsc = scales[:MB // 2], scales[MB // 2:]
                a_of = lambda mb: (asc[mb // 2], 2 * parity + mb % 2)  # noqa: E731
                b_of = lambda nb: (bsc[nb // 2], 2 * parity + nb % 2)  # noqa: E731
            else:
                asc, bsc = scales[:MB], scales[MB:]
                a_of = lambda mb: (asc[mb], 0)  # noqa: E731
                b_of = lambda nb: (bsc[nb], 0)  # noqa: E731
            accs, nxt_a, nxt_b = list(accs), [None] * MB, [None] * NB
            for mb in range_constexpr(MB):
                for nb in range_constexpr(NB):
                    i = mb * NB + nb
                    (sa, sel_a), (sb, sel_b) = a_of(mb), b_of(nb)
                    accs[i] = rocdl.mfma_scale_f32_16x16x128_f8f6f4(
                        T.vec(4, T.f32), [bv[nb], av[mb], accs[i], 0, 0, sel_b, sb, sel_a, sa])
                    if const_expr(read is not None and mb == MB - 1):
                        nxt_b[nb] = fragment(read, b_lo, b_hi, nb)
                        rocdl.sched_barrier(0)
                if const_expr(read is not None):
                    nxt_a[mb] = fragment(read, a_lo, a_hi, mb)
                    rocdl.sched_barrier(0)
            return accs if read is None else (accs, nxt_a + nxt_b)

        def fp8_offsets(a_row, b_row):
            """gfx942: lane (c, r)'s 8 bytes of each 32-wide block of its row."""
            return [off(x, A_PITCH, c * 8, A_MASKED) for x in a_row], [off(x, A_PITCH, c * 8, N_TAIL) for x in b_row]

        def fp8_scales(s, lo, hi, bs_rsrc, blocks, valid):
            """gfx942: the tile's scales of step s as f32 in LDS, each converted once per workgroup:
            A's as [row][block] (a lane reads its row's 4 blocks at once), B's as [block][column]
            (a lane reads its 4 output columns of a block at once). Returns the wave's (sa, sb):
            sa[mb] 4 f32 (blocks), sb(nb, j) reading 4 f32 (columns 4c .. 4c + 3)."""
            gpu.barrier()  # the previous step's reads are done
            ss = _uniform(scale_src(fx.Int32(0), 0)[1](s))
            for q0 in range_constexpr(0, (TILE_M + TILE_N) * 4, WAVES * WAVE):
                q = tid + q0
                if const_expr(q0 < TILE_M * 4):  # A: entry q = 4 row + block
                    m = row0 + q.shrui(fx.Int32(2))
                    ok = (m >= lo) & (m < hi) & ((q & 3) < valid)
                    e = _byte(as_rsrc, ok.select(scale_src(m, q & 3)[0], fx.Int32(OOB)), ss)
                    addr = q << 2
                else:  # B: entry q' = 4 column + block, stored at [block][column]
                    q2 = q - TILE_M * 4
                    col = q2.shrui(fx.Int32(2))
                    n = col_tile + col
                    ok = (n < COLS) & ((q2 & 3) < valid)
                    e = _byte(bs_rsrc, ok.select(scale_src(n, q2 & 3)[0], fx.Int32(OOB)), ss)
                    addr = (TILE_M * 4 + (q2 & 3) * TILE_N + col) << 2
                mx.lds_store(_e8m0_f32(e).bitcast(fx.Int32).ir_value(), (lds_base + addr).ir_value())
            gpu.barrier()
            sa = [Vec(mx.lds_load(4, (lds_base + ((wm_i * WM + mb * MFMA_MN + r) << 4)).ir_value())).bitcast(fx.Float32)
                  for mb in range_constexpr(MB)]

            def sb(nb, j):  # read where used: all of them at once would hold NB x blocks x 4 VGPRs
                return Vec(mx.lds_load(4, (lds_base + ((TILE_M * 4 + j * TILE_N + wn_i * WN + nb * MFMA_MN + c * 4) << 2))
                                       .ir_value())).bitcast(fx.Float32)

            return sa, sb

        def fp8_step(s, accs, o, b_rsrc, bs_rsrc, lo, hi, valid=K_STEP // BLOCK, fenced=True):
            """gfx942: per 32-wide block j of 128-wide step s, one v_mfma_f32_16x16x32_fp8_fp8 per
            block pair from 0, added to the accumulator times sa * sb (packed math). `valid`: the
            step's blocks below it are read; a compile-time count loads only those, a run-time one
            (the weight gradient's) all four, those at or past it as below. `fenced`: scaled_sums'."""
            blocks = valid if isinstance(valid, int) else K_STEP // BLOCK
            ao, bo = o
            sd = _uniform(s * K_STEP + D_BASE)
            # wgrad: block j through the scalar offset (with its run-time pitch LLVM would keep base + 32 j
            # in a VGPR per row block and block instead of the instruction's immediate). A block at or
            # past a run-time `valid` (the weight gradient's last step) re-reads block 0, inside the
            # group, and fp8_scales masks both its scales (code 0, 2^-127: their product, 2^-254, is 0
            # in FP32); masking its loads per lane instead held 14 more VGPRs (+0 operands, K 5120)
            sdj = [_uniform(sd + j * BLOCK if isinstance(valid, int) or j == 0 else
                            (fx.Int32(j) < valid).select(sd + j * BLOCK, sd)) if const_expr(WGRAD) else sd
                   for j in range_constexpr(blocks)]
            at = (lambda base, j: base) if const_expr(WGRAD) else (lambda base, j: base + j * BLOCK)  # noqa: E731
            av = [[_load(a_rsrc, at(ao[mb], j), sdj[j], 2) for j in range_constexpr(blocks)] for mb in range_constexpr(MB)]
            bv = [[_load(b_rsrc, at(bo[nb], j), sdj[j], 2) for j in range_constexpr(blocks)] for nb in range_constexpr(NB)]
            sa, sb = fp8_scales(s, lo, hi, bs_rsrc, blocks, valid)
            flat = _fnuz_operands([v[h] for v in [x for row in av + bv for x in row] for h in range_constexpr(2)],
                                  SIGNED_ZEROS, fused=not WGRAD)  # fused: the wgrad would hold 258 VGPRs, not 253
            ops = [Vec.from_elements(flat[2 * q:2 * q + 2], fx.Int32).bitcast(fx.Int64)[0] for q in range_constexpr(len(flat) // 2)]
            a_ops = [ops[mb * blocks:(mb + 1) * blocks] for mb in range_constexpr(MB)]
            b_ops = [ops[(MB + nb) * blocks:(MB + nb + 1) * blocks] for nb in range_constexpr(NB)]
            return scaled_sums(accs, a_ops, b_ops, sa, sb, blocks, fenced)

        def scaled_pipeline(o, b_rsrc, bs_rsrc, steps):
            """gfx950: the sums of full steps [0, steps), steps >= 1: compile-time (the forward's K)
            or run-time (the weight gradient's group). Software pipeline. Direct: step s + 1's
            loads are in flight while step s's MFMAs run, one wait per step. Staged, step s in LDS
            stage s % 2: while step s's MFMAs run on its operands (in registers), step s + 1's
            operands are read from the other stage, step s + 1's scales loaded and step s + 2's
            rows staged into s's stage; then one barrier (all landed, every wave done with the
            stage). Step 0 is peeled
            (its MFMAs start from a constant 0: no zeroed accumulators); the loop then walks (odd,
            even) step pairs, so that the stages are compile-time and an "mfma" scale dword, loaded
            with an even step, serves it and the odd step after it. A compile-time count ends the
            loop before a load would pass the last step and unrolls the steps left (1-2 direct,
            1-3 staged); a run-time one
            runs every pair, the last one peeled to clamp its loads past the last step to it
            (reloaded, never computed: the clamp costs SALU per pair when in the loop), then an odd
            last step."""
            static = isinstance(steps, int)
            n_acc, n_data = MB * NB, MB + NB
            per_step = not SCALE_MFMA  # plain scales are loaded with every step
            n_odd = n_data + (n_data if per_step else 0)  # an odd step's operands and own (plain) scales
            split = lambda st: (list(st[:n_acc]), list(st[n_acc:n_acc + n_odd]), list(st[n_acc + n_odd:]))  # noqa: E731

            def ahead(s, clamp):  # a step loaded ahead, clamped to the last step where it may pass it
                return fx.min(fx.Int32(s), steps - 1) if const_expr(clamp) else fx.Int32(s)

            def advance(accs, s, parity, cur, scales, read=True, stage=True, nxt_scales=True, clamp=not static):
                """Compute step s (parity: its stage, compile-time) from its operands `cur` and
                `scales` while step s + 1's operands are read (`read`; direct: loaded) and its scales
                loaded (`nxt_scales`), and step s + 2's rows staged (`stage`). Returns the
                accumulators and the step s + 1 values read and loaded."""
                if const_expr(not STAGED):  # the other loads in flight stay so: one wait per step
                    nxt = direct_load(ahead(s + 1, clamp), o, b_rsrc, bs_rsrc, nxt_scales) if const_expr(read) else []
                    rocdl.sched_barrier(0)
                    rocdl.s_waitcnt(vmcnt=len(nxt) + n_data if const_expr(read) else 0)  # a step's data: 2 loads per block
                    return scaled_compute(accs, cur, scales, parity), nxt
                sc = []
                if const_expr(read and nxt_scales):  # before the rows: the barrier's wait for those covers them
                    sc = scale_loads(ahead(s + 1, clamp), o, bs_rsrc)
                if const_expr(stage):
                    stage_step(ahead(s + 2, clamp), o, b_rsrc, parity)
                rocdl.sched_barrier(0)
                nxt = []
                if const_expr(read):
                    accs, nxt = scaled_compute(accs, cur, scales, parity, 1 - parity)
                else:
                    accs = scaled_compute(accs, cur, scales, parity)
                rocdl.sched_barrier(0)  # the MFMAs before the wait for the loads, not after it
                gpu.barrier()
                return accs, nxt + sc

            if const_expr(STAGED):
                stage_step(fx.Int32(0), o, b_rsrc, 0)
                if const_expr(not static or steps > 1):
                    stage_step(ahead(1, not static), o, b_rsrc, 1)
                sc0 = scale_loads(fx.Int32(0), o, bs_rsrc)
                gpu.barrier()
                d0 = fragments(0)
                gpu.barrier()  # every wave holds step 0's operands before step 2's rows overwrite them
            else:
                d0 = direct_load(fx.Int32(0), o, b_rsrc, bs_rsrc)
                d0, sc0 = d0[:n_data], d0[n_data:]
            accs, odd = advance([zero4] * n_acc, 0, 0, d0, sc0, not static or steps > 1, not static or steps > 2, per_step)
            # an odd step's scales: its own (plain, in `odd`) or its pair's ("mfma", `pair`)
            pair = [] if per_step else sc0

            def pair_of_steps(i, state, clamp):
                """Compute steps 2 i + 1 and 2 i + 2 (state: accs, the odd step's operands and scales,
                the pair's scales) with the loads ahead of them."""
                s_odd = fx.Int32(i) * 2 + 1
                accs, odd, pair = split(state)
                accs, even = advance(accs, s_odd, 1, odd[:n_data], odd[n_data:] + pair, clamp=clamp)
                accs, odd = advance(accs, s_odd + 1, 0, even[:n_data], even[n_data:], nxt_scales=per_step, clamp=clamp)
                return accs + odd + ([] if per_step else even[n_data:])

            state = accs + odd + pair
            if const_expr(static):
                pairs = max(0, (steps - (3 if STAGED else 2)) // 2)  # the loop's loads (2 or 1 steps ahead) below `steps`
                if const_expr(pairs > 0):
                    for i, st in range(0, pairs, 1, init=state):
                        res = yield pair_of_steps(i, st, False)
                    state = list(res)
            else:  # only the last pair's loads can pass the last step: the loop's are not clamped
                pairs = (steps - 1).shrui(fx.Int32(1))
                for i, st in range(0, pairs - 1, 1, init=state):
                    res = yield pair_of_steps(i, st, False)
                state = list(res)
                state = mx.if_else((pairs > 0).ir_value(), lambda: pair_of_steps(pairs - 1, state, True), lambda: state,
                                   types=[v.type for v in state])
            accs, odd, pair = split(state)
            if const_expr(static):  # the steps left, from 2 pairs + 1 (its operands in `odd`)
                cur, scales = odd[:n_data], odd[n_data:] + pair
                for s in range_constexpr(2 * pairs + 1, steps):
                    accs, nxt = advance(accs, s, s % 2, cur, scales, s + 1 < steps, s + 2 < steps, per_step or s % 2 == 1)
                    if const_expr(s % 2 == 1 or per_step):
                        cur, scales = nxt[:n_data], nxt[n_data:]
                    else:  # "mfma": the even step's dword serves the odd step after it
                        cur = nxt[:n_data]
            else:
                if (steps & 1) == 0:  # the last step, odd
                    accs = advance(accs, steps - 1, 1, odd[:n_data], odd[n_data:] + pair, False, False)[0]
            return accs

        def reduce(b_rsrc, bs_rsrc, a_row, b_row, lo, hi, steps, tail):
            """The tile's sums (setup's buffers and rows) over steps [0, steps) and a partial step
            `steps` of `tail` 32-wide chunks (0: none), both compile-time (the forward: K) or
            run-time (the weight gradient: the group's rows; 0 steps for an empty group)."""
            accs = [zero4] * (MB * NB)
            if const_expr(SCALED):
                o = scaled_offsets(a_row, b_row, lo, hi)
                if steps > 0:
                    accs = scaled_pipeline(o, b_rsrc, bs_rsrc, steps)
                if tail > 0:  # bytes at or past k = 32 tail masked (direct: a lane's two halves apart), and blocks' scales
                    chunk = stage_chunk if const_expr(STAGED) else c
                    keep = (chunk < tail * 2, chunk < tail * 2, c < tail, c < tail)
                    oobs = (DATA_OOB, DATA_OOB, OOB, OOB)
                    t = tuple([k.select(x, fx.Int32(v)) for x in part] for k, v, part in zip(keep, oobs, o))
                    if const_expr(STAGED):
                        stage_step(fx.Int32(steps), t, b_rsrc, 0)
                        sc = scale_loads(fx.Int32(steps), t, bs_rsrc)
                        gpu.barrier()
                        last = fragments(0) + sc
                    else:
                        last = direct_load(fx.Int32(steps), t, b_rsrc, bs_rsrc, hi_kept=c + 4 < tail * 2)
                        rocdl.s_waitcnt(vmcnt=0)
                    # the parity: the "mfma" scales' byte select (forward only: a compile-time count)
                    accs = scaled_compute(accs, last[:MB + NB], last[MB + NB:], steps % 2 if const_expr(SCALE_MFMA) else 0)
                    if const_expr(STAGED):
                        gpu.barrier()  # every wave is done with stage 0 before a next group's loads
            elif const_expr(WGRAD and not SIGNED_ZEROS):
                # one loop over every step, its blocks past the group masked. Registers (N 2048, K 5120):
                # 216 VGPRs this way, 272 with a separate last step; with the -0 rewrite (below) 260 and 253
                o = fp8_offsets(a_row, b_row)
                chunks = steps * (K_STEP // BLOCK) + tail
                for s, state in range(0, (chunks + 3).shrui(fx.Int32(2)), 1, init=accs):
                    s = fx.Int32(s)
                    res = yield fp8_step(s, list(state), o, b_rsrc, bs_rsrc, lo, hi, fx.min(chunks - s * 4, fx.Int32(4)))
                accs = list(res)
            else:
                o = fp8_offsets(a_row, b_row)
                for s, state in range(0, steps, 1, init=accs):
                    res = yield fp8_step(fx.Int32(s), list(state), o, b_rsrc, bs_rsrc, lo, hi)
                accs = list(res)
                if tail > 0:  # unfenced: here LLVM moved the MFMAs across the fences (wgrad: 358 VGPRs, 253 not)
                    accs = fp8_step(fx.Int32(steps), accs, o, b_rsrc, bs_rsrc, lo, hi, tail, fenced=False)
            return accs

        if const_expr(WGRAD):
            # out[g] = y[g rows]^T x[g rows]: the reduction walks the group's rows of M in 128-wide
            # steps; a last partial step (group sizes are multiples of 32) has its chunks past the
            # group masked, and an empty group runs none: its tile is written as 0.
            w_operands = setup(g_w, 0, N)
            w_span = hi_w - lo_w
            w_accs = reduce(*w_operands, 0, N, w_span.shrui(fx.Int32(7)), w_span.shrui(fx.Int32(5)) & 3)
            store(w_accs, 0, N, 1.0 if SCALED else 4.0)
        else:
            for g in range(g0, g1, 1):
                g = fx.Int32(g)
                start = _scalar_load(offs + _zext(fx.max(g - 1, fx.Int32(0)) << 2))
                lo = fx.max((g > 0).select(start, fx.Int32(0)), row0)
                hi = fx.min(_scalar_load(offs + _zext(g << 2)), row_end)
                if lo < hi:
                    store(reduce(*setup(g, lo, hi), lo, hi, FULL_STEPS, TAIL_CHUNKS), lo, hi, 1.0 if SCALED else 4.0)

            # rows at or past the last group's end: zeros
            z_lo = fx.max(_scalar_load(offs + (E - 1) * 4), row0)
            if z_lo < row_end:
                store([zero4] * (MB * NB), z_lo, row_end, 1.0)

    @flyc.jit
    def launch(a: fx.Int64, a_scale: fx.Int64, b: fx.Int64, b_scale: fx.Int64, offs: fx.Int64, out: fx.Int64,
               m_rows: fx.Int32, bs_expert_bytes: fx.Int32, grid_m: fx.Int32, stream: fx.Stream = fx.Stream(None)):
        grouped_mm_kernel(a, a_scale, b, b_scale, offs, out, m_rows, bs_expert_bytes).launch(
            grid=(grid_m, -(-COLS // TILE_N), E if WGRAD else 1), block=(WAVES * WAVE, 1, 1), stream=stream)

    return launch


def _uniform(x):
    """x (wave-uniform) in an SGPR: a buffer's scalar offset must be one (LLVM would otherwise loop
    over the lanes' values, a waterfall per load)."""
    return fx.Int32(rocdl.readfirstlane(T.i32, fx.Int32(x).ir_value()))


