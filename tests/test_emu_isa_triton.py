"""flyquant.emu: the instructions and features Triton-compiled AMD kernels need beyond FlyDSL's.

Each expected value is worked out from the instruction's definition in the CDNA3/CDNA4 ISA guides
(quoted in flyquant/emu/isa_hwreg.py, isa_vdiv.py, isa_scratch.py and isa_valu.py), not from the
emulator: the MODE register (s_setreg/s_getreg, FP16_OVFL), the f32 division sequence, SDWA
v_cndmask_b32, scratch (private) memory, buffer loads to LDS and the dispatch packet.
"""

from __future__ import annotations

import numpy as np
import pytest
from types import SimpleNamespace

from test_emu_isa import ARCHS, FULL, ZERO, as_f32, f32, run
from test_emu_isa_memory import _rsrc_sgprs
from tinygrad.renderer.amd.dsl import SDWA, VCC, s, src, v
from tinygrad.runtime.autogen.amd.cdna import ins as I

from flyquant.emu import interp
from flyquant.emu.isa_base import EmuError, Wave
from flyquant.emu.memory import EmuMemoryError, Memory

OFF = src[0x7F]  # SCRATCH saddr "off"


def hwreg(reg: int, offset: int, size: int) -> int:
    """SIMM16 of s_getreg/s_setreg: {size - 1 [15:11], offset [10:6], hwRegId [5:0]}."""
    return (size - 1) << 11 | offset << 6 | reg


MODE = 1
FP16_OVFL = hwreg(MODE, 23, 1)  # 0x5C1, what Triton's gfx950 kernels write first
SET_FP16_OVFL = I.s_setreg_imm32_b32(simm16=FP16_OVFL, literal=1)


# --- MODE: s_setreg / s_getreg ----------------------------------------------------------------------------
def test_s_setreg_imm32_and_s_getreg_of_mode():
    # FlyDSL's MODE (no descriptor): FP_DENORM 0xF (bits 7:4), DX10_CLAMP (8), IEEE (9) = 0x3F0.
    # Setting FP16_OVFL (bit 23) and reading bits 0..9 and bit 23 back; s_setreg_b32 from s2 = 0 clears it.
    w, _ = run("gfx950", SET_FP16_OVFL, I.s_getreg_b32(s[0], simm16=hwreg(MODE, 0, 10)),
               I.s_getreg_b32(s[1], simm16=FP16_OVFL), I.s_setreg_b32(s[2], simm16=FP16_OVFL),
               I.s_getreg_b32(s[3], simm16=FP16_OVFL), sgpr={2: 0})
    assert (w.s[0], w.s[1], w.s[3]) == (0x3F0, 1, 0)
    assert w.mode == 0x3F0


def test_s_setreg_of_a_field_the_emulator_fixes_is_an_error():
    with pytest.raises(EmuError, match="MODE.FP_DENORM is not modelled"):
        run("gfx950", I.s_setreg_imm32_b32(simm16=hwreg(MODE, 4, 4), literal=0))
    with pytest.raises(EmuError, match="hardware register 2 is not modelled"):
        run("gfx950", I.s_setreg_imm32_b32(simm16=hwreg(2, 0, 1), literal=0))
    run("gfx950", I.s_setreg_imm32_b32(simm16=hwreg(MODE, 4, 4), literal=0xF))  # no change: fine


def test_fp16_ovfl_makes_fp8_conversions_saturate():
    # +-500 / 1 rounds past 448: NaN (0x7F | sign) by default, +-448 (0x7E / 0xFE) with FP16_OVFL;
    # NaN stays NaN (0x7F); E5M2: 1e6 -> max 57344 (0x7B), a true infinity stays one (0x7C).
    vg = {0: f32(500.0), 1: f32(-500.0), 2: f32(1.0), 4: 0x7FC00000, 5: f32(1e6), 6: f32(float("inf"))}
    convert = (I.v_cvt_scalef32_pk_fp8_f32(v[3], v[0], v[1], v[2]), I.v_cvt_scalef32_pk_fp8_f32(v[7], v[4], v[0], v[2]),
               I.v_cvt_scalef32_pk_bf8_f32(v[8], v[5], v[6], v[2]))
    w, _ = run("gfx950", *convert, vgpr=vg)
    assert w.v[3, 0] & 0xFFFF == 0xFF7F
    w, _ = run("gfx950", SET_FP16_OVFL, *convert, vgpr=vg)
    assert (w.v[3, 0] & 0xFFFF, w.v[7, 0] & 0xFFFF, w.v[8, 0] & 0xFFFF) == (0xFE7E, 0x7E7F, 0x7C7B)


