"""Values of the vector ALU instructions: the float and integer functions the VALU tables
apply per lane, and the tables themselves (name -> kinds and function), following the pseudocode
of the CDNA3/CDNA4 ISA guides. No builders here: `isa_valu` turns the tables into closures.

Float arithmetic is IEEE binary32 round-to-nearest-even (NumPy's float32 on x86 does not flush
denormals); fused multiply-adds are computed exactly (see `fma_f32`). Transcendentals (v_rcp,
v_rsq, v_sqrt, v_exp, v_log) are computed correctly rounded; the hardware is only specified to
about 1 ulp, so those can differ from a GPU in the last bit. They also keep FP32 denormals in and
out, which a GPU may not: LLVM scales around v_rcp/v_rsq/v_sqrt/v_log for denormal inputs and
around v_exp/v_rcp for denormal results (emitRcpIEEE1ULP: "The rcp instruction doesn't support
denormals"), so there a GPU may give 0 or inf. Not modelled (the ISA guides do not say it); the
kernels' one use in that range, stage 1's sigmoid rcp(1 + exp(z)) with 1 + exp(z) above 2^126,
differs from 0 by less than 1e-37.
"""

from __future__ import annotations

import numpy as np

from .isa_base import F16, F32, F64, I16, I32, I64, U8, U16, U32, U64

# --- float helpers ------------------------------------------------------------------------------------
def fma_f32(a, b, c):
    """Fused a*b + c in binary32 with a single rounding.

    The product of two binary32 values is exact in binary64; the binary64 sum is then made
    "round-to-odd" (if inexact, force the last bit to 1), which makes the final rounding to
    binary32 correct (binary64 has more than 24 + 2 significant bits)."""
    p = np.asarray(a, F64) * np.asarray(b, F64)
    c64 = np.asarray(c, F64)
    s = p + c64
    t = s - p
    err = (p - (s - t)) + (c64 - t)  # exact error of the binary64 sum (TwoSum)
    bits = np.asarray(s).view(I64)
    fix = (err != 0) & ((bits & 1) == 0) & np.isfinite(s)
    if np.count_nonzero(fix):
        s = np.where(fix, np.nextafter(s, np.where(err > 0, np.inf, -np.inf)), s)
    return np.asarray(s).astype(F32)


_UINT_OF = {np.dtype(F32): U32, np.dtype(F16): U16, np.dtype(F64): U64}


_QUIET_BIT = {np.dtype(F32): 1 << 22, np.dtype(F16): 1 << 9, np.dtype(F64): 1 << 51}  # top mantissa bit


def _quiet_bit(dtype) -> int:
    return _QUIET_BIT[np.dtype(dtype)]


def _is_snan(x):
    b = x.view(_UINT_OF[x.dtype])
    return np.isnan(x) & ((b & b.dtype.type(_quiet_bit(x.dtype))) == 0)


def _quiet(x):
    ut = _UINT_OF[x.dtype]
    return (x.view(ut) | ut(_quiet_bit(x.dtype))).view(x.dtype)


def _signed_zero_fix(r, a, b, is_max):
    """Where a == b (so also +0 vs -0), the result is a's and b's bits ANDed (max: +0 wins) or
    ORed (min: -0 wins); identical bits otherwise."""
    eq = a == b
    if not np.count_nonzero(eq):
        return r
    ut = _UINT_OF[a.dtype]
    both = (a.view(ut) & b.view(ut)) if is_max else (a.view(ut) | b.view(ut))
    return np.where(eq, both.view(a.dtype), r)


def max_min(a, b, ieee, is_max):
    """v_max/v_min of one float type: a NaN operand is dropped (a signalling NaN is returned
    quieted in IEEE mode, S0's first); with both NaN the result is S1 (the pseudocode's
    "isNAN(S0) -> S1", which NumPy's fmax/fmin leave open); max(+0, -0) = +0, min(+0, -0) = -0."""
    r = _signed_zero_fix(np.fmax(a, b) if is_max else np.fmin(a, b), a, b, is_max)
    nan_a = np.isnan(a)
    if np.count_nonzero(nan_a) or np.count_nonzero(np.isnan(b)):
        r = np.where(nan_a & np.isnan(b), b, r)
        if ieee:
            r = np.where(_is_snan(b), _quiet(b), r)
            r = np.where(_is_snan(a), _quiet(a), r)
    return r


