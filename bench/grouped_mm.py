"""MXFP8 grouped GEMM (MoE forward / dgrad, kernels/mxfp8_grouped_mm.py): TFLOP/s on hardware,
observable work without it.

    python bench/grouped_mm.py                          # 6 shapes (SUBSET); hardware if a ROCm GPU is present
    python bench/grouped_mm.py --quick                  # 2 shapes (QUICK)
    python bench/grouped_mm.py --mode modelled --full   # torchao's 36-shape grid + DeepSeek-V3 + GPT-OSS
    python bench/grouped_mm.py --mode hardware --full   # on an MI300X / MI355X: TFLOP/s vs bf16 torch._grouped_mm

Shapes (SHAPES): torchao's grid, M = 16640 rows split into E equal token groups (E in 1, 2, 4, 8;
N, K in 2048, 5120, 8192), and expert GEMMs of DeepSeek-V3/R1 (hidden 7168, expert inter 2048)
and GPT-OSS-120b (hidden = inter = 2880) with the grid's M = 16640 and E = 8 local experts: per
model the forward of gate/up (N = 2 inter, K = hidden) and down (N = hidden, K = inter) and
their dgrads (N and K swapped). Operands: randn quantized 1x32 (flyquant.reference, rceil);
scales row-major ("plain") or aiter's e8m0_shuffle ("mfma"), both of which the kernel reads;
"mfma+0" is "mfma" with operands quantized with signed_zeros=False (+0 zeros) and the kernel told
so, as flyquant.training feeds it on gfx942 (not in the default --layouts).

Modelled mode (no AMD GPU): labelled "modelled, not timed". Per shape, arch and scale layout:
- compile-only figures of the model-sized kernel (the tile the selector plans for the shape
  and arch, select_grouped_mm.grouped_mm_tiles, unless --tile-m / --tile-n; 2x2 waves):
  VGPR/AGPR, LDS, spills, workgroups per CU;
- what one workgroup executes, emulated. The grid is (M / tile_m) x (N / tile_n) workgroups and
  every one runs the same code over the same K; they differ only in the rows they mask: a tile
  with a group boundary inside makes one pass over K per group, the last n-tile may be partial.
  So the grid's m-tiles are classed by (rows, boundary positions inside) and its n-tiles by
  width (tile_n or N % tile_n), one launch of ONE workgroup is emulated per class pair (M = the
  tile's rows, offs placing the boundaries where the class has them, N = the tile's width, the
  full K, the shape's E), and the grid's counters are those launches' counters times the number
  of workgroups of their class. The emulated kernel is the specialization for N = the tile's
  width; the row gives how its ISA differs from the model-sized one's (mnemonic counts: it
  differs only in constants when 0). tests/test_bench.py checks, on a grid small enough to
  emulate whole, that this reconstruction gives the whole launch's counters exactly.
- printed: wave-instructions per MFMA over the grid (and of the interior tile), coalescing of the
  operands' global loads (a, b and their scales: useful bytes / bytes of the 128-byte lines
  touched; every load's, offs included, and per tensor in the JSON), the interior tile's global
  bytes over its compulsory bytes (its A rows and scales, its B columns and scales, its output,
  offs), workgroups launched and working; and the issue's modelled targets (at most 3
  wave-instructions per MFMA over the grid, operand load coalescing 1.0, no spills, every
  workgroup working) marked met or missed. The tile column says "lds" where gfx950's operands
  are staged in LDS (the selector's choice for the tile and scales, or --staging).

Hardware mode (ROCm GPU; one command, not run where this was written: there was no GPU): per
shape, median of --iters single-call event timings after --warmup calls, caches flushed between
calls unless --no-flush, TFLOP/s = 2 M N K / time, of: the kernel's launcher (each scale
layout; where gfx950's operands are staged in LDS, also with each wave's own loads), fq.mxfp8_grouped_mm (the public op: kernel or reference, as the selector plans; the row
says which), bf16 torch._grouped_mm on the same (dequantized) operands, and hipBLASLt's dense
MXFP8 GEMM per group through torch._scaled_mm with 1x32 E8M0 scales where this torch exposes it
on ROCm (the row gives the error otherwise, e.g. on gfx942, which has no MX instructions). The
kernel's output is compared with bf16's (max error over max |bf16 out|: the dequantized values
are exact in bf16, so only the sums' order and the output rounding differ). The geomean over the
shapes of each implementation's TFLOP/s and of its speed-up over bf16 is printed.
"""

