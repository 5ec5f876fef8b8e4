"""Counters of one emulated kernel launch (`LaunchStats`), a plain Python object.

Counting rule: one wave-instruction per instruction a wave executes (s_nop and s_waitcnt
included). Instructions are grouped by class (`CLASSES`) and by mnemonic. Every vector memory
instruction (global/buffer/flat and LDS) also adds the bytes its active lanes moved and, for
global memory, the distinct 128-byte lines they touched: coalescing = bytes / (lines * 128).
A global store that covers a line only in part is counted in `partial_store_lines` (a real GPU
then does a read-modify-write or a masked write of that line).
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np

LINE_BYTES = 128
LINE_SHIFT = np.uint64(7)  # log2(LINE_BYTES)

CLASSES = ("salu", "smem", "valu", "mfma", "vmem_load", "vmem_store", "vmem_atomic", "lds", "branch",
           "wait", "barrier", "other")


def classify(name: str, enc: str) -> str:
    """Instruction class of a decoded instruction (mnemonic and encoding)."""
    if name in ("s_waitcnt", "s_nop", "s_sleep"):
        return "wait"
    if name == "s_barrier":
        return "barrier"
    if name.startswith(("s_branch", "s_cbranch", "s_setpc", "s_swappc", "s_call", "s_endpgm")):
        return "branch"
    if enc == "SMEM":
        return "smem"
    if enc in ("SOP1", "SOP2", "SOPK", "SOPC", "SOPP"):
        return "salu" if enc != "SOPP" else "other"
    if enc in ("MAI", "VOP3PX2"):
        return "mfma" if "mfma" in name or "smfmac" in name else "valu"
    if enc == "DS":
        return "lds"
    if enc in ("MUBUF", "MTBUF", "GLOBAL", "FLAT", "SCRATCH"):
        if "atomic" in name:
            return "vmem_atomic"
        return "vmem_store" if "_store" in name else "vmem_load"
    return "valu"


@dataclass
class MemCounter:
    """Per-mnemonic memory traffic: executions, bytes moved by active lanes, 128-byte lines."""

    executed: int = 0
    bytes: int = 0
    lines: int = 0
    partial_store_lines: int = 0

    @property
    def coalescing(self) -> float:
        """Useful bytes per byte of the 128-byte lines touched (1.0 = perfectly coalesced)."""
        return self.bytes / (self.lines * LINE_BYTES) if self.lines else 0.0


@dataclass
class LaunchStats:
    """What one launch executed. `by_class` / `by_opcode`: wave-instructions per class and per
    mnemonic; `memory`: per memory mnemonic, a `MemCounter`, with `mem_class` its class;
    `workgroups_with_global_store`: workgroups that stored or atomically updated global memory;
    `seconds` / `cpu_seconds`: wall and process CPU time of the interpretation."""

    kernel: str
    arch: str
    grid: tuple[int, int, int]
    block: tuple[int, int, int]
    waves_per_workgroup: int = 0
    workgroups_launched: int = 0
    workgroups_with_global_store: int = 0
    wave_instructions: int = 0
    by_class: dict[str, int] = field(default_factory=dict)
    by_opcode: dict[str, int] = field(default_factory=dict)
    memory: dict[str, MemCounter] = field(default_factory=dict)  # per mnemonic (global + LDS)
    mem_class: dict[str, str] = field(default_factory=dict)  # memory mnemonic -> its class
    lds_out_of_range_lanes: int = 0  # LDS accesses past the workgroup's allocation (read 0 / dropped)
    seconds: float = 0.0
    cpu_seconds: float = 0.0

    # -- derived ----------------------------------------------------------------------------------
    def bytes_of(self, cls: str) -> int:
        """Bytes moved by the instructions of one class (vmem_load, vmem_store, vmem_atomic, lds)."""
        return sum(c.bytes for name, c in self.memory.items() if self.mem_class.get(name) == cls)

    @property
    def global_lines(self) -> int:
        return sum(c.lines for name, c in self.memory.items() if self.mem_class.get(name) != "lds")

    @property
    def global_bytes(self) -> int:
        return sum(c.bytes for name, c in self.memory.items() if self.mem_class.get(name) != "lds")

    @property
    def coalescing(self) -> float:
        lines = self.global_lines
        return self.global_bytes / (lines * LINE_BYTES) if lines else 0.0

    @property
    def partial_store_lines(self) -> int:
        return sum(c.partial_store_lines for c in self.memory.values())

    @property
    def wave_instructions_per_second(self) -> float:
        return self.wave_instructions / self.seconds if self.seconds else 0.0

    def summary(self) -> str:
        lines = [
            f"{self.kernel} ({self.arch}) grid={self.grid} block={self.block}: "
            f"{self.workgroups_launched} workgroups ({self.workgroups_with_global_store} stored to global), "
            f"{self.waves_per_workgroup} waves each",
            f"  {self.wave_instructions} wave-instructions in {self.seconds:.3f} s "
            f"({self.wave_instructions_per_second / 1e6:.3f} M/s; {self.cpu_seconds:.3f} s of CPU)",
            "  by class: " + ", ".join(f"{k}={v}" for k, v in self.by_class.items() if v),
        ]
        for cls in ("vmem_load", "vmem_store", "vmem_atomic", "lds"):
            b = self.bytes_of(cls)
            if b:
                lines.append(f"  {cls}: {b} bytes")
        if self.global_lines:
            lines.append(f"  global: {self.global_lines} x 128-byte lines, coalescing {self.coalescing:.3f}, "
                         f"partially stored lines {self.partial_store_lines}")
        if self.lds_out_of_range_lanes:
            lines.append(f"  LDS out-of-range lane accesses: {self.lds_out_of_range_lanes}")
        top = sorted(self.by_opcode.items(), key=lambda kv: -kv[1])[:12]
        lines.append("  top opcodes: " + ", ".join(f"{k}={v}" for k, v in top))
        return "\n".join(lines)

    def __str__(self) -> str:
        return self.summary()


LINE_PATTERN_CACHE_SIZE = 4096  # distinct lane-address patterns remembered per launch


def line_counts(a: np.ndarray, nbytes: int, store: bool) -> tuple[int, int]:
    """(distinct 128-byte lines, lines a store covers only in part) of accesses of `nbytes` bytes
    at the addresses `a` (uint64, at least one)."""
    a = np.sort(a)
    first = a >> LINE_SHIFT
    last = (a + np.uint64(nbytes - 1)) >> LINE_SHIFT
    straddle = bool(np.count_nonzero(first != last))
    lines = np.concatenate([first, last]) if straddle else first
    if straddle:
        lines.sort()
    distinct = lines[np.concatenate(([True], lines[1:] != lines[:-1]))]
    if not store:
        return int(distinct.size), 0
    if straddle or (a.size > 1 and np.count_nonzero(a[1:] - a[:-1] < np.uint64(nbytes))):
        # overlapping lanes or lanes crossing a line: count each byte once
        byte_addrs = np.unique((a[:, None] + np.arange(nbytes, dtype=np.uint64)).ravel())
        covered = np.bincount(np.searchsorted(distinct, byte_addrs >> LINE_SHIFT), minlength=distinct.size)
    else:  # disjoint lanes, each inside one line
        covered = np.bincount(np.searchsorted(distinct, first), minlength=distinct.size) * nbytes
    return int(distinct.size), int(np.count_nonzero(covered < LINE_BYTES))


class MemRecorder:
    """Accumulates memory counters per instruction index during a launch.

    Line counts depend only on the lanes' addresses relative to the first active lane and on
    that lane's offset in its line (a translation by whole lines changes nothing), and kernels
    repeat few such patterns, so `line_counts` is computed once per pattern."""

    def __init__(self):
        self.counters: dict[int, MemCounter] = {}
        self.global_store = False  # did the current workgroup store/atomically update global memory
        self._patterns: dict[tuple, tuple[int, int]] = {}

    def counter(self, index: int) -> MemCounter:
        c = self.counters.get(index)
        if c is None:
            c = self.counters[index] = MemCounter()
        return c

    def global_access(self, index: int, addrs: np.ndarray, mask: np.ndarray | None, nbytes: int, store: bool,
                      part: int = 0) -> None:
        """Record one global access: `nbytes` per active lane at `addrs` (uint64). An instruction
        recorded in several parts counts as executed once (part 0)."""
        c = self.counters.get(index)
        if c is None:
            c = self.counters[index] = MemCounter()
        c.executed += part == 0
        a = addrs[mask] if mask is not None else addrs
        if a.size == 0:
            return
        c.bytes += int(a.size) * nbytes
        if store:
            self.global_store = True
        a0 = a[0]
        key = (int(a0) % LINE_BYTES, nbytes, store, (a - a0).tobytes())
        counts = self._patterns.get(key)
        if counts is None:
            if len(self._patterns) >= LINE_PATTERN_CACHE_SIZE:
                self._patterns.clear()
            counts = self._patterns[key] = line_counts(a, nbytes, store)
        c.lines += counts[0]
        c.partial_store_lines += counts[1]

    def lds_access(self, index: int, active_lanes: int, nbytes: int) -> None:
        c = self.counter(index)
        c.executed += 1
        c.bytes += active_lanes * nbytes
