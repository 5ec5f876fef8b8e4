"""Number-format conversions: FP8/BF8 (OCP on gfx950, FNUZ on gfx942), FP4 E2M1, BF16, F16, ints.

Formats (bits: sign | exponent | mantissa):
- OCP E4M3 "fp8" (gfx950): bias 7, max 448 (0x7E), NaN S.1111.111, has -0, no infinity.
- OCP E5M2 "bf8" (gfx950): bias 15, max 57344, infinity S.11111.00, NaN S.11111.{01,10,11}.
- FNUZ E4M3 "fp8" (gfx942): bias 8, max 240 (0x7F), the only NaN is 0x80, no -0, no infinity.
- FNUZ E5M2 "bf8" (gfx942): bias 16, max 57344 (0x7F), NaN 0x80, no -0, no infinity.
- FP4 E2M1: bias 1, values 0, 0.5, 1, 1.5, 2, 3, 4, 6; no infinity/NaN.
Narrowing conversions round to nearest even. Without saturation (the hardware default; AMD's
libraries clamp the input with v_med3 first when they want saturation; with MODE.FP16_OVFL set,
as Triton's gfx950 kernels do, the FP8/BF8 conversions saturate instead) a finite value that
rounds past the largest finite one becomes NaN (E4M3, both FNUZ formats) or infinity (OCP E5M2);
an infinity becomes the same. A NaN input gives the format's NaN with the input's sign (OCP:
S.1111.111 / S.11111.10; FNUZ: 0x80). FP4, which has neither, saturates: NaN and overflow give
+-6. The OCP/FP4 rules, the NaN payloads below and the scaled forms follow AMD's host model of
the gfx950 conversions (amd_hip_ocp_host.hpp, "gfx950 HW behavior"); none is verified on an
MI300X/MI355X here.

gfx950's scaled conversions (v_cvt_scalef32_*) use only the exponent field of the f32 scale
operand, an E8M0 value s: narrowing converts x / 2**(s - 127), widening returns v * 2**(s - 127)
(how FlyDSL's MX kernels use them: the dequantization scale is passed to both); s = 0xFF (NaN)
makes every result a NaN with the element's sign. Widening a NaN gives f32 0x7FC00000 and
f16/bf16 0x7FFF, with the sign bit of the code.
"""

from __future__ import annotations

import math

import numpy as np

from . import table
from .isa_base import F16, F32, F64, I32, U8, U16, U32, fp16_ovfl, vsrc, vwriter
from .isa_valu import vop_builders

F32_EXP_BIAS = 127


