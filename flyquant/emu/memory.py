"""Global memory of emulated kernels: host memory, addressed by host addresses, checked first.

FlyDSL passes CPU tensors' ``data_ptr()`` as kernel arguments and the HIP stand-in allocates
"device" memory with the C allocator, so a guest address *is* a host address. The interpreter
does every global access through a ``Memory``: each access is checked against the regions
known to be valid, so a wrong address raises ``EmuMemoryError`` naming it instead of
crashing the process.

Regions:
- precise ones, given to ``register``: hipMalloc allocations (the HIP stand-in reports them),
  the kernarg segment of the running launch and tensors given to ``flyquant.emu.track``;
- the process's mappings from /proc/self/maps (readable, and writable for stores), re-read
  when an address is not found, unless the memory is in strict mode: then only the precise
  regions are valid, which catches a kernel reading past the end of a tracked tensor.

Accesses go through one NumPy view of the whole user address space (``space``): after the
check, lane addresses become indices into it. The common case, all lanes inside the region
the previous access used, costs one vectorised compare and one fancy index.
"""

from __future__ import annotations

import bisect
import itertools
import threading

import numpy as np

# The view starts above page 0 (never mapped on Linux: vm.mmap_min_addr >= 4096) and ends at
# the top of the x86-64 user address space with 4-level paging (2**47).
BASE = 0x1000
END = 1 << 47
# Pseudo-mappings that are readable in /proc/self/maps but must not be touched (vvar can fault).
_UNSAFE_MAPPINGS = ("[vvar]", "[vvar_vclock]", "[vsyscall]")
_BASE_U64 = np.uint64(BASE)
_BYTE_OFFSETS: dict[int, np.ndarray] = {}  # nbytes -> arange(nbytes), reused by every access


class EmuMemoryError(RuntimeError):
    """A kernel accessed memory outside every known region."""

    def __init__(self, address: int, nbytes: int, write: bool, detail: str = ""):
        self.address = address
        self.nbytes = nbytes
        self.write = write
        kind = "store to" if write else "load from"
        super().__init__(f"{kind} {address:#x} ({nbytes} bytes) outside every known memory region{detail}")


class _RawSpan:
    """Exposes [ptr, ptr + n) to NumPy through the array interface (no copy, no ownership)."""

    def __init__(self, ptr: int, n: int):
        self.__array_interface__ = {"data": (ptr, False), "shape": (n,), "typestr": "|u1", "version": 3}


def _read_maps() -> list[tuple[int, int, bool]]:
    """(start, end, writable) of the readable mappings of this process."""
    spans: list[tuple[int, int, bool]] = []
    with open("/proc/self/maps") as f:
        for line in f:
            fields = line.split()
            perms = fields[1]
            if perms[0] != "r" or (len(fields) > 5 and fields[5] in _UNSAFE_MAPPINGS):
                continue
            start, end = (int(x, 16) for x in fields[0].split("-"))
            writable = perms[1] == "w"
            spans.append((start, end, writable))
    return spans


class _RegionSet:
    """Spans (start, end, writable), overlapping or touching ones of equal writability merged;
    answers 'is [a, a + n) inside one span'."""

    def __init__(self, spans: list[tuple[int, int, bool]]):
        merged: list[tuple[int, int, bool]] = []
        for start, end, writable in sorted(spans):
            if merged and start <= merged[-1][1] and writable == merged[-1][2]:
                merged[-1] = (merged[-1][0], max(end, merged[-1][1]), writable)
            else:
                merged.append((start, end, writable))
        spans = merged
        self.spans = spans
        self.starts = np.array([s for s, _, _ in spans], dtype=np.uint64)
        self.ends = np.array([e for _, e, _ in spans], dtype=np.uint64)
        self.writable = np.array([w for _, _, w in spans], dtype=bool)
        self._start_list = [s for s, _, _ in spans]

    def find(self, lo: int, hi: int, write: bool):
        """The span containing [lo, hi), or None (checks the nearest span starting at or before lo)."""
        i = bisect.bisect_right(self._start_list, lo) - 1
        if i >= 0:
            _start, end, writable = self.spans[i]
            if hi <= end and (writable or not write):
                return self.spans[i]
        return None

    def contains(self, addrs: np.ndarray, nbytes: int, write: bool) -> np.ndarray:
        """Per-address: is [a, a + nbytes) inside one span (writable if `write`)."""
        if not self.spans:
            return np.zeros(addrs.shape, dtype=bool)
        i = np.searchsorted(self.starts, addrs, side="right").astype(np.int64) - 1
        ok = (i >= 0) & (addrs < np.uint64(END - nbytes))  # (no wrap-around in addrs + nbytes)
        j = np.maximum(i, 0)
        ok &= addrs + np.uint64(nbytes) <= self.ends[j]
        if write:
            ok &= self.writable[j]
        return ok


