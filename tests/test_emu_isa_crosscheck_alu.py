"""Randomized differential tests of flyquant.emu's ALU semantics against an independent
reference: the CDNA3/CDNA4 ISA guides' pseudocode transcribed per lane in plain Python
(tests/emu_xref.py and below), exact rational arithmetic for the float results, and IEEE 754
special-value rules. Operands mix random values with the special ones (signed zeros, Inf,
quiet and signalling NaNs of either sign, denormals, shift counts at and past the width).
"""

from __future__ import annotations

import math
from fractions import Fraction as Fr

import emu_xref as X
import numpy as np
import pytest
from test_emu_isa import run
from tinygrad.renderer.amd.dsl import s, v
from tinygrad.runtime.autogen.amd.cdna import ins as I

ARCHS = ("gfx942", "gfx950")
M32 = 0xFFFFFFFF
F32_SPECIALS = [0x00000000, 0x80000000, 0x3F800000, 0xBF800000, 0x7F800000, 0xFF800000, 0x7FC00000, 0xFFC00000,
                0x7FC12345, 0x7F800001, 0xFFA00000, 0x00000001, 0x807FFFFF, 0x7F7FFFFF, 0x40000000]


def rand_u32(rng, n=64):
    return rng.integers(0, 1 << 32, n, dtype=np.uint64).astype(np.uint32)


def f32_operands(rng, n=64):
    """Half specials, half random floats of moderate exponent (so that equal values occur)."""
    pick = rng.choice(np.array(F32_SPECIALS, np.uint32), n)
    small = np.float32(rng.integers(-4, 5, n)).view(np.uint32)
    rnd = rand_u32(rng, n)
    which = rng.integers(0, 3, n)
    return np.where(which == 0, pick, np.where(which == 1, small, rnd)).astype(np.uint32)


# --- f32 max / min / med3 with NaNs and signed zeros ---------------------------------------------------
@pytest.mark.parametrize("arch", ARCHS)
def test_f32_max_min_med3_follow_the_pseudocode(arch):
    rng = np.random.default_rng(3)
    for _ in range(8):
        a, b, c = f32_operands(rng), f32_operands(rng), f32_operands(rng)
        w, _ = run(arch, I.v_max_f32_e64(v[3], v[0], v[1]), I.v_min_f32_e64(v[4], v[0], v[1]),
                   I.v_max_f32_e32(v[5], v[1], v[0]), I.v_min_f32_e32(v[6], v[1], v[0]),
                   I.v_max3_f32_e64(v[7], v[0], v[1], v[2]), I.v_min3_f32_e64(v[8], v[0], v[1], v[2]),
                   I.v_med3_f32_e64(v[9], v[0], v[1], v[2]), vgpr={0: a, 1: b, 2: c})
        for lane in range(64):
            x, y, z = int(a[lane]), int(b[lane]), int(c[lane])
            want = [X.v_max_f32(x, y), X.v_min_f32(x, y), X.v_max_f32(y, x), X.v_min_f32(y, x),
                    X.v_max_f32(X.v_max_f32(x, y), z), X.v_min_f32(X.v_min_f32(x, y), z), X.v_med3_f32(x, y, z)]
            got = [int(w.v[r, lane]) for r in range(3, 10)]
            assert got == want, ([hex(t) for t in (x, y, z)], [hex(t) for t in got], [hex(t) for t in want])


# --- integer and bit-field operations ------------------------------------------------------------------
def _shift_counts(rng, n=64):
    """Random 32-bit values whose low 5 bits are often 0, 1, 31 (and bits above set)."""
    r = rand_u32(rng, n)
    edge = rng.choice(np.array([0, 1, 16, 31, 32, 33, 63, 0xFFFFFFFF, 0x80000000], np.uint32), n)
    return np.where(rng.integers(0, 2, n) == 0, r, edge).astype(np.uint32)


def _s32(x):
    return x - (1 << 32) if x >> 31 else x


def _u24(x):
    return x & 0xFFFFFF


def _med3(a, b, c):
    return sorted([a, b, c])[1]


