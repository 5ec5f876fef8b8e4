"""Randomized differential tests of the packed 16-bit, compare, lane (DPP, permlane), scalar, LDS
and buffer instructions the flyquant kernels execute, against the CDNA3/CDNA4 ISA guides'
pseudocode and definitions transcribed per lane (tinygrad/runtime/autogen/amd/cdna/str_pcode.py),
exact rounding (tests/emu_xref.py) and byte models of memory.
"""

from __future__ import annotations

from fractions import Fraction as Fr

import emu_xref as X
import numpy as np
import pytest
from test_emu_isa import run
from tinygrad.renderer.amd.dsl import DPP, SDWA, VCC, s, v
from tinygrad.runtime.autogen.amd.cdna import ins as I

from flyquant.emu.errors import EmuError
from flyquant.emu.memory import Memory

M32, M16 = 0xFFFFFFFF, 0xFFFF
F16_SPECIALS = [0x0000, 0x8000, 0x3C00, 0xBC00, 0x7C00, 0xFC00, 0x7E00, 0xFE00, 0x7D00, 0x0001, 0x83FF, 0x7BFF,
                0xFBFF, 0x0400]


def rand_u32(rng, n=64):
    return rng.integers(0, 1 << 32, n, dtype=np.uint64).astype(np.uint32)


def f16_words(rng, n=64):
    """Two f16 halves per lane: specials, small integers (so equal values occur) and random bits."""
    def halves():
        pick = rng.choice(np.array(F16_SPECIALS, np.uint32), n)
        small = np.float16(rng.integers(-3, 4, n)).view(np.uint16).astype(np.uint32)
        which = rng.integers(0, 3, n)
        return np.where(which == 0, pick, np.where(which == 1, small, rng.integers(0, 1 << 16, n).astype(np.uint32)))
    return (halves() | halves() << 16).astype(np.uint32)


def _nan16(h):
    return X.is_nan_bits(h, 5, 10)


def _val16(h):
    return float(np.array([h], np.uint16).view(np.float16)[0])


def min_f16(a, b):
    """V_MIN_F16 pseudocode (IEEE mode): sNaN quieted (S0 first), one NaN dropped, both -> S1,
    min(+0, -0) = -0."""
    if _nan16(a) and not a >> 9 & 1:
        return a | 0x200
    if _nan16(b) and not b >> 9 & 1:
        return b | 0x200
    if _nan16(a):
        return b
    if _nan16(b):
        return a
    if {a, b} == {0, 0x8000}:
        return 0x8000
    return a if _val16(a) < _val16(b) else b


def maximum_f16(a, b):
    """IEEE 754-2019 maximum: a NaN operand gives a NaN (payload not checked: 'nan'), +0 > -0."""
    if _nan16(a) or _nan16(b):
        return "nan"
    if {a, b} == {0, 0x8000}:
        return 0
    return a if _val16(a) >= _val16(b) else b


def round16(value, sign_if_zero):
    if isinstance(value, str):
        return value
    bits = X.to_ieee(value, 5, 10)
    return bits | (0x8000 if value == 0 and sign_if_zero else 0)


def fma16(a, b, c):
    """fma on f16 bit patterns, one rounding; specials through binary64 (exact for them)."""
    xa, xb, xc = (X.exact(t, 5, 10) for t in (a, b, c))
    if any(isinstance(t, str) for t in (xa, xb, xc)):
        fa, fb, fc = (_val16(t) for t in (a, b, c))
        prod = fa * fb if not ((fa == 0 and np.isinf(fb)) or (fb == 0 and np.isinf(fa))) else float("nan")
        r = prod + fc if not (np.isinf(prod) and np.isinf(fc) and (prod > 0) != (fc > 0)) else float("nan")
        return "nan" if r != r else X.to_ieee("inf" if r > 0 else "-inf", 5, 10) if np.isinf(r) else \
            round16(Fr(r), False)
    exact = xa * xb + xc
    if exact == 0:
        ps = (a ^ b) >> 15 & 1
        neg = ps & (c >> 15) if xa * xb == 0 and xc == 0 else 0
        return 0x8000 if neg else 0
    return round16(exact, False)


def mul16(a, b):
    return fma16(a, b, 0x8000)  # x * y + (-0) is x * y exactly, zero signs included


@pytest.mark.parametrize("arch", ["gfx942", "gfx950"])
def test_packed_f16_fma_mul_min_follow_the_pseudocode(arch):
    rng = np.random.default_rng(17)
    for _ in range(6):
        a, b, c = f16_words(rng), f16_words(rng), f16_words(rng)
        insts = [I.v_pk_fma_f16(v[4], v[0], v[1], v[2], opsel_hi=3, opsel_hi2=1),
                 I.v_pk_mul_f16(v[5], v[0], v[1], opsel_hi=3), I.v_pk_min_f16(v[6], v[0], v[1], opsel_hi=3)]
        if arch == "gfx950":
            insts.append(I.v_pk_maximum3_f16(v[7], v[0], v[1], v[2], opsel_hi=3, opsel_hi2=1))
        w, _ = run(arch, *insts, vgpr={0: a, 1: b, 2: c})
        for lane in range(64):
            for h in (0, 1):
                x, y, z = ((int(t[lane]) >> (16 * h)) & M16 for t in (a, b, c))
                cases = [(4, fma16(x, y, z)), (5, mul16(x, y)), (6, min_f16(x, y))]
                if arch == "gfx950":
                    m = maximum_f16(x, y)
                    cases.append((7, "nan" if m == "nan" else maximum_f16(m, z)))
                for row, want in cases:
                    got = (int(w.v[row, lane]) >> (16 * h)) & M16
                    if want == "nan":
                        assert _nan16(got), (row, h, hex(x), hex(y), hex(z), hex(got))
                    else:
                        assert got == want, (row, h, hex(x), hex(y), hex(z), hex(got), hex(want))


