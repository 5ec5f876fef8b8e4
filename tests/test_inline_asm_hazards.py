"""Wait states around our inline-asm VALU instructions, checked on the compiled code.

_mx_ir.bit_select (v_bfi_b32) and _mx_ir.and_or (v_and_or_b32) are written as inline asm, and
LLVM's hazard recognizer looks at an inline asm only for the 12-dword store hazard
(GCNHazardRecognizer::checkInlineAsmHazards): the CDNA3 wait states it would insert around the
real instructions are not promised here, and flyquant.emu does not model hazards (it executes
each instruction after the previous one has finished), so one scheduled too close would go wrong
only on an MI300X / MI355X. These tests read the ISA of every kernel that uses them (bit_select:
the MXFP8 dual column kernel's NaN rows, FP32 half-line pair exchange and line stores; and_or:
gfx942's grouped GEMM forward, the -0 rewrite of its MFMA operands) and check, per straight-line
block:

- a DPP instruction reading their result: 2 wait states between them (CDNA3 ISA, "Manually
  inserted wait states": VALU write VGPR, then DPP read of it); an MFMA reading it: 2 (the same
  table: VALU write VGPR, then V_MFMA* read of it);
- one of them reading the result of a transcendental VALU op: 1; of a VALU that wrote only part
  of its VGPR (SDWA dst_sel, VOP3 op_sel on the destination): 1 (the same table);
- on gfx950, one of them reading a v_cvt_scalef32_* result: 2. LLVM has a gfx950-only
  "CvtScaleForwardingHazard" whose wait count no public document gives; 2 is what the code has
  today, so a schedule that moves them closer fails here and has to be checked against it.
"""

from __future__ import annotations

import re

import pytest
import torch

import flyquant.kernels.mxfp8_grouped_mm as G
from flyquant import toolchain
from test_mxfp8_kernels import compile_dual

ASM_VALU = ("v_bfi_b32", "v_and_or_b32")  # _mx_ir.bit_select, _mx_ir.and_or
TRANS = ("v_exp_", "v_log_", "v_rcp_", "v_rsq_", "v_sqrt_", "v_sin_", "v_cos_")
LOOK_BACK = 8  # instructions: more than any wait count here


def _vgprs(operand: str) -> set[int]:
    m = re.fullmatch(r"v(\d+)", operand) or re.fullmatch(r"v\[(\d+):(\d+)\]", operand)
    if not m:
        return set()
    lo = int(m.group(1))
    return set(range(lo, int(m.group(m.lastindex)) + 1))


def _instructions(isa: str):
    """(mnemonic, operands, text) per instruction; None at a label (another path can enter)."""
    out = []
    for raw in isa.splitlines():
        text = raw.split(";")[0].strip()
        if not text or text.startswith("."):
            continue
        if text.endswith(":"):
            out.append(None)
            continue
        parts = text.replace(",", " ").split()
        out.append((parts[0], parts[1:], text))
    return out


def _partial_write(mnemonic: str, text: str) -> bool:
    if "_sdwa" in mnemonic:
        sel = re.search(r"dst_sel:(\w+)", text)
        return bool(sel) and sel.group(1) != "DWORD"
    sel = re.search(r"op_sel:\[([01,]+)\]", text)
    return bool(sel) and not mnemonic.startswith("v_pk_") and len(sel.group(1).split(",")) == 4 \
        and sel.group(1).split(",")[3] == "1"


def _required(producer: str, text: str, consumer: str, consumer_text: str, arch: str) -> int:
    """Wait states the pair needs when the consumer reads the producer's result (0: none)."""
    dpp = "_dpp" in consumer or "quad_perm" in consumer_text or "row_" in consumer_text
    if producer in ASM_VALU:
        return 2 if dpp or consumer.startswith("v_mfma") else 0
    if consumer not in ASM_VALU:
        return 0
    if arch == "gfx950" and producer.startswith("v_cvt_scalef32"):
        return 2
    if producer.startswith(TRANS) or _partial_write(producer, text):
        return 1
    return 0


