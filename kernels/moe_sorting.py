"""moe_sorting on the device: routing pairs grouped by expert into blocks of block_m rows, in
one launch, bit-identical to flyquant.reference.moe_sorting (aiter's contract, defined parts).

Math. The P = T * topk routing pairs p = t * topk + slot (token-major) carry an expert key
k(p) = topk_ids[t, slot], or the sentinel E when the id is outside [0, E) or the expert is
masked out (the pair is dropped). For each served expert e in ascending order its pairs, in
ascending p (a stable counting sort by key), take rows row_start[e] .. + count[e] - 1 of
sorted_ids ((slot << 24) | t) and sorted_weights (f32), then padding up to
padded[e] = ceil(count[e] / block_m) * block_m rows; row_start is the exclusive prefix sum of
padded. Every row not holding a pair holds (topk << 24) | T with weight 0. Block b of
sorted_expert_ids holds the local id (served experts before it) of the expert whose rows it
covers, -1 past the last used block; num_valid_ids = [rows used, T].

Work split: one workgroup of `waves` waves (the whole sort is one launch, no host sync).
Wave w owns a contiguous slice of the pairs (S = ceil(P / waves) rounded up to 64), walked in
rounds of 64 (lane = pair):
  1. zero a per-wave histogram hist[w][key] in LDS, then count each pair into its own wave's
     row with ds_add_u32 (column E counts the dropped pairs and is ignored);
  2. thread i owns G consecutive keys: their counts are the column sums of hist, each column
     rewritten in place as its exclusive prefix over waves; blocks[e] = ceil(count / block_m)
     and served[e] (0/1) are summed together as blocks << SERVED_BITS | served: a thread-serial
     prefix over its G keys, a wave scan of the lane totals (DPP row_shr / row_bcast), the
     wave totals through LDS. That gives every expert its first block and its local id; the
     packed inclusive prefix is kept in LDS (scan[e]) and each hist[w][e] becomes the first row
     of wave w's pairs of e (DROP for the sentinel and masked experts);
  3. fill: every row gets the padding id and weight 0 (dwordx4 stores), every block its expert
     (the owner of block b is found by binary search over scan's block counts) or -1, and
     num_valid_ids; a workgroup barrier with a release/acquire fence orders these stores
     before the next phase's stores to the same rows;
  4. place: per round, lanes with the same key find each other with one ballot per key bit
     (peers = AND over bits of ballot or its complement), rank = peers below the lane,
     row = hist[w][key] + rank; then every peer writes hist[w][key] + count of peers back
     (the same value from every peer). Dropped pairs (cursor DROP, sign bit set) store at an
     offset past the buffers' ends, which the buffer range check drops.
Ordering is exact: waves own contiguous slices in order, rounds go in order inside a wave and
ranks in lane order inside a round, so equal keys keep ascending p. Round 0's ids and weights
and the mask flags are loaded before phase 1 and kept in registers (at decode, one round, the
kernel makes one round of dependent global loads, not three).

Optional moe_buf (the stage-2 output, any dtype, contiguous, a whole number of 4-byte words below
2 GiB; checked by the launcher): zeroed by extra workgroups of the same launch (workgroup 0
sorts), as aiter's moe_sorting zeroes moe_buf.

Constraints (checked by the launcher): 1 <= E <= MAX_EXPERTS (served count in SERVED_BITS
bits), P <= MAX_PAIRS per launch (used blocks <= P + E stay below 2^(32 - SERVED_BITS)),
1 <= block_m <= MAX_BLOCK_M, topk <= 127, T < 2^24; int32/int64 ids, f32/bf16/f16 weights,
bool/integer expert_mask; inputs contiguous. Every access goes through a buffer resource sized
to its tensor, so ids outside [0, E) touch nothing outside any allocation.
"""

from __future__ import annotations

import sys
from dataclasses import dataclass

import torch

import flydsl.compiler as flyc
import flydsl.expr as fx
from flydsl._mlir import ir
from flydsl._mlir.dialects import arith, llvm, rocdl, scf

from flyquant import toolchain, validate
from flyquant.arch import arch_info

