"""MX number formats, bit-exact, in plain PyTorch (any device).

Formats (OCP Microscaling spec v1.0):

- E8M0 (``torch.float8_e8m0fnu``): a block scale 2^(c - 127) for the byte c; code 0 is 2^-127,
  0xFF is NaN, there is no zero and no sign.
- FP8 E4M3 (OCP, ``torch.float8_e4m3fn``): bias 7, max 448, NaN 0x7F/0xFF, no infinities.
  Encoding saturates: anything above 448 (and +-Inf) becomes +-448.
- FP4 E2M1: values {0, 0.5, 1, 1.5, 2, 3, 4, 6} and their negatives in 4 bits (sign in bit 3),
  no NaN or Inf. Two per byte, the even element in the low nibble.

The MX block scale (one E8M0 per block of 32 elements) of MXFP8 (E4M3) follows torchao main's
shared MXFP8 bitwise contract (pytorch/ao PR 4725; `to_mx` and torchao/testing/_mxfp8_test_utils.py
at main), exact bit rules with no float rounding quirks:
- amax = max |x| over the block, in FP32 (BF16/FP16 upcast exactly); a NaN or Inf anywhere in the
  block gives the scale 0xFF and every element the NaN pattern 0x7F.
- floor: code = max(fp32 exponent field of amax - 8, 0) (8: 2^8 = 256 <= 448 < 2^9).
- rceil: descale = amax * fl32(1/448) (an FP32 multiply, rounded to nearest even), then rounded
  up to a power of two from its own FP32 bits (e8m0_rceil): a normal rounds up when any mantissa
  bit is set; a subnormal is code 0 up to 2^-127 and code 1 above.
- elements: e4m3(x * 2^(127 - code)) in FP32, round to nearest even, saturating to +-448; code
  0 means 2^-127 and is used (the multiplier is then 2^127).
MXFP4 (E2M1, max 6 = 1.5 * 2^2) follows the same contract with its own constants (floor: field
- 2; rceil: amax * fl32(1/6)), plus the mode "even" (torchao's ScaleCalculationMode.EVEN): amax's
FP32 bits rounded at E2M1's one mantissa bit (+ 2^21, then the mantissa cleared: mantissas from
0.75 carry into the exponent), then floor's rule on the rounded exponent field. A rounded field
of 255 (amax >= 1.75 * 2^127, finite) gives code 253 as torchao 0.18 does; torchao main's to_mx
takes that rounded value for Inf and gives 0xFF. Elements e2m1(x * 2^(127 - code)), nearest
even, saturating at +-6; a NaN/Inf block gets scale 0xFF and every element E2M1_NAN_BLOCK_CODE.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

MX_BLOCK = 32  # elements per scale block (OCP MX)

# FP32 bit layout
F32_MANT_BITS = 23
F32_EXP_MASK = 0xFF
F32_EXP_BIAS = 127
F32_ABS_MASK = 0x7FFFFFFF
F32_INF_BITS = 0x7F800000
F32_QNAN_BITS = 0x7FC00000
F32_MAX = 3.4028234663852886e38  # the largest finite FP32 (FLT_MAX)

# E8M0
E8M0_BIAS = 127
E8M0_MIN_EXP = -127  # code 0
E8M0_MAX_EXP = 127  # code 254
E8M0_NAN = 0xFF
E8M0_CODE0_F32_BITS = 0x00400000  # 2^-127 is an FP32 subnormal: mantissa bit 22 only

# FP8 E4M3 (OCP "fn" variant)
E4M3_MAX = 448.0
E4M3_MAX_POW2 = 8  # 2**8 = 256 is the largest power of two <= 448
E4M3_EXP_BIAS = 7
E4M3_MANT_BITS = 3
E4M3_MIN_NORMAL = 2.0**-6
E4M3_SUBNORMAL_STEP = 2.0**-9  # spacing of the subnormals (and of [2^-6, 2^-5))
E4M3_NAN = 0x7F
E4M3_SIGN = 0x80

# FP4 E2M1
E2M1_MAX = 6.0
E2M1_MAX_POW2 = 2  # 2**2 = 4 <= 6
E2M1_EXP_BIAS = 1
E2M1_MANT_BITS = 1
E2M1_MIN_NORMAL = 1.0
E2M1_SUBNORMAL_STEP = 0.5
E2M1_SIGN = 0x8
# E2M1 has no NaN. A non-finite block is marked NaN by its 0xFF scale alone; its elements get
# the largest positive magnitude, the E2M1 analogue of E4M3's 0x7F (all bits but the sign).
E2M1_NAN_BLOCK_CODE = 0x7
E2M1_VALUES = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0)


@dataclass(frozen=True)
class ElementFormat:
    """What the MX scale computation needs to know about an element format."""

    name: str
    max_value: float  # largest finite magnitude
    max_pow2: int  # exponent of the largest power of two <= max_value (torchao's *_MAX_POW2)
    mant_bits: int  # element mantissa bits ("even" rounds amax at this precision)


E4M3 = ElementFormat("e4m3", E4M3_MAX, E4M3_MAX_POW2, E4M3_MANT_BITS)
E2M1 = ElementFormat("e2m1", E2M1_MAX, E2M1_MAX_POW2, E2M1_MANT_BITS)

SCALING_MODES = ("floor", "rceil")  # MXFP8
MXFP4_SCALING_MODES = ("floor", "rceil", "even")


def _f32_bits(x: torch.Tensor) -> torch.Tensor:
    return x.to(torch.float32).contiguous().view(torch.int32)


def _pow2_f32(exponent: torch.Tensor) -> torch.Tensor:
    """2**exponent in FP32 for integer exponents in [-127, 127], built from bits (exact)."""
    return e8m0_decode(e8m0_encode(exponent))


# ------------------------------------------------------------------------------------------------
# E8M0
# ------------------------------------------------------------------------------------------------


def e8m0_encode(exponent: torch.Tensor) -> torch.Tensor:
    """Unbiased integer exponents -> E8M0 codes (uint8), clamped to [-127, 127] (codes 0..254)."""
    return (exponent.to(torch.int32).clamp(E8M0_MIN_EXP, E8M0_MAX_EXP) + E8M0_BIAS).to(torch.uint8)


def e8m0_decode(codes: torch.Tensor) -> torch.Tensor:
    """E8M0 codes (uint8 or float8_e8m0fnu) -> FP32, from bits (never via exp2, which is not exact
    on every device): code c in 1..254 is the FP32 with exponent field c; code 0 is 2^-127, an
    FP32 subnormal; 0xFF is NaN."""
    c = codes.view(torch.uint8).to(torch.int32)
    bits = torch.bitwise_left_shift(c, F32_MANT_BITS)
    bits = torch.where(c == 0, E8M0_CODE0_F32_BITS, bits)
    bits = torch.where(c == E8M0_NAN, F32_QNAN_BITS, bits)
    return bits.view(torch.float32)


# ------------------------------------------------------------------------------------------------
# FP8 E4M3 and FP4 E2M1 element encoders (round to nearest even, saturating)
# ------------------------------------------------------------------------------------------------


def _encode_minifloat(
    x: torch.Tensor, max_value: float, exp_bias: int, mant_bits: int, subnormal_step: float,
    min_normal: float,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Shared body of the E4M3/E2M1 encoders. Returns (sign bit 0/1, magnitude code, is_nan).

    |x| is first clamped to max_value (saturation; Inf -> max). Normal magnitudes round to
    nearest even on the FP32 bits: add half an output ulp minus one, plus the kept LSB, then
    truncate; a mantissa carry correctly bumps the exponent. Subnormal magnitudes are multiples
    of `subnormal_step`: |x| / step (exact, a power-of-two scaling) rounded half to even is the
    code, and a result equal to the first normal is the right code for it too.
    """
    bits = _f32_bits(x)
    sign = torch.bitwise_right_shift(bits, 31) & 1
    is_nan = (bits & F32_ABS_MASK) > F32_INF_BITS
    mag = (bits & F32_ABS_MASK).view(torch.float32).clamp(max=max_value)
    drop = F32_MANT_BITS - mant_bits
    mbits = mag.view(torch.int32)
    keep_lsb = torch.bitwise_right_shift(mbits, drop) & 1
    rounded = torch.bitwise_right_shift(mbits + ((1 << (drop - 1)) - 1) + keep_lsb, drop)
    normal_code = rounded - ((F32_EXP_BIAS - exp_bias) << mant_bits)
    subnormal_code = torch.round(mag / subnormal_step).to(torch.int32)
    code = torch.where(mag >= min_normal, normal_code, subnormal_code)
    return sign, code, is_nan


