"""Per-instruction tests of the flyquant.emu interpreter (decode + semantics), gfx942 and gfx950.

Each test assembles a few instructions with tinygrad's CDNA instruction classes (an encoder
independent of flyquant's decoder), runs them as one wave with registers set by the test, and
compares with values derived by hand from the ISA guide's pseudocode
(tinygrad/runtime/autogen/amd/cdna/str_pcode.py); the derivation is in the comments.
"""

from __future__ import annotations

import re
import struct

import emu_kernels as K
import numpy as np
import pytest
import torch
from tinygrad.renderer.amd.dsl import DPP, SDWA, s, src, v
from tinygrad.runtime.autogen.amd.cdna import ins as I

from flyquant import toolchain
from flyquant.emu import codeobject, interp
from flyquant.emu.alloc import aligned
from flyquant.emu.isa_base import AGPR_BASE, EmuError, Wave
from flyquant.emu.memory import Memory

ARCHS = ("gfx942", "gfx950")
FULL = (1 << 64) - 1
LANES = np.arange(64)
OFF = src[0x7F]  # GLOBAL saddr "off"
ZERO = src[128]  # inline constant 0 as a scalar operand


def f32(x: float) -> int:
    return struct.unpack("<I", struct.pack("<f", x))[0]


def as_f32(bits) -> np.ndarray:
    return np.asarray(bits, np.uint32).view(np.float32)


def run(arch, *insts, sgpr=None, vgpr=None, agpr=None, exec_mask=FULL, scc=0, lds=0, memory=None, budget=10_000):
    """Run `insts` + s_endpgm as one wave; returns (wave, stats)."""
    code = b"".join(i.to_bytes() for i in insts) + I.s_endpgm().to_bytes()
    prog = interp.snippet(code, arch)
    w = Wave()
    w.set_exec(exec_mask)
    w.scc = scc
    for k, val in (sgpr or {}).items():
        w.s[k] = val & 0xFFFFFFFF
    for k, val in (vgpr or {}).items():
        val = np.asarray(val)
        w.v[k] = val.view(np.uint32) if val.dtype == np.float32 else val.astype(np.uint32)
    for k, val in (agpr or {}).items():
        w.v[AGPR_BASE + k] = val
    stats = interp.run_wave(prog, w, memory, lds, budget)
    return w, stats


def u64(w, r):
    return w.v[r].astype(np.uint64) | (w.v[r + 1].astype(np.uint64) << np.uint64(32))


# --- decoding and errors ---------------------------------------------------------------------------
@pytest.mark.parametrize("arch", ARCHS)
def test_unknown_instruction_is_an_error_naming_it(arch):
    # v_mfma_f64_16x16x4_f64 decodes but is not modelled: executing it must raise with its text
    # and the byte offset (8: after the 8-byte v_mov_b32 with a literal).
    with pytest.raises(EmuError, match=r"v_mfma_f64_16x16x4_f64.*offset 0x8 "):
        run(arch, I.v_mov_b32_e32(v[0], 0x12345), I.v_mfma_f64_16x16x4_f64(v[0:7], v[8:9], v[10:11], v[0:7]))


def test_gfx950_only_instruction_rejected_on_gfx942():
    inst = I.v_cvt_pk_bf16_f32(v[0], v[1], v[2])
    with pytest.raises(EmuError, match="v_cvt_pk_bf16_f32 is a gfx950-only instruction"):
        run("gfx942", inst)
    run("gfx950", inst)


def test_endless_wave_is_an_error():
    # s_branch -1: branch to itself (target = pc + 4 + 4 * -1)
    # the message names the variable that sets the limit (it did not: a legitimately long wave
    # gave no hint of how to raise it)
    with pytest.raises(EmuError, match="without ending .* needs a larger FLYQUANT_EMU_MAX_WAVE_INSTRUCTIONS"):
        run("gfx942", I.s_branch(simm16=0xFFFF), budget=1000)


def test_undecodable_word_only_fails_when_executed():
    # an s_branch over a garbage word: the garbage is never executed, so the run succeeds;
    # jumping onto it fails with "cannot decode".
    code_ok = I.s_branch(simm16=1).to_bytes() + bytes.fromhex("ffffffff") + I.s_endpgm().to_bytes()
    w = Wave()
    interp.run_wave(interp.snippet(code_ok, "gfx942"), w)
    assert w.done
    code_bad = bytes.fromhex("ffffffff") + I.s_endpgm().to_bytes()
    with pytest.raises(EmuError, match="cannot decode"):
        interp.run_wave(interp.snippet(code_bad, "gfx942"), Wave())


def test_instruction_modules_import_neither_interpreter_nor_runtime():
    # The instruction modules only register builders into `table`; the interpreter reads it.
    import ast
    import pathlib

    from flyquant.emu import table

    for path in sorted(pathlib.Path(interp.__file__).parent.glob("isa_*.py")):
        imported = set()
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.ImportFrom) and node.level == 1:
                imported.add(node.module or "")
                imported.update(alias.name for alias in node.names if node.module is None)
        assert not imported & {"interp", "runtime"}, (path.name, imported)
    with pytest.raises(ValueError, match="registered twice: v_nop"):
        table.register({"v_nop": None})


# The decoder against LLVM: FlyDSL's dump has LLVM's own listing of the code object it links.
# Every decoded instruction must have LLVM's mnemonic (the _e32/_e64 suffixes LLVM omits when
# unambiguous are ignored) and, for ALU encodings, the same registers in the same order.
_REGISTERS = re.compile(r"\b[vsa]\[\d+:\d+\]|\b[vsa]\d+\b")
_ALU_ENCODINGS = {"VOP1", "VOP2", "VOPC", "VOP3", "VOP3SD", "VOP3P", "MAI", "SOP1", "SOP2", "SOPC", "SOPK"}


def _llvm_listing(isa: str) -> list[str]:
    body = isa.split(".Lfunc_end")[0]
    lines = (line.strip() for line in body.splitlines())
    return [line for line in lines if line and not line.startswith((".", ";")) and not line.endswith(":")]


def _mnemonic(text: str) -> str:
    return text.split()[0].replace("_e32", "").replace("_e64", "")


def _registers(text: str) -> list[str]:
    return _REGISTERS.findall(text.split(None, 1)[1]) if " " in text else []


@pytest.mark.parametrize("arch", ARCHS)
def test_decoder_matches_llvm_listing(arch, tmp_path, monkeypatch):
    # the end-to-end test kernels: SMEM, VALU with literals/VOP3/VOP3P, DS, cross-lane, MFMA,
    # global and buffer memory; built fresh (__wrapped__) so they compile and dump
    for name, value in dict(COMPILE_ONLY="1", FLYDSL_DUMP_IR="1", FLYDSL_DUMP_DIR=str(tmp_path),
                            FLYDSL_RUNTIME_ENABLE_CACHE="0").items():
        monkeypatch.setenv(name, value)
    with toolchain.target(arch):
        K.vector_add.__wrapped__(arch)(*(torch.zeros(20, 100) for _ in range(3)), stream=0)
        K.block_sum.__wrapped__(arch)(torch.zeros(512), torch.zeros(2), 2, stream=0)
        K.wave_shuffles.__wrapped__(arch)(torch.zeros(64, dtype=torch.int32), torch.zeros(256, dtype=torch.int32),
                                          stream=0)
        K.mfma_tile.__wrapped__(arch, "bf16")(torch.zeros(32, 64, dtype=torch.bfloat16),
                                              torch.zeros(32, 64, dtype=torch.bfloat16), torch.zeros(32, 32), 64,
                                              stream=0)
        K.buffer_tail.__wrapped__(arch)(torch.zeros(100), torch.zeros(100), torch.zeros(512), 2, stream=0)
    kernels = K.dumped_kernels(tmp_path)
    assert len(kernels) == 5
    for name, (elf, isa) in kernels.items():
        prog = interp.program(codeobject.load(elf), name)
        mine = [inst for inst in prog.insts if inst is not None]
        llvm = _llvm_listing(isa)
        assert len(mine) == len(llvm), name
        for theirs, inst in zip(llvm, mine):
            assert _mnemonic(theirs) == _mnemonic(inst.text), (name, theirs, inst.text)
            if inst.enc in _ALU_ENCODINGS:
                assert _registers(theirs) == _registers(inst.text), (name, theirs, inst.text)