# name -> (tinygrad builder, source kinds ('u' random, 's' shift/offset/width), reference on Python ints)
INT_OPS = {
    "v_bfe_u32": (I.v_bfe_u32_e64, "uss", lambda a, b, c: (a >> (b & 31)) & ((1 << (c & 31)) - 1)),
    "v_bfe_i32": (I.v_bfe_i32_e64, "uss", X.bfe_i32),
    "v_bfi_b32": (I.v_bfi_b32_e64, "uuu", lambda a, b, c: (a & b) | (~a & c)),
    "v_alignbit_b32": (I.v_alignbit_b32_e64, "uus", lambda a, b, c: ((a << 32 | b) >> (c & 31)) & M32),
    "v_alignbyte_b32": (I.v_alignbyte_b32_e64, "uus", lambda a, b, c: ((a << 32 | b) >> (8 * (c & 3))) & M32),
    "v_lshl_or_b32": (I.v_lshl_or_b32, "usu", lambda a, b, c: ((a << (b & 31)) | c) & M32),
    "v_and_or_b32": (I.v_and_or_b32, "uuu", lambda a, b, c: (a & b) | c),
    "v_or3_b32": (I.v_or3_b32, "uuu", lambda a, b, c: a | b | c),
    "v_add3_u32": (I.v_add3_u32_e64, "uuu", lambda a, b, c: (a + b + c) & M32),
    "v_lshl_add_u32": (I.v_lshl_add_u32_e64, "usu", lambda a, b, c: ((a << (b & 31)) + c) & M32),
    "v_add_lshl_u32": (I.v_add_lshl_u32_e64, "uus", lambda a, b, c: (((a + b) & M32) << (c & 31)) & M32),
    "v_xad_u32": (I.v_xad_u32_e64, "uuu", lambda a, b, c: ((a ^ b) + c) & M32),
    "v_mad_u32_u24": (I.v_mad_u32_u24_e64, "uuu", lambda a, b, c: (_u24(a) * _u24(b) + c) & M32),
    "v_med3_i32": (I.v_med3_i32_e64, "uuu", lambda a, b, c: _med3(_s32(a), _s32(b), _s32(c)) & M32),
    "v_med3_u32": (I.v_med3_u32_e64, "uuu", _med3),
    "v_min3_i32": (I.v_min3_i32_e64, "uuu", lambda a, b, c: min(_s32(a), _s32(b), _s32(c)) & M32),
    "v_max3_u32": (I.v_max3_u32_e64, "uuu", lambda a, b, c: max(a, b, c)),
    "v_mul_lo_u32": (I.v_mul_lo_u32, "uu", lambda a, b: (a * b) & M32),
    "v_mul_hi_u32": (I.v_mul_hi_u32, "uu", lambda a, b: (a * b) >> 32),
    "v_mul_hi_i32": (I.v_mul_hi_i32, "uu", lambda a, b: ((_s32(a) * _s32(b)) >> 32) & M32),
    "v_mul_u32_u24": (I.v_mul_u32_u24_e64, "uu", lambda a, b: (_u24(a) * _u24(b)) & M32),
    "v_mul_hi_u32_u24": (I.v_mul_hi_u32_u24_e64, "uu", lambda a, b: (_u24(a) * _u24(b)) >> 32),
    "v_lshlrev_b32": (I.v_lshlrev_b32_e64, "su", lambda a, b: (b << (a & 31)) & M32),
    "v_lshrrev_b32": (I.v_lshrrev_b32_e64, "su", lambda a, b: b >> (a & 31)),
    "v_ashrrev_i32": (I.v_ashrrev_i32_e64, "su", lambda a, b: (_s32(b) >> (a & 31)) & M32),
    "v_bcnt_u32_b32": (I.v_bcnt_u32_b32, "uu", lambda a, b: (bin(a).count("1") + b) & M32),
    "v_ffbh_u32": (I.v_ffbh_u32_e64, "u", X.ffbh_u32),
    "v_ffbl_b32": (I.v_ffbl_b32_e64, "u", X.ffbl_b32),
    "v_ffbh_i32": (I.v_ffbh_i32_e64, "u",
                   lambda a: M32 if a in (0, M32) else 32 - ((~a & M32) if a >> 31 else a).bit_length()),
    "v_bfrev_b32": (I.v_bfrev_b32_e64, "u", lambda a: int(f"{a:032b}"[::-1], 2)),
}