def e4m3_encode(x: torch.Tensor) -> torch.Tensor:
    """FP32/BF16/FP16 -> OCP FP8 E4M3 bits (uint8): round to nearest even, saturate to +-448
    (Inf too), NaN -> 0x7F. Same bits as torch's `.to(torch.float8_e4m3fn)` on finite values in
    [-448, 448] (that cast does not saturate beyond)."""
    sign, code, is_nan = _encode_minifloat(
        x, E4M3_MAX, E4M3_EXP_BIAS, E4M3_MANT_BITS, E4M3_SUBNORMAL_STEP, E4M3_MIN_NORMAL
    )
    out = sign * E4M3_SIGN | code
    return torch.where(is_nan, E4M3_NAN, out).to(torch.uint8)


def e2m1_encode(x: torch.Tensor) -> torch.Tensor:
    """FP32/BF16/FP16 -> FP4 E2M1 codes, one per uint8 (low nibble): round to nearest even,
    saturate to +-6 (Inf too). E2M1 has no NaN: NaN -> E2M1_NAN_BLOCK_CODE (only ever reached
    through a block whose scale is NaN)."""
    sign, code, is_nan = _encode_minifloat(
        x, E2M1_MAX, E2M1_EXP_BIAS, E2M1_MANT_BITS, E2M1_SUBNORMAL_STEP, E2M1_MIN_NORMAL
    )
    out = sign * E2M1_SIGN | code
    return torch.where(is_nan, E2M1_NAN_BLOCK_CODE, out).to(torch.uint8)