# --- scalar ALU --------------------------------------------------------------------------------------
def test_s_add_u32_carry_and_s_addc():
    # 0xFFFFFFFF + 1 = 0x1_00000000: D = 0, SCC = 1; then s_addc_u32 2 + 3 + SCC = 6, no carry
    w, _ = run("gfx942", I.s_add_u32(s[2], s[0], s[1]), I.s_addc_u32(s[3], s[4], s[5]),
               sgpr={0: 0xFFFFFFFF, 1: 1, 4: 2, 5: 3})
    assert (w.s[2], w.s[3], w.scc) == (0, 6, 0)


def test_s_sub_i32_signed_overflow():
    # 0x80000000 (-2^31) - 1 overflows: D = 0x7FFFFFFF, SCC = 1 (operand signs differ and the
    # result's sign differs from S0's)
    w, _ = run("gfx942", I.s_sub_i32(s[2], s[0], 1), sgpr={0: 0x80000000})
    assert (w.s[2], w.scc) == (0x7FFFFFFF, 1)


def test_s_shifts_mask_the_amount_and_set_scc():
    # s_lshl_b32 by 33 uses 33 & 31 = 1; s_ashr_i32 of -8 by 1 = -4; s_lshr_b64 by 36 (& 63)
    w, _ = run("gfx942", I.s_lshl_b32(s[2], s[0], s[1]), I.s_ashr_i32(s[3], s[4], 1),
               I.s_lshr_b64(s[6:7], s[8:9], 36),
               sgpr={0: 3, 1: 33, 4: (-8) & 0xFFFFFFFF, 8: 0, 9: 0x30})
    assert (w.s[2], w.s[3]) == (6, (-4) & 0xFFFFFFFF)
    assert (w.s[6], w.s[7], w.scc) == (3, 0, 1)  # 0x30_00000000 >> 36 = 3


def test_s_bfe_u32_and_i32():
    # control: offset S1[4:0] = 4, width S1[22:16] = 8: field = (0xABCD >> 4) & 0xFF = 0xBC;
    # signed: 0xBC sign-extended from 8 bits = -68
    ctl = 4 | (8 << 16)
    w, _ = run("gfx942", I.s_bfe_u32(s[2], s[0], s[1]), I.s_bfe_i32(s[3], s[0], s[1]), sgpr={0: 0xABCD, 1: ctl})
    assert w.s[2] == 0xBC and w.s[3] == (0xBC - 256) & 0xFFFFFFFF and w.scc == 1


def test_s_and_saveexec_b64():
    # saveexec: D = old EXEC; EXEC = S0 & EXEC; SCC = EXEC != 0
    w, _ = run("gfx942", I.s_and_saveexec_b64(s[4:5], s[0:1]), sgpr={0: 0xF0F0, 1: 0x1}, exec_mask=0x1_0000FF00)
    assert w.exec_value() == 0x1_0000F000 and (w.s[4], w.s[5]) == (0xFF00, 1) and w.scc == 1
    assert w.exec_mask.sum() == 5


def test_s_cmp_and_conditional_branch():
    # s_cmp_lt_i32 -1 < 1 (signed) sets SCC; s_cbranch_scc1 skips the s_mov_b32 that would set s2
    w, _ = run("gfx942", I.s_cmp_lt_i32(s[0], 1), I.s_cbranch_scc1(simm16=1), I.s_mov_b32(s[2], 7),
               sgpr={0: 0xFFFFFFFF, 2: 0})
    assert w.scc == 1 and w.s[2] == 0


def test_s_cbranch_execz_skips_when_no_lane_is_active():
    w, _ = run("gfx942", I.s_cbranch_execz(simm16=1), I.s_mov_b32(s[2], 7), exec_mask=0)
    assert w.s[2] == 0


def test_s_movk_addk_and_ff1():
    # s_movk_i32 0xFFFE sign-extends to -2; s_addk_i32 0x7FFFFFFF + 1 overflows (SCC = 1);
    # s_ff1_i32_b64 of 0 is -1, of 0x1_00000000 is 32
    w, _ = run("gfx942", I.s_movk_i32(s[0], simm16=0xFFFE), I.s_addk_i32(s[1], simm16=1),
               I.s_ff1_i32_b64(s[2], s[4:5]), I.s_ff1_i32_b64(s[3], s[6:7]),
               sgpr={1: 0x7FFFFFFF, 4: 0, 5: 0, 6: 0, 7: 1})
    assert w.s[0] == 0xFFFFFFFE and w.s[1] == 0x80000000 and w.scc == 1
    assert w.s[2] == 0xFFFFFFFF and w.s[3] == 32


def test_s_mul_hi_i32_negative():
    # (-3) * 0x40000000 = -0xC0000000 -> high word 0xFFFFFFFF (floor of -0.75)
    w, _ = run("gfx942", I.s_mul_hi_i32(s[2], s[0], s[1]), sgpr={0: (-3) & 0xFFFFFFFF, 1: 0x40000000})
    assert w.s[2] == 0xFFFFFFFF


# --- vector ALU: floats --------------------------------------------------------------------------------
@pytest.mark.parametrize("arch", ARCHS)
def test_f32_denormals_are_kept(arch):
    # FlyDSL kernels run with f32 denormals enabled: 2^-149 + 2^-149 = 2^-148 (bits 2);
    # 2^-126 * 0.5 = 2^-127 (bits 0x00400000), not flushed to 0.
    w, _ = run(arch, I.v_add_f32_e32(v[2], v[0], v[0]), I.v_mul_f32_e32(v[3], 0.5, v[1]),
               vgpr={0: 1, 1: 0x00800000})
    assert (w.v[2] == 2).all() and (w.v[3] == 0x00400000).all()


def test_v_max_min_f32_nan_and_signed_zero():
    # IEEE mode: a quiet NaN operand is dropped; a signalling NaN comes back quieted (bit 22 set);
    # max(+0, -0) = +0 and min(+0, -0) = -0 in either operand order.
    qnan, snan = 0x7FC00000, 0x7F800001
    a = np.array([qnan, f32(1.0), snan, 0x00000000, 0x80000000] + [0] * 59, np.uint32)
    b = np.array([f32(1.0), qnan, f32(1.0), 0x80000000, 0x00000000] + [0] * 59, np.uint32)
    w, _ = run("gfx942", I.v_max_f32_e32(v[2], v[0], v[1]), I.v_min_f32_e32(v[3], v[0], v[1]), vgpr={0: a, 1: b})
    assert list(w.v[2, :5]) == [f32(1.0), f32(1.0), 0x7FC00001, 0, 0]
    assert list(w.v[3, :5]) == [f32(1.0), f32(1.0), 0x7FC00001, 0x80000000, 0x80000000]


