"""Independent reference semantics for cross-checking flyquant.emu (tests/test_emu_isa_crosscheck*.py).

Written from the definitions, not from the emulator: every narrow float format is described by
(exponent bits, mantissa bits, bias, special-value rules) and a value is rounded with exact
rational arithmetic (fractions.Fraction), round to nearest, ties to even, as IEEE 754 defines
it for a format with that precision and exponent range. Nothing here uses the emulator's bit
tricks or tables (flyquant/emu/isa_cvt.py); sources for each rule are in the docstrings:

- the CDNA3 / CDNA4 ISA guides' pseudocode as transcribed by tinygrad
  (tinygrad/runtime/autogen/amd/cdna/str_pcode.py), for max/min/med3, perm, bfe, alignbit, ...;
- the OCP 8-bit float spec (E4M3: bias 7, no infinity, S.1111.111 NaN, max 448; E5M2: IEEE-like,
  max 57344) and the OCP MX spec (E2M1: bias 1, max 6, no Inf/NaN; E8M0 scales);
- the FNUZ formats of gfx942 (E4M3 bias 8, E5M2 bias 16; 0x80 the only NaN, no -0, no Inf).
"""

from __future__ import annotations

import math
import struct
from fractions import Fraction as Fr

# --- f32 bit patterns -------------------------------------------------------------------------------


def f32_bits(x: float) -> int:
    return struct.unpack("<I", struct.pack("<f", x))[0]


def bits_f32(b: int) -> float:
    return struct.unpack("<f", struct.pack("<I", b & 0xFFFFFFFF))[0]


def exact(bits: int, ebits: int = 8, mbits: int = 23) -> Fr | str:
    """Exact value of an IEEE binary format's bit pattern as a Fraction, or 'inf'/'-inf'/'nan'."""
    sign = -1 if bits >> (ebits + mbits) & 1 else 1
    e = bits >> mbits & ((1 << ebits) - 1)
    m = bits & ((1 << mbits) - 1)
    bias = (1 << (ebits - 1)) - 1
    if e == (1 << ebits) - 1:
        return "nan" if m else ("inf" if sign > 0 else "-inf")
    if e == 0:
        return sign * Fr(m) * Fr(2) ** (1 - bias - mbits)
    return sign * (1 + Fr(m, 1 << mbits)) * Fr(2) ** (e - bias)


def is_neg_bits(bits: int, nbits: int) -> bool:
    return bool(bits >> (nbits - 1) & 1)


def floor_log2(a: Fr) -> int:
    """floor(log2(a)) for a > 0, exactly."""
    e = a.numerator.bit_length() - a.denominator.bit_length()
    if Fr(2) ** e > a:
        e -= 1
    return e


def round_even(a: Fr, emin: int, mbits: int) -> Fr:
    """|a| rounded to nearest, ties to even, with `mbits` fraction bits, exponent unbounded above
    and normals down to 2**emin (below: the fixed quantum 2**(emin - mbits), i.e. subnormals)."""
    if a == 0:
        return Fr(0)
    e = max(floor_log2(a), emin)
    q = Fr(2) ** (e - mbits)
    n = a / q
    fl = n.numerator // n.denominator
    rem = n - fl
    if rem > Fr(1, 2) or (rem == Fr(1, 2) and fl % 2 == 1):
        fl += 1
    return fl * q


