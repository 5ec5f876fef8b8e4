"""Vector ALU: VOP1/VOP2/VOPC/VOP3/VOP3SD/VOP3P (non-MFMA) arithmetic, with their modifiers.

Every instruction is vectorised over the 64 lanes with NumPy and follows the pseudocode of the
CDNA3/CDNA4 ISA guides. The generic builder `build_vop` resolves, once per instruction:
- sources: VGPR rows, SGPRs/constants/literals as NumPy scalars of the operand type, 16-bit
  halves chosen by op_sel, SDWA byte/word selects, the DPP lane permutation of src0;
- input modifiers: abs/neg on float operands (sign-bit operations, so NaN payloads survive);
- output modifiers: omod (x2, x4, /2), clamp (floats to [0, 1], NaN -> 0; integers saturate),
  the SDWA destination select, the f32 denormal flush requested by the kernel descriptor
  (FlyDSL kernels ask for none: f32 denormals are kept);
- the EXEC-masked write.

Float arithmetic is IEEE binary32 round-to-nearest-even (NumPy's float32 on x86 does not flush
denormals); fused multiply-adds are computed exactly (see `fma_f32`). Transcendentals (v_rcp,
v_rsq, v_sqrt, v_exp, v_log) are computed correctly rounded; the hardware is only specified to
about 1 ulp, so those can differ from a GPU in the last bit.
"""

from __future__ import annotations

import numpy as np

from . import decode as D
from .isa_base import (F16, F32, F64, I16, I32, I64, KINDS, U8, U16, U32, U64, is_inline, kind_bits,
                       lane_mask_reader, lane_mask_writer, mask_to_int, vsrc, vwriter, vwriter_masked)
from .isa_lane import DppSource

SIGN32 = U32(0x80000000)
SDWA_DWORD = 6
SDWA_UNUSED_PAD, SDWA_UNUSED_SEXT, SDWA_UNUSED_PRESERVE = 0, 1, 2
OMOD_SCALE = {1: 2.0, 2: 4.0, 3: 0.5}


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


def _max_min(a, b, ieee, is_max):
    """v_max/v_min of one float type: a NaN operand is dropped (a signalling NaN is returned
    quieted in IEEE mode); max(+0, -0) = +0, min(+0, -0) = -0."""
    r = _signed_zero_fix(np.fmax(a, b) if is_max else np.fmin(a, b), a, b, is_max)
    if ieee and (np.count_nonzero(np.isnan(a)) or np.count_nonzero(np.isnan(b))):
        r = np.where(_is_snan(b), _quiet(b), r)
        r = np.where(_is_snan(a), _quiet(a), r)
    return r


def max_f32(a, b, ieee=True):
    """v_max_f32 (see `_max_min`)."""
    return _max_min(np.asarray(a, F32), np.asarray(b, F32), ieee, True)


def min_f32(a, b, ieee=True):
    """v_min_f32 (see `_max_min`)."""
    return _max_min(np.asarray(a, F32), np.asarray(b, F32), ieee, False)


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