def test_v_fma_f32_single_rounding():
    # (1 + 2^-23)^2 - (1 + 2^-22) = 2^-46 exactly with one rounding; an unfused multiply would
    # round the product to 1 + 2^-22 and give 0.
    x = f32(1.0) + 1
    w, _ = run("gfx942", I.v_fma_f32_e64(v[3], v[0], v[0], v[1]), vgpr={0: x, 1: f32(1.0) + 2 | 0x80000000})
    assert as_f32(w.v[3][0]) == np.float32(2.0**-46)


def test_v_fma_f32_avoids_double_rounding():
    # a = 1 + 2^-23, b = 1.5: a*b = 1.5 + 2^-23 + 2^-24 (a tie between 1.5 + 2^-23 and 1.5 + 2^-22);
    # c = -2^-80 puts the exact sum just below the tie, so the correct result is 1.5 + 2^-23
    # (0x3FC00001). Rounding first to binary64 would lose c and round the tie to even (0x3FC00002).
    w, _ = run("gfx942", I.v_fma_f32_e64(v[3], v[0], v[1], v[2]),
               vgpr={0: f32(1.0) + 1, 1: f32(1.5), 2: f32(-(2.0**-80))})
    assert w.v[3][0] == 0x3FC00001


def test_vop3_neg_abs_flip_sign_bits_even_of_nan():
    # v_mul_f32_e64 v2, -v0, |v1|: neg and abs act on the sign bit; -NaN * 2 keeps the sign
    w, _ = run("gfx942", I.v_mul_f32_e64(v[2], -v[0], abs(v[1])), I.v_mov_b32_e64(v[3], v[0]),
               vgpr={0: np.array([f32(3.0), 0x7FC00000] + [0] * 62), 1: f32(-2.0)})
    assert as_f32(w.v[2][0]) == -6.0 and w.v[2][1] == 0xFFC00000


def test_vop3_clamp_float_and_integer():
    # f32 clamp: 1.5 -> 1.0, -2 -> 0, NaN -> 0 (DX10 clamp); u32 clamp saturates 0xFFFFFFFF + 2
    a = np.array([f32(1.5), f32(-2.0), 0x7FC00000] + [0] * 61, np.uint32)
    w, _ = run("gfx942", I.v_add_f32_e64(v[2], v[0], 0, clmp=1), I.v_add_u32_e64(v[3], v[1], 2, clmp=1),
               vgpr={0: a, 1: 0xFFFFFFFF})
    assert list(w.v[2, :3]) == [f32(1.0), 0, 0] and (w.v[3] == 0xFFFFFFFF).all()


def test_omod_multiplies_the_result():
    # omod 1: x2, omod 3: /2
    w, _ = run("gfx942", I.v_add_f32_e64(v[2], v[0], 1.0, omod=1), I.v_add_f32_e64(v[3], v[0], 1.0, omod=3),
               vgpr={0: f32(2.0)})
    assert as_f32(w.v[2][0]) == 6.0 and as_f32(w.v[3][0]) == 1.5


def test_v_maximum3_propagates_nan_f32_and_packed_f16():
    # IEEE 754-2019 maximum (gfx950): any NaN operand gives NaN; +0 > -0. Packed f16: per half,
    # with neg on S2 (the kernels' max(x, -x) = |x| idiom); halves (lo, hi) = (-2.0, NaN) / (1.0, 3.0)
    w, _ = run("gfx950", I.v_maximum3_f32(v[3], v[0], v[1], v[2]),
               I.v_pk_maximum3_f16(v[6], v[4], v[5], -v[5]),
               vgpr={0: np.array([f32(1.0), 0x80000000] + [0] * 62, np.uint32),
                     1: np.array([0x7FC00000, 0x00000000] + [0] * 62, np.uint32), 2: f32(-5.0),
                     4: 0x7E00C000, 5: 0x42003C00})
    assert w.v[3, 0] & 0x7FC00000 == 0x7FC00000 and w.v[3, 1] == 0  # NaN; max(-0, +0, -5) = +0
    lo, hi = int(w.v[6, 0]) & 0xFFFF, int(w.v[6, 0]) >> 16
    assert lo == 0x3C00 and hi & 0x7E00 == 0x7E00  # max(-2, 1, -1) = 1.0; NaN in the high half


def test_v_med3_f32_with_nan_is_min3():
    w, _ = run("gfx942", I.v_med3_f32_e64(v[3], v[0], v[1], v[2]),
               vgpr={0: np.array([f32(5.0), 0x7FC00000] + [0] * 62, np.uint32), 1: f32(-1.0), 2: f32(2.0)})
    assert as_f32(w.v[3, 0]) == 2.0 and as_f32(w.v[3, 1]) == -1.0  # med3(5, -1, 2); NaN: min(-1, 2)


def test_packed_u16_clamp_saturates():
    # v_pk_sub_u16 with clamp: 3 - 5 -> 0 (not 0xFFFE), 0x8000 - 1 -> 0x7FFF
    w, _ = run("gfx942", I.v_pk_sub_u16(v[2], v[0], v[1], clmp=1), vgpr={0: 0x80000003, 1: 0x00010005})
    assert w.v[2, 0] == 0x7FFF0000


def test_sdwa_compare_with_sgpr_src1():
    # v_cmp_gt_u32_sdwa s[2:3], v0, s5 src0_sel:WORD_1: the S1 bit makes vsrc1 name s5
    inst = I.VOPC_SDWA_SDST(I.VOPCOp.V_CMP_GT_U32_E32, src0=SDWA, vsrc0=v[0], vsrc1=v[5], sdst=s[2], sd=1,
                            src0_sel=5, src1_sel=6, s1=1)
    w, _ = run("gfx942", inst, sgpr={5: 7}, vgpr={0: (LANES << 16).astype(np.uint32)})
    assert (w.s[2], w.s[3]) == ((1 << 32) - (1 << 8), (1 << 32) - 1)  # lanes 8..63 have lane > 7


def test_v_cvt_scalef32_pk_fp8_bf16_halves():
    # S0 = bf16 {hi: 6.0 (0x40C0), lo: -1.0 (0xBF80)}, scale 2.0 (exponent 128): 3.0 -> 0x44,
    # -0.5 -> 0xB0 (OCP E4M3: 0.5 = 2^-1 -> exponent field 6)
    w, _ = run("gfx950", I.v_cvt_scalef32_pk_fp8_bf16(v[2], v[0], v[1]), vgpr={0: 0x40C0BF80, 1: f32(2.0)})
    assert int(w.v[2, 0]) & 0xFFFF == 0x44B0


def test_f32_denormal_flush_mode_from_the_descriptor():
    # with FLOAT_DENORM_MODE_32 = 0 (flush inputs and outputs) 2^-149 + 2^-149 gives +0; FlyDSL's
    # mode 3 keeps them (test_f32_denormals_are_kept)
    class FlushingKd:
        float_denorm_mode_32, enable_ieee_mode, enable_dx10_clamp, fp16_overflow = 0, True, True, False

    prog = interp.snippet(I.v_add_f32_e32(v[2], v[0], v[0]).to_bytes() + I.s_endpgm().to_bytes(), "gfx942",
                          kd=FlushingKd())
    w = Wave()
    w.set_exec(FULL)
    w.v[0] = 1
    interp.run_wave(prog, w)
    assert (w.v[2] == 0).all()