def e2m1_decode(codes: torch.Tensor) -> torch.Tensor:
    """FP4 E2M1 codes (low nibble of uint8) -> FP32, by table."""
    table = torch.tensor(E2M1_VALUES + tuple(-v for v in E2M1_VALUES), dtype=torch.float32, device=codes.device)
    return table[(codes & 0xF).long()]


def pack_fp4(codes: torch.Tensor) -> torch.Tensor:
    """(..., 2n) E2M1 codes -> (..., n) uint8, element 2i in the low nibble, 2i+1 in the high."""
    c = codes.to(torch.uint8)
    return c[..., 0::2] | torch.bitwise_left_shift(c[..., 1::2], 4)


def unpack_fp4(packed: torch.Tensor) -> torch.Tensor:
    """(..., n) uint8 -> (..., 2n) E2M1 codes (uint8), inverse of pack_fp4."""
    p = packed.view(torch.uint8)
    return torch.stack((p & 0xF, torch.bitwise_right_shift(p, 4)), dim=-1).flatten(-2)


# ------------------------------------------------------------------------------------------------
# MX block scale: torchao main's MXFP8 contract
# ------------------------------------------------------------------------------------------------

F32_MANT_MASK = (1 << F32_MANT_BITS) - 1
F32_SUBNORMAL_HALF = 1 << (F32_MANT_BITS - 1)  # the mantissa of 2^-127, E8M0 code 0, as an FP32 subnormal


def f32_reciprocal(value: float) -> torch.Tensor:
    """fl32(1 / value): the FP32 constant the rceil descale is multiplied by."""
    return torch.tensor(1.0 / value, dtype=torch.float32)


def e8m0_rceil(value: torch.Tensor) -> torch.Tensor:
    """FP32 -> the E8M0 code (uint8) of the smallest power of two >= value, from value's bits.

    value >= 0 (or -0). Normal: the exponent field, plus one when any mantissa bit is set (254
    plus one is 0xFF: 2^127 < value overflows to NaN). Subnormal and zero: code 0 (2^-127) up to
    2^-127 inclusive, code 1 above it. NaN and Inf: 0xFF."""
    bits = _f32_bits(value) & F32_ABS_MASK
    exp_field = torch.bitwise_right_shift(bits, F32_MANT_BITS)
    mant = bits & F32_MANT_MASK
    up = torch.where(exp_field == 0, mant > F32_SUBNORMAL_HALF, mant != 0)
    code = exp_field + up.to(torch.int32)
    return torch.where(exp_field == F32_EXP_MASK, E8M0_NAN, code).to(torch.uint8)


