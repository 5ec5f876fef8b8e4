"""MXFP8 and MXFP4 quantize: bandwidth on hardware, observable work without it.

    python bench/quantize.py                                  # hardware if a ROCm GPU is present, else modelled
    python bench/quantize.py --quick --out results
    python bench/quantize.py --shapes 8192x7168 --kinds 1x32,32x1 --modes rceil
    python bench/quantize.py --mode modelled --vs torchao,aiter --vs-configs all   # peers' Triton casts beside ours
    python bench/quantize.py --mode modelled --kinds fp4_1x32,fp4_32x1,fp4_dual,fp4_a4w4,fp4_3d_a16w4 --vs aiter

Cases: 1x32, 32x1 and dual (both at once) on 2D shapes, per-expert 3D on 3D shapes, floor and
rceil, bf16 inputs (randn * 30), each through the public API (fq.mxfp8_quantize, ..._dual,
..._3d) so the selector's choice is what runs. The default shapes are MoE-training sizes plus
the three shapes issue 4 measured torchao 0.18's FlyDSL kernels on. MXFP4 (kinds fp4_1x32,
fp4_32x1, fp4_dual, fp4_a4w4, fp4_3d_a16w4; modes floor, rceil, even; each beside our MXFP8 1x32
and the MXFP8 kind of its orientations on the same shape, and issue 14's targets evaluated):
bench/quantize_mxfp4.py.

Hardware mode (ROCm GPU): median and minimum of single-call event timings after a warm-up,
TB/s = (bytes read + bytes written) / time and the fraction of HBM peak (MI300X 5.3 TB/s,
MI355X 8 TB/s), against torchao's Triton kernels, torchao 0.18's FlyDSL kernels and
torch.compile of the reference, when they import and run (failures are reported as such).
flyquant's output is first checked bit for bit against flyquant.reference.

Modelled mode (no AMD GPU): the kernel runs under flyquant.emu; the output holds only what is
observed, labelled "modelled, not timed": wave-instructions per element (beside torchao's
figures from issue 4 where the case matches), coalescing of loads and of each store mnemonic
(useful bytes / bytes of the 128-byte lines touched), lines stored only in part (a GPU then
reads, modifies and writes them), global traffic against the compulsory bytes, workgroups,
VGPR/LDS and the occupancy they allow, and a static estimate of the load bytes in flight per
CU (occupancy x the most load bytes a wave has outstanding, from the ISA). Shapes above
--max-elements are reduced along the leading dimension (rows; for 3D, experts and then K; the
MXFP4 kinds fp4_32x1 and fp4_3d_a16w4 keep their quantized dimension whole: quantize_mxfp4.KEEP)
and the totals scaled by elements: per-element figures and coalescing are ratios and carry over,
but the selector plans the reduced shape itself, so the table says when its configuration
differs from the full shape's (the MXFP4 shuffles' wave length, which grows with the launch, is
planned as for the full launch: quantize_mxfp4.waves_of_full_launch). Registers, LDS and occupancy are the emulated kernel's (the JSON
adds the model-sized input's as full_shape_resources when that compiles another
specialization). Outputs are checked bit for bit against the reference too. Input and outputs
sit on 256-byte boundaries as on a GPU (the launcher's CPU allocations are made so while it
is emulated), so line counts are a GPU's.

--vs torchao,aiter (modelled mode): torchao's Triton MXFP8 casts (1x32 = dim0, 32x1 = dim1) and
aiter's (downcast_to_mxfp), compiled by Triton for the same arch and run under flyquant.emu on each
row's very input, checked byte for byte against torchao's to_mx, in a second table:
wave-instructions per element and the peer/flyquant ratio, VGPR/AGPR, LDS, spills and scratch,
workgroups per CU (bench/peers*.py; --vs-configs all runs every torchao autotune config and marks
the best); each MXFP8 row is held to issue 20's target, at most 0.6x the wave-instructions per
element of the best peer run on its input. For the MXFP4 rows, --vs aiter runs aiter's Triton
MXFP4 quantize (dynamic_mxfp4_quant, "even" only) and compares it with flyquant.reference
(bench/peers_aiter.py). In hardware mode
torchao's Triton casts (and aiter's MXFP4 quantize, when aiter imports) are among the timed baselines.
"""