def test_v_rcp_f32_of_zero_and_inf():
    w, _ = run("gfx942", I.v_rcp_f32_e32(v[2], v[0]), vgpr={0: np.array([0, 0x80000000, 0x7F800000] + [0] * 61)})
    assert list(w.v[2, :3]) == [0x7F800000, 0xFF800000, 0]


# --- vector ALU: integers, bits ------------------------------------------------------------------------
def test_v_add_co_carry_chain_into_vcc():
    # lane 0: 0xFFFFFFFF + 1 carries; v_addc then adds that carry into the high words
    lo = np.full(64, 5, np.uint32)
    lo[0] = 0xFFFFFFFF
    w, _ = run("gfx942", I.v_add_co_u32_e32(v[2], 1, v[0]), I.v_addc_co_u32_e32(v[3], 0, v[1]),
               vgpr={0: lo, 1: 10})
    assert w.v[2, 0] == 0 and w.v[3, 0] == 11 and w.v[2, 1] == 6 and w.v[3, 1] == 10
    assert w.s[106] == 0 and w.s[107] == 0  # v_addc's own carry-out: none


def test_vopc_writes_zero_for_inactive_lanes_and_cndmask():
    # v_cmp_gt_i32 vcc, 0, v0 with v0 = lane - 32: true for lanes < 32, EXEC has lanes 0..47;
    # v_cndmask picks S1 where VCC
    x = (LANES - 32).astype(np.int32).view(np.uint32)
    w, _ = run("gfx942", I.v_cmp_gt_i32_e32(0, v[0]), I.v_cndmask_b32_e32(v[1], 7, v[2]),
               vgpr={0: x, 2: 9}, exec_mask=(1 << 48) - 1)
    assert w.s[106] == 0xFFFFFFFF and w.s[107] == 0
    assert (w.v[1, :32] == 9).all() and (w.v[1, 32:48] == 7).all() and (w.v[1, 48:] == 0).all()


def test_v_cmpx_writes_exec():
    w, _ = run("gfx942", I.v_cmpx_gt_u32_e32(4, v[0]), vgpr={0: LANES})  # 4 > lane
    assert w.exec_value() == 0xF and w.exec_mask.sum() == 4 and (w.s[106], w.s[107]) == (0xF, 0)


def test_v_cmp_class_f32():
    # S1 bits: 1 = qNaN, 2 = -inf, 5 = -0, 7 = +denormal
    vals = np.array([0x7FC00000, 0xFF800000, 0x80000000, 0x00000001, f32(1.0)] + [0] * 59, np.uint32)
    mask = (1 << 1) | (1 << 2) | (1 << 5) | (1 << 7)
    w, _ = run("gfx942", I.v_cmp_class_f32_e64(s[0:1], v[0], v[1]), vgpr={0: vals, 1: mask})
    assert w.s[0] & 0x1F == 0b01111


def test_bitfield_ops():
    # v_bfe_u32 (0xABCD, 4, 8) = 0xBC; v_bfe_i32 sign-extends to -68; width 0 gives 0;
    # v_alignbit_b32 ({0x12345678, 0x9ABCDEF0} >> 8) low word = 0x789ABCDE;
    # v_perm_b32 sel 0x0C0D0805: bytes 0x00, 0xFF, sign of byte 1 of S1 (0xDE: 0xFF), byte 5 (0x56)
    w, _ = run("gfx942", I.v_bfe_u32_e64(v[2], v[0], 4, 8), I.v_bfe_i32_e64(v[3], v[0], 4, 8),
               I.v_bfe_u32_e64(v[4], v[0], 4, 0),
               I.v_alignbit_b32_e64(v[5], v[6], v[7], 8), I.v_perm_b32_e64(v[8], v[6], v[7], v[9]),
               vgpr={0: 0xABCD, 6: 0x12345678, 7: 0x9ABCDEF0, 9: 0x0C0D0805})
    assert w.v[2, 0] == 0xBC and w.v[3, 0] == (0xBC - 256) & 0xFFFFFFFF and w.v[4, 0] == 0
    assert w.v[5, 0] == 0x789ABCDE and w.v[8, 0] == 0x00FFFF56


def test_v_mad_u64_u32_and_lshl_add_u64():
    # 0xFFFFFFFF * 0xFFFFFFFF + 0xFFFFFFFF_FFFFFFFF overflows 64 bits: carry set;
    # v_lshl_add_u64: (0x1_00000001 << 2) + 3 = 0x4_00000007
    w, _ = run("gfx942", I.v_mad_u64_u32(v[2:3], s[0:1], v[0], v[0], v[4:5]),
               I.v_lshl_add_u64(v[6:7], v[8:9], 2, 3),
               vgpr={0: 0xFFFFFFFF, 4: 0xFFFFFFFF, 5: 0xFFFFFFFF, 8: 1, 9: 1})
    expected = (0xFFFFFFFF * 0xFFFFFFFF + 0xFFFFFFFFFFFFFFFF) & ((1 << 64) - 1)
    assert int(u64(w, 2)[0]) == expected and w.s[0] == 0xFFFFFFFF and w.s[1] == 0xFFFFFFFF
    assert int(u64(w, 6)[0]) == 0x4_00000007


def test_v_mad_i64_i32_bit64_is_the_sign():
    # {D1, D0} = 65-bit S0*S1 + S2: (-1) * 1 + 0 = -1 -> D0 = 0xFFFF...F, D1 (bit 64) = 1 (negative);
    # 2 * 3 + (-7) = -1 likewise; 2 * 3 + 1 = 7: D1 = 0
    s0 = np.array([-1, 2, 2] + [0] * 61, np.int64).astype(np.int32).view(np.uint32)
    s1 = np.array([1, 3, 3] + [0] * 61, np.uint32)
    s2 = np.array([0, -7, 1] + [0] * 61, np.int64)
    w, _ = run("gfx942", I.v_mad_i64_i32(v[4:5], s[0:1], v[0], v[1], v[2:3]),
               vgpr={0: s0, 1: s1, 2: s2.view(np.uint32)[0::2], 3: s2.view(np.uint32)[1::2]})
    assert [int(x) for x in u64(w, 4)[:3]] == [(1 << 64) - 1, (1 << 64) - 1, 7]
    assert w.s[0] & 0b111 == 0b011


def test_v_mul_hi_and_24bit():
    w, _ = run("gfx942", I.v_mul_hi_u32(v[2], v[0], v[0]), I.v_mul_u32_u24_e32(v[3], v[1], v[1]),
               vgpr={0: 0xFFFFFFFF, 1: 0x01000003})  # u24 ignores bit 24: 3 * 3
    assert w.v[2, 0] == 0xFFFFFFFE and w.v[3, 0] == 9


def test_v_bitop3_truth_table_gfx950():
    # table 0xC8 = S1 & (S0 | S2) (bit i = f(S0, S1, S2) at i = 4*S0 + 2*S1 + S2); the table is
    # carried in OMOD[1:0], ABS[2:0], NEG[2:0] = 0b11, 0b001, 0b000
    inst = I.v_bitop3_b32(v[3], v[0], v[1], v[2], omod=3, abs=1, neg=0)
    w, _ = run("gfx950", inst, vgpr={0: 0xF0F0F0F0, 1: 0xFF00FF00, 2: 0xAAAAAAAA})
    assert w.v[3, 0] == (0xFF00FF00 & (0xF0F0F0F0 | 0xAAAAAAAA))


