"""The A16W4 MoE kernels' shared pieces (both stages, kernels/_a16w4_main_loop.py documents the
kernel): aiter's layout constants, the compile-time configuration and its wave split, small device
helpers (buffer loads, the FP4 -> BF16 unpacks, ballots) and the launch bounds both torch-facing
launchers use. Stage 1's epilogue is kernels/_a16w4_stage1_epilogue.py."""

from __future__ import annotations

from dataclasses import dataclass

import torch

import flydsl.expr as fx
from flydsl._mlir import ir
from flydsl._mlir.dialects import arith, llvm, vector
from flydsl.expr import range_constexpr, rocdl
from flydsl.expr.typing import T
from flydsl.expr.typing import Vector as Vec

from flyquant import validate

from . import _mx_common as mx
from ._mx_common import i32_bits

# ---- layout constants (aiter's A16W4 shuffles) -------------------------------------------------
WAVE = 64
WAVES = 4  # default waves per workgroup
WAVE_COUNTS = (1, 2, 4)
MFMA_MN = 16  # 16x16 MFMA output blocks
K_STEP = 128  # K covered by one 16-byte FP4 pack per lane (4 lanes x 32 along K)
K_CHUNK = 32  # FP4 values per lane per step (16 bytes); also the MX block
KT = 256  # K per loop iteration: two steps, one scale dword
W_TILE_BYTES = 1024  # one 16 (N) x 128 (K) weight tile: 64 lanes x 16 bytes
S_TILE_BYTES = 256  # one 32 (N) x 256 (K) scale tile: 64 lanes x 4 bytes
A_BYTES_PER_LANE = 64  # 32 bf16 per lane per step
TOKEN_BITS = 24
TOKEN_MASK = (1 << TOKEN_BITS) - 1
# A buffer offset past every num_records: the load returns 0, a store is dropped. Past a2's too:
# a2's buffer (one per token window) is at most BUFFER_MAX_BYTES = OOB bytes, so that OOB plus any
# instruction offset stays out of range (a masked K chunk must read 0, never a2's bytes there,
# which may be NaN: NaN x a masked weight of 0 is NaN)
OOB = 0x7FFFFFF0
# An offset bit past every expert's weights (below 1 GiB, checked by the launcher): or-ed into a
# weight offset it makes the load read 0, and the step's constant offset still folds into the
# instruction (a select of OOB would take an add per load)
W_PAST_END = 1 << 30
F32_MANT_BITS = 23

TILE_MS = (16, 32, 64)
TILE_NS = (64, 128, 256)
OUT_DTYPES = (torch.bfloat16, torch.float32)
BIAS_DTYPES = (torch.bfloat16, torch.float32)
ACTIVATIONS = ("silu", "gelu", "swiglu_oai")  # stage 1 (kernels/_a16w4_stage1_epilogue.py)
LDS_REDUCE_BUDGET = 32 * 1024  # keeps 2 workgroups per CU on gfx942 (64 KiB LDS)
MAX_ACC_PER_LANE = 64  # accumulator registers per lane (16x16 block = 4): more spill to AGPR copies
MAX_WAVE_N = 128  # columns per wave: two 128-wide steps of B in flight = 64 VGPRs
SPARSE_ROWS = 8  # stage 1: a tile with at most this many live rows takes the sparse epilogue
SPARSE_SLOTS = SPARSE_ROWS + 1  # ... whose last LDS slot takes the writes of rows without a pair


# gfx942 software unpack (_sw_tables, _unpack_sw)
E2M1_MAGNITUDES = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0)  # FP4 magnitude codes 0..7
F32_EXPONENT = 0x7F800000
F32_E8M0_ZERO = 0x00400000  # 2^-127, E8M0 code 0: an FP32 denormal
F32_NAN = 0x7FC00000  # E8M0 code 255
SEL_MAG = 0x07070707  # per-byte 3-bit magnitude of the low nibble
SIGN_BYTES = i32_bits(0x80808080)
PERM_LO_PAIRS = 0x05010400  # [lo.b0, hi.b0, lo.b1, hi.b1]: bf16 of lookups 0 and 1
PERM_HI_PAIRS = 0x07030602  # [lo.b2, hi.b2, lo.b3, hi.b3]: bf16 of lookups 2 and 3
PERM_EVEN_HALVES = 0x05040100  # bf16 0 of two dwords
PERM_ODD_HALVES = 0x07060302  # bf16 1 of two dwords


