"""Per-instruction tests of the flyquant.emu interpreter, continued (test_emu_isa.py says how):
conversions (FP8 OCP/FNUZ, the scaled FP8/FP4 conversions, BF16 rounding, int/float) and MFMA
(operand and accumulator layouts, AGPRs, FP4 and int8 operands)."""

from __future__ import annotations

import numpy as np
import pytest
from tinygrad.renderer.amd.dsl import SDWA, v
from tinygrad.runtime.autogen.amd.cdna import ins as I

from flyquant.emu.isa_base import AGPR_BASE, EmuError

from test_emu_isa import ARCHS, LANES, as_f32, f32, run


# --- conversions --------------------------------------------------------------------------------------
# f32 value -> (gfx942 FNUZ E4M3 byte, gfx950 OCP E4M3 byte), derived by hand:
#   OCP bias 7, FNUZ bias 8; subnormals m/8 * 2^-6 (OCP) and m/8 * 2^-7 (FNUZ).
FP8_CASES = [
    (1.0, 0x40, 0x38),          # exponent field 8 (FNUZ) / 7 (OCP), mantissa 0
    (-1.5, 0xC4, 0xBC),
    (240.0, 0x7F, 0x77),        # FNUZ max 1.875 * 2^7
    (448.0, 0x80, 0x7E),        # FNUZ overflow -> NaN (no saturation); OCP max
    (464.0, 0x80, 0x7E),        # OCP: tie between 448 (0x7E) and 480 (0x7F): even 0x7E
    (465.0, 0x80, 0x7F),        # OCP: rounds past 448 -> NaN
    (2.0**-9, 0x02, 0x01),      # OCP min subnormal; FNUZ 2 * 2^-10
    (2.0**-11, 0x00, 0x00),     # FNUZ: tie between 0 and 2^-10: even 0
    (1.0625, 0x40, 0x38),       # tie between 1.0 and 1.125: even mantissa 0
    (1.1875, 0x42, 0x3A),       # tie between 1.125 and 1.25: even mantissa 2
    (-0.0, 0x00, 0x80),         # FNUZ has no -0
    (float("inf"), 0x80, 0x7F),
    (float("nan"), 0x80, 0x7F),     # a NaN keeps its sign (OCP); FNUZ has one NaN
    (-float("nan"), 0x80, 0xFF),
]


@pytest.mark.parametrize("arch", ARCHS)
def test_v_cvt_pk_fp8_f32_fnuz_vs_ocp(arch):
    vals = np.array([f32(x) for x, _, _ in FP8_CASES] + [0] * (64 - len(FP8_CASES)), np.uint32)
    col = 1 if arch == "gfx942" else 2
    # op_sel[3] = 1 writes bits 31:16 and keeps 15:0 (0xBEEF); S0 -> low byte, S1 (1.0) -> high
    w, _ = run(arch, I.v_cvt_pk_fp8_f32(v[2], v[0], v[1], opsel=8), vgpr={0: vals, 1: f32(1.0), 2: 0xBEEF})
    one = FP8_CASES[0][col]
    for i, case in enumerate(FP8_CASES):
        assert w.v[2, i] == (one << 24) | (case[col] << 16) | 0xBEEF, (case, hex(w.v[2, i]))


@pytest.mark.parametrize("arch", ARCHS)
def test_v_cvt_f32_fp8_decodes_per_arch_with_sdwa_byte(arch):
    # byte 2 of 0x00C40000 is 0xC4: FNUZ -1.5 (bias 8), OCP -3.0 (bias 7); 0x80 is FNUZ NaN / OCP -0
    inst = I.VOP1_SDWA(I.VOP1Op.V_CVT_F32_FP8_E32, vdst=v[1], src0=SDWA, vsrc0=v[0], dst_sel=6, dst_unused=0,
                       src0_sel=2)
    w, _ = run(arch, inst, I.v_cvt_f32_fp8_e32(v[2], v[3]), vgpr={0: 0x00C40000, 3: 0x80})
    assert as_f32(w.v[1][0]) == (-1.5 if arch == "gfx942" else -3.0)
    if arch == "gfx942":
        assert np.isnan(as_f32(w.v[2][0]))
    else:
        assert w.v[2][0] == 0x80000000