class F8Format:
    """An 8-bit (or 4-bit) float format: decode table and round-to-nearest-even encoder."""

    def __init__(self, name: str, ebits: int, mbits: int, bias: int, fnuz: bool, has_inf: bool, max_code: int):
        self.name, self.ebits, self.mbits, self.bias = name, ebits, mbits, bias
        self.fnuz, self.has_inf = fnuz, has_inf
        self.nbits = 1 + ebits + mbits
        self.sign_bit = 1 << (ebits + mbits)
        self.max_code = max_code
        self.table = np.array([self._decode_one(c) for c in range(1 << self.nbits)], F32)
        self.table.flags.writeable = False
        self.max_value = float(self.table[max_code])
        self.emin = 1 - bias  # exponent of the smallest normal value
        self._tables: dict[bool, np.ndarray] = {}
        self._class_shift = U32(22 - mbits)  # binary32 bits above it: sign, exponent, mbits + 1 mantissa bits
        self._sticky_mask = U32((1 << (22 - mbits)) - 1)

    def _decode_one(self, code: int) -> float:
        sign = -1.0 if code & self.sign_bit else 1.0
        nan = math.copysign(math.nan, sign)
        e = (code >> self.mbits) & ((1 << self.ebits) - 1)
        m = code & ((1 << self.mbits) - 1)
        if self.fnuz and code == self.sign_bit:
            return nan
        if not self.fnuz and self.nbits == 8:
            emax_field = (1 << self.ebits) - 1
            if self.has_inf and e == emax_field:
                return sign * math.inf if m == 0 else nan
            if not self.has_inf and e == emax_field and m == (1 << self.mbits) - 1:
                return nan
        if e == 0:
            return sign * m * 2.0 ** (1 - self.bias - self.mbits)
        return sign * (1 + m / (1 << self.mbits)) * 2.0 ** (e - self.bias)

    def decode(self, codes) -> np.ndarray:
        return self.table[np.asarray(codes).astype(np.intp) & ((1 << self.nbits) - 1)]

    def encode(self, x, saturate: bool = False) -> np.ndarray:
        """Round-to-nearest-even codes of binary32 values `x`, by table lookup.

        The result depends only on the sign, the exponent, the top mbits + 1 mantissa bits and
        whether any lower bit is set (the sticky bit), also for results below the smallest
        normal (their guard bit is within those mantissa bits); the table holds
        `_encode_exact` of one value per such class."""
        table = self._tables.get(saturate)
        if table is None:
            classes = np.arange(1 << (1 + 8 + self.mbits + 1 + 1), dtype=np.uint32)  # class << 1 | sticky
            rep = ((classes >> U32(1)) << U32(22 - self.mbits)) | (classes & U32(1))
            table = self._tables[saturate] = self._encode_exact(rep.view(F32), saturate)
        b = np.asarray(x, F32).view(U32)
        sticky = (b & self._sticky_mask) != 0
        return table[((b >> self._class_shift) << U32(1)) | sticky]

    def _encode_exact(self, x, saturate: bool) -> np.ndarray:
        """Round-to-nearest-even codes of binary32 values `x` (narrower floats convert exactly).

        Normal results: RNE on the binary32 bit pattern (add half an output ulp minus one plus
        the lowest kept bit, truncate), then rebias. Results below the smallest normal: adding
        2**(emin - mbits + 23) aligns the output quantum with the binary32 ulp, so the binary32
        addition rounds to nearest even; the low bits are then the code (2**mbits rolls over
        into the smallest normal code)."""
        x = np.asarray(x, F32)
        b = x.view(U32)
        u = b & U32(0x7FFFFFFF)
        neg = (b >> U32(31)).astype(bool)
        shift = 23 - self.mbits
        r = (u + U32((1 << (shift - 1)) - 1) + ((u >> U32(shift)) & U32(1))) >> U32(shift)
        code = r.astype(np.int64) - ((F32_EXP_BIAS - self.bias) << self.mbits)
        small = u < U32((F32_EXP_BIAS + self.emin) << 23)
        if small.any():
            magic = np.float32(2.0 ** (self.emin - self.mbits + 23))
            with np.errstate(invalid="ignore"):  # NaN lanes: replaced below
                aligned = (np.abs(x) + magic).view(U32).astype(np.int64) - int(magic.view(U32))
            code = np.where(small, aligned, code)
        over = code > self.max_code
        if saturate:
            code = np.where(over, self.max_code, code)
        else:
            code = np.where(over, self._overflow_code(), code)
        nan = u > U32(0x7F800000)
        inf = u == U32(0x7F800000)
        code = np.where(nan, self.max_code if (saturate and self.nbits == 4) else self._nan_code(),
                        np.where(inf, self._inf_code(saturate), code))
        if self.fnuz:  # no negative zero; the NaN code 0x80 already carries the sign bit
            sign = neg & (code != 0) & (code != self.sign_bit)
        else:
            sign = neg
        return (code | np.where(sign, self.sign_bit, 0)).astype(U8)

    def _nan_code(self) -> int:
        if self.fnuz:
            return self.sign_bit
        if self.has_inf:
            return ((1 << self.ebits) - 1) << self.mbits | ((1 << self.mbits) - 2)  # S.11111.10
        return (1 << (self.ebits + self.mbits)) - 1  # S.1111.111

    def _overflow_code(self) -> int:
        if self.nbits == 4:
            return self.max_code
        if self.has_inf:
            return ((1 << self.ebits) - 1) << self.mbits
        return self._nan_code()

    def _inf_code(self, saturate: bool) -> int:
        if self.nbits == 4:
            return self.max_code
        if self.has_inf:
            return ((1 << self.ebits) - 1) << self.mbits
        return self._nan_code()


OCP_E4M3 = F8Format("ocp_e4m3", 4, 3, 7, fnuz=False, has_inf=False, max_code=0x7E)
OCP_E5M2 = F8Format("ocp_e5m2", 5, 2, 15, fnuz=False, has_inf=True, max_code=0x7B)
FNUZ_E4M3 = F8Format("fnuz_e4m3", 4, 3, 8, fnuz=True, has_inf=False, max_code=0x7F)
FNUZ_E5M2 = F8Format("fnuz_e5m2", 5, 2, 16, fnuz=True, has_inf=False, max_code=0x7F)
E2M1 = F8Format("e2m1", 2, 1, 1, fnuz=False, has_inf=False, max_code=0x7)