def test_16bit_op_sel_reads_high_halves():
    # v_pack_b32_f16 with op_sel [1, 1]: D = {S1.hi, S0.hi}
    w, _ = run("gfx942", I.v_pack_b32_f16(v[2], v[0], v[1], opsel=0b11), vgpr={0: 0xAAAA1111, 1: 0xBBBB2222})
    assert w.v[2, 0] == 0xBBBBAAAA


def test_exec_masked_write_keeps_inactive_lanes():
    w, _ = run("gfx942", I.v_mov_b32_e32(v[1], 5), vgpr={1: 3}, exec_mask=0xF)
    assert (w.v[1, :4] == 5).all() and (w.v[1, 4:] == 3).all()


# --- cross-lane ----------------------------------------------------------------------------------------
def test_dpp_quad_perm_and_row_shr_bound_ctrl():
    # quad_perm [1,0,3,2] (ctrl 0xB1) swaps neighbours; row_shr:1 (0x111) with bound_ctrl reads 0
    # at the first lane of each row; without bound_ctrl those lanes keep their old value.
    x = LANES + 100
    def mov_dpp(dst, ctrl, bound_ctrl):
        return I.VOP1_DPP16(I.VOP1Op.V_MOV_B32_E32, vdst=v[dst], src0=DPP, vsrc0=v[0], dpp=ctrl, row_mask=0xF,
                            bank_mask=0xF, bc=bound_ctrl)

    w, _ = run("gfx942", mov_dpp(1, 0xB1, 0), mov_dpp(2, 0x111, 1), mov_dpp(3, 0x111, 0), vgpr={0: x, 3: 7})
    assert (w.v[1] == (LANES ^ 1) + 100).all()
    expect_shr = np.where(LANES % 16 == 0, 0, LANES - 1 + 100)
    assert (w.v[2] == expect_shr).all()
    assert (w.v[3] == np.where(LANES % 16 == 0, 7, LANES - 1 + 100)).all()


def test_dpp_row_mask_and_add():
    # v_add_f32_dpp with row_mask 0x5: only rows 0 and 2 are written; src0 = row_mirror (0x140)
    x = as_f32(np.array([f32(float(i)) for i in range(64)], np.uint32))
    inst = I.VOP2_DPP16(I.VOP2Op.V_ADD_F32_E32, vdst=v[2], src0=DPP, vsrc0=v[0], vsrc1=v[1], dpp=0x140,
                        row_mask=0x5, bank_mask=0xF, bc=0)
    w, _ = run("gfx942", inst, vgpr={0: x, 1: np.float32(1000.0) * np.ones(64, np.float32), 2: 0})
    mirror = (LANES & ~15) + 15 - (LANES & 15)
    rows = LANES // 16
    expect = np.where((rows == 0) | (rows == 2), mirror + 1000.0, 0.0)
    got = np.where((rows == 0) | (rows == 2), as_f32(w.v[2]), 0.0)
    assert np.array_equal(got, expect) and (w.v[2][(rows == 1) | (rows == 3)] == 0).all()


def test_sdwa_byte_select():
    # v_add_u32_sdwa v2, v0, v1 src0_sel:BYTE_3: (0xAB000000 >> 24) + 5 = 0xB0
    inst = I.VOP2_SDWA(I.VOP2Op.V_ADD_U32_E32, vdst=v[2], src0=SDWA, vsrc0=v[0], vsrc1=v[1], dst_sel=6,
                       dst_unused=0, src0_sel=3, src1_sel=6)
    w, _ = run("gfx942", inst, vgpr={0: 0xAB000000, 1: 5})
    assert (w.v[2] == 0xB0).all()


def test_readlane_readfirstlane_writelane_mbcnt():
    # readfirstlane takes the lowest active lane (3); writelane writes lane 5 whatever EXEC;
    # mbcnt_lo/hi of all ones counts the lanes below: lane l -> l
    # tinygrad's classes only take VGPR destinations here: the vdst field (0 / 1) is the SGPR
    w, _ = run("gfx942", I.VOP1(I.VOP1Op.V_READFIRSTLANE_B32_E32, vdst=v[0], src0=v[0]),
               I.v_readlane_b32(v[1], v[0], 17), I.v_writelane_b32(v[1], s[2], 5),
               I.v_mbcnt_lo_u32_b32(v[2], -1, 0), I.v_mbcnt_hi_u32_b32(v[2], -1, v[2]),
               sgpr={2: 77}, vgpr={0: LANES * 10}, exec_mask=FULL & ~0b111)
    assert w.s[0] == 30 and w.s[1] == 170 and w.v[1, 5] == 77
    assert (w.v[2, 3:] == LANES[3:]).all()


def test_ds_bpermute_permute_and_swizzle():
    # bpermute pulls from lane addr/4 (an inactive source lane reads 0); permute pushes;
    # swizzle quad mode 0x801B: lane i of a quad reads quad lane 3 - i (sel [3,2,1,0] = 0x1B)
    addr = ((63 - LANES) * 4).astype(np.uint32)
    w, _ = run("gfx942", I.ds_bpermute_b32(v[2], v[1], v[0]), I.ds_permute_b32(v[3], v[1], v[0]),
               I.ds_swizzle_b32(v[4], v[0], offset0=0x1B, offset1=0x80), vgpr={0: LANES + 1000, 1: addr},
               exec_mask=FULL & ~1)
    assert w.v[2, 1] == 62 + 1000 and w.v[2, 63] == 0  # lane 63 pulls lane 0, which is inactive
    assert w.v[3, 62] == 1 + 1000 and w.v[3, 63] == 0  # lane 1 pushed to 62; nothing pushed to 63
    assert w.v[4, 1] == 2 + 1000 and w.v[4, 4] == 7 + 1000


def test_permlane32_swap_gfx950():
    # swaps lanes 32..63 of vdst with lanes 0..31 of src0
    w, _ = run("gfx950", I.v_permlane32_swap_b32_e32(v[0], v[1]), vgpr={0: LANES, 1: LANES + 100})
    assert (w.v[0, 32:] == LANES[:32] + 100).all() and (w.v[1, :32] == LANES[32:]).all()
    assert (w.v[0, :32] == LANES[:32]).all()


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


# --- memory -------------------------------------------------------------------------------------------
def _rsrc_sgprs(base: int, num_records: int) -> dict:
    """A raw buffer resource in s[4:7]: base, stride 0, num_records (bytes), FlyDSL's flags."""
    return {4: base & 0xFFFFFFFF, 5: (base >> 32) & 0xFFFF, 6: num_records, 7: (7 << 12) | (4 << 15)}


@pytest.mark.parametrize("arch", ARCHS)
def test_buffer_load_out_of_range_reads_zero_per_dword(arch):
    # num_records 40 bytes: lane l loads dwordx2 at byte 8*l (+ inst offset 0); dword d of lane l
    # is in range iff 8*l + 4*d + 4 <= 40. soffset (64 bytes, s8) is not part of the check.
    buf = np.arange(100, dtype=np.uint32) + 1000
    mem = Memory()
    sg = {**_rsrc_sgprs(buf.ctypes.data, 40), 8: 16}
    inst = I.buffer_load_dwordx2(vdata=v[2:3], vaddr=v[0], srsrc=s[4:7], soffset=s[8], offen=1, offset=0)
    w, stats = run(arch, inst, sgpr=sg, vgpr={0: LANES * 8, 2: 7, 3: 7}, memory=mem)
    for lane in range(8):
        for d in range(2):
            ok = 8 * lane + 4 * d + 4 <= 40
            assert w.v[2 + d, lane] == (buf[4 + 2 * lane + d] if ok else 0), (lane, d)
    assert stats.memory["buffer_load_dwordx2"].bytes == 5 * 8


