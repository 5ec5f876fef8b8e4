"""The IEEE f32 division sequence: v_div_scale_f32, v_div_fmas_f32, v_div_fixup_f32.

LLVM (and so Triton) expands an f32 `a / b` into: two v_div_scale_f32 (the denominator and the
numerator, pre-scaled by 2**+-64 when the quotient or the operands would lose precision; the
numerator's writes VCC), a Newton-Raphson refinement of v_rcp_f32 with fused multiply-adds,
v_div_fmas_f32 (the last fma, reading VCC) and v_div_fixup_f32 (special cases: NaN, 0, inf).

Each function below follows the pseudocode of the instruction in the CDNA3 and CDNA4 ISA
reference guides (identical in both), quoted in its docstring; `exponent(x)` is x's biased
exponent field, "== DENORM" tests for a denormal, and UNDERFLOW_F32 / OVERFLOW_F32 are the
smallest denormal (bits 0x00000001) and the largest finite value (0x7F7FFFFF). A result the
pseudocode leaves unassigned is S0 (the operand being scaled; the guides require S0 == S1 or
S0 == S2).

v_div_fmas_f32 with VCC set: the guides write `2.0F ** 32 * fma(...)`, which does not undo the
2**+-64 pre-scaling of v_div_scale_f32 (tinygrad's emulator treats it as an erratum and scales
by 2**64 or 2**-64 by the exponent of S2). That case (quotients near the f32 range limits) is not
modelled: a lane that reaches it is an error naming the instruction.
"""

from __future__ import annotations

import numpy as np

from . import table
from . import decode as D
from .isa_base import F32, I32, U32, lane_mask_reader, lane_mask_writer, vwriter
from .isa_valu import source, vectorize_first
from .isa_vmath import fma_f32

UNDERFLOW_F32 = np.uint32(0x00000001).view(F32)
OVERFLOW_F32 = np.uint32(0x7F7FFFFF).view(F32)
F32_MIN_NORMAL = np.float32(2.0 ** -126)
NAN_F32 = np.uint32(0x7FC00000).view(F32)
QNAN_NEG_F32 = np.uint32(0xFFC00000).view(F32)  # 0/0 and inf/inf in v_div_fixup_f32
QUIET_BIT = np.uint32(1 << 22)


def _exponent(x) -> np.ndarray:
    return ((np.asarray(x, F32).view(U32) >> U32(23)) & U32(0xFF)).astype(I32)


def _is_denorm(x) -> np.ndarray:
    x = np.asarray(x, F32)
    return (x != 0) & (np.abs(x) < F32_MIN_NORMAL)


def div_scale_f32(s0, s1, s2):
    """(D0, VCC) of V_DIV_SCALE_F32, per lane:
        VCC = 0
        if S2 == 0.0 || S1 == 0.0:              D0 = NAN
        elsif exponent(S2) - exponent(S1) >= 96: VCC = 1; if S0 == S1: D0 = ldexp(S0, 64)
        elsif S1 == DENORM:                     D0 = ldexp(S0, 64)
        elsif 1.0 / 64'F(S1) == DENORM.f64 && S2 / S1 == DENORM:
                                                VCC = 1; if S0 == S1: D0 = ldexp(S0, 64)
        elsif 1.0 / 64'F(S1) == DENORM.f64:     D0 = ldexp(S0, -64)
        elsif S2 / S1 == DENORM:                VCC = 1; if S0 == S2: D0 = ldexp(S0, 64)
        elsif exponent(S2) <= 23:               D0 = ldexp(S0, 64)   // numerator is tiny
    (1 / S1 in binary64 is never a binary64 denormal for a binary32 S1: those branches are dead.)"""
    s0, s1, s2 = (np.asarray(x, F32) for x in (s0, s1, s2))
    with np.errstate(all="ignore"):
        quotient = s2 / s1
    up = np.ldexp(s0, I32(64)).astype(F32)
    zero = (s2 == 0) | (s1 == 0)
    far = ~zero & (_exponent(s2) - _exponent(s1) >= 96)
    den1 = ~zero & ~far & _is_denorm(s1)
    den_q = ~zero & ~far & ~den1 & _is_denorm(quotient)
    tiny = ~zero & ~far & ~den1 & ~den_q & (_exponent(s2) <= 23)
    d = np.where(zero, NAN_F32, s0)
    d = np.where((far & (s0 == s1)) | den1 | (den_q & (s0 == s2)) | tiny, up, d)
    return d.astype(F32), far | den_q


