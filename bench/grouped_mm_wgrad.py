"""bench/grouped_mm.py --op wgrad: the MXFP8 grouped GEMM's weight gradient, modelled (the whole
launch of a small shape emulated, or one tile of torchao's grid on the tiles the selector picks for
the whole shape), beside the compile-only resources of a model-sized kernel. Not a script: the
--op wgrad branch of grouped_mm.py's command line."""

from __future__ import annotations

import argparse
import math
import re
from dataclasses import dataclass

import torch

import common

import flyquant.emu as emu
from flyquant import reference, select_grouped_mm, toolchain
from flyquant.kernels import mxfp8_grouped_mm as G

OUT_DTYPE = torch.bfloat16


@dataclass(frozen=True)
class WgradShape:
    """out[g] (N, K) = y[g rows]^T x[g rows] per token group; group sizes multiples of 32."""

    name: str
    n: int
    k: int
    sizes: tuple[int, ...]
    plan: tuple[int, int] | None = None  # the (N, K) whose tiles the selector picks (default: n, k)

    @property
    def m(self) -> int:
        return sum(self.sizes)


# Small enough to emulate every workgroup (grid N/tile_m x K/tile_n x E). Group sizes in 128-row
# steps: 16 (even); 2 + 3 chunks (a 96-row tail), 10 (even), 15 + 1 chunk (odd, a 32-row tail), 4.
# The grid-* rows are one tile of torchao's grid (M 16640, N = K = 2048) on the tiles the selector
# picks for the whole shape: every tile of it executes the same, so its per-MFMA figure is the grid's.
SHAPES = {s.name: s for s in (
    WgradShape("wgrad-M2048-E1-N128-K128", 128, 128, (2048,)),
    WgradShape("wgrad-M4096-E4-N256-K512", 256, 512, (352, 1280, 1952, 512)),
    WgradShape("grid-E1-N2048-K2048-one-tile", 128, 128, (16640,), (2048, 2048)),
    WgradShape("grid-E8-N2048-K2048-one-tile", 128, 256, (2080,) * 8, (2048, 2048)),
)}
MODEL = (2048, 5120, 8)  # (N, K, E) of the compile-only model-sized kernel: registers, spills


def shape_arg(text: str) -> list[WgradShape]:
    """Names from SHAPES or NxK:size+size+... (group sizes)."""
    out = []
    for item in common.csv_list(text):
        if item in SHAPES:
            out.append(SHAPES[item])
        elif re.fullmatch(r"[1-9]\d*x[1-9]\d*:\d+(\+\d+)*", item):
            nk, sizes = item.split(":")
            n, k = map(int, nk.split("x"))
            out.append(WgradShape(item, n, k, tuple(map(int, sizes.split("+")))))
        else:
            raise argparse.ArgumentTypeError(f"unknown wgrad shape {item!r}: a name ({', '.join(SHAPES)}) "
                                             "or NxK:size+size+...")
    return out


def plan_tiles(args, arch: str, n: int, k: int, experts: int) -> tuple[int, int]:
    """--tile-m / --tile-n where given, else what the selector plans for fq.mxfp8_grouped_mm_wgrad."""
    tm, tn = select_grouped_mm.grouped_mm_wgrad_tiles(arch, n, k, experts)[0]
    return args.tile_m or tm, args.tile_n or tn


