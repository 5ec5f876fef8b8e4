"""Shared pieces of the MX quantize kernels: the bitwise scale rules, amax, element conversion
and scale-layout addressing (emitted into FlyDSL kernels); the IR helpers, buffer access and
cross-lane exchanges they are written with are kernels/_mx_ir.py's, re-exported here.

Every kernel quantizes blocks of 32 elements: amax = max |x| over the block, an E8M0 code c
and elements fp8(clamp(x * 2^(127 - c), -448, 448)), torchao main's MXFP8 contract as
flyquant.formats.mx_scale states it (code 0 means 2^-127 and is used like any other).
All of it is integer bit arithmetic on the input's bit patterns (no device math library):

amax. |x| of a 16-bit value is its pattern with the sign cleared, and patterns of non-negative
values order like the values (NaN patterns above Inf), so an unsigned max of patterns is the
amax with NaN winning: a pattern >= the Inf pattern flags a non-finite block. gfx950's NaN-
propagating v_pk_maximum3_f16 (maximum(t, x, -x) = max(t, |x|)) takes 1 instruction per two
elements instead of 2: exact for FP16, and for BF16 patterns read as FP16 it orders every
pattern below 0x7C00 (|x| < 2^121) correctly; a block at or above that is "suspicious" and the
tile is redone with the exact integer max (rare: only huge, Inf or NaN values). FP32 on gfx950
uses v_maximum3_f32 with |.| modifiers (NaN-propagating); elsewhere v_max3_u32 on masked bits.

Scale rule (the E8M0 code c, which is also the exponent field of the conversion scale; eb =
the FP32 exponent field of amax, j = its mantissa field):
  floor: c = max(eb - 8, 0)
  rceil: c = max(eb - 8 + [j > 0x600000], 0), except c = 0 for the FP32 amax 0x04600001
j > 0x600000 means amax / 448 > 2^(eb - 135), i.e. the descale amax * fl32(1/448) rounds up
to the next power of two (448 = 1.75 * 2^8). This is the contract's rule (descale rounded to
FP32, then rounded up from its bits) for every amax: fl32(1/448) is above 1/448 by less than
half an ulp, so the rounded product is a power of two only where amax / 448 is one, checked
exhaustively per binade in tests; the one exception is eb = 8, where the descale is an FP32
subnormal (grid 2^-149): amax = 1.75 * 2^-119 * (1 + 2^-23) gives a descale within half a
step of 2^-127, which rounds to 2^-127 (code 0) (RCEIL_SUBNORMAL_TIE). BF16 works on its own
pattern (eb = p >> 7, 7 mantissa bits), FP16 is widened to FP32 first (exact; FP16 subnormals
become normal FP32); neither can hold that amax. The NaN code 0xFF and the element pattern 0x7F
are written for non-finite blocks by a rare pass after the common one.

Elements. gfx950: v_cvt_scalef32_pk_fp8_{bf16,f16,f32} compute fp8(x / 2^(c-127)) (exact
scaling, round to nearest even, OCP bits; the scale operand's exponent field is read as an E8M0
code, so field 0 is 2^-127). They give NaN on overflow unless MODE.FP16_OVFL is set, when they
saturate to +-448 (what AMD's Triton backend sets for its FP8 casts): floor mode, where x / s
reaches [448, 512), sets it at the kernel's start (saturate_conversions) and needs no clamp;
saturating after rounding equals clamping to 448 first, as every value in (448, 512) rounds to
448 or past it. rceil never overflows: amax / s <= 448, or 448 * (1 + 2^-23) for the
subnormal-descale tie, which rounds to 448.
gfx942's converter v_cvt_pk_fp8_f32 is FNUZ E4M3 (bias 8): the OCP code of v is the FNUZ code
of v / 2 for every finite v (both grids scale by exactly 2, subnormals included), so the
multiplier 2^(126 - c) carries an extra 0.5, floor clamps to +-224, and the FNUZ +0 of a negative input
(FNUZ has no -0) gets the sign bit OR-ed back from the input's sign (OCP -0 = 0x80; nonzero
FNUZ results already carry it). Spec.signed_zeros False (the ops' signed_zeros=False) writes +0
for every zero instead: gfx942 leaves the OR out, gfx950 clears bit 7 of the 0x80 bytes
(unsign_zeros); the gfx942 grouped GEMM then reads the bytes as FNUZ without rewriting them.

Lanes. A wave is 64 lanes; the kernels split a block over lanes at power-of-two distances and
combine with `exchange` (gfx950: v_permlane16/32_swap for distances 16/32; otherwise DPP: two
bank-masked moves at distance 8, a move plus selects at distance 1 or 2).
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass
from pathlib import Path

import flydsl.expr as fx
import torch
from flydsl._mlir import ir
from flydsl._mlir.dialects import arith, llvm, vector
from flydsl._mlir.dialects import rocdl

from flyquant.formats import MX_BLOCK
from flyquant.layouts import MFMA_COL_PAD, MFMA_ROW_PAD, TCGEN05_TILE_COLS, TCGEN05_TILE_ROWS, mfma_scales_shape  # noqa: F401  (MFMA_ROW_PAD: kernels read mx.MFMA_ROW_PAD)

from . import _mx_ir
from ._mx_ir import *  # noqa: F401,F403  (the IR helpers: kernels reach them as mx.*)

def source_tag(*modules) -> str:
    """A hash of this file's, _mx_ir's and `modules`' sources. FlyDSL's disk cache keys a kernel on its own
    module's functions and closure values but not on helpers reached through module attributes
    (mx.*), so every builder captures this tag as a closure value: editing a helper recompiles."""
    h = hashlib.sha256(Path(__file__).read_bytes())
    for m in (_mx_ir, *modules):
        h.update(Path(m.__file__).read_bytes())
    return h.hexdigest()[:16]



ELEM_BYTES = {"bf16": 2, "fp16": 2, "fp32": 4}
# Patterns of |x| at and above which a value is Inf or NaN.
NONFINITE = {"bf16": 0x7F80, "fp16": 0x7C00, "fp32": 0x7F800000}
F16_VIEW_INF = 0x7C00  # BF16 patterns >= this are Inf/NaN when read as FP16
E4M3_NAN_X4 = 0x7F7F7F7F  # four E4M3 NaN bytes
E8M0_NAN = 0xFF
E4M3_MAX_POW2 = 8  # 448 = 1.75 * 2^8
BF16_MANT_BITS = 7
F32_MANT_BITS = 23
F32_MANT_175 = 0x600000  # mantissa field of 1.75
BF16_MANT_175 = 0x60
FNUZ_HALF_MAX = 224.0  # 448 / 2: the OCP maximum, in FNUZ units
# gfx942 multiplier 2^(126 - e) = 0.5 * 2^(127 - e) has FP32 exponent field 253 - e.
FNUZ_MULT_FIELD = 253

# The FP32 amax 1.75 * 2^-119 * (1 + 2^-23): its rceil descale, an FP32 subnormal, rounds down
# to 2^-127 (code 0) although amax / 448 > 2^-127 (module docstring); one ulp more gives code 1.
RCEIL_SUBNORMAL_TIE = ((E4M3_MAX_POW2 << F32_MANT_BITS) | F32_MANT_175) + 1


@dataclass(frozen=True)
class Spec:
    """What a kernel variant is specialized on."""

    arch: str  # "gfx942" | "gfx950"
    dtype: str  # "bf16" | "fp16" | "fp32"
    mode: str  # "floor" | "rceil"
    signed_zeros: bool = True  # MXFP8: False writes +0 (0x00) for -0 (module docstring)

    @property
    def tag(self) -> str:
        return f"{self.mode}_{self.dtype}_{self.arch}" + ("" if self.signed_zeros else "_pz")

    @property
    def elem_bytes(self) -> int:
        return ELEM_BYTES[self.dtype]

    @property
    def wide(self) -> bool:
        return self.dtype == "fp32"

    @property
    def elems_per_piece(self) -> int:
        return PIECE_BYTES // self.elem_bytes

    @property
    def pieces_per_block(self) -> int:
        return MX_BLOCK // self.elems_per_piece

    @property
    def scaled_cvt(self) -> bool:
        """gfx950's OCP scaled conversions (else gfx942's FNUZ converter)."""
        return self.arch == "gfx950"

    @property
    def f16_view(self) -> bool:
        """amax by v_pk_maximum3_f16 (gfx950, 16-bit types)."""
        return self.arch == "gfx950" and not self.wide

    @property
    def needs_exact_redo(self) -> bool:
        """BF16 read as FP16: blocks with patterns >= 0x7C00 need the exact integer amax."""
        return self.f16_view and self.dtype == "bf16"

    @property
    def suspicious(self) -> int:
        """amax pattern from which a tile takes the rare path."""
        return F16_VIEW_INF if self.needs_exact_redo else NONFINITE[self.dtype]


# ------------------------------------------------------------------------------------------------
# Launch helpers and scale layouts
# ------------------------------------------------------------------------------------------------


def divide_magic(d: int) -> tuple[int, int]:
    """(magic, shift) with floor(g / d) == (umulhi(g, magic) + g) >> shift for 0 <= g < 2^31:
    magic = ceil(2^(32 + shift) / d) - 2^32, shift = ceil(log2(d)) (the error of the rounded-up
    reciprocal, below d * g / 2^(32 + shift) < 1/2, never reaches the next integer)."""
    shift = (d - 1).bit_length()
    return -(-(1 << (32 + shift)) // d) - (1 << 32), shift


def i32_bits(v: int) -> int:
    """An unsigned 32-bit value as the signed i32 argument with the same bits."""
    return v - (1 << 32) if v >= 1 << 31 else v


def wave_split(tiles: int, max_waves: int, max_tiles_per_wave: int) -> tuple[int, int, int]:
    """(waves per workgroup, tiles per wave, workgroups) for `tiles` units of a wave's work: each
    wave takes up to max_tiles_per_wave consecutive tiles (spreading its setup), workgroups of up
    to max_waves waves."""
    tpw = max(1, min(max_tiles_per_wave, tiles))
    waves = max(1, min(max_waves, -(-tiles // tpw)))
    return waves, tpw, -(-tiles // (waves * tpw))


def scale_layout_shape(rows: int, cols: int, scale_layout) -> tuple[int, int]:
    """Padded (rows, cols) of a scale matrix in a layout (flyquant.layouts)."""
    if scale_layout == "tcgen05":
        return -(-rows // TCGEN05_TILE_ROWS) * TCGEN05_TILE_ROWS, -(-cols // TCGEN05_TILE_COLS) * TCGEN05_TILE_COLS
    if scale_layout == "mfma":
        return mfma_scales_shape(rows, cols)
    return rows, cols


def layout_dims(scale_layout, padded_cols: int) -> int:
    return padded_cols // (TCGEN05_TILE_COLS if scale_layout == "tcgen05" else MFMA_COL_PAD)


def rows_per_launch(m: int, row_bytes: int, align: int) -> int:
    """Rows of an (M, .) tensor one launch takes (a multiple of `align`: whole layout tiles or
    experts), each buffer below MAX_LAUNCH_BYTES (32-bit byte offsets); row_bytes: the largest of
    a row's buffers. A ValueError when `align` rows do not fit."""
    rows = (MAX_LAUNCH_BYTES - 1) // row_bytes // align * align
    if rows == 0:
        raise ValueError(f"{align} row(s) of {row_bytes} bytes are too large for one launch ({MAX_LAUNCH_BYTES} bytes)")
    return min(m, rows)


