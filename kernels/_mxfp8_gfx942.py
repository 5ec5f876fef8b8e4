"""gfx942 pieces of the MXFP8 grouped GEMM (kernels/mxfp8_grouped_mm.py), which has no MX MFMA:
E8M0 scales as f32, OCP E4M3 dwords made FNUZ-safe for the FP8 MFMA, packed-math operands."""

from __future__ import annotations

import flydsl.expr as fx
from flydsl.expr.typing import Vector as Vec

from ._mx_common import i32_bits


def _e8m0_f32(e):
    """2^(e - 127) as f32 for an E8M0 code e (an i32 in [0, 255]): the exponent field for codes
    1 .. 254, the subnormal 2^-127 for 0 and NaN for 255 (both get mantissa bit 22)."""
    special = fx.Uint32(e - 1) > fx.Uint32(253)
    return ((e << 23) | special.select(fx.Int32(1 << 22), fx.Int32(0))).bitcast(fx.Float32)


def _fnuz_words(w):
    """An OCP E4M3 dword read as four FNUZ codes: -0 (0x80) -> +0; also returns a probe whose
    bit 7 of a byte is set where that byte is a NaN code (0x7F / 0xFF)."""
    low = w & 0x7F7F7F7F
    fixed = (w & (low + 0x7F7F7F7F)) | low  # a byte keeps its sign bit only when its low 7 bits are not 0
    return fixed, low + 0x01010101


def _fnuz_nans(w):
    """NaN codes of an already -0-fixed OCP dword -> FNUZ's NaN (0x80) (the rare branch)."""
    nan = ((w & 0x7F7F7F7F) + 0x01010101) & i32_bits(0x80808080)  # 0x80 in the NaN bytes
    mask = nan | (nan - nan.shrui(fx.Int32(7)))  # 0xFF in the NaN bytes
    return (w & ~mask) | nan


def _pair(v, h):
    """Elements 2h, 2h + 1 of a 4-vector of f32 (a packed-math operand)."""
    v = v if isinstance(v, list) else Vec(v)
    return Vec.from_elements([v[2 * h], v[2 * h + 1]], fx.Float32)