from __future__ import annotations

import argparse
import collections
import math
import re
import sys
from dataclasses import dataclass
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
import common  # noqa: E402  (bench/ is not a package: the scripts run as files)

import flyquant.emu as emu  # noqa: E402
from flyquant import layouts, reference, select_grouped_mm, toolchain  # noqa: E402
from flyquant.kernels import mxfp8_grouped_mm as G  # noqa: E402

import grouped_mm_wgrad as wgrad  # noqa: E402

MX_BLOCK = 32
GRID_M = 16640  # torchao's benchmark rows
GRID_NK = (2048, 5120, 8192)
GRID_E = (1, 2, 4, 8)
LOCAL_EXPERTS = 8
LAYOUTS = {"plain": None, "mfma": "mfma", "mfma+0": "mfma"}  # the scale layout of each --layouts name
# "mfma+0": operands quantized with signed_zeros=False and the GEMM told so, as flyquant.training
# runs it on gfx942 (the FNUZ path reads them without rewriting -0 and probing for NaN codes)
SIGNED_ZEROS = {"mfma+0": False}
PER_MFMA_TARGET = 3.0  # issue 22: wave-instructions per MFMA executed, over the grid
COALESCING_TARGET = 1.0
# the target's loads: the operand streams. offs (E int32, a line per wave read once per workgroup)
# is reported beside them (coalescing_by_tensor, coalescing_loads counts it) but holds 4 E of a
# line's 128 bytes whatever the kernel does
OPERANDS = ("a", "a_scale", "b", "b_scale")
OUT_DTYPE = wgrad.OUT_DTYPE  # both ops write bf16


