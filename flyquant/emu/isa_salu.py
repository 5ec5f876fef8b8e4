"""Scalar instructions: SOP1, SOP2, SOPK, SOPC, SOPP (control flow, waits, barrier) and SMEM loads.

Scalar values are Python ints holding the unsigned bit pattern (32 or 64 bits); each
operation follows the instruction's pseudocode in the CDNA3/CDNA4 ISA guides, including
which operations set SCC and how (carry, borrow, signed overflow, "result != 0").
"""

from __future__ import annotations

import numpy as np

from . import decode as D
from . import table
from .isa_base import BARRIER, END, FULL_MASK, U32_MASK, const_operand, plain_sgpr, sext, sreader, swriter

M32, M64 = U32_MASK, FULL_MASK


def _s32(x: int) -> int:
    return sext(x, 32)


def _brev(x: int, bits: int) -> int:
    return int(format(x, f"0{bits}b")[::-1], 2)


def _ff1(x: int) -> int:
    """Index of the lowest set bit, -1 (as u32) if none."""
    return (x & -x).bit_length() - 1 & M32 if x else M32


def _flbit(x: int, bits: int) -> int:
    """Leading zeros counted from the MSB, -1 (as u32) if x == 0."""
    return bits - x.bit_length() if x else M32


def _flbit_signed(x: int, bits: int) -> int:
    """Bits equal to the sign bit after it, counted from the MSB; -1 if all bits are equal."""
    if x >> (bits - 1):
        x = ~x & ((1 << bits) - 1)
    return bits - x.bit_length() if x else M32


def _bfe_u(x: int, ctl: int, bits: int) -> int:
    off = ctl & (bits - 1)
    width = (ctl >> 16) & 0x7F
    return (x >> off) & ((1 << width) - 1) & ((1 << bits) - 1)


def _bfe_i(x: int, ctl: int, bits: int) -> int:
    """S_BFE_I32/I64: the signed S0 shifted right arithmetically (a field reaching past the top
    bit reads copies of the sign bit), masked to `width` bits, sign-extended from bit `width`."""
    width = (ctl >> 16) & 0x7F
    if width == 0:
        return 0
    v = (sext(x, bits) >> (ctl & (bits - 1))) & ((1 << width) - 1)
    return sext(v, min(width, bits)) & ((1 << bits) - 1)


# SOP2: name -> (operand bits, fn(a, b, scc) -> (result, new scc or None))
_SOP2 = {
    "s_add_u32": (32, lambda a, b, c: ((a + b) & M32, int(a + b > M32))),
    "s_sub_u32": (32, lambda a, b, c: ((a - b) & M32, int(b > a))),
    "s_add_i32": (32, lambda a, b, c: _add_i32(a, b)),
    "s_sub_i32": (32, lambda a, b, c: _sub_i32(a, b)),
    "s_addc_u32": (32, lambda a, b, c: ((a + b + c) & M32, int(a + b + c > M32))),
    "s_subb_u32": (32, lambda a, b, c: ((a - b - c) & M32, int(b + c > a))),
    "s_min_i32": (32, lambda a, b, c: (a, 1) if _s32(a) < _s32(b) else (b, 0)),
    "s_min_u32": (32, lambda a, b, c: (a, 1) if a < b else (b, 0)),
    "s_max_i32": (32, lambda a, b, c: (a, 1) if _s32(a) >= _s32(b) else (b, 0)),
    "s_max_u32": (32, lambda a, b, c: (a, 1) if a >= b else (b, 0)),
    "s_cselect_b32": (32, lambda a, b, c: (a if c else b, None)),
    "s_cselect_b64": (64, lambda a, b, c: (a if c else b, None)),
    "s_bfm_b32": (32, lambda a, b, c: ((((1 << (a & 31)) - 1) << (b & 31)) & M32, None)),
    "s_bfm_b64": (64, lambda a, b, c: ((((1 << (a & 63)) - 1) << (b & 63)) & M64, None)),
    "s_mul_i32": (32, lambda a, b, c: ((a * b) & M32, None)),
    "s_mul_hi_u32": (32, lambda a, b, c: ((a * b) >> 32, None)),
    "s_mul_hi_i32": (32, lambda a, b, c: ((_s32(a) * _s32(b)) >> 32 & M32, None)),
    "s_absdiff_i32": (32, lambda a, b, c: _nz(abs(_s32(a) - _s32(b)) & M32)),
    "s_pack_ll_b32_b16": (32, lambda a, b, c: ((a & 0xFFFF) | (b & 0xFFFF) << 16, None)),
    "s_pack_lh_b32_b16": (32, lambda a, b, c: ((a & 0xFFFF) | (b >> 16) << 16, None)),
    "s_pack_hh_b32_b16": (32, lambda a, b, c: ((a >> 16) | (b >> 16) << 16, None)),
}
for _n in (1, 2, 3, 4):
    _SOP2[f"s_lshl{_n}_add_u32"] = (32, lambda a, b, c, n=_n: (((a << n) + b) & M32, int((a << n) + b > M32)))
