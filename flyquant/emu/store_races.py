"""Global stores of one launch that race: two workgroups storing different bytes to the same
address with plain (non-atomic) stores.

The interpreter runs workgroups one after another (interp.py), so the later one's bytes always
win; on hardware the workgroups run in any order and either may. A kernel whose output depends
on that order passes every emulated test and is wrong on a GPU now and then. In strict memory
mode (the test suite's) each launch records per byte the workgroup that last stored it, and a
store by another workgroup that changes the byte raises `StoreRace`. Stores of the bytes already
there (the same zeros from two workgroups) are left alone: their order does not matter. Atomics
are not recorded, and neither are loads (a workgroup reading what another stored needs a flag
and a fence, which this does not try to judge).
"""

from __future__ import annotations

import numpy as np

PAGE_BITS = 12
PAGE_MASK = (1 << PAGE_BITS) - 1


class StoreRace(Exception):
    """Two workgroups of a launch store different bytes to one address."""


class StoreRaceCheck:
    """The per-byte last storer of one launch's global stores (module docstring)."""

    def __init__(self, base: int):
        self.base = base  # address of byte index 0 (Memory.BASE)
        self.owner: dict[int, np.ndarray] = {}  # page -> per byte: workgroup number + 1 (0: none)
        self.workgroups: list[tuple] = []  # number -> workgroup ids

    def start(self, ids: tuple) -> int:
        """A workgroup starts; returns its number."""
        self.workgroups.append(ids)
        return len(self.workgroups) - 1

    def record(self, number: int, idx: np.ndarray, old: np.ndarray, new: np.ndarray) -> None:
        """Workgroup `number` stores `new` over `old` at the byte indices `idx` (same shapes)."""
        idx, changed = idx.ravel(), (old != new).ravel()
        pages = idx >> PAGE_BITS
        for page in np.unique(pages):
            sel = pages == page
            own = self.owner.get(int(page))
            if own is None:
                own = self.owner[int(page)] = np.zeros(1 << PAGE_BITS, np.int32)
            at = (idx[sel] & PAGE_MASK).astype(np.intp)
            prev = own[at]
            bad = (prev != 0) & (prev != number + 1) & changed[sel]
            if bad.any():
                k = int(np.flatnonzero(bad)[0])
                address = self.base + int(idx[sel][k])
                raise StoreRace(f"workgroup {self.workgroups[number]} stores to {address:#x}, where workgroup "
                                f"{self.workgroups[int(prev[k]) - 1]} of the same launch stored a different byte "
                                f"(the order of the two is not defined on hardware)")
            own[at] = number + 1