@dataclass(frozen=True)
class Shape:
    name: str
    m: int
    n: int
    k: int
    experts: int

    @property
    def flops(self) -> int:
        return 2 * self.m * self.n * self.k

    def ends(self) -> list[int]:
        """offs: E token groups of near-equal sizes (they differ by at most one row; M < E leaves
        some empty, spread among the others rather than all before the last)."""
        return [self.m * (g + 1) // self.experts for g in range(self.experts)]


def _model_shapes(model: str, hidden: int, inter: int) -> list[Shape]:
    fwd = {"gate_up": (2 * inter, hidden), "down": (hidden, inter)}
    out = []
    for gemm, (n, k) in fwd.items():
        out.append(Shape(f"{model}-{gemm}-fwd", GRID_M, n, k, LOCAL_EXPERTS))
        out.append(Shape(f"{model}-{gemm}-dgrad", GRID_M, k, n, LOCAL_EXPERTS))
    return out


GRID = [Shape(f"grid-E{e}-N{n}-K{k}", GRID_M, n, k, e) for e in GRID_E for n in GRID_NK for k in GRID_NK]
DEEPSEEK = _model_shapes("dsv3", 7168, 2048)  # DeepSeek-V3/R1: 256 routed experts, 8 per GPU at EP 32
GPTOSS = [s for s in _model_shapes("gptoss", 2880, 2880) if s.name != "gptoss-down-dgrad"]  # = down-fwd
SHAPES = {s.name: s for s in GRID + DEEPSEEK + GPTOSS}
SUBSET = ("grid-E1-N2048-K2048", "grid-E1-N8192-K8192", "grid-E8-N5120-K5120", "grid-E4-N2048-K8192",
          "dsv3-gate_up-fwd", "gptoss-down-fwd")
QUICK = ("grid-E8-N2048-K2048", "gptoss-down-fwd")


def shape_arg(text: str) -> list[Shape]:
    """Names from SHAPES, the sets grid / deepseek / gptoss, or MxNxKxE."""
    sets = {"grid": GRID, "deepseek": DEEPSEEK, "gptoss": GPTOSS}
    out = []
    for item in common.csv_list(text):
        if item in sets:
            out += sets[item]
        elif item in SHAPES:
            out.append(SHAPES[item])
        elif re.fullmatch(r"[1-9]\d*x[1-9]\d*x[1-9]\d*x[1-9]\d*", item):  # 0 was a ZeroDivisionError row
            m, n, k, e = map(int, item.split("x"))
            out.append(Shape(item, m, n, k, e))
        else:
            raise argparse.ArgumentTypeError(f"unknown shape {item!r}: a name ({', '.join(SHAPES)}), grid, "
                                             "deepseek, gptoss or MxNxKxE")
    return out


# ---- inputs -------------------------------------------------------------------------------------


def make_inputs(m: int, n: int, k: int, experts: int, ends: list[int], layout: str, seed: int, device="cpu"):
    """(a, a_scale, b, b_scale, offs): randn quantized 1x32 (rceil), on 256-byte boundaries."""
    gen = torch.Generator(device).manual_seed(seed)
    signed = SIGNED_ZEROS.get(layout, True)
    a, a_scale = reference.mxfp8_quantize(torch.randn(m, k, generator=gen, device=device) * 4, -1, "rceil",
                                          signed_zeros=signed)
    b, b_scale = reference.mxfp8_quantize(torch.randn(experts * n, k, generator=gen, device=device), -1, "rceil",
                                          signed_zeros=signed)
    b, b_scale = b.view(experts, n, k), b_scale.view(experts, n, -1)
    if LAYOUTS[layout] == "mfma":  # a's (M, K/32) and each expert's (N, K/32), stacked
        a_scale = layouts.mfma_shuffle_scales(a_scale)
        b_scale = torch.stack([layouts.mfma_shuffle_scales(s) for s in b_scale])
    offs = torch.tensor(ends, dtype=torch.int32)
    return tuple(emu.aligned(t) for t in (a, a_scale, b, b_scale, offs.to(device)))


def tiles(shape: Shape, arch: str, layout: str, args) -> tuple[int, int, bool]:
    """(tile_m, tile_n, lds_stage): --tile-m / --tile-n where given, else what the selector plans
    for fq.mxfp8_grouped_mm; the operands staged in LDS as the selector would for those tiles,
    or as --staging says."""
    tm, tn = select_grouped_mm.grouped_mm_tiles(arch, shape.m, shape.n, shape.experts, LAYOUTS[layout])[0]
    tm, tn = args.tile_m or tm, args.tile_n or tn
    lds = select_grouped_mm.grouped_mm_lds_stage(arch, (tm, tn), LAYOUTS[layout])[0]
    return tm, tn, {"selector": lds, "direct": False, "lds": True}[args.staging]


def launch(inputs, arch: str, layout: str, tile_m: int, tile_n: int, lds: bool, out=None):
    a, a_scale, b, b_scale, offs = inputs
    with toolchain.target(arch):
        return G.grouped_mm(a, a_scale, b, b_scale, offs, arch=arch, out=out, out_dtype=OUT_DTYPE,
                            scale_layout=LAYOUTS[layout], tile_m=tile_m, tile_n=tile_n,
                            signed_zeros=SIGNED_ZEROS.get(layout, True), lds_stage=lds)


# ---- modelled mode ------------------------------------------------------------------------------


def tile_classes(shape: Shape, tile_m: int, tile_n: int):
    """The grid's m-tiles by (rows, group boundaries strictly inside, relative to the tile's first
    row) -> count, and its n-tiles by width -> count (the groups cover all M rows: no tile has
    rows past the last group)."""
    ends = shape.ends()
    m_classes = collections.Counter()
    for row0 in range(0, shape.m, tile_m):
        rows = min(tile_m, shape.m - row0)
        inside = tuple(e - row0 for e in ends if row0 < e < row0 + rows)
        m_classes[(rows, inside)] += 1
    n_classes = collections.Counter({tile_n: shape.n // tile_n})
    if shape.n % tile_n:
        n_classes[shape.n % tile_n] += 1
    return dict(m_classes), {w: c for w, c in n_classes.items() if c}


def tile_offs(rows: int, inside: tuple, experts: int) -> list[int]:
    """offs of a one-tile launch whose groups end where the class's boundaries are: groups 0 ..
    len(inside) hold its rows, the later ones are empty (their ends at `rows`)."""
    return [*inside, *[rows] * (experts - len(inside))]


def compulsory_bytes(rows: int, cols: int, k: int, groups: int, experts: int) -> float:
    """What one tile must move: its A rows and their scales, each group's B columns and scales,
    its output, offs."""
    return rows * k * (1 + 1 / MX_BLOCK) + groups * cols * k * (1 + 1 / MX_BLOCK) + rows * cols * 2 + experts * 4


_MNEMONIC = re.compile(r"^\s+([a-z][a-z0-9_]*)\b", re.M)


def isa_mnemonics(isa: str) -> collections.Counter:
    return collections.Counter(m for m in _MNEMONIC.findall(isa) if not m.startswith("."))


def compile_report(arch: str, shape: Shape, n: int, layout: str, tile_m: int, tile_n: int, lds: bool):
    cfg = G.GroupedMMConfig(arch=arch, out_dtype=OUT_DTYPE, n=n, k=shape.k, experts=shape.experts, tile_m=tile_m,
                            tile_n=tile_n, scale_layout=LAYOUTS[layout],
                            signed_zeros=SIGNED_ZEROS.get(layout, True), lds_stage=lds)
    (report,) = toolchain.compile_only(arch, G.build_grouped_mm(cfg), *([0] * 6), shape.m, 1, 1, stream=0)
    return report


def model_shape(shape: Shape, arch: str, layout: str, tile_m: int, tile_n: int, lds: bool, seed: int) -> dict:
    full = compile_report(arch, shape, shape.n, layout, tile_m, tile_n, lds)
    res = common.Resources.of(full)
    m_classes, n_classes = tile_classes(shape, tile_m, tile_n)
    terms, tiles, isa_diffs = [], [], {}
    for width in n_classes:  # the emulated specializations (N = width) against the model-sized one
        diff = isa_mnemonics(full.isa)
        diff.subtract(isa_mnemonics(compile_report(arch, shape, width, layout, tile_m, tile_n, lds).isa))
        isa_diffs[width] = {k: v for k, v in diff.items() if v}
    for (rows, inside), m_count in m_classes.items():
        for width, n_count in n_classes.items():
            inputs = make_inputs(rows, width, shape.k, shape.experts, tile_offs(rows, inside, shape.experts), layout,
                                 seed)
            out = emu.aligned_empty((rows, width), OUT_DTYPE)
            names = ("a", "a_scale", "b", "b_scale", "offs")
            _, counts, records = common.emulate(lambda: launch(inputs, arch, layout, tile_m, tile_n, lds, out),
                                                dict(zip(names, inputs)) | {"out": out})
            if len(records) != 1 or counts.workgroups_launched != 1:
                raise RuntimeError(f"expected one launch of one workgroup, got {len(records)} launches, "
                                   f"{counts.workgroups_launched:.0f} workgroups")
            moved = counts.mem(common.GLOBAL_CLASSES).bytes
            need = compulsory_bytes(rows, width, shape.k, len(inside) + 1, shape.experts)
            tiles.append({"rows": rows, "boundaries": list(inside), "cols": width, "workgroups": m_count * n_count,
                          "wave_instr": counts.wave_instructions, "mfma": counts.cls("mfma"),
                          "instr_per_mfma": counts.wave_instructions / counts.cls("mfma"),
                          "global_bytes": moved, "compulsory_bytes": need, "traffic_vs_compulsory": moved / need,
                          "working": counts.workgroups_working, "counts": counts.to_json()})
            terms.append((m_count * n_count, counts))
    grid = common.Counts.combine(terms)
    interior = max(tiles, key=lambda t: t["workgroups"])  # the tile class most of the grid runs
    loads = grid.mem("vmem_load")
    row = {
        "shape": shape.name, "m": shape.m, "n": shape.n, "k": shape.k, "experts": shape.experts, "arch": arch,
        "layout": layout, "tile_m": tile_m, "tile_n": tile_n, "tile": f"{tile_m}x{tile_n}{' lds' if lds else ''}", "kernel": full.name,
        "wg_launched": grid.workgroups_launched, "wg_working": grid.workgroups_working,
        "grid_workgroups": math.ceil(shape.m / tile_m) * math.ceil(shape.n / tile_n),
        "instr_per_mfma": grid.wave_instructions / grid.cls("mfma"),
        "tile_instr_per_mfma": interior["instr_per_mfma"],
        "coalescing_loads": common.coalescing(loads),
        "coalescing_operands": common.coalescing(common.MemFigures.total(grid.by_tensor[t] for t in OPERANDS)),
        "coalescing_by_tensor": {k: common.coalescing(m) for k, m in grid.by_tensor.items()},
        "coalescing_stores": common.coalescing(grid.mem("vmem_store")),
        "coal_a": common.coalescing(grid.by_tensor["a"]), "coal_b": common.coalescing(grid.by_tensor["b"]),
        "coal_scales": min(common.coalescing(grid.by_tensor[t]) for t in ("a_scale", "b_scale")),
        "tile_traffic_vs_compulsory": interior["traffic_vs_compulsory"],
        "tile_classes": len(tiles),
        "isa_diff_vs_full_n": max(sum(map(abs, d.values())) for d in isa_diffs.values()),
        "isa_mnemonic_diffs": {str(w): d for w, d in isa_diffs.items()},
        "emulated": f"{len(tiles)} tile(s) of 1 WG",
        "tiles": tiles, "counts": grid.to_json(),
    }
    return row | common.resource_figures(res)


def target_misses(row: dict) -> list[str]:
    misses = []
    if row["instr_per_mfma"] > PER_MFMA_TARGET:
        misses.append(f"{row['instr_per_mfma']:.2f} wave-instructions per MFMA (target <= {PER_MFMA_TARGET})")
    if row["coalescing_operands"] is None:  # a figure not observed is not a target met
        misses.append("operand load coalescing not observed")
    elif row["coalescing_operands"] < COALESCING_TARGET - 1e-9:
        per = ", ".join(f"{k} {v:.3f}" for k, v in row["coalescing_by_tensor"].items() if k in OPERANDS)
        misses.append(f"operand load coalescing {row['coalescing_operands']:.3f} ({per})")
    if row.get("spills") is None:
        misses.append("spills not known (no compiler resources)")
    elif row["spills"]:
        misses.append(f"{row['spills']} spills")
    if row["wg_working"] != row["grid_workgroups"] or row["wg_launched"] != row["grid_workgroups"]:
        misses.append(f"{row['wg_working']:.0f} of {row['grid_workgroups']} workgroups working")
    return misses


MODELLED_COLUMNS = [
    ("shape", "shape"), ("arch", "arch"), ("layout", "scales"), ("tile", "tile"), ("vgprs", "VGPR"), ("agprs", "AGPR"),
    ("lds_bytes", "LDS B"), ("spills", "spill"), ("workgroups_per_cu", "WG/CU"), ("grid_workgroups", "WGs"),
    ("wg_working", "working"), ("instr_per_mfma", "instr/MFMA"), ("tile_instr_per_mfma", "tile"),
    ("coalescing_operands", "coal op"), ("coal_a", "A"), ("coal_b", "B"), ("coal_scales", "scales"),
    ("coalescing_stores", "coal st"), ("tile_traffic_vs_compulsory", "tile B/min"),
    ("emulated", "emulated"), ("isa_diff_vs_full_n", "ISA diff"), ("verdict", "target"),
]


# ---- hardware mode ------------------------------------------------------------------------------


def dequantized(data: torch.Tensor, scales: torch.Tensor) -> torch.Tensor:
    """bf16 values of 1x32 MXFP8 data (row-major scales) for the bf16 baseline."""
    s = torch.exp2(scales.view(torch.uint8).float() - 127)
    return (data.float().unflatten(-1, (-1, MX_BLOCK)) * s.unsqueeze(-1)).flatten(-2).to(torch.bfloat16)


def hipblaslt_per_group(a, a_scale, b, b_scale, ends):
    """hipBLASLt's dense MXFP8 GEMM once per group (torch._scaled_mm with E8M0 1x32 scales)."""
    groups = [(g, lo, hi) for g, (lo, hi) in enumerate(zip([0, *ends[:-1]], ends)) if hi > lo]

    def run():  # each group's output its own tensor: no copy into one (M, N) is timed
        return [torch._scaled_mm(a[lo:hi], b[g].t(), a_scale[lo:hi].contiguous(), b_scale[g], out_dtype=OUT_DTYPE)
                for g, lo, hi in groups]

    return run


def time_shape(shape: Shape, arch: str, layouts_: list[str], args) -> list[dict]:
    import flyquant as fq

    head = {"shape": shape.name, "m": shape.m, "n": shape.n, "k": shape.k, "experts": shape.experts, "arch": arch}
    plain = make_inputs(shape.m, shape.n, shape.k, shape.experts, shape.ends(), "plain", args.seed, "cuda")
    a, a_scale, b, b_scale, offs = plain
    candidates = []
    for layout in layouts_:
        inputs = plain if layout == "plain" else make_inputs(shape.m, shape.n, shape.k, shape.experts, shape.ends(),
                                                             layout, args.seed, "cuda")
        tm, tn, lds = tiles(shape, arch, layout, args)
        # where the operands are staged, each wave's own loads beside them: which is faster is what the
        # modelled figures cannot say (one costs ~0.5 wave-instructions per MFMA, the other half the bytes)
        for staged in (lds, False) if lds else (False,):
            candidates.append((f"flyquant kernel ({layout}, {tm}x{tn}{' lds' if staged else ''})",
                               lambda i=inputs, lay=layout, tm=tm, tn=tn, st=staged: launch(i, arch, lay, tm, tn, st)))
    plan = select_grouped_mm.plan_mxfp8_grouped_mm(a, b, offs, OUT_DTYPE)
    candidates.append((f"fq.mxfp8_grouped_mm [{plan.backend}]", lambda: fq.mxfp8_grouped_mm(a, a_scale, b, b_scale,
                                                                                            offs)))
    a16, b16 = dequantized(a, a_scale), dequantized(b, b_scale)
    b16_t = b16.transpose(-2, -1)  # (E, K, N), as torchao passes its weights
    candidates.append(("bf16 torch._grouped_mm", lambda: torch._grouped_mm(a16, b16_t, offs, out_dtype=OUT_DTYPE)))
    candidates.append(("hipBLASLt MXFP8 per group", hipblaslt_per_group(a, a_scale, b, b_scale, shape.ends())))
    rows, ref = [], None
    for name, fn in candidates:
        try:
            got = fn()  # fails here, untimed, when this torch / GPU does not support it
            t = common.time_gpu(fn, warmup=args.warmup, iters=args.iters, flush=not args.no_flush)
        except Exception as exc:  # reported with its error, never given a number
            rows.append(head | {"impl": name, "error": " ".join(f"{type(exc).__name__}: {exc}".split())[:300]})
            continue
        if name == "bf16 torch._grouped_mm":
            ref = got.float()
        rows.append(head | {"impl": name, "median_us": t.median_us, "min_us": t.min_us, "iters": t.iters,
                            "cold_cache": t.cold_cache, "host_us": t.host_us, "gpu_delay": t.gpu_delay, "late": t.late,
                            "tflops": shape.flops / (t.median_us * 1e-6) / 1e12,
                            "out": got if name.startswith("flyquant kernel") else None})
    for r in rows:  # the kernel's output against bf16's on the same values (E4M3 x 2^s is exact in bf16)
        out = r.pop("out", None)
        if out is not None and ref is not None:
            r["rel_err_vs_bf16"] = float((out.float() - ref).abs().max() / ref.abs().max())
    bf16 = next((r for r in rows if r["impl"] == "bf16 torch._grouped_mm" and "tflops" in r), None)
    for r in rows:
        r["vs_bf16"] = r["tflops"] / bf16["tflops"] if bf16 and "tflops" in r else None
    return rows


def geomeans(rows: list[dict]) -> list[dict]:
    """Per implementation, over the shapes it ran: geomean TFLOP/s and speed-up over bf16."""
    out = []
    for impl in dict.fromkeys(r["impl"] for r in rows):
        ran = [r for r in rows if r["impl"] == impl and "tflops" in r]
        vs = [r["vs_bf16"] for r in ran if r["vs_bf16"]]
        out.append({"shape": f"geomean ({len(ran)} shapes)", "impl": impl,
                    "tflops": math.exp(sum(math.log(r["tflops"]) for r in ran) / len(ran)) if ran else None,
                    "vs_bf16": math.exp(sum(map(math.log, vs)) / len(vs)) if vs else None})
    return out


HARDWARE_COLUMNS = [("shape", "shape"), ("impl", "impl"), ("median_us", "median us"), ("host_us", "host us"),
                    ("tflops", "TFLOP/s"),
                    ("vs_bf16", "vs bf16"), ("rel_err_vs_bf16", "max err / max |bf16|"),
                    ("error", "error")]


# ---- outputs ------------------------------------------------------------------------------------


def plot(rows: list[dict], mode: str, path: Path) -> Path:
    """Modelled: wave-instructions per MFMA (target line) and load coalescing per shape, one bar
    per arch and scale layout; hardware: TFLOP/s per shape, one bar per implementation."""
    plt = common.pyplot()
    ok = [r for r in rows if "error" not in r and not r["shape"].startswith("geomean")]
    shapes = list(dict.fromkeys(r["shape"] for r in ok))
    key = (lambda r: f"{r['arch']} {r['layout']}") if mode == "modelled" else (lambda r: r["impl"])
    series = list(dict.fromkeys(key(r) for r in ok))
    panels = ([("instr_per_mfma", "wave-instructions / MFMA (grid)", PER_MFMA_TARGET),
               ("coalescing_operands", "operand load coalescing", COALESCING_TARGET)]
              if mode == "modelled" else [("tflops", "TFLOP/s", None)])
    fig, axes = plt.subplots(len(panels), 1, figsize=(max(6, 0.9 * len(shapes) * max(1, len(series)) / 2), 3.6 *
                                                                                                      len(panels)),
                             squeeze=False)
    width = 0.8 / max(1, len(series))
    for ax, (field, label, target) in zip(axes[:, 0], panels):
        for i, s in enumerate(series):
            by_shape = {r["shape"]: r.get(field) for r in ok if key(r) == s}
            xs = [j for j, sh in enumerate(shapes) if by_shape.get(sh) is not None]
            ax.bar([x + i * width for x in xs], [by_shape[shapes[x]] for x in xs], width, label=s)
        if target is not None:
            ax.axhline(target, color="k", ls="--", lw=1, label="issue 22 target")
        ax.set_xticks([j + 0.4 - width / 2 for j in range(len(shapes))], shapes, rotation=60, ha="right", fontsize=6)
        ax.set_title(label + (" (modelled, not timed)" if mode == "modelled" else ""), fontsize=9)
        ax.grid(alpha=0.3, axis="y")
        ax.legend(fontsize=6)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def parse_args(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--shapes", type=shape_arg, default=None,
                    help=f"names, sets (grid, deepseek, gptoss) or MxNxKxE (default: {','.join(SUBSET)})")
    ap.add_argument("--full", action="store_true", help="every shape: torchao's grid, DeepSeek-V3, GPT-OSS")
    ap.add_argument("--layouts", type=common.csv_list, default=["plain", "mfma"],
                    help="scale layouts: plain,mfma, or mfma+0 (+0 zeros: the training op's gfx942 operands)")
    ap.add_argument("--tile-m", type=common.positive_int, default=None, help="default: the selector's per shape, arch and scales")
    ap.add_argument("--tile-n", type=common.positive_int, default=None, help="default: the selector's per shape, arch and scales")
    ap.add_argument("--staging", choices=("selector", "direct", "lds"), default="selector",
                    help="gfx950's forward operands: staged in LDS where the selector would for the tiles (default), "
                         "loaded by each wave, or staged")
    ap.add_argument("--op", choices=("fwd", "wgrad"), default="fwd",
                    help="fwd: forward / dgrad (--shapes); wgrad: the weight gradient (--wgrad-shapes)")
    ap.add_argument("--wgrad-shapes", type=wgrad.shape_arg, default=list(wgrad.SHAPES.values()),
                    help=f"--op wgrad: names or NxK:size+size+... (default: {','.join(wgrad.SHAPES)})")
    common.add_common_args(ap)
    ap.set_defaults(arch=["gfx950", "gfx942"])
    args = ap.parse_args(argv)
    for layout in args.layouts:
        if layout not in LAYOUTS:
            ap.error(f"unknown scale layout {layout!r}: choose from {tuple(LAYOUTS)}")
    if args.op == "wgrad":
        ignored = [opt for opt, given in (("--shapes", args.shapes is not None), ("--full", args.full),
                                          ("--layouts", args.layouts != ap.get_default("layouts")),
                                          ("--staging", args.staging != "selector")) if given]
        if ignored:
            ap.error(f"--op wgrad takes --wgrad-shapes, not {', '.join(ignored)}")
        if args.mode == "hardware":
            ap.error("--op wgrad: modelled mode only so far")
    if args.shapes is None:
        names = SHAPES if args.full else QUICK if args.quick else SUBSET
        args.shapes = [SHAPES[n] for n in names]
    return args


def main(argv=None) -> dict:
    args = parse_args(argv)
    if args.op == "wgrad":
        return wgrad.main(args, plot)
    forced = f"{args.tile_m or 'selector'}x{args.tile_n or 'selector'}"
    mode, archs, label, sources = common.begin(args, f"MXFP8 grouped GEMM, tiles {forced}")
    rows = []
    for arch in archs:
        if mode == "modelled":
            emu.enable(arch)
        for shape in args.shapes:
            if mode == "hardware":
                rows += time_shape(shape, arch, args.layouts, args)
                print(f"  {shape.name} {arch}: timed", flush=True)
                continue
            for layout in args.layouts:
                try:
                    row = model_shape(shape, arch, layout, *tiles(shape, arch, layout, args), args.seed)
                    row["target_misses"] = target_misses(row)
                    row["verdict"] = "missed" if row["target_misses"] else "met"
                except Exception as exc:  # a failed compile or launch: reported, the other shapes go on
                    row = {"shape": shape.name, "arch": arch, "layout": layout,
                           "error": f"{type(exc).__name__}: {exc}"}
                rows.append(row)
                print(f"  {shape.name} {arch} {layout}: {row.get('verdict', row.get('error'))}", flush=True)
    print()
    if mode == "hardware":
        rows += geomeans(rows)
    common.print_table([r for r in rows if "error" not in r or mode == "hardware"],
                       MODELLED_COLUMNS if mode == "modelled" else HARDWARE_COLUMNS)
    if mode == "modelled":
        for r in rows:
            if "error" in r:
                print(f"not measured: {r['shape']} {r['arch']} {r['layout']}: {r['error']}")
            elif r["target_misses"]:
                print(f"target missed: {r['shape']} {r['arch']} {r['layout']}: " + "; ".join(r["target_misses"]))
        print("\ninstr/MFMA: wave-instructions per MFMA executed over the whole grid, reconstructed from one emulated "
              "workgroup per tile class (m-tile rows and group boundaries inside x n-tile width) times its count; "
              "'tile': the class most workgroups run. gfx950 issues one 16x16x128 scaled MFMA per 128-wide K step, "
              "gfx942 four 16x16x32 FP8 MFMAs. 'tile B/min': that tile's global bytes over its compulsory bytes. "
              "'ISA diff': mnemonics whose count differs between the emulated (N = tile width) and the model-sized "
              "specialization (0: only constants differ). Registers, LDS, spills, WG/CU: the model-sized kernel.")
    changed = common.warn_if_sources_changed(sources)
    stem = f"grouped_mm_{mode}"
    payload = {"mode": mode, "label": label, "args": vars(args) | {"shapes": [s.name for s in args.shapes]},
               "environment": common.environment() | {"kernel_sources_changed": changed}, "rows": rows,
               "targets": {"instr_per_mfma_max": PER_MFMA_TARGET, "coalescing_operands": COALESCING_TARGET,
                           "spills": 0, "workgroups_working": "all"}}
    json_path = common.write_json(args.out / f"{stem}.json", payload)
    png_path = plot(rows, mode, args.out / f"{stem}.png")
    print(f"\nwrote {json_path} and {png_path}")
    return payload


if __name__ == "__main__":
    main()