class Narrow:
    """A narrow float format from its definition. kind: 'ieee' (E5M2: all-ones exponent holds
    Inf and NaN), 'ocp_e4m3' (only S.1111.111 is NaN, no Inf), 'fnuz' (0x80 the only NaN, no -0,
    no Inf), 'fp4' (no Inf/NaN)."""

    def __init__(self, name, ebits, mbits, bias, kind):
        self.name, self.ebits, self.mbits, self.bias, self.kind = name, ebits, mbits, bias, kind
        self.nbits = 1 + ebits + mbits
        self.emin = 1 - bias
        self.by_value: dict[Fr, int] = {}
        self.value_of: dict[int, Fr | str] = {}
        for code in range(1 << self.nbits):
            val = self._decode(code)
            self.value_of[code] = val
            if isinstance(val, Fr) and val >= 0 and not (val == 0 and code):
                self.by_value[val] = code
        self.max = max(self.by_value)

    def _decode(self, code):
        sign_bit = 1 << (self.nbits - 1)
        neg = bool(code & sign_bit)
        e = code >> self.mbits & ((1 << self.ebits) - 1)
        m = code & ((1 << self.mbits) - 1)
        top = (1 << self.ebits) - 1
        if self.kind == "fnuz" and code == sign_bit:
            return "nan"
        if self.kind == "ieee" and e == top:
            return "nan" if m else ("-inf" if neg else "inf")
        if self.kind == "ocp_e4m3" and e == top and m == (1 << self.mbits) - 1:
            return "nan"
        mag = Fr(m) * Fr(2) ** (self.emin - self.mbits) if e == 0 else \
            (1 + Fr(m, 1 << self.mbits)) * Fr(2) ** (e - self.bias)
        return -mag if neg else mag

    def encode(self, x: Fr | str, saturate: bool = False, neg: bool | None = None) -> int | str:
        """Code of x (an exact value or 'inf'/'-inf'/'nan'; `neg`: its sign, needed for -0);
        'nan' when the result is a NaN (its payload is not checked: the ISA guides do not
        define it). FP4 has no NaN: the caller decides what a NaN input gives."""
        if x == "nan":
            return "nan"
        if neg is None:
            neg = x == "-inf" or (isinstance(x, Fr) and x < 0)
        if isinstance(x, str):
            over = True
        else:
            r = round_even(abs(x), self.emin, self.mbits)
            over = r > self.max
        if over:
            if saturate or self.kind == "fp4":
                r = self.max
            elif self.kind == "ieee":
                return ((1 << self.ebits) - 1) << self.mbits | ((1 << (self.nbits - 1)) if neg else 0)
            else:
                return "nan"
        code = self.by_value[r]
        if neg and not (self.kind == "fnuz" and code == 0):
            code |= 1 << (self.nbits - 1)
        return code


OCP_E4M3 = Narrow("ocp_e4m3", 4, 3, 7, "ocp_e4m3")
OCP_E5M2 = Narrow("ocp_e5m2", 5, 2, 15, "ieee")
FNUZ_E4M3 = Narrow("fnuz_e4m3", 4, 3, 8, "fnuz")
FNUZ_E5M2 = Narrow("fnuz_e5m2", 5, 2, 16, "fnuz")
E2M1 = Narrow("e2m1", 2, 1, 1, "fp4")
FORMATS = {"gfx950": (OCP_E4M3, OCP_E5M2), "gfx942": (FNUZ_E4M3, FNUZ_E5M2)}


def to_ieee(x: Fr | str, ebits: int, mbits: int, rtz: bool = False) -> int:
    """Bits of x rounded to an IEEE binary format (f32: 8/23, f16: 5/10, bf16: 8/7), ties to even
    (or toward zero), overflow to Inf (RTZ: to the largest finite). A NaN input gives the
    canonical quiet NaN (callers compare NaN-ness only)."""
    nb = 1 + ebits + mbits
    sign = 1 << (nb - 1)
    inf = ((1 << ebits) - 1) << mbits
    if x == "nan":
        return inf | 1 << (mbits - 1)
    if x in ("inf", "-inf"):
        return inf | (sign if x == "-inf" else 0)
    neg = x < 0
    a = abs(x)
    bias = (1 << (ebits - 1)) - 1
    emin = 1 - bias
    if rtz:
        e = max(floor_log2(a), emin) if a else emin
        q = Fr(2) ** (e - mbits)
        r = (a / q).numerator // (a / q).denominator * q
    else:
        r = round_even(a, emin, mbits)
    maxv = (2 - Fr(1, 1 << mbits)) * Fr(2) ** bias
    if r > maxv:
        bits = (inf - 1) if rtz else inf
    elif r == 0:
        bits = 0
    else:
        e = floor_log2(r)
        if e < emin:
            bits = int(r / Fr(2) ** (emin - mbits))
        else:
            bits = (e + bias) << mbits | int((r / Fr(2) ** e - 1) * (1 << mbits))
    return bits | (sign if neg else 0)


