"""Per-instruction tests of the flyquant.emu interpreter, continued (test_emu_isa.py says how):
the scalar unit as the kernels use it, and scalar operands of vector instructions. SOPC compares
(SCC), SOP2 min/max/or and s_cselect (which reads SCC), the 64-bit logic ops, shifts and moves,
the conditional branches on SCC / VCC / EXEC (taken, not taken, backwards), scalar loads of 4, 8
and 16 dwords with each offset form, s_waitcnt / s_barrier in a lone wave; then VALU reading
SGPRs: lane selects, v_mad_u64_u32 and SDWA with SGPR sources, the float ops (v_minimum3_f32
among them) and packed ops with SGPR operands and modifiers. Expected values are the CDNA3/CDNA4
pseudocode (tinygrad/runtime/autogen/amd/cdna/str_pcode.py) on Python integers, and for float
results the exact references of emu_xref and the crosscheck tests.
"""

from __future__ import annotations

import itertools

import emu_xref as X
import numpy as np
import pytest
from tinygrad.renderer.amd.dsl import SDWA, s, v
from tinygrad.runtime.autogen.amd.cdna import ins as I

from flyquant.emu.memory import Memory

from test_emu_isa import ARCHS, FULL, run
from test_emu_isa_crosscheck_alu import _ieee_op, _maximum_f32, rand_u32
from test_emu_isa_crosscheck_packed import fma16, maximum_f16, min_f16, mul16

M32, M64 = 0xFFFFFFFF, (1 << 64) - 1
# sign bits, 0, all ones, shift amounts at and past the width, values that tie in the low word
EDGES = [0, 1, 5, 31, 32, 33, 63, 64, 0x7FFFFFFF, 0x80000000, M32, 0xFFFFFFC0]


def _s32(x: int) -> int:
    return x - (1 << 32) if x >> 31 else x


def _operand_pairs(seed: int, n_random: int = 40):
    """Every pair of EDGES (so a == b, signed/unsigned disagreements, ... all occur) and random pairs."""
    rng = np.random.default_rng(seed)
    rand = [(int(a), int(b)) for a, b in rng.integers(0, 1 << 32, (n_random, 2), dtype=np.uint64)]
    return list(itertools.product(EDGES, EDGES)) + rand


# --- SOPC: SCC = the comparison, signed (_i32) or unsigned (_u32) ------------------------------------
SOPC = {
    "s_cmp_eq_u32": lambda a, b: a == b, "s_cmp_lg_u32": lambda a, b: a != b,
    "s_cmp_gt_u32": lambda a, b: a > b, "s_cmp_ge_u32": lambda a, b: a >= b,
    "s_cmp_lt_u32": lambda a, b: a < b, "s_cmp_le_u32": lambda a, b: a <= b,
    "s_cmp_eq_i32": lambda a, b: a == b, "s_cmp_lg_i32": lambda a, b: a != b,
    "s_cmp_gt_i32": lambda a, b: _s32(a) > _s32(b), "s_cmp_ge_i32": lambda a, b: _s32(a) >= _s32(b),
    "s_cmp_lt_i32": lambda a, b: _s32(a) < _s32(b), "s_cmp_le_i32": lambda a, b: _s32(a) <= _s32(b),
}


@pytest.mark.parametrize("name", sorted(SOPC))
@pytest.mark.parametrize("arch", ARCHS)
def test_s_cmp_32bit_sets_scc_from_the_comparison(arch, name):
    # 0x80000000 vs 0x7FFFFFFF is the case where signed and unsigned order differ; SCC starts as
    # the opposite of the expected result, so a compare that left SCC alone would fail
    for a, b in _operand_pairs(len(name)):
        want = int(SOPC[name](a, b))
        w, _ = run(arch, getattr(I, name)(s[0], s[1]), sgpr={0: a, 1: b}, scc=1 - want)
        assert w.scc == want, (name, hex(a), hex(b))


