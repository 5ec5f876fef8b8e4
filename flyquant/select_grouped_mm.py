"""The selector's plans for the MXFP8 grouped GEMMs (forward / dgrad and weight gradient):
whether the kernel takes the shape, its tiles and why (flyquant.select holds the targets, the
Plan and the other ops' plans)."""

from __future__ import annotations

import torch

from .arch import arch_info
from .select import Plan, _forced_reference, _kernel_plan, _kernel_target, reference_plan

# The FlyDSL grouped-GEMM launchers, op -> "module:function" under flyquant.kernels, with the
# signature launch(<the op's 5 tensors>, *, out, arch, [scale_layout,] **config), writing every
# element of out.
GROUPED_MM_KERNELS: dict[str, str] = {"mxfp8_grouped_mm": "mxfp8_grouped_mm:grouped_mm",
                                      "mxfp8_grouped_mm_wgrad": "mxfp8_grouped_mm:grouped_mm_wgrad"}
GROUPED_MM_MAX_BUFFER = (1 << 31) - 64  # one buffer resource per tensor (expert), 32-bit offsets
WIDE_TILE_N = (320, 256, 192)  # gfx950's 128-row wide tiles, in order of preference (both GEMMs)
TALL_TILE_M = 192  # gfx950's 192x256 forward tile (grouped_mm_tiles)
GFX942_GROUPED_MM_MAX_K = 43648  # gfx942's forward reads 4 columns' scales at immediate offsets below 4096


def _grouped_mm_unsupported(op: str, arch: str, m: int, n: int, k: int, out_dtype: torch.dtype) -> str | None:
    """Why the kernel cannot take this shape (None: it can). Forward: a (m, k), b (E, n, k), out
    (m, n); wgrad: x (m, k), y (m, n), out (E, n, k), its output columns k."""
    cols = k if op == "mxfp8_grouped_mm_wgrad" else n
    if cols % 16:
        return f"the output's {cols} columns are not a multiple of 16 (the kernel's 16-column MFMA blocks)"
    out_bytes = (n * k if op == "mxfp8_grouped_mm_wgrad" else m * n) * torch.finfo(out_dtype).bits // 8
    if max(m * k, n * k, m * n, out_bytes) > GROUPED_MM_MAX_BUFFER:
        return "a tensor (or one expert's part) spans 2 GiB or more (32-bit buffer offsets)"
    if op == "mxfp8_grouped_mm" and arch == "gfx942" and k > GFX942_GROUPED_MM_MAX_K:
        return f"K = {k} > {GFX942_GROUPED_MM_MAX_K} on gfx942 (scale offsets)"
    return None