def fp8_formats(arch: str) -> tuple[F8Format, F8Format]:
    """(fp8, bf8) formats of the hardware FP8 conversions and MFMAs on `arch`."""
    return (OCP_E4M3, OCP_E5M2) if arch == "gfx950" else (FNUZ_E4M3, FNUZ_E5M2)


# --- bf16 / f16 ---------------------------------------------------------------------------------------
def f32_to_bf16_bits(x) -> np.ndarray:
    """Round-to-nearest-even f32 -> bf16 bits; a NaN stays a NaN (quiet, sign and top payload kept)."""
    b = np.asarray(x, F32).view(U32)
    rounded = (b + U32(0x7FFF) + ((b >> U32(16)) & U32(1))) >> U32(16)
    nan = (b & U32(0x7FFFFFFF)) > U32(0x7F800000)
    return np.where(nan, (b >> U32(16)) | U32(0x40), rounded).astype(U16)


def bf16_bits_to_f32(h) -> np.ndarray:
    return (np.asarray(h, U32) << U32(16)).view(F32)


def f32_to_i32(x) -> np.ndarray:
    """Truncate toward zero, saturating; NaN -> 0."""
    x = np.asarray(x, F64)
    return np.where(np.isnan(x), 0, np.clip(np.trunc(x), -2.0 ** 31, 2.0 ** 31 - 1)).astype(I32)


def f32_to_u32(x) -> np.ndarray:
    """Truncate toward zero, saturating to [0, 2**32 - 1]; NaN -> 0."""
    x = np.asarray(x, F64)
    return np.where(np.isnan(x), 0, np.clip(np.trunc(x), 0, 2.0 ** 32 - 1)).astype(U32)


def _f16_rtz(x) -> np.ndarray:
    """f32 -> f16 rounding toward zero (v_cvt_pkrtz_f16_f32)."""
    x = np.asarray(x, F32)
    r = x.astype(F16)
    too_big = np.abs(r.astype(F64)) > np.abs(x.astype(F64))
    step_down = np.nextafter(r, np.zeros_like(r))
    r = np.where(too_big & np.isfinite(x), step_down, r)
    return r.astype(F16)


def scale_exponent(scale_f32) -> np.ndarray:
    """The E8M0 scale carried by a v_cvt_scalef32 scale operand: its f32 exponent field."""
    return (np.asarray(scale_f32, F32).view(U32) >> U32(23)) & U32(0xFF)


def e8m0_pow2(s) -> np.ndarray:
    """2**(s - 127) (float64) for E8M0 codes s (0xFF: NaN)."""
    return np.where(s == 0xFF, np.nan, np.ldexp(1.0, (s - F32_EXP_BIAS).astype(I32)))


# 2**(127 - s) in binary32 for every E8M0 code s (s = 254: the subnormal 2**-127; 255: NaN),
# indexed by the top 9 bits (sign, exponent) of the f32 scale operand
_INV_POW2 = np.array([np.ldexp(np.float32(1.0), F32_EXP_BIAS - s) for s in range(255)] + [np.nan], F32)
_INV_POW2_BY_TOP9 = np.concatenate([_INV_POW2, _INV_POW2])
F32_EXP_SHIFT = U32(23)


def unscale(x, scale_f32) -> np.ndarray:
    """x / 2**(s - 127) in binary32, s the exponent field of the scale operand (0xFF: NaN).

    Multiplying by the power of two 2**(127 - s) is exact in binary32 except where the result
    leaves the normal range: overflow gives infinity (the narrow format's overflow code either
    way) and results below 2**-126 are far below the narrow formats' smallest subnormal
    (they round to zero either way), so one binary32 multiply is as good as exact division."""
    x = np.asarray(x, F32)
    factor = _INV_POW2_BY_TOP9[np.asarray(scale_f32, F32).view(U32) >> F32_EXP_SHIFT]
    if np.count_nonzero(np.isnan(factor)):  # scale code 0xFF: NaN with each element's sign
        return np.where(np.isnan(factor), np.copysign(np.float32(np.nan), x), x * factor)
    return x * factor


# --- builders -----------------------------------------------------------------------------------------
def _no_mods(ctx, inst, allow_opsel=False):
    if inst.neg or inst.abs or inst.clamp or inst.omod or (inst.opsel and not allow_opsel):
        raise ctx.error(inst, "modifiers on this conversion are not supported")
    if inst.dpp is not None:
        raise ctx.error(inst, "DPP on this conversion is not supported")


