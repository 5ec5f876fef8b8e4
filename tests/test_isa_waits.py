"""tests/isa_waits.py, the missing-s_waitcnt check that conftest runs on every compiled kernel:
its rules on small hand-written blocks, and on real kernels that it sees every wait they need
(removing any one s_waitcnt, or loosening any count by one, is a violation)."""

from __future__ import annotations

import re

import pytest

from isa_waits import CAP, COUNTER, memory_kind, violations, wait_counts
from test_moe_gemm1_kernel import compile_stage1
from test_mxfp8_kernels import compile_dual


def body(code: str) -> str:
    return "k:\n" + code + "\n.Lfunc_end0:\n"


def test_a_vector_load_is_waited_for_in_issue_order():
    two_loads = """
        buffer_load_dword v1, v0, s[4:7], 0 offen
        buffer_load_dwordx4 v[4:7], v0, s[4:7], 0 offen offset:16
        s_waitcnt vmcnt(1)
        v_add_u32_e32 v2, v1, v1
        {use}
        s_endpgm
    """
    assert violations(body(two_loads.format(use=""))) == []
    found = violations(body(two_loads.format(use="v_mov_b32_e32 v8, v6")))
    assert len(found) == 1 and "v6" in found[0]
    # a write the late load would overwrite is a violation too
    assert violations(body(two_loads.format(use="v_mov_b32_e32 v5, 0")))
    # a store counts: after it, vmcnt(1) completes both loads
    stored = two_loads.replace("s_waitcnt vmcnt(1)", "buffer_store_dword v9, v0, s[4:7], 0 offen\n s_waitcnt vmcnt(1)")
    assert violations(body(stored.format(use="v_mov_b32_e32 v8, v6"))) == []


def test_scalar_loads_complete_only_at_lgkmcnt_0():
    code = """
        s_load_dwordx2 s[8:9], s[0:1], 0x0
        ds_read_b32 v1, v0
        s_waitcnt lgkmcnt({n})
        s_add_u32 s10, s8, 1
        s_endpgm
    """
    assert violations(body(code.format(n=0))) == []
    assert violations(body(code.format(n=1)))  # the scalar load may return after the LDS read


def test_lds_operations_complete_in_order():
    code = """
        ds_read_b64 v[2:3], v0
        ds_read_b128 v[4:7], v0 offset:64
        s_waitcnt lgkmcnt(1)
        v_add_u32_e32 v8, v2, v3
        {use}
        s_endpgm
    """
    assert violations(body(code.format(use=""))) == []
    assert violations(body(code.format(use="v_add_u32_e32 v9, v4, v4")))


def test_a_load_issued_at_the_end_of_a_loop_is_waited_for_at_its_top():
    loop = """
        buffer_load_dword v1, v0, s[4:7], 0 offen
        s_mov_b32 s2, 4
    .LBB0_1:
        {wait}
        v_add_u32_e32 v2, v1, v2
        buffer_load_dword v1, v0, s[4:7], 0 offen
        s_sub_u32 s2, s2, 1
        s_cmp_lg_u32 s2, 0
        s_cbranch_scc1 .LBB0_1
        s_waitcnt vmcnt(0)
        s_endpgm
    """
    assert violations(body(loop.format(wait="s_waitcnt vmcnt(0)"))) == []
    found = violations(body(loop.format(wait="")))
    assert len(found) == 1 and "v1" in found[0]


def test_lds_writes_are_complete_before_a_barrier():
    code = """
        ds_write_b32 v0, v1
        {wait}
        s_barrier
        ds_read_b32 v2, v0 offset:4
        s_waitcnt lgkmcnt(0)
        s_endpgm
    """
    assert violations(body(code.format(wait="s_waitcnt lgkmcnt(0)"))) == []
    assert violations(body(code.format(wait="")))


def _repeats_a_wait(lines: list[str], i: int) -> bool:
    """Whether the s_waitcnt at lines[i] only repeats an earlier one of its straight-line code: one
    at least as strict on each counter it waits on, with no operation of that counter between."""
    vm, lgkm = wait_counts(lines[i].strip().partition(" ")[2])
    need = {c: n for c, n in (("vm", vm), ("lgkm", lgkm)) if n < CAP}
    for line in reversed(lines[:i]):
        text = line.split(";")[0].strip()
        if not need or text.endswith(":") or text.startswith("s_cbranch") or text.startswith("s_branch"):
            break
        mnemonic, _, operands = text.partition(" ")
        if mnemonic == "s_waitcnt":
            earlier = dict(zip(("vm", "lgkm"), wait_counts(operands)))
            need = {c: n for c, n in need.items() if earlier[c] > n}
            continue
        kind = memory_kind(mnemonic, operands) if mnemonic else None
        if kind and ("vm" if COUNTER[kind] == "vm" else "lgkm") in need:
            return False
    return not need


@pytest.mark.parametrize("arch", ("gfx950", "gfx942"))
@pytest.mark.parametrize("kernel", ("mxfp8_dual", "moe_stage1"))
def test_every_wait_of_a_real_kernel_is_seen(arch, kernel):
    """Every wait of real kernels that does not merely repeat an earlier one is needed by the
    check's rules: without it, or with any of its counts one larger, the check flags the kernel
    (LLVM places its waits tight; ours are the pipelined ones of stage 1's main loop and the
    one-wait-for-all of _mx_ir.wait_loads, which can repeat a wait LLVM placed). The MXFP8 dual
    column kernel has LDS stores, a barrier and scalar loads; stage 1 the software pipeline."""
    # GPT-OSS stage 1 at 16x128: its software-pipelined waits are placed by hand
    isa = (compile_dual(arch, "bf16")[0] if kernel == "mxfp8_dual" else compile_stage1(arch, "gptoss", 16, 128)).isa
    assert violations(isa) == []
    lines = isa.split("\n")
    waits = [i for i, line in enumerate(lines) if line.strip().startswith("s_waitcnt")]
    needed = [i for i in waits if not _repeats_a_wait(lines, i)]
    assert len(needed) >= 10
    for i in needed:
        assert violations("\n".join(lines[:i] + lines[i + 1:])), f"removing `{lines[i].strip()}` went unseen"
        for m in re.finditer(r"(vmcnt|lgkmcnt)\((\d+)\)", lines[i]):
            looser = lines[i][:m.start()] + f"{m.group(1)}({int(m.group(2)) + 1})" + lines[i][m.end():]
            assert violations("\n".join(lines[:i] + [looser] + lines[i + 1:])), f"`{looser.strip()}` went unseen"