class Memory:
    """Checked access to host memory for the interpreter (see module docstring)."""

    BASE = BASE

    def __init__(self, strict: bool = False):
        self.strict = strict
        self._space = np.asarray(_RawSpan(BASE, END - BASE))
        self._typed: dict[np.dtype, np.ndarray] = {np.dtype(np.uint8): self._space}
        self._keys = itertools.count()
        self._registered: dict[int, tuple[int, int, bool]] = {}
        self._precise = _RegionSet([])
        self._maps = _RegionSet([])
        self._last: tuple[int, int, bool] = (0, 0, False)  # the span that satisfied the last check
        self._lock = threading.Lock()  # threads register and unregister at once (emu.track, kernargs)

    # -- regions ---------------------------------------------------------------------------------
    def register(self, start: int, nbytes: int, writable: bool = True) -> int:
        """Mark [start, start + nbytes) valid (also in strict mode); returns a key for `unregister`."""
        if start < BASE or start + nbytes > END:
            raise ValueError(f"region [{start:#x}, {start + nbytes:#x}) is outside the user address space")
        with self._lock:
            key = next(self._keys)
            self._registered[key] = (start, start + nbytes, writable)
            self._precise = _RegionSet(list(self._registered.values()))
        return key

    def unregister(self, key: int) -> None:
        with self._lock:
            if self._registered.pop(key, None) is not None:
                self._precise = _RegionSet(list(self._registered.values()))
                self._last = (0, 0, False)

    def _find(self, lo: int, hi: int, write: bool) -> bool:
        """Is [lo, hi) inside one known span? (Remembers the span: lanes of the next access
        usually fall in the same one.)"""
        last = self._last
        if last[0] <= lo and hi <= last[1] and (last[2] or not write):
            return True
        for regions in (self._precise,) if self.strict else (self._precise, self._maps):
            span = regions.find(lo, hi, write)
            if span is not None:
                self._last = span
                return True
        return False

    def check(self, addrs: np.ndarray, nbytes: int, mask: np.ndarray | None = None, write: bool = False) -> None:
        """Raise EmuMemoryError unless every active lane's [addr, addr + nbytes) is valid."""
        a = addrs if mask is None else addrs[mask]
        if a.size == 0:
            return
        a = a.astype(np.uint64, copy=False)
        start, end, writable = self._last  # fast path: the span of the previous access
        if end - start >= nbytes and (writable or not write):
            # a - start wraps around for a < start, so one unsigned compare bounds both sides
            if not np.count_nonzero(a - np.uint64(start) > np.uint64(end - start - nbytes)):
                return
        lo, hi = int(a.min()), int(a.max()) + nbytes
        if self._find(lo, hi, write) or self._lanes_ok(a, nbytes, write):
            return
        if not self.strict:  # memory mapped since the mappings were last read (new tensors)?
            self._maps = _RegionSet(_read_maps())
            if self._find(lo, hi, write) or self._lanes_ok(a, nbytes, write):
                return
        ok = self._lane_mask(a, nbytes, write)
        address = int(a[~ok][0])
        raise EmuMemoryError(address, nbytes, write, self._describe(address, write))

    def _lane_mask(self, a: np.ndarray, nbytes: int, write: bool) -> np.ndarray:
        """Per lane: is its access inside one known span (lanes may use different spans)."""
        ok = self._precise.contains(a, nbytes, write)
        if not self.strict:
            ok |= self._maps.contains(a, nbytes, write)
        return ok

    def _lanes_ok(self, a: np.ndarray, nbytes: int, write: bool) -> bool:
        return bool(self._lane_mask(a, nbytes, write).all())

    def _describe(self, address: int, write: bool) -> str:
        if address < BASE:
            return " (null or near-null pointer)"
        if write and not self.strict and self._maps.find(address, address + 1, False) is not None:
            return " (the mapping there is read-only)"
        if self.strict:
            return " (strict mode: only hipMalloc'd, tracked and launch-internal ranges are valid)"
        return ""

    # -- access ----------------------------------------------------------------------------------
    def space(self, dtype=np.uint8) -> np.ndarray:
        """The whole address space as `dtype`: element i is at address BASE + i * itemsize.

        Index only with addresses that passed `check` (an unchecked index can crash the process).
        """
        dtype = np.dtype(dtype)
        view = self._typed.get(dtype)
        if view is None:
            view = self._typed[dtype] = self._space.view(dtype)
        return view

    def _indices(self, addrs: np.ndarray, nbytes: int) -> np.ndarray:
        """(lanes, nbytes) byte indices into `space()` of already checked addresses."""
        offsets = _BYTE_OFFSETS.get(nbytes)
        if offsets is None:
            offsets = _BYTE_OFFSETS[nbytes] = np.arange(nbytes, dtype=np.uint64)
        return (addrs.astype(np.uint64, copy=False) - _BASE_U64)[:, None] + offsets

    def load(self, addrs: np.ndarray, nbytes: int, mask: np.ndarray | None = None) -> np.ndarray:
        """(lanes, nbytes) uint8 read at each active lane's address (mask None: all lanes);
        inactive lanes read 0 and their addresses are not touched."""
        active = addrs.shape[0] if mask is None else np.count_nonzero(mask)
        if active == addrs.shape[0]:
            self.check(addrs, nbytes, None)
            return self._space[self._indices(addrs, nbytes)]
        out = np.zeros((addrs.shape[0], nbytes), dtype=np.uint8)
        if active:
            a = addrs[mask]
            self.check(a, nbytes, None)
            out[mask] = self._space[self._indices(a, nbytes)]
        return out

    def store(self, addrs: np.ndarray, data: np.ndarray, mask: np.ndarray | None = None, race=None) -> None:
        """Write data[lane] (uint8 rows) at each active lane's address (mask None: all lanes);
        where lanes overlap, the highest lane's bytes win. `race(indices, old, new)`, if given,
        sees the bytes before they are written (store_races)."""
        nbytes = data.shape[1]
        if mask is not None and np.count_nonzero(mask) != addrs.shape[0]:
            addrs, data = addrs[mask], data[mask]
        if addrs.shape[0]:
            self.check(addrs, nbytes, None, write=True)
            idx = self._indices(addrs, nbytes)
            if race is not None:
                race(idx, self._space[idx], data)
            self._space[idx] = data

    def read(self, addr: int, nbytes: int) -> np.ndarray:
        """A copy of nbytes at one address (scalar loads), checked."""
        if not self._find(addr, addr + nbytes, False):
            self.check(np.array([addr], dtype=np.uint64), nbytes)
        return self._space[addr - BASE : addr - BASE + nbytes].copy()


__all__ = ["BASE", "EmuMemoryError", "Memory"]