def _sdwa_byte_sel(inst) -> int | None:
    """Byte selected by SDWA src0_sel for v_cvt_f32_{fp8,bf8}, else None: BYTE_1..3 select their
    byte, anything else byte 0 (the ISA pseudocode: "else // BYTE0 implied"; WORD_1 too)."""
    if inst.sdwa is None:
        return None
    sel = inst.sdwa["src0_sel"]
    return sel if sel in (1, 2, 3) else 0


def build_cvt_pk_f8(inst, ctx):
    """v_cvt_pk_fp8_f32 / v_cvt_pk_bf8_f32: two f32 -> two 8-bit floats in the low (op_sel[3]=0)
    or high 16 bits of vdst; the other half is kept. Saturating when MODE.FP16_OVFL is set."""
    fmt = fp8_formats(ctx.arch)[inst.name == "v_cvt_pk_bf8_f32"]
    a, b = _float_src(ctx, inst, 0), _float_src(ctx, inst, 1)
    if inst.clamp or inst.omod:
        raise ctx.error(inst, "clamp/omod on an FP8 conversion are not modelled")
    put = vwriter(ctx, inst, "u16", hi=(inst.opsel >> 3) & 1)
    return lambda w: put(w, encode_pairs(fmt, a(w), b(w), saturate=fp16_ovfl(w)))


def _lanes(x, dtype) -> np.ndarray:
    """x as a 64-lane array of dtype (a scalar operand is repeated)."""
    a = np.asarray(x, dtype)
    return a if a.ndim else np.full(64, a)


def encode_pairs(fmt: F8Format, lo, hi, scale=None, saturate=False) -> np.ndarray:
    """uint16[64] holding code(lo) in bits 7:0 and code(hi) in bits 15:8 of each lane (f32
    inputs; `scale`: a v_cvt_scalef32 scale operand to divide by; `saturate`: MODE.FP16_OVFL).
    One encode of 128 values."""
    pairs = np.empty((64, 2), F32)  # lo first (little-endian)
    pairs[:, 0] = lo
    pairs[:, 1] = hi
    if scale is not None:
        pairs = unscale(pairs, np.asarray(scale, F32)[..., None] if np.ndim(scale) else scale)
    return fmt.encode(pairs, saturate).view(U16).reshape(64)


def _float_src(ctx, inst, i):
    """An f32 source with abs/neg modifiers."""
    g = vsrc(ctx, inst, i, "f32")
    ab, ng = (inst.abs >> i) & 1, (inst.neg >> i) & 1
    if ab:
        g0 = g
        g = lambda w: np.abs(g0(w))  # noqa: E731
    if ng:
        g1 = g
        g = lambda w: np.negative(g1(w))  # noqa: E731
    return g


def build_cvt_f32_f8(inst, ctx):
    """v_cvt_f32_fp8 / v_cvt_f32_bf8: one byte (SDWA src0_sel, else op_sel in VOP3) -> f32."""
    fmt = fp8_formats(ctx.arch)[inst.name == "v_cvt_f32_bf8"]
    src = vsrc(ctx, inst, 0, "u32")
    sel = _sdwa_byte_sel(inst)
    if sel is None:
        sel = inst.opsel & 3 if inst.enc == "VOP3" else 0
    put = vwriter(ctx, inst, "f32")
    shift = U32(8 * sel)
    return lambda w: put(w, fmt.decode((np.asarray(src(w), U32) >> shift) & U32(0xFF)))


def build_cvt_pk_f32_f8(inst, ctx):
    """v_cvt_pk_f32_fp8 / _bf8: two bytes of word 0 or 1 -> two f32 in vdst, vdst+1."""
    fmt = fp8_formats(ctx.arch)[inst.name == "v_cvt_pk_f32_bf8"]
    src = vsrc(ctx, inst, 0, "u32")
    word = 0
    if inst.sdwa is not None:  # the pseudocode compares SDWA_SRC0_SEL[1:0] with WORD_1's: BYTE_1 too
        word = 1 if inst.sdwa["src0_sel"] & 3 == 1 else 0
    elif inst.enc == "VOP3":
        word = inst.opsel & 1
    put_lo, put_hi = vwriter(ctx, inst, "f32"), vwriter(ctx, inst, "f32", inst.vdst + 1)
    shift = U32(16 * word)

    def run(w):
        x = np.asarray(src(w), U32) >> shift
        lo, hi = fmt.decode(x & U32(0xFF)), fmt.decode((x >> U32(8)) & U32(0xFF))
        put_lo(w, lo)
        put_hi(w, hi)
    return run