def compile_report(arch: str, n: int, k: int, experts: int, m: int, tiles: tuple[int, int]):
    cfg = G.GroupedMMConfig(arch=arch, out_dtype=OUT_DTYPE, n=n, k=k, experts=experts, tile_m=tiles[0],
                            tile_n=tiles[1], wgrad=True)
    (report,) = toolchain.compile_only(arch, G.build_grouped_mm(cfg), *([0] * 6), m, 0, -(-n // cfg.tile_m), stream=0)
    return report


def model(shape: WgradShape, arch: str, args) -> dict:
    """The whole launch emulated (randn operands quantized 32x1, rceil), and the compile-only
    resources of the emulated kernel and of the model-sized one (MODEL), each on its tiles."""
    seed = args.seed
    tiles = plan_tiles(args, arch, *(shape.plan or (shape.n, shape.k)), len(shape.sizes))
    model_tiles = plan_tiles(args, arch, *MODEL)
    gen = torch.Generator().manual_seed(seed)
    x, x_scale = reference.mxfp8_quantize(torch.randn(shape.m, shape.k, generator=gen) * 4, 0, "rceil")
    y, y_scale = reference.mxfp8_quantize(torch.randn(shape.m, shape.n, generator=gen), 0, "rceil")
    offs = torch.tensor(shape.sizes).cumsum(0).to(torch.int32)
    x, x_scale, y, y_scale, offs = (emu.aligned(t) for t in (x.t(), x_scale, y.t(), y_scale, offs))  # (K, M), (N, M)
    out = emu.aligned_empty((len(shape.sizes), shape.n, shape.k), OUT_DTYPE)

    def run():
        with toolchain.target(arch):
            G.grouped_mm_wgrad(x.t(), x_scale, y.t(), y_scale, offs, arch=arch, out=out, tile_m=tiles[0],
                               tile_n=tiles[1])

    tensors = {"x": x, "x_scale": x_scale, "y": y, "y_scale": y_scale, "offs": offs, "out": out}
    _, counts, _ = common.emulate(run, tensors)
    res = common.Resources.of(compile_report(arch, shape.n, shape.k, len(shape.sizes), shape.m, tiles))
    big = common.Resources.of(compile_report(arch, *MODEL, shape.m, model_tiles))
    grid = math.ceil(shape.n / tiles[0]) * math.ceil(shape.k / tiles[1]) * len(shape.sizes)
    return {"shape": shape.name, "m": shape.m, "n": shape.n, "k": shape.k, "sizes": list(shape.sizes), "arch": arch,
            "tile": f"{tiles[0]}x{tiles[1]}", "model_tile": f"{model_tiles[0]}x{model_tiles[1]}",
            "layout": "plain",  # row-major scales: the only ones the weight gradient reads
            "instr_per_mfma": counts.wave_instructions / counts.cls("mfma"),
            "coalescing_loads": common.coalescing(counts.mem("vmem_load")),
            "grid_workgroups": grid, "wg_working": counts.workgroups_working,
            "model_vgprs": big.vgprs, "model_agprs": big.agprs, "model_spills": big.spills,
            "model_kernel": big.kernel, "counts": counts.to_json()} | common.resource_figures(res)


COLUMNS = [("shape", "shape"), ("arch", "arch"), ("tile", "tile"), ("vgprs", "VGPR"), ("agprs", "AGPR"), ("spills", "spill"),
                 ("workgroups_per_cu", "WG/CU"), ("grid_workgroups", "WGs"), ("wg_working", "working"), ("instr_per_mfma", "instr/MFMA"),
                 ("coalescing_loads", "coal ld"), ("model_tile", "model tile"), ("model_vgprs", "model VGPR"), ("model_agprs", "model AGPR"),
                 ("model_spills", "model spill")]


def main(args, plot) -> dict:
    """--op wgrad: modelled rows only (every workgroup of a small launch emulated); `plot` is
    grouped_mm's (rows, mode, path) -> path."""
    args.mode = "modelled"
    forced = f"{args.tile_m or 'selector'}x{args.tile_n or 'selector'}"
    mode, archs, label, sources = common.begin(args, f"MXFP8 grouped GEMM, weight gradient, tiles {forced}")
    rows = []
    for arch in archs:
        emu.enable(arch)
        for shape in args.wgrad_shapes:
            rows.append(model(shape, arch, args))
            print(f"  {shape.name} {arch}: {rows[-1]['instr_per_mfma']:.3f} wave-instructions per MFMA", flush=True)
    print()
    common.print_table(rows, COLUMNS)
    print(f"\ninstr/MFMA: wave-instructions per MFMA executed by the whole (emulated) launch; VGPR, AGPR, spill: the "
          f"emulated kernel; model *: the compile-only kernel for (N, K, E) = {MODEL}.")
    payload = {"mode": mode, "label": label, "op": "wgrad", "args": vars(args) | {
        "wgrad_shapes": [s.name for s in args.wgrad_shapes], "shapes": None},
        "environment": common.environment() | {"kernel_sources_changed": common.warn_if_sources_changed(sources)},
        "rows": rows}
    json_path = common.write_json(args.out / "grouped_mm_wgrad_modelled.json", payload)
    print(f"\nwrote {json_path} and {plot(rows, mode, args.out / 'grouped_mm_wgrad_modelled.png')}")
    return payload