def scale_tensor(shape, padded: bool, device) -> torch.Tensor:
    """uint8 scale storage; zero-filled only when the layout has padding the kernel skips."""
    return (torch.zeros if padded else torch.empty)(shape, dtype=torch.uint8, device=device)


def scale_offset(layout, row, col, dims):
    """Byte offset of scale (row, col) of a (rows, cols) scale matrix in `layout` (see
    flyquant.layouts): dims = padded column count / 4 (tcgen05) or / 8 (mfma)."""
    if layout == "tcgen05":
        tile = add(mul(lshr(row, 7), dims), lshr(col, 2))
        inner = add(add(shl(band(row, 31), 4), shl(band(lshr(row, 5), 3), 2)), band(col, 3))
        return add(shl(tile, 9), inner)
    tile = add(mul(lshr(row, 5), shl(dims, 8)), shl(lshr(col, 3), 8))
    inner = add(add(shl(band(col, 3), 6), shl(band(row, 15), 2)), add(shl(band(lshr(col, 2), 1), 1), band(lshr(row, 4), 1)))
    return add(tile, inner)


# ------------------------------------------------------------------------------------------------
# amax
# ------------------------------------------------------------------------------------------------


def _f16_max_abs(acc, x):
    """max(acc, |x|) on two FP16 lanes with NaN propagation (gfx950 v_pk_maximum3_f16)."""
    a, xv = bitcast(v2f16_t(), acc), bitcast(v2f16_t(), x)
    return bitcast(i32_t(), arith.maximumf(arith.maximumf(a, xv), arith.negf(xv)))


