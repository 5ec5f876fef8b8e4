"""Cross-lane operations: DPP source permutations, readlane/readfirstlane/writelane, permlane swaps.

DPP (GFX9 "data parallel primitives", the second dword of a VOP1/VOP2/VOPC with src0 = 250)
replaces src0 of every lane by src0 of another lane before the ALU op. All controls are known
when the instruction is decoded, so each becomes a static map `src_lane[64]` plus `valid[64]`
(the source lane exists) and a static write mask (row_mask/bank_mask). At run time a source lane
that is out of range or has EXEC off is "invalid": with bound_ctrl set the lane reads 0,
otherwise the lane does not write its result.
"""

from __future__ import annotations

import numpy as np

from . import decode as D
from . import table
from .isa_base import LANE_IDS, LANES, U32, sreader, swriter, vsrc, vwriter

ROW = 16  # lanes per DPP row
BANK = 4  # lanes per DPP bank

# dpp_ctrl ranges (GFX9 DPP_CTRL enumeration)
QUAD_PERM_MAX = 0x0FF
ROW_SHL, ROW_SHR, ROW_ROR = 0x100, 0x110, 0x120
WAVE_SHL1, WAVE_ROL1, WAVE_SHR1, WAVE_ROR1 = 0x130, 0x134, 0x138, 0x13C
ROW_MIRROR, ROW_HALF_MIRROR, ROW_BCAST15, ROW_BCAST31 = 0x140, 0x141, 0x142, 0x143


def dpp_lane_map(ctrl: int) -> tuple[np.ndarray, np.ndarray] | None:
    """(source lane per lane, source exists) for a DPP control, or None if the control is reserved."""
    lane = LANE_IDS
    row_base, in_row = lane & ~(ROW - 1), lane & (ROW - 1)
    if ctrl <= QUAD_PERM_MAX:
        sel = np.array([(ctrl >> (2 * i)) & 3 for i in range(4)])
        return (lane & ~3) + sel[lane & 3], np.ones(LANES, bool)
    n = ctrl & 0xF
    if ROW_SHL < ctrl < ROW_SHL + ROW:  # lane reads the lane n above it in its row
        src = in_row + n
        return row_base + (src & (ROW - 1)), src < ROW
    if ROW_SHR < ctrl < ROW_SHR + ROW:  # lane reads the lane n below it in its row
        src = in_row - n
        return row_base + (src & (ROW - 1)), src >= 0
    if ROW_ROR < ctrl < ROW_ROR + ROW:
        return row_base + ((in_row - n) & (ROW - 1)), np.ones(LANES, bool)
    if ctrl == WAVE_SHL1:
        return (lane + 1) % LANES, lane + 1 < LANES
    if ctrl == WAVE_ROL1:
        return (lane + 1) % LANES, np.ones(LANES, bool)
    if ctrl == WAVE_SHR1:
        return (lane - 1) % LANES, lane >= 1
    if ctrl == WAVE_ROR1:
        return (lane - 1) % LANES, np.ones(LANES, bool)
    if ctrl == ROW_MIRROR:
        return row_base + (ROW - 1 - in_row), np.ones(LANES, bool)
    if ctrl == ROW_HALF_MIRROR:
        return (lane & ~7) + (7 - (lane & 7)), np.ones(LANES, bool)
    if ctrl == ROW_BCAST15:  # rows 1..3 read lane 15 of the previous row
        return np.maximum(row_base - 1, 0), row_base >= ROW
    if ctrl == ROW_BCAST31:  # rows 2, 3 read lane 31
        return np.full(LANES, 31), lane >= 2 * ROW
    return None