def e8m0_reciprocal(codes: torch.Tensor) -> torch.Tensor:
    """E8M0 codes -> FP32 2^(127 - code), exact (code 0: 2^127; code 254: the subnormal 2^-127;
    0xFF: NaN)."""
    c = codes.view(torch.uint8).to(torch.int32)
    return torch.where(c == E8M0_NAN, float("nan"), e8m0_decode((2 * E8M0_BIAS - c).clamp(min=0).to(torch.uint8)))


def even_round_amax(amax: torch.Tensor, fmt: ElementFormat) -> torch.Tensor:
    """"even" mode: amax's FP32 bits plus half an element-mantissa step (2^(22 - mant_bits)),
    mantissa cleared: the exponent field of amax rounded at the element's precision (FP32 bits)."""
    return (_f32_bits(amax) + (1 << (F32_MANT_BITS - fmt.mant_bits - 1))) & ~F32_MANT_MASK


def _mx_scale_contract(amax: torch.Tensor, scaling_mode: str, fmt: ElementFormat) -> tuple[torch.Tensor, torch.Tensor]:
    finite = torch.isfinite(amax)
    if scaling_mode in ("floor", "even"):
        bits = _f32_bits(amax) if scaling_mode == "floor" else even_round_amax(amax, fmt)
        exp_field = torch.bitwise_right_shift(bits, F32_MANT_BITS) & F32_EXP_MASK
        code = (exp_field - fmt.max_pow2).clamp(min=0).to(torch.uint8)
    else:
        code = e8m0_rceil(amax * f32_reciprocal(fmt.max_value).to(amax.device))
    code = torch.where(finite, code, E8M0_NAN).to(torch.uint8)
    return code, e8m0_reciprocal(code)


def mx_scale(amax: torch.Tensor, scaling_mode: str, fmt: ElementFormat = E4M3) -> tuple[torch.Tensor, torch.Tensor]:
    """Block amax (FP32, >= 0 or NaN/Inf) -> (E8M0 code uint8, FP32 multiplier 2^(127 - code)
    for the elements; NaN for a NaN/Inf amax, code 0xFF), the contract in the module docstring.
    The elements are then encoded from clamp(x * multiplier, -max, max). "even" is an MXFP4
    (E2M1) mode."""
    modes = MXFP4_SCALING_MODES if fmt is E2M1 else SCALING_MODES
    if scaling_mode not in modes:
        raise ValueError(f"scaling_mode must be one of {modes}, got {scaling_mode!r}")
    return _mx_scale_contract(amax.to(torch.float32), scaling_mode, fmt)


def mx_quantize_blocks(blocks: torch.Tensor, scaling_mode: str, fmt: ElementFormat) -> tuple[torch.Tensor, torch.Tensor]:
    """Quantize (..., B) blocks (B elements share one scale) -> (codes (...) uint8,
    element bits (..., B) uint8: E4M3 bytes or E2M1 codes one per byte).

    amax over the block; scale and multiplier by mx_scale; elements = encode(clamp(x * m)).
    A block holding any NaN or Inf gets scale 0xFF and every element the NaN pattern.
    FP16/BF16 input is upcast to FP32 first (exact; amax of the upcast equals the upcast amax).
    """
    x = blocks.to(torch.float32)
    amax = x.abs().amax(dim=-1)
    code, multiplier = mx_scale(amax, scaling_mode, fmt)
    scaled = (x * multiplier.unsqueeze(-1)).clamp(-fmt.max_value, fmt.max_value)
    if fmt is E4M3:
        elems, nan_elem = e4m3_encode(scaled), E4M3_NAN
    elif fmt is E2M1:
        elems, nan_elem = e2m1_encode(scaled), E2M1_NAN_BLOCK_CODE
    else:
        raise ValueError(f"unsupported element format {fmt.name}")
    elems = torch.where((code == E8M0_NAN).unsqueeze(-1), nan_elem, elems).to(torch.uint8)
    return code, elems