def _f32_max_abs(acc, x):
    xa = llvm.intr_fabs(as_f32(x))
    return as_i32(arith.maximumf(as_f32(acc), xa))


def abs_mask(spec: Spec) -> int:
    """The bits of |x| in a dword of x: FP32, or two 16-bit halves."""
    return 0x7FFFFFFF if spec.wide else splat16(0x7FFF)


def chain_amax(spec: Spec, dwords, exact=False, mask=None):
    """amax over dwords of one block (or of column pairs, for the 16-bit column kernels) as an
    i32: two 16-bit patterns (BF16/FP16: the low and high halves separately) or FP32 bits, all of
    |x|. exact=False uses gfx950's f16 view for BF16 (see the module doc). mask: abs_mask as a
    value of the caller's (an opaque SGPR keeps these |x| apart from other uses of x & abs_mask,
    which LLVM would otherwise merge with them and keep alive in between)."""
    mask = abs_mask(spec) if mask is None else mask
    if spec.wide:
        if spec.arch == "gfx950":
            acc = as_i32(llvm.intr_fabs(as_f32(dwords[0])))
            for d in dwords[1:]:
                acc = _f32_max_abs(acc, d)
            return acc
        return _tree([band(d, mask) for d in dwords], umax)
    if spec.f16_view and not exact:
        acc = band(dwords[0], mask)
        for d in dwords[1:]:
            acc = _f16_max_abs(acc, d)
        return acc
    return _tree([band(d, mask) for d in dwords], pk_umax)