def m_tiling(tokens: int, topk: int, experts: int) -> tuple[int, int]:
    """(tile_m, m-tiles in use) both stages size for: tile_m covers the average rows per active
    expert (the smallest tile that does, else the largest)."""
    pairs = max(1, tokens * topk)
    active = min(experts, pairs)
    rows_per_expert = -(-pairs // active)
    tile_m = next((m for m in TILE_MS if m >= rows_per_expert), TILE_MS[-1])
    return tile_m, active * -(-rows_per_expert // tile_m)


def k_iterations(inter_dim: int) -> int:
    """The KT-wide K iterations covering inter_dim (the last one may be partly past it)."""
    return -(-inter_dim // KT)


def wave_fits(tile_m: int, tile_n: int, wn: int, wk: int, pair: bool = False) -> bool:
    """Whether wn x wk waves can split a tile_m x tile_n tile (wn along N, wk along K): whole
    16-column blocks per wave, at most MAX_WAVE_N columns and MAX_ACC_PER_LANE accumulators per
    wave, the LDS reduction of the wk partial tiles within LDS_REDUCE_BUDGET. pair (stage 1):
    whole 32-column (gate block, up block) pairs per wave."""
    wave_n = tile_n // wn
    if pair and tile_n % (wn * 2 * MFMA_MN):
        return False
    acc = tile_m * wave_n // WAVE
    return (tile_n % (wn * MFMA_MN) == 0 and wave_n <= MAX_WAVE_N and acc <= MAX_ACC_PER_LANE
            and reduce_lds_bytes(tile_m, tile_n, wk) <= LDS_REDUCE_BUDGET)


def reduce_lds_bytes(tile_m: int, tile_n: int, wk: int) -> int:
    """LDS of the wk reduction: the wk - 1 partial FP32 tiles the other K waves hand to wave 0."""
    return (wk - 1) * tile_m * tile_n * 4


def default_waves(tile_m: int, tile_n: int, n_kt: int, k_batch: int, pair: bool = False) -> int:
    """2 waves per workgroup when a 2-wave split fits, else 4. Fewer, longer waves spend fewer
    instructions on per-wave setup and epilogue (wave-instructions per MFMA, measured under the
    emulator, drop ~10-20% from 4 waves to 2 at 1-5 tokens); 2 waves with split K still keep
    many loads in flight at small token counts (at 1 token, GPT-OSS-like: 276 workgroups x 2
    waves x 2 steps of 8 KiB of weights)."""
    try:
        default_layout(tile_m, tile_n, n_kt, k_batch, 2, pair)
        return 2
    except ValueError:
        return WAVES


def default_layout(tile_m: int, tile_n: int, n_kt: int, k_batch: int, waves: int = WAVES,
                   pair: bool = False) -> tuple[int, int]:
    """(wn, wk) for `waves` waves per workgroup: the most K-parallel split that fits (more waves
    along K = more columns per wave = fewer A loads per MFMA) and leaves every wave at least one
    256-wide K step."""
    for wk in (4, 2, 1):
        if waves % wk == 0 and wave_fits(tile_m, tile_n, waves // wk, wk, pair) and k_batch * wk <= n_kt:
            return waves // wk, wk
    raise ValueError(f"tile {tile_m}x{tile_n}, {waves} waves, k_batch {k_batch} over {n_kt} K steps of {KT}: no wave split fits")


@dataclass(frozen=True)
class Gemm2Config:
    """Everything a compiled kernel is specialised on."""

    arch: str
    out_dtype: torch.dtype
    tile_m: int
    tile_n: int
    k_batch: int
    wn: int  # waves along N
    wk: int  # waves along K (wn * wk waves per workgroup)
    model_dim: int  # true N (output columns)
    inter_dim: int  # true K
    w_n: int  # the weights' N (model_dim padded)
    w_k: int  # the weights' K (inter_dim padded)
    a_stride: int  # a2 row stride (elements)
    topk: int
    block_m: int
    apply_weights: bool
    bias_dtype: torch.dtype | None  # None: no bias
    windowed: bool = False  # a2 past one 32-bit buffer: one launch per window of tokens (token_windows)
    # Stage 1 (stage=1, see STAGE1_DOC): the same GEMM on the gate_up weights read as one (w_n, w_k)
    # matrix, model_dim = 2 * inter_dim (its N), inter_dim = the hidden size (its K), a_stride x's
    stage: int = 2
    activation: str = ""
    alpha: float = 1.702
    limit: float = 7.0
    out_stride: int = 0  # stage 1: a2 row stride (elements)

    @property
    def waves(self) -> int:
        return self.wn * self.wk

    @property
    def n_kt(self) -> int:
        return k_iterations(self.inter_dim)

    @property
    def n_tiles(self) -> int:
        return -(-self.model_dim // self.tile_n)

    @property
    def sparse_lds_bytes(self) -> int:
        """Stage 1's sparse epilogue (kernels/_a16w4_stage1_epilogue.py): per wave along N, SPARSE_SLOTS
        slots of its g and u (FP32) and of each slot's a2 row and weight; 0 (dense only) where it would
        take the LDS past LDS_REDUCE_BUDGET."""
        need = SPARSE_SLOTS * (4 * self.tile_n + 16 * self.wn)  # 16 bytes per slot's row: aligned waves
        return need if self.stage == 1 and self.reduce_lds_bytes + need <= LDS_REDUCE_BUDGET else 0

    @property
    def reduce_lds_bytes(self) -> int:
        return reduce_lds_bytes(self.tile_m, self.tile_n, self.wk)

    @property
    def lds_bytes(self) -> int:
        return self.reduce_lds_bytes + self.sparse_lds_bytes

    @property
    def name(self) -> str:
        return kernel_name(self.stage, self.arch, self.out_dtype, self.tile_m, self.tile_n, self.k_batch, self.wn,
                           self.wk, self.model_dim, self.inter_dim, self.apply_weights, self.windowed,
                           self.bias_dtype is not None, self.activation, self.alpha, self.limit)


def kernel_name(stage: int, arch: str, out_dtype: torch.dtype, tile_m: int, tile_n: int, k_batch: int, wn: int, wk: int,
                model_dim: int, inter_dim: int, apply_weights: bool, windowed: bool, bias: bool, activation: str = "",
                alpha: float = 1.702, limit: float = 7.0) -> str:
    """A compiled stage kernel's name (Gemm2Config's fields; stage 1: model_dim = 2 * its inter_dim, inter_dim =
    its hidden size), also what flyquant.select's plans call it."""
    if stage == 1:
        act = activation
        if act == "swiglu_oai":
            # a symbol: '.' and '-' spelled out, an exponent's '+' dropped (repr puts it only after 'e')
            act += f"_a{float(alpha)!r}_l{float(limit)!r}".replace(".", "p").replace("-", "m").replace("+", "")
        opt = ("_w" if apply_weights else "") + ("_win" if windowed else "") + ("_bias" if bias else "")
        return f"moe_gemm1_a16w4_{act}_{tile_m}x{tile_n}_w{wn}x{wk}{opt}_i{model_dim // 2}_k{inter_dim}_{arch}"
    out = "bf16" if out_dtype == torch.bfloat16 else "f32"
    wts = ("_w" if apply_weights else "") + ("_win" if windowed else "")
    return (f"moe_gemm2_a16w4_{out}_{tile_m}x{tile_n}_kb{k_batch}_w{wn}x{wk}{wts}{'_bias' if bias else ''}"
            f"_n{model_dim}_k{inter_dim}_{arch}")


def launch_geometry(stage: int, act: torch.Tensor, act_rows: int, width: int, out_span: tuple[int, int, int],
                    tile_m: int, tile_n: int, k_batch: int, waves: int,
                    n_kt: int) -> tuple[int, int, list[tuple[int, int]]]:
    """(wn, wk, token windows) of a stage launch (1 or 2), one rule for the launchers and the plans: the
    wave layout of the tiles, and the windows of the activations `act` (act_rows rows per token) as the
    kernel reads them: act's own rows at unit column stride, else the launcher's contiguous copy of
    `width` columns; out_span the output's (rows per token, row bytes, pitch bytes) (token_windows)."""
    wn, wk = default_layout(tile_m, tile_n, n_kt, k_batch, waves, pair=stage == 1)
    row_stride, cols = (act.stride(0), act.shape[1]) if act.stride(1) == 1 else (width, width)
    return wn, wk, token_windows(act.shape[0] // act_rows, (act_rows, 2 * cols, 2 * row_stride), out_span)


def planned_name(stage: int, arch: str, config: dict, act: torch.Tensor, act_rows: int, width: int,
                 out_span: tuple[int, int, int], model_dim: int, inter_dim: int, **name) -> str:
    """The name of the stage kernel (1 or 2) its launcher compiles for a plan's config (tile_m, tile_n,
    [k_batch,] waves), by the launchers' launch_geometry and kernel_name."""
    tm, tn, kb = config["tile_m"], config["tile_n"], config.get("k_batch", 1)
    n_kt = k_iterations(inter_dim if stage == 2 else model_dim)
    wn, wk, windows = launch_geometry(stage, act, act_rows, width, out_span, tm, tn, kb, config["waves"], n_kt)
    dims = (model_dim, inter_dim) if stage == 2 else (2 * inter_dim, model_dim)
    return kernel_name(stage, arch, name.pop("out_dtype", torch.bfloat16), tm, tn, kb, wn, wk, *dims,
                       windowed=len(windows) > 1, **name)


# ---- small device helpers ----------------------------------------------------------------------


def _i32(v):
    return fx.Int32(v)


def _rsrc(addr, nbytes, own: str | None = None):
    """Buffer resource over [addr, addr + nbytes): loads past the end return 0. `own` (a name
    unique in the kernel) gives the descriptor registers of its own: LLVM otherwise builds
    descriptors that share a word (the flags, an equal size) from one register and, in a loop
    that needs all four quads at once, copies the shared words back into each quad every
    iteration (s_movs in the main loop)."""
    if own is None:
        ptr_ty = fx.PointerType.get(T.i32, address_space=fx.AddressSpace.Global, alignment=4)
        return rocdl.get_buffer_rsrc(rocdl.make_buffer_ptr(fx.inttoptr(ptr_ty, addr), num_records_bytes=fx.Int64(nbytes)))
    base = llvm.inttoptr(ir.Type.parse("!llvm.ptr<1>"), mx.opaque_sgpr(fx.Int64(addr), f"{own} base"))
    return rocdl.MakeBufferRsrcOp(ir.Type.parse("!llvm.ptr<8>"), base, mx.const(0, T.i16),
                                  mx.opaque_sgpr(fx.Int64(nbytes), f"{own} size"),
                                  mx.opaque_sgpr(mx.CDNA_BUFFER_FLAGS, f"{own} flags")).result


def _zext(x):
    """A non-negative i32 as i64: zero-extended, so a byte offset folds into the load (an SGPR
    offset) and a size needs no 64-bit shift."""
    return fx.Int64(fx.Uint32(x))


def _scalar_load(addr):
    """One wave-uniform i32 at a global address that the kernel never writes: s_load_dword."""
    ptr = llvm.inttoptr(ir.Type.parse("!llvm.ptr<1>"), fx.Int64(addr).ir_value())
    return fx.Int32(llvm.load(T.i32, ptr, alignment=4, invariant=True))


def _load(rsrc, voffset, soffset, dwords: int):
    """buffer_load_dword{,x2,x4}: `dwords` i32 per lane at rsrc + soffset + voffset (bytes)."""
    res = T.i32 if dwords == 1 else T.vec(dwords, T.i32)
    v = rocdl.raw_ptr_buffer_load(res, rsrc, _i32(voffset).ir_value(), _i32(soffset).ir_value(), 0)
    return fx.Int32(v) if dwords == 1 else Vec(v)


def _perm(hi, lo, sel: int):
    """v_perm_b32: byte i of the result = byte sel_i of the 8-byte value (hi:lo)."""
    return fx.Int32(rocdl.perm_b32(hi, lo, fx.Int32(sel)))


def _as_f32(bits):
    return fx.Int32(bits).bitcast(fx.Float32)


def _ballot(pred):
    return fx.Int64(rocdl.ballot(T.i64, pred))


def _lanes_below(mask):
    """Number of set bits of the wave mask in lanes below this one (v_mbcnt)."""
    lo = fx.Int32(mask)
    hi = fx.Int32(mask >> 32)
    below_lo = rocdl.mbcnt_lo(T.i32, lo.ir_value(), fx.Int32(0).ir_value())
    return fx.Int32(rocdl.mbcnt_hi(T.i32, hi.ir_value(), below_lo))


def _scale_f32(dword, byte: int):
    """An f32 whose exponent field is byte `byte` of `dword`: the form of an E8M0 scale that
    v_cvt_scalef32_pk_bf16_fp4 reads (it uses the exponent field only)."""
    shift = F32_MANT_BITS - 8 * byte
    return _as_f32(dword << shift if shift >= 0 else dword.shrui(fx.Int32(-shift)))


def _unpack_hw(dword, scale):
    """gfx950: 8 FP4 (one dword, element 2i in the low nibble of byte i) times the scale -> 8
    BF16 in order, 4 x v_cvt_scalef32_pk_bf16_fp4."""
    words = []
    for sel in range_constexpr(4):
        pk = rocdl.cvt_scalef32_pk_bf16_fp4(T.vec(2, T.bf16), dword, scale, sel)
        words.append(Vec(pk).bitcast(fx.Int32)[0])
    return words


def _sw_tables(dword, byte: int):
    """gfx942: for the scales s = bytes `byte` and `byte` + 1 of `dword`, the BF16 bytes of
    fp4(c) * 2^(s - 127) for the 8 magnitude codes c: per scale (lo0, lo1, hi0, hi1), low/high BF16
    byte of codes 0..3 / 4..7 (a table nobody uses costs nothing: LLVM drops it).

    The 8 products per scale in FP32, both scales' in one v_pk_mul_f32 per code (a pair of
    defined registers: a broadcast of one scale left the pair's high register undefined, and
    LLVM gave it one a pending load writes, then waited for that load mid-step), are exact for
    every s, and so are their high halves, the BF16 values: 2 significant bits, FP32 denormals
    kept (the kernels' float mode) from s = 0 (2^-127, a denormal scale) on, a product past FP32's
    range inf, s = 255 NaN for every code (flyquant.reference's dequantize: 0 x NaN is NaN). Four
    v_perm_b32 per 4 codes gather their bytes 2 and 3."""
    scales = []
    for b in range_constexpr(byte, byte + 2):
        bits = mx.band(mx.val(_scale_f32(dword, b).bitcast(fx.Int32)), F32_EXPONENT)  # 2^(s - 127), s >= 1
        scales.append(mx.as_f32(mx.select(mx.cmp_eq(bits, F32_EXPONENT), F32_NAN, mx.umax(bits, F32_E8M0_ZERO))))
    pair_t = ir.VectorType.get([2], mx.f32_t())
    scale = vector.from_elements(pair_t, scales)
    products = [[], []]  # per scale
    for c in range_constexpr(8):
        prod = arith.mulf(vector.broadcast(pair_t, arith.constant(mx.f32_t(), E2M1_MAGNITUDES[c])), scale)
        for h in range_constexpr(2):
            products[h].append(fx.Int32(mx.as_i32(mx.extract(prod, h))))
    tables = []
    for p in products:
        # codes (c, c + 1): [lo c, lo c + 1, hi c, hi c + 1]; then the low and high bytes of 4 codes
        pairs = [_perm(p[c + 1], p[c], PERM_HI_PAIRS) for c in range_constexpr(0, 8, 2)]
        lo0, hi0 = (_perm(pairs[1], pairs[0], sel) for sel in (PERM_EVEN_HALVES, PERM_ODD_HALVES))
        lo1, hi1 = (_perm(pairs[3], pairs[2], sel) for sel in (PERM_EVEN_HALVES, PERM_ODD_HALVES))
        tables.append((lo0, lo1, hi0, hi1))
    return tables


def _unpack_sw(dword, tables):
    """gfx942: 8 FP4 of one dword -> 8 BF16 (scaled) as 4 dwords in the element order
    (0, 2), (4, 6), (1, 3), (5, 7): the even-nibble and odd-nibble magnitudes index the byte
    tables (v_perm_b32), the nibble's sign bit is OR-ed into the high byte, and two more perms
    interleave low/high bytes into BF16 pairs. 14 VALU per dword."""
    lo0, lo1, hi0, hi1 = tables
    sel_even = dword & SEL_MAG
    sel_odd = dword.shrui(fx.Int32(4)) & SEL_MAG
    lo_e = _perm(lo1, lo0, sel_even)
    lo_o = _perm(lo1, lo0, sel_odd)
    hi_e = _perm(hi1, hi0, sel_even) | ((dword << 4) & SIGN_BYTES)
    hi_o = _perm(hi1, hi0, sel_odd) | (dword & SIGN_BYTES)
    return [
        _perm(hi_e, lo_e, PERM_LO_PAIRS),
        _perm(hi_e, lo_e, PERM_HI_PAIRS),
        _perm(hi_o, lo_o, PERM_LO_PAIRS),
        _perm(hi_o, lo_o, PERM_HI_PAIRS),
    ]


def _a_operands_sw(a_dwords):
    """gfx942: the 8 BF16 of one A chunk (4 dwords, natural order) regrouped as the two K=16
    operands matching _unpack_sw's order: (a0, a2, a4, a6) and (a1, a3, a5, a7)."""
    d0, d1, d2, d3 = a_dwords
    even = [_perm(d1, d0, PERM_EVEN_HALVES), _perm(d3, d2, PERM_EVEN_HALVES)]
    odd = [_perm(d1, d0, PERM_ODD_HALVES), _perm(d3, d2, PERM_ODD_HALVES)]
    return even, odd


def _udiv(x, d: int):
    """x // d for x >= 0 and a constant d: a shift for powers of two, else an unsigned divide
    (a multiply-high); the signed // costs sign fix-ups."""
    if d & (d - 1) == 0:
        return x.shrui(fx.Int32(d.bit_length() - 1))
    return fx.Int32(fx.arith.divui(x.ir_value(), fx.Int32(d).ir_value()))


def _vec_i32(words):
    return Vec.from_elements([_i32(w) for w in words], fx.Int32)


def bias_blocks(bias, bias_stride, expert, first, col_wave, kl, nb: int, pair: bool, row_elems: int, bias_bytes: int):
    """The expert's bias at lane (kl, .)'s 4 columns of each of the wave's nb 16-column blocks, as
    4 x f32 vectors (bf16 widened exactly); `first` false gives an empty buffer (loads read 0).
    pair (stage 1): blocks are (gate, up) pairs, gate columns [0, P) and up columns [P, 2P) of the
    expert's row of row_elems = 2P; stage 2: columns past row_elems = model_dim read 0. (Starting
    the accumulators from it instead saves the adds but costs every other K worker the loads and
    conversions: more instructions at the split-K token counts.)"""
    b_row = bias + _zext(expert) * _zext(bias_stride) * bias_bytes
    b_rsrc = _rsrc(b_row, first.select(fx.Int64(row_elems * bias_bytes), fx.Int64(0)))
    blocks = []
    for j in range_constexpr(nb):
        if pair:
            col = col_wave.shrui(fx.Int32(1)) + kl * 4 + (j % 2) * (row_elems // 2) + j // 2 * MFMA_MN
        else:
            col = col_wave + kl * 4 + j * MFMA_MN
        words = _load(b_rsrc, col * bias_bytes, 0, bias_bytes)
        if bias_bytes == 4:
            vals = [words[i].bitcast(fx.Float32) for i in range_constexpr(4)]
        else:  # bf16 = the high half of an f32
            vals = [((words[i // 2] << 16) if i % 2 == 0 else (words[i // 2] & i32_bits(0xFFFF0000))).bitcast(fx.Float32)
                    for i in range_constexpr(4)]
        blocks.append(Vec.from_elements(vals, fx.Float32).ir_value())
    return blocks


def m_grid(tokens: int, topk: int, experts: int, sorted_rows: int, tile_m: int) -> tuple[int, bool]:
    """(m-slots to launch, compact) from shapes alone (no device read): the m-tiles that can hold
    a routing pair number at most T*topk (one pair each) and at most T*topk/tile_m + min(E, T*topk)
    (whole tiles plus one partial tile per active expert). Below the sorted arrays' tile count,
    launch that bound and let each slot scan for its tile (compact)."""
    tiles_all = sorted_rows // tile_m
    pairs = tokens * topk
    bound = min(tiles_all, pairs, pairs // tile_m + min(experts, pairs))
    return (bound, True) if bound < tiles_all else (tiles_all, False)


# ---- launch bounds and accepted dtypes (both launchers) ----------------------------------------

W2_DTYPES = (torch.uint8, torch.float4_e2m1fn_x2)
MAX_BUFFER_BYTES = (1 << 32) - 1  # a buffer resource's num_records is 32 bits
MAX_SORTED_ROWS = MAX_BUFFER_BYTES // 4  # int32 rows, byte offsets in 32 bits
BUFFER_MAX_BYTES = OOB  # one a2 or out buffer (token window): below the OOB offset
OUT_ELEM_BYTES = {torch.bfloat16: 2, torch.float32: 4}
SCALE_DTYPES = (torch.float8_e8m0fnu, torch.uint8)


def token_windows(tokens: int, *spans: tuple[int, int, int]) -> list[tuple[int, int]]:
    """(first token, tokens) of each launch. Each span is a tensor's rows as a launch addresses them:
    (rows per token, bytes of a row's data, row pitch in bytes): the activations (x at stage 1, a2
    with topk rows at stage 2) and the output. The whole batch when every span's
    (rows - 1) * pitch + row bytes fits one buffer of BUFFER_MAX_BYTES (just under 2 GiB: buffer
    offsets are 32-bit and OOB must stay past the end), else windows of as many tokens as fit, one
    launch each (every launch scans the same sorted rows and computes those whose token is in its
    window)."""
    def fits(rows: int, width: int, pitch: int) -> int:  # tokens whose rows fit one buffer
        if pitch == 0:
            return tokens if width <= BUFFER_MAX_BYTES else 0
        return max(0, ((BUFFER_MAX_BYTES - width) // pitch + 1) // rows)

    per = min(fits(*span) for span in spans)
    if tokens == 0 or per >= tokens:
        return [(0, tokens)]
    if per == 0:
        raise ValueError("one token's rows of the activations or the output (rows, bytes, pitch: "
                         f"{', '.join(map(str, spans))}) span more than {BUFFER_MAX_BYTES} bytes, the range one "
                         "buffer addresses")
    return [(t0, min(per, tokens - t0)) for t0 in range(0, tokens, per)]


def kernel_row_stride(stride: int) -> int:
    """A bf16 row stride as the kernel multiplies it into 32-bit byte offsets: one past a buffer's
    range is 0, since then no token window holds a second row (token_windows) and row 0's offset is 0."""
    return stride if 2 * stride <= BUFFER_MAX_BYTES else 0


def check_inputs(a_name: str, a, w_name: str, w, s_name: str, w_scale, sorted_ids, sorted_weights, sorted_expert_ids,
                 num_valid_ids, topk: int, n_multiple: int, n_what: str) -> tuple[int, int, int]:
    """Both launchers' checks of the activations `a` (bf16, 2D), the shuffled FP4 weights and their
    scales, the sorted arrays (dtypes, rank, device) and topk; the weights' N a multiple of
    n_multiple (`n_what` says why). Returns (experts, w_n, w_k)."""
    validate.tensor(a, a_name, (torch.bfloat16,), ndim=2)
    validate.tensor(w, w_name, W2_DTYPES, ndim=3)
    validate.tensor(w_scale, s_name, SCALE_DTYPES, ndim=(2, 3))
    for name, t, dt in (("sorted_ids", sorted_ids, torch.int32), ("sorted_weights", sorted_weights, torch.float32),
                        ("sorted_expert_ids", sorted_expert_ids, torch.int32), ("num_valid_ids", num_valid_ids, torch.int32)):
        validate.tensor(t, name, (dt,), ndim=1)
        validate.same_device(a_name, a, name, t)
    for name, t in ((w_name, w), (s_name, w_scale)):
        validate.same_device(a_name, a, name, t)
    if not validate.is_int(topk) or not 0 < topk < 1 << (32 - TOKEN_BITS - 1):
        raise ValueError(f"topk must be an int in [1, {(1 << (32 - TOKEN_BITS - 1)) - 1}], got {topk!r}")
    experts, w_n, w_k_half = w.shape
    w_k = 2 * w_k_half
    validate.multiple_of(w_k, KT, f"{w_name}'s K = 2 * {w_name}.shape[2] (aiter's scale shuffle works in 256-wide K tiles)")
    validate.multiple_of(w_n, n_multiple, f"{w_name}.shape[1] ({n_what})")
    if w_n * w_k // 2 >= W_PAST_END:
        raise ValueError(f"one expert's weights must be below {W_PAST_END} bytes (32-bit buffer offsets), got {w_n} x {w_k} FP4")
    scale_shape = (experts * w_n, w_k // K_CHUNK) if w_scale.dim() == 2 else (experts, w_n, w_k // K_CHUNK)
    validate.shape(w_scale, s_name, scale_shape)
    return experts, w_n, w_k


def check_sorted_lengths(sorted_ids, sorted_weights, sorted_expert_ids, num_valid_ids, block_m: int) -> int:
    """block_m is a positive int and the sorted arrays' lengths agree (moe_sorting's for block_m).
    Returns R = len(sorted_ids)."""
    if not validate.is_int(block_m) or block_m <= 0:
        raise ValueError(f"block_m must be a positive int, got {block_m!r}")
    rows = sorted_ids.shape[0]
    validate.shape(sorted_weights, "sorted_weights", (rows,))
    if sorted_expert_ids.shape[0] < -(-rows // block_m):
        raise ValueError(f"sorted_expert_ids must have >= ceil(len(sorted_ids) / block_m) = {-(-rows // block_m)} entries, got {sorted_expert_ids.shape[0]}")
    validate.shape(num_valid_ids, "num_valid_ids", (2,))
    return rows


def resolve_tiles(block_m: int, tile_m, tile_n, auto_m: int, auto_n: int) -> tuple[int, int]:
    """The launch's (tile_m, tile_n): given, or the automatic choice (tile_m the largest divisor of
    block_m among TILE_MS up to auto_m); checked (tile_m must divide block_m)."""
    if tile_m is None:
        fitting = [m for m in TILE_MS if block_m % m == 0]
        tile_m = max([m for m in fitting if m <= auto_m] or fitting[:1] or [None])
    if tile_m not in TILE_MS or block_m % tile_m:
        raise ValueError(f"block_m = {block_m} must be a multiple of tile_m = {tile_m} (tile_m in {TILE_MS})")
    tile_n = auto_n if tile_n is None else tile_n
    if tile_n not in TILE_NS:
        raise ValueError(f"tile_n must be one of {TILE_NS}, got {tile_n}")
    return tile_m, tile_n