@pytest.mark.parametrize("name", sorted(INT_OPS))
def test_integer_op_follows_the_pseudocode(name):
    build, kinds, ref = INT_OPS[name]
    rng = np.random.default_rng(len(name) * 7919 + sum(map(ord, name)))
    for _ in range(4):
        srcs = [_shift_counts(rng) if k == "s" else rand_u32(rng) for k in kinds]
        if kinds == "u":  # leading/trailing-zero counts: values with few bits set, 0 and all ones
            edge = rng.choice(np.array([0, M32, 1, 0x80000000, 0x7FFFFFFF], np.uint32), 64)
            few = srcs[0] >> rng.integers(0, 32, 64).astype(np.uint32)
            srcs[0] = np.where(rng.integers(0, 2, 64) == 0, few, edge).astype(np.uint32)
        w, _ = run("gfx942", build(v[8], *[v[i] for i in range(len(kinds))]), vgpr=dict(enumerate(srcs)))
        for lane in range(64):
            ops = [int(x[lane]) for x in srcs]
            assert int(w.v[8, lane]) == ref(*ops) & M32, (name, [hex(o) for o in ops], hex(int(w.v[8, lane])))


# --- scalar ALU: results and SCC ------------------------------------------------------------------------
def _nz(r):
    return r & M32, int(r & M32 != 0)


def _bfe_i_scalar(a, ctl, bits=32):
    """S_BFE_I32/I64 pseudocode: arithmetic shift of S0, mask, sign-extend from bit `width`."""
    off, width = ctl & (bits - 1), ctl >> 16 & 0x7F
    sa = a - (1 << bits) if a >> (bits - 1) else a
    tmp = (sa >> off) & ((1 << width) - 1)
    if 0 < width and tmp >> (width - 1) & 1:
        tmp -= 1 << width
    return tmp & ((1 << bits) - 1)


SOP2 = {  # name -> reference (a, b, scc) -> (result, scc or None)
    "s_add_u32": lambda a, b, c: ((a + b) & M32, int(a + b >= 1 << 32)),
    "s_sub_u32": lambda a, b, c: ((a - b) & M32, int(b > a)),
    "s_addc_u32": lambda a, b, c: ((a + b + c) & M32, int(a + b + c >= 1 << 32)),
    "s_subb_u32": lambda a, b, c: ((a - b - c) & M32, int(b + c > a)),
    "s_add_i32": lambda a, b, c: ((a + b) & M32, int(a >> 31 == b >> 31 and a >> 31 != ((a + b) >> 31) & 1)),
    "s_sub_i32": lambda a, b, c: ((a - b) & M32, int(a >> 31 != b >> 31 and a >> 31 != ((a - b) >> 31) & 1)),
    "s_min_i32": lambda a, b, c: (a, 1) if _s32(a) < _s32(b) else (b, 0),
    "s_max_u32": lambda a, b, c: (a, 1) if a >= b else (b, 0),
    "s_cselect_b32": lambda a, b, c: (a if c else b, None),
    "s_and_b32": lambda a, b, c: _nz(a & b),
    "s_andn2_b32": lambda a, b, c: _nz(a & ~b),
    "s_xnor_b32": lambda a, b, c: _nz(~(a ^ b)),
    "s_lshl_b32": lambda a, b, c: _nz(a << (b & 31)),
    "s_lshr_b32": lambda a, b, c: _nz(a >> (b & 31)),
    "s_ashr_i32": lambda a, b, c: _nz(_s32(a) >> (b & 31)),
    "s_bfm_b32": lambda a, b, c: ((((1 << (a & 31)) - 1) << (b & 31)) & M32, None),
    "s_bfe_u32": lambda a, b, c: _nz((a >> (b & 31)) & ((1 << (b >> 16 & 0x7F)) - 1)),
    "s_bfe_i32": lambda a, b, c: _nz(_bfe_i_scalar(a, b)),
    "s_mul_i32": lambda a, b, c: ((a * b) & M32, None),
    "s_mul_hi_u32": lambda a, b, c: ((a * b) >> 32, None),
    "s_absdiff_i32": lambda a, b, c: _nz(abs(_s32(a) - _s32(b))),
    "s_lshl1_add_u32": lambda a, b, c: (((a << 1) + b) & M32, int((a << 1) + b >= 1 << 32)),
    "s_lshl2_add_u32": lambda a, b, c: (((a << 2) + b) & M32, int((a << 2) + b >= 1 << 32)),
    "s_pack_ll_b32_b16": lambda a, b, c: ((a & 0xFFFF) | (b & 0xFFFF) << 16, None),
}