def chain_amax_interleaved(spec: Spec, columns, exact=False, pinned=False, mask=None):
    """chain_amax of several independent lists, emitted step by step across the lists so that
    consecutive instructions do not depend on each other (no hazard wait states between them).
    pinned: a scheduling barrier after each step keeps that order (LLVM's scheduler otherwise may
    run a fourth chain alone, an s_nop between each of its steps). mask (chain_amax's) serves the
    chain_amax paths only: gfx950's f16-view chains keep the literal, as with the mask the dual
    kernel executed 1.7% more (0.0698 -> 0.0709 per element, BF16 512x1024)."""
    if spec.wide and spec.arch != "gfx950" or (not spec.wide and not (spec.f16_view and not exact)):
        return [chain_amax(spec, col, exact, mask) for col in columns]
    first = _f32_abs if spec.wide else (lambda d: band(d, splat16(0x7FFF)))
    step = _f32_max_abs if spec.wide else _f16_max_abs
    accs = [first(col[0]) for col in columns]
    for i in range(1, len(columns[0])):
        accs = [step(a, col[i]) for a, col in zip(accs, columns)]
        if pinned:
            fx.rocdl.sched_barrier(0)
    return accs


def _f32_abs(x):
    return as_i32(llvm.intr_fabs(as_f32(x)))


def _tree(values, op):
    while len(values) > 1:
        values = [op(values[i], values[i + 1]) if i + 1 < len(values) else values[i] for i in range(0, len(values), 2)]
    return values[0]