from __future__ import annotations

import argparse
import fractions
import math
import sys
import zlib
from dataclasses import dataclass
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
import common  # noqa: E402  (bench/ is not a package: the scripts run as files)
import peers  # noqa: E402
import peers_aiter  # noqa: E402
import peers_torchao  # noqa: E402
import quantize_mxfp4 as fp4  # noqa: E402
from quantize_report import (HARDWARE_COLUMNS, MODELLED_COLUMNS, TORCHAO_WAVE_INSTR, display, plot,  # noqa: E402
                             print_torchao, torchao_json)

import flyquant as fq  # noqa: E402
import flyquant.emu as emu  # noqa: E402
from flyquant import reference, select  # noqa: E402

MX_BLOCK = 32
INPUT_SCALE = 30.0  # randn * 30: the inputs issue 4's torchao figures were measured with
SHAPES_2D = ((8192, 7168), (16384, 5120), (16384, 16384))
SHAPES_3D = ((8, 5120, 5120), (8, 7168, 7168), (32, 8192, 8192))
QUICK_SHAPES = ((8192, 7168), (8, 5120, 5120))
KINDS_2D = ("1x32", "32x1", "dual")
KINDS_3D = ("3d",)
MODES = ("floor", "rceil")
DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}
MAX_ELEMENTS = 1 << 22  # modelled mode: larger inputs are reduced (a few seconds of emulation each)
QUICK_MAX_ELEMENTS = 1 << 20  # still above the torchao comparison shapes (<= 128 x 5120)
REDUCE_STEP = 256  # reduced dimensions are multiples of this: the kernels' row tiles and scale layouts divide it

TARGETS = (
    "data loads and stores coalescing >= 0.95 (scale stores: reported, no target); no partially stored data lines",
    "load bytes in flight >= 32 KiB per CU for large shapes",
    "wave-instructions per element on gfx950 <= 0.6x torchao's on the same shapes",
    "hardware: >= 90% of HBM peak for large shapes",
)
PER_ELEMENT_TARGET = 0.6
PEER_TARGET = 0.6  # issue 20: ours <= 0.6x the wave-instructions per element of a peer's Triton cast (--vs)
PEERS = {"torchao": peers_torchao, "aiter": peers_aiter}  # --vs: the peers' Triton casts (bench/peers.py)
BYTES_IN_FLIGHT_TARGET = 32 * 1024
COALESCING_TARGET = 0.95
LARGE_ELEMENTS = 1 << 24  # "large shapes" for the bytes-in-flight target (every training shape is)