def _f16(fn):
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
    off = np.asarray(off, U32) & U32(31)
    width = np.asarray(width, U32) & U32(31)
    field = (np.asarray(a, U32) >> off) & ((U32(1) << width) - U32(1))
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
_def("v_add_f16", "f16", "f16 f16".split(), _f16(lambda a, b: a + b), True)
_def("v_sub_f16", "f16", "f16 f16".split(), _f16(lambda a, b: a - b), True)
_def("v_subrev_f16", "f16", "f16 f16".split(), _f16(lambda a, b: b - a), True)
_def("v_mul_f16", "f16", "f16 f16".split(), _f16(lambda a, b: a * b), True)
_def("v_fma_f16", "f16", "f16 f16 f16".split(), _f16(lambda a, b, c: a * b + c), True)
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
_IEEE_OPS = {
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


# --- generic builder --------------------------------------------------------------------------------
def _sdwa_select(get_u32, sel: int, sext: bool):
    if sel == SDWA_DWORD:
        return get_u32
    width = 8 if sel < 4 else 16
    shift = U32(8 * sel if sel < 4 else 16 * (sel - 4))
    mask = U32((1 << width) - 1)
    if not sext:
        return lambda w: (np.asarray(get_u32(w), U32) >> shift) & mask
    up = 32 - width
    return lambda w: (((np.asarray(get_u32(w), U32) >> shift) << U32(up)).view(I32) >> up).view(U32)


def _as_kind(get_u32, kind):
    """Reinterpret the low bits of a uint32 getter as `kind`."""
    dtype = KINDS[kind][0]
    if kind_bits(kind) == 16:
        return lambda w: np.asarray(get_u32(w), U32).astype(U16).view(dtype)
    return lambda w: np.asarray(get_u32(w), U32).view(dtype)


def _source(ctx, inst, i, kind, is_float):
    """Getter for source i with op_sel/SDWA selection and abs/neg modifiers applied."""
    bits = kind_bits(kind)
    hi = (inst.opsel >> i) & 1 if (bits == 16 and inst.enc == "VOP3") else 0
    if inst.sdwa is not None and i < 2:
        if bits == 64:
            raise ctx.error(inst, "SDWA on a 64-bit operand")
        raw = vsrc(ctx, inst, i, "u32")
        s = inst.sdwa
        get = _as_kind(_sdwa_select(raw, s[f"src{i}_sel"], bool(s[f"src{i}_sext"])), kind)
    else:
        get = vsrc(ctx, inst, i, kind, hi)
    ab, ng = (inst.abs >> i) & 1, (inst.neg >> i) & 1
    if ab or ng:
        if not (is_float and KINDS[kind][2]):
            raise ctx.error(inst, f"abs/neg modifier on integer operand {i}")
        dtype = KINDS[kind][0]
        if ab and ng:
            return lambda w: np.negative(np.abs(np.asarray(get(w), dtype)))
        if ab:
            return lambda w: np.abs(np.asarray(get(w), dtype))
        return lambda w: np.negative(np.asarray(get(w), dtype))
    return get


def _flush_f32(x):
    x = np.asarray(x, F32)
    return np.where(np.abs(x) < np.float32(1.1754944e-38), np.copysign(np.float32(0), x), x)


def _output(ctx, inst, dst, is_float, sat):
    """(transform applied to the result before the write, clamp handled?)"""
    steps = []
    if inst.omod:
        if not is_float or dst != "f32":
            raise ctx.error(inst, "omod on a non-f32 result")
        scale = np.float32(OMOD_SCALE[inst.omod])
        steps.append(lambda x: x * scale)
    if inst.clamp:
        if is_float:
            dtype = KINDS[dst][0]
            zero, one = dtype(0), dtype(1)
            steps.append(lambda x: np.where(np.isnan(x), zero, np.clip(x, zero, one)).astype(dtype))
        elif sat is None:
            raise ctx.error(inst, "clamp on an integer instruction without saturation semantics")
    if ctx.flush_f32_out and is_float and dst == "f32":
        steps.append(_flush_f32)
    if not steps:
        return None
    if len(steps) == 1:
        return steps[0]

    def chain(x):
        for s in steps:
            x = s(x)
        return x
    return chain


def _sdwa_dst(ctx, inst, dst_kind, row):
    """Writer applying the SDWA destination select to a 32-bit (or 16-bit) result."""
    s = inst.sdwa
    sel, unused = s["dst_sel"], s["dst_unused"]
    plain = vwriter(ctx, inst, "u32", row)
    if sel == SDWA_DWORD and kind_bits(dst_kind) == 32:
        dtype = KINDS[dst_kind][0]
        return lambda w, x: plain(w, np.asarray(x, dtype).view(U32))
    width = 8 if sel < 4 else 16
    shift = 8 * sel if sel < 4 else 16 * (sel - 4)
    if sel == SDWA_DWORD:
        width, shift = 16, 0
    field_mask = U32(((1 << width) - 1) << shift)
    dtype = KINDS[dst_kind][0]

    def put(w, x):
        bits = np.asarray(x, dtype).view(U16 if kind_bits(dst_kind) == 16 else U32).astype(U32)
        val = (bits << U32(shift)) & field_mask
        if unused == SDWA_UNUSED_PRESERVE:
            val = (w.v[row] & ~field_mask) | val
        elif unused == SDWA_UNUSED_SEXT:
            top = U32(shift + width)
            neg = ((bits >> U32(width - 1)) & U32(1)).astype(bool)
            upper = np.where(neg, ~U32(0) << top if shift + width < 32 else U32(0), U32(0))
            val = val | upper.astype(U32)
        plain(w, val)
    return put


def _vectorize_first(inst, getters, kinds):
    """If no source is a VGPR, make source 0 a full 64-lane array (results stay per lane, in the
    operand's dtype, instead of becoming NumPy scalars)."""
    if not any(code is not None and code >= D.VGPR_BASE for code in inst.src[:len(kinds)]):
        getters[0] = (lambda w, g=getters[0], dtype=KINDS[kinds[0]][0]: np.full(64, g(w), dtype))
    return getters


def build_vop(inst, ctx, dst, srcs, fn, is_float=False, sat=None):
    """Closure for a VALU instruction D = fn(S0, S1, ...) with all modifiers (see module doc)."""
    if inst.dpp is not None and kind_bits(dst) != 32:
        raise ctx.error(inst, "DPP on a non-32-bit instruction")
    getters = [_source(ctx, inst, i, k, is_float) for i, k in enumerate(srcs)]
    if ctx.flush_f32_in and is_float:
        getters = [(lambda w, g=g: _flush_f32(g(w))) if k == "f32" else g for g, k in zip(getters, srcs)]
    _vectorize_first(inst, getters, srcs)
    if inst.clamp and not is_float and sat is not None:
        fn = sat
    post = _output(ctx, inst, dst, is_float, sat)
    row = inst.vdst
    if inst.sdwa is not None:
        put = _sdwa_dst(ctx, inst, dst, row)
    elif kind_bits(dst) == 16:
        if inst.enc == "VOP3" and inst.name in OPSEL_16:
            put = vwriter(ctx, inst, dst, row, hi=(inst.opsel >> 3) & 1)
        else:
            put = vwriter(ctx, inst, dst, row, zero_hi=True)
    else:
        put = vwriter(ctx, inst, dst, row)

    if inst.dpp is not None:
        dpp = DppSource(ctx, inst)
        mput = vwriter_masked(ctx, inst, dst, row)
        rest = getters[1:]

        def run_dpp(w):
            x0, lanes = dpp.read(w, getters[0](w))
            r = fn(x0, *[g(w) for g in rest])
            mput(w, r if post is None else post(r), lanes)
        return run_dpp

    n = len(getters)
    if post is None:
        if n == 1:
            g0, = getters
            return lambda w: put(w, fn(g0(w)))
        if n == 2:
            g0, g1 = getters
            return lambda w: put(w, fn(g0(w), g1(w)))
        g0, g1, g2 = getters
        return lambda w: put(w, fn(g0(w), g1(w), g2(w)))
    return lambda w: put(w, post(fn(*[g(w) for g in getters])))


def _build_table(inst, ctx):
    dst, srcs, fn, is_float, sat = OPS[inst.name]
    return build_vop(inst, ctx, dst, srcs, fn, is_float, sat)


def _build_ieee(inst, ctx):
    nsrc, fn = _IEEE_OPS[inst.name]
    ieee = ctx.ieee
    return build_vop(inst, ctx, "f32", ("f32",) * nsrc, lambda *xs: fn(*xs, ieee=ieee), True)


# --- madmk/madak, v_cndmask, carries, 64-bit mad ---------------------------------------------------
def _build_fmamk(inst, ctx):
    """v_fmamk_f32: D = S0 * K + S1; v_fmaak_f32: D = S0 * S1 + K (K: the literal)."""
    k = np.frombuffer(int(inst.literal).to_bytes(4, "little"), F32)[0]
    if inst.name == "v_fmamk_f32":
        return build_vop(inst, ctx, "f32", ("f32", "f32"), lambda a, b: fma_f32(a, k, b), True)
    return build_vop(inst, ctx, "f32", ("f32", "f32"), lambda a, b: fma_f32(a, b, k), True)


def _bits_source(ctx, inst, i):
    """A 32-bit source read as raw bits, with abs/neg applied to the sign bit (v_cndmask)."""
    get = vsrc(ctx, inst, i, "u32")
    ab, ng = (inst.abs >> i) & 1, (inst.neg >> i) & 1
    if ab:
        g1 = get
        get = lambda w: np.asarray(g1(w), U32) & U32(0x7FFFFFFF)
    if ng:
        g2 = get
        get = lambda w: np.asarray(g2(w), U32) ^ SIGN32
    return get


def _build_cndmask(inst, ctx):
    if inst.dpp is not None or inst.sdwa is not None:
        raise ctx.error(inst, "DPP/SDWA v_cndmask_b32 is not supported")
    a, b = _bits_source(ctx, inst, 0), _bits_source(ctx, inst, 1)
    cond = lane_mask_reader(ctx, inst, inst.src[2])
    put = vwriter(ctx, inst, "u32")
    return lambda w: put(w, np.where(cond(w), b(w), a(w)))


def _build_carry(inst, ctx):
    """v_add/sub/subrev_co_u32 (carry out) and v_addc/subb/subbrev_co_u32 (carry in and out)."""
    if inst.dpp is not None or inst.sdwa is not None:
        raise ctx.error(inst, "DPP/SDWA carry instructions are not supported")
    name = inst.name
    a, b = _vectorize_first(inst, [vsrc(ctx, inst, 0, "u32"), vsrc(ctx, inst, 1, "u32")], ("u32", "u32"))
    cin = lane_mask_reader(ctx, inst, inst.src[2]) if name in ("v_addc_co_u32", "v_subb_co_u32",
                                                                "v_subbrev_co_u32") else None
    put = vwriter(ctx, inst, "u32")
    put_carry = lane_mask_writer(ctx, inst, inst.sdst)
    rev = "rev" in name
    sub = "sub" in name
    clamp = inst.clamp

    def run(w):
        x, y = np.asarray(a(w), I64), np.asarray(b(w), I64)
        if rev:
            x, y = y, x
        c = cin(w).astype(I64) if cin is not None else 0
        r = x - y - c if sub else x + y + c
        carry = (r < 0) if sub else (r > 0xFFFFFFFF)
        if clamp:
            r = np.clip(r, 0, 0xFFFFFFFF)
        put(w, (r & 0xFFFFFFFF).astype(U32))
        put_carry(w, carry)
    return run


def _build_mad64(inst, ctx):
    """v_mad_u64_u32 / v_mad_i64_i32: {D1, D0.u64} = S0 * S1 + S2 as a 65-bit result: D1 (the
    scalar destination) gets bit 64, the carry out (unsigned) or the sign of the sum (signed)."""
    signed = inst.name == "v_mad_i64_i32"
    kinds = ("i32", "i32", "i64") if signed else ("u32", "u32", "u64")
    a, b, c = _vectorize_first(inst, [vsrc(ctx, inst, i, kind) for i, kind in enumerate(kinds)], kinds)
    put = vwriter(ctx, inst, "u64")
    put_carry = lane_mask_writer(ctx, inst, inst.sdst)
    if inst.clamp:
        raise ctx.error(inst, "clamp on v_mad_u64_u32 is not supported")

    def run(w):
        x, y, z = a(w), b(w), c(w)
        if signed:
            p = np.asarray(x, I64) * np.asarray(y, I64)  # |p| < 2**62: exact
            z64 = np.asarray(z, I64)
            r = p + z64  # wraps when the exact 65-bit sum leaves the int64 range
            wrapped = ((p < 0) == (z64 < 0)) & ((r < 0) != (p < 0))
            carry = np.where(wrapped, p < 0, r < 0)  # bit 64 of the 65-bit sum: its sign
            put(w, r.view(U64))
        else:
            p = np.asarray(x, U64) * np.asarray(y, U64)  # < 2**64, exact
            r = p + np.asarray(z, U64)
            carry = r < p
            put(w, r)
        put_carry(w, carry)
    return run


def _build_bitop3(inst, ctx):
    """v_bitop3_b32/b16 (gfx950): a 3-input truth table held in the OMOD, ABS and NEG fields."""
    table = (inst.omod << 6) | (inst.abs << 3) | inst.neg
    kind = "u32" if inst.name.endswith("b32") else "u16"
    dtype = KINDS[kind][0]
    g = [vsrc(ctx, inst, i, kind, (inst.opsel >> i) & 1 if kind == "u16" else 0) for i in range(3)]
    put = vwriter(ctx, inst, kind, hi=(inst.opsel >> 3) & 1) if kind == "u16" else vwriter(ctx, inst, kind)

    def run(w):
        s0, s1, s2 = (np.asarray(x(w), dtype) for x in g)
        out = np.zeros(np.broadcast(s0, s1, s2).shape, dtype)
        for i in range(8):
            if table >> i & 1:
                out |= (s0 if i & 4 else ~s0) & (s1 if i & 2 else ~s1) & (s2 if i & 1 else ~s2)
        put(w, out)
    return run


# --- VOP3P packed math ------------------------------------------------------------------------------
# name -> (kind, sources, fn); float16 arithmetic is computed exactly in binary64 (`_f16`)
_PK16 = {
    "v_pk_add_f16": ("f16", 2, _f16(lambda a, b: a + b)), "v_pk_mul_f16": ("f16", 2, _f16(lambda a, b: a * b)),
    "v_pk_fma_f16": ("f16", 3, _f16(lambda a, b, c: a * b + c)),
    "v_pk_max_f16": ("f16", 2, lambda a, b: _max_min(np.asarray(a, F16), np.asarray(b, F16), True, True)),
    "v_pk_min_f16": ("f16", 2, lambda a, b: _max_min(np.asarray(a, F16), np.asarray(b, F16), True, False)),
    "v_pk_maximum3_f16": ("f16", 3, lambda a, b, c: maximum3(*(np.asarray(x, F16) for x in (a, b, c)))),
    "v_pk_minimum3_f16": ("f16", 3, lambda a, b, c: minimum3(*(np.asarray(x, F16) for x in (a, b, c)))),
    "v_pk_add_u16": ("u16", 2, lambda a, b: a + b), "v_pk_sub_u16": ("u16", 2, lambda a, b: a - b),
    "v_pk_add_i16": ("i16", 2, lambda a, b: a + b), "v_pk_sub_i16": ("i16", 2, lambda a, b: a - b),
    "v_pk_mul_lo_u16": ("u16", 2, lambda a, b: a * b),
    "v_pk_lshlrev_b16": ("u16", 2, lambda a, b: b << (a & U16(15))),
    "v_pk_lshrrev_b16": ("u16", 2, lambda a, b: b >> (a & U16(15))),
    "v_pk_ashrrev_i16": ("i16", 2, lambda a, b: b >> (a & I16(15))),
    "v_pk_max_i16": ("i16", 2, np.maximum), "v_pk_min_i16": ("i16", 2, np.minimum),
    "v_pk_max_u16": ("u16", 2, np.maximum), "v_pk_min_u16": ("u16", 2, np.minimum),
    "v_pk_mad_u16": ("u16", 3, lambda a, b, c: a * b + c), "v_pk_mad_i16": ("i16", 3, lambda a, b, c: a * b + c),
}
_PK32 = {
    "v_pk_add_f32": (2, lambda a, b: a + b), "v_pk_mul_f32": (2, lambda a, b: a * b),
    "v_pk_fma_f32": (3, fma_f32),
}


_PK16_SAT = {"u16": (I32(0), I32(0xFFFF)), "i16": (I32(-0x8000), I32(0x7FFF))}


def _half_rows(kind: str, row: int, lo_sel: int, hi_sel: int):
    """Getter w -> the 16-bit halves of register `row` that feed the low and the high result,
    as a (64, 2) view (or (64, 1) when both results read the same half)."""
    view = {"u16": "h16", "b16": "h16", "i16": "hi16", "f16": "hf16"}[kind]
    if (lo_sel, hi_sel) == (0, 1):
        cols = slice(None)
    elif lo_sel == hi_sel:
        cols = slice(lo_sel, lo_sel + 1)
    else:
        cols = slice(None, None, -1)
    if view == "h16":
        return lambda w: w.h16[row, :, cols]
    if view == "hi16":
        return lambda w: w.hi16[row, :, cols]
    return lambda w: w.hf16[row, :, cols]


def _pk16_pair(ctx, inst, i, kind, wide):
    """Getter for packed source i giving both halves at once (a (64, 2)-broadcastable array:
    column 0 feeds the low result, column 1 the high one) with neg applied, or None when the
    halves need different modifiers (then the instruction runs half by half)."""
    neg_lo, neg_hi = (inst.neg >> i) & 1, (inst.neg_hi >> i) & 1
    if neg_lo != neg_hi or (neg_lo and kind != "f16"):
        return None
    sel_lo, sel_hi = (inst.opsel >> i) & 1, (inst.opsel_hi >> i) & 1
    dtype = KINDS[kind][0]
    code = inst.src[i]
    if code >= D.VGPR_BASE:
        get = _half_rows(kind, code - D.VGPR_BASE, sel_lo, sel_hi)
    else:
        g_lo, g_hi = vsrc(ctx, inst, i, kind, sel_lo), vsrc(ctx, inst, i, kind, sel_hi)
        if code == D.SRC_LITERAL or is_inline(code):
            pair = np.array([g_lo(None), g_hi(None)], dtype)
            get = lambda w: pair  # noqa: E731
        else:
            get = lambda w: np.array([g_lo(w), g_hi(w)], dtype)  # noqa: E731
    if neg_lo:
        return lambda w: np.negative(get(w))
    if wide is not dtype:
        return lambda w: np.asarray(get(w), wide)
    return get


def _build_pk16(inst, ctx):
    """Packed 16-bit math: op_sel[i] / op_sel_hi[i] pick the half of source i for the low / high
    result, neg / neg_hi negate float halves. Clamp saturates integers (computed in int32) and
    clamps floats to [0, 1]. The operations are element-wise, so both halves are computed in
    one NumPy call on (64, 2) arrays whenever the two halves take the same modifiers."""
    kind, n, fn = _PK16[inst.name]
    is_float = kind == "f16"
    dtype = KINDS[kind][0]
    clamp = inst.clamp
    wide = I32 if clamp and not is_float else dtype

    def finish(r):
        if clamp and is_float:
            r = np.where(np.isnan(r), dtype(0), np.clip(r, dtype(0), dtype(1)))
        elif clamp:
            low, high = _PK16_SAT[kind]
            r = np.minimum(np.maximum(r, low), high)
        return np.asarray(r).astype(dtype)

    pairs = [_pk16_pair(ctx, inst, i, kind, wide) for i in range(n)]
    if all(g is not None for g in pairs):
        row = inst.vdst

        def run_pairs(w):
            r = finish(fn(*[g(w) for g in pairs])).view(U16)
            if w.exec_full:
                w.h16[row] = r
            else:
                np.copyto(w.h16[row], r, where=w.exec_mask[:, None])
        return run_pairs

    def half_getter(i, hi_sel, neg):
        g = vsrc(ctx, inst, i, kind, hi_sel)
        if neg:
            if not is_float:
                raise ctx.error(inst, "neg on an integer packed operand")
            return lambda w: np.negative(np.asarray(g(w), dtype))
        if wide is not dtype:
            return lambda w: np.asarray(g(w), wide)
        return g

    lo = [half_getter(i, (inst.opsel >> i) & 1, (inst.neg >> i) & 1) for i in range(n)]
    hi = [half_getter(i, (inst.opsel_hi >> i) & 1, (inst.neg_hi >> i) & 1) for i in range(n)]
    put_lo = vwriter(ctx, inst, kind, hi=0)
    put_hi = vwriter(ctx, inst, kind, hi=1)

    def run(w):
        r_lo = finish(fn(*[g(w) for g in lo]))
        r_hi = finish(fn(*[g(w) for g in hi]))
        put_lo(w, r_lo)
        put_hi(w, r_hi)
    return run


def _pk32_half(ctx, inst, i, sel, neg):
    """f32 half `sel` of the 64-bit packed source i, negated if `neg`. An inline constant is
    the 32-bit constant in both halves (how LLVM encodes splat constants of v2f32 operands)."""
    code = inst.src[i]
    if code >= D.VGPR_BASE:
        get = (lambda w, r=code - D.VGPR_BASE + sel: w.vf[r])
    elif code <= D.EXEC_HI:
        get = (lambda w, c=code + sel: np.frombuffer(int(w.s[c]).to_bytes(4, "little"), F32)[0])
    elif is_inline(code):
        const = vsrc(ctx, inst, i, "f32")(None)
        get = (lambda w: const)
    else:
        raise ctx.error(inst, f"operand {D.operand_text(code)} of packed f32 math is not supported")
    if neg:
        return lambda w: np.negative(get(w))
    return get


def _pk32_pair(ctx, inst, i):
    """Getter for packed f32 source i giving both halves at once as a (2, 64)-broadcastable
    array (row 0 feeds the low result, row 1 the high one), or None when the halves take
    different neg modifiers."""
    neg = (inst.neg >> i) & 1
    if neg != (inst.neg_hi >> i) & 1:
        return None
    sel_lo, sel_hi = (inst.opsel >> i) & 1, (inst.opsel_hi >> i) & 1
    code = inst.src[i]
    if code >= D.VGPR_BASE:
        r = code - D.VGPR_BASE
        if (sel_lo, sel_hi) == (0, 1):
            get = lambda w: w.vf[r:r + 2]  # noqa: E731
        elif sel_lo == sel_hi:
            get = lambda w: w.vf[r + sel_lo:r + sel_lo + 1]  # noqa: E731
        else:
            get = lambda w: w.vf[[r + 1, r]]  # noqa: E731
    else:
        g_lo, g_hi = _pk32_half(ctx, inst, i, sel_lo, 0), _pk32_half(ctx, inst, i, sel_hi, 0)
        if is_inline(code):
            const = g_lo(None)
            get = lambda w: const  # noqa: E731
        else:
            get = lambda w: np.array([[g_lo(w)], [g_hi(w)]], F32)  # noqa: E731
    if neg:
        return lambda w: np.negative(get(w))
    return get


def _build_pk32(inst, ctx):
    """v_pk_{add,mul,fma}_f32 / v_pk_mov_b32: two f32 lanes per 64-bit register pair;
    op_sel[i] picks the half of source i for the low result, op_sel_hi[i] for the high one.
    The arithmetic is element-wise: both halves are one NumPy call on (2, 64) arrays when
    the two halves of every source take the same neg modifier."""
    if inst.clamp:
        raise ctx.error(inst, "clamp on packed f32 math is not supported")
    row = inst.vdst
    if inst.name != "v_pk_mov_b32":
        n, fn = _PK32[inst.name]
        pairs = [_pk32_pair(ctx, inst, i) for i in range(n)]
        if all(g is not None for g in pairs):
            def run_pairs(w):
                r = fn(*[g(w) for g in pairs])
                if w.exec_full:
                    w.vf[row:row + 2] = r
                else:
                    np.copyto(w.vf[row:row + 2], r, where=w.exec_mask, casting="unsafe")
            return run_pairs
    if inst.name == "v_pk_mov_b32":
        lo = _pk32_half(ctx, inst, 0, inst.opsel & 1, 0)
        hi = _pk32_half(ctx, inst, 1, (inst.opsel >> 1) & 1, 0)
    else:
        los = [_pk32_half(ctx, inst, i, (inst.opsel >> i) & 1, (inst.neg >> i) & 1) for i in range(n)]
        his = [_pk32_half(ctx, inst, i, (inst.opsel_hi >> i) & 1, (inst.neg_hi >> i) & 1) for i in range(n)]
        lo = lambda w: fn(*[g(w) for g in los])  # noqa: E731
        hi = lambda w: fn(*[g(w) for g in his])  # noqa: E731
    put_lo = vwriter(ctx, inst, "f32", row)
    put_hi = vwriter(ctx, inst, "f32", row + 1)

    def run(w):
        a, b = lo(w), hi(w)  # both halves read before either is written
        put_lo(w, a)
        put_hi(w, b)
    return run


def _build_dot2_bf16(inst, ctx):
    """v_dot2_f32_bf16 (VOP3P) / v_dot2c_f32_bf16 (VOP2, D is the addend):
    D = S0.lo*S1.lo + S0.hi*S1.hi + S2, bf16 products accumulated in f32 as in the pseudocode."""
    g0, g1, g2 = vsrc(ctx, inst, 0, "u32"), vsrc(ctx, inst, 1, "u32"), vsrc(ctx, inst, 2, "f32")
    put = vwriter(ctx, inst, "f32")
    if inst.neg or inst.neg_hi or inst.clamp or inst.dpp is not None or inst.sdwa is not None:
        raise ctx.error(inst, "modifiers on v_dot2 bf16 are not supported")

    def halves(x):
        x = np.asarray(x, U32)
        return (x << U32(16)).view(F32), (x & U32(0xFFFF0000)).view(F32)

    def run(w):
        a_lo, a_hi = halves(g0(w))
        b_lo, b_hi = halves(g1(w))
        if inst.enc == "VOP3P":
            t = a_lo * b_lo
            t = t + a_hi * b_hi
            t = t + g2(w)
        else:
            t = np.asarray(g2(w), F32) + a_lo * b_lo
            t = t + a_hi * b_hi
        put(w, t)
    return run


# --- VOPC ---------------------------------------------------------------------------------------------
def _float_cmp(op):
    return {
        "f": lambda a, b: np.zeros(np.broadcast(a, b).shape, bool),
        "lt": np.less, "eq": np.equal, "le": np.less_equal, "gt": np.greater,
        "lg": lambda a, b: (a < b) | (a > b), "ge": np.greater_equal,
        "o": lambda a, b: ~(np.isnan(a) | np.isnan(b)), "u": lambda a, b: np.isnan(a) | np.isnan(b),
        "nge": lambda a, b: ~(a >= b), "nlg": lambda a, b: ~((a < b) | (a > b)), "ngt": lambda a, b: ~(a > b),
        "nle": lambda a, b: ~(a <= b), "neq": lambda a, b: ~(a == b), "nlt": lambda a, b: ~(a < b),
        "tru": lambda a, b: np.ones(np.broadcast(a, b).shape, bool),
    }[op]


def _int_cmp(op):
    return {
        "f": lambda a, b: np.zeros(np.broadcast(a, b).shape, bool), "lt": np.less, "eq": np.equal,
        "le": np.less_equal, "gt": np.greater, "ne": np.not_equal, "lg": np.not_equal, "ge": np.greater_equal,
        "t": lambda a, b: np.ones(np.broadcast(a, b).shape, bool),
    }[op]


def _class_test(kind):
    """v_cmp_class: S1 bit per class: 0 sNaN, 1 qNaN, 2 -inf, 3 -normal, 4 -denorm, 5 -0,
    6 +0, 7 +denorm, 8 +normal, 9 +inf."""
    dtype = KINDS[kind][0]
    ubits = {F32: (U32, 23, 0xFF), F64: (U64, 52, 0x7FF), F16: (U16, 10, 0x1F)}[dtype]

    def test(x, mask):
        x = np.asarray(x, dtype)
        ut, mant_bits, emax = ubits
        b = x.view(ut)
        exp = (b >> ut(mant_bits)) & ut(emax)
        mant = b & ut((1 << mant_bits) - 1)
        neg = np.signbit(x)
        quiet = (mant >> ut(mant_bits - 1)) & ut(1)
        cls = np.where(exp == emax,
                       np.where(mant == 0, np.where(neg, 2, 9), np.where(quiet == 1, 1, 0)),
                       np.where(exp > 0, np.where(neg, 3, 8), np.where(mant != 0, np.where(neg, 4, 7),
                                                                       np.where(neg, 5, 6))))
        return ((np.asarray(mask, U32) >> cls.astype(U32)) & U32(1)).astype(bool)
    return test


def _build_vopc(inst, ctx):
    name = inst.name
    cmpx = name.startswith("v_cmpx_")
    body = name[len("v_cmpx_") if cmpx else len("v_cmp_"):]
    op, t = body.rsplit("_", 1)
    if op == "class":
        kinds, fn = (t, "u32"), _class_test(t)
        is_float = True
    elif t.startswith("f"):
        kinds, fn, is_float = (t, t), _float_cmp(op), True
    else:
        kinds, fn, is_float = (t, t), _int_cmp(op), False
    if inst.dpp is not None:
        raise ctx.error(inst, "DPP compare is not supported")
    getters = _vectorize_first(inst, [_source(ctx, inst, i, kind, is_float and not (op == "class" and i == 1))
                                      for i, kind in enumerate(kinds)], kinds)
    put = lane_mask_writer(ctx, inst, inst.sdst)  # lanes with EXEC off get 0

    def run(w):
        r = fn(getters[0](w), getters[1](w))
        if cmpx:  # v_cmpx writes the result to EXEC as well as to the destination
            r = r & w.exec_mask
            put(w, r)
            w.set_exec(mask_to_int(r))
        else:
            put(w, r)
    return run


def _vopc_names():
    from tinygrad.runtime.autogen.amd.cdna.enum import VOPCOp
    out = []
    for m in VOPCOp:
        n = m.name.lower().removesuffix("_e32")
        out.append(n)
    return out


BUILDERS = {name: _build_table for name in OPS}
BUILDERS.update({name: _build_ieee for name in _IEEE_OPS})
BUILDERS.update({
    "v_fmamk_f32": _build_fmamk, "v_fmaak_f32": _build_fmamk,
    "v_cndmask_b32": _build_cndmask,
    "v_add_co_u32": _build_carry, "v_sub_co_u32": _build_carry, "v_subrev_co_u32": _build_carry,
    "v_addc_co_u32": _build_carry, "v_subb_co_u32": _build_carry, "v_subbrev_co_u32": _build_carry,
    "v_mad_u64_u32": _build_mad64, "v_mad_i64_i32": _build_mad64,
    "v_bitop3_b32": _build_bitop3, "v_bitop3_b16": _build_bitop3,
    "v_pk_add_f32": _build_pk32, "v_pk_mul_f32": _build_pk32, "v_pk_fma_f32": _build_pk32,
    "v_pk_mov_b32": _build_pk32,
    "v_dot2_f32_bf16": _build_dot2_bf16, "v_dot2c_f32_bf16": _build_dot2_bf16,
    "v_nop": lambda inst, ctx: (lambda w: None),
})
BUILDERS.update({name: _build_pk16 for name in _PK16})
for _n in _vopc_names():
    _t = _n.rsplit("_", 1)[1]
    if _t in ("f16", "f32", "f64", "i16", "u16", "i32", "u32", "i64", "u64"):
        BUILDERS[_n] = _build_vopc