def nonfinite_halves(spec: Spec, pair):
    """Two 16-bit amax patterns h in a dword -> 1 in bit 0 / 16 where h >= NONFINITE (NaN or Inf),
    else 0: with 2^s = 2^15 - NONFINITE, h >> s is all ones exactly there, so adding 1 carries
    into bit 15 - s. Packed shifts and an add of inline constants (a compare would keep its bound
    in a register). The sign bits are cleared first: a NaN amax of gfx950's f16 view keeps the sign
    of the NaN it came from (v_pk_maximum3_f16 returns the NaN operand), and -NaN's h >> s carried
    into bit 1 / 17 instead (scale 0xFF, elements left unpatched)."""
    s = (0x8000 - NONFINITE[spec.dtype]).bit_length() - 1
    top = pk(arith.addi, pk(arith.shrui, band(pair, splat16(0x7FFF)), splat16(s)), splat16(1))
    return pk(arith.shrui, top, splat16(15 - s))


def amax_max(spec: Spec, a, b):
    """Combine two partial amaxes (same representation as chain_amax)."""
    return umax(a, b) if spec.wide else pk_umax(a, b)


def amax_halves(spec: Spec, x):
    """Final amax pattern from a partial: the larger 16-bit half (16-bit types)."""
    if spec.wide:
        return x
    return umax(band(x, 0xFFFF), lshr(x, 16))


# ------------------------------------------------------------------------------------------------
# Scale rule
# ------------------------------------------------------------------------------------------------


def block_scale(spec: Spec, amax):
    """(E8M0 code, conversion scale as FP32) for a block amax pattern (finite; non-finite
    blocks get arbitrary values here and are overwritten by the NaN pass).

    The conversion scale is, on gfx950, the operand of the scaled conversions (only its exponent
    field e matters); on gfx942 the multiplier 2^(126 - e) for the FNUZ converter."""
    if spec.dtype == "bf16":
        if spec.mode == "floor":
            code = lshr(usub_sat(amax, E4M3_MAX_POW2 << BF16_MANT_BITS), BF16_MANT_BITS)
        else:
            step = (1 << BF16_MANT_BITS) - 1 - BF16_MANT_175  # j > 0x60 carries into the exponent
            code = lshr(usub_sat(amax, (E4M3_MAX_POW2 << BF16_MANT_BITS) - step), BF16_MANT_BITS)
    else:
        tie = RCEIL_SUBNORMAL_TIE if spec.dtype == "fp32" else None
        code = f32_scale_code(amax_f32_bits(spec, amax), spec.mode, E4M3_MAX_POW2, F32_MANT_175, tie)
    if spec.scaled_cvt:
        return code, as_f32(shl(code, F32_MANT_BITS))
    return code, as_f32(shl(sub(FNUZ_MULT_FIELD, code), F32_MANT_BITS))


def amax_f32_bits(spec: Spec, amax):
    """An amax pattern (16-bit types: in the low half) -> the FP32 bits of the same value (exact:
    BF16 shifted, FP16 widened, FP16 subnormals becoming normal FP32)."""
    if spec.dtype == "bf16":
        return shl(amax, 16)
    if spec.dtype == "fp16":
        half = arith.trunci(ir.IntegerType.get_signless(16), val(amax))
        return as_i32(arith.extf(f32_t(), arith.bitcast(ir.F16Type.get(), half)))
    return amax


def scale_carry(mode: str, rceil_mant: int, even_mant_bits=None) -> int:
    """What f32_scale_code adds to the FP32 amax bits before taking the exponent field."""
    if mode == "floor":
        return 0
    if mode == "rceil":
        return (1 << F32_MANT_BITS) - 1 - rceil_mant
    return 1 << (F32_MANT_BITS - 1 - even_mant_bits)