@pytest.mark.parametrize("arch", ARCHS)
def test_fp8_to_f32_sdwa_selects_of_the_isa_pseudocode(arch):
    # V_CVT_F32_FP8: BYTE_1..3 pick their byte, "else // BYTE0 implied" (WORD_1 and DWORD read byte
    # 0); V_CVT_PK_F32_FP8: "SDWA_SRC0_SEL[1:0] == WORD1.b2 ? S0[31:16] : S0[15:0]" (BYTE_1 reads
    # the high word too). Bytes 0x38, 0x40, 0x48, 0x50: OCP 1, 2, 4, 8 (FNUZ half of each)
    word = 0x50484038
    half = 0.5 if arch == "gfx942" else 1.0
    one = [I.VOP1_SDWA(I.VOP1Op.V_CVT_F32_FP8_E32, vdst=v[1 + i], src0=SDWA, vsrc0=v[0], dst_sel=6, dst_unused=0,
                       src0_sel=sel) for i, sel in enumerate((1, 3, 5, 6))]
    pk = [I.VOP1_SDWA(I.VOP1Op.V_CVT_PK_F32_FP8_E32, vdst=v[5 + 2 * i:6 + 2 * i], src0=SDWA, vsrc0=v[0], dst_sel=6,
                      dst_unused=0, src0_sel=sel) for i, sel in enumerate((1, 4, 5))]
    w, _ = run(arch, *one, *pk, vgpr={0: word})
    got = [as_f32(w.v[r][0]) for r in range(1, 11)]
    assert got == [half * x for x in (2, 8, 1, 1, 4, 8, 1, 2, 4, 8)]


def test_v_cvt_scalef32_pk_fp8_f32_divides_by_the_scale():
    # scale operand 4.0 (exponent 129: 2^2): 12.0 / 4 = 3.0 -> OCP 0x44; -0.5 / 4 = -0.125 -> 0xA0;
    # the mantissa and sign of the scale operand are ignored (-5.0 has exponent 129 too)
    w, _ = run("gfx950", I.v_cvt_scalef32_pk_fp8_f32(v[3], v[0], v[1], v[2]),
               vgpr={0: f32(12.0), 1: f32(-0.5), 2: f32(-5.0), 3: 0xFFFF0000})
    assert w.v[3, 0] == 0xFFFFA044


def test_v_cvt_scalef32_pk_fp8_f32_overflow_is_nan():
    # 500 / 1 rounds past 448: NaN (0x7F with the sign), the reason kernels clamp first
    w, _ = run("gfx950", I.v_cvt_scalef32_pk_fp8_f32(v[3], v[0], v[1], v[2]),
               vgpr={0: f32(500.0), 1: f32(-500.0), 2: f32(1.0)})
    assert w.v[3, 0] & 0xFFFF == 0xFF7F


def test_scaled_conversions_with_nan_scale_and_fp4_saturation():
    # scale code 0xFF (an f32 NaN operand) makes every result NaN with the element's sign;
    # FP4 narrowing saturates: 100 / 1 -> 6 (code 7), NaN -> 7 with its sign, -inf -> 0xF
    w, _ = run("gfx950", I.v_cvt_scalef32_pk_fp8_f32(v[3], v[0], v[1], v[2]),
               I.v_cvt_scalef32_pk_fp4_f32(v[4], v[5], v[6], v[7]), I.v_cvt_scalef32_pk_fp4_f32(v[8], v[9], v[9], v[7]),
               vgpr={0: f32(1.0), 1: f32(-1.0), 2: 0x7FC00000, 3: 0, 5: f32(100.0), 6: 0xFFC00000, 7: f32(1.0),
                     9: f32(-float("inf"))})
    assert w.v[3, 0] & 0xFFFF == 0xFF7F and w.v[4, 0] & 0xFF == 0xF7 and w.v[8, 0] & 0xFF == 0xFF


def test_v_cvt_scalef32_pk_bf16_fp4():
    # byte 1 of 0x0000A172 is 0xA1: low nibble 1 (+0.5), high nibble 0xA (-1.0); scale 2^-1
    # (0.5, exponent 126): 0.25 -> bf16 0x3E80, -0.5 -> 0xBF00
    w, _ = run("gfx950", I.v_cvt_scalef32_pk_bf16_fp4(v[2], v[0], v[1], opsel=1), vgpr={0: 0x0000A172, 1: f32(0.5)})
    assert w.v[2, 0] == 0xBF003E80
    with pytest.raises(EmuError, match="gfx950-only"):
        run("gfx942", I.v_cvt_scalef32_pk_bf16_fp4(v[2], v[0], v[1]))


def test_v_cvt_pk_bf16_f32_rounds_to_nearest_even():
    # 0x3F808000 is exactly between bf16 0x3F80 and 0x3F81: even -> 0x3F80;
    # 0x3F818000 -> 0x3F82; 0x3F808001 (just above the tie) -> 0x3F81; NaN stays NaN
    a = np.array([0x3F808000, 0x3F808001, 0x7FC00001] + [0] * 61, np.uint32)
    w, _ = run("gfx950", I.v_cvt_pk_bf16_f32(v[2], v[0], v[1]), vgpr={0: a, 1: 0x3F818000})
    assert [int(x) for x in w.v[2, :2]] == [0x3F823F80, 0x3F823F81]
    lo = int(w.v[2, 2]) & 0xFFFF
    assert lo & 0x7F80 == 0x7F80 and lo & 0x7F  # exponent all ones, mantissa non-zero