@pytest.mark.parametrize("arch", ARCHS)
def test_s_cmp_eq_u64_compares_both_words(arch):
    # SCC = S0.u64 == S1.u64: pairs equal in one word only must give 0
    for (a, b), hi_equal in itertools.product(_operand_pairs(3, 8), (True, False)):
        hi0, hi1 = a ^ 0x5A5A, (a ^ 0x5A5A) if hi_equal else b ^ 0xA5A5
        w, _ = run(arch, I.s_cmp_eq_u64(s[0:1], s[2:3]), sgpr={0: a, 1: hi0, 2: b, 3: hi1}, scc=1)
        assert w.scc == int(a == b and hi0 == hi1), (hex(a), hex(b), hi_equal)


# --- SOP2: min / max / or with their SCC, and s_cselect reading it -----------------------------------
@pytest.mark.parametrize("arch", ARCHS)
def test_s_min_u32_s_max_i32_s_or_b32_scc_read_by_s_cselect(arch):
    # S_MIN_U32: SCC = S0 < S1 (unsigned), D = SCC ? S0 : S1; S_MAX_I32: SCC = S0 >= S1 (signed);
    # S_OR_B32: SCC = D != 0. Each is followed by s_cselect_b32 D = SCC ? 1 : 0 (inline constants),
    # so the SCC the next instruction sees is checked too.
    for a, b in _operand_pairs(6):
        w, _ = run(arch, I.s_min_u32(s[4], s[0], s[1]), I.s_cselect_b32(s[5], 1, 0),
                   I.s_max_i32(s[6], s[0], s[1]), I.s_cselect_b32(s[7], 1, 0),
                   I.s_or_b32(s[8], s[0], s[1]), I.s_cselect_b32(s[9], 1, 0), sgpr={0: a, 1: b})
        assert (w.s[4], w.s[5]) == (min(a, b), int(a < b)), (hex(a), hex(b))
        assert (w.s[6], w.s[7]) == ((a if _s32(a) >= _s32(b) else b), int(_s32(a) >= _s32(b))), (hex(a), hex(b))
        assert (w.s[8], w.s[9]) == (a | b, int(a | b != 0)), (hex(a), hex(b))


@pytest.mark.parametrize("arch", ARCHS)
def test_s_cselect_b32_picks_by_scc_with_sgpr_and_literal_operands(arch):
    # D = SCC ? S0 : S1; a literal (0x12345678) and a negative inline constant (-3) as sources
    for scc in (0, 1):
        w, _ = run(arch, I.s_cselect_b32(s[2], s[0], 0x12345678), I.s_cselect_b32(s[3], -3, s[1]),
                   sgpr={0: 0xAAAA5555, 1: 0x80000000}, scc=scc)
        assert (w.s[2], w.s[3], w.scc) == ((0xAAAA5555, 0xFFFFFFFD) if scc else (0x12345678, 0x80000000)) + (scc,)


# --- 64-bit SALU ---------------------------------------------------------------------------------------
B64 = {  # name -> (reference on u64 operands and the 32-bit shift source, whether S1 is a pair)
    "s_and_b64": (lambda x, y, b: x & y, True),
    "s_or_b64": (lambda x, y, b: x | y, True),
    "s_xor_b64": (lambda x, y, b: x ^ y, True),
    # S_LSHL_B64: D = S0.u64 << S1[5:0]: the amount is masked to 6 bits (64 -> 0, 65 -> 1)
    "s_lshl_b64": (lambda x, y, b: (x << (b & 63)) & M64, False),
}


@pytest.mark.parametrize("name", sorted(B64))
@pytest.mark.parametrize("arch", ARCHS)
def test_64bit_logic_and_shift_set_scc_when_nonzero(arch, name):
    # D.u64 = op, SCC = D.u64 != 0 (SCC starts 1, so a zero result must clear it); a result that is
    # non-zero only in its high word must set SCC
    ref, pair = B64[name]
    rng = np.random.default_rng(len(name) + 11)
    for a, b in _operand_pairs(len(name), 20):
        c, d = (int(t) for t in rng.integers(0, 1 << 32, 2, dtype=np.uint64))
        if a == b:
            c, d = 0, 0  # equal pairs with zero high words: and/xor give 0 or a low-word-only result
        x, y = a | c << 32, b | d << 32
        src1 = s[2:3] if pair else s[2]
        w, _ = run(arch, getattr(I, name)(s[4:5], s[0:1], src1), sgpr={0: a, 1: c, 2: b, 3: d}, scc=1)
        r = ref(x, y, b)
        assert (w.s[4] | w.s[5] << 32, w.scc) == (r, int(r != 0)), (name, hex(x), hex(y))
    w, _ = run(arch, I.s_lshl_b64(s[4:5], s[0:1], 32), sgpr={0: 1, 1: 0}, scc=0)
    assert (w.s[4], w.s[5], w.scc) == (0, 1, 1)  # the one bit moves into the high word: SCC = 1


