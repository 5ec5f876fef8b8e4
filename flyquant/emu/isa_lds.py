"""LDS: the DS instructions (loads, stores, pairs, atomics, the cross-lane moves through the LDS
crossbar) and `Lds`, the checked access to a workgroup's LDS bytes that they and the loads to
LDS (isa_mem) use.

LDS is one byte array per workgroup (static + dynamic size from the launch). An access past its
end reads 0 / writes nothing (the hardware's behaviour) and is counted in the launch statistics.
In a workgroup of several waves every read and write goes through its race check (lds_races).
"""

from __future__ import annotations

import numpy as np

from . import table
from .isa_base import AGPR_BASE, F32, LANE_IDS, LANES, U8, U32
from .isa_mem import DWORD, _active, _apply_atomic, gather_store_bytes, write_load

_DS_WIDTH = {"b8": 1, "u8": 1, "i8": 1, "b16": 2, "u16": 2, "i16": 2, "b32": 4, "b64": 8, "b96": 12, "b128": 16}


_LDS_BYTE_OFFSETS = {n: np.arange(n, dtype=np.int64) for n in (1, 2, 4, 8, 12, 16)}


class Lds:
    """Checked gathers/scatters on the workgroup's LDS bytes (lanes past the end: 0 / dropped).
    `addrs` are int64 byte addresses of all 64 lanes; when every lane (active or not) is in
    range, one gather/scatter does it."""

    @staticmethod
    def _ok(w, addrs, nbytes, mask):
        size = w.wg.lds.size
        ok = addrs + nbytes <= size
        if mask is not None:
            bad = mask & ~ok
            ok = ok & mask
        else:
            bad = ~ok
        n_bad = int(np.count_nonzero(bad))
        if n_bad:
            w.launch.lds_oob += n_bad
        return ok

    @staticmethod
    def _record(w, addrs, nbytes, mask, data=None):
        """The workgroup's race check (lds_races) of the active lanes' bytes in range: a read, or
        (data given) a write of data's rows, which tells which bytes it changes."""
        lanes = addrs + nbytes <= w.wg.lds.size
        if mask is not None:
            lanes = lanes & mask
        idx = addrs[lanes, None] + _LDS_BYTE_OFFSETS[nbytes]
        if data is None:
            w.wg.races.read(w.wave_id, idx)
        else:
            w.wg.races.write(w.wave_id, idx, w.wg.lds[idx] != data[lanes])

    @staticmethod
    def read(w, addrs, nbytes, mask):
        """(64, nbytes) uint8; rows of inactive lanes are unspecified (never written back)."""
        if w.wg.races is not None:
            Lds._record(w, addrs, nbytes, mask)
        lds = w.wg.lds
        if not np.count_nonzero(addrs > lds.size - nbytes):
            return lds[addrs[:, None] + _LDS_BYTE_OFFSETS[nbytes]]
        ok = Lds._ok(w, addrs, nbytes, mask)
        idx = np.where(ok[:, None], addrs[:, None] + _LDS_BYTE_OFFSETS[nbytes], 0)
        return lds[idx] * ok[:, None].astype(U8)

    @staticmethod
    def write(w, addrs, data, mask):
        lds = w.wg.lds
        nbytes = data.shape[1]
        if w.wg.races is not None:
            Lds._record(w, addrs, nbytes, mask, data)
        if not np.count_nonzero(addrs > lds.size - nbytes):
            if mask is None:  # colliding lanes: the highest lane's bytes win
                lds[addrs[:, None] + _LDS_BYTE_OFFSETS[nbytes]] = data
                return
            lanes = np.flatnonzero(mask)
        else:
            lanes = np.flatnonzero(Lds._ok(w, addrs, nbytes, mask))
        lds[addrs[lanes, None] + _LDS_BYTE_OFFSETS[nbytes]] = data[lanes]


def build_ds(inst, ctx):
    name, f = inst.name, inst.f
    if f["gds"]:
        raise ctx.error(inst, "GDS is not supported")
    index = ctx.index
    addr_row = f["addr"]
    acc = AGPR_BASE if f["acc"] else 0
    d0, d1, vdst = f["data0"] + acc, f["data1"] + acc, f["vdst"] + acc
    offset = f["offset0"] | f["offset1"] << 8
    op = name[3:]

    def addrs(w):
        return w.v[addr_row].astype(np.int64) + offset

    if op in ("swizzle_b32", "permute_b32", "bpermute_b32"):
        return _build_ds_lane(inst, ctx, op, addr_row, d0, vdst, offset, index)
    if op.startswith(("write2", "read2")):
        return _build_ds_pair(inst, ctx, op, addr_row, d0, d1, vdst, index)
    if op.startswith(("write_", "read_")) and "addtid" not in op and "_tr_" not in op:
        parts = op.split("_")
        kind, width = parts[0], parts[1]
        d16 = None
        if parts[2:] == ["d16", "hi"]:
            d16 = "hi"
        elif parts[2:] == ["d16"]:
            d16 = "lo"
        elif parts[2:]:
            return None
        nbytes = _DS_WIDTH.get(width)
        if nbytes is None:
            return None
        signed = width.startswith("i")
        if kind == "write":
            def ds_write(w):
                mask = _active(w)
                Lds.write(w, addrs(w), gather_store_bytes(w, d0, nbytes, d16), mask)
                w.launch.rec.lds_access(index, int(np.count_nonzero(w.exec_mask)), nbytes)
            return ds_write

        def ds_read(w):
            mask = _active(w)
            data = Lds.read(w, addrs(w), nbytes, mask)
            write_load(w, vdst, data, nbytes, signed, d16, mask)
            w.launch.rec.lds_access(index, int(np.count_nonzero(w.exec_mask)), nbytes)
        return ds_read
    return _build_ds_atomic(inst, ctx, op, addrs, d0, d1, vdst, index)