@pytest.mark.parametrize("arch", ARCHS)
def test_buffer_store_out_of_range_is_dropped_and_dwordx3(arch):
    # dwordx3 stores at 12*l, num_records 30: dword d of lane l is written iff 12l + 4d + 4 <= 30:
    # lanes 0 and 1 write all three, lane 2 only its first (24 + 4 <= 30 < 28 + 4)
    buf = np.zeros(64, np.uint32)
    mem = Memory()
    inst = I.buffer_store_dwordx3(vdata=v[2:4], vaddr=v[0], srsrc=s[4:7], soffset=ZERO, offen=1, offset=0)
    vg = {0: LANES * 12, 2: LANES + 1, 3: LANES + 100, 4: LANES + 200}
    run(arch, inst, sgpr=_rsrc_sgprs(buf.ctypes.data, 30), vgpr=vg, memory=mem)
    assert list(buf[:9]) == [1, 100, 200, 2, 101, 201, 3, 0, 0]


@pytest.mark.parametrize("arch", ARCHS)
def test_buffer_sub_dword_loads_and_d16(arch):
    # ubyte zero-extends, sbyte sign-extends, short_d16_hi writes bits 31:16 and keeps 15:0
    data = np.array([0x80, 0x7F, 0xFE, 0xFF], np.uint8)
    mem = Memory()
    sg = _rsrc_sgprs(data.ctypes.data, 4)
    w, _ = run(arch, I.buffer_load_ubyte(vdata=v[1], vaddr=v[0], srsrc=s[4:7], soffset=ZERO, offset=0),
               I.buffer_load_sbyte(vdata=v[2], vaddr=v[0], srsrc=s[4:7], soffset=ZERO, offset=0),
               I.buffer_load_short_d16_hi(vdata=v[3], vaddr=v[0], srsrc=s[4:7], soffset=ZERO, offset=2),
               I.buffer_load_ubyte(vdata=v[4], vaddr=v[0], srsrc=s[4:7], soffset=ZERO, offset=4),
               I.buffer_load_dword(vdata=v[5], vaddr=v[0], srsrc=s[4:7], soffset=ZERO, offset=2),
               sgpr=sg, vgpr={3: 0x1234, 4: 9, 5: 9}, memory=mem)
    assert w.v[1, 0] == 0x80 and w.v[2, 0] == 0xFFFFFF80 and w.v[3, 0] == 0xFFFE1234
    assert w.v[4, 0] == 0  # byte 4 is out of range (num_records 4)
    assert w.v[5, 0] == 0  # a dword at bytes 2..5 crosses num_records: all of it reads 0


@pytest.mark.parametrize("arch", ARCHS)
def test_global_loads_stores_x3_and_d16_hi(arch):
    src_buf = np.arange(64 * 3, dtype=np.uint32)
    dst = np.zeros(64, np.uint16)
    mem = Memory()
    addr = src_buf.ctypes.data + LANES.astype(np.uint64) * 12
    daddr = dst.ctypes.data + LANES.astype(np.uint64) * 2
    w, stats = run(arch, I.global_load_dwordx3(vdst=v[4:6], addr=v[0], saddr=OFF, offset=0),
                   I.global_store_short_d16_hi(addr=v[2], data=v[7], saddr=OFF, offset=0),
                   vgpr={0: addr & 0xFFFFFFFF, 1: addr >> 32, 2: daddr & 0xFFFFFFFF, 3: daddr >> 32,
                         7: (LANES + 0xAB00) << 16}, memory=mem)
    assert (w.v[4] == LANES * 3).all() and (w.v[6] == LANES * 3 + 2).all()
    assert (dst == LANES + 0xAB00).all()
    # 768 contiguous bytes from a 4-byte aligned base: 6 or 7 lines; 128 contiguous stored bytes
    load = stats.memory["global_load_dwordx3"]
    assert load.bytes == 768 and load.lines in (6, 7)
    assert stats.workgroups_with_global_store == 1


@pytest.mark.parametrize("arch", ARCHS)
def test_global_atomic_pk_add_bf16_colliding_lanes_in_order(arch):
    # all 64 lanes add bf16 1.0 to both halves of the same dword starting at 256.0: in bf16
    # (8 bits) 256 + 1 = 257 rounds to even 256 every time, so lane order matters only through
    # rounding: the result stays 256 (0x4380) in both halves; return value of lane 0 is 256.
    out = np.array([0x43804380], np.uint32)
    mem = Memory()
    a = out.ctypes.data
    w, _ = run(arch, I.global_atomic_pk_add_bf16(vdst=v[3], addr=v[0], data=v[2], saddr=OFF, offset=0, sc0=1),
               vgpr={0: a & 0xFFFFFFFF, 1: a >> 32, 2: 0x3F803F80}, memory=mem)
    assert out[0] == 0x43804380 and w.v[3, 0] == 0x43804380


@pytest.mark.parametrize("arch", ARCHS)
def test_global_atomic_add_f32_sums_every_lane(arch):
    out = np.zeros(2, np.float32)
    mem = Memory()
    addr = out.ctypes.data + (LANES % 2).astype(np.uint64) * 4
    run(arch, I.global_atomic_add_f32(addr=v[0], data=v[2], saddr=OFF, offset=0),
        vgpr={0: addr & 0xFFFFFFFF, 1: addr >> 32, 2: np.float32(0.5) * np.ones(64, np.float32)}, memory=mem)
    assert list(out) == [16.0, 16.0]


def test_memory_error_names_the_instruction():
    with pytest.raises(EmuError, match=r"global_load_dword.*offset 0x0"):
        run("gfx942", I.global_load_dword(vdst=v[1], addr=v[0], saddr=OFF, offset=0), vgpr={0: 16, 1: 0},
            memory=Memory(strict=True))


def test_lds_write2st64_read2_and_out_of_range():
    # write2st64_b32 offsets 1 and 2 (x 256 bytes); read2_b32 reads them back as dwords 64 and
    # 128; a b64 read past the 1024-byte LDS returns 0 and is counted
    addr = (LANES * 4).astype(np.uint32)
    w, stats = run("gfx942", I.ds_write2st64_b32(addr=v[0], data0=v[1], data1=v[2], offset0=1, offset1=2),
                   I.ds_read2_b32(vdst=v[4:5], addr=v[0], offset0=64, offset1=128),
                   I.ds_read_b64(vdst=v[6:7], addr=v[3], offset0=0, offset1=0),
                   vgpr={0: addr, 1: LANES + 1, 2: LANES + 500, 3: 1020, 6: 9, 7: 9}, lds=1024)
    assert (w.v[4] == LANES + 1).all() and (w.v[5] == LANES + 500).all()
    assert (w.v[6] == 0).all() and stats.lds_out_of_range_lanes == 64


def test_ds_add_rtn_u32_colliding_lanes():
    # every lane adds 1 to LDS dword 0: final 64, lane l returns l (lanes apply in order)
    w, _ = run("gfx942", I.ds_add_rtn_u32(vdst=v[2], addr=v[0], data0=v[1], offset0=0, offset1=0),
               I.ds_read_b32(vdst=v[3], addr=v[0], offset0=0, offset1=0), vgpr={0: 0, 1: 1}, lds=64)
    assert (w.v[2] == LANES).all() and (w.v[3] == 64).all()


