"""Scratch (private) memory: the SCRATCH encoding's loads and stores (scratch_load_*/scratch_store_*).

A kernel whose descriptor asks for a private segment (COMPUTE_PGM_RSRC2.SCRATCH_EN, with
`.private_segment_fixed_size` bytes per work-item) gets, per wave, one zeroed byte array per
lane of that size (`Wave.scratch`, shape (64, size)), set up by the interpreter at dispatch.
gfx942/gfx950 have architected flat scratch: the hardware points FLAT_SCRATCH at the wave's
private memory, so code addresses it with per-lane offsets only (the hardware interleaves the
lanes' dwords in memory; each lane sees its own contiguous private memory, which is what this
models).

Address of a lane (CDNA3/CDNA4 ISA guides, "Scratch" FLAT segment): the offset
    (SADDR != off ? SGPR[SADDR] : 0) + (SVE ? VGPR[VADDR] : 0) + sext(OFFSET, 13)
into the lane's private memory. A lane's access that leaves [0, size) is an error naming the
instruction (the hardware would read or clobber other memory), never a silent read of 0.
"""

from __future__ import annotations

import numpy as np

from . import decode as D
from . import table
from .isa_base import sext, sreader
from .isa_mem import data_rows, gather_store_bytes, parse_access, write_load


def _offsets(ctx, inst):
    """Closure w -> int64[64]: each lane's byte offset into its private memory."""
    f = inst.f
    const = sext(f["offset"], 13)
    sgpr = sreader(ctx, inst, f["saddr"]) if f["saddr"] != D.GLOBAL_SADDR_OFF else None
    vaddr = f["addr"] if f["sve"] else None

    def offsets(w):
        off = np.full(64, const + (sgpr(w) if sgpr is not None else 0), np.int64)
        if vaddr is not None:
            off += w.v[vaddr]
        return off
    return offsets


def build_scratch(inst, ctx):
    parsed = parse_access(inst.name)
    if parsed is None:
        return None
    kind, nbytes, signed, d16 = parsed
    offsets = _offsets(ctx, inst)
    span = np.arange(nbytes)
    err = ctx.error

    def lanes_and_bytes(w):
        """(active lanes, their byte indices (lanes, nbytes)) after the range check."""
        if w.scratch is None:
            raise err(inst, "scratch access in a kernel without a private segment")
        lanes = np.flatnonzero(w.exec_mask)
        start = offsets(w)[lanes]
        bad = (start < 0) | (start + nbytes > w.scratch.shape[1])
        if bad.any():
            lane = int(lanes[np.argmax(bad)])
            raise err(inst, f"lane {lane} accesses private bytes {int(start[np.argmax(bad)])}.."
                            f"{int(start[np.argmax(bad)]) + nbytes - 1} outside its {w.scratch.shape[1]}")
        return lanes, start[:, None] + span

    if kind == "load":
        row = data_rows(inst, "vdst")

        def load(w):
            lanes, idx = lanes_and_bytes(w)
            data = np.zeros((64, nbytes), np.uint8)
            data[lanes] = w.scratch[lanes[:, None], idx]
            write_load(w, row, data, nbytes, signed, d16, None if w.exec_full else w.exec_mask)
        return load
    if kind != "store":
        return None
    row = data_rows(inst, "data")

    def store(w):
        lanes, idx = lanes_and_bytes(w)
        w.scratch[lanes[:, None], idx] = gather_store_bytes(w, row, nbytes, d16)[lanes]
    return store


table.register_encoding({"SCRATCH": build_scratch})