PK_U16 = {  # name -> per-half reference (s0 half, s1 half, whole s0 for the shift count)
    "v_pk_add_u16": lambda a, b: (a + b) & M16,
    "v_pk_sub_u16": lambda a, b: (a - b) & M16,
    "v_pk_max_u16": max,
    "v_pk_lshlrev_b16": lambda a, b: (b << (a & 15)) & M16,
    "v_pk_lshrrev_b16": lambda a, b: b >> (a & 15),
}


@pytest.mark.parametrize("name", sorted(PK_U16))
def test_packed_u16_ops_follow_the_pseudocode(name):
    # the shifts take the count from bits 3:0 (low half) and 19:16 (high half) of S0
    rng = np.random.default_rng(len(name))
    a, b = rand_u32(rng), rand_u32(rng)
    a[:4] = [0x000F0010, 0x00100000, 0xFFFFFFFF, 0]
    w, _ = run("gfx950", getattr(I, name)(v[2], v[0], v[1], opsel_hi=3), vgpr={0: a, 1: b})
    for lane in range(64):
        for h in (0, 1):
            x, y = (int(a[lane]) >> (16 * h)) & M16, (int(b[lane]) >> (16 * h)) & M16
            assert (int(w.v[2, lane]) >> (16 * h)) & M16 == PK_U16[name](x, y), (name, hex(int(a[lane])), hex(y))


def class_f16(h, mask):
    """V_CMP_CLASS_F16 pseudocode."""
    e, m, neg = h >> 10 & 31, h & 0x3FF, h >> 15
    if e == 31 and m:
        bit = 1 if m >> 9 else 0
    elif e == 31:
        bit = 2 if neg else 9
    elif e:
        bit = 3 if neg else 8
    elif m:
        bit = 4 if neg else 7
    else:
        bit = 5 if neg else 6
    return mask >> bit & 1


def test_compares_follow_the_pseudocode():
    # v_cmp_class_f16 (every class bit), v_cmp_o_f32 / v_cmp_u_f32 (ordered / unordered),
    # v_cmp_lt_u16 / v_cmp_ne_u16 (low halves only); lanes with EXEC off read 0
    rng = np.random.default_rng(23)
    for _ in range(4):
        h = f16_words(rng) & np.uint32(M16)
        mask = rng.integers(0, 1 << 10, 64).astype(np.uint32)
        fa = np.where(rng.integers(0, 3, 64) == 0, np.uint32(0x7FC00000), rand_u32(rng)).astype(np.uint32)
        fb = np.where(rng.integers(0, 3, 64) == 0, np.uint32(0xFF800001), rand_u32(rng)).astype(np.uint32)
        ua, ub = rand_u32(rng), rand_u32(rng)
        ub[:8] = ua[:8] ^ np.uint32(0xFFFF0000)  # equal low halves
        ex = int(rng.integers(0, 1 << 63)) | 1
        w, _ = run("gfx950", I.v_cmp_class_f16_e64(s[0:1], v[0], v[1]), I.v_cmp_o_f32_e64(s[2:3], v[2], v[3]),
                   I.v_cmp_u_f32_e64(s[4:5], v[2], v[3]), I.v_cmp_lt_u16_e64(s[6:7], v[4], v[5]),
                   I.v_cmp_ne_u16_e64(s[8:9], v[4], v[5]), vgpr={0: h, 1: mask, 2: fa, 3: fb, 4: ua, 5: ub},
                   exec_mask=ex)
        def unordered(i):
            return X.is_nan_bits(int(fa[i]), 8, 23) or X.is_nan_bits(int(fb[i]), 8, 23)
        for k, fn in enumerate([lambda i: class_f16(int(h[i]), int(mask[i])),
                                lambda i: int(not unordered(i)), lambda i: int(unordered(i)),
                                lambda i: int((int(ua[i]) & M16) < (int(ub[i]) & M16)),
                                lambda i: int((int(ua[i]) & M16) != (int(ub[i]) & M16))]):
            want = sum(fn(i) << i for i in range(64) if ex >> i & 1)
            assert w.s[2 * k] | w.s[2 * k + 1] << 32 == want, k


def _s24(x):
    x &= 0xFFFFFF
    return x - (1 << 24) if x >> 23 else x