@pytest.mark.parametrize("arch", ARCHS)
def test_s_mov_b64_copies_the_pair_and_keeps_scc(arch):
    # S_MOV_B64: D0.b64 = S0.b64, no SCC write; also from an inline constant (-1 sign-extends to
    # 64 bits) and a literal (zero-extended: the high word is 0)
    for scc in (0, 1):
        w, _ = run(arch, I.s_mov_b64(s[10:11], s[0:1]), I.s_mov_b64(s[12:13], -1),
                   I.s_mov_b64(s[14:15], 0x80000000), sgpr={0: 0x12345678, 1: 0x9ABCDEF0}, scc=scc)
        assert [w.s[r] for r in range(10, 16)] == [0x12345678, 0x9ABCDEF0, M32, M32, 0x80000000, 0] and w.scc == scc


# --- conditional branches: target = PC + 4 + 4 * simm16 ------------------------------------------------
BRANCHES = [  # (branch, state, taken): VCCZ / EXECZ mean all 64 bits zero, so a high-word bit counts
    ("s_cbranch_scc0", dict(scc=0), True), ("s_cbranch_scc0", dict(scc=1), False),
    ("s_cbranch_vccz", dict(sgpr={106: 0, 107: 0}), True),
    ("s_cbranch_vccz", dict(sgpr={106: 0, 107: 1 << 31}), False),
    ("s_cbranch_vccnz", dict(sgpr={106: 0, 107: 1}), True), ("s_cbranch_vccnz", dict(sgpr={106: 1, 107: 0}), True),
    ("s_cbranch_vccnz", dict(sgpr={106: 0, 107: 0}), False),
    ("s_cbranch_execnz", dict(exec_mask=1 << 63), True), ("s_cbranch_execnz", dict(exec_mask=1), True),
    ("s_cbranch_execnz", dict(exec_mask=0), False),
]


@pytest.mark.parametrize("branch,state,taken", BRANCHES)
@pytest.mark.parametrize("arch", ARCHS)
def test_conditional_branch_taken_or_not(arch, branch, state, taken):
    # simm16 = 1 skips the one-word s_mov_b32 that would set s0 = 1
    state = dict(state)
    sgpr = {**state.pop("sgpr", {}), 0: 0}
    w, _ = run(arch, getattr(I, branch)(simm16=1), I.s_mov_b32(s[0], 1), sgpr=sgpr, **state)
    assert w.s[0] == (0 if taken else 1)


@pytest.mark.parametrize("arch", ARCHS)
def test_backward_branch_loop_counts_down(arch):
    # s1 += 3; s0 -= 1; s_cmp_lg_u32 s0, 0; s_cbranch_scc1 -4 (back to the s_add: 3 one-word
    # instructions + the branch itself): the body runs s0 = 5 times, then falls through
    body = [I.s_add_u32(s[1], s[1], 3), I.s_sub_u32(s[0], s[0], 1), I.s_cmp_lg_u32(s[0], 0),
            I.s_cbranch_scc1(simm16=(-4) & 0xFFFF)]
    w, stats = run(arch, *body, sgpr={0: 5, 1: 100})
    assert (w.s[0], w.s[1], w.scc) == (0, 115, 0)
    assert stats.by_opcode["s_add_u32"] == 5 and stats.by_opcode["s_cbranch_scc1"] == 5


