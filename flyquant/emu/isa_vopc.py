"""Vector compares (VOPC, and their VOP3 forms): v_cmp_*/v_cmpx_* of floats and integers and
v_cmp_class, writing a lane mask (and EXEC for v_cmpx), as in the CDNA3/CDNA4 ISA guides."""

from __future__ import annotations

import numpy as np

from . import table
from .isa_base import F16, F32, F64, KINDS, U16, U32, U64, lane_mask_writer, mask_to_int
from .isa_valu import source, vectorize_first


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
    getters = vectorize_first(inst, [source(ctx, inst, i, kind, is_float and not (op == "class" and i == 1))
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


table.register({name: _build_vopc for name in _vopc_names()
                if name.rsplit("_", 1)[1] in ("f16", "f32", "f64", "i16", "u16", "i32", "u32", "i64", "u64")})
