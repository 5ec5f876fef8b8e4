"""gfx942 pieces of the MXFP8 grouped GEMM (kernels/mxfp8_grouped_mm.py), which has no MX MFMA:
E8M0 scales as f32, OCP E4M3 dwords made FNUZ-safe for the FP8 MFMA, packed-math operands."""

from __future__ import annotations

import flydsl.expr as fx
from flydsl.expr.typing import T
from flydsl.expr.typing import Vector as Vec

from . import _mx_common as mx
from ._mx_common import i32_bits


def _e8m0_f32(e):
    """2^(e - 127) as f32 for an E8M0 code e (an i32 in [0, 255]): the exponent field for codes
    1 .. 254, the subnormal 2^-127 for 0 and NaN for 255 (both get mantissa bit 22)."""
    special = fx.Uint32(e - 1) > fx.Uint32(253)
    return ((e << 23) | special.select(fx.Int32(1 << 22), fx.Int32(0))).bitcast(fx.Float32)


def _fnuz_words(w):
    """An OCP E4M3 dword read as four FNUZ codes: -0 (0x80) -> +0; also returns a probe whose
    bit 7 of a byte is set where that byte is a NaN code (0x7F / 0xFF)."""
    return fx.Int32(mx.unsign_zeros(w)), (w & 0x7F7F7F7F) + 0x01010101


def _fnuz_nans(w):
    """NaN codes of an already -0-fixed OCP dword -> FNUZ's NaN (0x80) (the rare branch)."""
    nan = ((w & 0x7F7F7F7F) + 0x01010101) & i32_bits(0x80808080)  # 0x80 in the NaN bytes
    mask = nan | (nan - nan.shrui(fx.Int32(7)))  # 0xFF in the NaN bytes
    return (w & ~mask) | nan


def _fnuz_operands(words, signed_zeros: bool):
    """The step's loaded OCP E4M3 dwords as FNUZ operands: -0 rewritten (_fnuz_words) and, when a
    probe finds a NaN code in the wave, NaN codes too (_fnuz_nans, a rare branch). signed_zeros
    False: the caller promises no -0 byte and NaN codes only in blocks whose scale is NaN (what
    flyquant's quantize ops write with signed_zeros=False), whose products the NaN scale makes NaN
    anyway: the words are used as they are."""
    words = [fx.Int32(w) for w in words]
    if not signed_zeros:
        return words
    probe = fx.Int32(0)
    flat = []
    for w in words:
        fixed, p = _fnuz_words(w)
        probe = probe | p
        flat.append(fixed)
    has_nan = mx.wave_any(((probe & i32_bits(0x80808080)) != 0).ir_value())
    return [fx.Int32(x) for x in mx.if_else(has_nan, lambda: [_fnuz_nans(w) for w in flat], lambda: flat,
                                            types=[T.i32] * len(flat))]


def _pair(v, h):
    """Elements 2h, 2h + 1 of a 4-vector of f32 (a packed-math operand)."""
    v = v if isinstance(v, list) else Vec(v)
    return Vec.from_elements([v[2 * h], v[2 * h + 1]], fx.Float32)
