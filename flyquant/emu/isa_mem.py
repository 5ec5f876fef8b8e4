"""Vector memory: GLOBAL/FLAT and MUBUF (buffer) loads, stores and atomics.

Global addresses are host addresses; every access goes through the launch's `Memory`
(flyquant.emu.memory), which raises on an address outside every known region.

Buffer instructions address base + soffset + inst_offset + (offen ? vgpr : 0), with the base and
the size (num_records, bytes) from the 128-bit buffer resource descriptor in four SGPRs. Only raw
buffers are modelled (stride 0, no index, no swizzle, no thread-id add), which is what FlyDSL
builds. Range checking: load/store DWORDxN check each dword on its own, a byte/short access and
an atomic is in or out as a whole; an out-of-range load returns 0 and an out-of-range store or
atomic writes nothing. Which offset is checked has two readings: the CDNA3/CDNA4 ISA guides' (as
this module read them), inst_offset + vgpr offset, the SGPR offset added after the check; and
ROCm's own simulator's, matched to gfx950 hardware (rocm-systems PR 10928, for CDNA1-4): the SGPR
offset counts too, and only vgpr offset + inst_offset wraps at 32 bits. A lane whose access the two
readings judge differently is an error (EmuError naming the instruction), so a kernel that passes
here behaves the same under either.

A buffer load with the LDS bit, and global_load_lds_* (gfx950 up to DWORDx4; Triton's pipelined
loads), write each active lane's bytes to LDS instead of VGPRs, at M0 + inst_offset + lane * bytes
(the LDS address the CDNA3/CDNA4 ISA guides give for loads to LDS, M0 holding the base;
inst_offset applies to both addresses), a 32-bit sum: a negative offset that takes it below 0
wraps far past any LDS allocation, out of range (dropped and counted, as isa_lds does), not to
LDS's last bytes; a buffer load's out-of-range components write 0. Their traffic is counted as
the global load.

DS (LDS) instructions are isa_lds'. In strict memory mode every plain global store goes through
the launch's race check (store_races).
"""

from __future__ import annotations

import functools

import numpy as np

from . import decode as D
from . import table
from .isa_base import AGPR_BASE, F32, LANE_IDS, LANES, U8, U16, U32, U64, sext, sreader
from .isa_cvt import bf16_bits_to_f32, f32_to_bf16_bits

DWORD = 4
RSRC_STRIDE_SHIFT, RSRC_STRIDE_MASK = 16, 0x3FFF  # dword 1 bits 29:16
RSRC_SWIZZLE_BIT = 31  # dword 1
RSRC_ADD_TID_BIT = 23  # dword 3
BASE_MASK = (1 << 48) - 1
U64_MASK = (1 << 64) - 1

# load/store widths: suffix -> (bytes, signed)
_WIDTH = {"ubyte": (1, False), "sbyte": (1, True), "ushort": (2, False), "sshort": (2, True), "byte": (1, False),
          "short": (2, False), "dword": (4, False), "dwordx2": (8, False), "dwordx3": (12, False),
          "dwordx4": (16, False)}


def parse_access(name: str):
    """('load'|'store', bytes, signed, d16 mode) of a global/buffer/flat load/store mnemonic.

    d16 mode: None (full dwords / zero- or sign-extended to 32 bits), 'lo' (write bits 15:0,
    keep 31:16), 'hi' (write bits 31:16, keep 15:0; stores take the data from bits 31:16)."""
    parts = name.split("_")
    kind = parts[1]
    rest = parts[2:]
    d16 = None
    if rest[-2:] == ["d16", "hi"]:
        d16, rest = "hi", rest[:-2]
    elif rest[-1:] == ["d16"]:
        d16, rest = "lo", rest[:-1]
    width = "_".join(rest)
    if width not in _WIDTH:
        return None
    n, signed = _WIDTH[width]
    return kind, n, signed, d16


def data_rows(inst, field: str) -> int:
    row = inst.f[field]
    return row + (AGPR_BASE if inst.f.get("acc") else 0)