def max_f32(a, b, ieee=True):
    """v_max_f32 (see `_max_min`)."""
    return max_min(np.asarray(a, F32), np.asarray(b, F32), ieee, True)


def min_f32(a, b, ieee=True):
    """v_min_f32 (see `_max_min`)."""
    return max_min(np.asarray(a, F32), np.asarray(b, F32), ieee, False)


def med3_f32(a, b, c, ieee=True):
    """v_med3_f32 per its pseudocode: any NaN -> min3; else the max of the two non-largest."""
    a, b, c = (np.asarray(x, F32) for x in (a, b, c))
    mx = max_f32(max_f32(a, b, ieee), c, ieee)
    r = np.where(mx == a, max_f32(b, c, ieee), np.where(mx == b, max_f32(a, c, ieee), max_f32(a, b, ieee)))
    nan = np.isnan(a) | np.isnan(b) | np.isnan(c)
    if np.count_nonzero(nan):
        r = np.where(nan, min_f32(min_f32(a, b, ieee), c, ieee), r)
    return r


def _maximum_minimum(a, b, is_max):
    """IEEE 754-2019 maximum/minimum (v_maximum*, v_minimum*): NaN if either operand is NaN
    (the first NaN operand, quieted), +0 > -0."""
    r = _signed_zero_fix(np.maximum(a, b) if is_max else np.minimum(a, b), a, b, is_max)
    if np.count_nonzero(np.isnan(r)):
        r = np.where(np.isnan(a), _quiet(a), np.where(np.isnan(b), _quiet(b), r))
    return r


def _extremum3(a, b, c, is_max):
    """maximum/minimum of three: NumPy's maximum/minimum already give the IEEE result unless
    a NaN or a signed zero is involved, which a final result that is neither NaN nor zero rules
    out (a NaN operand propagates; an intermediate zero of either sign did not win). Otherwise
    the exact pairwise rule decides."""
    f = np.maximum if is_max else np.minimum
    r = f(f(a, b), c)
    if np.count_nonzero(np.abs(r) > 0) == r.size:
        return r
    return _maximum_minimum(_maximum_minimum(a, b, is_max), c, is_max)


def maximum3(a, b, c):
    return _extremum3(a, b, c, True)


def minimum3(a, b, c):
    return _extremum3(a, b, c, False)


def f16_exact(fn):
    """A binary16 operation computed in binary64 and rounded once to binary16: add, sub and mul
    are exact in binary64, so correctly rounded; so is fma unless its terms lie more than ~30
    binades apart (then two roundings can differ from one in a tie)."""
    return lambda *xs: np.asarray(fn(*(np.asarray(x, F64) for x in xs))).astype(F16)


def _mul_legacy(a, b):
    return np.where((a == 0) | (b == 0), F32(0), a * b)


def _fract_f32(x):
    """v_fract_f32: x - floor(x), at most the largest float below 1 (NaN/Inf -> NaN)."""
    r = np.minimum(x - np.floor(x), np.float32(0.99999994))
    return np.where(np.isinf(x), np.float32(np.nan), r).astype(F32)


def _frexp_mant(x):
    m, _ = np.frexp(x)
    return np.where(np.isfinite(x), m, x).astype(x.dtype)


def _frexp_exp(x):
    _, e = np.frexp(x)
    return np.where(np.isfinite(x), e, 0).astype(I32)


def _ldexp(x, e):
    return np.ldexp(x, np.clip(np.asarray(e, I64), -1000, 1000).astype(I32)).astype(x.dtype)


def _rcp(x):
    return (np.float64(1.0) / np.asarray(x, F64)).astype(np.asarray(x).dtype)