@pytest.mark.parametrize("name", sorted(SOP2))
def test_sop2_result_and_scc_follow_the_pseudocode(name):
    rng = np.random.default_rng(sum(map(ord, name)))
    edges = [0, 1, 0x7FFFFFFF, 0x80000000, M32, 31, 32, 0x00080004, 0x00200008, 0x0008001C, 0x007F0000]
    for k in range(40):
        a = int(rng.choice(edges)) if k % 3 == 0 else int(rng.integers(0, 1 << 32))
        b = int(rng.choice(edges)) if k % 2 == 0 else int(rng.integers(0, 1 << 32))
        if name.startswith("s_bfe") and k % 4 == 1:
            b = int(rng.integers(0, 32)) | int(rng.integers(0, 40)) << 16
        scc_in = k & 1
        w, _ = run("gfx942", getattr(I, name)(s[2], s[0], s[1]), sgpr={0: a, 1: b}, scc=scc_in)
        res, scc = SOP2[name](a, b, scc_in)
        assert (w.s[2], w.scc) == (res & M32, scc_in if scc is None else scc), (name, hex(a), hex(b), scc_in)


# --- f32 arithmetic: exact rounding -------------------------------------------------------------------------
def _round32(value):
    return X.to_ieee(value, 8, 23)


def _ieee_op(op, xs):
    """Reference f32 result bits of + * fma on bit patterns: exact rational result rounded once;
    specials via binary64 (exact for these operations' special cases). NaN -> 'nan'."""
    vals = [X.exact(x) for x in xs]
    if any(isinstance(t, str) for t in vals):
        fl = [X.bits_f32(x) for x in xs]
        r = {"add": lambda a, b: a + b, "mul": lambda a, b: a * b, "fma": lambda a, b, c: a * b + c}[op](*fl) \
            if not (op == "fma" and math.isinf(fl[0] * fl[1]) and math.isinf(fl[2]) and
                    (fl[0] * fl[1] > 0) != (fl[2] > 0)) else math.nan
        return "nan" if math.isnan(r) else X.f32_bits(r)
    exact = {"add": lambda a, b: a + b, "mul": lambda a, b: a * b, "fma": lambda a, b, c: a * b + c}[op](*vals)
    bits = _round32(exact)
    if exact == 0:  # IEEE zero signs: x + (-x) = +0 (RNE); products by sign; fma by the sum rule
        if op == "mul":
            sign = (xs[0] ^ xs[1]) >> 31
        elif op == "add":
            sign = xs[0] >> 31 & xs[1] >> 31
        else:
            ps = (xs[0] ^ xs[1]) >> 31
            sign = ps & (xs[2] >> 31) if vals[0] * vals[1] == 0 and vals[2] == 0 else 0
        return bits | sign << 31
    return bits


@pytest.mark.parametrize("arch", ARCHS)
def test_f32_add_mul_fma_and_packed_forms_round_once(arch):
    # v_add/mul/fma_f32 and v_pk_{add,mul,fma}_f32 (both halves), denormals kept (FlyDSL's mode)
    rng = np.random.default_rng(5)
    for _ in range(4):
        ops = []
        for _ in range(6):
            x = f32_operands(rng)
            tiny = (rng.integers(0, 1 << 24, 64).astype(np.uint32) | (rng.integers(0, 2, 64).astype(np.uint32) << 31))
            ops.append(np.where(rng.integers(0, 4, 64) == 0, tiny, x).astype(np.uint32))
        a0, a1, b0, b1, c0, c1 = ops
        w, _ = run(arch, I.v_add_f32_e64(v[10], v[0], v[2]), I.v_mul_f32_e64(v[11], v[0], v[2]),
                   I.v_fma_f32_e64(v[12], v[0], v[2], v[4]), I.v_pk_add_f32(v[14:15], v[0:1], v[2:3]),
                   I.v_pk_mul_f32(v[16:17], v[0:1], v[2:3]), I.v_pk_fma_f32(v[18:19], v[0:1], v[2:3], v[4:5]),
                   vgpr={0: a0, 1: a1, 2: b0, 3: b1, 4: c0, 5: c1})
        for lane in range(64):
            x0, x1, y0, y1, z0, z1 = (int(t[lane]) for t in ops)
            cases = [(10, "add", (x0, y0)), (11, "mul", (x0, y0)), (12, "fma", (x0, y0, z0)),
                     (14, "add", (x0, y0)), (15, "add", (x1, y1)), (16, "mul", (x0, y0)), (17, "mul", (x1, y1)),
                     (18, "fma", (x0, y0, z0)), (19, "fma", (x1, y1, z1))]
            for row, op, xs in cases:
                got, want = int(w.v[row, lane]), _ieee_op(op, xs)
                if want == "nan":
                    assert X.is_nan_bits(got, 8, 23), (row, op, [hex(t) for t in xs], hex(got))
                else:
                    assert got == want, (row, op, [hex(t) for t in xs], hex(got), hex(want))