def bf16_scale_tops(pair, mode: str, max_pow2: int, rceil_mant: int, even_mant_bits=None):
    """f32_scale_code for two BF16 amax patterns p in one dword, with one v_pk_sub_u16 (clamp):
    w = sat(p - ((max_pow2 << 7) - carry / 2^16)) per half (the carry's low 16 bits never reach
    p's, whose FP32 value has its low 16 bits zero) holds the code in its bits 14:7, where the top
    half of an FP32 holds its exponent field: w is the top_halves of the gfx950 conversion scales
    (bits 6:0 are what is left of p's mantissa, which the conversions ignore)."""
    low = (max_pow2 << BF16_MANT_BITS) - (scale_carry(mode, rceil_mant, even_mant_bits) >> 16)
    return pk(llvm.intr_usub_sat, pair, splat16(low))


F16_MANT_BITS = 10
F16_TO_F32_BIAS = 127 - 15
# v_cmp_class mask of the FP16 amax patterns f16_scale_tops leaves to the caller: sNaN, qNaN,
# +-Inf, +-subnormal, +-0 (a zero block's code is 0, which the packed rule would not give)
F16_UNUSUAL = 0x2F7


def f16_scale_tops(pair, mode: str, max_pow2: int, rceil_mant: int, even_mant_bits=None):
    """bf16_scale_tops for two FP16 amax patterns p in one dword, both normal (blocks whose amax is
    0, an FP16 subnormal, Inf or NaN are the caller's rare path: f16_unusual). An FP16 pattern's
    FP32 bits have their low 13 bits zero, so the FP32 carry acts as carry >> 13 on p, and FP32's
    exponent field is FP16's plus 112: w = ((p + carry') >> 3) + ((112 - max_pow2) << 7) holds the
    code in bits 14:7; bits 6:0 are mantissa, which the conversions ignore. Three packed 16-bit
    instructions, two where the carry is a multiple of 8 (floor's 0, MXFP4 even's 256): then
    (p + carry) >> 3 = (p >> 3) + carry / 8, folded into the last add."""
    carry = scale_carry(mode, rceil_mant, even_mant_bits) >> (F32_MANT_BITS - F16_MANT_BITS)
    bias = (F16_TO_F32_BIAS - max_pow2) << BF16_MANT_BITS
    if carry % 8 == 0:
        bias, carry = bias + carry // 8, 0
    t = pk(arith.shrui, pk(arith.addi, pair, splat16(carry)) if carry else pair, splat16(3))
    return pk(arith.addi, t, splat16(bias))


def f16_unusual(pair):
    """i1: a half of `pair` (FP16 amax patterns) is 0, subnormal, Inf or NaN (v_cmp_class each)."""
    halves = bitcast(v2f16_t(), pair)
    cls = [llvm.call_intrinsic(ir.IntegerType.get_signless(1), "llvm.amdgcn.class.f16",
                               [extract(halves, h), const(F16_UNUSUAL)], [], []) for h in range(2)]
    return arith.ori(*cls)


def f32_scale_code(bits, mode: str, max_pow2: int, rceil_mant: int, tie=None, even_mant_bits=None):
    """The E8M0 code of a block from its FP32 amax bits (eb = exponent field, j = mantissa field)
    for an element format whose largest value is (1 + rceil_mant / 2^23) * 2^max_pow2:
      floor: max(eb - max_pow2, 0)
      even:  floor's rule on bits + 2^(22 - even_mant_bits) (amax rounded at the element's
             precision: the carry reaches the exponent from mantissa 1 - 2^-(m+1))
      rceil: max(eb - max_pow2 + [j > rceil_mant], 0), and 0 for the amax pattern `tie` (the
             one subnormal-descale exception of the format, checked exhaustively in tests)."""
    carry = scale_carry(mode, rceil_mant, even_mant_bits)
    code = lshr(usub_sat(add(bits, carry) if carry else bits, max_pow2 << F32_MANT_BITS), F32_MANT_BITS)
    if tie is not None and mode == "rceil":
        code = select(cmp_eq(bits, tie), 0, code)
    return code


def pack_pair(hi, lo):
    """Two 16-bit amax patterns (i32 each, < 2^16) -> one dword (hi << 16 | lo)."""
    return bor(shl(hi, 16), lo)