def test_fp16_ovfl_on_gfx942_fnuz_conversion():
    # FNUZ E4M3: 500 rounds past 240: NaN 0x80 by default, 240 (0x7F) with FP16_OVFL; 1.0 -> 0x40
    vg = {0: f32(500.0), 1: f32(1.0)}
    w, _ = run("gfx942", I.v_cvt_pk_fp8_f32(v[2], v[0], v[1]), vgpr=vg)
    assert w.v[2, 0] & 0xFFFF == 0x4080
    w, _ = run("gfx942", SET_FP16_OVFL, I.v_cvt_pk_fp8_f32(v[2], v[0], v[1]), vgpr=vg)
    assert w.v[2, 0] & 0xFFFF == 0x407F


def test_fp16_ovfl_leaves_selecting_f16_results():
    # FP16_OVFL clamps overflowed f16 results and keeps true infinities (ISA, MODE register); a
    # max/min/maximum3 result is one of its operands, never an overflow: the same with the bit
    # set. Halves (lo, hi): max(-inf, 65504, -65504) = 65504 (0x7BFF); max(inf, -2, 2) = inf.
    vg = {4: 0x7C00FC00, 5: 0xC0007BFF}
    for setup in ((), (SET_FP16_OVFL,)):
        w, _ = run("gfx950", *setup, I.v_pk_maximum3_f16(v[6], v[4], v[5], -v[5]), I.v_pk_max_f16(v[7], v[4], v[5]),
                   vgpr=vg)
        assert (int(w.v[6, 0]), int(w.v[7, 0])) == (0x7C007BFF, 0x7C007BFF)


def test_f16_result_with_fp16_ovfl_fails_loudly():
    with pytest.raises(EmuError, match="f16 result with MODE.FP16_OVFL"):
        run("gfx950", SET_FP16_OVFL, I.v_cvt_f16_f32_e32(v[1], v[0]), vgpr={0: f32(1e6)})


# --- the f32 division sequence ------------------------------------------------------------------------
def _lanes(*values) -> np.ndarray:
    out = np.full(64, f32(1.0), np.uint32)
    out[:len(values)] = [f32(x) if isinstance(x, float) else x for x in values]
    return out


def test_v_div_scale_f32_cases():
    # (S0, S1 denominator, S2 numerator) -> (D, VCC), from the pseudocode's branches:
    cases = [
        (3.0, 3.0, 6.0, 3.0, 0),              # nothing special: D = S0
        (3.0, 3.0, 0.0, np.nan, 0),           # S2 == 0: NaN
        (2.0 ** -140, 2.0 ** -140, 2.0 ** -40, 2.0 ** -76, 0),  # denormal S1: ldexp(S0, 64)
        (2.0 ** -140, 2.0 ** -140, 1.0, 2.0 ** -76, 1),  # the same S1 under 1.0: the exponent gap (127) comes first
        (4.0, 4.0, 2.0 ** 100, 2.0 ** 66, 1),  # exponent(S2) - exponent(S1) = 98 >= 96, S0 == S1
        (2.0 ** 100, 4.0, 2.0 ** 100, 2.0 ** 100, 1),  # same, S0 == S2: unscaled
        (2.0 ** -100, 2.0 ** 40, 2.0 ** -100, 2.0 ** -36, 1),  # S2 / S1 = 2^-140 is denormal, S0 == S2
        (2.0 ** -110, 1.0, 2.0 ** -110, 2.0 ** -46, 0),  # exponent(S2) = 17 <= 23: ldexp(S0, 64)
    ]
    s0, s1, s2 = (_lanes(*[c[i] for c in cases]) for i in range(3))
    w, _ = run("gfx950", I.v_div_scale_f32(v[3], VCC, v[0], v[1], v[2]), vgpr={0: s0, 1: s1, 2: s2})
    got = as_f32(w.v[3])
    for lane, (*_, d, vcc) in enumerate(cases):
        assert (np.isnan(got[lane]) if np.isnan(d) else got[lane] == np.float32(d)), (lane, got[lane])
        assert (w.s[106] >> lane) & 1 == vcc, lane