def test_mad_and_64bit_integer_ops_follow_the_pseudocode():
    # v_mad_i32_i24 (S0.i24 * S1.i24 + S2.i32), v_mad_u64_u32 ({carry, D} = S0 * S1 + S2.u64),
    # v_lshl_add_u64 ((S0.u64 << S1[2:0]) + S2.u64), v_mbcnt_lo/hi (set bits of the SGPR mask
    # S0 below the lane, plus S1)
    rng = np.random.default_rng(29)
    for _ in range(4):
        a, b, c, d, e = (rand_u32(rng) for _ in range(5))
        mlo, mhi = (int(t) for t in rand_u32(rng, 2))
        b[:4] = [0, 1, 4, 7]
        w, _ = run("gfx942", I.v_mad_i32_i24_e64(v[10], v[0], v[1], v[2]),
                   I.v_mad_u64_u32(v[12:13], s[20:21], v[0], v[1], v[2:3]),
                   I.v_lshl_add_u64(v[14:15], v[3:4], v[1], v[4:5]),
                   I.v_mbcnt_lo_u32_b32(v[16], s[10], v[2]), I.v_mbcnt_hi_u32_b32(v[17], s[11], v[16]),
                   vgpr={0: a, 1: b, 2: c, 3: d, 4: e, 5: a ^ d}, sgpr={10: mlo, 11: mhi})
        carry = 0
        for lane in range(64):
            x, y, z, p, q, r = (int(t[lane]) for t in (a, b, c, d, e, a ^ d))
            assert int(w.v[10, lane]) == (_s24(x) * _s24(y) + (z - (1 << 32) if z >> 31 else z)) & M32
            full = x * y + (z | p << 32)
            assert int(w.v[12, lane]) | int(w.v[13, lane]) << 32 == full & ((1 << 64) - 1)
            carry |= (full >> 64) << lane
            shifted = ((p | q << 32) << (y & 7)) + (q | r << 32)
            assert int(w.v[14, lane]) | int(w.v[15, lane]) << 32 == shifted & ((1 << 64) - 1), lane
            lo = bin(mlo & ((1 << min(lane, 32)) - 1)).count("1") + z
            assert int(w.v[16, lane]) == lo & M32
            hi = bin(mhi & ((1 << max(lane - 32, 0)) - 1)).count("1") + lo
            assert int(w.v[17, lane]) == hi & M32, lane
        assert w.s[20] | w.s[21] << 32 == carry


@pytest.mark.parametrize("kind", ["b32", "b16"])
def test_v_bitop3_every_table_follows_the_pseudocode(kind):
    # V_BITOP3: TTBL = {OMOD[1:0], ABS[2:0], NEG[2:0]}; bit i of TTBL selects the minterm with
    # S0 = i[2], S1 = i[1], S2 = i[0]
    rng = np.random.default_rng(31)
    a, b, c = rand_u32(rng), rand_u32(rng), rand_u32(rng)
    width = 32 if kind == "b32" else 16
    for ttbl in list(range(0, 256, 7)) + [0xFF, 0x96, 0xE8]:
        inst = getattr(I, f"v_bitop3_{kind}")(v[3], v[0], v[1], v[2], omod=ttbl >> 6, abs=ttbl >> 3 & 7, neg=ttbl & 7)
        w, _ = run("gfx950", inst, vgpr={0: a, 1: b, 2: c, 3: 0})
        for lane in range(0, 64, 5):
            x, y, z = (int(t[lane]) & ((1 << width) - 1) for t in (a, b, c))
            want = 0
            for bit in range(width):
                i = (x >> bit & 1) << 2 | (y >> bit & 1) << 1 | (z >> bit & 1)
                want |= (ttbl >> i & 1) << bit
            assert int(w.v[3, lane]) & ((1 << width) - 1) == want, (hex(ttbl), lane)


def test_permlane_swaps_follow_the_pseudocode():
    # v_permlane16_swap: in each 32-lane half, lanes 0..15 of SRC0 swap with lanes 16..31 of VDST;
    # v_permlane32_swap: lanes 0..31 of SRC0 swap with lanes 32..63 of VDST
    rng = np.random.default_rng(37)
    x, y = rand_u32(rng), rand_u32(rng)
    for name in ("v_permlane16_swap_b32_e32", "v_permlane32_swap_b32_e32"):
        w, _ = run("gfx950", getattr(I, name)(v[0], v[1]), vgpr={0: y, 1: x})  # VDST v0, SRC0 v1
        vd, s0 = y.copy(), x.copy()
        span = 16 if "16" in name else 32
        for base in ((0, 32) if span == 16 else (0,)):
            for lane in range(span):
                lo, hi = base + lane, base + lane + span
                s0[lo], vd[hi] = vd[hi], s0[lo]
        assert np.array_equal(w.v[0], vd) and np.array_equal(w.v[1], s0), name


SOP = {  # (builder, sources, reference (a, b) -> (D, SCC or None))
    "s_brev_b32": (lambda: I.s_brev_b32(s[2], s[0]), lambda a, b: (int(f"{a:032b}"[::-1], 2), None)),
    "s_bcnt1_i32_b32": (lambda: I.s_bcnt1_i32_b32(s[2], s[0]), lambda a, b: (bin(a).count("1"), int(a != 0))),
    "s_bcnt1_i32_b64": (lambda: I.s_bcnt1_i32_b64(s[2], s[0:1]),
                        lambda a, b: (bin(a | b << 32).count("1"), int((a | b << 32) != 0))),
    "s_ff1_i32_b64": (lambda: I.s_ff1_i32_b64(s[2], s[0:1]),
                      lambda a, b: (X.ffbl_b32(a) if a else (X.ffbl_b32(b) + 32 if b else M32), None)),
    "s_not_b32": (lambda: I.s_not_b32(s[2], s[0]), lambda a, b: (~a & M32, int(~a & M32 != 0))),
    "s_bitcmp0_b32": (lambda: I.s_bitcmp0_b32(s[0], s[1]), lambda a, b: (None, int(not a >> (b & 31) & 1))),
    "s_bitcmp1_b32": (lambda: I.s_bitcmp1_b32(s[0], s[1]), lambda a, b: (None, a >> (b & 31) & 1)),
    "s_mul_hi_i32": (lambda: I.s_mul_hi_i32(s[2], s[0], s[1]),
                     lambda a, b: (((a - (a >> 31 << 32)) * (b - (b >> 31 << 32)) >> 32) & M32, None)),
}


