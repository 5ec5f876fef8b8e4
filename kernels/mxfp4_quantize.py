"""MXFP4 quantize, rowwise (blocks of 32 along the last dim): x (M, K) -> packed E2M1 data
(M, ceil(K/32) * 16) and E8M0 scales (M, ceil(K/32)).

Math (flyquant.reference.mxfp4_quantize, bit-exact): per block of 32 elements, amax = max |x|
(FP32), the E8M0 code c of the floor / rceil / even rule on amax's FP32 bits
(_mx_common.f32_scale_code with E2M1's constants: 6 = 1.5 * 2^2), elements
e2m1(x * 2^(127 - c)), nearest even, saturating at +-6; a block holding NaN or Inf gets code
0xFF and every element E2M1_NAN_BLOCK_CODE (0x7). A trailing partial block (K % 32 != 0) is the
zero-padded block: its missing elements are masked to +0 after the load (code 0 nibbles).

rceil on bits: the contract's e8m0_rceil(amax * fl32(1/6)) equals max(eb - 2 + [j > 0x400000],
0) for every FP32 amax (eb, j: exponent and mantissa fields) except amax = 0x01400001, whose
subnormal descale rounds down to 2^-127 (code 0): checked exhaustively per binade in
tests/test_mxfp4_kernels.py. No FP32 arithmetic is involved, so the FP32 denormal mode does not
matter.

Elements. gfx950: v_cvt_scalef32_pk_fp4_{bf16,f16,f32} convert two elements to E2M1 as
x / 2^(s - 127), s the exponent field of the scale operand (CDNA4 ISA, "VOP3 instructions":
V_CVT_SCALEF32_PK_FP4_BF16 and siblings), writing one byte of the destination: 16 conversions
per block. They round to nearest even and saturate (overflow and Inf give +-6), the contract's
clamp; NaN input gives +-6, so NaN/Inf blocks are patched (code 0xFF, nibbles 0x7) in a rare
branch taken when any lane of the wave holds one.
gfx942 has no FP4 conversion: y = x * 2^(127 - c) in FP32 (exact: c <= 253 keeps the multiplier
normal, and a y that underflows is below 0.25 either way), then from a = |y| bits clamped to
6.0: for a < 2 the code is round(2a) by the FP32 adder (a + 2^22 has a 0.5 grid, nearest even:
0.25 -> 0, 0.75 -> 1.0, 1.75 -> 2.0 as E2M1's ties), for a >= 1 it is the FP32 bits rounded to
one mantissa bit, nearest even ((a + 0x1FFFFF + bit 22) >> 22) minus the exponent rebias (252).
The sign is bit 31 of x (-0 -> 0x8, as the reference).

amax: the largest |x| pattern of the block (_mx_common.chain_amax: gfx950 takes 16-bit pairs
through the NaN-propagating v_pk_maximum3_f16, BF16 read as FP16 and redone with the exact
integer max in a rare branch when a block reaches 2^121; otherwise integer max of the patterns).

Work split: one lane per block. Block g of the (M, nkb) block grid reads row g / nkb at
(g % nkb) * 32 elements: 4 (16-bit) or 8 (FP32) 16-byte loads per lane, one 16-byte store of
its 32 nibbles at 16 g (consecutive lanes: consecutive 16 bytes, a wave's store is 1 KiB
contiguous) and one code byte at g. A wave takes `tiles_per_wave` runs of 64 consecutive blocks;
blocks past the end read zeros and their stores are dropped (buffer range checks). With K %
32 == 0 the row division is skipped (block g starts at 32 g elements). Rows whose byte length is
not a multiple of 16 are loaded at 2- or 4-byte alignment (the unaligned buffer access ROCm
enables; not verified on hardware).
"""

from __future__ import annotations

import functools
import sys
from dataclasses import dataclass

import torch

import flydsl.compiler as flyc
import flydsl.expr as fx
from flydsl._mlir import ir
from flydsl._mlir.dialects import arith, rocdl, vector