# --- scalar loads ----------------------------------------------------------------------------------
SMEM_SIZES = {"s_load_dwordx4": 4, "s_load_dwordx8": 8, "s_load_dwordx16": 16}


@pytest.mark.parametrize("name", sorted(SMEM_SIZES))
@pytest.mark.parametrize("arch", ARCHS)
def test_s_load_dwordxn_offset_forms(arch, name):
    # addr = SBASE.u64 + offset: IMM=1 a signed 21-bit byte offset (here +12 and -8), IMM=0 the
    # byte offset in the SGPR the OFFSET field names, IMM=1 with SOFFSET_EN both; SDATA[i] is the
    # dword at addr + 4 i. The base is 64 bytes into the buffer so a negative offset stays inside.
    n = SMEM_SIZES[name]
    data = (np.arange(64, dtype=np.uint32) * 0x01010101 + 0x80000000).astype(np.uint32)
    base = data.ctypes.data + 64
    op = getattr(I, name)
    dst = [s[20:20 + n - 1], s[40:40 + n - 1], s[60:60 + n - 1], s[80:80 + n - 1]]
    w, stats = run(arch, op(dst[0], s[0:1], offset=12, imm=1),
                   op(dst[1], s[0:1], offset=(-8) & 0x1FFFFF, imm=1),
                   op(dst[2], s[0:1], offset=2, imm=0),  # byte offset from s2
                   op(dst[3], s[0:1], offset=4, imm=1, soffset_en=1, soffset=s[3]),
                   sgpr={0: base & M32, 1: base >> 32, 2: 36, 3: 16}, memory=Memory())
    for first, byte_offset in ((20, 12), (40, -8), (60, 36), (80, 4 + 16)):
        at = (64 + byte_offset) // 4
        assert [w.s[first + i] for i in range(n)] == [int(x) for x in data[at:at + n]], (name, byte_offset)
    assert stats.by_class["smem"] == 4


@pytest.mark.parametrize("arch", ARCHS)
def test_s_waitcnt_and_s_barrier_in_a_lone_wave_change_nothing(arch):
    # the emulator completes every load at once, so s_waitcnt (any counts) is a no-op; a wave alone
    # in its workgroup passes s_barrier at once. Registers, SCC and EXEC are untouched, the
    # instructions after them run, and they are counted as their classes.
    data = np.array([7, 8, 9, 10], np.uint32)
    base = data.ctypes.data
    vmcnt0_lgkmcnt0, vmcnt3 = 0x0070, 0x0F73  # simm16: vmcnt[3:0] (+[15:14]), expcnt[6:4], lgkmcnt[11:8]
    w, stats = run(arch, I.s_load_dwordx4(s[4:7], s[0:1], offset=0, imm=1), I.s_waitcnt(simm16=vmcnt0_lgkmcnt0),
                   I.s_barrier(), I.s_waitcnt(simm16=vmcnt3), I.s_add_u32(s[8], s[4], s[7]),
                   sgpr={0: base & M32, 1: base >> 32}, exec_mask=FULL >> 1, scc=1, memory=Memory())
    assert [w.s[r] for r in range(4, 8)] == [7, 8, 9, 10] and w.s[8] == 17
    assert w.scc == 0 and w.exec_value() == FULL >> 1 and w.done  # SCC from the s_add (no carry)
    assert (stats.by_class["wait"], stats.by_class["barrier"], stats.by_class["smem"]) == (2, 1, 1)