# --- f32 -> f16 / bf16 and int conversions -----------------------------------------------------------------
def test_f16_bf16_narrowing_round_once():
    # v_cvt_f16_f32 (RNE), v_cvt_pkrtz_f16_f32 (toward zero), gfx950 v_cvt_pk_f16_f32 / v_cvt_pk_bf16_f32
    rng = np.random.default_rng(9)
    for _ in range(6):
        e = rng.integers(100, 150, 64).astype(np.uint32)
        a = (e << 23 | rand_u32(rng) & 0x807FFFFF).astype(np.uint32)
        a[:len(F32_SPECIALS)] = F32_SPECIALS
        mids = [0x3F808000, 0x477FF000, 0x477FEFFF, 0x33000000, 0x33000001, 0x387FC000, 0x7F7FFFFF]
        a[len(F32_SPECIALS):len(F32_SPECIALS) + len(mids)] = mids  # bf16/f16 ties, f16 max/overflow, subnormals
        b = a[::-1].copy() ^ np.uint32(0x80000000)
        w, _ = run("gfx950", I.v_cvt_f16_f32_e32(v[2], v[0]), I.v_cvt_pkrtz_f16_f32(v[3], v[0], v[1]),
                   I.v_cvt_pk_f16_f32(v[4], v[0], v[1]), I.v_cvt_pk_bf16_f32(v[5], v[0], v[1]), vgpr={0: a, 1: b})
        for lane in range(64):
            x, y = int(a[lane]), int(b[lane])

            def ref(bits, ebits, mbits, rtz=False):
                val = X.exact(bits)
                if val == "nan":
                    return "nan"
                out = X.to_ieee(val, ebits, mbits, rtz)
                return out | (bits >> 31) << (ebits + mbits) if val == 0 else out
            checks = [(int(w.v[2, lane]), ref(x, 5, 10), 5, 10),
                      (int(w.v[3, lane]) & 0xFFFF, ref(x, 5, 10, True), 5, 10),
                      (int(w.v[3, lane]) >> 16, ref(y, 5, 10, True), 5, 10),
                      (int(w.v[4, lane]) & 0xFFFF, ref(x, 5, 10), 5, 10),
                      (int(w.v[4, lane]) >> 16, ref(y, 5, 10), 5, 10),
                      (int(w.v[5, lane]) & 0xFFFF, ref(x, 8, 7), 8, 7), (int(w.v[5, lane]) >> 16, ref(y, 8, 7), 8, 7)]
            for k, (got, want, eb, mb) in enumerate(checks):
                if want == "nan":
                    assert X.is_nan_bits(got, eb, mb), (k, hex(x), hex(y), hex(got))
                else:
                    assert got == want, (k, hex(x), hex(y), hex(got), hex(want))


