"""Missing s_waitcnt in a kernel's final ISA (22_final_isa.s), found by a dataflow over its blocks.

flyquant.emu completes every load before the next instruction, so a kernel that reads a load's
destination before waiting for it passes every emulated test and reads stale registers on an
MI300X / MI355X. LLVM inserts the waits (SIInsertWaitcnts), but our kernels also place their own
(kernels/_a16w4_main_loop.py's pipelined waits) and a future hand-scheduled load (LDS DMA,
inline asm) is not LLVM's to track. This check replays the counters' rules (CDNA3 / CDNA4 ISA,
"Data Dependency Resolution"; the pre-GFX10 rules LLVM's SIInsertWaitcnts uses):

- vmcnt counts vector memory loads and stores of the wave and they complete in issue order, so
  after `s_waitcnt vmcnt(n)` a load is complete if n or more vector memory operations were
  issued after it;
- lgkmcnt counts LDS (in order among themselves) and scalar memory operations (out of order): an
  LDS operation is complete after lgkmcnt(n) if n or more LDS operations were issued after it, a
  scalar load only after lgkmcnt(0);
- a destination register is pending until its load is complete: any instruction naming it (a
  read, or a write the late load would overwrite) is a violation; a vector load may name a
  register another pending vector load writes (same order), as may LDS after LDS;
- an LDS write (or a load into LDS) still pending at s_barrier may be unseen by the other waves
  after it: a violation; an LDS read while a load into LDS is pending is one too.

Blocks start at labels and after branches; a block's entry state merges its predecessors' (per
register the fewest operations issued after its load: the strictest), iterated to a fixpoint.
Not modelled (none in the kernels): FLAT (both counters; refused), implicit register operands
(VCC of VOPC / v_cndmask, M0), exports, a register that two paths load through different counters
(the merge keeps one path's counter).
"""

from __future__ import annotations

import re

CAP = 64  # more operations after a load than any wait count encodes: any wait retires it
LDS_WRITES = ("lds", "writes")  # pseudo-register: an LDS write in flight
LDS_DMA = ("lds", "dma")  # pseudo-register: a vector load into LDS in flight
# the counter each memory_kind counts on: vmcnt, or lgkmcnt for LDS (in order) and scalar loads (not)
COUNTER = {"vm_load": "vm", "vm": "vm", "lds_dma": "vm", "ds_read": "ds", "ds_write": "ds", "smem": "smem"}
_REG = re.compile(r"(?<![\w.])([vsa])(?:(\d+)|\[(\d+):(\d+)\])(?!\w)")
_BRANCH = re.compile(r"^s_(c?branch)\w*$")


def _regs(operands: str) -> set:
    out = set()
    for kind, one, lo, hi in _REG.findall(operands):
        first, last = (int(one), int(one)) if one else (int(lo), int(hi))
        out |= {(kind, r) for r in range(first, last + 1)}
    return out


def wait_counts(operands: str) -> tuple[int, int]:
    """(vmcnt, lgkmcnt) an s_waitcnt waits for: CAP where it does not wait."""
    named = dict(re.findall(r"(\w+)\((\d+)\)", operands))
    if not named and operands.strip():
        imm = int(operands.strip(), 0)  # GFX9 encoding: vmcnt [3:0] + [15:14], lgkmcnt [11:8]
        return (imm & 0xF) | ((imm >> 14) & 3) << 4, (imm >> 8) & 0xF
    return int(named.get("vmcnt", CAP)), int(named.get("lgkmcnt", CAP))


def memory_kind(mnemonic: str, operands: str) -> str | None:
    """'vm_load', 'vm', 'lds_dma', 'ds_read', 'ds_write', 'smem' or None (not a memory operation)."""
    if mnemonic.startswith(("buffer_", "global_", "scratch_")):
        if re.search(r"(?<!\w)lds(?!\w)", operands) or "_lds_" in mnemonic:
            return "lds_dma"
        returns = "_load" in mnemonic or ("_atomic" in mnemonic and re.search(r"(?<!\w)(glc|sc0)(?!\w)", operands))
        return "vm_load" if returns else "vm"
    if mnemonic.startswith(("s_load_", "s_buffer_load_", "s_memtime", "s_memrealtime")):
        return "smem"
    if mnemonic.startswith("ds_"):
        reads = mnemonic.startswith(("ds_read", "ds_load", "ds_swizzle", "ds_permute", "ds_bpermute")) or "_rtn" in mnemonic
        return "ds_read" if reads else "ds_write"
    if mnemonic.startswith("flat_"):
        raise ValueError(f"{mnemonic}: FLAT instructions count on both counters, which this check does not model")
    return None