from flyquant import toolchain
from flyquant.arch import arch_info
from flyquant.formats import E2M1_MANT_BITS, E2M1_MAX_POW2, E2M1_NAN_BLOCK_CODE

from . import _mx_common as mx
from ._mx_common import MX_BLOCK, PIECE_BYTES, WAVE, Spec, add, band, bor, const, lshr, mul, shl, sub, val

SOURCE_TAG = mx.source_tag(sys.modules[__name__])
TORCH_DTYPES = {torch.bfloat16: "bf16", torch.float16: "fp16", torch.float32: "fp32"}

OUT_BLOCK_BYTES = MX_BLOCK // 2  # 32 nibbles
E2M1_RCEIL_MANT = 0x400000  # mantissa field of 1.5: 6 = 1.5 * 2^2
E2M1_RCEIL_TIE = 0x01400001  # the FP32 amax whose rceil descale rounds down to 2^-127 (module doc)
E2M1_NAN_X8 = E2M1_NAN_BLOCK_CODE * 0x11111111  # eight NaN-block nibbles
# gfx942 software encoder constants (module docstring)
F32_SIX = 0x40C00000  # 6.0: saturation
F32_TWO = 0x40000000  # below 2.0 the adder path is exact
HALF_GRID = 4194304.0  # 2^22: FP32 values there are spaced 0.5
HALF_GRID_BITS = 0x4A800000
ROUND_BELOW_BIT22 = (1 << 21) - 1  # round to one mantissa bit: + 0x1FFFFF + bit 22, >> 22
E2M1_REBIAS = (127 - 1) << E2M1_MANT_BITS  # FP32 (exponent, 1 mantissa bit) -> E2M1 code
F32_MULT_FIELD = 254  # 2^(127 - c) has exponent field 254 - c
MAX_WAVES = 4
TILES_PER_WAVE = 4


@dataclass(frozen=True)
class RowPlan:
    waves: int  # waves per workgroup
    tiles_per_wave: int  # runs of 64 blocks a wave quantizes
    workgroups: int