def test_int_float_conversions_against_exact_values():
    # v_cvt_f32_i32/u32 round to nearest even; v_cvt_i32_f32/u32_f32 truncate and saturate, NaN -> 0
    rng = np.random.default_rng(13)
    for _ in range(4):
        ints = np.where(rng.integers(0, 2, 64) == 0, rand_u32(rng),
                        rand_u32(rng) >> rng.integers(0, 32, 64).astype(np.uint32)).astype(np.uint32)
        ints[:6] = [0, 1, M32, 0x80000000, 0x7FFFFFFF, 0x01000001]
        fl = np.concatenate([F32_SPECIALS, np.float32(rng.normal(0, 1e9, 64 - len(F32_SPECIALS))).view(np.uint32)])
        fl = fl.astype(np.uint32)
        w, _ = run("gfx942", I.v_cvt_f32_i32_e32(v[2], v[0]), I.v_cvt_f32_u32_e32(v[3], v[0]),
                   I.v_cvt_i32_f32_e32(v[4], v[1]), I.v_cvt_u32_f32_e32(v[5], v[1]), vgpr={0: ints, 1: fl})
        for lane in range(64):
            n, f = int(ints[lane]), int(fl[lane])
            assert int(w.v[2, lane]) == X.to_ieee(Fr(_s32(n)), 8, 23), hex(n)
            assert int(w.v[3, lane]) == X.to_ieee(Fr(n), 8, 23), hex(n)
            val = X.exact(f)
            if val == "nan":
                want_i = want_u = 0
            else:
                t = {"inf": 1 << 40, "-inf": -(1 << 40)}.get(val, None) if isinstance(val, str) else int(val)
                want_i = min(max(t, -(1 << 31)), (1 << 31) - 1) & M32
                want_u = min(max(t, 0), M32)
            assert (int(w.v[4, lane]), int(w.v[5, lane])) == (want_i, want_u), hex(f)


# --- regressions found by the tests above ----------------------------------------------------------------
@pytest.mark.parametrize("arch", ARCHS)
def test_v_max_min_f32_of_two_quiet_nans_is_s1(arch):
    # V_MAX_F32 / V_MIN_F32 pseudocode: "elsif isNAN(S0) then D0 = S1": with two quiet NaNs the
    # result is S1, bit for bit (the emulator returned NumPy's choice, S0, on 64-lane arrays)
    a = np.full(64, 0xFFC00000, np.uint32)
    b = np.full(64, 0x7FC00123, np.uint32)
    w, _ = run(arch, I.v_max_f32_e64(v[2], v[0], v[1]), I.v_min_f32_e64(v[3], v[0], v[1]),
               I.v_max3_f32_e64(v[4], v[0], v[1], v[1]), I.v_med3_f32_e64(v[5], v[0], v[1], v[0]),
               vgpr={0: a, 1: b})
    # max3(a, b, b) = max(max(a, b), b) = max(b, b) = b; med3 with a NaN = min3(a, b, a) = min(b, a) = a
    assert (w.v[2] == 0x7FC00123).all() and (w.v[3] == 0x7FC00123).all()
    assert (w.v[4] == 0x7FC00123).all() and (w.v[5] == 0xFFC00000).all()


@pytest.mark.parametrize("arch", ARCHS)
def test_signed_bitfield_extract_past_bit_31_reads_the_sign(arch):
    # V_BFE_I32 / S_BFE_I32 pseudocode: tmp = (S0.i32 >> offset) & mask is an arithmetic shift,
    # so a field reaching past bit 31 reads copies of the sign bit. 0x80000000, offset 28,
    # width 8: tmp = 0xFFFFFFF8 & 0xFF = 0xF8, sign-extended from bit 8: -8 (the emulator
    # shifted logically: 0x08 -> +8). S_BFE_I64 alike: 0x8000000000000000, offset 60, width 8.
    w, _ = run(arch, I.v_bfe_i32_e64(v[1], v[0], v[2], v[3]), I.s_bfe_i32(s[2], s[0], s[1]),
               I.s_bfe_i64(s[4:5], s[6:7], s[8]),
               vgpr={0: 0x80000000, 2: 28, 3: 8}, sgpr={0: 0x80000000, 1: 8 << 16 | 28, 6: 0, 7: 0x80000000,
                                                        8: 8 << 16 | 60})
    assert (w.v[1] == 0xFFFFFFF8).all() and w.s[2] == 0xFFFFFFF8 and (w.s[4], w.s[5]) == (0xFFFFFFF8, M32)


# --- transcendentals: IEEE special values and the guides' 1 ULP -------------------------------------------
def _ulp_distance(a: int, b: int) -> int:
    """Distance in representable f32 steps (same-sign ordering of the bit patterns)."""
    def key(x):
        return -(x & 0x7FFFFFFF) if x >> 31 else x
    return abs(key(a) - key(b))