def _sqrt(x):
    return np.sqrt(np.asarray(x, F64)).astype(np.asarray(x).dtype)


def _rsq(x):
    return (1.0 / np.sqrt(np.asarray(x, F64))).astype(np.asarray(x).dtype)


def _exp2(x):
    return np.exp2(np.asarray(x, F64)).astype(np.asarray(x).dtype)


def _log2(x):
    with np.errstate(all="ignore"):
        return np.log2(np.asarray(x, F64)).astype(np.asarray(x).dtype)


# --- integer helpers ----------------------------------------------------------------------------------
def _mul_hi_u32(a, b):
    return ((np.asarray(a, U64) * np.asarray(b, U64)) >> U64(32)).astype(U32)


def _mul_hi_i32(a, b):
    return ((np.asarray(a, I64) * np.asarray(b, I64)) >> 32).astype(I32)


def _u24(x):
    return np.asarray(x, U32) & U32(0xFFFFFF)


def _i24(x):
    return (np.asarray(x, I32) << 8) >> 8


def _bfe_u32(a, off, width):
    off = np.asarray(off, U32) & U32(31)
    width = np.asarray(width, U32) & U32(31)
    return (np.asarray(a, U32) >> off) & ((U32(1) << width) - U32(1))


def _bfe_i32(a, off, width):
    """(S0.i32 >> off) & ((1 << width) - 1), sign-extended from bit `width`: the shift is
    arithmetic, so a field reaching past bit 31 reads copies of the sign bit (pseudocode)."""
    off = np.asarray(off, U32) & U32(31)
    width = np.asarray(width, U32) & U32(31)
    field = (np.asarray(a, I32) >> off.astype(I32)).view(U32) & ((U32(1) << width) - U32(1))
    shift = (U32(32) - width) & U32(31)  # width 0 -> 0 (and shift 0)
    out = ((field << shift).view(I32) >> shift.astype(I32))
    return np.where(width == 0, I32(0), out)


def _alignbit(a, b, c):
    wide = (np.asarray(a, U64) << U64(32)) | np.asarray(b, U64)
    return (wide >> (np.asarray(c, U64) & U64(31))).astype(U32)


def _alignbyte(a, b, c):
    wide = (np.asarray(a, U64) << U64(32)) | np.asarray(b, U64)
    return (wide >> ((np.asarray(c, U64) & U64(3)) * U64(8))).astype(U32)


PERM_ZERO, PERM_ONES = 12, 13  # v_perm_b32 selector values for the constant bytes 0x00 / 0xFF (13..255)
PERM_TABLE_BYTES = 16  # per lane: 8 source bytes, 4 sign bytes, 0x00, 3 x 0xFF
_PERM_CONST_WORD = U32(0xFFFFFF00)  # table bytes 12..15 (little-endian): 0x00, 0xFF, 0xFF, 0xFF
_PERM_LANE_BASE = (np.arange(64, dtype=np.intp) * PERM_TABLE_BYTES)[:, None]


_PERM_SCALAR_SEL: dict[int, np.ndarray] = {}  # selector value -> flat table indices (64, 4)


def _perm_scalar_index(sel: int) -> np.ndarray:
    idx = _PERM_SCALAR_SEL.get(sel)
    if idx is None:
        if len(_PERM_SCALAR_SEL) >= 4096:
            _PERM_SCALAR_SEL.clear()
        idx = _PERM_SCALAR_SEL[sel] = _PERM_LANE_BASE + [min((sel >> (8 * k)) & 0xFF, PERM_ONES) for k in range(4)]
    return idx