def test_int_float_conversions_saturate():
    # v_cvt_i32_f32: NaN -> 0, 3e9 -> INT_MAX, -2.7 -> -2 (toward zero); v_cvt_u32_f32: -1 -> 0
    a = np.array([0x7FC00000, f32(3e9), f32(-2.7)] + [0] * 61, np.uint32)
    w, _ = run("gfx942", I.v_cvt_i32_f32_e32(v[1], v[0]), I.v_cvt_u32_f32_e32(v[2], v[3]),
               vgpr={0: a, 3: f32(-1.0)})
    assert list(w.v[1, :3]) == [0, 0x7FFFFFFF, (-2) & 0xFFFFFFFF] and (w.v[2] == 0).all()


# --- MFMA ---------------------------------------------------------------------------------------------
def _mfma_operand(mat: np.ndarray, rows: int, per_lane: int) -> np.ndarray:
    """Per-lane elements (64, per_lane) of a (rows, K) operand: lane l holds row l % rows,
    k = per_lane * (l // rows) + j (the layout derived from the ISA guide's description)."""
    groups = 64 // rows
    return mat.reshape(rows, groups, per_lane).transpose(1, 0, 2).reshape(64, per_lane)


@pytest.mark.parametrize("arch", ARCHS)
def test_mfma_f32_16x16x4_with_accumulator_layout(arch):
    rng = np.random.default_rng(0)
    a = rng.integers(-8, 8, (16, 4)).astype(np.float32)  # small integers: every sum is exact
    b = rng.integers(-8, 8, (4, 16)).astype(np.float32)
    c = rng.integers(-8, 8, (16, 16)).astype(np.float32)
    # C/D: register r of lane l is element (4 * (l // 16) + r, l % 16)
    c_regs = c.reshape(4, 4, 16).transpose(1, 0, 2).reshape(4, 64)
    vgpr = {4: _mfma_operand(a, 16, 1)[:, 0], 5: _mfma_operand(b.T, 16, 1)[:, 0]}
    w, stats = run(arch, I.v_mfma_f32_16x16x4_f32(v[0:3], v[4], v[5], v[0:3]),
                   vgpr={**vgpr, **{i: c_regs[i] for i in range(4)}})
    d = as_f32(w.v[0:4]).reshape(4, 4, 16).transpose(1, 0, 2).reshape(16, 16)
    assert np.array_equal(d, a @ b + c) and stats.by_class["mfma"] == 1