def violations(isa: str, arch: str, asm: str = "v_bfi_b32") -> tuple[int, list[str]]:
    """(the count of `asm`, the producer/consumer pairs closer than _required), each source
    operand against its newest writer in the block."""
    code = _instructions(isa)
    found, count = [], 0
    for i, ins in enumerate(code):
        if ins is None or not ins[0].startswith("v_"):
            continue
        mnemonic, operands, text = ins
        count += mnemonic == asm
        for reads in filter(None, (_vgprs(o) for o in operands[1:])):
            waits = 0
            for j in range(i - 1, max(-1, i - LOOK_BACK), -1):
                prev = code[j]
                if prev is None:
                    break
                p_mnemonic, p_operands, p_text = prev
                if p_mnemonic == "s_nop":
                    waits += int(p_operands[0], 0) + 1
                    continue
                if p_mnemonic.startswith("v_") and p_operands and _vgprs(p_operands[0]) & reads:
                    need = _required(p_mnemonic, p_text, mnemonic, text, arch)
                    if waits < need:
                        found.append(f"{p_text}  ->  {text}: {waits} wait states, {need} needed")
                    break
                waits += 1
    return count, found


@pytest.mark.parametrize("arch", ("gfx950", "gfx942"))
@pytest.mark.parametrize("dtype", ("bf16", "fp16", "fp32"))
def test_bit_select_keeps_its_wait_states(arch, dtype):
    rep, _ = compile_dual(arch, dtype)
    bfi, found = violations(rep.isa, arch)
    assert bfi > 0, "the kernel no longer uses bit_select: point this test at the kernels that do"
    assert not found, "\n".join(found)


@pytest.mark.parametrize("k", (2048, 2880))  # whole steps; a partial last step
def test_and_or_keeps_its_wait_states(k):
    """gfx942's grouped GEMM forward with OCP operands (signed zeros): its -0 rewrite's v_and_or_b32
    results are MFMA operands."""
    cfg = G.GroupedMMConfig(arch="gfx942", out_dtype=torch.bfloat16, n=2048, k=k, experts=8, tile_m=128, tile_n=128)
    (rep,) = toolchain.compile_only("gfx942", G.build_grouped_mm(cfg), *([0] * 6), 16640, 1, 1, stream=0)
    count, found = violations(rep.isa, "gfx942", "v_and_or_b32")
    assert count > 0, "the kernel no longer uses and_or: point this test at the kernels that do"
    assert not found, "\n".join(found)


def test_the_check_sees_a_close_pair():
    # the checker itself: a v_bfi_b32 result read by DPP one instruction later, a transcendental
    # result read at once, a partial write read at once; and the same pairs far enough apart
    close = """
        v_bfi_b32 v4, v1, v2, v3
        v_add_u32_e32 v9, v8, v7
        v_mov_b32_dpp v5, v4 quad_perm:[1,0,3,2] row_mask:0xf bank_mask:0xf
        v_exp_f32_e32 v6, v6
        v_bfi_b32 v7, v6, v2, v3
        v_mov_b32_sdwa v8, v1 dst_sel:WORD_1 dst_unused:UNUSED_PRESERVE src0_sel:WORD_0
        v_bfi_b32 v9, v1, v8, v3
    """
    apart = """
        v_bfi_b32 v4, v1, v2, v3
        s_nop 1
        v_mov_b32_dpp v5, v4 quad_perm:[1,0,3,2] row_mask:0xf bank_mask:0xf
        v_exp_f32_e32 v6, v6
        s_nop 0
        v_bfi_b32 v7, v6, v2, v3
    """
    assert len(violations(close, "gfx942")[1]) == 3
    assert violations(apart, "gfx942") == (2, [])
    mfma_close = """
        v_and_or_b32 v4, v1, v2, v3
        v_add_u32_e32 v9, v8, v7
        v_mfma_f32_16x16x32_fp8_fp8 v[10:13], v[4:5], v[6:7], 0
    """
    mfma_apart = mfma_close.replace("v_add_u32_e32 v9, v8, v7", "v_add_u32_e32 v9, v8, v7\n        s_nop 0")
    assert len(violations(mfma_close, "gfx942", "v_and_or_b32")[1]) == 1
    assert violations(mfma_apart, "gfx942", "v_and_or_b32") == (1, [])