def grouped_mm_tiles(arch: str, m: int, n: int, experts: int, scale_layout=None) -> tuple[tuple[int, int], tuple]:
    """The forward / dgrad GEMM's (tile_m, tile_n) and why. tile_m 64 when the average group is
    smaller than the 128-row tile (less masked work at group boundaries), else 128 (fewer loads per
    MFMA). On gfx950 the wide tiles (2 x 2 waves; each fragment loaded feeds more MFMAs), each
    only where its tile_n divides N (no masked columns) and the grid still gives every CU a
    workgroup: 192x256 (waves of 96 x 128, 48 MFMAs per 28 loads and step) when the groups average
    192 rows or more; else, with tile_m 128, the first of 320, 256 and 192 (64 x 160, 64 x 128,
    64 x 96: 40, 32, 24 MFMAs per step). bench/grouped_mm.py --full: 192x256 is 0.17-0.41 wave-
    instructions per MFMA below the 128-row tiles on every shape of torchao's grid and
    DeepSeek-V3's with each wave's own loads ("mfma" scales 1.96-2.34, row-major 2.16-2.54; staged
    in LDS, grouped_mm_lds_stage, "mfma" 2.45-2.87); GPT-OSS's N 2880 and 5760 on
    128x320 0.30-0.46 below 128x192. The wide tiles hold 300-490 VGPRs, one workgroup (4 waves)
    per CU instead of two. Not 128x320 for a single expert with row-major scales: LLVM then holds
    492 VGPRs and moves accumulators through AGPRs (N 5120 at K 2048-8192: 3.40-3.73 per MFMA
    against 128x256's 2.51-2.93). Else 128."""
    groups = max(experts, 1)
    if _wide_tile_n(arch, n, -(-m // TALL_TILE_M), (256,)) == 256 and m >= TALL_TILE_M * groups:
        return (TALL_TILE_M, 256), (f"tile 192x256: gfx950, groups of {m // groups} rows on average, 256 divides "
                                    f"N = {n}, every CU a workgroup",)
    tile_m = 128 if m >= 128 * groups else 64
    why = [f"tile_m {tile_m}: {m} rows over {experts} groups"]
    m_tiles = -(-m // tile_m)
    tile_n = _wide_tile_n(arch, n, m_tiles, WIDE_TILE_N) if tile_m == 128 else 128
    if tile_n == 320 and experts == 1 and scale_layout is None:
        tile_n = _wide_tile_n(arch, n, m_tiles, tuple(t for t in WIDE_TILE_N if t != 320))
        why.append("not 320: one expert with row-major scales (LLVM shuffles its accumulators through AGPRs)")
    if tile_n != 128:
        why.append(f"tile_n {tile_n}: gfx950, {tile_n} divides N = {n}, every CU a workgroup")
    return (tile_m, tile_n), tuple(why)


def grouped_mm_lds_stage(arch: str, tiles: tuple[int, int], scale_layout) -> tuple[bool, tuple]:
    """Whether the forward stages its operands in LDS (kernels/mxfp8_grouped_mm.py), and why: on
    gfx950's 192x256 tile with "mfma" scales. Its global loads then use whole 128-byte lines and
    read each row once per workgroup (bench/grouped_mm.py --full, torchao's grid: coalescing 1.0
    instead of 0.5, the tile's bytes 1.03x its compulsory ones instead of 1.91x) for about 0.5 more
    wave-instructions per MFMA (2.45-2.87 instead of 1.96-2.34: the fragments' LDS reads cost more
    than the loads they save). Not with row-major scales (their byte loads already cost 0.2 per
    MFMA: 3.1 at K 2048, and they cannot be whole lines) nor on the smaller tiles (fewer MFMAs per
    fragment read: 128x320 3.1, 64x128 6.2)."""
    if arch == "gfx950" and tiles == (TALL_TILE_M, 256) and scale_layout == "mfma":
        return True, ("operands staged in LDS: whole-line loads, each row read once per workgroup",)
    return False, ()


def grouped_mm_wgrad_tiles(arch: str, n: int, k: int, experts: int) -> tuple[tuple[int, int], tuple]:
    """The weight gradient's (tile_m, tile_n) over its (N, K) output per group, and why: 128 x 128,
    or on gfx950 128 x 320 / 256 / 192 (the first dividing K) when that still gives every CU a
    workgroup: as the forward's wide tiles, each fragment loaded feeds more MFMAs (bench/grouped_mm.py
    --op wgrad, torchao's groups of 2080 rows: 2.84 instead of 3.55 wave-instructions per MFMA on
    128x256; K 1280 in such groups 2.69 on 128x320, 2.85 on 128x256, 3.10 on 128x192), with
    376-448 VGPRs, so one workgroup per CU instead of two."""
    tile_n = _wide_tile_n(arch, k, -(-n // 128) * experts, WIDE_TILE_N)
    why = [f"tile_n {tile_n}: gfx950, {tile_n} divides K = {k}, every CU a workgroup" if tile_n != 128 else "tile 128x128"]
    return (128, tile_n), tuple(why)


def _wide_tile_n(arch: str, cols: int, tiles_per_column_tile: int, widths) -> int:
    """The grouped GEMMs' tile_n over `cols` output columns: on gfx950 the first of `widths` that
    divides them and still gives every CU a workgroup (the grid has tiles_per_column_tile
    workgroups per column tile), else 128."""
    if arch != "gfx950":
        return 128
    cus = arch_info(arch).compute_units
    return next((t for t in widths if cols % t == 0 and tiles_per_column_tile * (cols // t) >= cus), 128)


def plan_grouped_mm_sizes(op: str, device: torch.device, out_dtype: torch.dtype, m: int, n: int, k: int,
                          experts: int, signed_zeros: bool = True, scale_layout=None) -> Plan:
    """The plan of a grouped GEMM from its sizes (forward: a (m, k), b (E, n, k); wgrad: x (m, k),
    y (m, n)); under FLYQUANT_BACKEND=flydsl a BackendError for sizes the kernel does not take. The
    training op plans its GEMMs with it before its quantize launches."""
    target = _kernel_target(op, device)
    if isinstance(target, Plan):
        return target
    why = _grouped_mm_unsupported(op, target.arch, m, n, k, out_dtype)
    if why:
        _forced_reference(why)
        return reference_plan(op, target, why)
    config = {"launcher": GROUPED_MM_KERNELS[op]}
    reasons = ()
    if op == "mxfp8_grouped_mm":
        (config["tile_m"], config["tile_n"]), reasons = grouped_mm_tiles(target.arch, m, n, experts, scale_layout)
        config["lds_stage"], why_lds = grouped_mm_lds_stage(target.arch, (config["tile_m"], config["tile_n"]), scale_layout)
        reasons += why_lds
    else:
        (config["tile_m"], config["tile_n"]), reasons = grouped_mm_wgrad_tiles(target.arch, n, k, experts)
    fnuz = arch_info(target.arch).fnuz_fp8
    if fnuz:
        reasons += ("operands read as loaded (signed_zeros=False: no -0, NaN codes only in NaN-scale blocks)"
                    if not signed_zeros else "OCP -0 and NaN codes rewritten as FNUZ in registers",)
    from .kernels.mxfp8_grouped_mm import GroupedMMConfig

    # the launched kernel's own name
    name = GroupedMMConfig(target.arch, out_dtype, n, k, experts, config["tile_m"], config["tile_n"],
                           scale_layout=scale_layout, wgrad=op == "mxfp8_grouped_mm_wgrad", signed_zeros=signed_zeros,
                           lds_stage=config.get("lds_stage", False)).name
    empty = experts * n * k == 0 if op == "mxfp8_grouped_mm_wgrad" else m * n == 0  # as the launchers return early
    return _kernel_plan(op, target, name, config, *reasons, *(("an empty output: nothing is launched",) if empty else ()))


def plan_mxfp8_grouped_mm(a, b, offs, out_dtype, signed_zeros=True, scale_layout=None) -> Plan:
    """The MXFP8 grouped GEMM (forward / dgrad), inputs already checked."""
    e, n, k = b.shape
    return plan_grouped_mm_sizes("mxfp8_grouped_mm", a.device, out_dtype, a.shape[0], n, k, e, signed_zeros,
                                 scale_layout)


def plan_mxfp8_grouped_mm_wgrad(x, y, offs, out_dtype, signed_zeros=True) -> Plan:
    """The MXFP8 grouped weight-gradient GEMM, inputs already checked."""
    return plan_grouped_mm_sizes("mxfp8_grouped_mm_wgrad", x.device, out_dtype, x.shape[0], y.shape[1], x.shape[1],
                                 offs.shape[0], signed_zeros)


def grouped_mm_launcher(plan: Plan):
    """The launcher function a kernel plan of a grouped GEMM names."""
    import importlib

    module, function = plan.config["launcher"].split(":")
    return getattr(importlib.import_module(f"flyquant.kernels.{module}"), function)