def test_v_div_fmas_f32_is_one_fma_and_refuses_vcc():
    # (1 + 2^-12)^2 - 1 = 2^-11 + 2^-24 exactly (a single rounding; a*b then +c would give 2^-11)
    a = f32(1.0 + 2.0 ** -12)
    w, _ = run("gfx950", I.v_div_fmas_f32_e64(v[3], v[0], v[0], v[1]), vgpr={0: a, 1: f32(-1.0)},
               sgpr={106: 0, 107: 0})
    assert as_f32(w.v[3, 0]) == np.float32(2.0 ** -11 + 2.0 ** -24)
    with pytest.raises(EmuError, match="VCC set"):
        run("gfx950", I.v_div_fmas_f32_e64(v[3], v[0], v[0], v[1]), vgpr={0: a, 1: f32(-1.0)}, sgpr={106: 4})


def test_v_div_fixup_f32_cases():
    inf = float("inf")
    # (S0 quotient, S1 denominator, S2 numerator) -> D bits, by the pseudocode's branches
    cases = [
        (1.0, 2.0, 0x7F800001, 0x7FC00001),      # S2 signalling NaN -> quieted
        (1.0, 0.0, 0.0, 0xFFC00000),             # 0/0
        (1.0, inf, -inf, 0xFFC00000),            # inf/inf
        (1.0, 0.0, -5.0, 0xFF800000),            # x/0: -inf (signs differ)
        (1.0, inf, 5.0, 0x00000000),             # x/inf: +0
        (1.0, -2.0, 0.0, 0x80000000),            # 0/y: -0
        (1.0, 2.0 ** 30, 2.0 ** -126, 0x00000001),  # exponent(S2) - exponent(S1) = -156 < -150: UNDERFLOW_F32
        (3.0, 2.0, -6.0, f32(-3.0)),             # ordinary: sign_out ? -|S0| : |S0|
    ]
    s0, s1, s2 = (_lanes(*[c[i] for c in cases]) for i in range(3))
    w, _ = run("gfx950", I.v_div_fixup_f32_e64(v[3], v[0], v[1], v[2]), vgpr={0: s0, 1: s1, 2: s2})
    assert [int(x) for x in w.v[3, :len(cases)]] == [c[3] for c in cases]


@pytest.mark.parametrize("arch", ARCHS)
def test_division_sequence_is_ieee_division(arch):
    # LLVM's f32 fdiv expansion (denormals kept), as Triton's kernels contain it: correctly
    # rounded a / b for ordinary operands, so it must equal NumPy's binary32 division bit for bit.
    rng = np.random.default_rng(20)
    a = (rng.standard_normal(64) * 2.0 ** rng.integers(-30, 30, 64)).astype(np.float32)
    b = (rng.standard_normal(64) * 2.0 ** rng.integers(-30, 30, 64)).astype(np.float32)
    seq = (I.v_div_scale_f32(v[2], VCC, v[1], v[1], v[0]), I.v_div_scale_f32(v[3], VCC, v[0], v[1], v[0]),
           I.v_rcp_f32_e32(v[4], v[2]), I.v_fma_f32_e64(v[5], v[2], v[4], 1.0, neg=1),
           I.v_fma_f32_e64(v[4], v[5], v[4], v[4]), I.v_mul_f32_e32(v[5], v[3], v[4]),
           I.v_fma_f32_e64(v[6], v[2], v[5], v[3], neg=1), I.v_fma_f32_e64(v[5], v[6], v[4], v[5]),
           I.v_fma_f32_e64(v[2], v[2], v[5], v[3], neg=1), I.v_div_fmas_f32_e64(v[2], v[2], v[4], v[5]),
           I.v_div_fixup_f32_e64(v[0], v[2], v[1], v[0]))
    w, _ = run(arch, *seq, vgpr={0: a, 1: b})
    np.testing.assert_array_equal(w.v[0], (a / b).view(np.uint32))