def test_smem_load_and_s_buffer_load_range():
    data = np.array([11, 22, 33, 44], np.uint32)
    mem = Memory()
    base = data.ctypes.data
    w, _ = run("gfx942", I.s_load_dwordx2(s[10:11], s[0:1], offset=4, imm=1),
               I.s_buffer_load_dwordx2(s[12:13], s[4:7], offset=8, imm=1),
               sgpr={0: base & 0xFFFFFFFF, 1: base >> 32, **_rsrc_sgprs(base, 12)}, memory=mem)
    assert (w.s[10], w.s[11]) == (22, 33)
    assert (w.s[12], w.s[13]) == (33, 0)  # the dword at byte 12 is past num_records


# --- counters -----------------------------------------------------------------------------------------
def test_counters_by_class_and_partial_store_lines():
    # 64 lanes store dword l at byte 4*l: 256 contiguous bytes; from a base 64 bytes into a line
    # they touch 3 lines, the first and last only partly.
    buf = np.zeros(128, np.uint32)
    mem = Memory()
    base = (buf.ctypes.data + 127) // 128 * 128 + 64
    addr = base + LANES.astype(np.uint64) * 4
    _, stats = run("gfx942", I.s_nop(simm16=0), I.global_store_dword(addr=v[0], data=v[2], saddr=OFF, offset=0),
                   vgpr={0: addr & 0xFFFFFFFF, 1: addr >> 32, 2: LANES}, memory=mem)
    st = stats.memory["global_store_dword"]
    assert (st.bytes, st.lines, st.partial_store_lines) == (256, 3, 2)
    assert stats.by_class["wait"] == 1 and stats.by_class["vmem_store"] == 1 and stats.wave_instructions == 3


def test_memory_counters_per_instruction_and_by_tensor():
    # Two loads of two tensors, told apart by pc and by address range:
    #   pc 4 (after the 4-byte s_nop): global_load_dwordx4, lane l at a + 16 l: 64 x 16 = 1024
    #     contiguous bytes from a line start = 8 whole lines, coalescing 1, range [a, a + 1024);
    #   pc 12 (after the 8-byte global load): global_load_dword, lane l at b + 256 (63 - l) (column
    #     0 of a 64 x 64 f32 matrix, bottom up: lane 0 is not the lowest address): 64 x 4 bytes in
    #     64 lines, coalescing 256 / (64 * 128) = 1/32, range [b, b + 63 * 256 + 4).
    a = aligned(torch.zeros(256, dtype=torch.int32))  # line-aligned, as a GPU allocation
    b = aligned(torch.zeros(64 * 64, dtype=torch.int32))
    a.copy_(torch.arange(256))
    b.copy_(torch.arange(64 * 64) + 5000)
    pa, pb = a.data_ptr(), b.data_ptr()
    addr_a = pa + LANES.astype(np.uint64) * 16
    addr_b = pb + (63 - LANES).astype(np.uint64) * 256
    w, stats = run("gfx950", I.s_nop(simm16=0),
                   I.global_load_dwordx4(vdst=v[4:7], addr=v[0], saddr=OFF, offset=0),
                   I.global_load_dword(vdst=v[8], addr=v[2], saddr=OFF, offset=0),
                   vgpr={0: addr_a & 0xFFFFFFFF, 1: addr_a >> 32, 2: addr_b & 0xFFFFFFFF, 3: addr_b >> 32},
                   memory=Memory())
    assert (w.v[4] == LANES * 4).all() and (w.v[8] == (63 - LANES) * 64 + 5000).all()
    assert sorted(stats.memory_by_pc) == [4, 12]
    ca, cb = stats.memory_by_pc[4], stats.memory_by_pc[12]
    assert (ca.name, ca.cls, cb.name, cb.cls) == ("global_load_dwordx4", "vmem_load", "global_load_dword", "vmem_load")
    assert (ca.executed, ca.lanes, ca.bytes, ca.lines, ca.lo, ca.hi) == (1, 64, 1024, 8, pa, pa + 1024)
    assert (cb.executed, cb.lanes, cb.bytes, cb.lines, cb.lo, cb.hi) == (1, 64, 256, 64, pb, pb + 63 * 256 + 4)
    assert (ca.bytes_per_lane, ca.coalescing, cb.bytes_per_lane, cb.coalescing) == (16, 1.0, 4, 1 / 32)
    # by tensor: [data_ptr, data_ptr + nbytes) holds exactly one instruction's accesses each
    assert stats.memory_within(pa, pa + a.nbytes) == {4: ca}
    assert stats.memory_within(pb, pb + b.nbytes) == {12: cb}
    ta = stats.traffic_within(pa, pa + a.nbytes)
    assert (ta.executed, ta.bytes, ta.lines) == (1, 1024, 8)
    assert stats.traffic_within(pa, pa + 512).executed == 0  # an instruction half inside does not count
    # the per-mnemonic counters are the per-pc ones summed
    assert stats.memory["global_load_dwordx4"] == stats.traffic_within(pa, pa + a.nbytes)


# --- vectorised paths: per-lane selectors, packed halves at once, tails, gathers -----------------------
def _perm_ref(s0: int, s1: int, sel: int) -> int:
    """v_perm_b32 per the ISA pseudocode, one lane: byte k of D from selector byte k."""
    out = 0
    for k in range(4):
        b = (sel >> (8 * k)) & 0xFF
        if b < 4:
            byte = (s1 >> (8 * b)) & 0xFF
        elif b < 8:
            byte = (s0 >> (8 * (b - 4))) & 0xFF
        elif b <= 11:  # sign of S1[15], S1[31], S0[15], S0[31] replicated
            word, bit = (s1, s1, s0, s0)[b - 8], (15, 31, 15, 31)[b - 8]
            byte = 0xFF if (word >> bit) & 1 else 0
        else:
            byte = 0 if b == 12 else 0xFF
        out |= byte << (8 * k)
    return out


def test_v_perm_b32_per_lane_and_scalar_selectors():
    # per-lane selectors cover every table entry (0..13) and values above 13 (0xFF); the scalar
    # selector 0x0B0A0908 takes the four sign bytes, 0x070D0C00 a source byte and the constants
    rng = np.random.default_rng(7)
    s0, s1 = (rng.integers(0, 2**32, 64, dtype=np.uint64).astype(np.uint32) for _ in range(2))
    sel = rng.choice(np.array(list(range(14)) + [14, 0x80, 0xFF], np.uint32), (64, 4))
    sel = (sel[:, 0] | sel[:, 1] << 8 | sel[:, 2] << 16 | sel[:, 3] << 24).astype(np.uint32)
    w, _ = run("gfx942", I.v_perm_b32_e64(v[8], v[6], v[7], v[9]), I.v_perm_b32_e64(v[10], v[6], v[7], s[20]),
               I.v_perm_b32_e64(v[11], v[6], v[7], s[21]),
               vgpr={6: s0, 7: s1, 9: sel}, sgpr={20: 0x0B0A0908, 21: 0x070D0C00})
    for lane in range(64):
        a, b = int(s0[lane]), int(s1[lane])
        assert w.v[8, lane] == _perm_ref(a, b, int(sel[lane])), lane
        assert w.v[10, lane] == _perm_ref(a, b, 0x0B0A0908) and w.v[11, lane] == _perm_ref(a, b, 0x070D0C00)