def halves_pair(a, b):
    """Two partial amaxes (two 16-bit halves each) -> (max of b's halves) << 16 | max of a's."""
    lows = perm(b, a, 0x05040100)  # (b.lo, a.lo)
    highs = perm(b, a, 0x07060302)  # (b.hi, a.hi)
    return pk_umax(lows, highs)


def pair_max(x):
    """max of the two 16-bit halves of x."""
    return umax(band(x, 0xFFFF), lshr(x, 16))


def top_halves(s_hi, s_lo):
    """(top 16 bits of s_hi) << 16 | top 16 bits of s_lo: two FP32 conversion scales whose low
    16 bits are zero, in one dword (undone by scale_from_tops)."""
    return perm(as_i32(s_hi), as_i32(s_lo), 0x07060302)


def scale_from_tops(spec: Spec, tops, j):
    """Conversion scale j (0: low half, 1: high half) of a top_halves dword. gfx950 reads only
    the exponent field, so the high one is the dword itself (the low half is mantissa there)."""
    if j == 0:
        return as_f32(shl(tops, 16))
    return as_f32(tops if spec.scaled_cvt else band(tops, 0xFFFF0000))


def packed_scale_pair(spec: Spec, pair, max_pow2: int, rceil_mant: int, even_mant_bits=None):
    """The scale rule of two blocks whose 16-bit amax patterns share a dword (gfx950), with v_pk_*
    ops, for an element format as f32_scale_code's: (codes (c_hi << 16 | c_lo), top_halves of the
    two conversion scales). BF16 amaxes: bf16_scale_tops; FP16 (both normal): f16_scale_tops. The
    tops' low 7 bits are mantissa bits of the scale, which the conversion ignores."""
    tops_of = bf16_scale_tops if spec.dtype == "bf16" else f16_scale_tops
    w = tops_of(pair, spec.mode, max_pow2, rceil_mant, even_mant_bits)
    return pk(arith.shrui, w, splat16(BF16_MANT_BITS)), w


def pair_scales(spec: Spec, pair, normal: bool = False):
    """(codes, conversion scales) of two blocks whose 16-bit amax patterns share a dword:
    (c_hi << 16 | c_lo, top_halves(s_hi, s_lo)); FP16 with `normal` (gfx950, both patterns
    normal FP16 numbers: the caller's rare path takes the others): f16_scale_tops."""
    if spec.scaled_cvt and (spec.dtype == "bf16" or normal):
        return packed_scale_pair(spec, pair, E4M3_MAX_POW2, F32_MANT_175)
    c0, s0 = block_scale(spec, band(pair, 0xFFFF))
    c1, s1 = block_scale(spec, lshr(pair, 16))
    return pack_pair(c1, c0), top_halves(s1, s0)


# ------------------------------------------------------------------------------------------------
# Element conversion
# ------------------------------------------------------------------------------------------------


HWREG_MODE_FP16_OVFL = 1 | 23 << 6  # s_setreg SIMM16: hwRegId 1 (MODE), bit offset 23, 1 bit


def saturate_conversions(spec: Spec):
    """gfx950 floor: set MODE.FP16_OVFL for the rest of the wave, so that the FP8 conversions
    saturate overflow to +-448 instead of giving NaN (module docstring). The kernels' other
    instructions have no 16-bit float results it could change."""
    if spec.mode == "floor" and spec.scaled_cvt:
        llvm.call_intrinsic(None, "llvm.amdgcn.s.setreg", [const(HWREG_MODE_FP16_OVFL), const(1)], [], [])


def _cvt16(spec: Spec, old, pair, scale, hi):
    op = rocdl.cvt_scalef32_pk_fp8_bf16 if spec.dtype == "bf16" else rocdl.cvt_scalef32_pk_fp8_f16
    src = bitcast(v2bf16_t() if spec.dtype == "bf16" else v2f16_t(), pair)
    r = op(v2i16_t(), bitcast(v2i16_t(), old), src, scale, hi)
    return bitcast(i32_t(), r)


def _cvt32(old, a, b, scale, hi):
    r = rocdl.cvt_scalef32_pk_fp8_f32(v2i16_t(), bitcast(v2i16_t(), old), as_f32(a), as_f32(b), scale, hi)
    return bitcast(i32_t(), r)