def _build_ds_pair(inst, ctx, op, addr_row, d0, d1, vdst, index):
    """ds_write2/read2[st64]_b32/b64: two accesses at addr + offset0/1 * size (* 64 for st64)."""
    f = inst.f
    width = op.rsplit("_", 1)[1]
    nbytes = {"b32": 4, "b64": 8}.get(width)
    if nbytes is None:
        return None
    scale = nbytes * (64 if "st64" in op else 1)
    o0, o1 = f["offset0"] * scale, f["offset1"] * scale
    if op.startswith("write2"):
        def write2(w):
            mask = _active(w)
            a = w.v[addr_row].astype(np.int64)
            Lds.write(w, a + o0, gather_store_bytes(w, d0, nbytes, None), mask)
            Lds.write(w, a + o1, gather_store_bytes(w, d1, nbytes, None), mask)
            w.launch.rec.lds_access(index, int(np.count_nonzero(w.exec_mask)), 2 * nbytes)
        return write2
    words = nbytes // DWORD

    def read2(w):
        mask = _active(w)
        a = w.v[addr_row].astype(np.int64)
        first = Lds.read(w, a + o0, nbytes, mask)
        second = Lds.read(w, a + o1, nbytes, mask)
        write_load(w, vdst, first, nbytes, False, None, mask)
        write_load(w, vdst + words, second, nbytes, False, None, mask)
        w.launch.rec.lds_access(index, int(np.count_nonzero(w.exec_mask)), 2 * nbytes)
    return read2


def _build_ds_lane(inst, ctx, op, addr_row, d0, vdst, offset, index):
    """ds_swizzle_b32, ds_permute_b32 (push), ds_bpermute_b32 (pull): cross-lane moves through the
    LDS crossbar (no LDS memory is touched). A lane reading an inactive lane gets 0."""
    if op == "swizzle_b32":
        if offset & 0x8000:  # quad mode: lane i of each quad reads quad lane offset[2i+1:2i]
            sel = np.array([(offset >> (2 * i)) & 3 for i in range(4)])
            src = (LANE_IDS & ~3) + sel[LANE_IDS & 3]
        else:  # bit mode within 32-lane halves: ((lane & and) | or) ^ xor
            and_m, or_m, xor_m = offset & 0x1F, (offset >> 5) & 0x1F, (offset >> 10) & 0x1F
            src = (LANE_IDS & 32) | ((((LANE_IDS & 31) & and_m) | or_m) ^ xor_m)

        def swizzle(w):  # the data operand of ds_swizzle is the ADDR register
            data = w.v[addr_row][src] * w.exec_mask[src]
            if w.exec_full:
                w.v[vdst] = data
            else:
                np.copyto(w.v[vdst], data, where=w.exec_mask)
        return swizzle

    def permute(w):
        lane = ((w.v[addr_row].astype(np.int64) + offset) >> 2) & (LANES - 1)
        mask = w.exec_mask
        if op == "bpermute_b32":
            data = w.v[d0][lane] * mask[lane]
        else:
            data = np.zeros(LANES, U32)
            act = np.flatnonzero(mask)
            data[lane[act]] = w.v[d0][act]  # colliding lanes: the highest lane wins
        if w.exec_full:
            w.v[vdst] = data
        else:
            np.copyto(w.v[vdst], data, where=mask)
    return permute


_DS_ATOMIC = {"add_u32": "add", "sub_u32": "sub", "min_i32": "smin", "max_i32": "smax", "min_u32": "umin",
              "max_u32": "umax", "and_b32": "and", "or_b32": "or", "xor_b32": "xor", "inc_u32": "inc",
              "dec_u32": "dec", "add_f32": "add_f32", "wrxchg_b32": "swap", "cmpst_b32": "cmpswap",
              "pk_add_bf16": "pk_add_bf16", "pk_add_f16": "pk_add_f16"}


def _build_ds_atomic(inst, ctx, op, addrs, d0, d1, vdst, index):
    ret = "_rtn_" in op
    base = op.replace("rtn_", "")
    if base in ("min_f32", "max_f32"):
        from .isa_vmath import max_f32, min_f32
        fn = max_f32 if base == "max_f32" else min_f32
        atomic = "custom"
    else:
        atomic = _DS_ATOMIC.get(base)
        if atomic is None:
            return None

    def run(w):
        a = addrs(w)
        mask = w.exec_mask
        lanes = np.flatnonzero(mask)
        ok = Lds._ok(w, a, DWORD, mask)
        if np.count_nonzero(a[lanes] & 3):
            raise ctx.error(inst, "misaligned LDS atomic address")
        good = np.flatnonzero(ok)
        lds32 = w.wg.lds[: w.wg.lds.size // 4 * 4].view(U32)
        idx = a[good] >> 2
        if atomic == "custom":
            old = np.empty(good.size, U32)
            for k, lane in enumerate(good):
                o = lds32[idx[k]:idx[k] + 1].copy()
                old[k] = o[0]
                lds32[idx[k]] = fn(o.view(F32), w.v[d0, lane:lane + 1].view(F32), ctx.ieee).view(U32)[0]
        else:
            data = (w.v[d0, good], w.v[d1, good]) if atomic == "cmpswap" else w.v[d0, good]
            if atomic == "cmpswap":  # ds_cmpst: DATA0 is the compare value, DATA1 the new one
                data = (data[1], data[0])
            old = _apply_atomic(lds32, idx, data, atomic)
        if ret:
            out = np.zeros(LANES, U32)
            out[good] = old
            np.copyto(w.v[vdst], out, where=mask)
        w.launch.rec.lds_access(index, int(lanes.size), DWORD)
    return run


table.register_encoding({"DS": build_ds})