def dpp_write_mask(row_mask: int, bank_mask: int) -> np.ndarray:
    """Lanes whose row (lane // 16) and bank ((lane % 16) // 4) are enabled."""
    rows = (row_mask >> (LANE_IDS // ROW)) & 1
    banks = (bank_mask >> ((LANE_IDS % ROW) // BANK)) & 1
    return (rows & banks).astype(bool)


class DppSource:
    """src0 under a DPP control: call `read(w, values)` with the unpermuted src0 row; it returns
    the permuted values and the per-lane write enable (None when every lane writes)."""

    def __init__(self, ctx, inst):
        d = inst.dpp
        lane_map = dpp_lane_map(d["dpp_ctrl"])
        if lane_map is None:
            raise ctx.error(inst, f"reserved DPP control {d['dpp_ctrl']:#x}")
        self.src, self.valid = lane_map
        self.static_write = dpp_write_mask(d["row_mask"], d["bank_mask"])
        self.bound_zero = bool(d["bound_ctrl"])
        self.all_static = bool(self.valid.all() and self.static_write.all())

    def read(self, w, values):
        out = values[self.src]
        valid = self.valid & w.exec_mask[self.src]
        if self.bound_zero:
            out = np.where(valid, out, np.zeros((), out.dtype))
            write = self.static_write
        else:
            write = self.static_write & valid
        return out, (None if (self.all_static and w.exec_full) else write)


# --- readlane / readfirstlane / writelane -----------------------------------------------------------
def build_readfirstlane(inst, ctx):
    row = inst.src[0] - D.VGPR_BASE
    if row < 0:
        raise ctx.error(inst, "v_readfirstlane_b32 needs a VGPR source")
    put = swriter(ctx, inst, inst.sdst)

    def run(w):
        e = w.exec_value()
        lane = (e & -e).bit_length() - 1 if e else 0  # lowest active lane, lane 0 if none
        put(w, int(w.v[row, lane]))
    return run


def build_readlane(inst, ctx):
    row = inst.src[0] - D.VGPR_BASE
    if row < 0:
        raise ctx.error(inst, "v_readlane_b32 needs a VGPR source")
    sel = sreader(ctx, inst, inst.src[1])
    put = swriter(ctx, inst, inst.sdst)
    return lambda w: put(w, int(w.v[row, sel(w) & (LANES - 1)]))


def build_writelane(inst, ctx):
    value = sreader(ctx, inst, inst.src[0])
    sel = sreader(ctx, inst, inst.src[1])
    row = inst.vdst

    def run(w):  # writes one lane regardless of EXEC
        w.v[row, sel(w) & (LANES - 1)] = value(w)
    return run


def build_permlane_swap(inst, ctx):
    """v_permlane16_swap_b32 / v_permlane32_swap_b32 (gfx950): swap lane groups between vdst and src0.

    permlane32: lanes 32..63 of vdst <-> lanes 0..31 of src0. permlane16: within each 32-lane
    half, lanes 16..31 of vdst <-> lanes 0..15 of src0 (the ISA guide's pseudocode)."""
    a = inst.vdst
    b = inst.src[0] - D.VGPR_BASE
    if b < 0:
        raise ctx.error(inst, "permlane swap needs a VGPR source")
    if inst.name == "v_permlane32_swap_b32":
        lo_b, hi_a = np.arange(0, 32), np.arange(32, 64)
    else:
        lo_b = np.concatenate([np.arange(0, 16), np.arange(32, 48)])
        hi_a = lo_b + 16
    if inst.clamp or inst.opsel or inst.neg or inst.abs:
        raise ctx.error(inst, "modifiers on permlane swap are not supported")

    def run(w):  # the pseudocode swaps every lane pair, independent of EXEC
        tmp = w.v[b, lo_b].copy()
        w.v[b, lo_b] = w.v[a, hi_a]
        w.v[a, hi_a] = tmp
    return run


def build_mbcnt(inst, ctx):
    """v_mbcnt_lo/hi_u32_b32: S1 + number of set bits of S0 in the lanes below this one
    (lo: mask bits 0..31, hi: mask bits 32..63)."""
    mask_src = sreader(ctx, inst, inst.src[0]) if inst.src[0] < D.VGPR_BASE else None
    if mask_src is None:
        raise ctx.error(inst, "v_mbcnt with a VGPR mask is not supported")
    add = vsrc(ctx, inst, 1, "u32")
    put = vwriter(ctx, inst, "u32")
    # lane l counts mask bits 0..k-1 of its 32-bit half: k = l (lo) or l - 32 (hi), within 0..32
    k = np.clip(LANE_IDS - (32 if inst.name == "v_mbcnt_hi_u32_b32" else 0), 0, 32)

    def run(w):
        m = mask_src(w) & 0xFFFFFFFF
        bits = np.unpackbits(np.frombuffer(m.to_bytes(4, "little"), np.uint8), bitorder="little")
        prefix = np.concatenate([[0], np.cumsum(bits)]).astype(U32)  # set bits among bits 0..k-1
        put(w, prefix[k] + add(w))
    return run


BUILDERS = {
    "v_readfirstlane_b32": build_readfirstlane,
    "v_readlane_b32": build_readlane,
    "v_writelane_b32": build_writelane,
    "v_permlane16_swap_b32": build_permlane_swap,
    "v_permlane32_swap_b32": build_permlane_swap,
    "v_mbcnt_lo_u32_b32": build_mbcnt,
    "v_mbcnt_hi_u32_b32": build_mbcnt,
}
table.register(BUILDERS)