# --- scalar operands of vector instructions --------------------------------------------------------
@pytest.mark.parametrize("arch", ARCHS)
def test_sgpr_lane_select_mad_u64_u32_and_sdwa_sgpr_src1(arch):
    # v_readlane: lane = S1[5:0], so an SGPR holding 129 selects lane 1; v_readfirstlane: the lowest
    # active lane (4). v_mad_u64_u32 {carry, D} = S0 * S1 + S2.u64 with S0/S1 an SGPR or the inline 7
    # (carry bits checked for active lanes). VOP2 SDWA v_sub_u32 with S1 an SGPR (the s1 bit),
    # src0 WORD_0 / WORD_1, clamp: max(word - S1, 0).
    rng = np.random.default_rng(4)
    a, c0, c1 = rand_u32(rng), rand_u32(rng), rand_u32(rng)
    ex = 0xFFFF_0000_FFFF_FFF0
    sdwa = [I.VOP2_SDWA(I.VOP2Op.V_SUB_U32_E32, vdst=v[10 + sel], src0=SDWA, vsrc0=v[0], vsrc1=v[3], s1=1, dst_sel=6,
                        dst_unused=0, src0_sel=sel, src1_sel=6, clmp=1) for sel in (4, 5)]
    w, _ = run(arch, I.v_mad_u64_u32(v[4:5], s[20:21], s[0], v[0], v[2:3]),
               I.v_mad_u64_u32(v[6:7], s[22:23], v[0], s[1], v[2:3]),
               I.v_mad_u64_u32(v[8:9], s[24:25], s[0], 7, v[2:3]),
               I.v_readlane_b32(v[30], v[0], 37), I.v_readlane_b32(v[31], v[0], s[2]),
               I.v_readfirstlane_b32_e32(v[32], v[0]), *sdwa,
               sgpr={0: M32, 1: 0x87654321, 2: 129, 3: 0x1234}, vgpr={0: a, 2: c0, 3: c1}, exec_mask=ex)
    assert (w.s[30], w.s[31], w.s[32]) == (int(a[37]), int(a[1]), int(a[4]))
    for reg, sdst, mul in ((4, 20, lambda x: M32 * x), (6, 22, lambda x: x * 0x87654321), (8, 24, lambda x: M32 * 7)):
        carry = 0
        for lane in (lane for lane in range(64) if ex >> lane & 1):
            full = mul(int(a[lane])) + (int(c0[lane]) | int(c1[lane]) << 32)
            carry |= (full >> 64) << lane
            assert int(w.v[reg, lane]) | int(w.v[reg + 1, lane]) << 32 == full & M64, (reg, lane)
        assert (w.s[sdst] | w.s[sdst + 1] << 32) & ex == carry, reg
    for lane in (lane for lane in range(64) if ex >> lane & 1):
        x = int(a[lane])
        assert (int(w.v[14, lane]), int(w.v[15, lane])) == (max((x & 0xFFFF) - 0x1234, 0), max((x >> 16) - 0x1234, 0))


F32_SPECIALS = [0, 0x80000000, 0x7F800000, 0xFF800000, 0x7FC00000, 0xFFC00001, 0x7F800001, 0xFFA00000, 1,
                0x807FFFFF, 0x7F7FFFFF, 0x3F800000, 0xBF800000, 0x40800000]
F16_SPECIALS = [0, 0x8000, 0x7C00, 0xFC00, 0x7E00, 0xFE01, 0x7C01, 0x0001, 0x83FF, 0x7BFF, 0x3C00, 0xBC00, 0x3800]


def _minimum_f32(a: int, b: int):
    """IEEE 754-2019 minimum (V_MINIMUM3_F32 applies it twice): a NaN operand gives a NaN ('nan'),
    -0 < +0."""
    if X.is_nan_bits(a, 8, 23) or X.is_nan_bits(b, 8, 23):
        return "nan"
    if {a, b} == {0, 0x80000000}:
        return 0x80000000
    return a if X.bits_f32(a) <= X.bits_f32(b) else b


def _then(f, x, y):
    return "nan" if x == "nan" else f(x, y)


def _halves(f):
    """A per-half f16 reference applied to the low and high halves of packed words: [lo, hi]."""
    return lambda *words: [f(*((w >> k) & 0xFFFF for w in words)) for k in (0, 16)]