def _perm_b32(s0, s1, sel):
    """v_perm_b32: byte k of D is byte sel[k] of a table per lane: bytes 0..3 of S1, 4..7 of S0,
    8..11 the sign of bytes 1, 3, 5, 7 replicated, 12 -> 0x00, >= 13 -> 0xFF.

    The table is 16 bytes per lane (12 -> 0x00, 13..15 -> 0xFF, selectors clamped to 13), so a
    whole instruction is one gather from the flattened (64, 16) table."""
    table = np.empty((64, PERM_TABLE_BYTES // 4), U32)
    table[:, 0] = s1  # a scalar broadcasts
    table[:, 1] = s0
    table[:, 3] = _PERM_CONST_WORD
    tb = table.view(U8)
    np.right_shift(tb[:, 1:8:2].view(np.int8), 7, out=tb[:, 8:12].view(np.int8))  # sign -> 0x00 / 0xFF
    if np.ndim(sel) == 0:
        idx = _perm_scalar_index(int(sel))
    else:
        sel = np.minimum(np.ascontiguousarray(sel, U32).view(U8).reshape(64, 4), U8(PERM_ONES))
        idx = sel + _PERM_LANE_BASE
    return tb.reshape(-1)[idx].view(U32).reshape(64)


def _ffbh_u32(x):
    x = np.asarray(x, U32)
    r = np.full(x.shape, -1, I32)
    nz = x != 0
    r[nz] = 31 - np.floor(np.log2(x[nz].astype(F64))).astype(I32)
    return r


def _ffbl_b32(x):
    x = np.asarray(x, U32)
    low = x & (~x + U32(1))  # lowest set bit
    return np.where(x == 0, I32(-1), np.log2(np.maximum(low, 1).astype(F64)).astype(I32))


def _ffbh_i32(x):
    x = np.asarray(x, I32)
    y = np.where(x < 0, ~x, x).view(U32)
    r = _ffbh_u32(y)
    return np.where(y == 0, I32(-1), r)


def _bfrev(x):
    x = np.asarray(x, U32)
    b = np.unpackbits(np.ascontiguousarray(x.reshape(-1)).view(np.uint8).reshape(-1, 4), axis=1, bitorder="little")
    return np.packbits(b[:, ::-1], axis=1, bitorder="little").view(U32).reshape(x.shape)


def _bcnt(a, b):
    a = np.asarray(a, U32)
    bytes_ = a.reshape(-1).view(np.uint8).reshape(-1, 4)
    return (np.unpackbits(bytes_, axis=1).sum(axis=1).astype(U32).reshape(a.shape) + b).astype(U32)


def _sat_u32(x):
    return np.clip(x, 0, 0xFFFFFFFF).astype(U32)


def _sat_i32(x):
    return np.clip(x, -(1 << 31), (1 << 31) - 1).astype(I32)


# --- op tables ------------------------------------------------------------------------------------------
# name -> (dst kind, source kinds, fn, float op?, saturating fn for integer clamp or None)
OPS: dict[str, tuple] = {}


def _def(name, dst, srcs, fn, flt=False, sat=None):
    OPS[name] = (dst, tuple(srcs), fn, flt, sat)


# 32-bit float
_def("v_add_f32", "f32", "f32 f32".split(), lambda a, b: a + b, True)
_def("v_sub_f32", "f32", "f32 f32".split(), lambda a, b: a - b, True)
_def("v_subrev_f32", "f32", "f32 f32".split(), lambda a, b: b - a, True)
_def("v_mul_f32", "f32", "f32 f32".split(), lambda a, b: a * b, True)
_def("v_mul_legacy_f32", "f32", "f32 f32".split(), _mul_legacy, True)
_def("v_fma_f32", "f32", "f32 f32 f32".split(), fma_f32, True)
_def("v_fmac_f32", "f32", "f32 f32 f32".split(), fma_f32, True)
_def("v_mad_f32", "f32", "f32 f32 f32".split(), lambda a, b, c: (a * b) + c, True)  # unfused
_def("v_mac_f32", "f32", "f32 f32 f32".split(), lambda a, b, c: (a * b) + c, True)
_def("v_ldexp_f32", "f32", "f32 i32".split(), _ldexp, True)
_def("v_fract_f32", "f32", ["f32"], _fract_f32, True)
_def("v_trunc_f32", "f32", ["f32"], np.trunc, True)
_def("v_ceil_f32", "f32", ["f32"], np.ceil, True)
_def("v_floor_f32", "f32", ["f32"], np.floor, True)
_def("v_rndne_f32", "f32", ["f32"], np.rint, True)
_def("v_rcp_f32", "f32", ["f32"], _rcp, True)
_def("v_rcp_iflag_f32", "f32", ["f32"], _rcp, True)
_def("v_rsq_f32", "f32", ["f32"], _rsq, True)
_def("v_sqrt_f32", "f32", ["f32"], _sqrt, True)
_def("v_exp_f32", "f32", ["f32"], _exp2, True)
_def("v_log_f32", "f32", ["f32"], _log2, True)
_def("v_frexp_mant_f32", "f32", ["f32"], _frexp_mant, True)
_def("v_frexp_exp_i32_f32", "i32", ["f32"], _frexp_exp, True)
# 64-bit float
_def("v_add_f64", "f64", "f64 f64".split(), lambda a, b: a + b, True)
_def("v_mul_f64", "f64", "f64 f64".split(), lambda a, b: a * b, True)
_def("v_ldexp_f64", "f64", "f64 i32".split(), _ldexp, True)
_def("v_trunc_f64", "f64", ["f64"], np.trunc, True)
_def("v_ceil_f64", "f64", ["f64"], np.ceil, True)
_def("v_floor_f64", "f64", ["f64"], np.floor, True)
_def("v_rndne_f64", "f64", ["f64"], np.rint, True)
# 16-bit float (computed exactly in binary64, rounded once)
_def("v_add_f16", "f16", "f16 f16".split(), f16_exact(lambda a, b: a + b), True)
_def("v_sub_f16", "f16", "f16 f16".split(), f16_exact(lambda a, b: a - b), True)
_def("v_subrev_f16", "f16", "f16 f16".split(), f16_exact(lambda a, b: b - a), True)
_def("v_mul_f16", "f16", "f16 f16".split(), f16_exact(lambda a, b: a * b), True)
_def("v_fma_f16", "f16", "f16 f16 f16".split(), f16_exact(lambda a, b, c: a * b + c), True)
# 32-bit integer / bitwise
_def("v_add_u32", "u32", "u32 u32".split(), lambda a, b: a + b, sat=lambda a, b: _sat_u32(np.asarray(a, I64) + b))
_def("v_sub_u32", "u32", "u32 u32".split(), lambda a, b: a - b, sat=lambda a, b: _sat_u32(np.asarray(a, I64) - b))
_def("v_subrev_u32", "u32", "u32 u32".split(), lambda a, b: b - a, sat=lambda a, b: _sat_u32(np.asarray(b, I64) - a))
_def("v_add_i32", "i32", "i32 i32".split(), lambda a, b: a + b, sat=lambda a, b: _sat_i32(np.asarray(a, I64) + b))
_def("v_sub_i32", "i32", "i32 i32".split(), lambda a, b: a - b, sat=lambda a, b: _sat_i32(np.asarray(a, I64) - b))
_def("v_mul_lo_u32", "u32", "u32 u32".split(), lambda a, b: a * b)
_def("v_mul_hi_u32", "u32", "u32 u32".split(), _mul_hi_u32)
_def("v_mul_hi_i32", "i32", "i32 i32".split(), _mul_hi_i32)
_def("v_mul_u32_u24", "u32", "u32 u32".split(), lambda a, b: _u24(a) * _u24(b))
_def("v_mul_hi_u32_u24", "u32", "u32 u32".split(), lambda a, b: _mul_hi_u32(_u24(a), _u24(b)))
_def("v_mul_i32_i24", "i32", "i32 i32".split(), lambda a, b: _i24(a) * _i24(b))
_def("v_mul_hi_i32_i24", "i32", "i32 i32".split(), lambda a, b: _mul_hi_i32(_i24(a), _i24(b)))
_def("v_mad_u32_u24", "u32", "u32 u32 u32".split(), lambda a, b, c: _u24(a) * _u24(b) + c)
_def("v_mad_i32_i24", "i32", "i32 i32 i32".split(), lambda a, b, c: _i24(a) * _i24(b) + c)
_def("v_min_i32", "i32", "i32 i32".split(), np.minimum)
_def("v_max_i32", "i32", "i32 i32".split(), np.maximum)
_def("v_min_u32", "u32", "u32 u32".split(), np.minimum)
_def("v_max_u32", "u32", "u32 u32".split(), np.maximum)
_def("v_min3_i32", "i32", "i32 i32 i32".split(), lambda a, b, c: np.minimum(np.minimum(a, b), c))
_def("v_max3_i32", "i32", "i32 i32 i32".split(), lambda a, b, c: np.maximum(np.maximum(a, b), c))
_def("v_min3_u32", "u32", "u32 u32 u32".split(), lambda a, b, c: np.minimum(np.minimum(a, b), c))
_def("v_max3_u32", "u32", "u32 u32 u32".split(), lambda a, b, c: np.maximum(np.maximum(a, b), c))
_def("v_med3_i32", "i32", "i32 i32 i32".split(),
     lambda a, b, c: np.maximum(np.minimum(a, b), np.minimum(np.maximum(a, b), c)))
_def("v_med3_u32", "u32", "u32 u32 u32".split(),
     lambda a, b, c: np.maximum(np.minimum(a, b), np.minimum(np.maximum(a, b), c)))
_def("v_lshlrev_b32", "u32", "u32 u32".split(), lambda a, b: b << (a & U32(31)))
_def("v_lshrrev_b32", "u32", "u32 u32".split(), lambda a, b: b >> (a & U32(31)))
_def("v_ashrrev_i32", "i32", "u32 i32".split(), lambda a, b: b >> (a & U32(31)).astype(I32))
_def("v_and_b32", "u32", "u32 u32".split(), lambda a, b: a & b)
_def("v_or_b32", "u32", "u32 u32".split(), lambda a, b: a | b)
_def("v_xor_b32", "u32", "u32 u32".split(), lambda a, b: a ^ b)
_def("v_xnor_b32", "u32", "u32 u32".split(), lambda a, b: ~(a ^ b))
_def("v_not_b32", "u32", ["u32"], lambda a: ~a)
_def("v_bfrev_b32", "u32", ["u32"], _bfrev)
_def("v_ffbh_u32", "i32", ["u32"], _ffbh_u32)
_def("v_ffbl_b32", "i32", ["u32"], _ffbl_b32)
_def("v_ffbh_i32", "i32", ["i32"], _ffbh_i32)
_def("v_bcnt_u32_b32", "u32", "u32 u32".split(), _bcnt)
_def("v_bfm_b32", "u32", "u32 u32".split(), lambda a, b: ((U32(1) << (a & U32(31))) - U32(1)) << (b & U32(31)))
_def("v_bfe_u32", "u32", "u32 u32 u32".split(), _bfe_u32)
_def("v_bfe_i32", "i32", "i32 u32 u32".split(), _bfe_i32)
_def("v_bfi_b32", "u32", "u32 u32 u32".split(), lambda a, b, c: (a & b) | (~a & c))
_def("v_alignbit_b32", "u32", "u32 u32 u32".split(), _alignbit)
_def("v_alignbyte_b32", "u32", "u32 u32 u32".split(), _alignbyte)
_def("v_perm_b32", "u32", "u32 u32 u32".split(), _perm_b32)
_def("v_lshl_or_b32", "u32", "u32 u32 u32".split(), lambda a, b, c: (a << (b & U32(31))) | c)
_def("v_and_or_b32", "u32", "u32 u32 u32".split(), lambda a, b, c: (a & b) | c)
_def("v_or3_b32", "u32", "u32 u32 u32".split(), lambda a, b, c: a | b | c)
_def("v_xad_u32", "u32", "u32 u32 u32".split(), lambda a, b, c: (a ^ b) + c)
_def("v_add3_u32", "u32", "u32 u32 u32".split(), lambda a, b, c: a + b + c)
_def("v_lshl_add_u32", "u32", "u32 u32 u32".split(), lambda a, b, c: (a << (b & U32(31))) + c)
_def("v_add_lshl_u32", "u32", "u32 u32 u32".split(), lambda a, b, c: (a + b) << (c & U32(31)))
_def("v_mov_b32", "u32", ["u32"], lambda a: a)
# 64-bit integer
_def("v_mov_b64", "u64", ["u64"], lambda a: a)
_def("v_lshlrev_b64", "u64", "u32 u64".split(), lambda a, b: b << (np.asarray(a, U64) & U64(63)))
_def("v_lshrrev_b64", "u64", "u32 u64".split(), lambda a, b: b >> (np.asarray(a, U64) & U64(63)))
_def("v_ashrrev_i64", "i64", "u32 i64".split(), lambda a, b: b >> (np.asarray(a, I64) & I64(63)))
_def("v_lshl_add_u64", "u64", "u64 u32 u64".split(), lambda a, b, c: (a << (np.asarray(b, U64) & U64(7))) + c)
# 16-bit integer
_def("v_add_u16", "u16", "u16 u16".split(), lambda a, b: a + b)
_def("v_sub_u16", "u16", "u16 u16".split(), lambda a, b: a - b)
_def("v_subrev_u16", "u16", "u16 u16".split(), lambda a, b: b - a)
_def("v_mul_lo_u16", "u16", "u16 u16".split(), lambda a, b: a * b)
_def("v_lshlrev_b16", "u16", "u16 u16".split(), lambda a, b: b << (a & U16(15)))
_def("v_lshrrev_b16", "u16", "u16 u16".split(), lambda a, b: b >> (a & U16(15)))
_def("v_ashrrev_i16", "i16", "u16 i16".split(), lambda a, b: b >> (a & U16(15)).astype(I16))
_def("v_max_u16", "u16", "u16 u16".split(), np.maximum)
_def("v_min_u16", "u16", "u16 u16".split(), np.minimum)
_def("v_max_i16", "i16", "i16 i16".split(), np.maximum)
_def("v_min_i16", "i16", "i16 i16".split(), np.minimum)
_def("v_mad_u16", "u16", "u16 u16 u16".split(), lambda a, b, c: a * b + c)
_def("v_mad_i16", "i16", "i16 i16 i16".split(), lambda a, b, c: a * b + c)
_def("v_pack_b32_f16", "u32", "u16 u16".split(), lambda a, b: np.asarray(a, U32) | (np.asarray(b, U32) << U32(16)))

# Float ops whose NaN/zero rules need the descriptor's IEEE mode: filled in by the builder.
IEEE_OPS = {
    "v_max_f32": (2, max_f32), "v_min_f32": (2, min_f32),
    "v_max3_f32": (3, lambda a, b, c, ieee: max_f32(max_f32(a, b, ieee), c, ieee)),
    "v_min3_f32": (3, lambda a, b, c, ieee: min_f32(min_f32(a, b, ieee), c, ieee)),
    "v_med3_f32": (3, med3_f32),
}
_def("v_maximum3_f32", "f32", "f32 f32 f32".split(), lambda *xs: maximum3(*(np.asarray(x, F32) for x in xs)), True)
_def("v_minimum3_f32", "f32", "f32 f32 f32".split(), lambda *xs: minimum3(*(np.asarray(x, F32) for x in xs)), True)

# 16-bit VOP3 instructions with op_sel: write the op_sel[3] half and keep the other (gfx9);
# every other 16-bit result is written to bits 15:0 with bits 31:16 cleared.
OPSEL_16 = {"v_mad_u16", "v_mad_i16", "v_fma_f16", "v_mad_f16", "v_div_fixup_f16", "v_min3_f16",
            "v_max3_f16", "v_med3_f16", "v_min3_i16", "v_max3_i16", "v_med3_i16", "v_min3_u16",
            "v_max3_u16", "v_med3_u16"}