for _bits, _m in ((32, M32), (64, M64)):
    _sfx = f"b{_bits}"
    _SOP2.update({
        f"s_and_{_sfx}": (_bits, lambda a, b, c: _nz(a & b)),
        f"s_or_{_sfx}": (_bits, lambda a, b, c: _nz(a | b)),
        f"s_xor_{_sfx}": (_bits, lambda a, b, c: _nz(a ^ b)),
        f"s_andn2_{_sfx}": (_bits, lambda a, b, c, m=_m: _nz(a & ~b & m)),
        f"s_orn2_{_sfx}": (_bits, lambda a, b, c, m=_m: _nz((a | ~b) & m)),
        f"s_nand_{_sfx}": (_bits, lambda a, b, c, m=_m: _nz(~(a & b) & m)),
        f"s_nor_{_sfx}": (_bits, lambda a, b, c, m=_m: _nz(~(a | b) & m)),
        f"s_xnor_{_sfx}": (_bits, lambda a, b, c, m=_m: _nz(~(a ^ b) & m)),
        f"s_lshl_{_sfx}": (_bits, lambda a, b, c, n=_bits, m=_m: _nz((a << (b & (n - 1))) & m)),
        f"s_lshr_{_sfx}": (_bits, lambda a, b, c, n=_bits: _nz(a >> (b & (n - 1)))),
        f"s_ashr_i{_bits}": (_bits, lambda a, b, c, n=_bits, m=_m: _nz((sext(a, n) >> (b & (n - 1))) & m)),
        f"s_bfe_u{_bits}": (_bits, lambda a, b, c, n=_bits: _nz(_bfe_u(a, b, n))),
        f"s_bfe_i{_bits}": (_bits, lambda a, b, c, n=_bits: _nz(_bfe_i(a, b, n))),
    })
# Shift amounts and bitfield controls of 64-bit shifts/BFEs are 32-bit operands.
_SOP2_SRC1_32 = {"s_lshl_b64", "s_lshr_b64", "s_ashr_i64", "s_bfe_u64", "s_bfe_i64", "s_bfm_b64"}


def _nz(x: int):
    return x, int(x != 0)


def _add_i32(a: int, b: int):
    r = (a + b) & M32
    return r, int((a >> 31) == (b >> 31) and (a >> 31) != (r >> 31))


def _sub_i32(a: int, b: int):
    r = (a - b) & M32
    return r, int((a >> 31) != (b >> 31) and (a >> 31) != (r >> 31))