from . import _mx_common as mx
from ._mx_common import WAVE, add, band, bor, const, lshr, mul, select, shl, sub, val

TOKEN_BITS = 24  # sorted id = (slot << 24) | token (flyquant.moe)
MAX_TOPK = (1 << (31 - TOKEN_BITS)) - 1
SERVED_BITS = 11  # low bits of the packed scan value: served experts so far (<= MAX_EXPERTS)
MAX_EXPERTS = (1 << (SERVED_BITS - 1))  # 1024
MAX_PAIRS = 1 << 20  # routed pairs per launch: used blocks <= P + E < 2^(32 - SERVED_BITS)
MAX_BLOCK_M = 1024  # rows R = P + E * block_m - topk stay far below 2^29 (byte offsets in i32)
DROP = -(1 << 31)  # a cursor for dropped keys: rows from it are negative, stored nowhere
OOB = mx.OOB  # a buffer offset past every buffer's end: the store is dropped
WAVE_COUNTS = (1, 4, 8)
LDS_BUDGET = 48 * 1024  # histograms + scan: leaves the GEMM's workgroups room on gfx942
ZERO_BYTES_PER_LANE = 16  # moe_buf zeroing: one dwordx4 store per lane
ZERO_ROUNDS = 8  # stores per lane and zeroing workgroup
MAX_MOE_BUF_BYTES = mx.MAX_LAUNCH_BYTES  # moe_buf byte offsets are non-negative i32
ID_DTYPES = {torch.int32: 4, torch.int64: 8}
WEIGHT_DTYPES = {torch.float32: "f32", torch.bfloat16: "bf16", torch.float16: "f16"}
MASK_DTYPES = (torch.bool, torch.uint8, torch.int8, torch.int16, torch.int32, torch.int64)
SOURCE_TAG = mx.source_tag(sys.modules[__name__])

# DPP controls of the wave scan (GFX9): row_shr:n reads lane - n of the 16-lane row,
# row_bcast15 / row_bcast31 give rows 1, 3 / rows 2, 3 lane 15 / lane 31.
DPP_ROW_SHR = 0x110
DPP_ROW_BCAST15, DPP_ROW_BCAST31 = 0x142, 0x143
ROWS_1_3, ROWS_2_3, ALL = 0xA, 0xC, 0xF