def div_fmas_f32(s0, s1, s2):
    """D0 of V_DIV_FMAS_F32 for a lane whose VCC bit is 0: fma(S0, S1, S2), rounded once."""
    return fma_f32(s0, s1, s2)


def div_fixup_f32(s0, s1, s2):
    """D0 of V_DIV_FIXUP_F32 (S0 the quotient, S1 the denominator, S2 the numerator), per lane:
        sign_out = sign(S1) ^ sign(S2)
        if isNAN(S2):                      D0 = cvtToQuietNAN(S2)
        elsif isNAN(S1):                   D0 = cvtToQuietNAN(S1)
        elsif S1 == 0.0 && S2 == 0.0:      D0 = 0xffc00000            // 0/0
        elsif abs(S1) == INF && abs(S2) == INF: D0 = 0xffc00000       // inf/inf
        elsif S1 == 0.0 || abs(S2) == INF: D0 = sign_out ? -INF : +INF   // x/0, or inf/y
        elsif abs(S1) == INF || S2 == 0.0: D0 = sign_out ? -0.0 : 0.0    // x/inf, 0/y
        elsif exponent(S2) - exponent(S1) < -150: D0 = sign_out ? -UNDERFLOW_F32 : UNDERFLOW_F32
        elsif exponent(S1) == 255:         D0 = sign_out ? -OVERFLOW_F32 : OVERFLOW_F32
        else:                              D0 = sign_out ? -abs(S0) : abs(S0)"""
    s0, s1, s2 = (np.asarray(x, F32) for x in (s0, s1, s2))
    neg = np.signbit(s1) ^ np.signbit(s2)

    def signed(mag):
        return np.where(neg, -np.asarray(mag, F32), np.asarray(mag, F32))

    quiet = lambda x: (x.view(U32) | QUIET_BIT).view(F32)  # noqa: E731
    a1, a2 = np.abs(s1), np.abs(s2)
    conds = [np.isnan(s2), np.isnan(s1), (s1 == 0) & (s2 == 0), np.isinf(a1) & np.isinf(a2),
             (s1 == 0) | np.isinf(a2), np.isinf(a1) | (s2 == 0), _exponent(s2) - _exponent(s1) < -150,
             _exponent(s1) == 255]
    values = [quiet(s2), quiet(s1), QNAN_NEG_F32, QNAN_NEG_F32, signed(np.float32(np.inf)), signed(np.float32(0)),
              signed(UNDERFLOW_F32), signed(OVERFLOW_F32)]
    return np.select(conds, values, signed(np.abs(s0))).astype(F32)


def _sources(ctx, inst):
    return vectorize_first(inst, [source(ctx, inst, i, "f32", True) for i in range(3)], ("f32",) * 3)


def _check_plain(ctx, inst):
    if inst.clamp or inst.omod:
        raise ctx.error(inst, "clamp/omod on the division instructions are not modelled")


def _build_div_scale(inst, ctx):
    _check_plain(ctx, inst)
    g = _sources(ctx, inst)
    put, put_vcc = vwriter(ctx, inst, "f32"), lane_mask_writer(ctx, inst, inst.sdst)

    def run(w):
        d, vcc = div_scale_f32(g[0](w), g[1](w), g[2](w))
        put(w, d)
        put_vcc(w, vcc)
    return run


def _build_div_fmas(inst, ctx):
    _check_plain(ctx, inst)
    g = _sources(ctx, inst)
    vcc = lane_mask_reader(ctx, inst, D.VCC_LO)  # read implicitly
    put = vwriter(ctx, inst, "f32")
    err = ctx.error(inst, "v_div_fmas_f32 on a lane with VCC set (a quotient near the f32 range limits) "
                          "is not modelled: the ISA guides' 2**32 scaling is not what the hardware does")

    def run(w):
        if (vcc(w) & w.exec_mask).any():
            raise err
        put(w, div_fmas_f32(g[0](w), g[1](w), g[2](w)))
    return run


def _build_div_fixup(inst, ctx):
    _check_plain(ctx, inst)
    g = _sources(ctx, inst)
    put = vwriter(ctx, inst, "f32")
    return lambda w: put(w, div_fixup_f32(g[0](w), g[1](w), g[2](w)))


table.register({"v_div_scale_f32": _build_div_scale, "v_div_fmas_f32": _build_div_fmas,
                "v_div_fixup_f32": _build_div_fixup})