# --- SDWA v_cndmask_b32 ----------------------------------------------------------------------------------
def test_v_cndmask_b32_sdwa():
    # D.word1 = VCC ? sext(S1.word0) : S0.byte0, word 0 preserved (dst_unused PRESERVE);
    # even lanes take S0's byte 0 (0x34), odd lanes S1's word 0 (0x8001, sign-extended: the high
    # bits fall outside the 16-bit destination field)
    inst = I.VOP2_SDWA(I.VOP2Op.V_CNDMASK_B32_E32, vdst=v[3], src0=SDWA, vsrc0=v[0], vsrc1=v[1], dst_sel=5,
                       dst_unused=2, src0_sel=0, src1_sel=4, src1_sext=1)
    odd = sum(1 << i for i in range(1, 64, 2))
    w, _ = run("gfx950", inst, vgpr={0: 0x12345634, 1: 0xFFFF8001, 3: 0xAAAABBBB},
               sgpr={106: odd & 0xFFFFFFFF, 107: odd >> 32})
    assert w.v[3, 0] == 0x0034BBBB and w.v[3, 1] == 0x8001BBBB


# --- scratch ----------------------------------------------------------------------------------------------
def _run_scratch(insts, size, vgpr, sgpr=None, exec_mask=FULL):
    code = b"".join(i.to_bytes() for i in insts) + I.s_endpgm().to_bytes()
    w = Wave()
    w.set_exec(exec_mask)
    w.scratch = np.zeros((64, size), np.uint8)
    for k, val in vgpr.items():
        w.v[k] = val
    for k, val in (sgpr or {}).items():
        w.s[k] = val
    interp.run_wave(interp.snippet(code, "gfx950"), w)
    return w


def test_scratch_store_and_load_are_per_lane():
    # ST mode (no SGPR, no VGPR offset), SS mode (s0 = 4 + offset 4 = the same byte 8) and SVE
    # (v4 = 4 * lane): each lane has its own private bytes, so lane l reads back its own values.
    lanes = np.arange(64, dtype=np.uint32)
    insts = (I.scratch_store_dword(addr=v[0], data=v[1], saddr=OFF, offset=8),
             I.scratch_load_dword(vdst=v[2], addr=v[0], saddr=s[0], offset=4),
             I.scratch_store_dwordx2(addr=v[4], data=v[6:7], saddr=OFF, offset=16, sve=1),
             I.scratch_load_dwordx2(vdst=v[8:9], addr=v[4], saddr=OFF, offset=16, sve=1),
             I.scratch_load_dword(vdst=v[10], addr=v[0], saddr=OFF, offset=16))
    w = _run_scratch(insts, 32 + 4 * 64, {1: lanes + 100, 4: lanes * 4, 6: lanes + 7, 7: lanes + 9},
                     sgpr={0: 4}, exec_mask=FULL >> 1)
    np.testing.assert_array_equal(w.v[2, :63], lanes[:63] + 100)
    np.testing.assert_array_equal(w.v[8, :63], lanes[:63] + 7)
    np.testing.assert_array_equal(w.v[9, :63], lanes[:63] + 9)
    assert w.v[10, 0] == 7 and w.v[10, 1] == 0  # lane 1 wrote at 16 + 4, lane 0 at 16
    assert not w.scratch[63].any() and w.v[2, 63] == 0  # lane 63 is off: nothing stored or loaded


def test_scratch_access_outside_the_private_segment_fails():
    with pytest.raises(EmuError, match="lane 0 accesses private bytes 60..63 outside its 60"):
        _run_scratch([I.scratch_load_dword(vdst=v[1], addr=v[0], saddr=OFF, offset=60)], 60, {})