TRANS = {  # name -> (builder, reference in binary64 on a finite/special float, input exponent range)
    # v_exp_f32 inputs |x| < 64: normal results
    "v_exp_f32": (I.v_exp_f32_e32, lambda x: 2.0 ** x if x < 1024 else math.inf, (118, 133)),
    "v_log_f32": (I.v_log_f32_e32, lambda x: (-math.inf if x == 0 else math.nan if x < 0 else
                                              math.inf if x == math.inf else math.log2(x)), (1, 254)),
    "v_rcp_f32": (I.v_rcp_f32_e32, lambda x: math.copysign(math.inf, x) if x == 0 else 1.0 / x, (2, 252)),
    "v_sqrt_f32": (I.v_sqrt_f32_e32, lambda x: math.nan if x < 0 else math.sqrt(x) if x != math.inf else x,
                   (1, 254)),
    "v_rsq_f32": (I.v_rsq_f32_e32, lambda x: (math.copysign(math.inf, x) if x == 0 else math.nan if x < 0 else
                                              0.0 if x == math.inf else 1.0 / math.sqrt(x)), (1, 254)),
}
TRANS_SPECIALS = [0x00000000, 0x80000000, 0x7F800000, 0xFF800000, 0x7FC00000, 0x3F800000, 0xBF800000, 0x40800000]


@pytest.mark.parametrize("name", sorted(TRANS))
def test_transcendental_special_values_and_one_ulp(name):
    # The guides define D = 2**S0, log2(S0), 1/S0, sqrt(S0), 1/sqrt(S0) "with 1 ULP accuracy";
    # special values as IEEE 754 (exp2(-inf) = +0, log2(+-0) = -inf, rcp(-0) = -inf, sqrt(-0) = -0,
    # NaN in -> NaN). Normal inputs and results only: the hardware's denormal handling of these
    # instructions is not in the guides (LLVM's AMDGPUUsage says the f32 v_exp/v_log do not
    # natively support denormals; the emulator computes them exactly), so it is not checked here.
    build, ref, (elo, ehi) = TRANS[name]
    rng = np.random.default_rng(sum(map(ord, name)))
    e = rng.integers(elo, ehi, 64).astype(np.uint32)
    x = (e << 23 | rand_u32(rng) & 0x807FFFFF).astype(np.uint32)
    if name in ("v_log_f32", "v_sqrt_f32", "v_rsq_f32"):
        x &= np.uint32(0x7FFFFFFF)
    x[:len(TRANS_SPECIALS)] = TRANS_SPECIALS
    w, _ = run("gfx950", build(v[1], v[0]), vgpr={0: x})
    for lane in range(64):
        xi, got = int(x[lane]), int(w.v[1, lane])
        xf = X.bits_f32(xi)
        r = math.nan if math.isnan(xf) else ref(xf)
        if math.isnan(r):
            assert X.is_nan_bits(got, 8, 23), (name, hex(xi), hex(got))
            continue
        want = X.f32_bits(float(np.float32(r))) if math.isfinite(r) else X.f32_bits(r)
        if name == "v_sqrt_f32" and xi == 0x80000000:
            want = 0x80000000
        if want & 0x7FFFFFFF in (0, 0x7F800000) or lane < len(TRANS_SPECIALS):
            assert got == want, (name, hex(xi), hex(got), hex(want))
        else:
            assert _ulp_distance(got, want) <= 1, (name, hex(xi), hex(got), hex(want))


def _maximum_f32(a: int, b: int):
    """IEEE 754-2019 maximum (V_MAXIMUM3_F32 applies it twice): a NaN operand gives a NaN
    ('nan': its payload is not checked), +0 > -0."""
    if X.is_nan_bits(a, 8, 23) or X.is_nan_bits(b, 8, 23):
        return "nan"
    if {a, b} == {0, 0x80000000}:
        return 0
    return a if X.bits_f32(a) >= X.bits_f32(b) else b


