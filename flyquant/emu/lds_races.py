"""LDS races between the waves of a workgroup: accesses to the same byte by two waves with no
s_barrier between them, at least one a write.

The interpreter runs a workgroup's waves one after another between barriers (interp.py), so a
wave reads what a lower-numbered wave wrote since the last barrier as if the write had come
first; on hardware the two are unordered and the read may see the old byte. Such a kernel passes
every emulated test and fails on a GPU. This check makes it fail here: per LDS byte it keeps the
last writer and the waves that read it, each with the barrier epoch of the access, and raises
`LdsRace` on a read of another wave's write (RAW), a write over another wave's write (WAW) or
over another wave's read (WAR) in the same epoch. A write that leaves a byte as it was (waves
holding copies of one value, as Triton's layout conversions do, all storing it) is neither a
race nor recorded: in either order the byte ends the same and every read sees it. Within a wave
program order holds (the ISA orders a wave's LDS accesses), so a wave's own accesses never race.
LDS atomics are neither checked nor recorded (they are ordered by the hardware); a workgroup of
one wave is not tracked.
"""

from __future__ import annotations

import numpy as np


class LdsRace(Exception):
    """Two waves of a workgroup touch the same LDS byte with no barrier between them."""


class LdsRaceCheck:
    """The per-byte access record of one workgroup's LDS (module docstring)."""

    def __init__(self, nbytes: int):
        self.writer = np.full(nbytes, -1, np.int16)
        self.write_epoch = np.full(nbytes, -1, np.int64)
        self.readers = np.zeros(nbytes, np.uint16)  # bit w: wave w read it in read_epoch (<= 16 waves)
        self.read_epoch = np.full(nbytes, -1, np.int64)
        self.epoch = 0

    def reset(self) -> None:
        """A new workgroup."""
        self.writer.fill(-1)
        self.write_epoch.fill(-1)
        self.readers.fill(0)
        self.read_epoch.fill(-1)
        self.epoch = 0

    def barrier(self) -> None:
        self.epoch += 1

    def _written_by_another(self, wave: int, idx: np.ndarray) -> np.ndarray:
        return (self.write_epoch[idx] == self.epoch) & (self.writer[idx] != wave)

    def read(self, wave: int, idx: np.ndarray) -> None:
        """Wave `wave` reads the LDS bytes `idx` (int64, any shape)."""
        idx = idx.ravel()
        bad = self._written_by_another(wave, idx)
        if bad.any():
            at = int(np.flatnonzero(bad)[0])
            raise LdsRace(f"wave {wave} reads LDS byte {int(idx[at])}, which wave {int(self.writer[idx[at]])} "
                          f"wrote with no s_barrier between them (their order is not defined on hardware)")
        stale = idx[self.read_epoch[idx] != self.epoch]
        self.readers[stale] = 0
        self.read_epoch[idx] = self.epoch
        self.readers[idx] |= np.uint16(1 << wave)

    def write(self, wave: int, idx: np.ndarray, changed: np.ndarray) -> None:
        """Wave `wave` writes the LDS bytes `idx`, `changed` (same shape) where the byte written
        differs from the one there."""
        idx = idx.ravel()[changed.ravel()]
        over_write = self._written_by_another(wave, idx)
        over_read = (self.read_epoch[idx] == self.epoch) & ((self.readers[idx] & np.uint16(~(1 << wave) & 0xFFFF)) != 0)
        bad = over_write | over_read
        if bad.any():
            at = int(np.flatnonzero(bad)[0])
            byte = int(idx[at])
            if over_write[at]:
                other = f"wave {int(self.writer[byte])} wrote"
            else:
                others = [v for v in range(16) if v != wave and int(self.readers[byte]) >> v & 1]
                other = f"wave {others[0]} read"
            raise LdsRace(f"wave {wave} writes LDS byte {byte}, which {other} with no s_barrier between "
                          f"them (their order is not defined on hardware)")
        self.writer[idx] = wave
        self.write_epoch[idx] = self.epoch