@pytest.mark.parametrize("name", sorted(SOP))
def test_scalar_ops_follow_the_pseudocode(name):
    build, ref = SOP[name]
    rng = np.random.default_rng(len(name) * 31)
    for k in range(24):
        a, b = (int(x) for x in rand_u32(rng, 2))
        if k % 3 == 0:
            a >>= int(rng.integers(0, 32))
            b = b >> int(rng.integers(0, 32)) if k % 2 else 0
        if k == 1:
            a, b = 0, 0
        w, _ = run("gfx942", build(), sgpr={0: a, 1: b, 2: 0xDEAD}, scc=k & 1)
        d, scc = ref(a, b)
        if d is not None:
            assert w.s[2] == d & M32, (name, hex(a), hex(b), hex(w.s[2]))
        assert w.scc == (k & 1 if scc is None else scc), (name, hex(a), hex(b))


def test_sopk_addk_mulk_and_saveexec():
    # S_ADDK_I32: D += signext(simm16), SCC = signed overflow; S_MULK_I32: D *= signext(simm16);
    # S_AND/ANDN2_SAVEEXEC_B64: D = EXEC; EXEC = S0 & EXEC / S0 & ~EXEC; SCC = EXEC != 0
    for d0, k in ((0x7FFFFFFF, 1), (0x80000000, 0xFFFF), (5, 0x8000), (0xFFFFFFFE, 3)):
        w, _ = run("gfx942", I.s_addk_i32(s[0], simm16=k), I.s_mulk_i32(s[1], simm16=k), sgpr={0: d0, 1: d0})
        kk = k - (1 << 16) if k >> 15 else k
        r = (d0 + kk) & M32
        assert w.s[0] == r and w.scc == int(d0 >> 31 == (kk < 0) and d0 >> 31 != r >> 31), (hex(d0), k)
        assert w.s[1] == ((d0 - (d0 >> 31 << 32)) * kk) & M32
    ex, src = 0x00FF00FF0000FFFF, 0x0F0F0F0F0F0F0F0F
    for name, new in (("s_and_saveexec_b64", src & ex), ("s_andn2_saveexec_b64", src & ~ex & (1 << 64) - 1)):
        w, _ = run("gfx942", getattr(I, name)(s[2:3], s[0:1]), sgpr={0: src & M32, 1: src >> 32}, exec_mask=ex)
        assert (w.s[2] | w.s[3] << 32, w.exec_value(), w.scc) == (ex, new, int(new != 0)), name


# --- DPP: every control the kernels use (and the other GFX9 ones), with masks and bound_ctrl -----------
def _dpp_source(ctrl: int, lane: int):
    """(source lane, exists) for a GFX9 DPP control, from the guides' DPP_CTRL list: quad_perm
    selects within the quad; row_shl:n reads lane + n of the row, row_shr:n lane - n, row_ror:n
    (lane - n) mod 16; wave_shl1 / wave_rol1 lane + 1, wave_shr1 / wave_ror1 lane - 1 (rotations
    wrap); row_mirror 15 - i, row_half_mirror 7 - i in each half row; row_bcast:15 lane 15 of
    the previous row (rows 1..3), row_bcast:31 lane 31 (rows 2, 3)."""
    row, i = lane & ~15, lane & 15
    n = ctrl & 15
    if ctrl <= 0xFF:
        return (lane & ~3) + (ctrl >> (2 * (lane & 3)) & 3), True
    if 0x101 <= ctrl <= 0x10F:
        return row + i + n, i + n < 16
    if 0x111 <= ctrl <= 0x11F:
        return row + i - n, i - n >= 0
    if 0x121 <= ctrl <= 0x12F:
        return row + (i - n) % 16, True
    return {0x130: ((lane + 1) % 64, lane < 63), 0x134: ((lane + 1) % 64, True), 0x138: ((lane - 1) % 64, lane > 0),
            0x13C: ((lane - 1) % 64, True), 0x140: (row + 15 - i, True), 0x141: (row + (i & 8) + 7 - (i & 7), True),
            0x142: (row - 1, lane >= 16), 0x143: (31, lane >= 32)}[ctrl]


DPP_CTRLS = [0xB1, 0x4E, 0x1B, 0xE4, 0x101, 0x108, 0x111, 0x11F, 0x124, 0x128, 0x12C, 0x130, 0x134, 0x138, 0x13C,
             0x140, 0x141, 0x142, 0x143]