def _build_sop2(inst, ctx):
    bits, fn = _SOP2[inst.name]
    c0, c1, d = inst.f["ssrc0"], inst.f["ssrc1"], inst.f["sdst"]
    bits0 = 32 if inst.name == "s_bfm_b64" else bits
    bits1 = 32 if inst.name in _SOP2_SRC1_32 else bits
    if bits == 32 and plain_sgpr(d):  # fast paths: no reader/writer closures
        k0, k1 = const_operand(ctx, inst, c0), const_operand(ctx, inst, c1)
        if plain_sgpr(c0) and plain_sgpr(c1):
            def run_rr(w):
                s = w.s
                r, scc = fn(s[c0], s[c1], w.scc)
                s[d] = r
                if scc is not None:
                    w.scc = scc
            return run_rr
        if plain_sgpr(c0) and k1 is not None:
            def run_rk(w):
                s = w.s
                r, scc = fn(s[c0], k1, w.scc)
                s[d] = r
                if scc is not None:
                    w.scc = scc
            return run_rk
        if k0 is not None and plain_sgpr(c1):
            def run_kr(w):
                s = w.s
                r, scc = fn(k0, s[c1], w.scc)
                s[d] = r
                if scc is not None:
                    w.scc = scc
            return run_kr
    a = sreader(ctx, inst, c0, bits0)
    b = sreader(ctx, inst, c1, bits1)
    put = swriter(ctx, inst, d, bits)

    def run(w):
        r, scc = fn(a(w), b(w), w.scc)
        put(w, r)
        if scc is not None:
            w.scc = scc
    return run


# SOP1: name -> (source bits, destination bits, fn(a, scc) -> (result, new scc or None))
_SOP1 = {
    "s_mov_b32": (32, 32, lambda a, c: (a, None)),
    "s_mov_b64": (64, 64, lambda a, c: (a, None)),
    "s_not_b32": (32, 32, lambda a, c: _nz(~a & M32)),
    "s_not_b64": (64, 64, lambda a, c: _nz(~a & M64)),
    "s_brev_b32": (32, 32, lambda a, c: (_brev(a, 32), None)),
    "s_brev_b64": (64, 64, lambda a, c: (_brev(a, 64), None)),
    "s_bcnt0_i32_b32": (32, 32, lambda a, c: _nz(32 - a.bit_count())),
    "s_bcnt0_i32_b64": (64, 32, lambda a, c: _nz(64 - a.bit_count())),
    "s_bcnt1_i32_b32": (32, 32, lambda a, c: _nz(a.bit_count())),
    "s_bcnt1_i32_b64": (64, 32, lambda a, c: _nz(a.bit_count())),
    "s_ff0_i32_b32": (32, 32, lambda a, c: (_ff1(~a & M32), None)),
    "s_ff0_i32_b64": (64, 32, lambda a, c: (_ff1(~a & M64), None)),
    "s_ff1_i32_b32": (32, 32, lambda a, c: (_ff1(a), None)),
    "s_ff1_i32_b64": (64, 32, lambda a, c: (_ff1(a), None)),
    "s_flbit_i32_b32": (32, 32, lambda a, c: (_flbit(a, 32), None)),
    "s_flbit_i32_b64": (64, 32, lambda a, c: (_flbit(a, 64), None)),
    "s_flbit_i32": (32, 32, lambda a, c: (_flbit_signed(a, 32), None)),
    "s_flbit_i32_i64": (64, 32, lambda a, c: (_flbit_signed(a, 64), None)),
    "s_sext_i32_i8": (32, 32, lambda a, c: (sext(a, 8) & M32, None)),
    "s_sext_i32_i16": (32, 32, lambda a, c: (sext(a, 16) & M32, None)),
    "s_abs_i32": (32, 32, lambda a, c: _nz(abs(_s32(a)) & M32)),
    "s_quadmask_b32": (32, 32, lambda a, c: _nz(sum(1 << i for i in range(8) if a >> (4 * i) & 0xF))),
    "s_quadmask_b64": (64, 64, lambda a, c: _nz(sum(1 << i for i in range(16) if a >> (4 * i) & 0xF))),
    "s_wqm_b32": (32, 32, lambda a, c: _nz(sum(0xF << i for i in range(0, 32, 4) if a >> i & 0xF))),
    "s_wqm_b64": (64, 64, lambda a, c: _nz(sum(0xF << i for i in range(0, 64, 4) if a >> i & 0xF))),
}
# s_<op>_saveexec_b64: D = EXEC; EXEC = op(S0, EXEC); SCC = EXEC != 0
_SAVEEXEC = {
    "s_and_saveexec_b64": lambda s, e: s & e,
    "s_or_saveexec_b64": lambda s, e: s | e,
    "s_xor_saveexec_b64": lambda s, e: s ^ e,
    "s_andn2_saveexec_b64": lambda s, e: s & ~e,
    "s_orn2_saveexec_b64": lambda s, e: s | ~e,
    "s_nand_saveexec_b64": lambda s, e: ~(s & e),
    "s_nor_saveexec_b64": lambda s, e: ~(s | e),
    "s_xnor_saveexec_b64": lambda s, e: ~(s ^ e),
    "s_andn1_saveexec_b64": lambda s, e: ~s & e,
    "s_orn1_saveexec_b64": lambda s, e: ~s | e,
}