def build_cvt_scalef32_pk_f8(inst, ctx):
    """v_cvt_scalef32_pk_{fp8,bf8}_f32 (gfx950): fp8(S0 / 2**(s-127)), fp8(S1 / ...) into the
    op_sel[3] half of vdst; s = exponent field of S2. Saturating when MODE.FP16_OVFL is set."""
    _no_mods(ctx, inst, allow_opsel=True)
    fmt = fp8_formats(ctx.arch)[inst.name.endswith("bf8_f32")]
    a, b, sc = vsrc(ctx, inst, 0, "f32"), vsrc(ctx, inst, 1, "f32"), vsrc(ctx, inst, 2, "f32")
    put = vwriter(ctx, inst, "u16", hi=(inst.opsel >> 3) & 1)

    return lambda w: put(w, encode_pairs(fmt, a(w), b(w), sc(w), fp16_ovfl(w)))


def build_cvt_scalef32_pk_f8_16(inst, ctx):
    """v_cvt_scalef32_pk_{fp8,bf8}_{f16,bf16} (gfx950): the two 16-bit halves of S0, scale S1;
    saturating when MODE.FP16_OVFL is set."""
    _no_mods(ctx, inst, allow_opsel=True)
    fmt = fp8_formats(ctx.arch)[inst.name.startswith("v_cvt_scalef32_pk_bf8")]
    src, sc = vsrc(ctx, inst, 0, "u32"), vsrc(ctx, inst, 1, "f32")
    is_bf16 = inst.name.endswith("_bf16")
    put = vwriter(ctx, inst, "u16", hi=(inst.opsel >> 3) & 1)

    def run(w):
        halves = np.ascontiguousarray(_lanes(src(w), U32)).view(U16).reshape(64, 2)  # [:, 0] = bits 15:0
        values = (halves.astype(U32) << U32(16)).view(F32) if is_bf16 else halves.view(F16).astype(F32)
        scale = sc(w)
        values = unscale(values, np.asarray(scale, F32)[..., None] if np.ndim(scale) else scale)
        put(w, fmt.encode(values, fp16_ovfl(w)).view(U16).reshape(64))
    return run


def build_cvt_scalef32_f8_to_f32(inst, ctx):
    """v_cvt_scalef32_pk_f32_{fp8,bf8}: word op_sel[0] -> 2 f32; v_cvt_scalef32_f32_{fp8,bf8}:
    byte op_sel[1:0] -> f32; each times 2**(s-127), s = exponent field of S1."""
    _no_mods(ctx, inst, allow_opsel=True)
    fmt = fp8_formats(ctx.arch)[inst.name.endswith("bf8")]
    src, sc = vsrc(ctx, inst, 0, "u32"), vsrc(ctx, inst, 1, "f32")
    packed = "_pk_" in inst.name
    shift = U32(16 * (inst.opsel & 1) if packed else 8 * (inst.opsel & 3))
    put_lo = vwriter(ctx, inst, "f32")
    put_hi = vwriter(ctx, inst, "f32", inst.vdst + 1) if packed else None

    def run(w):
        p = e8m0_pow2(scale_exponent(sc(w)))
        x = np.asarray(src(w), U32) >> shift
        put_lo(w, (fmt.decode(x & U32(0xFF)).astype(F64) * p).astype(F32))
        if packed:
            put_hi(w, (fmt.decode((x >> U32(8)) & U32(0xFF)).astype(F64) * p).astype(F32))
    return run


def build_cvt_scalef32_pk_fp4_out(inst, ctx):
    """v_cvt_scalef32_pk_fp4_f32 (S0, S1, scale S2) and _fp4_{f16,bf16} (halves of S0, scale S1):
    two E2M1 codes (saturating) into byte op_sel[3:2] of vdst, other bytes kept."""
    _no_mods(ctx, inst, allow_opsel=True)
    byte = (inst.opsel >> 2) & 3
    row = inst.vdst
    if inst.name == "v_cvt_scalef32_pk_fp4_f32":
        a, b, sc = vsrc(ctx, inst, 0, "f32"), vsrc(ctx, inst, 1, "f32"), vsrc(ctx, inst, 2, "f32")

        def values(w):
            return a(w), b(w), sc(w)
    else:
        src, sc = vsrc(ctx, inst, 0, "u32"), vsrc(ctx, inst, 1, "f32")
        is_bf16 = inst.name.endswith("_bf16")

        def values(w):
            x = np.asarray(src(w), U32)
            if is_bf16:
                lo, hi = bf16_bits_to_f32(x & U32(0xFFFF)), bf16_bits_to_f32(x >> U32(16))
            else:
                lo, hi = (x & U32(0xFFFF)).astype(U16).view(F16), (x >> U32(16)).astype(U16).view(F16)
            return lo, hi, sc(w)

    def run(w):
        lo, hi, s = values(w)
        code = (E2M1.encode(unscale(lo, s), saturate=True).astype(U32)
                | (E2M1.encode(unscale(hi, s), saturate=True).astype(U32) << U32(4)))
        new = (w.v[row] & ~U32(0xFF << (8 * byte))) | (code << U32(8 * byte))
        np.copyto(w.v[row], new, where=w.exec_mask)
    return run