@pytest.mark.parametrize("ctrl", DPP_CTRLS, ids=[hex(c) for c in DPP_CTRLS])
def test_dpp_controls_masks_and_bound_ctrl(ctrl):
    # v_mov_b32_dpp over random row/bank masks, bound_ctrl on/off and partial EXEC: a lane is
    # written iff its row and bank are enabled and EXEC is on, and then, if its source lane
    # exists and has EXEC on, it reads that lane; otherwise it reads 0 with bound_ctrl, else it
    # is not written (GFX9 DPP rules for an invalid source lane)
    rng = np.random.default_rng(ctrl)
    src = rand_u32(rng)
    for row_mask, bank_mask, bc in ((0xF, 0xF, 0), (0xF, 0xF, 1), (int(rng.integers(1, 16)), 0xC, 0),
                                    (0xA, int(rng.integers(1, 16)), 1), (0xF, 0x3, 0), (0xF, 0x5, 1)):
        ex = int(rng.integers(0, 1 << 63)) << 1 | 1 if bc else (1 << 64) - 1
        inst = I.VOP1_DPP16(I.VOP1Op.V_MOV_B32_E32, vdst=v[1], src0=DPP, vsrc0=v[0], dpp=ctrl, row_mask=row_mask,
                            bank_mask=bank_mask, bc=bc)
        w, _ = run("gfx942", inst, vgpr={0: src, 1: 0x5EED}, exec_mask=ex)
        for lane in range(64):
            s_lane, exists = _dpp_source(ctrl, lane)
            enabled = row_mask >> (lane // 16) & 1 and bank_mask >> (lane % 16 // 4) & 1 and ex >> lane & 1
            valid = exists and ex >> s_lane & 1
            want = 0x5EED if not enabled else int(src[s_lane]) if valid else 0 if bc else 0x5EED
            assert int(w.v[1, lane]) == want, (hex(ctrl), row_mask, bank_mask, bc, lane)


# --- LDS: the DS forms the kernels use, against a byte model of the pseudocode's addresses ---------------
def test_ds_forms_against_a_byte_model():
    # ds_write2_b64 / ds_read2_b64 (ADDR + OFFSETn * 8), ds_write2st64_b32 / ds_read2st64_b32
    # (ADDR + OFFSETn * 256), ds_write_b128 / ds_read_b128 and ds_write_b16[_d16_hi] (ADDR +
    # {OFFSET1, OFFSET0}), ds_read2_b32 (ADDR + OFFSETn * 4): random distinct lane addresses,
    # random offsets, EXEC with lanes off (they neither write nor read)
    rng = np.random.default_rng(47)
    size = 1 << 16
    for rep in range(3):
        lds = np.zeros(size, np.uint8)
        ex = int(rng.integers(0, 1 << 64, dtype=np.uint64)) | 1
        on = [bool(ex >> lane & 1) for lane in range(64)]
        slots = rng.permutation(64).astype(np.uint32)
        a64 = slots * 32  # region 0..2047 (+ offsets * 8 < 2048)
        a_st = 8192 + slots * 4  # region 8192 + 256 * offset
        a128 = 40960 + slots * 16
        a16 = 50000 + slots * 4
        o0, o1 = int(rng.integers(0, 2)), int(rng.integers(2, 4))  # b64 slots: 8 * o within the lane's 32 bytes
        s0, s1 = int(rng.integers(0, 6)), int(rng.integers(6, 12))  # st64: 256 * s within 8192..11264 + 256
        off128 = int(rng.integers(0, 64)) * 16
        d = [rand_u32(rng) for _ in range(10)]
        insts = [I.ds_write2_b64(addr=v[0], data0=v[10:11], data1=v[12:13], offset0=o0, offset1=o1),
                 I.ds_write2st64_b32(addr=v[1], data0=v[14], data1=v[15], offset0=s0, offset1=s1),
                 I.ds_write_b128(addr=v[2], data0=v[16:19], offset0=off128 & 0xFF, offset1=off128 >> 8),
                 I.ds_write_b16(addr=v[3], data0=v[10], offset0=0, offset1=0),
                 I.ds_write_b16_d16_hi(addr=v[3], data0=v[11], offset0=2, offset1=0),
                 I.ds_read2_b64(vdst=v[20:23], addr=v[0], offset0=o0, offset1=o1),
                 I.ds_read2st64_b32(vdst=v[24:25], addr=v[1], offset0=s0, offset1=s1),
                 I.ds_read_b128(vdst=v[26:29], addr=v[2], offset0=off128 & 0xFF, offset1=off128 >> 8),
                 I.ds_read_b32(vdst=v[30], addr=v[3], offset0=0, offset1=0),
                 I.ds_read2_b32(vdst=v[32:33], addr=v[0], offset0=2 * o0 + 1, offset1=2 * o1)]
        vg = {0: a64, 1: a_st, 2: a128, 3: a16, **{10 + k: d[k] for k in range(10)}}
        vg.update({r: np.full(64, 0xDEADBEEF, np.uint32) for r in range(20, 34)})
        w, _ = run("gfx942", *insts, vgpr=vg, lds=size, exec_mask=ex)

        def put(addr, val, n):
            lds[addr:addr + n] = np.frombuffer(int(val).to_bytes(n, "little"), np.uint8)

        def get(addr, n):
            return int.from_bytes(lds[addr:addr + n].tobytes(), "little")
        for lane in range(64):
            if not on[lane]:
                continue
            dd = [int(x[lane]) for x in d]
            put(int(a64[lane]) + 8 * o0, dd[0] | dd[1] << 32, 8)
            put(int(a64[lane]) + 8 * o1, dd[2] | dd[3] << 32, 8)
            put(int(a_st[lane]) + 256 * s0, dd[4], 4)
            put(int(a_st[lane]) + 256 * s1, dd[5], 4)
            put(int(a128[lane]) + off128, dd[6] | dd[7] << 32 | dd[8] << 64 | dd[9] << 96, 16)
            put(int(a16[lane]), dd[0] & M16, 2)
            put(int(a16[lane]) + 2, dd[1] >> 16, 2)
        assert np.array_equal(w.wg.lds, lds), rep
        for lane in range(64):
            got = [int(w.v[r, lane]) for r in range(20, 34) if r != 31]
            if not on[lane]:
                assert all(g == 0xDEADBEEF for g in got), lane
                continue
            b64, st, b128, b16 = int(a64[lane]), int(a_st[lane]), int(a128[lane]) + off128, int(a16[lane])
            want = [get(b64 + 8 * o0, 4), get(b64 + 8 * o0 + 4, 4), get(b64 + 8 * o1, 4), get(b64 + 8 * o1 + 4, 4),
                    get(st + 256 * s0, 4), get(st + 256 * s1, 4),
                    get(b128, 4), get(b128 + 4, 4), get(b128 + 8, 4), get(b128 + 12, 4), get(b16, 4),
                    get(b64 + 4 * (2 * o0 + 1), 4), get(b64 + 8 * o1, 4)]
            assert got == want, (rep, lane)


# --- buffer range checking ------------------------------------------------------------------------------
def _buffer_sgprs(base: int, num_records: int, soffset: int) -> dict:
    """A raw buffer resource in s[4:7] (stride 0, FlyDSL's flags) and the SGPR offset in s8."""
    return {4: base & M32, 5: (base >> 32) & 0xFFFF, 6: num_records, 7: (7 << 12) | (4 << 15), 8: soffset}


BUFFER_LOADS = {"buffer_load_dword": (4, 1), "buffer_load_dwordx2": (8, 2), "buffer_load_dwordx4": (16, 4),
                "buffer_load_ubyte": (1, 1), "buffer_load_ushort": (2, 1)}


def _readings(voff, inst_offset: int, soffset: int, num_records: int, width: int, ndw: int):
    """Per lane and dword: (in range by the ISA guides' check, by gfx950 hardware's; flyquant.emu.
    isa_mem's docstring): VGPR + instruction offset unsigned and unwrapped, against num_records;
    or wrapped at 32 bits plus the SGPR offset. DWORDxN check each dword on its own (AMDGPUUsage
    "Relaxed Buffer OOB Mode": 32-bit words checked independently), sub-dword accesses whole."""
    off = voff.astype(np.uint64) + inst_offset
    ends = np.arange(1, ndw + 1, dtype=np.uint64) * width
    guide = off[:, None] + ends <= num_records
    hardware = (off & M32)[:, None] + soffset + ends <= num_records
    return guide, hardware


@pytest.mark.parametrize("name", sorted(BUFFER_LOADS))
@pytest.mark.parametrize("arch", ["gfx942", "gfx950"])
def test_buffer_loads_range_check(arch, name):
    # Raw buffer (stride 0) loads near the end of the range, far past it (0x80000000) and where
    # VGPR + instruction offset wraps at 32 bits (0xFFFFFFF0 + up to 39): out-of-range dwords read
    # 0 where the two readings of the check agree (_readings), and the launch stops (EmuError)
    # where they do not. Even trials have no SGPR offset (only a wrap can make them disagree),
    # odd ones a random one (lanes at the end disagree).
    nbytes, ndw = BUFFER_LOADS[name]
    width = min(nbytes, 4)
    rng = np.random.default_rng(nbytes * 7 + len(name))
    outcomes = set()
    for trial in range(6):
        num_records = int(rng.integers(64, 400))
        soffset = int(rng.integers(1, 64)) * 4 if trial % 2 else 0
        inst_offset = int(rng.integers(0, 40))
        data = rng.integers(0, 256, num_records + soffset + 128, dtype=np.uint8)
        near = num_records - inst_offset - int(nbytes) + rng.integers(-12, 12, 64)
        far = np.array([0x80000000, 0] + ([0xFFFFFFF0] if trial % 4 == 2 else []), np.uint64)
        voff = np.where(rng.integers(0, 8, 64) == 0, rng.choice(far, 64), np.maximum(near, 0)).astype(np.uint32)
        vd = v[2:2 + ndw - 1] if ndw > 1 else v[2]
        inst = getattr(I, name)(vdata=vd, vaddr=v[0], srsrc=s[4:7], soffset=s[8], offen=1, offset=inst_offset)
        args = dict(sgpr=_buffer_sgprs(data.ctypes.data, num_records, soffset),
                    vgpr={0: voff, **{2 + k: 0xA5A5A5A5 for k in range(ndw)}}, memory=Memory())
        guide, hardware = _readings(voff, inst_offset, soffset, num_records, width, ndw)
        if not np.array_equal(guide, hardware):
            outcomes.add("error")
            with pytest.raises(EmuError, match="in range by one reading"):
                run(arch, inst, **args)
            continue
        outcomes.add("values")
        w, _ = run(arch, inst, **args)
        for lane in range(64):
            for c in range(ndw):
                at = soffset + int(voff[lane]) + inst_offset + width * c
                want = int.from_bytes(data[at:at + width].tobytes(), "little") if guide[lane, c] else 0
                assert int(w.v[2 + c, lane]) == want, (name, lane, hex(int(voff[lane])), c, num_records)
    assert outcomes == {"error", "values"}


@pytest.mark.parametrize("arch", ["gfx942", "gfx950"])
def test_buffer_stores_range_check(arch):
    # The same rule for stores: where the readings agree an out-of-range dword (DWORDxN) or a whole
    # sub-dword store is dropped; lanes write distinct 16-byte slots, so their order does not
    # matter. With an SGPR offset the last lanes' readings disagree: EmuError, nothing written
    rng = np.random.default_rng(53)
    for name, nbytes, ndw in (("buffer_store_dwordx4", 16, 4), ("buffer_store_dwordx2", 8, 2),
                              ("buffer_store_dword", 4, 1), ("buffer_store_short", 2, 1), ("buffer_store_byte", 1, 1)):
        width = min(nbytes, 4)
        num_records = int(rng.integers(300, 1000))
        inst_offset = int(rng.integers(0, 5)) * 4
        voff = (np.arange(64) * 16 + rng.integers(0, 16 - nbytes + 1, 64) // width * width).astype(np.uint32)
        vals = [rand_u32(rng) for _ in range(ndw)]
        vd = v[2:2 + ndw - 1] if ndw > 1 else v[2]
        inst = getattr(I, name)(vdata=vd, vaddr=v[0], srsrc=s[4:7], soffset=s[8], offen=1, offset=inst_offset)
        for soffset in (0, int(rng.integers(1, 16)) * 4):
            data = np.zeros(num_records + soffset + 1200, np.uint8)
            args = dict(sgpr=_buffer_sgprs(data.ctypes.data, num_records, soffset),
                        vgpr={0: voff, **{2 + k: vals[k] for k in range(ndw)}}, memory=Memory())
            guide, hardware = _readings(voff, inst_offset, soffset, num_records, width, ndw)
            if soffset:
                assert not np.array_equal(guide, hardware)
                with pytest.raises(EmuError, match="in range by one reading"):
                    run(arch, inst, **args)
                assert not data.any(), name
                continue
            run(arch, inst, **args)
            want = np.zeros_like(data)
            for lane in range(64):
                for c in range(ndw):
                    if guide[lane, c]:
                        at = int(voff[lane]) + inst_offset + width * c
                        want[at:at + width] = np.frombuffer(int(vals[c][lane]).to_bytes(4, "little")[:width], np.uint8)
            assert np.array_equal(data, want), name


def test_sopk_compares_extend_the_immediate_by_signedness():
    # S_CMPK_*_I32 sign-extend SIMM16, S_CMPK_*_U32 zero-extend it; S_MOVK_I32 sign-extends;
    # S_CMP_EQ/LG_U64 compare 64 bits; S_CSELECT_B64 picks by SCC
    def s32(x):
        return x - (1 << 32) if x >> 31 else x

    for d0 in (0, 5, 0x7FFF, 0x8000, 0xFFFF, 0xFFFF8000, 0xFFFFFFFF, 0x80000000, 0x12345):
        for k in (0, 5, 0x7FFF, 0x8000, 0xFFFF):
            ks = k - (1 << 16) if k >> 15 else k
            for name, want in (("s_cmpk_gt_i32", s32(d0) > ks), ("s_cmpk_lt_i32", s32(d0) < ks),
                               ("s_cmpk_gt_u32", d0 > k), ("s_cmpk_lt_u32", d0 < k)):
                w, _ = run("gfx942", getattr(I, name)(s[0], simm16=k), sgpr={0: d0})
                assert w.scc == int(want), (name, hex(d0), hex(k))
        w, _ = run("gfx942", I.s_movk_i32(s[1], simm16=d0 & M16))
        assert w.s[1] == (d0 & M16) - (1 << 16 if d0 >> 15 & 1 else 0) & M32
    for lo, hi, lo2, hi2 in ((1, 0, 1, 1), (7, 9, 7, 9), (0, 0, 0, 0), (0, 1, 0, 0)):
        w, _ = run("gfx942", I.s_cmp_lg_u64(s[0:1], s[2:3]), I.s_cselect_b64(s[4:5], s[0:1], s[2:3]),
                   sgpr={0: lo, 1: hi, 2: lo2, 3: hi2})
        differ = (lo, hi) != (lo2, hi2)
        assert w.scc == int(differ) and (w.s[4], w.s[5]) == ((lo, hi) if differ else (lo2, hi2))


# --- the SDWA forms and clamp / abs / neg modifiers the kernels' code objects use ---------------------------
def test_sdwa_and_modifier_forms_the_kernels_use():
    # SDWA src_sel: BYTE0..3 = 0..3, WORD0/1 = 4/5, DWORD = 6 (zero-extended, no sext here); a
    # 16-bit op takes the low 16 bits of a DWORD select. Integer clamp saturates (unsigned for
    # _u32 / _u16). Forms as they occur in the MX, GEMM and sorting kernels' code objects.
    rng = np.random.default_rng(59)
    a, b, m = rand_u32(rng), rand_u32(rng), rng.integers(0, 1 << 10, 64).astype(np.uint32)
    b[:16] = a[:16] & np.uint32(0xFFFF)  # equal words: compares and saturation edges
    c = f16_words(rng)
    insts = [
        I.VOP2_SDWA(I.VOP2Op.V_ADD_U32_E32, vdst=v[10], src0=SDWA, vsrc0=v[0], vsrc1=v[1], dst_sel=6, dst_unused=0,
                    src0_sel=3, src1_sel=6),
        I.VOP2_SDWA(I.VOP2Op.V_MAX_U32_E32, vdst=v[11], src0=SDWA, vsrc0=v[0], vsrc1=v[1], dst_sel=6, dst_unused=0,
                    src0_sel=4, src1_sel=5),
        I.VOP2_SDWA(I.VOP2Op.V_SUB_U32_E32, vdst=v[12], src0=SDWA, vsrc0=v[0], vsrc1=v[1], dst_sel=6, dst_unused=0,
                    src0_sel=5, src1_sel=6, clmp=1),
        I.VOP1_SDWA(I.VOP1Op.V_CVT_F32_F16_E32, vdst=v[13], src0=SDWA, vsrc0=v[2], dst_sel=6, dst_unused=0, src0_sel=5),
        I.VOPC_SDWA_SDST(I.VOPCOp.V_CMP_GT_U32_E32, src0=SDWA, vsrc0=v[0], vsrc1=v[1], sdst=s[20], sd=1, src0_sel=4,
                         src1_sel=6),
        I.VOPC_SDWA_SDST(I.VOPCOp.V_CMP_LT_U16_E32, src0=SDWA, vsrc0=v[0], vsrc1=v[1], sdst=VCC, sd=0, src0_sel=0,
                         src1_sel=6),
        I.VOPC_SDWA_SDST(I.VOPCOp.V_CMP_CLASS_F16_E32, src0=SDWA, vsrc0=v[2], vsrc1=v[3], sdst=s[22], sd=1,
                         src0_sel=5, src1_sel=6),
        I.v_sub_u32_e64(v[14], v[0], v[1], clmp=1),
        I.v_pk_sub_u16(v[15], v[0], v[1], opsel_hi=3, clmp=1),
        # VOP2 SDWA: D = S1 >> S0 into BYTE1 with the other bits 0 (UNUSED_PAD); S1's BYTE3 / WORD0
        I.VOP2_SDWA(I.VOP2Op.V_LSHRREV_B32_E32, vdst=v[16], src0=SDWA, vsrc0=v[4], vsrc1=v[1], dst_sel=1,
                    dst_unused=0, src0_sel=6, src1_sel=6),
        I.VOP2_SDWA(I.VOP2Op.V_LSHLREV_B32_E32, vdst=v[17], src0=SDWA, vsrc0=v[4], vsrc1=v[1], dst_sel=6,
                    dst_unused=0, src0_sel=6, src1_sel=3),
        I.VOP2_SDWA(I.VOP2Op.V_OR_B32_E32, vdst=v[18], src0=SDWA, vsrc0=v[0], vsrc1=v[1], dst_sel=6, dst_unused=0,
                    src0_sel=0, src1_sel=4),
        I.VOP2_SDWA(I.VOP2Op.V_ADD_U32_E32, vdst=v[19], src0=SDWA, vsrc0=v[0], vsrc1=v[1], dst_sel=6, dst_unused=0,
                    src0_sel=6, src1_sel=3),
        I.VOPC_SDWA_SDST(I.VOPCOp.V_CMP_NE_U32_E32, src0=SDWA, vsrc0=v[0], vsrc1=v[1], sdst=s[24], sd=1, src0_sel=5,
                         src1_sel=6),
    ]
    shifts = rng.integers(0, 40, 64).astype(np.uint32)
    w, _ = run("gfx950", *insts, vgpr={0: a, 1: b, 2: c, 3: m, 4: shifts})
    gt = lt = cls = ne = 0
    for lane in range(64):
        x, y, h = int(a[lane]), int(b[lane]), int(c[lane])
        assert int(w.v[10, lane]) == ((x >> 24) + y) & M32
        assert int(w.v[11, lane]) == max(x & M16, y >> 16)
        assert int(w.v[12, lane]) == max((x >> 16) - y, 0)
        half = X.exact(h >> 16, 5, 10)
        got13 = int(w.v[13, lane])
        assert (X.is_nan_bits(got13, 8, 23) if half == "nan" else
                got13 == X.to_ieee(half, 8, 23) | (h >> 31) << 31), hex(h)
        assert int(w.v[14, lane]) == max(x - y, 0)
        assert int(w.v[15, lane]) == max((x & M16) - (y & M16), 0) | max((x >> 16) - (y >> 16), 0) << 16
        sh = int(shifts[lane])
        assert int(w.v[16, lane]) == ((y >> (sh & 31)) & 0xFF) << 8
        assert int(w.v[17, lane]) == ((y >> 24) << (sh & 31)) & M32
        assert int(w.v[18, lane]) == (x & 0xFF) | (y & M16)
        assert int(w.v[19, lane]) == (x + (y >> 24)) & M32
        ne |= int((x >> 16) != y) << lane
        gt |= int((x & M16) > y) << lane
        lt |= int((x & 0xFF) < (y & M16)) << lane
        cls |= class_f16(h >> 16, int(m[lane])) << lane
    assert (w.s[20] | w.s[21] << 32, w.s[106] | w.s[107] << 32, w.s[22] | w.s[23] << 32) == (gt, lt, cls)
    assert w.s[24] | w.s[25] << 32 == ne


def test_maximum3_with_abs_and_neg_modifiers():
    # v_maximum3_f32 with abs on S1, S2 (abs=6) and v_pk_maximum3_f16 with S2 negated in both
    # halves (neg=4, neg_hi=4), as the MX kernels use them: amax = maximum3(amax, |x|, |y|)
    rng = np.random.default_rng(61)
    a, b, c = (np.where(rng.integers(0, 4, 64) == 0, np.uint32(0x7FC00000), rand_u32(rng)) for _ in range(3))
    h0, h1, h2 = f16_words(rng), f16_words(rng), f16_words(rng)
    w, _ = run("gfx950", I.v_maximum3_f32(v[10], v[0], v[1], v[2], abs=6),
               I.v_pk_maximum3_f16(v[11], v[3], v[4], v[5], opsel_hi=3, opsel_hi2=1, neg=4, neg_hi=4),
               vgpr={0: a, 1: b, 2: c, 3: h0, 4: h1, 5: h2})
    for lane in range(64):
        x, y, z = int(a[lane]), int(b[lane]) & 0x7FFFFFFF, int(c[lane]) & 0x7FFFFFFF
        fx, fy, fz = (X.bits_f32(t) for t in (x, y, z))
        got = int(w.v[10, lane])
        if any(t != t for t in (fx, fy, fz)):
            assert X.is_nan_bits(got, 8, 23), lane
        else:
            best = max((x, y, z), key=lambda t: (X.bits_f32(t), not t >> 31))
            assert got == best, (lane, hex(x), hex(y), hex(z), hex(got))
        for hh in (0, 1):
            p, q, r = ((int(t[lane]) >> (16 * hh)) & M16 for t in (h0, h1, h2))
            m1 = maximum_f16(p, q)
            want = "nan" if m1 == "nan" else maximum_f16(m1, r ^ 0x8000)
            gh = (int(w.v[11, lane]) >> (16 * hh)) & M16
            assert (_nan16(gh) if want == "nan" else gh == want), (lane, hh, hex(p), hex(q), hex(r), hex(gh))