def _build_sop1(inst, ctx):
    name = inst.name
    if name in _SAVEEXEC:
        fn = _SAVEEXEC[name]
        a = sreader(ctx, inst, inst.f["ssrc0"], 64)
        put = swriter(ctx, inst, inst.f["sdst"], 64)

        def saveexec(w):
            s0 = a(w)
            old = w.exec_value()
            w.set_exec(fn(s0, old) & M64)
            put(w, old)
            w.scc = int(w.exec_value() != 0)
        return saveexec
    if name in ("s_andn1_wrexec_b64", "s_andn2_wrexec_b64"):
        a = sreader(ctx, inst, inst.f["ssrc0"], 64)
        put = swriter(ctx, inst, inst.f["sdst"], 64)
        invert_src = name == "s_andn1_wrexec_b64"

        def wrexec(w):
            s0, e = a(w), w.exec_value()
            new = (~s0 & e) if invert_src else (s0 & ~e)
            w.set_exec(new & M64)
            put(w, new & M64)
            w.scc = int(new & M64 != 0)
        return wrexec
    if name in ("s_cmov_b32", "s_cmov_b64"):
        bits = 32 if name.endswith("32") else 64
        a = sreader(ctx, inst, inst.f["ssrc0"], bits)
        put = swriter(ctx, inst, inst.f["sdst"], bits)

        def cmov(w):
            if w.scc:
                put(w, a(w))
        return cmov
    if name in ("s_bitset0_b32", "s_bitset1_b32", "s_bitset0_b64", "s_bitset1_b64"):
        bits = 32 if name.endswith("32") else 64
        a = sreader(ctx, inst, inst.f["ssrc0"], 32)
        get_d = sreader(ctx, inst, inst.f["sdst"], bits)
        put = swriter(ctx, inst, inst.f["sdst"], bits)
        one = name.startswith("s_bitset1")

        def bitset(w):
            bit = 1 << (a(w) & (bits - 1))
            d = get_d(w)
            put(w, d | bit if one else d & ~bit)
        return bitset
    if name not in _SOP1:
        return None
    sbits, dbits, fn = _SOP1[name]
    a = sreader(ctx, inst, inst.f["ssrc0"], sbits)
    put = swriter(ctx, inst, inst.f["sdst"], dbits)

    def run(w):
        r, scc = fn(a(w), w.scc)
        put(w, r)
        if scc is not None:
            w.scc = scc
    return run


# SOPC: name -> (bits, predicate)
_SOPC = {}
for _bits in (32, 64):
    for _op, _pred in (("eq", lambda a, b: a == b), ("lg", lambda a, b: a != b), ("gt", lambda a, b: a > b),
                       ("ge", lambda a, b: a >= b), ("lt", lambda a, b: a < b), ("le", lambda a, b: a <= b)):
        _SOPC[f"s_cmp_{_op}_u{_bits}"] = (_bits, _pred)
        _SOPC[f"s_cmp_{_op}_i{_bits}"] = (_bits, lambda a, b, p=_pred, n=_bits: p(sext(a, n), sext(b, n)))