SCALAR_OPERAND_OPS = {  # name -> (f32 or f16, instruction with v0, v1 and s0, s1 operands, reference)
    "v_med3_f32": ("f32", lambda: I.v_med3_f32_e64(v[5], v[0], s[0], v[1]),
                   lambda a, b, s0, s1: X.v_med3_f32(a, s0, b)),
    "v_min_f32_e32": ("f32", lambda: I.v_min_f32_e32(v[5], s[0], v[0]), lambda a, b, s0, s1: X.v_min_f32(s0, a)),
    "v_max_f32_e64": ("f32", lambda: I.v_max_f32_e64(v[5], v[0], s[0]), lambda a, b, s0, s1: X.v_max_f32(a, s0)),
    "v_mul_f32": ("f32", lambda: I.v_mul_f32_e64(v[5], s[0], v[0]), lambda a, b, s0, s1: _ieee_op("mul", (s0, a))),
    "v_fma_f32": ("f32", lambda: I.v_fma_f32_e64(v[5], v[0], s[0], s[1]),
                  lambda a, b, s0, s1: _ieee_op("fma", (a, s0, s1))),
    # abs / neg act on the SGPR's value as on a VGPR's: maximum3(a, |s0|, -|s1|)
    "v_maximum3_f32": ("f32", lambda: I.v_maximum3_f32(v[5], v[0], abs(s[0]), -abs(s[1])),
                       lambda a, b, s0, s1: _then(_maximum_f32, _maximum_f32(a, s0 & 0x7FFFFFFF), s1 | 0x80000000)),
    "v_minimum3_f32": ("f32", lambda: I.v_minimum3_f32(v[5], s[1], v[0], s[0]),
                       lambda a, b, s0, s1: _then(_minimum_f32, _minimum_f32(s1, a), s0)),
    "v_pk_min_f16": ("f16", lambda: I.v_pk_min_f16(v[5], v[0], s[0]), lambda a, b, s0, s1: _halves(min_f16)(a, s0)),
    "v_pk_mul_f16": ("f16", lambda: I.v_pk_mul_f16(v[5], s[0], v[0]), lambda a, b, s0, s1: _halves(mul16)(s0, a)),
    "v_pk_fma_f16": ("f16", lambda: I.v_pk_fma_f16(v[5], v[0], s[0], v[1]),
                     lambda a, b, s0, s1: _halves(fma16)(a, s0, b)),
    # VOP3P NEG negates the low half of a source and NEG_HI the high half: neg on S2 only in the low
    "v_pk_maximum3_f16": ("f16", lambda: I.v_pk_maximum3_f16(v[5], v[0], s[0], s[1], neg=4, neg_hi=0),
                          lambda a, b, s0, s1: _halves(lambda p, q, r: _then(maximum_f16, maximum_f16(p, q), r))(
                              a, s0, s1 ^ 0x8000)),
}


GFX950_ONLY = {"v_maximum3_f32", "v_minimum3_f32", "v_pk_maximum3_f16"}


@pytest.mark.parametrize("arch,name", [(arch, name) for name in sorted(SCALAR_OPERAND_OPS) for arch in ARCHS
                                       if arch == "gfx950" or name not in GFX950_ONLY])
def test_float_ops_read_sgpr_operands_in_every_lane(arch, name):
    # an SGPR source is the same value in every lane (packed f16: its two halves per op_sel_hi = 1);
    # operands mix specials (signed zeros, Inf, quiet and signalling NaNs, denormals) and random
    # bits; the first round has the SGPRs -0 and +0. NaN results: NaN-ness only.
    kind, build, ref = SCALAR_OPERAND_OPS[name]
    rng = np.random.default_rng(len(name))
    specials, width = (F32_SPECIALS, 32) if kind == "f32" else (F16_SPECIALS, 16)

    def operand(n):
        if kind == "f16":
            return (operand16(n) | operand16(n) << 16).astype(np.uint32)
        return np.where(rng.integers(0, 2, n) == 0, rng.choice(specials, n), rand_u32(rng, n)).astype(np.uint32)

    def operand16(n):
        return np.where(rng.integers(0, 2, n) == 0, rng.choice(specials, n), rng.integers(0, 1 << 16, n))
    for rep in range(8):
        a, b = operand(64), operand(64)
        s0, s1 = (int(x) for x in operand(2)) if rep else ((0x80000000, 0) if width == 32 else (0x00008000, 0x80000000))
        w, _ = run(arch, build(), sgpr={0: s0, 1: s1}, vgpr={0: a, 1: b})
        for lane in range(64):
            want, got = ref(int(a[lane]), int(b[lane]), s0, s1), int(w.v[5, lane])
            wants, gots = (want, [got & 0xFFFF, got >> 16]) if width == 16 else ([want], [got])
            ebits, mbits = (8, 23) if width == 32 else (5, 10)
            assert all(X.is_nan_bits(g, ebits, mbits) if h == "nan" else g == h for g, h in zip(gots, wants)), \
                (name, hex(int(a[lane])), hex(int(b[lane])), hex(s0), hex(s1), hex(got), want)


