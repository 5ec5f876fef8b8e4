"""Hardware registers: s_getreg_b32 / s_setreg_b32 / s_setreg_imm32_b32 on MODE.

CDNA3/CDNA4 ISA guides, SOPK: SIMM16 = {size - 1 [15:11], offset [10:6], hwRegId [5:0]};
s_setreg writes the `size` low bits of its value to bits offset .. offset + size - 1 of
hardware register hwRegId:
    mask = ((1 << size) - 1) << offset
    HW_REGISTERS[hwRegId] = ((value << offset) & mask) | (HW_REGISTERS[hwRegId] & ~mask)
s_getreg reads those bits back, shifted down to bit 0.

Only MODE (hwRegId 1) is modelled, and of its fields only FP16_OVFL (bit 23) may change: the
float conversions read it from the wave at run time (Triton's AMD backend sets it at the start of
a gfx950 kernel so that FP8 conversions saturate). The other MODE fields (rounding, denormals,
IEEE, DX10 clamp) are fixed from the kernel descriptor when the program is built, so a write
that changes one of them is an error naming the field, never silently ignored.
"""

from __future__ import annotations

from . import table
from .isa_base import MODE_FP16_OVFL, sreader, swriter

HW_REG_MODE = 1
_MODE_FIELDS = ((0, 4, "FP_ROUND"), (4, 4, "FP_DENORM"), (8, 1, "DX10_CLAMP"), (9, 1, "IEEE"),
                (10, 1, "LOD_CLAMPED"), (11, 1, "DEBUG"), (12, 7, "EXCP_EN"), (23, 1, "FP16_OVFL"))
_WRITABLE = 1 << MODE_FP16_OVFL


def hwreg_fields(simm16: int) -> tuple[int, int, int]:
    """(hwRegId, offset, size) of a s_getreg/s_setreg SIMM16."""
    return simm16 & 0x3F, (simm16 >> 6) & 0x1F, (simm16 >> 11) + 1


def _mode_field_names(bits: int) -> str:
    return ", ".join(name for lo, n, name in _MODE_FIELDS if bits >> lo & ((1 << n) - 1)) or f"bits {bits:#x}"


def _check_mode(ctx, inst, reg: int):
    if reg != HW_REG_MODE:
        raise ctx.error(inst, f"hardware register {reg} is not modelled (only MODE, 1)")


def _build_setreg(inst, ctx):
    reg, offset, size = hwreg_fields(inst.f["simm16"])
    _check_mode(ctx, inst, reg)
    mask = ((1 << size) - 1) << offset & 0xFFFFFFFF
    if inst.name == "s_setreg_imm32_b32":
        value = inst.literal
        get = lambda w: value  # noqa: E731
    else:
        get = sreader(ctx, inst, inst.f["sdst"])  # SOPK s_setreg_b32: the SDST field names the source
    err = ctx.error  # bound now: raised with the instruction's text

    def run(w):
        new = ((get(w) << offset) & mask) | (w.mode & ~mask)
        changed = (new ^ w.mode) & ~_WRITABLE
        if changed:
            raise err(inst, f"s_setreg changing MODE.{_mode_field_names(changed)} is not modelled "
                            "(only FP16_OVFL may change at run time)")
        w.mode = new
    return run


def _build_getreg(inst, ctx):
    reg, offset, size = hwreg_fields(inst.f["simm16"])
    _check_mode(ctx, inst, reg)
    put = swriter(ctx, inst, inst.f["sdst"])
    field = (1 << size) - 1
    return lambda w: put(w, (w.mode >> offset) & field)


table.register({"s_setreg_b32": _build_setreg, "s_setreg_imm32_b32": _build_setreg, "s_getreg_b32": _build_getreg})