def _scaled_table(decoded: np.ndarray, out: str) -> np.ndarray:
    """(256 scale codes, codes) bit patterns of decoded[code] * 2**(s - 127) in `out`
    (f32, f16 or bf16): computed exactly in binary64, rounded once to the output format."""
    with np.errstate(over="ignore", invalid="ignore"):
        values = decoded.astype(F64)[None, :] * e8m0_pow2(np.arange(256))[:, None]
        negative = np.broadcast_to(np.signbit(decoded)[None, :], values.shape)
        nan = np.isnan(values)
        if out == "f32":
            bits = values.astype(F32).view(U32)
            nan_bits, sign = U32(0x7FC00000), U32(0x80000000)
        else:  # bf16: binary64 -> f32 is exact here (few significant bits) unless it overflows
            bits = f32_to_bf16_bits(values.astype(F32)) if out == "bf16" else values.astype(F16).view(U16)
            nan_bits, sign = U16(0x7FFF), U16(0x8000)
        return np.where(nan, np.where(negative, nan_bits | sign, nan_bits), bits)


_SCALED_TABLES: dict = {}


def scaled_table(fmt: F8Format, out: str) -> np.ndarray:
    """Cached `_scaled_table` of a format."""
    key = (fmt.name, out)
    if key not in _SCALED_TABLES:
        _SCALED_TABLES[key] = _scaled_table(fmt.table, out)
    return _SCALED_TABLES[key]


def scaled_pair_table(fmt: F8Format, out: str) -> np.ndarray:
    """uint32 [256 * scale + pair]: the two 16-bit results (`out`: f16 or bf16) of a packed pair
    of codes (low code in the low bits of `pair`) at one scale, one gather per instruction."""
    key = (fmt.name, out, "pair")
    if key not in _SCALED_TABLES:
        t = scaled_table(fmt, out).astype(U32)
        code_bits = fmt.nbits
        pairs = np.arange(1 << (2 * code_bits))
        lo, hi = pairs & ((1 << code_bits) - 1), pairs >> code_bits
        _SCALED_TABLES[key] = (t[:, lo] | (t[:, hi] << U32(16))).reshape(-1)
    return _SCALED_TABLES[key]


SCALE_ROW = 256  # entries per scale code in the pair / scaled tables
_SCALE_ROW_BY_TOP9 = (np.arange(512, dtype=np.intp) & 0xFF) * SCALE_ROW


def scale_row(scale_f32) -> np.ndarray:
    """Exponent field of the scale operand times SCALE_ROW (a row offset into a flattened
    (256 scales, 256 codes) table), from the operand's top 9 bits by one lookup."""
    return _SCALE_ROW_BY_TOP9[np.asarray(scale_f32, F32).view(U32) >> F32_EXP_SHIFT]


def build_cvt_scalef32_fp4_in(inst, ctx):
    """v_cvt_scalef32_pk_{f32,f16,bf16}_fp4 (gfx950): byte op_sel[1:0] of S0 holds two E2M1 codes
    (low nibble first); each becomes value * 2**(s-127), s = exponent field of S1."""
    _no_mods(ctx, inst, allow_opsel=True)
    src, sc = vsrc(ctx, inst, 0, "u32"), vsrc(ctx, inst, 1, "f32")
    shift = U32(8 * (inst.opsel & 3))
    out = inst.name.split("_")[4]  # v_cvt_scalef32_pk_<out>_fp4: f32 | f16 | bf16
    if out == "f32":
        table = scaled_table(E2M1, out)
        put_lo, put_hi = vwriter(ctx, inst, "f32"), vwriter(ctx, inst, "f32", inst.vdst + 1)

        def run_f32(w):
            e = scale_exponent(sc(w))
            byte = (np.asarray(src(w), U32) >> shift) & U32(0xFF)
            put_lo(w, table[e, byte & U32(0xF)].view(F32))
            put_hi(w, table[e, byte >> U32(4)].view(F32))
        return run_f32
    pairs = scaled_pair_table(E2M1, out)
    put = vwriter(ctx, inst, "u32")

    def run(w):  # both results of the byte at once: pairs[256 * scale + byte]
        put(w, pairs[scale_row(sc(w)) + ((np.asarray(src(w), U32) >> shift) & U32(0xFF))])
    return run