@pytest.mark.parametrize("arch", ARCHS)
def test_v_pk_add_mul_f32_read_both_sgprs_of_a_pair(arch):
    # v_pk_{add,mul}_f32 D.lo = S0.lo op S1[0], D.hi = S0.hi op S1[1] with S1 the pair s[0:1]
    rng = np.random.default_rng(3)
    for _ in range(6):
        a0, a1 = (np.where(rng.integers(0, 2, 64) == 0, rng.choice(F32_SPECIALS, 64), rand_u32(rng)) for _ in range(2))
        s0, s1 = (int(x) for x in rng.choice(F32_SPECIALS, 2))
        for op in ("add", "mul"):
            w, _ = run(arch, getattr(I, f"v_pk_{op}_f32")(v[6:7], v[0:1], s[0:1]), sgpr={0: s0, 1: s1},
                       vgpr={0: a0, 1: a1})
            for lane in range(64):
                for reg, x, y in ((6, int(a0[lane]), s0), (7, int(a1[lane]), s1)):
                    want, got = _ieee_op(op, (x, y)), int(w.v[reg, lane])
                    assert X.is_nan_bits(got, 8, 23) if want == "nan" else got == want, (op, hex(x), hex(y))


@pytest.mark.parametrize("arch", ARCHS)
def test_64_bit_operands_read_float_inline_constants_as_doubles(arch):
    # A float inline constant in a 64-bit operand is the double's bit pattern, as LLVM reads it:
    # it materializes the FP32 pair (0.0, 2.0) of a packed multiply as s_mov_b64 s[4:5], 2.0
    # (gfx942's FP4 unpack tables; the emulator gave (2.0, 0.0), zero-extending the FP32 pattern,
    # and the kernel's products came out wrong). Integer inline constants sign-extend.
    w, _ = run(arch, I.s_mov_b64(s[4:5], 2.0), I.s_mov_b64(s[6:7], -0.5), I.s_mov_b64(s[8:9], 1.0),
               I.s_mov_b64(s[10:11], -3), I.s_mov_b32(s[12], 2.0))
    got = [int(w.s[i]) for i in range(4, 13)]
    assert got == [0, 0x40000000, 0, 0xBFE00000, 0, 0x3FF00000, 0xFFFFFFFD, 0xFFFFFFFF, 0x40000000]


def test_scalar_carry_chain_edges():
    # S_ADDC_U32: SCC = S0 + S1 + SCC >= 2^32 (the carry-in counts); S_SUB_U32: SCC = S1 > S0 (equal
    # operands do not borrow). The random operands of the tests above almost never land on these.
    for inst, sgpr, scc, want in (
        (I.s_addc_u32(s[2], s[0], s[1]), {0: M32, 1: 0}, 1, (0, 1)),
        (I.s_addc_u32(s[2], s[0], s[1]), {0: 0x80000000, 1: 0x7FFFFFFF}, 1, (0, 1)),
        (I.s_addc_u32(s[2], s[0], s[1]), {0: M32, 1: 0}, 0, (M32, 0)),
        (I.s_sub_u32(s[2], s[0], s[1]), {0: 5, 1: 5}, 0, (0, 0)),
        (I.s_sub_u32(s[2], s[0], s[1]), {0: M32, 1: M32}, 1, (0, 0)),
        (I.s_sub_u32(s[2], s[0], s[1]), {0: 4, 1: 5}, 0, (M32, 1)),
    ):
        w, _ = run("gfx942", inst, sgpr=sgpr, scc=scc)
        assert (int(w.s[2]), int(w.scc)) == want, (inst, sgpr, scc)
