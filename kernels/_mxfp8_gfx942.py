"""gfx942 pieces of the MXFP8 grouped GEMM (kernels/mxfp8_grouped_mm.py), which has no MX MFMA:
E8M0 scales as f32, OCP E4M3 dwords made FNUZ-safe for the FP8 MFMA, a step's FP8 MFMAs and their
scaled sums; and the vector joins both arches use."""

from __future__ import annotations

import flydsl.expr as fx
from flydsl.expr import const_expr, range_constexpr, rocdl
from flydsl.expr.typing import T
from flydsl.expr.typing import Vector as Vec

from . import _mx_common as mx
from ._mx_common import i32_bits


def _e8m0_f32(e):
    """2^(e - 127) as f32 for an E8M0 code e (an i32 in [0, 255]): the exponent field for codes
    1 .. 254, the subnormal 2^-127 for 0 and NaN for 255 (both get mantissa bit 22)."""
    special = fx.Uint32(e - 1) > fx.Uint32(253)
    return ((e << 23) | special.select(fx.Int32(1 << 22), fx.Int32(0))).bitcast(fx.Float32)


def _fnuz_words(w, fused: bool):
    """An OCP E4M3 dword read as four FNUZ codes: -0 (0x80) -> +0 (mx.unsign_zeros, `fused`); also
    returns a probe whose bit 7 of a byte is set where that byte is a NaN code (0x7F / 0xFF)."""
    return fx.Int32(mx.unsign_zeros(w, fused)), (w & 0x7F7F7F7F) + 0x01010101


def _fnuz_nans(w):
    """NaN codes of an already -0-fixed OCP dword -> FNUZ's NaN (0x80) (the rare branch)."""
    nan = ((w & 0x7F7F7F7F) + 0x01010101) & i32_bits(0x80808080)  # 0x80 in the NaN bytes
    mask = nan | (nan - nan.shrui(fx.Int32(7)))  # 0xFF in the NaN bytes
    return (w & ~mask) | nan


def _fnuz_operands(words, signed_zeros: bool, fused: bool):
    """The step's loaded OCP E4M3 dwords as FNUZ operands: -0 rewritten (_fnuz_words) and, when a
    probe finds a NaN code in the wave, NaN codes too (_fnuz_nans, a rare branch). signed_zeros
    False: the caller promises no -0 byte and NaN codes only in blocks whose scale is NaN (what
    flyquant's quantize ops write with signed_zeros=False), whose products the NaN scale makes NaN
    anyway: the words are used as they are. `fused`: mx.unsign_zeros'."""
    words = [fx.Int32(w) for w in words]
    if not signed_zeros:
        return words
    probe = fx.Int32(0)
    flat = []
    for w in words:
        fixed, p = _fnuz_words(w, fused)
        probe = probe | p
        flat.append(fixed)
    has_nan = mx.wave_any(((probe & i32_bits(0x80808080)) != 0).ir_value())
    return [fx.Int32(x) for x in mx.if_else(has_nan, lambda: [_fnuz_nans(w) for w in flat], lambda: flat,
                                            types=[T.i32] * len(flat))]


def _pair(v, h):
    """Elements 2h, 2h + 1 of a 4-vector of f32 (a packed-math operand)."""
    v = v if isinstance(v, list) else Vec(v)
    return Vec.from_elements([v[2 * h], v[2 * h + 1]], fx.Float32)


def _cat(x, y, ty=fx.Int32):
    """Two vectors -> one (a 32-byte MFMA operand from two 16-byte loads; 2 + 2 f32 halves)."""
    x, y = Vec(x), Vec(y)
    return Vec.from_elements([x[i] for i in range(len(x))] + [y[i] for i in range(len(y))], ty).ir_value()


LAG = 2  # MFMAs issued between one and the VALU reading its result (1: 0.34 hazard s_nops per MFMA, 2: 0.10)


def scaled_sums(accs, a_ops, b_ops, sa, sb, blocks: int, fenced: bool):
    """accs[mb * NB + nb] (4 f32) plus, for each 32-wide block j < blocks of the step, row block
    mb's times column block nb's FP8 operands (one v_mfma_f32_16x16x32_fp8_fp8 from 0) times
    sa[mb][j] * sb(nb, j) (packed FP32). Issue order: block, column block, row block; each MFMA's
    result is scaled and added LAG MFMAs later, a column block's scales read (sb) as its first
    MFMA issues. `fenced`: the order kept with scheduling barriers (LLVM's own issues every MFMA
    of a block first and reads the first result too soon)."""
    MB, NB = len(a_ops), len(b_ops)
    zero4 = Vec.filled(4, 0.0, fx.Float32).ir_value()
    accs = list(accs)
    order = [(j, nb, mb) for j in range_constexpr(blocks) for nb in range_constexpr(NB) for mb in range_constexpr(MB)]
    parts, sbs = {}, {}

    def scale_add(j, nb, mb):
        sa2 = Vec.from_elements([sa[mb][j], sa[mb][j]], fx.Float32)
        p, acc = parts.pop((j, nb, mb)), Vec(accs[mb * NB + nb])
        prods = [_pair(sbs[j, nb], h) * sa2 for h in range_constexpr(2)]  # both before their FMAs: no s_nop
        halves = [fx.math.fma(_pair(p, h), prods[h], _pair(acc, h)) for h in range_constexpr(2)]
        accs[mb * NB + nb] = _cat(*halves, ty=fx.Float32)

    for t in range_constexpr(len(order)):
        j, nb, mb = order[t]
        if const_expr(mb == 0):
            sbs[j, nb] = sb(nb, j)
        parts[j, nb, mb] = Vec(rocdl.mfma_f32_16x16x32_fp8_fp8(T.vec(4, T.f32), [b_ops[nb][j], a_ops[mb][j], zero4]))
        if const_expr(t >= LAG):
            scale_add(*order[t - LAG])
        if const_expr(fenced):
            rocdl.sched_barrier(0)
    for t in range_constexpr(max(0, len(order) - LAG), len(order)):
        scale_add(*order[t])
    return accs