@pytest.mark.parametrize("opsel,opsel_hi", [(0b00, 0b11), (0b00, 0b00), (0b11, 0b11), (0b01, 0b10), (0b10, 0b01)])
def test_packed_u16_op_sel_halves_with_sgpr_and_partial_exec(opsel, opsel_hi):
    # v_pk_add_u16 D = S0 + S1 per half, wrapping: the low result adds half opsel[i] of source i,
    # the high one half opsel_hi[i]; S1 is an SGPR; lanes 40..63 (EXEC off) keep D
    rng = np.random.default_rng(opsel * 4 + opsel_hi)
    a = rng.integers(0, 2**32, 64, dtype=np.uint64).astype(np.uint32)
    sgpr = 0xFFF01234
    w, _ = run("gfx950", I.v_pk_add_u16(v[6], v[4], s[10], opsel=opsel, opsel_hi=opsel_hi),
               vgpr={4: a, 6: 0xDEADBEEF}, sgpr={10: sgpr}, exec_mask=(1 << 40) - 1)

    def half(x, h):
        return (int(x) >> (16 * h)) & 0xFFFF
    for lane in range(64):
        lo = (half(a[lane], opsel & 1) + half(sgpr, opsel >> 1 & 1)) & 0xFFFF
        hi = (half(a[lane], opsel_hi & 1) + half(sgpr, opsel_hi >> 1 & 1)) & 0xFFFF
        assert w.v[6, lane] == (lo | hi << 16 if lane < 40 else 0xDEADBEEF), lane


def test_packed_f16_neg_on_one_half_only():
    # neg = 0b01, neg_hi = 0b00: the low result is -S0.lo + S1.lo = -1.5 + 0.25 = -1.25 (0xBD00),
    # the high one S0.hi + S1.hi = 2 + 0.5 = 2.5 (0x4100)
    w, _ = run("gfx950", I.v_pk_add_f16(v[2], v[0], v[1], neg=0b01, neg_hi=0b00),
               vgpr={0: 0x40003E00, 1: 0x38003400})
    assert (w.v[2] == 0x4100BD00).all()


@pytest.mark.parametrize("opsel,opsel_hi", [(0b00, 0b11), (0b11, 0b00), (0b01, 0b01)])
def test_packed_f32_fma_halves_with_sgpr_pair(opsel, opsel_hi):
    # v_pk_fma_f32 D.lo = A[opsel0] * B[opsel1] + C.lo, D.hi = A[opsel_hi0] * B[opsel_hi1] + C.hi,
    # B an SGPR pair; small exact values; EXEC off for lanes 50..63 (D kept)
    a = np.stack([LANES + 1.0, LANES * 2.0]).astype(np.float32)
    b = (3.0, -0.5)
    c = np.float32(0.25)
    w, _ = run("gfx942", I.v_pk_fma_f32(v[6:7], v[0:1], s[10:11], v[2:3], opsel=opsel, opsel_hi=opsel_hi, opsel_hi2=1),
               vgpr={0: a[0], 1: a[1], 2: np.full(64, c), 3: np.full(64, c), 6: 7, 7: 7},
               sgpr={10: f32(b[0]), 11: f32(b[1])}, exec_mask=(1 << 50) - 1)
    lo = a[opsel & 1] * np.float32(b[opsel >> 1 & 1]) + c
    hi = a[opsel_hi & 1] * np.float32(b[opsel_hi >> 1 & 1]) + c
    assert np.array_equal(as_f32(w.v[6, :50]), lo[:50]) and np.array_equal(as_f32(w.v[7, :50]), hi[:50])
    assert (w.v[6:8, 50:] == 7).all()


@pytest.mark.parametrize("arch", ARCHS)
def test_buffer_tail_counts_bytes_and_lines_once(arch):
    # lane l loads dwordx4 at byte 16*l of a 128-byte aligned buffer with num_records 136: lanes
    # 0..7 are in range (one line), lane 8 only for dwords 0, 1 (bytes 128..135, the next line),
    # every other dword reads 0. Counted once: 136 bytes in 2 lines.
    store = np.arange(256, dtype=np.uint32)
    base = (store.ctypes.data + 127) // 128 * 128
    first = (base - store.ctypes.data) // 4
    inst = I.buffer_load_dwordx4(vdata=v[2:5], vaddr=v[0], srsrc=s[4:7], soffset=ZERO, offen=1, offset=0)
    w, stats = run(arch, inst, sgpr=_rsrc_sgprs(base, 136), vgpr={0: LANES * 16}, memory=Memory())
    got = w.v[2:6].T
    for lane in range(64):
        want = [store[first + 4 * lane + d] if 16 * lane + 4 * d + 4 <= 136 else 0 for d in range(4)]
        assert list(got[lane]) == want, lane
    c = stats.memory["buffer_load_dwordx4"]
    assert (c.executed, c.bytes, c.lines) == (1, 136, 2)
    # 9 lanes moved data (lane 8 two dwords of its four): 136 / 9 bytes per lane; bytes [base, base + 136)
    pc = stats.memory_by_pc[0]
    assert (pc.lanes, pc.bytes_per_lane, pc.lo, pc.hi) == (9, 136 / 9, base, base + 136)


def test_line_counts_follow_the_offset_in_the_line():
    # the same lane pattern (64 contiguous dwords) from a line-aligned base touches 2 lines,
    # from 4 bytes further 3: the counts are remembered per pattern and offset in the line
    buf = np.zeros(256, np.uint32)
    base = (buf.ctypes.data + 127) // 128 * 128
    a0 = base + LANES.astype(np.uint64) * 4
    a1 = a0 + 4
    _, stats = run("gfx942", I.global_load_dword(vdst=v[4], addr=v[0], saddr=OFF, offset=0),
                   I.global_load_dword(vdst=v[5], addr=v[2], saddr=OFF, offset=0),
                   I.global_load_dword(vdst=v[6], addr=v[0], saddr=OFF, offset=0),
                   vgpr={0: a0 & 0xFFFFFFFF, 1: a0 >> 32, 2: a1 & 0xFFFFFFFF, 3: a1 >> 32}, memory=Memory())
    assert stats.memory["global_load_dword"].lines == 2 + 3 + 2


def test_lds_read_with_an_inactive_lane_out_of_range():
    # lane 63 (EXEC off) points past the 256-byte LDS: nothing is counted, active lanes read
    w, stats = run("gfx942", I.ds_write_b32(addr=v[0], data0=v[1], offset0=0, offset1=0),
                   I.ds_read_b32(vdst=v[2], addr=v[0], offset0=0, offset1=0),
                   vgpr={0: np.where(LANES < 63, LANES * 4, 4096), 1: LANES + 100, 2: 5},
                   exec_mask=(1 << 63) - 1, lds=256)
    assert (w.v[2, :63] == LANES[:63] + 100).all() and w.v[2, 63] == 5 and stats.lds_out_of_range_lanes == 0


@pytest.mark.parametrize("arch", ARCHS)
def test_global_atomic_pk_add_f16_every_lane(arch):
    # 64 lanes add f16 (1.0, 0.5) to one dword holding (0, 0): exact sums 64.0 (0x5400) and
    # 32.0 (0x5000); lane 0 returns the initial value
    out = np.zeros(1, np.uint32)
    a = out.ctypes.data
    w, _ = run(arch, I.global_atomic_pk_add_f16(vdst=v[3], addr=v[0], data=v[2], saddr=OFF, offset=0, sc0=1),
               vgpr={0: a & 0xFFFFFFFF, 1: a >> 32, 2: 0x38003C00, 3: 9}, memory=Memory())
    assert out[0] == 0x50005400 and w.v[3, 0] == 0


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