@dataclass(frozen=True)
class SortSpec:
    """Everything a compiled sorting kernel is specialised on."""

    arch: str
    experts: int  # E
    topk: int
    block_m: int
    id_bytes: int  # 4 (int32) or 8 (int64)
    weight: str  # "f32" | "bf16" | "f16"
    mask_bytes: int  # 0: no expert_mask, else its element size
    waves: int

    @property
    def threads(self) -> int:
        return self.waves * WAVE

    @property
    def keys_per_thread(self) -> int:
        """G: keys 0..E (E = dropped) spread over the threads, G consecutive each."""
        return -(-(self.experts + 1) // self.threads)

    @property
    def key_stride(self) -> int:
        """Dwords per histogram row (and of scan): every thread's G keys, so no access of phase 2
        needs a bound check."""
        return self.threads * self.keys_per_thread

    @property
    def key_bits(self) -> int:
        return self.experts.bit_length()  # keys 0..E

    @property
    def lds_bytes(self) -> int:
        return 4 * ((self.waves + 1) * self.key_stride + self.waves)

    @property
    def name(self) -> str:
        mask = f"_mask{self.mask_bytes}" if self.mask_bytes else ""
        return (f"moe_sorting_e{self.experts}_k{self.topk}_m{self.block_m}_i{8 * self.id_bytes}_{self.weight}"
                f"{mask}_w{self.waves}_{self.arch}")


def _i64():
    return mx.i64_t()


def _c64(v):
    return arith.constant(_i64(), v)


def _lds_addr(base, index):
    return add(base, shl(index, 2))


def _lds_add(addr, value):
    """ds_add_u32 (result unused)."""
    llvm.AtomicRMWOp(llvm.AtomicBinOp.add, mx.lds_ptr(addr), val(value), llvm.AtomicOrdering.monotonic,
                     syncscope="workgroup")


def _barrier():
    """Workgroup barrier that also orders global and LDS memory (release, s_barrier, acquire)."""
    llvm.fence(llvm.AtomicOrdering.release, syncscope="workgroup")
    rocdl.s_barrier()
    llvm.fence(llvm.AtomicOrdering.acquire, syncscope="workgroup")


def _ballot(pred):
    return rocdl.ballot(_i64(), pred)


def _popcount(x):
    return llvm.intr_ctpop(val(x))


def _opaque_vgpr(x):
    """x, hidden from LLVM's combines by an empty inline asm (no instruction)."""
    return llvm.inline_asm(mx.i32_t(), [val(x)], "", "=v,0")


def _sign_extended_bit(x, bit: int):
    """0 or -1: bit `bit` of x copied into every bit (v_bfe_i32 x, bit, 1)."""
    return arith.shrsi(shl(x, 31 - bit), const(31))


def _for_range_from(start: int, stop, body):
    """Emit `for i in range(start, stop): body(i)` as a runtime loop (none when stop <= start)."""
    loop = scf.ForOp(const(start), val(stop), const(1))
    with ir.InsertionPoint(loop.body):
        body(loop.induction_variable)
        scf.YieldOp([])


def _udiv(x, d: int):
    return arith.divui(val(x), const(d))


def _wave_inclusive_scan(x):
    """Inclusive prefix sum over the 64 lanes (Hillis-Steele inside 16-lane rows by DPP row_shr,
    then row 0's / rows 0-1's totals broadcast into the rows above)."""
    for d in (1, 2, 4, 8):
        x = add(x, rocdl.update_dpp(mx.i32_t(), const(0), val(x), DPP_ROW_SHR + d, ALL, ALL, True))
    x = add(x, rocdl.update_dpp(mx.i32_t(), const(0), val(x), DPP_ROW_BCAST15, ROWS_1_3, ALL, False))
    x = add(x, rocdl.update_dpp(mx.i32_t(), const(0), val(x), DPP_ROW_BCAST31, ROWS_2_3, ALL, False))
    return x


def build_moe_sorting(spec: SortSpec):
    """A fresh @flyc.jit launcher for `spec` (uncached: compile_only needs a fresh one)."""
    arch_info(spec.arch)
    E, TOPK, BM, W = spec.experts, spec.topk, spec.block_m, spec.waves
    N, G, STRIDE, KEY_BITS = spec.threads, spec.keys_per_thread, spec.key_stride, spec.key_bits
    IDB, MB = spec.id_bytes, spec.mask_bytes
    WB = 4 if spec.weight == "f32" else 2
    SLICE_SHIFT = (N - 1).bit_length()  # slices are multiples of 64 per wave: S = ceil(P / N) * 64
    # LDS dword offsets: the W waves' histogram rows from 0 (STRIDE apart), then the scan and the wave totals
    SCAN, WTOT = W * STRIDE, (W + 1) * STRIDE
    name = spec.name
    source = SOURCE_TAG

    def load_key(r_ids, p, live):
        """The pair's key: its expert id, or E when `live` is false or the id is outside [0, E)."""
        if IDB == 4:
            e = mx.load(r_ids, shl(p, 2), 1)
            ok = mx.cmp_ult(e, E)
        else:
            two = mx.load(r_ids, shl(p, 3), 2)
            e, hi = mx.extract(two, 0), mx.extract(two, 1)
            ok = arith.andi(mx.cmp_ult(e, E), mx.cmp_eq(hi, const(0)))
        return select(arith.andi(ok, live), e, E)

    def load_weight(r_w, p):
        if WB == 4:
            return mx.load(r_w, shl(p, 2), 1)
        h = mx.load_short(r_w, shl(p, 1))
        if spec.weight == "bf16":
            return shl(h, 16)
        f16 = arith.bitcast(ir.F16Type.get(), arith.trunci(ir.IntegerType.get_signless(16), h))
        return mx.as_i32(arith.extf(mx.f32_t(), f16))

    def served(r_mask, e):
        """1 where expert e (< E) is served (mask element nonzero), 0 otherwise and for e >= E."""
        in_range = mx.cmp_ult(e, E)
        if MB == 0:
            return arith.extui(mx.i32_t(), in_range)
        if MB == 1:
            m = arith.extui(mx.i32_t(), rocdl.raw_ptr_buffer_load(ir.IntegerType.get_signless(8), r_mask,
                                                                  val(e), const(0)))
        elif MB == 2:
            m = mx.load_short(r_mask, shl(e, 1))
        elif MB == 4:
            m = mx.load(r_mask, shl(e, 2), 1)
        else:
            two = mx.load(r_mask, shl(e, 3), 2)
            m = bor(mx.extract(two, 0), mx.extract(two, 1))
        return arith.extui(mx.i32_t(), arith.andi(in_range, mx.cmp_ne(m, 0)))

    def body(topk_ids, topk_weights, expert_mask, sorted_ids, sorted_weights, sorted_expert_ids, num_valid_ids,
             moe_buf, tokens, moe_buf_bytes):
        tid = val(fx.Int32(fx.thread_idx.x))
        wg = val(fx.Int32(fx.block_idx.x))
        lane = band(tid, WAVE - 1)
        wave = mx.readfirstlane(lshr(tid, 6))
        lds = fx.SharedAllocator().allocate(spec.lds_bytes, alignment=16)
        lds_base = val(fx.Int32(fx.ptrtoint(lds.peek().ptr)))

        def zero_moe_buf():
            r_buf = mx.buffer(moe_buf, _c64(0), moe_buf_bytes)
            chunk = N * ZERO_BYTES_PER_LANE
            first = add(mul(sub(wg, 1), ZERO_ROUNDS * chunk), shl(tid, 4))
            zero = mx.from_elements([const(0)] * 4)
            for i in range(ZERO_ROUNDS):  # the tail past moe_buf's end is dropped per dword
                mx.store(zero, r_buf, add(first, i * chunk))

        def sort():
            sort_body(topk_ids, topk_weights, expert_mask, sorted_ids, sorted_weights, sorted_expert_ids,
                      num_valid_ids, tokens, tid, lane, wave, lds_base)

        mx.if_else(mx.cmp_eq(wg, const(0)), sort, zero_moe_buf)

    def sort_body(topk_ids, topk_weights, expert_mask, sorted_ids, sorted_weights, sorted_expert_ids,
                  num_valid_ids, tokens, tid, lane, wave, lds_base):
        t_count = val(tokens)
        pairs = mul(t_count, TOPK)
        rows = add(pairs, E * BM - TOPK)
        blocks = _udiv(add(rows, BM - 1), BM)
        r_ids = mx.buffer(topk_ids, _c64(0), mul(pairs, IDB))
        r_w = mx.buffer(topk_weights, _c64(0), mul(pairs, WB))
        r_mask = mx.buffer(expert_mask, _c64(0), const(E * max(MB, 1)))
        r_sid = mx.buffer(sorted_ids, _c64(0), shl(rows, 2))
        r_sw = mx.buffer(sorted_weights, _c64(0), shl(rows, 2))
        r_se = mx.buffer(sorted_expert_ids, _c64(0), shl(blocks, 2))
        r_nv = mx.buffer(num_valid_ids, _c64(0), const(8))

        hist_wave = _lds_addr(lds_base, mul(wave, STRIDE))  # this wave's histogram row (bytes)
        scan_base = _lds_addr(lds_base, const(SCAN))

        # slice of pairs of this wave: [p0, p_end), walked in rounds of 64
        slice_len = shl(lshr(add(pairs, N - 1), SLICE_SHIFT), 6)
        p0 = mul(wave, slice_len)
        p_end = arith.minui(add(p0, slice_len), pairs)
        n_rounds = lshr(add(mx.usub_sat(p_end, p0), WAVE - 1), 6)

        def pair_of(r):
            p = add(add(p0, shl(r, 6)), lane)
            return p, load_key(r_ids, p, mx.cmp_ult(p, p_end))

        # Loads with no dependence, issued first: round 0's pairs (counted in phase 1 and placed
        # in phase 4, whatever n_rounds: a wave without pairs sees only dead lanes, key E) and
        # the served flags of this thread's keys (phase 2).
        p_first, key_first = pair_of(const(0))
        weight_first = load_weight(r_w, p_first)
        key0 = mul(tid, G)
        served_flags = [served(r_mask, add(key0, g)) for g in range(G)]

        # ---- 1. histograms -----------------------------------------------------------------
        def zero_hist(i):
            mx.lds_store(const(0), _lds_addr(lds_base, add(mul(i, N), tid)))

        mx.for_range(const(W * STRIDE // N), zero_hist)
        _barrier()

        def count(key):
            _lds_add(_lds_addr(hist_wave, key), const(1))

        count(key_first)
        _for_range_from(1, n_rounds, lambda r: count(pair_of(r)[1]))
        _barrier()

        # ---- 2. counts, blocks, local ids, first rows ----------------------------------------
        packed = []  # per owned key: blocks << SERVED_BITS | served
        for g in range(G):
            e = add(key0, g)
            cum = const(0)
            for w in range(W):
                addr = _lds_addr(lds_base, add(e, w * STRIDE))
                h = mx.lds_load(1, addr)
                mx.lds_store(cum, addr)
                cum = add(cum, h)
            s = served_flags[g]
            count = select(mx.cmp_ne(s, 0), cum, 0)
            packed.append(bor(shl(_udiv(add(count, BM - 1), BM), SERVED_BITS), s))
        inclusive = []
        running = const(0)
        for v in packed:
            running = add(running, v)
            inclusive.append(running)
        lane_incl = _wave_inclusive_scan(running)
        if W == 1:
            before = sub(lane_incl, running)
            grand = rocdl.readlane(mx.i32_t(), val(lane_incl), const(WAVE - 1))
        else:
            mx.if_then(mx.cmp_eq(lane, const(WAVE - 1)),
                       lambda: mx.lds_store(lane_incl, _lds_addr(lds_base, add(wave, WTOT))))
            _barrier()
            totals = [mx.lds_load(1, _lds_addr(lds_base, const(WTOT + w))) for w in range(W)]
            wave_before = const(0)
            grand = const(0)
            for w in range(W):
                wave_before = add(wave_before, select(mx.cmp_ult(const(w), wave), totals[w], 0))
                grand = add(grand, totals[w])
            before = add(wave_before, sub(lane_incl, running))
        for g in range(G):
            e = add(key0, g)
            incl = add(before, inclusive[g])
            mx.lds_store(incl, _lds_addr(scan_base, e))
            n_blk = lshr(packed[g], SERVED_BITS)
            row_start = mul(sub(lshr(incl, SERVED_BITS), n_blk), BM)
            is_served = mx.cmp_ne(band(packed[g], 1), 0)
            for w in range(W):
                addr = _lds_addr(lds_base, add(e, w * STRIDE))
                mx.lds_store(select(is_served, add(mx.lds_load(1, addr), row_start), DROP), addr)
        used_blocks = lshr(grand, SERVED_BITS)
        used_rows = mul(used_blocks, BM)
        mx.if_then(mx.cmp_eq(tid, const(0)), lambda: mx.store(mx.from_elements([used_rows, t_count]), r_nv, const(0)))
        _barrier()

        # ---- 3. padding everywhere, the experts of the blocks --------------------------------
        pad = bor(const(TOPK << TOKEN_BITS), t_count)
        pads = mx.from_elements([pad] * 4)
        zeros = mx.from_elements([const(0)] * 4)

        def fill_rows(i):
            off = shl(add(mul(i, N), tid), 4)  # 4 rows per lane; the last chunk's tail is dropped
            mx.store(pads, r_sid, off)
            mx.store(zeros, r_sw, off)

        mx.for_range(lshr(add(rows, 4 * N - 1), 2 + SLICE_SHIFT), fill_rows)

        def owner_local_id(b):
            """Local id of the expert owning used block b: binary search for the first e with
            (scan[e] >> SERVED_BITS) > b, then served experts through it, minus one."""
            pos = const(0)
            step = 1 << (E.bit_length() - 1)
            while step:
                cand = add(pos, step)
                idx = arith.minui(sub(cand, 1), const(E - 1))
                ends = lshr(mx.lds_load(1, _lds_addr(scan_base, idx)), SERVED_BITS)
                take = arith.andi(mx.cmp_ule(cand, E), mx.cmp_ule(ends, b))
                pos = select(take, cand, pos)
                step >>= 1
            own = arith.minui(pos, const(E - 1))
            return sub(band(mx.lds_load(1, _lds_addr(scan_base, own)), (1 << SERVED_BITS) - 1), 1)

        def fill_blocks(i):
            b = add(mul(i, N), tid)
            used = mx.cmp_ult(b, used_blocks)
            (local,) = mx.if_else(mx.wave_any(used), lambda: [owner_local_id(b)], lambda: [const(-1)],
                                  [mx.i32_t()])
            mx.store(select(used, local, -1), r_se, shl(b, 2))

        mx.for_range(lshr(add(blocks, N - 1), SLICE_SHIFT), fill_blocks)
        _barrier()

        # ---- 4. place the pairs ----------------------------------------------------------------
        lanes_below = sub(shl(_c64(1), arith.extui(_i64(), lane)), _c64(1))

        def place(p, key, weight):
            # peers: lanes whose key agrees with this lane's on every bit. Per bit b, clear = all
            # ones where the lane's bit b is 0 (a sign-extended bit of ~key), and votes ^ clear
            # is the ballot of the lanes whose bit b equals this lane's.
            # (32-bit halves: the mask applies to both; `clear` is opaque so that the ballot
            # compares it, one v_cmp, instead of re-deriving the bit.)
            not_key = arith.xori(val(key), const(-1))
            peers_lo, peers_hi = const(-1), const(-1)
            for bit in range(KEY_BITS):
                clear = _opaque_vgpr(_sign_extended_bit(not_key, bit))
                votes = _ballot(mx.cmp_eq(clear, const(0)))
                votes_lo = arith.trunci(mx.i32_t(), votes)
                votes_hi = arith.trunci(mx.i32_t(), arith.shrui(votes, _c64(32)))
                peers_lo = band(peers_lo, arith.xori(votes_lo, clear))
                peers_hi = band(peers_hi, arith.xori(votes_hi, clear))
            below_lo = arith.trunci(mx.i32_t(), lanes_below)
            below_hi = arith.trunci(mx.i32_t(), arith.shrui(lanes_below, _c64(32)))
            rank = add(_popcount(band(peers_lo, below_lo)), _popcount(band(peers_hi, below_hi)))
            peer_count = add(_popcount(peers_lo), _popcount(peers_hi))
            addr = _lds_addr(hist_wave, key)
            cursor = mx.lds_load(1, addr)
            mx.lds_store(add(cursor, peer_count), addr)
            row = add(cursor, rank)
            off = select(mx.cmp_ult(row, rows), shl(row, 2), OOB)  # DROP rows are negative: >= rows unsigned
            token = _udiv(p, TOPK)
            slot = sub(p, mul(token, TOPK))
            mx.store(bor(shl(slot, TOKEN_BITS), token), r_sid, off)
            mx.store(weight, r_sw, off)

        def place_round(r):
            p, key = pair_of(r)
            place(p, key, load_weight(r_w, p))

        place(p_first, key_first, weight_first)
        _for_range_from(1, n_rounds, place_round)

    @flyc.kernel(name=name, known_block_size=[N, 1, 1])
    def kernel(
        topk_ids: fx.Tensor,  # (T, topk) int32 / int64, contiguous
        topk_weights: fx.Tensor,  # (T, topk) f32 / bf16 / f16, contiguous
        expert_mask: fx.Tensor,  # (E,) bool / integer, or any tensor when unmasked (never read)
        sorted_ids: fx.Tensor,  # (R,) int32
        sorted_weights: fx.Tensor,  # (R,) f32
        sorted_expert_ids: fx.Tensor,  # (ceil(R / block_m),) int32
        num_valid_ids: fx.Tensor,  # (2,) int32
        moe_buf: fx.Tensor,  # zeroed by workgroups 1.. (any tensor when they are not launched)
        tokens: fx.Int32,  # T
        moe_buf_bytes: fx.Int32,
    ):
        body(topk_ids, topk_weights, expert_mask, sorted_ids, sorted_weights, sorted_expert_ids, num_valid_ids,
             moe_buf, tokens, moe_buf_bytes)

    @flyc.jit
    def launch(
        topk_ids: fx.Tensor,
        topk_weights: fx.Tensor,
        expert_mask: fx.Tensor,
        sorted_ids: fx.Tensor,
        sorted_weights: fx.Tensor,
        sorted_expert_ids: fx.Tensor,
        num_valid_ids: fx.Tensor,
        moe_buf: fx.Tensor,
        tokens: fx.Int32,
        moe_buf_bytes: fx.Int32,
        workgroups: fx.Int32,
        stream: fx.Stream = fx.Stream(None),
    ):
        assert source and name  # closure values, so FlyDSL's disk cache keys on them (sources, variant)
        kernel(topk_ids, topk_weights, expert_mask, sorted_ids, sorted_weights, sorted_expert_ids, num_valid_ids,
               moe_buf, tokens, moe_buf_bytes).launch(grid=(workgroups, 1, 1), block=(N, 1, 1), stream=stream)

    return launch


_cached_launcher = toolchain.launcher_cache(build_moe_sorting)


# ------------------------------------------------------------------------------------------------
# Configuration and the torch-facing launcher
# ------------------------------------------------------------------------------------------------

# Pairs per launch from which a wave count pays: one wave walks 64 pairs per round (about 80
# instructions), more waves split the rounds at the cost of their setup and a larger scan.
WAVES_FROM_PAIRS = ((8 * 1024, 8), (1024, 4), (0, 1))


def choose_waves(pairs: int, experts: int, arch: str) -> int:
    """Waves for the sorting workgroup: by pairs (WAVES_FROM_PAIRS), fewer if the LDS does not fit."""
    want = next(w for limit, w in WAVES_FROM_PAIRS if pairs >= limit)
    for waves in sorted((w for w in WAVE_COUNTS if w <= want), reverse=True):
        spec = SortSpec(arch, experts, 1, 1, 4, "f32", 0, waves)
        if spec.lds_bytes <= LDS_BUDGET:
            return waves
    return 1


def sorted_shapes(tokens: int, topk: int, experts: int, block_m: int) -> tuple[int, int]:
    """(rows, blocks) of the sorted arrays: aiter's worst case."""
    rows = tokens * topk + experts * block_m - topk
    return rows, -(-rows // block_m)


def check_supported(topk_ids, topk_weights, num_experts, block_m, expert_mask=None, moe_buf=None) -> None:
    """Raise a ValueError/TypeError naming what this kernel does not take (the contract's own
    checks, flyquant.moe, come first in the API)."""
    validate.tensor(topk_ids, "topk_ids", tuple(ID_DTYPES), ndim=2)
    validate.tensor(topk_weights, "topk_weights", tuple(WEIGHT_DTYPES), ndim=2)
    validate.shape(topk_weights, "topk_weights", tuple(topk_ids.shape))
    validate.contiguous(topk_ids, "topk_ids")
    validate.contiguous(topk_weights, "topk_weights")
    validate.same_device("topk_ids", topk_ids, "topk_weights", topk_weights)
    tokens, topk = topk_ids.shape
    if not validate.is_int(num_experts) or not 0 < num_experts <= MAX_EXPERTS:
        raise ValueError(f"num_experts must be an int in [1, {MAX_EXPERTS}] for the sorting kernel, got {num_experts!r}")
    if not validate.is_int(block_m) or not 0 < block_m <= MAX_BLOCK_M:
        raise ValueError(f"block_m must be an int in [1, {MAX_BLOCK_M}] for the sorting kernel, got {block_m!r}")
    if not 0 < topk <= min(num_experts, MAX_TOPK):
        raise ValueError(f"topk = topk_ids.shape[1] = {topk} must be in [1, min(num_experts, {MAX_TOPK})]")
    if tokens * topk > MAX_PAIRS:
        raise ValueError(f"T * topk = {tokens * topk} routed pairs: one sorting launch takes at most {MAX_PAIRS}")
    if expert_mask is not None:
        validate.tensor(expert_mask, "expert_mask", MASK_DTYPES, ndim=1)
        validate.shape(expert_mask, "expert_mask", (num_experts,))
        validate.contiguous(expert_mask, "expert_mask")
        validate.same_device("topk_ids", topk_ids, "expert_mask", expert_mask)
    if moe_buf is not None:
        validate.tensor(moe_buf, "moe_buf")
        validate.contiguous(moe_buf, "moe_buf")
        validate.same_device("topk_ids", topk_ids, "moe_buf", moe_buf)
        validate.no_overlap(moe_buf, "moe_buf", {"topk_ids": topk_ids, "topk_weights": topk_weights,
                                                 "expert_mask": expert_mask})
        if moe_buf.nbytes % 4 or moe_buf.nbytes >= MAX_MOE_BUF_BYTES:
            raise ValueError(f"moe_buf must span a multiple of 4 bytes below {MAX_MOE_BUF_BYTES}, got {moe_buf.nbytes}")


def moe_sorting(topk_ids, topk_weights, num_experts: int, block_m: int, expert_mask=None, *, arch: str,
                moe_buf=None, out=None, waves: int | None = None):
    """Launch the sorting kernel for `arch` on the tensors' device (CPU tensors: the emulator),
    on torch's current stream, without a host synchronisation. Returns (sorted_ids,
    sorted_weights, sorted_expert_ids, num_valid_ids) as flyquant.reference.moe_sorting, with
    pairs whose id is outside [0, num_experts) dropped. moe_buf: zeroed in the same launch.
    out: the four output tensors to write (int32 (R,), float32 (R,), int32 (blocks,), int32
    (2,)), else they are allocated."""
    info = arch_info(arch)
    check_supported(topk_ids, topk_weights, num_experts, block_m, expert_mask, moe_buf)
    tokens, topk = topk_ids.shape
    rows, blocks = sorted_shapes(tokens, topk, num_experts, block_m)
    device = topk_ids.device
    if out is None:
        out = (torch.empty(rows, dtype=torch.int32, device=device), torch.empty(rows, dtype=torch.float32, device=device),
               torch.empty(blocks, dtype=torch.int32, device=device), torch.empty(2, dtype=torch.int32, device=device))
    else:
        for (name, dt, n), t in zip((("sorted_ids", torch.int32, rows), ("sorted_weights", torch.float32, rows),
                                     ("sorted_expert_ids", torch.int32, blocks), ("num_valid_ids", torch.int32, 2)), out):
            validate.tensor(t, name, (dt,), ndim=1)
            validate.shape(t, name, (n,))
            validate.contiguous(t, name)
            validate.same_device("topk_ids", topk_ids, name, t)
    waves = choose_waves(tokens * topk, num_experts, info.name) if waves is None else waves
    if not validate.is_int(waves) or waves not in WAVE_COUNTS:
        raise ValueError(f"waves must be one of {WAVE_COUNTS}, got {waves!r}")
    spec = SortSpec(
        arch=info.name, experts=num_experts, topk=topk, block_m=block_m, id_bytes=ID_DTYPES[topk_ids.dtype],
        weight=WEIGHT_DTYPES[topk_weights.dtype], mask_bytes=0 if expert_mask is None else expert_mask.element_size(),
        waves=waves,
    )
    if spec.lds_bytes > info.lds_bytes_per_cu:
        raise ValueError(f"{spec.name} needs {spec.lds_bytes} bytes of LDS, {info.name} has {info.lds_bytes_per_cu}")
    buf_bytes = 0 if moe_buf is None else moe_buf.nbytes
    zero_wgs = -(-buf_bytes // (spec.threads * ZERO_BYTES_PER_LANE * ZERO_ROUNDS))
    num_valid = out[3]
    mask_arg = num_valid if expert_mask is None else expert_mask.view(torch.uint8).view(-1) if expert_mask.dtype == torch.bool else expert_mask
    buf_arg = num_valid if moe_buf is None else moe_buf.view(-1).view(torch.uint8)
    with toolchain.target(info.name, topk_ids.device):
        _cached_launcher(spec)(
            topk_ids, topk_weights, mask_arg, *out, buf_arg, tokens, buf_bytes, 1 + zero_wgs,
            stream=toolchain.stream(topk_ids),
        )
    return out