@pytest.mark.parametrize("arch,k", [("gfx942", 16), ("gfx950", 32)])
def test_mfma_bf16_agpr_accumulate(arch, k):
    # bf16 16x16x16 (gfx942) / 16x16x32 (gfx950): E = 16k/64 bf16 per lane, D in AGPRs (acc_cd)
    rng = np.random.default_rng(1)
    a = rng.integers(-4, 5, (16, k)).astype(np.float32)
    b = rng.integers(-4, 5, (k, 16)).astype(np.float32)
    e = 16 * k // 64
    pack = lambda m: (_mfma_operand(m, 16, e).view(np.uint32) >> 16).astype(np.uint32)  # noqa: E731  exact bf16
    pa, pb = pack(a), pack(b.T)
    words = lambda p: [(p[:, 2 * j] | (p[:, 2 * j + 1] << 16)).astype(np.uint32) for j in range(e // 2)]  # noqa: E731
    vgpr = {}
    for j, word in enumerate(words(pa)):
        vgpr[10 + j] = word
    for j, word in enumerate(words(pb)):
        vgpr[20 + j] = word
    mk = I.v_mfma_f32_16x16x16_bf16 if k == 16 else I.v_mfma_f32_16x16x32_bf16
    regs = e // 2
    inst = mk(v[0:3], v[10:10 + regs - 1], v[20:20 + regs - 1], 0, acc_cd=1)
    w, _ = run(arch, inst, vgpr=vgpr)
    d = as_f32(w.v[AGPR_BASE:AGPR_BASE + 4]).reshape(4, 4, 16).transpose(1, 0, 2).reshape(16, 16)
    assert np.array_equal(d, a @ b)


def test_accvgpr_moves():
    w, _ = run("gfx942", I.v_accvgpr_write(v[3], v[0]), I.v_accvgpr_read(v[1], v[3]), vgpr={0: LANES + 5})
    assert (w.v[AGPR_BASE + 3] == LANES + 5).all() and (w.v[1] == LANES + 5).all()


E2M1_VALUES = [0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0]  # codes 0..7; bit 3 is the sign


def test_mfma_f8f6f4_fp4_operands():
    # v_mfma_f32_16x16x128_f8f6f4 with cbsz = blgp = 4 (both FP4 E2M1): lane l holds row l % 16,
    # k = 32 * (l // 16) + j, element j in nibble j % 2 (low first) of byte j // 2 of its 4
    # registers; values from the E2M1 table, products and sums exact in f32 here
    rng = np.random.default_rng(3)
    ca, cb = rng.integers(0, 16, (16, 128)), rng.integers(0, 16, (16, 128))  # codes of A and B^T

    def value(code):
        return (-1.0 if code & 8 else 1.0) * E2M1_VALUES[code & 7]

    def pack(codes):  # (16, 128) codes -> 4 registers of (64,) words
        lane = _mfma_operand(codes, 16, 32)  # (64, 32)
        nib = (lane[:, 0::2] | lane[:, 1::2] << 4).astype(np.uint8)  # (64, 16) bytes
        return np.ascontiguousarray(nib).view(np.uint32).T  # (4, 64)

    pa, pb = pack(ca), pack(cb)
    vgpr = {**{10 + r: pa[r] for r in range(4)}, **{20 + r: pb[r] for r in range(4)}}
    w, _ = run("gfx950", I.v_mfma_f32_16x16x128_f8f6f4(v[0:3], v[10:13], v[20:23], 0, cbsz=4, blgp=4), vgpr=vgpr)
    a, b = np.vectorize(value)(ca), np.vectorize(value)(cb)
    d = as_f32(w.v[0:4]).reshape(4, 4, 16).transpose(1, 0, 2).reshape(16, 16)
    assert np.array_equal(d, (a @ b.T).astype(np.float32))


@pytest.mark.parametrize("arch", ARCHS)
def test_mfma_i32_16x16x32_i8_accumulates(arch):
    # int8 A (16x32) and B (32x16), 8 bytes per lane in 2 registers (k = 8 * (l // 16) + j), C = 1000
    rng = np.random.default_rng(4)
    a, b = rng.integers(-128, 128, (16, 32)), rng.integers(-128, 128, (32, 16))

    def pack(m):
        return np.ascontiguousarray(_mfma_operand(m, 16, 8).astype(np.int8)).view(np.uint32).T  # (2, 64)

    pa, pb = pack(a), pack(b.T)
    c = np.full((4, 64), 1000, np.uint32)
    w, _ = run(arch, I.v_mfma_i32_16x16x32_i8(v[0:3], v[10:11], v[20:21], v[0:3]),
               vgpr={10: pa[0], 11: pa[1], 20: pb[0], 21: pb[1], **{r: c[r] for r in range(4)}})
    d = w.v[0:4].view(np.int32).reshape(4, 4, 16).transpose(1, 0, 2).reshape(16, 16)
    assert np.array_equal(d, a @ b + 1000)


def test_scaled_fp4_conversion_writes_only_active_lanes():
    # VALU results go only to lanes with EXEC set: lanes 32..63 keep their 0xDEADBEEF. Active lanes:
    # byte 0 = fp4(2.0) = 0x4 (high nibble), fp4(1.0) = 0x2 (low), the other bytes kept
    w, _ = run("gfx950", I.v_cvt_scalef32_pk_fp4_f32(v[3], v[0], v[1], v[2]),
               vgpr={0: f32(1.0), 1: f32(2.0), 2: f32(1.0), 3: 0xDEADBEEF}, exec_mask=(1 << 32) - 1)
    assert (w.v[3, :32] == 0xDEADBE42).all() and (w.v[3, 32:] == 0xDEADBEEF).all()


def test_v_cvt_pk_bf8_f32_nan_code_gfx950():
    # OCP E5M2 on gfx950: a NaN gives S.11111.10 with its sign (isa_cvt's reading of AMD's host model,
    # amd_hip_ocp_host.hpp; not checked on hardware): +NaN -> 0x7E, -NaN -> 0xFE
    w, _ = run("gfx950", I.v_cvt_pk_bf8_f32(v[2], v[0], v[1]), vgpr={0: 0x7FC00000, 1: 0xFFC00001, 2: 0})
    assert int(w.v[2, 0]) == 0xFE7E


def test_v_cvt_f32_fp8_vop3_op_sel_picks_the_byte():
    # V_CVT_F32_FP8 (VOP3): byte OPSEL[1:0] of S0; gfx950 OCP E4M3: 0xC4 = -3.0, 0x38 = 1.0
    w, _ = run("gfx950", I.v_cvt_f32_fp8_e64(v[1], v[0], opsel=2), I.v_cvt_f32_fp8_e64(v[2], v[0], opsel=3),
               vgpr={0: 0x38C40000})
    assert as_f32(w.v[1, 0]) == -3.0 and as_f32(w.v[2, 0]) == 1.0