def _fnuz4(values, mult, clamp):
    """Four FP32 values (bits) -> four FNUZ bytes of value * mult, clamped to +-224 for floor."""
    ys = []
    for i in range(0, 4, 2):
        pair = vector.from_elements(ir.VectorType.get([2], f32_t()), [as_f32(values[i]), as_f32(values[i + 1])])
        prod = arith.mulf(pair, vector.broadcast(ir.VectorType.get([2], f32_t()), mult))
        ys += [extract(prod, 0), extract(prod, 1)]
    if clamp:
        lo, hi = arith.constant(f32_t(), -FNUZ_HALF_MAX), arith.constant(f32_t(), FNUZ_HALF_MAX)
        ys = [arith.minnumf(arith.maxnumf(y, lo), hi) for y in ys]  # v_med3_f32 (NaN blocks are rewritten)
    out = rocdl.cvt_pk_fp8_f32(i32_t(), ys[0], ys[1], poison(i32_t()), False)
    return rocdl.cvt_pk_fp8_f32(i32_t(), ys[2], ys[3], out, True)


def unsign_zeros(d, fused: bool = False):
    """E4M3 bytes with -0 (0x80) made +0: a byte keeps bit 7 only where its low 7 bits are not 0:
    (d & (low + 0x7F7F7F7F)) | low, low = d & 0x7F7F7F7F. `fused`: the last two operations as one
    v_and_or_b32 (_mx_ir.and_or: inline asm, its wait states checked in
    tests/test_inline_asm_hazards.py for the kernels using it); else LLVM's
    d & ((low + 0x7F7F7F7F) | 0x7F7F7F7F), one instruction more, low dead sooner."""
    low = band(d, 0x7F7F7F7F)
    t = add(low, 0x7F7F7F7F)
    return _mx_ir.and_or(d, t, low) if fused else bor(band(d, t), low)


def convert4_16(spec: Spec, p0, p1, conv):
    """Four 16-bit elements of one block, as two dwords of pairs (p0.lo, p0.hi, p1.lo, p1.hi),
    -> one dword of E4M3 bytes in that order."""
    if spec.scaled_cvt:
        out = _cvt16(spec, _cvt16(spec, poison(i32_t()), p0, conv, False), p1, conv, True)
        return out if spec.signed_zeros else unsign_zeros(out)
    vals = []
    for d in (p0, p1):
        if spec.dtype == "bf16":
            vals += [shl(d, 16), band(d, 0xFFFF0000)]
        else:
            halves = bitcast(v2f16_t(), d)
            vals += [as_i32(arith.extf(f32_t(), extract(halves, j))) for j in range(2)]
    out = _fnuz4(vals, conv, spec.mode == "floor")
    if not spec.signed_zeros:
        return out
    signs = perm(p1, p0, 0x07050301)  # the four sign bytes
    return bor(out, band(signs, 0x80808080))


def convert4_32(spec: Spec, xs, conv):
    """Four FP32 elements (bits) of one block -> one dword of E4M3 bytes."""
    if spec.scaled_cvt:
        out = _cvt32(_cvt32(poison(i32_t()), xs[0], xs[1], conv, False), xs[2], xs[3], conv, True)
        return out if spec.signed_zeros else unsign_zeros(out)
    out = _fnuz4(xs, conv, spec.mode == "floor")
    if not spec.signed_zeros:
        return out
    low, high = perm(xs[1], xs[0], 0x0C0C0703), perm(xs[3], xs[2], 0x0C0C0703)
    signs = perm(high, low, 0x05040100)  # byte 3 (the sign byte) of each value
    return bor(out, band(signs, 0x80808080))


def convert_piece(spec: Spec, dwords, conv):
    """One loaded piece (4 dwords: 8 BF16/FP16 or 4 FP32 of one block) -> its E4M3 bytes as
    output dwords (2 or 1), element order kept."""
    if spec.wide:
        return [convert4_32(spec, dwords, conv)]
    return [convert4_16(spec, dwords[i], dwords[i + 1], conv) for i in (0, 2)]