# --- buffer loads to LDS (Triton's pipelined loads on gfx950) ---------------------------------------------
def test_buffer_load_dwordx4_to_lds():
    # LDS address of lane l = M0 + inst_offset + 16 * l (M0 = 64, offset 16); the global side reads
    # base + inst_offset + v0 = 16 + 16 * l bytes, num_records 16 + 16 * 5 + 8: lanes 0..4 in
    # range, lane 5 only its first two dwords (out-of-range dwords write 0), lane 6 and up nothing.
    # Lane 3 is off: its 16 LDS bytes are not written (0 here, as they start; that they keep other
    # bytes: test_emu_isa_memory.test_buffer_load_to_lds_leaves_the_lds_of_inactive_lanes). VGPRs are untouched.
    buf = np.arange(4 * 64 + 16, dtype=np.uint32) + 1000
    lanes = np.arange(64, dtype=np.uint32)
    inst = I.buffer_load_dwordx4(vdata=v[4:7], vaddr=v[0], srsrc=s[4:7], soffset=ZERO, offen=1, offset=16, lds=1)
    code = inst.to_bytes() + I.s_endpgm().to_bytes()
    w = Wave()
    w.set_exec(FULL & ~(1 << 3))
    for k, val in {**_rsrc_sgprs(buf.ctypes.data, 16 + 16 * 5 + 8), 124: 64}.items():  # 124: M0
        w.s[k] = val
    w.v[0] = lanes * 16
    w.v[4] = 7
    interp.run_wave(interp.snippet(code, "gfx950"), w, Memory(), lds_bytes=64 + 16 + 16 * 64)
    lds = w.wg.lds[64 + 16:].view(np.uint32).reshape(64, 4)
    for lane in (0, 1, 2, 4):
        np.testing.assert_array_equal(lds[lane], buf[4 + 4 * lane:8 + 4 * lane])
    assert list(lds[5]) == [buf[24], buf[25], 0, 0]
    assert not lds[3].any() and not lds[6:].any() and not w.wg.lds[:80].any()
    assert (w.v[4] == 7).all()



def test_global_load_lds_dwordx4():
    # lane l reads the 16 bytes at buf + 16 * l (64-bit address in v[0:1], saddr off, offset 16 on
    # both sides) and writes them to LDS at M0 + 16 + 16 * l (M0 = 32); lane 2 is off.
    buf = np.arange(4 * 64 + 4, dtype=np.uint32) + 500
    addr = buf.ctypes.data + 16 * np.arange(64, dtype=np.uint64) - 16
    inst = I.global_load_lds_dwordx4(vdst=v[4:7], addr=v[0], data=v[4:7], saddr=OFF, offset=16)
    code = inst.to_bytes() + I.s_endpgm().to_bytes()
    w = Wave()
    w.set_exec(FULL & ~(1 << 2))
    w.s[124] = 32  # M0
    w.v[0], w.v[1] = addr & 0xFFFFFFFF, addr >> 32
    w.v[4] = 9
    interp.run_wave(interp.snippet(code, "gfx950"), w, Memory(), lds_bytes=48 + 16 * 64)
    lds = w.wg.lds[48:].view(np.uint32).reshape(64, 4)
    for lane in (0, 1, 3, 63):
        np.testing.assert_array_equal(lds[lane], buf[4 * lane:4 * lane + 4])
    assert not lds[2].any() and not w.wg.lds[:48].any() and (w.v[4] == 9).all()

def test_dispatch_packet_fields():
    # hsa_kernel_dispatch_packet_t: header u16 @0 (type 2 = kernel dispatch), setup u16 @2 (3 dims),
    # workgroup_size_x/y/z u16 @4/6/8, grid_size_x/y/z u32 @12/16/20 (work-items), private and
    # group segment sizes u32 @24/28, kernarg_address u64 @40; read-only in memory for the launch.
    info = SimpleNamespace(private_segment_fixed_size=48, group_segment_fixed_size=1024)
    mem = Memory(strict=True)
    packet = interp.DispatchPacket(info, (5, 2, 1), (256, 1, 1), 0x1234_5678_9ABC, 512, mem)
    f = packet.buffer
    assert list(f[0:10].view(np.uint16)) == [2, 3, 256, 1, 1]
    assert list(f[12:32].view(np.uint32)) == [1280, 2, 1, 48, 1536]
    assert f[40:48].view(np.uint64)[0] == 0x1234_5678_9ABC
    assert mem.read(packet.address, 64).tobytes() == f.tobytes()
    with pytest.raises(EmuMemoryError):
        mem.check(np.array([packet.address], np.uint64), 4, write=True)
    packet.close()
    with pytest.raises(EmuMemoryError):
        mem.read(packet.address, 4)