_SOPC["s_bitcmp0_b32"] = (32, lambda a, b: not (a >> (b & 31)) & 1)
_SOPC["s_bitcmp1_b32"] = (32, lambda a, b: bool((a >> (b & 31)) & 1))
_SOPC["s_bitcmp0_b64"] = (64, lambda a, b: not (a >> (b & 63)) & 1)
_SOPC["s_bitcmp1_b64"] = (64, lambda a, b: bool((a >> (b & 63)) & 1))


def _build_sopc(inst, ctx):
    if inst.name not in _SOPC:
        return None
    bits, pred = _SOPC[inst.name]
    a = sreader(ctx, inst, inst.f["ssrc0"], bits)
    b = sreader(ctx, inst, inst.f["ssrc1"], 32 if inst.name.startswith("s_bitcmp") else bits)

    def run(w):
        w.scc = int(pred(a(w), b(w)))
    return run


def _build_sopk(inst, ctx):
    name, k = inst.name, inst.f["simm16"]
    ks = sext(k, 16) & M32
    sd = inst.f["sdst"]
    if name == "s_movk_i32":
        put = swriter(ctx, inst, sd)
        return lambda w: put(w, ks)
    if name == "s_cmovk_i32":
        put = swriter(ctx, inst, sd)

        def cmovk(w):
            if w.scc:
                put(w, ks)
        return cmovk
    get = sreader(ctx, inst, sd)
    put = swriter(ctx, inst, sd)
    if name.startswith("s_cmpk_"):
        op, signed = name[7:9], name.endswith("i32")
        pred = {"eq": lambda a, b: a == b, "lg": lambda a, b: a != b, "gt": lambda a, b: a > b,
                "ge": lambda a, b: a >= b, "lt": lambda a, b: a < b, "le": lambda a, b: a <= b}[op]
        kv = sext(k, 16) if signed else k

        def cmpk(w):
            a = get(w)
            w.scc = int(pred(_s32(a) if signed else a, kv))
        return cmpk
    if name == "s_addk_i32":
        def addk(w):
            r, w.scc = _add_i32(get(w), ks)
            put(w, r)
        return addk
    if name == "s_mulk_i32":
        return lambda w: put(w, (get(w) * ks) & M32)
    return None


# --- SOPP: control flow, waits, barrier -------------------------------------------------------------
_NOPS = {"s_nop", "s_waitcnt", "s_sleep", "s_setprio", "s_icache_inv", "s_incperflevel", "s_decperflevel",
         "s_ttracedata", "s_set_valu_coexec_mode", "s_wakeup"}


def _build_sopp(inst, ctx):
    name = inst.name
    if name in _NOPS:
        return lambda w: None
    if name == "s_endpgm":
        def endpgm(w):
            w.done = True
            return END
        return endpgm
    if name == "s_barrier":
        return lambda w: BARRIER
    if name.startswith(("s_branch", "s_cbranch_")):
        target = ctx.index_of(inst.addr + 4 + 4 * sext(inst.f["simm16"], 16))
        cond = {
            "s_branch": None,
            "s_cbranch_scc0": lambda w: not w.scc,
            "s_cbranch_scc1": lambda w: w.scc,
            "s_cbranch_vccz": lambda w: not (w.s[D.VCC_LO] or w.s[D.VCC_HI]),
            "s_cbranch_vccnz": lambda w: w.s[D.VCC_LO] or w.s[D.VCC_HI],
            "s_cbranch_execz": lambda w: not (w.s[D.EXEC_LO] or w.s[D.EXEC_HI]),
            "s_cbranch_execnz": lambda w: w.s[D.EXEC_LO] or w.s[D.EXEC_HI],
        }.get(name, False)
        if cond is False:
            return None
        if cond is None:
            return lambda w: target

        def branch(w):
            if cond(w):
                return target
            return None
        return branch
    return None


