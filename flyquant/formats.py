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
MXFP4 (E2M1) still follows torchao 0.18's to_mx bit for bit on finite input, including its float
arithmetic quirks (named below; E2M1 has torchao_018_scale set), until the MXFP4 issue moves it
to the same contract; its non-finite blocks follow the rule above with the E2M1 NaN-block code.
"""

from __future__ import annotations

import math
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
    torchao_018_scale: bool = False  # torchao 0.18's scale arithmetic (quirks) instead of main's contract


E4M3 = ElementFormat("e4m3", E4M3_MAX, E4M3_MAX_POW2)
E2M1 = ElementFormat("e2m1", E2M1_MAX, E2M1_MAX_POW2, torchao_018_scale=True)

SCALING_MODES = ("floor", "rceil")


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


def _mx_scale_contract(amax: torch.Tensor, scaling_mode: str, fmt: ElementFormat) -> tuple[torch.Tensor, torch.Tensor]:
    finite = torch.isfinite(amax)
    if scaling_mode == "floor":
        exp_field = torch.bitwise_right_shift(_f32_bits(amax), F32_MANT_BITS) & F32_EXP_MASK
        code = (exp_field - fmt.max_pow2).clamp(min=0).to(torch.uint8)
    else:
        code = e8m0_rceil(amax * f32_reciprocal(fmt.max_value).to(amax.device))
    code = torch.where(finite, code, E8M0_NAN).to(torch.uint8)
    return code, e8m0_reciprocal(code)


# ------------------------------------------------------------------------------------------------
# MX block scale as torchao 0.18 computes it (MXFP4 only, until it moves to the contract above)
# ------------------------------------------------------------------------------------------------


def _log2_rounds_down_table() -> list[int]:
    """TORCHAO_RCEIL_LOG2 quirk table, indexed by e + 127 for e in [-127, 127].

    torchao 0.18 computes the rceil exponent as ceil(log2(descale)) in FP32. For
    descale = 2^e * (1 + n * 2^-23) with small n >= 1, the true log2 is e + n * 2^-23 / ln 2
    + O(n^2 2^-46); when that offset is below half an FP32 ulp of the result, log2 rounds to
    exactly e and the ceil stays at e instead of e + 1. The result has magnitude |e| for e > 0
    and just under |e| for e < 0, so its binade is b = floor(log2(L)) with L = e or -e - 1,
    its half-ulp 2^(b - 24), and the largest n that still rounds down is
    ceil(ln 2 * 2^(b - 1)) - 1 (never an integer boundary). Checked exhaustively against
    torch.log2 on every positive FP32 (see tests/test_formats.py).
    """
    table = []
    for e in range(E8M0_MIN_EXP, E8M0_MAX_EXP + 1):
        magnitude = e if e > 0 else -e - 1
        if magnitude < 4:  # binade < 2: even n = 1 moves log2 by more than half an ulp
            table.append(0)
            continue
        binade = magnitude.bit_length() - 1
        table.append(math.ceil(math.log(2) * 2.0 ** (binade - 1)) - 1)
    return table


LOG2_ROUNDS_DOWN = _log2_rounds_down_table()


def rceil_exponent_torchao(descale: torch.Tensor) -> torch.Tensor:
    """ceil(log2(descale)) as torchao 0.18 computes it in FP32, from bits, for finite
    descale >= 0, clamped to [-127, 127] (codes 0..254) as torchao does.

    Quirk TORCHAO_RCEIL_LOG2: just above a power of two, FP32 log2 rounds to the integer and the
    ceil does not step up (table above). Descales in (2^-127, 2^-126) are FP32 subnormals with
    22 fraction bits: n counts units of 2^-22 there, i.e. 2 units of 2^-23.
    """
    bits = descale.view(torch.int32)
    exp_field = torch.bitwise_right_shift(bits, F32_MANT_BITS) & F32_EXP_MASK
    mant = bits & ((1 << F32_MANT_BITS) - 1)
    subnormal_lead = 1 << (F32_MANT_BITS - 1)  # 2^-127 as an FP32 subnormal mantissa
    is_sub = exp_field == 0
    e = torch.where(is_sub, E8M0_MIN_EXP, exp_field - F32_EXP_BIAS)
    n = torch.where(is_sub, (mant - subnormal_lead) * 2, mant)
    table = torch.tensor(LOG2_ROUNDS_DOWN, dtype=torch.int32, device=descale.device)
    steps_up = n > table[(e - E8M0_MIN_EXP).long()]
    # below 2^-127 (and zero) the ceil is <= -127 and clamps to -127
    ceil_exp = (e + steps_up.to(torch.int32)).clamp(max=E8M0_MAX_EXP)
    return torch.where(is_sub & (mant <= subnormal_lead), E8M0_MIN_EXP, ceil_exp)


def mx_scale(amax: torch.Tensor, scaling_mode: str, fmt: ElementFormat = E4M3) -> tuple[torch.Tensor, torch.Tensor]:
    """Block amax (FP32, >= 0 or NaN/Inf) -> (E8M0 code uint8, FP32 multiplier for the elements).

    The elements are then encoded from clamp(x * multiplier, -max, max).

    E4M3 (and any format without torchao_018_scale): torchao main's contract (module docstring):
    the multiplier is exactly 2^(127 - code), code 0 included. E2M1 (torchao_018_scale) as follows:

    floor (OCP MX): scale exponent = floor(log2(amax)) - fmt.max_pow2, read from amax's FP32
    exponent field (an FP32-subnormal amax counts as exponent -127), clamped at -127.
    rceil: scale exponent = ceil(log2(amax / fmt.max_value)), the smallest power of two that keeps
    the block within range, with descale = amax / max_value rounded to FP32 first (as torchao).
    A kernel must form descale as the correctly rounded FP32 quotient (IEEE division: a multiply
    by the inexact 1/448 differs), then needs only integer ops (rceil_exponent_torchao).

    The multiplier is 2^-(scale exponent), exact, except for torchao 0.18's handling of code 0:
    - quirk TORCHAO_FLOOR_CODE0: floor divides by max(2^(code-127), 2^-126) (torchao clamps the
      FP32 scale to the smallest normal), so a code-0 block (nominally 2^-127) is multiplied by
      2^126, not 2^127: its elements decode to half their value.
    - quirk TORCHAO_RCEIL_CODE0: rceil uses the reciprocal 1.0 for code 0, so a code-0 block is
      not scaled at all (its elements, all below ~448 * 2^-127, underflow to +-0).
    - quirk TORCHAO_RCEIL_LOG2: see rceil_exponent_torchao.
    NaN or Inf amax: code 0xFF and a NaN multiplier (the caller writes the NaN element pattern).
    """
    if scaling_mode not in SCALING_MODES:
        raise ValueError(f"scaling_mode must be one of {SCALING_MODES}, got {scaling_mode!r}")
    amax = amax.to(torch.float32)
    if not fmt.torchao_018_scale:
        return _mx_scale_contract(amax, scaling_mode, fmt)
    finite = torch.isfinite(amax)
    safe = torch.where(finite, amax, 0.0)
    if scaling_mode == "floor":
        exp_field = torch.bitwise_right_shift(safe.view(torch.int32), F32_MANT_BITS) & F32_EXP_MASK
        code = (exp_field - fmt.max_pow2).clamp(min=0)  # exponent field - bias - max_pow2 + bias
        multiplier = torch.where(code == 0, 2.0**126, _pow2_f32(E8M0_BIAS - code))
    else:
        descale = safe / fmt.max_value
        code = rceil_exponent_torchao(descale) + E8M0_BIAS
        multiplier = torch.where(code == 0, 1.0, _pow2_f32(E8M0_BIAS - code))
    code = torch.where(finite, code, E8M0_NAN).to(torch.uint8)
    multiplier = torch.where(finite, multiplier, float("nan"))
    return code, multiplier


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