def _parse(isa: str):
    """The kernel body's blocks of (mnemonic, operands, text) and each block's successor indices."""
    blocks, labels, current = [], {}, []
    body = re.search(r"^[\w.$]+:\n(.*?)^\.Lfunc_end", isa, flags=re.M | re.S)
    for raw in (body.group(1) if body else isa).splitlines():
        text = raw.split(";")[0].strip()
        if text.startswith(".LBB") and text.endswith(":"):
            if current:
                blocks.append(current)
                current = []
            labels[text[:-1]] = len(blocks)
        if not text or text.startswith("."):
            continue
        mnemonic, _, operands = text.partition(" ")
        current.append((mnemonic, operands.strip(), text))
        if _BRANCH.match(mnemonic) or mnemonic == "s_endpgm":
            blocks.append(current)
            current = []
    if current:
        blocks.append(current)
    succs = []
    for i, block in enumerate(blocks):
        mnemonic, operands, _ = block[-1]
        nxt = [i + 1] if i + 1 < len(blocks) else []
        if mnemonic == "s_endpgm":
            succs.append([])
        elif _BRANCH.match(mnemonic):
            target = labels[operands.split()[0]]
            succs.append([target] if mnemonic == "s_branch" else [target] + nxt)
        else:
            succs.append(nxt)
    return blocks, succs


def _merge(a: dict, b: dict) -> dict:
    out = dict(a)
    for reg, entry in b.items():
        out[reg] = entry if reg not in out else (out[reg][0], min(out[reg][1], entry[1]))
    return out


def _step(state: dict, ins, found: list | None) -> dict:
    """The pending registers after `ins` ({register: (counter, operations issued after its load)},
    counter 'vm', 'ds' or 'smem'); violations appended to `found` (None: not recorded)."""
    mnemonic, operands, text = ins
    if mnemonic == "s_waitcnt":
        vm, lgkm = wait_counts(operands)
        done = {"vm": lambda n: n >= vm, "ds": lambda n: n >= lgkm, "smem": lambda n: lgkm == 0}
        return {r: e for r, e in state.items() if not done[e[0]](e[1])}
    kind = memory_kind(mnemonic, operands)
    touched = _regs(operands)
    dest = set()
    if kind in ("vm_load", "smem", "ds_read") and operands:
        dest = _regs(operands.split(",")[0])
    bad = set()
    for reg in touched & state.keys():
        same_order = reg in dest and (state[reg][0], kind) in (("vm", "vm_load"), ("ds", "ds_read"))
        if not same_order:
            bad.add(reg)
    if mnemonic == "s_barrier":
        bad |= {r for r in (LDS_WRITES, LDS_DMA) if r in state}
    if kind in ("ds_read", "ds_write") and LDS_DMA in state:
        bad.add(LDS_DMA)
    if bad and found is not None:
        names = sorted(f"{r[0]}{r[1]}" for r in bad)
        found.append(f"{text}: {', '.join(names)} not yet waited for")
    state = {r: e for r, e in state.items() if r not in bad}
    if kind is None:
        return state
    counter = COUNTER[kind]
    state = {r: (c, min(n + 1, CAP)) if c == counter else (c, n) for r, (c, n) in state.items()}
    for reg in dest:
        state[reg] = (counter, 0)
    if kind == "ds_write":
        state[LDS_WRITES] = ("ds", 0)
    if kind == "lds_dma":
        state[LDS_DMA] = ("vm", 0)
    return state


def violations(isa: str) -> list[str]:
    """Instructions that name a register (or need LDS) whose memory operation may be in flight
    (module docstring), one line each; empty when every wait is in place."""
    blocks, succs = _parse(isa)
    entry: list = [None] * len(blocks)
    entry[0] = {}
    work = [0]
    while work:  # fixpoint of the entry states (merges only tighten: a finite lattice)
        i = work.pop()
        state = entry[i]
        for ins in blocks[i]:
            state = _step(state, ins, None)
        for j in succs[i]:
            merged = state if entry[j] is None else _merge(entry[j], state)
            if merged != entry[j]:
                entry[j] = merged
                work.append(j)
    found: list[str] = []
    for i, block in enumerate(blocks):
        state = entry[i]
        if state is None:  # unreachable
            continue
        for ins in block:
            state = _step(state, ins, found)
    return found