def build_cvt_scalef32_f8_to_16(inst, ctx):
    """v_cvt_scalef32_pk_{f16,bf16}_{fp8,bf8} (gfx950): word op_sel[0] of S0 -> two 16-bit floats."""
    _no_mods(ctx, inst, allow_opsel=True)
    fmt = fp8_formats(ctx.arch)[inst.name.endswith("bf8")]
    src, sc = vsrc(ctx, inst, 0, "u32"), vsrc(ctx, inst, 1, "f32")
    shift = U32(16 * (inst.opsel & 1))
    table = scaled_table(fmt, inst.name.split("_")[4]).astype(U32).reshape(-1)  # <bf16|f16>_<fp8|bf8>
    put = vwriter(ctx, inst, "u32")

    def run(w):  # table[256 * scale + code] for each byte of the selected word
        row = scale_row(sc(w))
        x = np.asarray(src(w), U32) >> shift
        put(w, table[row + (x & U32(0xFF))] | (table[row + ((x >> U32(8)) & U32(0xFF))] << U32(16)))
    return run


def build_cvt_pk_16_f32(inst, ctx):
    """v_cvt_pk_bf16_f32 (gfx950), v_cvt_pk_f16_f32 (gfx950, RNE), v_cvt_pkrtz_f16_f32 (RTZ):
    S0 -> bits 15:0, S1 -> bits 31:16."""
    if inst.clamp or inst.omod:
        raise ctx.error(inst, "clamp/omod on a packing conversion are not supported")
    a, b = _float_src(ctx, inst, 0), _float_src(ctx, inst, 1)
    put = vwriter(ctx, inst, "u32")
    if inst.name == "v_cvt_pk_bf16_f32":
        conv = f32_to_bf16_bits
    elif inst.name == "v_cvt_pk_f16_f32":
        conv = lambda x: np.asarray(x, F32).astype(F16).view(U16)  # noqa: E731
    else:
        conv = lambda x: _f16_rtz(x).view(U16)  # noqa: E731
    return lambda w: put(w, conv(a(w)).astype(U32) | (conv(b(w)).astype(U32) << U32(16)))


def _f16_to_int(x, low, high):
    """Truncate toward zero, saturating to [low, high]; NaN -> 0."""
    return np.clip(np.nan_to_num(np.trunc(np.asarray(x, F32)), nan=0), low, high)


