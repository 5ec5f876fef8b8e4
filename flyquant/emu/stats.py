"""Counters of one emulated kernel launch (`LaunchStats`), a plain Python object.

Counting rule: one wave-instruction per instruction a wave executes (s_nop and s_waitcnt
included). Instructions are grouped by class (`CLASSES`) and by mnemonic. Every vector memory
instruction (global/buffer/flat and LDS) also adds the lanes that moved data (EXEC-active and,
for buffer accesses, in range), the bytes they moved and, for global memory, the distinct
128-byte lines they touched: coalescing = bytes / (lines * 128). A global store that covers a
line only in part is counted in `partial_store_lines` (a real GPU then does a read-modify-write
or a masked write of that line).

The memory counters exist per mnemonic (`LaunchStats.memory`) and per instruction
(`LaunchStats.memory_by_pc`, keyed by the instruction's byte offset from the kernel entry, with
the lowest and one past the highest global byte address it touched). Instructions of one
mnemonic often serve different tensors (e.g. weights and activations both by
buffer_load_dwordx4); `LaunchStats.traffic_within(lo, hi)` sums the instructions that stayed
inside one tensor's bytes. Under the emulator a CPU tensor's `data_ptr()` is the address the
kernel sees, so a contiguous tensor t is `traffic_within(t.data_ptr(), t.data_ptr() + t.nbytes)`.
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


@dataclass(slots=True)
class MemCounter:
    """Memory traffic of one or more instructions: executions, lanes that moved data (summed over
    executions), the bytes they moved, 128-byte lines touched (global memory only)."""

    executed: int = 0
    lanes: int = 0
    bytes: int = 0
    lines: int = 0
    partial_store_lines: int = 0

    @property
    def coalescing(self) -> float:
        """Useful bytes per byte of the 128-byte lines touched (1.0 = perfectly coalesced)."""
        return self.bytes / (self.lines * LINE_BYTES) if self.lines else 0.0

    @property
    def bytes_per_lane(self) -> float:
        """Bytes a lane that moved data moved per execution (16 for full dwordx4 accesses)."""
        return self.bytes / self.lanes if self.lanes else 0.0

    def add(self, other: MemCounter) -> None:
        """Accumulate `other`'s counts into this counter."""
        self.executed += other.executed
        self.lanes += other.lanes
        self.bytes += other.bytes
        self.lines += other.lines
        self.partial_store_lines += other.partial_store_lines


@dataclass(slots=True)
class PcMemCounter(MemCounter):
    """One memory instruction's traffic in a launch: `pc` its byte offset from the kernel entry,
    `name` its mnemonic, `text` its assembly, `cls` its class; [lo, hi) spans the global bytes its
    lanes touched (lo the lowest address, hi one past the highest; None for LDS instructions and
    for instructions that never moved data)."""

    pc: int = -1
    name: str = ""
    text: str = ""
    cls: str = ""
    lo: int | None = None
    hi: int | None = None


@dataclass
class LaunchStats:
    """What one launch executed. `by_class` / `by_opcode`: wave-instructions per class and per
    mnemonic; `memory`: per memory mnemonic, a `MemCounter`, with `mem_class` its class;
    `memory_by_pc`: the same per memory instruction, keyed by its byte offset from the kernel
    entry (`PcMemCounter`, with the global address range it touched);
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
    memory_by_pc: dict[int, PcMemCounter] = field(default_factory=dict)  # per instruction, by offset
    lds_out_of_range_lanes: int = 0  # LDS accesses past the workgroup's allocation (read 0 / dropped)
    seconds: float = 0.0
    cpu_seconds: float = 0.0

    # -- derived ----------------------------------------------------------------------------------
    def bytes_of(self, cls: str) -> int:
        """Bytes moved by the instructions of one class (vmem_load, vmem_store, vmem_atomic, lds)."""
        return sum(c.bytes for name, c in self.memory.items() if self.mem_class.get(name) == cls)

    def memory_within(self, lo: int, hi: int) -> dict[int, PcMemCounter]:
        """The global memory instructions (by pc) whose every access lay inside [lo, hi)."""
        return {pc: c for pc, c in self.memory_by_pc.items() if c.lo is not None and lo <= c.lo and c.hi <= hi}

    def traffic_within(self, lo: int, hi: int) -> MemCounter:
        """The summed traffic of `memory_within(lo, hi)`: for a tensor t under the emulator,
        lo = t.data_ptr(), hi = lo + t.nbytes."""
        total = MemCounter()
        for c in self.memory_within(lo, hi).values():
            total.add(c)
        return total

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

    Line counts and the address extent relative to the first active lane depend only on the
    lanes' addresses relative to that lane and on its offset in its line (a translation by
    whole lines changes nothing), and kernels repeat few such patterns, so they are computed
    once per pattern."""

    def __init__(self):
        self.counters: dict[int, PcMemCounter] = {}
        self.global_store = False  # did the current workgroup store/atomically update global memory
        self._patterns: dict[tuple, tuple[int, int, int, int]] = {}

    def counter(self, index: int) -> PcMemCounter:
        c = self.counters.get(index)
        if c is None:
            c = self.counters[index] = PcMemCounter()
        return c

    def global_access(self, index: int, addrs: np.ndarray, mask: np.ndarray | None, nbytes: int, store: bool,
                      lanes: int | None = None) -> None:
        """Record one execution: `nbytes` at each of `addrs` (uint64) where `mask` (None: all).
        `lanes`: the lanes that moved data, when `addrs` holds several pieces per lane (a
        buffer access split at the end of its range); None: one address per lane."""
        c = self.counters.get(index)
        if c is None:
            c = self.counters[index] = PcMemCounter()
        c.executed += 1
        a = addrs[mask] if mask is not None else addrs
        if a.size == 0:
            return
        n = a.size
        c.lanes += n if lanes is None else lanes
        c.bytes += n * nbytes
        if store:
            self.global_store = True
        a0 = a[0]
        start = int(a0)
        key = (start % LINE_BYTES, nbytes, store, (a - a0).tobytes())
        counts = self._patterns.get(key)
        if counts is None:
            if len(self._patterns) >= LINE_PATTERN_CACHE_SIZE:
                self._patterns.clear()
            rel = (a - a0).view(np.int64)  # lanes below the first one wrap to negative offsets
            counts = self._patterns[key] = (*line_counts(a, nbytes, store), int(rel.min()), int(rel.max()) + nbytes)
        c.lines += counts[0]
        c.partial_store_lines += counts[1]
        lo, hi = start + counts[2], start + counts[3]
        if c.lo is None:
            c.lo, c.hi = lo, hi
        else:
            if lo < c.lo:
                c.lo = lo
            if hi > c.hi:
                c.hi = hi

    def lds_access(self, index: int, active_lanes: int, nbytes: int) -> None:
        c = self.counter(index)
        c.executed += 1
        c.lanes += active_lanes
        c.bytes += active_lanes * nbytes