def test_v_maximum3_f32_and_v_cvt_f32_f16():
    # gfx950 v_maximum3_f32 = maximum(maximum(S0, S1), S2); v_cvt_f32_f16 of every f16 code is
    # its exact value (NaN codes: a NaN)
    rng = np.random.default_rng(43)
    for _ in range(6):
        a, b, c = f32_operands(rng), f32_operands(rng), f32_operands(rng)
        w, _ = run("gfx950", I.v_maximum3_f32(v[3], v[0], v[1], v[2]), vgpr={0: a, 1: b, 2: c})
        for lane in range(64):
            m = _maximum_f32(int(a[lane]), int(b[lane]))
            want = "nan" if m == "nan" else _maximum_f32(m, int(c[lane]))
            got = int(w.v[3, lane])
            assert (X.is_nan_bits(got, 8, 23) if want == "nan" else got == want), \
                ([hex(int(t[lane])) for t in (a, b, c)], hex(got))
    want = {}
    for h in range(1 << 16):
        val = X.exact(h, 5, 10)
        want[h] = "nan" if val == "nan" else X.to_ieee(val, 8, 23) | (h >> 15) << 31
    codes = np.arange(1 << 16, dtype=np.uint32).reshape(-1, 16, 64)  # 16 registers of 64 lanes per run
    for block in codes:
        w, _ = run("gfx942", *[I.v_cvt_f32_f16_e32(v[16 + r], v[r]) for r in range(16)], vgpr=dict(enumerate(block)))
        for r in range(16):
            for lane in range(64):
                h, got = int(block[r, lane]), int(w.v[16 + r, lane])
                assert (X.is_nan_bits(got, 8, 23) if want[h] == "nan" else got == want[h]), (hex(h), hex(got))


# --- gfx942 MFMAs the kernels use: register layouts from AMD's matrix instruction calculator -------------
@pytest.mark.parametrize("name,k,per_lane", [("v_mfma_f32_16x16x16_bf16", 16, 4),
                                             ("v_mfma_f32_16x16x32_fp8_fp8", 32, 8)])
def test_gfx942_mfma_layout_of_amds_calculator(name, k, per_lane):
    # ROCm/amd_matrix_instruction_calculator (-a CDNA3 -i <name> -A/-B/-D --matrix-layout) gives
    # A[i][kk] in lane i + 16 * (kk // E), element kk % E of the lane's registers (E = per_lane,
    # little-endian), B[kk][j] in lane j + 16 * (kk // E) likewise, D[i][j] in lane
    # j + 16 * (i // 4), register i % 4. With those, the MFMA is A @ B + C (exact here: the
    # products and sums of these small values are exact in binary32).
    import torch
    rng = np.random.default_rng(k)
    if per_lane == 4:
        a = torch.from_numpy(rng.integers(-8, 9, (16, k)).astype(np.float32)).bfloat16()
        b = torch.from_numpy(rng.integers(-8, 9, (k, 16)).astype(np.float32)).bfloat16()
        abits, bbits = (t.view(torch.int16).numpy().astype(np.uint16).astype(np.uint32) for t in (a, b))
    else:
        a = torch.from_numpy(rng.integers(-8, 9, (16, k)).astype(np.float32)).to(torch.float8_e4m3fnuz)
        b = torch.from_numpy(rng.integers(-8, 9, (k, 16)).astype(np.float32)).to(torch.float8_e4m3fnuz)
        abits, bbits = (t.view(torch.uint8).numpy().astype(np.uint32) for t in (a, b))
    bits = 64 // per_lane  # element bits: A and B are 2 registers per lane
    regs = {r: np.zeros(64, np.uint32) for r in range(4)}
    for lane in range(64):
        row, grp = lane % 16, lane // 16
        for e in range(per_lane):
            kk = per_lane * grp + e
            regs[e * bits // 32][lane] |= np.uint32(int(abits[row, kk]) << (e * bits % 32))
            regs[2 + e * bits // 32][lane] |= np.uint32(int(bbits[kk, row]) << (e * bits % 32))
    c = rng.integers(-100, 100, (16, 16)).astype(np.float32)
    for r in range(4):
        regs[8 + r] = np.array([c[4 * (lane // 16) + r, lane % 16] for lane in range(64)], np.float32).view(np.uint32)
    w, _ = run("gfx942", getattr(I, name)(v[8:11], v[0:1], v[2:3], v[8:11]), vgpr=regs)
    want = a.float().numpy() @ b.float().numpy() + c
    got = np.zeros((16, 16), np.float32)
    for lane in range(64):
        for r in range(4):
            got[4 * (lane // 16) + r, lane % 16] = w.v[8 + r, lane].view(np.float32)
    assert np.array_equal(got, want)