# Simple one-source conversions: name -> (dst kind, src kind, fn); handled by isa_valu.build_vop
SIMPLE = {
    "v_cvt_f32_i32": ("f32", "i32", lambda x: np.asarray(x).astype(F32)),
    "v_cvt_f32_u32": ("f32", "u32", lambda x: np.asarray(x).astype(F32)),
    "v_cvt_i32_f32": ("i32", "f32", f32_to_i32),
    "v_cvt_u32_f32": ("u32", "f32", f32_to_u32),
    "v_cvt_rpi_i32_f32": ("i32", "f32", lambda x: f32_to_i32(np.floor(np.asarray(x, F64) + 0.5))),
    "v_cvt_flr_i32_f32": ("i32", "f32", lambda x: f32_to_i32(np.floor(x))),
    "v_cvt_f16_f32": ("f16", "f32", lambda x: np.asarray(x, F32).astype(F16)),
    "v_cvt_f32_f16": ("f32", "f16", lambda x: np.asarray(x, F16).astype(F32)),
    "v_cvt_f32_f64": ("f32", "f64", lambda x: np.asarray(x, F64).astype(F32)),
    "v_cvt_f64_f32": ("f64", "f32", lambda x: np.asarray(x, F32).astype(F64)),
    "v_cvt_f64_i32": ("f64", "i32", lambda x: np.asarray(x).astype(F64)),
    "v_cvt_f64_u32": ("f64", "u32", lambda x: np.asarray(x).astype(F64)),
    "v_cvt_i32_f64": ("i32", "f64", f32_to_i32),
    "v_cvt_u32_f64": ("u32", "f64", f32_to_u32),
    "v_cvt_f32_bf16": ("f32", "u32", lambda x: bf16_bits_to_f32(np.asarray(x, U32) & U32(0xFFFF))),
    "v_cvt_f16_u16": ("f16", "u16", lambda x: np.asarray(x).astype(F16)),
    "v_cvt_f16_i16": ("f16", "i16", lambda x: np.asarray(x).astype(F16)),
    "v_cvt_u16_f16": ("u16", "f16", lambda x: _f16_to_int(x, 0, 0xFFFF).astype(U16)),
    "v_cvt_i16_f16": ("i16", "f16", lambda x: _f16_to_int(x, -0x8000, 0x7FFF).astype(np.int16)),
    "v_cvt_f32_ubyte0": ("f32", "u32", lambda x: (np.asarray(x, U32) & U32(0xFF)).astype(F32)),
    "v_cvt_f32_ubyte1": ("f32", "u32", lambda x: ((np.asarray(x, U32) >> U32(8)) & U32(0xFF)).astype(F32)),
    "v_cvt_f32_ubyte2": ("f32", "u32", lambda x: ((np.asarray(x, U32) >> U32(16)) & U32(0xFF)).astype(F32)),
    "v_cvt_f32_ubyte3": ("f32", "u32", lambda x: (np.asarray(x, U32) >> U32(24)).astype(F32)),
}
# Two-source packing instructions (integers): name -> (dst, srcs, fn)
SIMPLE2 = {
    "v_cvt_pk_u16_u32": ("u32", ("u32", "u32"),
                         lambda a, b: np.minimum(a, U32(0xFFFF)) | (np.minimum(b, U32(0xFFFF)) << U32(16))),
    "v_cvt_pk_i16_i32": ("u32", ("i32", "i32"),
                         lambda a, b: (np.clip(a, -32768, 32767).astype(np.int16).view(U16).astype(U32))
                         | (np.clip(b, -32768, 32767).astype(np.int16).view(U16).astype(U32) << U32(16))),
}

BUILDERS = {
    **dict.fromkeys(("v_cvt_pk_fp8_f32", "v_cvt_pk_bf8_f32"), build_cvt_pk_f8),
    **dict.fromkeys(("v_cvt_f32_fp8", "v_cvt_f32_bf8"), build_cvt_f32_f8),
    **dict.fromkeys(("v_cvt_pk_f32_fp8", "v_cvt_pk_f32_bf8"), build_cvt_pk_f32_f8),
    **dict.fromkeys(("v_cvt_scalef32_pk_fp8_f32", "v_cvt_scalef32_pk_bf8_f32"), build_cvt_scalef32_pk_f8),
    **dict.fromkeys(("v_cvt_scalef32_pk_fp8_f16", "v_cvt_scalef32_pk_bf8_f16", "v_cvt_scalef32_pk_fp8_bf16",
                     "v_cvt_scalef32_pk_bf8_bf16"), build_cvt_scalef32_pk_f8_16),
    **dict.fromkeys(("v_cvt_scalef32_pk_f32_fp8", "v_cvt_scalef32_pk_f32_bf8", "v_cvt_scalef32_f32_fp8",
                     "v_cvt_scalef32_f32_bf8"), build_cvt_scalef32_f8_to_f32),
    **dict.fromkeys(("v_cvt_scalef32_pk_f16_fp8", "v_cvt_scalef32_pk_f16_bf8", "v_cvt_scalef32_pk_bf16_fp8",
                     "v_cvt_scalef32_pk_bf16_bf8"), build_cvt_scalef32_f8_to_16),
    **dict.fromkeys(("v_cvt_scalef32_pk_fp4_f32", "v_cvt_scalef32_pk_fp4_f16", "v_cvt_scalef32_pk_fp4_bf16"),
                    build_cvt_scalef32_pk_fp4_out),
    **dict.fromkeys(("v_cvt_scalef32_pk_f32_fp4", "v_cvt_scalef32_pk_f16_fp4", "v_cvt_scalef32_pk_bf16_fp4"),
                    build_cvt_scalef32_fp4_in),
    **dict.fromkeys(("v_cvt_pk_bf16_f32", "v_cvt_pk_f16_f32", "v_cvt_pkrtz_f16_f32"), build_cvt_pk_16_f32),
}
table.register(BUILDERS)
table.register(vop_builders(SIMPLE, SIMPLE2))