@dataclass(frozen=True)
class Case:
    kind: str  # 1x32 | 32x1 | dual | 3d, or an MXFP4 kind (fp4.KINDS)
    shape: tuple
    mode: str  # floor | rceil (| even: MXFP4)
    dtype: torch.dtype = torch.bfloat16

    @property
    def name(self) -> str:
        dtype = "" if self.dtype == torch.bfloat16 else f" {str(self.dtype).removeprefix('torch.')}"
        return f"{self.kind} {'x'.join(map(str, self.shape))} {self.mode}{dtype}"

    @property
    def elements(self) -> int:
        return math.prod(self.shape)

    def bytes_moved(self, shape=None) -> int:
        """Compulsory traffic: the input read once, FP8 data and E8M0 scales written once (per
        orientation; dual writes two)."""
        if self.kind in fp4.KINDS:
            return fp4.bytes_moved(self.kind, shape or self.shape, self.dtype)
        n = math.prod(shape or self.shape)
        outputs = 2 if self.kind == "dual" else 1
        return n * self.dtype.itemsize + outputs * (n + n // MX_BLOCK)


def api_call(case: Case, x: torch.Tensor):
    """The public API call of a case."""
    if case.kind in fp4.KINDS:
        return fp4.api_call(case.kind, case.mode, x)
    if case.kind == "1x32":
        return fq.mxfp8_quantize(x, axis=-1, scaling_mode=case.mode)
    if case.kind == "32x1":
        return fq.mxfp8_quantize(x, axis=0, scaling_mode=case.mode)
    if case.kind == "dual":
        return fq.mxfp8_quantize_dual(x, scaling_mode=case.mode)
    return fq.mxfp8_quantize_3d(x, scaling_mode=case.mode)


def reference_call(case: Case, x: torch.Tensor):
    if case.kind in fp4.KINDS:
        return fp4.reference_call(case.kind, case.mode, x)
    if case.kind == "1x32":
        return reference.mxfp8_quantize(x, -1, case.mode)
    if case.kind == "32x1":
        return reference.mxfp8_quantize(x, 0, case.mode)
    if case.kind == "dual":
        return reference.mxfp8_quantize_dual(x, case.mode)
    return reference.mxfp8_quantize_3d(x, case.mode)


def plan(case: Case, x: torch.Tensor) -> select.Plan:
    """The selector's plan for the case on x (shape, dtype and device only)."""
    if case.kind in fp4.KINDS:
        return fp4.plan(case.kind, case.mode, x)
    if case.kind in ("1x32", "32x1"):
        return select.plan_mxfp8_quantize(x, 1 if case.kind == "1x32" else 0, case.mode, None, None)
    if case.kind == "dual":
        return select.plan_mxfp8_quantize_dual(x, case.mode)
    return select.plan_mxfp8_quantize_3d(x, case.mode, 1, None)


def _tensors(out) -> list[torch.Tensor]:
    if isinstance(out, torch.Tensor):
        return [out]
    return [t for item in out for t in _tensors(item)]


def bit_exact(case: Case, x: torch.Tensor, got) -> bool:
    """Every output tensor equal, byte for byte and in strides, to the reference's (computed on
    x's device)."""
    got, want = _tensors(got), _tensors(reference_call(case, x))
    return len(got) == len(want) and all(
        g.shape == w.shape and g.stride() == w.stride() and torch.equal(g.view(torch.uint8), w.view(torch.uint8))
        for g, w in zip(got, want)
    )


def make_input(case: Case, shape, device, seed: int = 0) -> torch.Tensor:
    """randn * INPUT_SCALE of `shape`, from a generator seeded by the case's kind, the shape and --seed
    (seed 0: the inputs the README's figures were measured on)."""
    gen = torch.Generator().manual_seed(zlib.crc32(f"{case.kind}/{shape}".encode()) ^ seed)
    return emu.aligned((torch.randn(shape, generator=gen) * INPUT_SCALE).to(case.dtype).to(device))


def reduced_shape(shape: tuple, max_elements: int, keep: str | None = None) -> tuple:
    """The shape emulated for `shape`: unchanged up to max_elements, else fewer rows (2D) or one
    expert and fewer columns K (3D); keep "k": fewer rows N, K whole (3D: one expert); keep "m"
    (2D): fewer columns, M whole. Reduced sizes are multiples of REDUCE_STEP (so no tail the full
    shape lacks)."""
    if math.prod(shape) <= max_elements:
        return shape
    if keep == "m":
        m, k = shape
        return (m, _fewer(k, max_elements // m))
    if len(shape) == 2 or keep == "k":
        *_, n, k = shape
        return (1,) * (len(shape) - 2) + (_fewer(n, max_elements // k), k)
    _, n, k = shape
    return (1, n, _fewer(k, max_elements // n))


def _fewer(size: int, budget: int) -> int:
    return min(size, max(REDUCE_STEP, budget // REDUCE_STEP * REDUCE_STEP))


def _config_diff(emulated: select.Plan, full: select.Plan) -> str:
    """' (config key=<emulated shape's> vs <full shape's>, ...)' over the keys where the plans differ, or ''."""
    keys = [k for k in {**full.config, **emulated.config} if emulated.config.get(k) != full.config.get(k)]
    if not keys:
        return ""
    return " (config " + ", ".join(f"{k}={emulated.config.get(k)} vs {full.config.get(k)}" for k in keys) + ")"


# ---- modelled mode ------------------------------------------------------------------------------


def model_case(case: Case, arch: str, max_elements: int, seed: int = 0) -> dict:
    row = {
        "case": case.name,
        "kind": case.kind,
        "shape": list(case.shape),
        "mode": case.mode,
        "arch": arch,
        "elements": case.elements,
    }
    # the planner reads shapes, dtypes and the device only: a stride-0 view costs no memory
    full = torch.empty(1, dtype=case.dtype).expand(case.shape)
    try:
        full_plan = plan(case, full)
    except ImportError as exc:  # the kernel module is not there (yet): say what is missing
        return row | {"status": f"missing: the selector could not load the kernel ({exc})"}
    row["plan"] = str(full_plan)
    if full_plan.backend != "flydsl":
        return row | {"status": f"the selector chose the reference: {'; '.join(full_plan.reasons)}"}
    shape = reduced_shape(case.shape, max_elements, fp4.KEEP.get(case.kind))
    x = make_input(case, shape, "cpu", seed)
    # Every input is compiled (without running) before it is emulated, so each specialization's
    # first compile is one whose resources are read; the emulated kernel's are then known by name.
    full_key = (arch, case.kind, case.mode, case.dtype, case.shape)
    full_res = common.compiled_resources(full_key, arch, api_call, case, torch.empty(case.shape, dtype=case.dtype))
    with fp4.waves_of_full_launch(fractions.Fraction(math.prod(shape), case.elements)):
        small_plan = plan(case, x)
        common.compiled_resources(full_key[:-1] + (shape,), arch, api_call, case, x)
        with emu.device_like_allocations():
            out, counts, records = common.emulate(lambda: api_call(case, x))
    if not records:
        return row | {"status": "nothing was launched (the API ran the reference)"}
    resources = common.resources_of_kernel(records[0].kernel)  # None: compiled before this script ran it
    if full_res is not None and resources is not None and full_res.kernel != resources.kernel:
        row["full_shape_resources"] = full_res  # the model-sized input compiles another specialization
    scale = case.elements / math.prod(shape)
    total = counts.scaled(scale)
    return (
        row
        | modelled_figures(case, arch, total, resources, records)
        | {
            "status": "ok",
            "bit_exact": bit_exact(case, x, out),
            # outputs the launcher allocated off a 128-byte line (0 when device_like_allocations
            # reached them): their stores show split lines that a hipMalloc'd buffer has not
            "outputs_off_line": emu.misaligned(_tensors(out)),
            "reduction": (
                "exact"
                if shape == case.shape
                else "from " + "x".join(map(str, shape)) + _config_diff(small_plan, full_plan)
            ),
            "config": full_plan.config,
            "emulated_config": small_plan.config,
            "emulated_shape": list(shape),
            "scale": scale,
            "kernels": sorted({r.kernel for r in records}),
        }
    )


def modelled_figures(case: Case, arch: str, total: common.Counts, res: common.Resources | None, records) -> dict:
    loads = total.mem("vmem_load")
    stores = total.mem("vmem_store")
    glob = total.mem(common.GLOBAL_CLASSES)
    per_element = total.wave_instructions / case.elements
    # torchao's figures are gfx950's (their gfx942 code does not assemble or is wrong)
    torchao = TORCHAO_WAVE_INSTR.get((case.kind, tuple(case.shape), case.mode)) if arch == "gfx950" else None
    torchao_pe = torchao / case.elements if torchao else None
    store_mnemonics = {name: m for name, m in sorted(total.memory.items()) if m.cls == "vmem_store"}
    # the data stores: the store mnemonic moving the most bytes (the scales are 1/32 of the data)
    data_name, data = max(store_mnemonics.items(), key=lambda kv: kv[1].bytes, default=(None, None))
    figures = {
        "wave_instr": total.wave_instructions,
        "instr_per_element": per_element,
        "torchao_wave_instr": torchao,
        "torchao_instr_per_element": torchao_pe,
        "vs_torchao": per_element / torchao_pe if torchao_pe else None,
        "emulated_workgroups": sum(r.stats.workgroups_launched for r in records),
        "launches": len(records),
        "coalescing_loads": common.coalescing(loads),
        "coalescing_stores": common.coalescing(stores),
        "store_coalescing_by_mnemonic": {name: common.coalescing(m) for name, m in store_mnemonics.items()},
        "data_store_mnemonic": data_name,
        "coalescing_data_stores": common.coalescing(data) if data else None,
        "partial_data_store_lines": data.partial_store_lines if data else None,
        "partial_store_lines": stores.partial_store_lines,
        "partial_store_fraction": stores.partial_store_lines / stores.lines if stores.lines else None,
        "global_bytes": glob.bytes,
        "compulsory_bytes": case.bytes_moved(),
        "traffic_vs_compulsory": glob.bytes / case.bytes_moved(),
        "lds_bytes_moved": total.mem("lds").bytes,
        "counts": total.to_json(),
    }
    return figures | common.resource_figures(res)


def target_misses(row: dict) -> list[str]:
    """The issue 4 targets this row misses (whole-launch figures, tail workgroups included), and for an
    MXFP8 row run with --vs issue 20's against the best peer (peers.annotate_best first)."""
    misses = []
    if row.get("spills"):
        misses.append(f"{row['spills']} spills")
    if row["coalescing_loads"] is not None and row["coalescing_loads"] < COALESCING_TARGET:
        misses.append(f"load coalescing {row['coalescing_loads']:.3f}")
    off_line = " (outputs start mid-line here: see 'out off-line')" if row.get("outputs_off_line") else ""
    if row["coalescing_data_stores"] is not None and row["coalescing_data_stores"] < COALESCING_TARGET:
        misses.append(
            f"data store ({row['data_store_mnemonic']}) coalescing {row['coalescing_data_stores']:.3f}{off_line}"
        )
    if row["partial_data_store_lines"]:
        misses.append(f"{row['partial_data_store_lines']:.0f} data lines stored in part{off_line}")
    if row["vs_torchao"] is not None and row["vs_torchao"] > PER_ELEMENT_TARGET:
        misses.append(
            f"wave-instructions per element {row['vs_torchao']:.2f}x torchao's (target <= {PER_ELEMENT_TARGET}x)"
        )
    if row["kind"] not in fp4.KINDS and row.get("vs_best_peer") is not None and row["vs_best_peer"] > PEER_TARGET:
        misses.append(f"wave-instructions per element {row['vs_best_peer']:.2f}x {row['best_peer']}'s "
                      f"(issue 20: target <= {PEER_TARGET}x)")
    inflight = row.get("load_bytes_in_flight_per_cu")
    if row["elements"] >= LARGE_ELEMENTS and inflight is not None and inflight < BYTES_IN_FLIGHT_TARGET:
        misses.append(f"{inflight / 1024:.0f} KiB of loads in flight per CU (static estimate; target >= 32)")
    return misses


# ---- hardware mode ------------------------------------------------------------------------------


def baselines(case: Case):
    """[(name, callable(x) or None, why)] for the other implementations of this case."""
    out = fp4.hardware_baselines(case.kind, case.mode) if case.kind in fp4.KINDS else []
    try:
        from torchao.prototype.mx_formats import kernels as tk

        triton = {
            "1x32": lambda x: tk.triton_to_mxfp8_dim0(x, 32, case.mode),
            "32x1": lambda x: tk.triton_to_mxfp8_dim1(x, 32, case.mode),
        }.get(case.kind)
        out.append(("torchao triton", triton, None if triton else f"torchao has no Triton {case.kind} kernel"))
    except Exception as exc:
        out.append(("torchao triton", None, f"{type(exc).__name__}: {exc}"))
    try:
        from torchao.prototype.moe_training.kernels.mxfp8 import quant as tq

        flydsl = {
            "1x32": lambda x: tq.mxfp8_quantize_2d_1x32_flydsl(x, scaling_mode=case.mode),
            "32x1": lambda x: tq.mxfp8_quantize_2d_32x1_flydsl(x, scaling_mode=case.mode),
            "3d": lambda x: tq.mxfp8_quantize_3d_flydsl(x, scaling_mode=case.mode),
        }.get(case.kind)
        out.append(("torchao flydsl", flydsl, None if flydsl else f"torchao has no FlyDSL {case.kind} kernel"))
    except Exception as exc:
        out.append(("torchao flydsl", None, f"{type(exc).__name__}: {exc}"))
    compiled = torch.compile(lambda x: reference_call(case, x))
    out.append(("torch.compile(reference)", compiled, None))
    return out


def time_case(case: Case, arch: str, args) -> list[dict]:
    x = make_input(case, case.shape, "cuda", args.seed)
    head = {"case": case.name, "kind": case.kind, "shape": list(case.shape), "mode": case.mode, "arch": arch}
    full_plan = plan(case, x)
    rows = []
    candidates = [("flyquant", lambda: api_call(case, x), None)]
    candidates += [(name, (lambda fn=fn: fn(x)) if fn else None, why) for name, fn, why in baselines(case)]
    for name, fn, why in candidates:
        row = head | {"impl": name}
        if fn is None:
            rows.append(row | {"error": why})
            continue
        try:
            # ours must match the reference; the baselines' output contracts (shapes, layouts) differ
            exact = bit_exact(case, x, fn()) if name == "flyquant" else None
            t = common.time_gpu(fn, warmup=args.warmup, iters=args.iters, flush=not args.no_flush)
        except Exception as exc:  # a failing baseline is reported, never given a number
            rows.append(row | {"error": f"{type(exc).__name__}: {exc}"})
            continue
        tb_s = case.bytes_moved() / (t.median_us * 1e-6) / 1e12
        rows.append(
            row
            | {
                "median_us": t.median_us,
                "min_us": t.min_us,
                "iters": t.iters,
                "cold_cache": t.cold_cache,
                "host_us": t.host_us,
                "gpu_delay": t.gpu_delay,
                "late": t.late,
                "tb_per_s": tb_s,
                "hbm_peak_fraction": tb_s * 1e12 / common.hbm_peak_bytes_per_s(arch),
                "bit_exact": exact,
                "plan": str(full_plan) if name == "flyquant" else None,
            }
        )
    return rows


# ---- driver -------------------------------------------------------------------------------------


def shape_arg(text: str) -> list[tuple]:
    """ "8192x7168,8x5120x5120" -> [(8192, 7168), (8, 5120, 5120)]."""
    shapes = [tuple(common.positive_int(d) for d in s.split("x")) for s in common.csv_list(text)]  # 0: ZeroDivisionError rows
    for s in shapes:
        if len(s) not in (2, 3):
            raise argparse.ArgumentTypeError(f"{'x'.join(map(str, s))}: shapes are MxK or ExNxK")
    return shapes


def cases_for(args) -> list[Case]:
    cases = []
    if args.shapes is None:
        shapes = list(QUICK_SHAPES if args.quick else SHAPES_2D + SHAPES_3D)
        torchao_cases = [(kind, shape) for kind, shape, _ in TORCHAO_WAVE_INSTR]
    else:
        shapes, torchao_cases = args.shapes, []
    fp4_modes = [m for m in args.modes if m in fp4.MODES] if args.modes else fp4.default_modes(args.quick)
    fp8_modes = [m for m in args.modes if m in MODES] if args.modes else MODES
    for shape in shapes:
        for kind in (KINDS_2D + fp4.KINDS_2D if len(shape) == 2 else KINDS_3D + fp4.KINDS_3D):
            if kind not in args.kinds:
                continue
            for d in args.dtypes:
                if kind not in fp4.KINDS:
                    cases += [Case(kind, shape, mode, DTYPES[d]) for mode in fp8_modes]
                    continue
                for mode in fp4_modes:  # each beside our MXFP8 1x32 and its orientations' kind, same shape
                    cases += [Case(*p, DTYPES[d]) for p in fp4.fp8_partners(kind, shape, mode)] + [Case(kind, shape, mode, DTYPES[d])]
    for kind, shape in dict.fromkeys(torchao_cases):
        if kind in args.kinds:
            cases += [Case(kind, shape, mode, DTYPES[d]) for d in args.dtypes for mode in fp8_modes]
    return list(dict.fromkeys(cases))


def parse_args(argv=None):
    ap = argparse.ArgumentParser(
        description=__doc__.split("\n\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter
    )
    ap.add_argument(
        "--shapes",
        type=shape_arg,
        default=None,
        help="MxK / ExNxK list (default: MoE-training shapes and issue 4's torchao shapes)",
    )
    kinds = KINDS_2D + KINDS_3D + fp4.KINDS
    ap.add_argument("--kinds", type=common.csv_list, default=list(kinds), help=",".join(kinds))
    ap.add_argument("--modes", type=common.csv_list, default=None,
                    help="floor,rceil,even (even: MXFP4 only; default: floor,rceil for MXFP8, all three for "
                         "MXFP4, --quick only even)")
    ap.add_argument("--dtypes", type=common.csv_list, default=["bf16"], help="input dtypes: bf16,fp16,fp32")
    ap.add_argument(
        "--max-elements",
        type=common.positive_int,
        default=None,
        help=f"modelled: larger inputs are reduced (default {MAX_ELEMENTS}, --quick {QUICK_MAX_ELEMENTS})",
    )
    ap.add_argument("--vs", type=common.csv_list, default=[], help=f"modelled: peers beside ours: {','.join(PEERS)}")
    ap.add_argument("--vs-configs", choices=("default", "all"), default="default",
                    help="torchao's autotune configs to run: its first, or every one (best and default marked)")
    common.add_common_args(ap)
    args = ap.parse_args(argv)
    for peer in args.vs:
        if peer not in PEERS:
            ap.error(f"unknown peer {peer!r}: choose from {tuple(PEERS)}")
    for kind in args.kinds:
        if kind not in kinds:
            ap.error(f"unknown kind {kind!r}: choose from {kinds}")
    for mode in args.modes or ():
        if mode not in fp4.MODES:
            ap.error(f"unknown mode {mode!r}: choose from {fp4.MODES}")
    for dtype in args.dtypes:
        if dtype not in DTYPES:
            ap.error(f"unknown dtype {dtype!r}: choose from {tuple(DTYPES)}")
    args.max_elements = args.max_elements or (QUICK_MAX_ELEMENTS if args.quick else MAX_ELEMENTS)
    if not cases_for(args):  # e.g. --kinds 1x32 --modes even: "even" is an MXFP4 mode only
        ap.error("no case to run: the --kinds, --modes and --shapes given select nothing (MXFP8 kinds take "
                 f"{','.join(MODES)}; MXFP4 kinds {','.join(fp4.MODES)}; 3D kinds need 3D shapes)")
    return args


def main(argv=None) -> dict:
    args = parse_args(argv)
    mode, archs, label, sources = common.begin(args, "MXFP8 and MXFP4 quantize")
    rows, peer_rows = [], []
    for arch in archs:
        if mode == "modelled":
            emu.enable(arch)  # the selector plans, and the API compiles, for the emulator's arch
        for case in cases_for(args):
            try:
                if mode == "modelled":
                    new = [model_case(case, arch, args.max_elements, args.seed)]
                else:
                    new = time_case(case, arch, args)
            except Exception as exc:  # a failed launch or check: reported, and the other cases go on
                new = [
                    {
                        "case": case.name,
                        "kind": case.kind,
                        "shape": list(case.shape),
                        "mode": case.mode,
                        "arch": arch,
                        "status": f"error: {type(exc).__name__}: {exc}",
                    }
                ]
            rows += new
            print(f"  {case.name} {arch}: {new[0].get('status', 'done')}", flush=True)
            if mode == "modelled" and args.vs and new[0].get("status") == "ok":
                x = make_input(case, tuple(new[0]["emulated_shape"]), "cpu", args.seed)  # our row's very input
                for name in args.vs:
                    peer_rows += peers.compare(PEERS[name], case, x, arch, args.vs_configs, new[0])
    print()
    if mode == "modelled":  # each row beside the best peer; each MXFP4 row beside our MXFP8 rows on its shape
        by_name = {(r["case"], r["arch"]): r for r in rows}
        for case in cases_for(args):
            for r in (by_name.get((case.name, arch)) for arch in archs):
                if r and r.get("status") == "ok":
                    peers.annotate_best(r, peer_rows)
                    if case.kind in fp4.KINDS:
                        partners = [Case(*p, case.dtype).name for p in fp4.fp8_partners(case.kind, case.shape, case.mode)]
                        fp4.annotate(r, [by_name.get((p, r["arch"])) for p in partners])
    measured = [r for r in rows if r.get("status", "ok") == "ok"]
    common.print_table(list(display(measured)), MODELLED_COLUMNS if mode == "modelled" else HARDWARE_COLUMNS)
    unmeasured = [r for r in rows if r.get("status", "ok") != "ok"]
    for r in rows:
        if r.get("status", "ok") != "ok":
            print(f"not measured: {r['case']} {r['arch']}: {r['status']}")
        elif mode == "modelled":
            r["target_misses"] = target_misses(r) + (fp4.target_misses(r) if r["kind"] in fp4.KINDS else [])
            if r["target_misses"]:
                print(f"target missed: {r['case']} {r['arch']}: " + "; ".join(r["target_misses"]))
    if mode == "modelled":
        print(
            "\nout off-line: outputs the launcher allocated off a 128-byte line despite the bench's 256-byte-aligned "
            "CPU allocations (should be 0); their store coalescing would be understated"
        )
        print(
            "reduction: 'exact' = the whole input emulated; 'from S' = shape S emulated (its own selector plan; "
            "keys that differ from the full shape's are listed), totals scaled by elements; "
            "'WG emulated' = workgroups of that launch"
        )
        print_torchao([
            "targets (issue 4): " + "; ".join(TARGETS), "MXFP4 targets (issue 14): " + "; ".join(fp4.TARGETS),
            f"--vs (issue 20): MXFP8 wave-instructions per element <= {PEER_TARGET}x the best peer run's"])
        if args.vs:
            peers.print_rows(peer_rows)
    changed = common.warn_if_sources_changed(sources)
    stem = f"quantize_{mode}"
    environment = common.environment() | {"kernel_sources_changed": changed}
    payload = {"mode": mode, "label": label, "args": vars(args), "environment": environment, "rows": rows,
               "peers": peer_rows}
    if mode == "modelled":
        payload["torchao"] = torchao_json(TARGETS)
    json_path = common.write_json(args.out / f"{stem}.json", payload)
    png_path = plot(rows, mode, args.out / f"{stem}.png", peer_rows)
    print(f"\nwrote {json_path} and {png_path}")
    if unmeasured:
        print(f"{len(unmeasured)} of {len(rows)} cases not measured (above); exit status 1")
    return payload


def failed(row: dict) -> bool:
    """A case not measured (modelled) or our kernel's call failing or not bit-exact (hardware)."""
    ours = row.get("impl", "flyquant") == "flyquant"
    return row.get("status", "ok") != "ok" or (ours and (bool(row.get("error")) or row.get("bit_exact") is False))


if __name__ == "__main__":
    sys.exit(1 if any(failed(r) for r in main()["rows"]) else 0)