# --- SMEM ----------------------------------------------------------------------------------------
_SMEM_DWORDS = {"s_load_dword": 1, "s_load_dwordx2": 2, "s_load_dwordx4": 4, "s_load_dwordx8": 8,
                "s_load_dwordx16": 16, "s_buffer_load_dword": 1, "s_buffer_load_dwordx2": 2,
                "s_buffer_load_dwordx4": 4, "s_buffer_load_dwordx8": 8, "s_buffer_load_dwordx16": 16}
NUM_RECORDS_DWORD = 2  # dword 2 of a buffer resource descriptor


def _build_smem(inst, ctx):
    name, f = inst.name, inst.f
    if name in ("s_dcache_inv", "s_dcache_wb", "s_dcache_inv_vol", "s_dcache_wb_vol"):
        return lambda w: None
    if name not in _SMEM_DWORDS:
        return None
    n = _SMEM_DWORDS[name]
    sbase, sdata = f["sbase"] * 2, f["sdata"]
    if sdata + n > 102:
        raise ctx.error(inst, "scalar load into special registers is not supported")
    imm = sext(f["offset"], 21) if f["imm"] else 0
    soff = None
    if not f["imm"]:
        soff = sreader(ctx, inst, f["offset"] & 0x7F)
    elif f["soe"]:
        soff = sreader(ctx, inst, f["soffset"])
    is_buffer = name.startswith("s_buffer")

    def offset(w):
        return imm + (soff(w) if soff is not None else 0)

    if not is_buffer:
        def sload(w):
            addr = (w.sreg64(sbase) + offset(w)) & M64
            data = w.launch.memory.read(addr, 4 * n).view(np.uint32)
            w.s[sdata:sdata + n] = data.tolist()
        return sload

    def sbuffer_load(w):
        base = w.sreg64(sbase) & 0xFFFF_FFFF_FFFF
        num_records = w.s[sbase + NUM_RECORDS_DWORD]
        off = offset(w) & M32
        vals = []
        for i in range(n):  # dwords past num_records (bytes) read 0
            o = off + 4 * i
            vals.append(int(w.launch.memory.read(base + o, 4).view(np.uint32)[0]) if o + 4 <= num_records else 0)
        w.s[sdata:sdata + n] = vals
    return sbuffer_load


BUILDERS = {}
for _name in _SOP2:
    BUILDERS[_name] = _build_sop2
for _name in list(_SOP1) + list(_SAVEEXEC) + ["s_cmov_b32", "s_cmov_b64", "s_bitset0_b32", "s_bitset1_b32",
                                              "s_bitset0_b64", "s_bitset1_b64", "s_andn1_wrexec_b64",
                                              "s_andn2_wrexec_b64"]:
    BUILDERS[_name] = _build_sop1
for _name in _SOPC:
    BUILDERS[_name] = _build_sopc
for _name in ("s_movk_i32", "s_cmovk_i32", "s_addk_i32", "s_mulk_i32") + tuple(
        f"s_cmpk_{op}_{t}32" for op in ("eq", "lg", "gt", "ge", "lt", "le") for t in "iu"):
    BUILDERS[_name] = _build_sopk
for _name in list(_NOPS) + ["s_endpgm", "s_barrier", "s_branch", "s_cbranch_scc0", "s_cbranch_scc1",
                            "s_cbranch_vccz", "s_cbranch_vccnz", "s_cbranch_execz", "s_cbranch_execnz"]:
    BUILDERS[_name] = _build_sopp
for _name in list(_SMEM_DWORDS) + ["s_dcache_inv", "s_dcache_wb", "s_dcache_inv_vol", "s_dcache_wb_vol"]:
    BUILDERS[_name] = _build_smem
table.register(BUILDERS)