def is_nan_bits(bits: int, ebits: int, mbits: int) -> bool:
    return (bits >> mbits & ((1 << ebits) - 1)) == (1 << ebits) - 1 and bits & ((1 << mbits) - 1) != 0


# --- ISA pseudocode, per lane --------------------------------------------------------------------------


def _is_snan32(b):
    return is_nan_bits(b, 8, 23) and not b >> 22 & 1


def _cmp_val(b):
    return bits_f32(b)


def _nan_pick(a: int, b: int, ieee: bool) -> int | None:
    """The NaN rules V_MAX_F32 and V_MIN_F32 share: a signaling NaN quieted (IEEE mode), else a
    quiet NaN gives the other operand; None when neither is NaN."""
    for x in (a, b):
        if ieee and _is_snan32(x):
            return x | 1 << 22
    if is_nan_bits(a, 8, 23):
        return b
    if is_nan_bits(b, 8, 23):
        return a
    return None


def v_max_f32(a: int, b: int, ieee: bool = True) -> int:
    """V_MAX_F32 pseudocode (CDNA3/CDNA4 ISA) on bit patterns."""
    nan = _nan_pick(a, b, ieee)
    if nan is not None:
        return nan
    if {a, b} == {0, 0x80000000}:
        return 0
    x, y = _cmp_val(a), _cmp_val(b)
    if ieee:
        return a if x >= y else b
    return a if x > y else b


def v_min_f32(a: int, b: int, ieee: bool = True) -> int:
    """V_MIN_F32 pseudocode."""
    nan = _nan_pick(a, b, ieee)
    if nan is not None:
        return nan
    if {a, b} == {0, 0x80000000}:
        return 0x80000000
    return a if _cmp_val(a) < _cmp_val(b) else b


def v_med3_f32(a: int, b: int, c: int, ieee: bool = True) -> int:
    """V_MED3_F32 pseudocode: a NaN operand -> min3; else by which operand equals max3."""
    if any(is_nan_bits(x, 8, 23) for x in (a, b, c)):
        return v_min_f32(v_min_f32(a, b, ieee), c, ieee)
    mx = v_max_f32(v_max_f32(a, b, ieee), c, ieee)
    if _cmp_val(mx) == _cmp_val(a):
        return v_max_f32(b, c, ieee)
    if _cmp_val(mx) == _cmp_val(b):
        return v_max_f32(a, c, ieee)
    return v_max_f32(a, b, ieee)


def perm_b32(s0: int, s1: int, sel: int) -> int:
    """V_PERM_B32 pseudocode: bytes of {S0, S1} (S1 the low word) selected per S2 byte."""
    data = (s0 << 32) | s1
    inb = [(data >> (8 * i)) & 0xFF for i in range(8)]
    out = 0
    for k in range(4):
        sl = (sel >> (8 * k)) & 0xFF
        if sl >= 13:
            byte = 0xFF
        elif sl == 12:
            byte = 0
        elif sl >= 8:
            byte = 0xFF * (inb[2 * (sl - 8) + 1] >> 7)
        else:
            byte = inb[sl]
        out |= byte << (8 * k)
    return out


def bfe_i32(a: int, off: int, width: int) -> int:
    """V_BFE_I32 pseudocode: tmp = (S0.i32 >> off) & ((1 << width) - 1), an arithmetic shift of
    the signed S0 (a field reaching past bit 31 reads copies of the sign bit), then sign-extended
    from bit `width`."""
    off, width = off & 31, width & 31
    if width == 0:
        return 0
    signed = a - (1 << 32) if a >> 31 else a
    field = (signed >> off) & ((1 << width) - 1)
    if field >> (width - 1):
        field -= 1 << width
    return field & 0xFFFFFFFF


def ffbh_u32(x: int) -> int:
    return 0xFFFFFFFF if x == 0 else 32 - x.bit_length()


def ffbl_b32(x: int) -> int:
    return 0xFFFFFFFF if x == 0 else (x & -x).bit_length() - 1


def frac_of_float(x: float) -> Fr | str:
    if math.isnan(x):
        return "nan"
    if math.isinf(x):
        return "inf" if x > 0 else "-inf"
    return Fr(x)