def gather_store_bytes(w, row: int, nbytes: int, d16: str | None) -> np.ndarray:
    """(64, nbytes) uint8 of the data registers of a store."""
    if nbytes >= DWORD:
        words = w.v[row:row + nbytes // DWORD]
        return np.ascontiguousarray(words.T).view(U8).reshape(LANES, nbytes)
    word = w.v[row]
    if d16 == "hi":
        word = word >> U32(16)
    return np.ascontiguousarray(word).view(U8).reshape(LANES, DWORD)[:, :nbytes]


def write_load(w, row: int, data: np.ndarray, nbytes: int, signed: bool, d16: str | None, mask) -> None:
    """Write (64, nbytes) uint8 loaded data to the destination registers of the active lanes."""
    if nbytes >= DWORD:
        words = np.ascontiguousarray(data).view(U32).reshape(LANES, nbytes // DWORD).T
        if mask is None:
            w.v[row:row + nbytes // DWORD] = words
        else:
            np.copyto(w.v[row:row + nbytes // DWORD], words, where=mask)
        return
    if nbytes == 1:
        value = data[:, 0].view(np.int8).astype(np.int32).view(U32) if signed else data[:, 0].astype(U32)
    else:
        raw = np.ascontiguousarray(data).view(U16)[:, 0]
        value = raw.view(np.int16).astype(np.int32).view(U32) if signed else raw.astype(U32)
    if d16 is None:
        new = value
    elif d16 == "lo":
        new = (w.v[row] & U32(0xFFFF0000)) | (value & U32(0xFFFF))
    else:
        new = (w.v[row] & U32(0xFFFF)) | (value << U32(16))
    if mask is None:
        w.v[row] = new
    else:
        np.copyto(w.v[row], new, where=mask)


def _active(w):
    return None if w.exec_full else w.exec_mask


def _race(w):
    """The launch's store race check for this workgroup's stores (store_races), or None."""
    check = w.launch.stores
    return None if check is None else functools.partial(check.record, w.wg.store_number)


# --- atomics ------------------------------------------------------------------------------------------
def _halves(x) -> np.ndarray:
    """uint16 (2n,) of uint32 words (n,): the low half of each word first."""
    return np.ascontiguousarray(x, U32).view(U16)


def _bf16x2_add(old, val):
    """Packed bf16 add of both halves at once, each rounded to nearest even."""
    total = bf16_bits_to_f32(_halves(old)) + bf16_bits_to_f32(_halves(val))
    return f32_to_bf16_bits(total).view(U32)


def _f16x2_add(old, val):
    """Packed f16 add of both halves at once (exact in binary64, rounded once)."""
    total = _halves(old).view(np.float16).astype(np.float64) + _halves(val).view(np.float16).astype(np.float64)
    return total.astype(np.float16).view(U32)


# op -> (dwords of memory operand, fn(old, data) -> new); data for cmpswap is (src, cmp)
ATOMIC_OPS = {
    "swap": (1, lambda o, d: d), "add": (1, lambda o, d: o + d), "sub": (1, lambda o, d: o - d),
    "smin": (1, lambda o, d: np.minimum(o.view(np.int32), d.view(np.int32)).view(U32)),
    "umin": (1, np.minimum),
    "smax": (1, lambda o, d: np.maximum(o.view(np.int32), d.view(np.int32)).view(U32)),
    "umax": (1, np.maximum), "and": (1, lambda o, d: o & d), "or": (1, lambda o, d: o | d),
    "xor": (1, lambda o, d: o ^ d),
    "inc": (1, lambda o, d: np.where(o >= d, U32(0), o + U32(1))),
    "dec": (1, lambda o, d: np.where((o == 0) | (o > d), d, o - U32(1))),
    "add_f32": (1, lambda o, d: (o.view(F32) + d.view(F32)).view(U32)),
    "pk_add_bf16": (1, _bf16x2_add), "pk_add_f16": (1, _f16x2_add),
    "cmpswap": (1, None),
}


def _apply_atomic(space, idx, data, op):
    """Apply an atomic to uint32 elements space[idx] lane by lane in lane order when lanes collide,
    vectorised otherwise; returns the values before the operation."""
    if op == "cmpswap":
        src, cmp = data
    if np.unique(idx).size == idx.size:
        old = space[idx].copy()
        if op == "cmpswap":
            space[idx] = np.where(old == cmp, src, old)
        else:
            space[idx] = ATOMIC_OPS[op][1](old, data).astype(U32)
        return old
    old = np.empty(idx.size, U32)
    for k in range(idx.size):
        i = idx[k]
        o = space[i:i + 1].copy()
        old[k] = o[0]
        if op == "cmpswap":
            space[i] = src[k] if o[0] == cmp[k] else o[0]
        else:
            space[i] = ATOMIC_OPS[op][1](o, data[k:k + 1]).astype(U32)[0]
    return old


def _atomic_op(name: str) -> str | None:
    op = name.split("_atomic_", 1)[1]
    return op if op in ATOMIC_OPS else None


# --- GLOBAL / FLAT ------------------------------------------------------------------------------------
def lds_addresses(inst_offset: int, nbytes: int):
    """Closure w -> the LDS byte address of each lane of a load to LDS: M0 + inst_offset + lane *
    nbytes, a 32-bit sum (module docstring: below 0 it wraps out of range)."""
    lanes = LANE_IDS.astype(np.int64) * nbytes + inst_offset

    def at(w):
        return (int(w.s[D.M0]) + lanes) & 0xFFFFFFFF
    return at


def _global_address(ctx, inst):
    """Closure w -> uint64[64] lane addresses of a GLOBAL/FLAT instruction."""
    f = inst.f
    offset = U64(sext(f["offset"], 13) & 0xFFFFFFFFFFFFFFFF) if inst.enc != "FLAT" else U64(f["offset"])
    vaddr = f["addr"]
    if inst.enc == "GLOBAL" and f["saddr"] != D.GLOBAL_SADDR_OFF:
        base = sreader(ctx, inst, f["saddr"], 64)
        off = int(offset)
        return lambda w: w.v[vaddr].astype(U64) + U64((base(w) + off) & U64_MASK)
    return lambda w: (w.v[vaddr].astype(U64) | (w.v[vaddr + 1].astype(U64) << U64(32))) + offset


def build_global(inst, ctx):
    from .isa_lds import Lds  # (isa_lds takes this module's helpers)

    name = inst.name
    to_lds = inst.enc == "GLOBAL" and "_load_lds_" in name
    address = _global_address(ctx, inst)
    index = ctx.index
    if "_atomic_" in name:
        return _build_global_atomic(inst, ctx, address, index)
    parsed = parse_access(name.replace("_load_lds_", "_load_"))
    if parsed is None:
        return None
    kind, nbytes, signed, d16 = parsed
    if kind == "load":
        row = None if to_lds else data_rows(inst, "vdst")
        lds_at = lds_addresses(sext(inst.f["offset"], 13), nbytes)

        def load(w):
            mask = _active(w)
            addrs = address(w)
            data = w.launch.memory.load(addrs, nbytes, mask)
            if to_lds:
                Lds.write(w, lds_at(w), data, mask)
            else:
                write_load(w, row, data, nbytes, signed, d16, mask)
            w.launch.rec.global_access(index, addrs, mask, nbytes, False)
        return load
    row = data_rows(inst, "data")

    def store(w):
        mask = _active(w)
        addrs = address(w)
        w.launch.memory.store(addrs, gather_store_bytes(w, row, nbytes, d16), mask, _race(w))
        w.launch.rec.global_access(index, addrs, mask, nbytes, True)
    return store


def _atomic_lanes(w, inst, ctx, op, addrs, mask, data_row, ret_row):
    """The dword atomic `op` of the lanes in `mask` at `addrs` (checked, 4-byte aligned), the old
    values into ret_row when it is not None (global and buffer atomics alike)."""
    lanes = np.flatnonzero(mask)
    if not lanes.size:
        return
    mem = w.launch.memory
    a = addrs[lanes]
    mem.check(a, DWORD, None, write=True)
    if np.count_nonzero(a & U64(3)):
        raise ctx.error(inst, "misaligned atomic address")
    idx = ((a - U64(mem.BASE)) >> U64(2)).astype(np.int64)
    data = (w.v[data_row, lanes], w.v[data_row + 1, lanes]) if op == "cmpswap" else w.v[data_row, lanes]
    old = _apply_atomic(mem.space(U32), idx, data, op)
    if ret_row is not None:
        w.v[ret_row, lanes] = old


def _build_global_atomic(inst, ctx, address, index):
    name = inst.name
    op = _atomic_op(name)
    if op is None or name.endswith("_x2"):
        return None
    data_row = data_rows(inst, "data")
    ret_row = data_rows(inst, "vdst") if inst.f["sc0"] else None  # sc0 (glc): return the old value

    def atomic(w):
        mask = w.exec_mask
        addrs = address(w)
        _atomic_lanes(w, inst, ctx, op, addrs, mask, data_row, ret_row)
        w.launch.rec.global_access(index, addrs, mask, DWORD, True)
    return atomic


# --- MUBUF --------------------------------------------------------------------------------------------
def _buffer_parts(ctx, inst):
    """Closures for the descriptor fields and the per-lane checked offset of a MUBUF instruction."""
    f = inst.f
    if f["idxen"]:
        raise ctx.error(inst, "indexed (structured) buffer access is not supported")
    rs = f["srsrc"] * 4
    if rs + 4 > 102:
        raise ctx.error(inst, "buffer resource outside the SGPRs")
    soff = sreader(ctx, inst, f["soffset"])
    inst_offset = U64(f["offset"])
    vaddr = f["vaddr"]
    offen = f["offen"]

    def descriptor(w):
        s = w.s
        stride = (s[rs + 1] >> RSRC_STRIDE_SHIFT) & RSRC_STRIDE_MASK
        if stride or (s[rs + 1] >> RSRC_SWIZZLE_BIT) & 1 or (s[rs + 3] >> RSRC_ADD_TID_BIT) & 1:
            raise ctx.error(inst, f"buffer resource with stride {stride} / swizzle / add-tid is not supported "
                                  f"(descriptor {s[rs]:#x} {s[rs + 1]:#x} {s[rs + 2]:#x} {s[rs + 3]:#x})")
        base = (s[rs] | s[rs + 1] << 32) & BASE_MASK
        return base, s[rs + 2], soff(w)

    def offsets(w):
        """Per lane, vgpr offset (offen) + inst_offset, not wrapped."""
        if offen:
            return w.v[vaddr].astype(U64) + inst_offset
        return np.full(LANES, inst_offset, U64)
    return descriptor, offsets


def _in_range(ctx, inst, off, soffset, ends, num_records, active):
    """Per lane (and per component: `ends`, the bytes each ends after the lane's offset), whether
    the access is in range, where the module docstring's two readings agree; EmuError where they
    do not."""
    guide = off[:, None] + ends <= U64(num_records)
    hardware = (off & U64(0xFFFFFFFF))[:, None] + U64(soffset) + ends <= U64(num_records)
    if active is not None:
        guide &= active[:, None]
        hardware &= active[:, None]
    if not np.array_equal(guide, hardware):
        lanes = np.flatnonzero((guide != hardware).any(axis=1))
        raise ctx.error(inst, f"buffer lanes {lanes[:8].tolist()} are in range by one reading of the range check and "
                              f"out of range by the other (offset {int(off[lanes[0]]):#x}, SGPR offset {int(soffset):#x}, "
                              f"num_records {int(num_records):#x}; flyquant.emu.isa_mem's docstring)")
    return guide


def build_buffer(inst, ctx):
    from .isa_lds import Lds  # (isa_lds takes this module's helpers)

    name = inst.name
    if "_format_" in name or name in ("buffer_wbl2", "buffer_inv"):
        if name in ("buffer_wbl2", "buffer_inv"):
            return lambda w: None
        return None
    descriptor, offsets = _buffer_parts(ctx, inst)
    index = ctx.index
    to_lds = bool(inst.f["lds"])
    if to_lds and not (name.startswith("buffer_load_") and "_d16" not in name):
        raise ctx.error(inst, "only plain buffer loads go to LDS")
    if "_atomic_" in name:
        return _build_buffer_atomic(inst, ctx, descriptor, offsets, index)
    parsed = parse_access(name)
    if parsed is None:
        return None
    kind, nbytes, signed, d16 = parsed
    ncomp = nbytes // DWORD if nbytes >= DWORD else 1
    comp_bytes = DWORD if nbytes >= DWORD else nbytes
    comp_off = np.arange(ncomp, dtype=U64) * U64(comp_bytes)
    comp_end = comp_off + U64(comp_bytes)
    inst_offset = inst.f["offset"]
    row = data_rows(inst, "vdata")

    def addresses(w):
        """(lane addresses, every component of every lane in range?, the range check's inputs):
        all in range when the largest offset leaves room for the whole access below num_records
        by both readings of the check (module docstring)."""
        base, num_records, soffset = descriptor(w)
        off = offsets(w)
        addrs = off + U64(base + soffset)
        top = int(off.max())
        all_in = top + nbytes <= num_records and (top & 0xFFFFFFFF) + soffset + nbytes <= num_records
        return addrs, all_in, (off, soffset, num_records)

    def components(w, addrs, check, active):
        """Out-of-range tail: (component addresses, component in range and lane active), both
        flattened lane-major to 64 * ncomp entries of comp_bytes bytes."""
        off, soffset, num_records = check
        ok = _in_range(ctx, inst, off, soffset, comp_end, num_records, active)
        return (addrs[:, None] + comp_off).reshape(-1), ok.reshape(-1)

    def lanes_moving(ok):
        """Lanes with a component in range (`ok` as `components` returns it): those whose first
        component is, as a later component in range implies the first one is."""
        return int(np.count_nonzero(ok[::ncomp]))

    if kind == "load":
        lds_at = lds_addresses(inst_offset, nbytes)

        def load(w):
            addrs, all_in, check = addresses(w)
            active = None if w.exec_full else w.exec_mask
            mem, rec = w.launch.memory, w.launch.rec
            if all_in:
                data = mem.load(addrs, nbytes, active)
                rec.global_access(index, addrs, active, nbytes, False)
            else:  # out-of-range components read 0 and are never touched (they may be unmapped)
                caddrs, ok = components(w, addrs, check, active)
                data = mem.load(caddrs, comp_bytes, ok).reshape(LANES, nbytes)
                rec.global_access(index, caddrs, ok, comp_bytes, False, lanes_moving(ok))
            if to_lds:
                Lds.write(w, lds_at(w), data, active)
            else:
                write_load(w, row, data, nbytes, signed, d16, active)
        return load

    def store(w):
        addrs, all_in, check = addresses(w)
        active = None if w.exec_full else w.exec_mask
        data = gather_store_bytes(w, row, nbytes, d16)
        mem, rec = w.launch.memory, w.launch.rec
        if all_in:
            mem.store(addrs, data, active, _race(w))
            rec.global_access(index, addrs, active, nbytes, True)
        else:  # out-of-range components are dropped one by one
            caddrs, ok = components(w, addrs, check, active)
            mem.store(caddrs, data.reshape(LANES * ncomp, comp_bytes), ok, _race(w))
            rec.global_access(index, caddrs, ok, comp_bytes, True, lanes_moving(ok))
    return store


def _build_buffer_atomic(inst, ctx, descriptor, offsets, index):
    op = _atomic_op(inst.name)
    if op is None or inst.name.endswith("_x2"):
        return None
    data_row = data_rows(inst, "vdata")
    ret = bool(inst.f["sc0"])  # return the old value into vdata

    def atomic(w):
        base, num_records, soffset = descriptor(w)
        off = offsets(w)
        ok = _in_range(ctx, inst, off, soffset, np.array([DWORD], U64), num_records, w.exec_mask)[:, 0]
        addrs = U64(base) + U64(soffset) + off
        _atomic_lanes(w, inst, ctx, op, addrs, ok, data_row, data_row if ret else None)
        if ret:  # lanes out of range return 0
            bad = w.exec_mask & ~ok
            w.v[data_row, bad] = 0
        w.launch.rec.global_access(index, addrs, ok, DWORD, True)
    return atomic


BUILDERS_BY_ENC = {"GLOBAL": build_global, "FLAT": build_global, "MUBUF": build_buffer}
table.register_encoding(BUILDERS_BY_ENC)
