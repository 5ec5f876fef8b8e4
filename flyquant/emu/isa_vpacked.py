"""Vector ALU, VOP3P packed math: two 16-bit or two 32-bit results per register (v_pk_*) and
the bf16 dot products, following the pseudocode of the CDNA3/CDNA4 ISA guides."""

from __future__ import annotations

import numpy as np

from . import decode as D
from . import table
from .isa_base import F16, F32, I16, I32, KINDS, U16, U32, is_inline, vsrc, vwriter, without_fp16_ovfl
from .isa_vmath import f16_exact, fma_f32, max_min, maximum3, minimum3


# --- VOP3P packed math ------------------------------------------------------------------------------
# name -> (kind, sources, fn); float16 arithmetic is computed exactly in binary64 (`f16_exact`)
_PK16 = {
    "v_pk_add_f16": ("f16", 2, f16_exact(lambda a, b: a + b)),
    "v_pk_mul_f16": ("f16", 2, f16_exact(lambda a, b: a * b)),
    "v_pk_fma_f16": ("f16", 3, f16_exact(lambda a, b, c: a * b + c)),
    "v_pk_max_f16": ("f16", 2, lambda a, b: max_min(np.asarray(a, F16), np.asarray(b, F16), True, True)),
    "v_pk_min_f16": ("f16", 2, lambda a, b: max_min(np.asarray(a, F16), np.asarray(b, F16), True, False)),
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
    op = _build_pk16_op(inst, ctx)
    return without_fp16_ovfl(ctx, inst, op) if _PK16[inst.name][0] == "f16" else op


def _build_pk16_op(inst, ctx):
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


table.register({
    **dict.fromkeys(_PK16, _build_pk16),
    **dict.fromkeys(("v_pk_add_f32", "v_pk_mul_f32", "v_pk_fma_f32", "v_pk_mov_b32"), _build_pk32),
    "v_dot2_f32_bf16": _build_dot2_bf16, "v_dot2c_f32_bf16": _build_dot2_bf16,
})
