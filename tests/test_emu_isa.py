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
from flyquant.emu.isa_base import AGPR_BASE, EmuError, Wave

ARCHS = ("gfx942", "gfx950")
FULL = (1 << 64) - 1
LANES = np.arange(64)
OFF = src[0x7F]  # GLOBAL saddr "off"
ZERO = src[128]  # inline constant 0 as a scalar operand


def f32(x: float) -> int:
    return struct.unpack("<I", struct.pack("<f", x))[0]


def as_f32(bits) -> np.ndarray:
    return np.asarray(bits, np.uint32).view(np.float32)


def program(arch, *insts):
    """`insts` + s_endpgm as an interpreter program."""
    return interp.snippet(b"".join(i.to_bytes() for i in insts) + I.s_endpgm().to_bytes(), arch)


def wave(sgpr=None, vgpr=None, agpr=None, exec_mask=FULL, scc=0):
    """A wave holding the given registers (VGPRs: a value or 64 lanes' values, FP32 as its bits)."""
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
    return w


def run(arch, *insts, sgpr=None, vgpr=None, agpr=None, exec_mask=FULL, scc=0, lds=0, memory=None, budget=10_000):
    """Run `insts` + s_endpgm as one wave; returns (wave, stats)."""
    w = wave(sgpr, vgpr, agpr, exec_mask, scc)
    stats = interp.run_wave(program(arch, *insts), w, memory, lds, budget)
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


@pytest.mark.parametrize("name", ["v_cvt_pk_bf16_f32", "buffer_atomic_pk_add_bf16"])
def test_gfx950_only_instruction_rejected_on_gfx942(name):
    # gfx942 has the global form of the packed BF16 atomic add only (arch.py: buffer_pk_add_bf16)
    inst = (I.v_cvt_pk_bf16_f32(v[0], v[1], v[2]) if name == "v_cvt_pk_bf16_f32" else
            I.buffer_atomic_pk_add_bf16(vdata=v[2], vaddr=v[0], srsrc=s[4:7], soffset=ZERO, offen=1, offset=0))
    with pytest.raises(EmuError, match=f"{name} is a gfx950-only instruction"):
        run("gfx942", inst)


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


def test_packed_inline_constant_is_half_of_a_32_bit_value():
    # LLVM's getInlineEncodingV216: integer codes are sign-extended 32-bit values, float codes in an
    # F16 operand the half pattern over zero high bits. op_sel_hi = 0 on the constant (LLVM's splat)
    # repeats the low half; op_sel_hi = 1 reads the high half: 0 for 1 and 1.0, 0xFFFF for -1
    cases = [(I.v_pk_add_u16, 1, 0b01, 0x00100020, 0x00110021), (I.v_pk_add_u16, 1, 0b11, 0x00100020, 0x00100021),
             (I.v_pk_add_u16, -1, 0b11, 0x00100020, 0x000F001F), (I.v_pk_add_u16, 0, 0b11, 0x00100020, 0x00100020),
             (I.v_pk_add_f16, 1.0, 0b01, 0x40003C00, 0x42004000), (I.v_pk_add_f16, 1.0, 0b11, 0x40003C00, 0x40004000)]
    for op, const, opsel_hi, x, want in cases:
        w, _ = run("gfx942", op(v[2], v[0], const, opsel_hi=opsel_hi), vgpr={0: x})
        assert (w.v[2] == want).all(), (op, const, opsel_hi, hex(int(w.v[2, 0])))
    # a float code in a 16-bit integer operand's high half (FP32 or BF16 pattern) is refused
    with pytest.raises(EmuError, match="float inline constant in a 16-bit integer operand"):
        run("gfx942", I.v_pk_add_u16(v[2], v[0], 1.0, opsel_hi=0b11), vgpr={0: 0})


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


def test_v_maximum3_quiets_a_signalling_nan():
    # IEEE 754-2019 maximum (the v_maximum helpers; RDNA4's V_MAXIMUM_F32 pseudocode spells out
    # cvtToQuietNAN): a signalling NaN operand comes back quieted, its payload kept, in FP32 and in
    # each FP16 half
    w, _ = run("gfx950", I.v_maximum3_f32(v[3], v[0], v[1], v[2]), I.v_pk_maximum3_f16(v[6], v[4], v[5], v[5]),
               vgpr={0: 0x7F800001, 1: f32(1.0), 2: f32(2.0), 4: 0x3C007D01, 5: 0x3C003C00})
    assert int(w.v[3, 0]) == 0x7FC00001 and int(w.v[6, 0]) == 0x3C007F01


def test_packed_f32_mul_with_neg_on_one_half_keeps_op_sel_hi():
    # V_PK_MUL_F32: D.lo = S0[op_sel[0]] * S1[op_sel[1]], D.hi = S0[op_sel_hi[0]] * S1[op_sel_hi[1]],
    # neg / neg_hi negating each half's sources: neg = 0b10 (S1 of the low half), op_sel 0, op_sel_hi
    # 0b11: lo = 2 * -5 = -10, hi = 3 * 7 = 21 (halves with different negations take the per-half path)
    w, _ = run("gfx942", I.v_pk_mul_f32(v[4:5], v[0:1], v[2:3], opsel=0, opsel_hi=3, neg=0b10, neg_hi=0),
               vgpr={0: f32(2.0), 1: f32(3.0), 2: f32(5.0), 3: f32(7.0)})
    assert (as_f32(w.v[4]) == -10.0).all() and (as_f32(w.v[5]) == 21.0).all()
