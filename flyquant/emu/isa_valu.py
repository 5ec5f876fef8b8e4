"""Vector ALU: VOP1/VOP2/VOP3/VOP3SD (non-MFMA, non-packed) arithmetic, with their modifiers.

Every instruction is vectorised over the 64 lanes with NumPy and follows the pseudocode of the
CDNA3/CDNA4 ISA guides (the per-lane functions and tables are in `isa_vmath`). The generic
builder `build_vop` resolves, once per instruction:
- sources: VGPR rows, SGPRs/constants/literals as NumPy scalars of the operand type, 16-bit
  halves chosen by op_sel, SDWA byte/word selects, the DPP lane permutation of src0;
- input modifiers: abs/neg on float operands (sign-bit operations, so NaN payloads survive);
- output modifiers: omod (x2, x4, /2), clamp (floats to [0, 1], NaN -> 0; integers saturate),
  the SDWA destination select, the f32 denormal flush requested by the kernel descriptor
  (FlyDSL kernels ask for none: f32 denormals are kept);
- the EXEC-masked write.
"""

from __future__ import annotations

import numpy as np

from . import decode as D
from . import table
from .isa_base import (F32, I32, I64, KINDS, U16, U32, U64, kind_bits, lane_mask_reader, lane_mask_writer, vsrc,
                       vwriter, vwriter_masked, without_fp16_ovfl)
from .isa_lane import DppSource
from .isa_vmath import IEEE_OPS, OPS, OPSEL_16, fma_f32

SIGN32 = U32(0x80000000)
SDWA_DWORD = 6
SDWA_UNUSED_PAD, SDWA_UNUSED_SEXT, SDWA_UNUSED_PRESERVE = 0, 1, 2
OMOD_SCALE = {1: 2.0, 2: 4.0, 3: 0.5}


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


def source(ctx, inst, i, kind, is_float):
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


def vectorize_first(inst, getters, kinds):
    """If no source is a VGPR, make source 0 a full 64-lane array (results stay per lane, in the
    operand's dtype, instead of becoming NumPy scalars)."""
    if not any(code is not None and code >= D.VGPR_BASE for code in inst.src[:len(kinds)]):
        getters[0] = (lambda w, g=getters[0], dtype=KINDS[kinds[0]][0]: np.full(64, g(w), dtype))
    return getters


def build_vop(inst, ctx, dst, srcs, fn, is_float=False, sat=None):
    """Closure for a VALU instruction D = fn(S0, S1, ...) with all modifiers (see module doc)."""
    op = _build_vop(inst, ctx, dst, srcs, fn, is_float, sat)
    return without_fp16_ovfl(ctx, inst, op) if dst == "f16" else op


def _build_vop(inst, ctx, dst, srcs, fn, is_float, sat):
    if inst.dpp is not None and kind_bits(dst) != 32:
        raise ctx.error(inst, "DPP on a non-32-bit instruction")
    getters = [source(ctx, inst, i, k, is_float) for i, k in enumerate(srcs)]
    if ctx.flush_f32_in and is_float:
        getters = [(lambda w, g=g: _flush_f32(g(w))) if k == "f32" else g for g, k in zip(getters, srcs)]
    vectorize_first(inst, getters, srcs)
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


def vop_builders(unary: dict, binary: dict) -> dict:
    """Builders for tables of simple instructions: `unary` name -> (dst kind, src kind, fn), a
    float instruction when either kind is; `binary` name -> (dst kind, (src kinds), fn), integer."""
    out = {}
    for name, (dst, src, fn) in unary.items():
        is_float = dst.startswith("f") or src.startswith("f")
        out[name] = (lambda i, c, dst=dst, src=src, fn=fn, f=is_float: build_vop(i, c, dst, (src,), fn, f))
    for name, (dst, srcs, fn) in binary.items():
        out[name] = (lambda i, c, dst=dst, srcs=srcs, fn=fn: build_vop(i, c, dst, srcs, fn))
    return out


def _build_ieee(inst, ctx):
    nsrc, fn = IEEE_OPS[inst.name]
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
    """v_cndmask_b32: D = VCC[lane] ? S1 : S0 (VOP3: the lane mask in S2). The SDWA form (VOP2)
    selects a byte/word of each source (zero- or sign-extended) and writes D through dst_sel /
    dst_unused, as every SDWA instruction (CDNA3/CDNA4 ISA guides, "SDWA")."""
    if inst.dpp is not None:
        raise ctx.error(inst, "DPP v_cndmask_b32 is not supported")
    cond = lane_mask_reader(ctx, inst, inst.src[2])
    if inst.sdwa is not None:
        if inst.abs or inst.neg:
            raise ctx.error(inst, "abs/neg on SDWA v_cndmask_b32 is not supported")
        a, b = source(ctx, inst, 0, "u32", False), source(ctx, inst, 1, "u32", False)
        put = _sdwa_dst(ctx, inst, "u32", inst.vdst)
    else:
        a, b = _bits_source(ctx, inst, 0), _bits_source(ctx, inst, 1)
        put = vwriter(ctx, inst, "u32")
    return lambda w: put(w, np.where(cond(w), b(w), a(w)))


def _build_carry(inst, ctx):
    """v_add/sub/subrev_co_u32 (carry out) and v_addc/subb/subbrev_co_u32 (carry in and out)."""
    if inst.dpp is not None or inst.sdwa is not None:
        raise ctx.error(inst, "DPP/SDWA carry instructions are not supported")
    name = inst.name
    a, b = vectorize_first(inst, [vsrc(ctx, inst, 0, "u32"), vsrc(ctx, inst, 1, "u32")], ("u32", "u32"))
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
    a, b, c = vectorize_first(inst, [vsrc(ctx, inst, i, kind) for i, kind in enumerate(kinds)], kinds)
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


table.register({
    **dict.fromkeys(OPS, _build_table),
    **dict.fromkeys(IEEE_OPS, _build_ieee),
    "v_fmamk_f32": _build_fmamk, "v_fmaak_f32": _build_fmamk,
    "v_cndmask_b32": _build_cndmask,
    "v_add_co_u32": _build_carry, "v_sub_co_u32": _build_carry, "v_subrev_co_u32": _build_carry,
    "v_addc_co_u32": _build_carry, "v_subb_co_u32": _build_carry, "v_subbrev_co_u32": _build_carry,
    "v_mad_u64_u32": _build_mad64, "v_mad_i64_i32": _build_mad64,
    "v_bitop3_b32": _build_bitop3, "v_bitop3_b16": _build_bitop3,
    "v_nop": lambda inst, ctx: (lambda w: None),
})