def plan_rows(shape, arch: str) -> RowPlan:
    """Waves per workgroup and tiles per wave for a rowwise quantize of an (M, K) tensor (the same
    split on both arches)."""
    arch_info(arch)
    m, k = shape
    tiles = -(-(m * -(-k // MX_BLOCK)) // WAVE)
    return RowPlan(*mx.wave_split(tiles, MAX_WAVES, TILES_PER_WAVE))


def scale_code(spec: Spec, amax):
    """E8M0 code of a block from its amax pattern (module docstring)."""
    tie = E2M1_RCEIL_TIE if spec.dtype == "fp32" else None
    return mx.f32_scale_code(mx.amax_f32_bits(spec, amax), spec.mode, E2M1_MAX_POW2, E2M1_RCEIL_MANT, tie,
                             E2M1_MANT_BITS)


def _tail_masks(spec: Spec, valid):
    """Per input dword, the bits of the elements below `valid` (the block's elements present)."""
    per = 4 // spec.elem_bytes
    masks = []
    for i in range(MX_BLOCK // per):
        if per == 1:
            masks.append(mx.select(mx.cmp_ult(i, valid), -1, 0))
        else:
            masks.append(mx.select(mx.cmp_ult(2 * i + 1, valid), -1, mx.select(mx.cmp_ult(2 * i, valid), 0xFFFF, 0)))
    return masks


def _hw_convert(spec: Spec, words, code):
    """gfx950: 32 elements -> 4 dwords of nibbles with the scaled FP4 conversions."""
    scale = mx.as_f32(shl(code, mx.F32_MANT_BITS))
    out = []
    for j in range(4):
        acc = mx.poison(mx.i32_t())
        for b in range(4):
            if spec.wide:
                a, c = words[8 * j + 2 * b], words[8 * j + 2 * b + 1]
                acc = rocdl.cvt_scalef32_pk_fp4_f32(mx.i32_t(), acc, mx.as_f32(a), mx.as_f32(c), scale, b)
            else:
                op = rocdl.cvt_scalef32_pk_fp4_bf16 if spec.dtype == "bf16" else rocdl.cvt_scalef32_pk_fp4_f16
                src = mx.bitcast(mx.v2bf16_t() if spec.dtype == "bf16" else mx.v2f16_t(), words[4 * j + b])
                acc = op(mx.i32_t(), acc, src, scale, b)
        out.append(acc)
    return out


def _f32_elements(spec: Spec, words):
    """The 32 elements as FP32 bit patterns (16-bit types widened exactly)."""
    if spec.wide:
        return list(words)
    out = []
    for d in words:
        if spec.dtype == "bf16":
            out += [shl(d, 16), band(d, 0xFFFF0000)]
        else:
            halves = mx.bitcast(mx.v2f16_t(), d)
            out += [mx.as_i32(arith.extf(mx.f32_t(), mx.extract(halves, h))) for h in range(2)]
    return out


def _sw_nibble(y, x):
    """gfx942: the E2M1 code of the scaled value y (FP32 bits) with the sign of x (bits)."""
    a = mx.umin(band(y, 0x7FFFFFFF), F32_SIX)
    grid = arith.addf(mx.as_f32(a), arith.constant(mx.f32_t(), HALF_GRID))
    small = sub(mx.as_i32(grid), HALF_GRID_BITS)
    big = sub(lshr(add(add(a, ROUND_BELOW_BIT22), band(lshr(a, 22), 1)), 22), E2M1_REBIAS)
    code = mx.select(mx.cmp_ult(a, F32_TWO), small, big)
    return bor(code, band(lshr(x, 28), 8))


def _sw_convert(spec: Spec, words, code):
    """gfx942: 32 elements -> 4 dwords of nibbles in software (module docstring)."""
    mult = mx.as_f32(shl(sub(F32_MULT_FIELD, code), mx.F32_MANT_BITS))
    xs = _f32_elements(spec, words)
    pair_t = ir.VectorType.get([2], mx.f32_t())
    ys = []
    for i in range(0, MX_BLOCK, 2):  # v_pk_mul_f32
        v = vector.from_elements(pair_t, [mx.as_f32(xs[i]), mx.as_f32(xs[i + 1])])
        p = arith.mulf(v, vector.broadcast(pair_t, mult))
        ys += [mx.as_i32(mx.extract(p, 0)), mx.as_i32(mx.extract(p, 1))]
    out = []
    for j in range(4):
        acc = const(0)
        for n in range(8):
            e = 8 * j + n
            nib = _sw_nibble(ys[e], xs[e])
            acc = nib if n == 0 else bor(acc, shl(nib, 4 * n))
        out.append(acc)
    return out


def _last_element(words, g, valid, bufs, sizes):
    """16-bit types, a last block with an odd element count: the tensor's last element is the low
    half of a loaded dword whose high half lies past the buffer's end, and the range check, which
    checks whole dwords, reads that dword as 0. The lane of the last block takes the element from
    a 2-byte load instead (a wave-uniform branch, taken by one wave of the launch)."""
    rx = bufs[0]
    nblocks, x_bytes = sizes
    hit = arith.andi(mx.cmp_eq(band(valid, 1), 1), mx.cmp_eq(g, sub(nblocks, 1)))
    last = lshr(sub(valid, 1), 1)  # the word holding it, in its low half

    def patched():
        value = mx.load_short(rx, sub(x_bytes, 2))
        return [mx.select(arith.andi(hit, mx.cmp_eq(last, i)), value, w) for i, w in enumerate(words)]

    return mx.if_else(mx.wave_any(hit), patched, lambda: words, types=[mx.i32_t()] * len(words))


def _nan_words(valid):
    """Data of a NaN/Inf block: nibble 0x7 for the elements present, 0 for the padding."""
    out = []
    for j in range(4):
        n = mx.umin(mx.usub_sat(valid, 8 * j), 8)  # elements present in this dword's 8
        part = sub(shl(1, shl(n, 2)), 1)  # 4n low bits (n < 8)
        out.append(band(E2M1_NAN_X8, mx.select(mx.cmp_uge(n, 8), -1, part)))
    return out


def build_rows(arch: str, dtype: str, mode: str, tail: bool, waves: int = MAX_WAVES):
    """An uncached @flyc.jit launcher of the rowwise kernel for one specialization (tail: K % 32
    != 0, rows divided and partial blocks masked)."""
    spec = Spec(arch, dtype, mode)
    in_block = MX_BLOCK * spec.elem_bytes
    loads = in_block // PIECE_BYTES
    name = f"mxfp4_rows_{spec.tag}" + ("_tail" if tail else "") + f"_w{waves}"
    source = SOURCE_TAG
    convert = _hw_convert if spec.scaled_cvt else _sw_convert

    def block(g, bufs, shape, nblocks_bytes):
        """Block g (per lane) of the block grid; nblocks_bytes: (blocks, x's bytes)."""
        rx, rq, rs = bufs
        nkb, row_bytes, k, magic, shift = shape
        if tail:
            row = lshr(add(mx.umulhi(g, magic), g), shift)
            kb = sub(g, mul(row, nkb))
            off = add(mul(row, row_bytes), mul(kb, in_block))
            valid = sub(k, mul(kb, MX_BLOCK))
        else:
            off, valid = mul(g, in_block), const(MX_BLOCK)
        regs = [mx.load(rx, off if i == 0 else add(off, i * PIECE_BYTES)) for i in range(loads)]
        words = [w for r in regs for w in mx.dwords_of(r)]
        if tail:
            words = [band(w, m) for w, m in zip(words, _tail_masks(spec, valid))]
            if not spec.wide:
                words = _last_element(words, g, valid, bufs, nblocks_bytes)
        # two interleaved chains: consecutive max instructions do not depend on each other
        amax = mx.amax_halves(spec, mx.amax_max(spec, *mx.chain_amax_interleaved(spec, [words[0::2], words[1::2]])))
        if spec.needs_exact_redo:  # BF16 read as FP16 (gfx950): blocks from 2^121 up redo it exactly
            exact = lambda: [mx.amax_halves(spec, mx.chain_amax(spec, words, exact=True))]  # noqa: E731
            amax = mx.if_else(mx.wave_any(mx.cmp_uge(amax, spec.suspicious)), exact, lambda: [amax],
                              types=[mx.i32_t()])[0]
        code = scale_code(spec, amax)
        data = convert(spec, words, code)
        bad = mx.cmp_uge(amax, mx.NONFINITE[dtype])
        i32 = mx.i32_t()
        patched = mx.if_else(
            mx.wave_any(bad),
            lambda: [mx.select(bad, n, d) for n, d in zip(_nan_words(valid), data)] + [mx.select(bad, mx.E8M0_NAN, code)],
            lambda: data + [code],
            types=[i32] * 5,
        )
        mx.store_byte(patched[4], rs, g)
        mx.store(mx.from_elements(patched[:4]), rq, mul(g, OUT_BLOCK_BYTES))

    def body(x, q, s, nblocks, tiles_per_wave, nkb, row_bytes, k, magic, shift, x_bytes):
        tid = val(fx.Int32(fx.thread_idx.x))
        wave = mx.readfirstlane(lshr(tid, 6))
        lane = band(tid, WAVE - 1)
        nb = val(nblocks)
        zero = const(0, mx.i64_t())
        rx = mx.buffer(x, zero, mx.to_i64(x_bytes))
        rq = mx.buffer(q, zero, mul(mx.to_i64(nb), OUT_BLOCK_BYTES))
        rs = mx.buffer(s, zero, mx.to_i64(nb))
        first = add(mul(val(fx.Int32(fx.block_idx.x)), mul(tiles_per_wave, waves)), mul(wave, tiles_per_wave))
        bufs, shape = (rx, rq, rs), (val(nkb), val(row_bytes), val(k), val(magic), val(shift))
        sizes = (nb, val(x_bytes))
        mx.for_range(tiles_per_wave,
                     lambda i: block(add(mx.opaque_sgpr(mul(add(first, i), WAVE)), lane), bufs, shape, sizes))

    @flyc.kernel(name=name, known_block_size=[WAVE * waves, 1, 1])
    def kernel(
        x: fx.Tensor,  # (M, K) BF16/FP16/FP32, row-major
        q: fx.Tensor,  # (M, nkb * 16) uint8: packed E2M1
        s: fx.Tensor,  # (M, nkb) uint8: E8M0 codes
        nblocks: fx.Int32,  # M * nkb, nkb = ceil(K / 32)
        tiles_per_wave: fx.Int32,
        nkb: fx.Int32,
        row_bytes: fx.Int32,  # K * element bytes
        k: fx.Int32,  # K
        magic: fx.Int32,  # floor(g / nkb) = (umulhi(g, magic) + g) >> shift (tail only)
        shift: fx.Int32,
        x_bytes: fx.Int32,  # M * K * element bytes
    ):
        body(x, q, s, nblocks, tiles_per_wave, nkb, row_bytes, k, magic, shift, x_bytes)

    @flyc.jit
    def launch(
        x: fx.Tensor,
        q: fx.Tensor,
        s: fx.Tensor,
        nblocks: fx.Int32,
        tiles_per_wave: fx.Int32,
        nkb: fx.Int32,
        row_bytes: fx.Int32,
        k: fx.Int32,
        magic: fx.Int32,
        shift: fx.Int32,
        x_bytes: fx.Int32,
        workgroups: fx.Int32,
        stream: fx.Stream = fx.Stream(None),
    ):
        assert source and name  # closure values, so FlyDSL's disk cache keys on them (sources, variant)
        kernel(x, q, s, nblocks, tiles_per_wave, nkb, row_bytes, k, magic, shift, x_bytes).launch(
            grid=(workgroups, 1, 1), block=(WAVE * waves, 1, 1), stream=stream
        )

    return launch


_cached_rows = functools.lru_cache(maxsize=None)(build_rows)


def too_large(shape, dtype: torch.dtype) -> str | None:
    """Why one launch cannot take an (M, K) tensor (32-bit buffer offsets), or None."""
    m, k = shape
    x_bytes = m * k * torch.empty((), dtype=dtype).element_size()
    out_bytes = m * -(-k // MX_BLOCK) * OUT_BLOCK_BYTES
    if max(x_bytes, out_bytes) >= mx.MAX_LAUNCH_BYTES:
        return f"x ({x_bytes} bytes) or its data ({out_bytes} bytes) reaches 2 GiB (32-bit buffer offsets)"
    return None


def quantize_rows(x: torch.Tensor, *, arch: str, scaling_mode: str = "floor"):
    """Rowwise MXFP4 quantize of a contiguous (M, K) BF16/FP16/FP32 tensor on `arch`, as
    flyquant.reference.mxfp4_quantize(x, -1, scaling_mode): (uint8 (M, ceil(K/32) * 16), float8_e8m0fnu
    (M, ceil(K/32))). Inputs are validated by the caller (flyquant.api / reference checks)."""
    m, k = x.shape
    nkb = -(-k // MX_BLOCK)
    data = torch.empty((m, nkb * OUT_BLOCK_BYTES), dtype=torch.uint8, device=x.device)
    scales = torch.empty((m, nkb), dtype=torch.uint8, device=x.device)
    reason = too_large(x.shape, x.dtype)
    if reason:
        raise ValueError(reason)
    if m * nkb == 0:
        return data, scales.view(torch.float8_e8m0fnu)
    tail = k % MX_BLOCK != 0
    magic, shift = mx.divide_magic(nkb)
    cfg = plan_rows((m, k), arch)
    with toolchain.target(arch):
        launch = _cached_rows(arch, TORCH_DTYPES[x.dtype], scaling_mode, tail, cfg.waves)
        launch(x, data, scales, m * nkb, cfg.tiles_per_wave, nkb, k * x.element_size(), k, mx.i32_bits(magic), shift,
               x.numel() * x.element_size(), cfg.workgroups, stream=mx.torch_stream(x))
    return data, scales.view(torch.float8_e8m0fnu)
