"""A16W4 MoE GEMM, stage 1 or 2: sweep of tile_n (and split-K, waves per workgroup) per shape and token count.

    python bench/moe_tile_n.py                          # stage 2; hardware if a ROCm GPU is present, else modelled
    python bench/moe_tile_n.py --stage 1 --quick --out results    # stage 1 (gate/up + activation), a subset
    python bench/moe_tile_n.py --shapes gptoss --tokens 1,4 --tile-n 128,256 --k-batch sel,1
    python bench/moe_tile_n.py --mode modelled --quick --arch gfx950,gfx942 --vs aiter   # aiter's Triton GEMM beside ours

Stage 1 has no split K (its activation needs whole sums): --k-batch is 1 there. Each shape says
stage 1's activation and bias (moe_problem.SHAPES).

Inputs are built the way a user builds them: routing (random top-k, --skew makes some experts
popular), flyquant's moe_sorting with the selector's block size, weights laid out by flyquant's
shuffle_weight_a16w4 / shuffle_scale_a16w4. The weights are random FP4 bytes and E8M0 scales:
the kernel's instructions and memory accesses do not depend on the values (no data-dependent
branch), and quantizing real model-sized weights on a CPU would take minutes and gigabytes.

Hardware mode (ROCm GPU): each config is timed (median and minimum of --iters single-call event
pairs after --warmup calls, caches flushed between calls unless --no-flush), with
TFLOPS = 2 * tokens * topk * N * K / time (stage 1: N = 2 * inter_dim, K = model_dim; stage 2:
N = model_dim, K = inter_dim), the compulsory-traffic bandwidth and how far the time is from the
weight-streaming bound; beside them the public API's end-to-end
call (selector + custom op + kernel) and, when importable, the PyTorch reference and aiter's
CK-Tile stage 2 (stage 1: not wired here). It writes the tuning table the selector reads
(FLYQUANT_TUNING=<out>/tuning_<arch>.json): the fastest config per stage, shape and token count
(a second stage's run adds its entries to the same file; merge_tuning says which entry a shape
swept again keeps). The selector takes the entry of the nearest tuned token count (by ratio,
within a factor of 2); a stage-1 entry only where its tile_m divides the block size fused_moe
sorts with (stage 2's), as it was timed on rows sorted at its own tile_m.

Modelled mode (no AMD GPU): the same configs run under flyquant.emu and the outputs hold only
what is observed, labelled "modelled, not timed": workgroups launched and working, the idle
workgroups' cost, VGPR/AGPR/LDS and the occupancy they allow (compiler), wave-instructions
(total, per MFMA executed, per useful MFMA), memory instructions and bytes, coalescing (useful
bytes / bytes of the 128-byte lines touched; the weight loads apart: the instructions that read
only inside the stage's weights, and their bytes per lane). No tuning table is written from them.

How a model-sized launch is reduced to something a CPU emulates in seconds (stated per row).
Every launch emulated is the real kernel (the same compiled configuration as the model-sized
one) on the real routing; only which m-tiles hold work changes:
- when the m-tiles with work need more than --max-workgroups workgroups (each m-tile is
  n-tiles x k_batch workgroups, all emulated), a systematic sample of S of the W tiles (evenly
  spaced in the order of their routed rows, so partly filled tiles are represented as often as
  in the launch) is emulated and its working workgroups' counters scaled by W / S.
  An estimate, marked "~S/W" in the table; "exact" when every tile with work ran;
- how: when the kernel maps m-slots to m-tiles directly, the sampled tiles' rows are gathered
  into shorter moe_sorting-shaped arrays (same token ids, routing weights, experts), so only
  they launch; when it scans for the tiles with work (small token counts: the grid is sized by
  an upper bound, kernel.m_grid's "compact"), the unsampled tiles' rows become padding instead,
  keeping the real grid and scan with those tiles' workgroups idle;
- an idle workgroup's counters come from a launch without work (no row in use, resp. all rows
  padding), and the real launch's idle workgroups (its grid, from kernel.m_grid, minus the
  working ones) are counted at that cost.
--vs aiter (modelled mode): aiter's Triton MXFP4 MoE GEMM of the stage (bench/peers_aiter_moe.py)
beside the selector's row of each shape and token count, on the same routing, weights and
activations, reduced the same way, its output checked against float64 recomputation; its own table,
the JSON's "peers" and a series of its own colour in the PNG's per-useful-MFMA panel. In hardware
mode the same flag times aiter's Triton GEMM (launched through Triton, bench/peers_aiter_gpu.py)
beside our rows, with the same method.

Workgroups working = tiles with work x n-tiles x k_batch, checked against the emulator's count of
workgroups that stored. All tensors start on 256-byte boundaries (as hipMalloc places them), so
line counts match device allocations rather than torch's 64-byte-aligned CPU buffers.
"""

from __future__ import annotations

import argparse
import json
import math
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
import common  # noqa: E402  (bench/ is not a package: the scripts run as files)
import peers_aiter_gpu  # noqa: E402
import peers_aiter_moe  # noqa: E402

import flyquant as fq  # noqa: E402
import flyquant.emu as emu  # noqa: E402
from flyquant import env, select, tuning  # noqa: E402
from moe_tile_n_report import (  # noqa: E402
    HARDWARE_COLUMNS, MODELLED_COLUMNS, TARGETS, UPSTREAM_NOTES, UPSTREAM_PER_MFMA, UPSTREAM_SOURCE, _display,
    config_label, plot, print_upstream, target_misses,
)
from moe_problem import (  # noqa: E402
    SHAPES, STAGES, TOKENS, Config, Problem, Stage, Weights, build_problem, compulsory_bytes, configs_for, flops,
    gathered_sorting, launch, new_out, padded_sorting, selector_choice, systematic_sample, useful_mfmas,
)

QUICK_TOKENS = (1, 4, 16, 128)
K_BATCH_DEFAULT = "sel,1,2,4"  # "sel": the selector's split for the shape and token count
WAVES_DEFAULT = "auto"  # "auto": the kernel's default for each config (what the selector picks)
# modelled mode: working workgroups emulated per config (whole m-tiles: n-tiles x k_batch each)
MAX_WORKGROUPS = 96
QUICK_MAX_WORKGROUPS = 24

DEFAULT_SHAPES = "gptoss,gptoss-3072,dsr1-i256,dsr1-i1024,dsr1-i2048,dsr1-i2048-e384,upstream-small"
QUICK_SHAPES = "gptoss,dsr1-i2048"
PEERS = {"aiter": peers_aiter_moe}  # --vs: aiter's Triton MXFP4 MoE GEMMs

# ---- modelled mode ------------------------------------------------------------------------------


def model_config(p: Problem, arch: str, cfg: Config, max_workgroups: int, weights: Weights) -> dict:
    """Emulate a representative part of one config's launch and estimate the whole launch's
    counters (module docstring). Returns a result row."""
    s, kernel = p.shape, p.stage.kernel()
    # compiled (without running) before any emulated launch of this config compiles it
    res = common.compiled_resources((arch, p.stage, s.name, cfg), arch, launch, p, arch, cfg, p.sorting, weights)
    n_tiles = -(-p.stage.n(s) // cfg.tile_n)
    grid_m, compact = kernel.m_grid(p.tokens, s.topk, s.experts, p.sorting[0].numel(), p.tile_m)
    per_tile = n_tiles * cfg.k_batch  # workgroups of one m-tile
    n_work = int(p.work_tiles.numel())
    sampled = max(1, min(n_work, max_workgroups // per_tile))
    # the fill sets the A traffic and the epilogue's atomics
    keep = systematic_sample(p.work_tiles, p.valid_rows, sampled)
    weights.fill(p.sorting[2].cpu()[keep].tolist())  # block_m = tile_m: one expert id per m-tile

    records = []

    def run(sorting):
        out = new_out(p, "cpu")
        _, counts, recs = common.emulate(
            lambda: launch(p, arch, cfg, sorting, weights, out), tensors={"w": weights.w}
        )
        records.extend(recs)
        return counts

    if compact:  # the real grid and scan: unsampled tiles' workgroups idle
        idle = run(padded_sorting(p, keep[:0]))
        mixed = run(padded_sorting(p, keep))
    else:  # m-slot = m-tile: launch the sampled tiles alone; idle = out of the rows in use
        idle = run(gathered_sorting(p, keep[:1], in_use=False))
        mixed = run(gathered_sorting(p, keep))
    if idle.workgroups_working:
        raise RuntimeError(f"{s.name} T={p.tokens} {cfg}: a launch without work stored to global memory")
    if mixed.workgroups_working != sampled * per_tile:
        raise RuntimeError(
            f"{s.name} T={p.tokens} {cfg}: {mixed.workgroups_working:.0f} workgroups stored, expected "
            f"{sampled * per_tile} (sampled tiles with work x n-tiles x k_batch): the kernel and this script "
            "disagree on which m-tiles have work"
        )
    per_idle = idle.scaled(1.0 / idle.workgroups_launched)
    work = common.Counts.combine([(1.0, mixed), (-(mixed.workgroups_launched - mixed.workgroups_working), per_idle)])
    launched, working = grid_m * per_tile, n_work * per_tile
    total = common.Counts.combine([(n_work / sampled, work), (launched - working, per_idle)])
    res = res or common.resources_of_kernel(records[0].kernel)  # None: compiled earlier in this process
    waves = records[0].stats.waves_per_workgroup
    return modelled_row(p, arch, cfg, res, waves, total, per_idle, launched, working, sampled, n_work) | {
        "kernel": records[0].kernel
    }


def modelled_row(p, arch, cfg, res, waves, total, per_idle, launched, working, sampled, n_work) -> dict:
    mfma = total.cls("mfma")
    useful = useful_mfmas(p, arch)
    loads = total.mem("vmem_load")
    w = total.by_tensor["w"]
    stores = total.mem("vmem_store")
    atomics = total.mem("vmem_atomic")
    lds = total.mem("lds")
    glob = total.mem(common.GLOBAL_CLASSES)
    quoted = arch == "gfx950" and p.stage.number == 2  # upstream's figures: stage 2 on gfx950
    upstream = UPSTREAM_PER_MFMA.get((p.shape.name, p.tokens, cfg.tile_m, cfg.tile_n)) if quoted else None
    per_mfma = total.wave_instructions / mfma if mfma else None
    return {
        "stage": p.stage.number,
        "shape": p.shape.name,
        "tokens": p.tokens,
        "arch": arch,
        "tile_m": cfg.tile_m,
        "tile_n": cfg.tile_n,
        "k_batch": cfg.k_batch,
        "waves": cfg.waves,
        "reduction": "exact" if sampled == n_work else f"~{sampled}/{n_work} tiles",
        "wg_launched": launched,
        "wg_working": working,
        "tiles_with_work": n_work,
        "tiles_sampled": sampled,
        "idle_wg_instr": per_idle.wave_instructions,
        "idle_wave_instr": per_idle.wave_instructions / waves,
        **common.resource_figures(res),
        "wave_instr": total.wave_instructions,
        "mfma": mfma,
        "mfma_useful": useful,
        "instr_per_mfma": per_mfma,
        "instr_per_useful_mfma": total.wave_instructions / useful if useful else None,
        "instr_per_working_wave": (total.wave_instructions - per_idle.wave_instructions * (launched - working))
        / (working * waves),
        "upstream_instr_per_mfma": upstream,
        "vs_upstream": per_mfma / upstream if upstream and per_mfma else None,
        "vmem_load_instr": loads.executed,
        "vmem_load_bytes": loads.bytes,
        "coalescing_loads": common.coalescing(loads),
        "coalescing_w_loads": common.coalescing(w),
        "w_bytes_per_lane": w.bytes / w.lanes if w.lanes else None,
        "store_instr": stores.executed,
        "coalescing_stores": common.coalescing(stores),
        "atomic_instr": atomics.executed,
        "atomic_bytes": atomics.bytes,
        "coalescing_atomics": common.coalescing(atomics),
        "partial_store_lines": glob.partial_store_lines,
        "lds_instr": lds.executed,
        "lds_bytes_moved": lds.bytes,
        "global_bytes": glob.bytes,
        "compulsory_bytes": compulsory_bytes(p),
        "traffic_vs_compulsory": glob.bytes / compulsory_bytes(p),
        "counts": total.to_json(),
    }


# ---- hardware mode ------------------------------------------------------------------------------


def aiter_stage2():
    """aiter's CK-Tile stage 2 (aiter.fused_moe.cktile_moe_stage2), or None and why not."""
    try:
        from aiter.fused_moe import cktile_moe_stage2
    except Exception as exc:  # aiter raises RuntimeError, ImportError, OSError... without ROCm pieces
        return None, f"aiter not importable ({type(exc).__name__}: {exc})"
    return cktile_moe_stage2, "aiter.fused_moe.cktile_moe_stage2"


def time_config(p: Problem, arch: str, cfg: Config, weights: Weights, args) -> dict:
    out = new_out(p, "cuda")
    t = common.time_gpu(
        lambda: launch(p, arch, cfg, p.sorting, weights, out=out),
        warmup=args.warmup,
        iters=args.iters,
        flush=not args.no_flush,
        before=out.zero_,
    )
    return timing_row(p, arch, t, "flyquant", vars(cfg))


def timing_row(p: Problem, arch: str, t: common.Timing, impl: str, extra: dict) -> dict:
    seconds = t.median_us * 1e-6
    bound = compulsory_bytes(p) / common.hbm_peak_bytes_per_s(arch)
    return {
        "stage": p.stage.number,
        "shape": p.shape.name,
        "tokens": p.tokens,
        "arch": arch,
        "impl": impl,
        **extra,
        "median_us": t.median_us,
        "min_us": t.min_us,
        "iters": t.iters,
        "cold_cache": t.cold_cache,
        "host_us": t.host_us,
        "gpu_delay": t.gpu_delay,
        "late": t.late,
        "tflops": flops(p) / seconds / 1e12,
        "compulsory_tb_per_s": compulsory_bytes(p) / seconds / 1e12,
        "hbm_peak_fraction": compulsory_bytes(p) / seconds / common.hbm_peak_bytes_per_s(arch),
        "vs_streaming_bound": seconds / bound,
    }


def time_baselines(p: Problem, arch: str, weights: Weights, args) -> list[dict]:
    """The public API (with the selector's config for this block size), the PyTorch reference and,
    for stage 2, aiter's CK-Tile stage 2 on the same inputs (failures recorded)."""
    s, st = p.shape, p.stage
    rows = []
    api_out = new_out(p, "cuda")
    ref_out = torch.zeros(*st.out_shape(s, p.tokens), dtype=torch.float32 if st.number == 2 else torch.bfloat16,
                          device="cuda")
    sizes = dict(model_dim=s.model_dim, inter_dim=s.inter_dim)
    if st.number == 1:
        extra = dict(bias=weights.bias, activation=s.activation, **sizes)
        api_fn, ref_fn = fq.moe_gemm1_a16w4, fq.reference.moe_gemm1_a16w4
    else:
        extra = sizes
        api_fn, ref_fn = fq.moe_gemm2_a16w4, fq.reference.moe_gemm2_a16w4

    def api():  # the user's path: selector (plan per call) + custom op + kernel
        api_fn(p.a, weights.w, weights.scale, *p.sorting, topk=s.topk, block_m=p.tile_m, out=api_out, **extra)

    def reference():
        ref_fn(p.a, weights.w, weights.scale, *p.sorting, s.topk, p.tile_m, out=ref_out, **extra)

    candidates = [("flyquant api", api, api_out.zero_), ("pytorch reference", reference, ref_out.zero_)]
    fn, why = aiter_stage2() if st.number == 2 else (None, "aiter's stage 1 is not wired into this script")
    if fn is not None:
        out_bf16 = torch.zeros(p.tokens, s.w_n, dtype=torch.bfloat16, device="cuda")
        sorted_ids, sorted_weights, sorted_expert_ids, num_valid = p.sorting

        def ck_tile():  # a2 as (T, topk, K); the padding of the weights given as aiter's *_pad_zeros
            fn(
                p.a.view(p.tokens, s.topk, s.w_k),
                None,
                weights.w,
                sorted_ids,
                sorted_expert_ids,
                num_valid,
                out_bf16,
                s.topk,
                weights.scale.view(torch.float8_e8m0fnu),
                None,
                p.tile_m,
                sorted_weights=sorted_weights,
                n_pad_zeros=s.w_n - s.model_dim,
                k_pad_zeros=s.w_k - s.inter_dim,
            )

        candidates.append(("aiter ck-tile", ck_tile, out_bf16.zero_))
    else:
        rows.append({"stage": st.number, "shape": s.name, "tokens": p.tokens, "arch": arch, "impl": "aiter ck-tile",
                     "error": why})
    for name, call, before in candidates:
        try:
            t = common.time_gpu(call, warmup=args.warmup, iters=args.iters, flush=not args.no_flush, before=before)
        except Exception as exc:  # a baseline that fails is reported, never replaced by a number
            rows.append({"stage": st.number, "shape": s.name, "tokens": p.tokens, "arch": arch, "impl": name,
                         "error": f"{type(exc).__name__}: {exc}"})
            continue
        rows.append(timing_row(p, arch, t, name, {}))
    return rows


def _tuned_shape(r: dict, shapes: dict) -> dict:
    s = shapes[r["shape"]]
    return {"tokens": r["tokens"], "topk": s.topk, "experts": s.experts, "model_dim": s.model_dim,
            "inter_dim": s.inter_dim}


def _entry_key(e: dict) -> tuple:
    return e["op"], e["arch"], tuple(sorted(e["shape"].items()))


def tuning_table(rows: list[dict], shapes: dict) -> dict:
    """The fastest flyquant config per (stage, arch, shape, tokens), in tuning.tuned_config's format."""
    best = {}
    for r in rows:
        if r.get("impl") != "flyquant":
            continue
        key = (STAGES[r["stage"]].op, r["arch"], r["shape"], r["tokens"])
        if key not in best or r["median_us"] < best[key]["median_us"]:
            best[key] = r
    entries = []
    for (op, arch, _, _), r in sorted(best.items()):
        entries.append({"op": op, "arch": arch, "shape": _tuned_shape(r, shapes),
                        "config": {f: r[f] for f in tuning.TUNED_OPS[op][1]}, "median_us": r["median_us"]})
    return {"entries": entries}


def merge_tuning(path: Path, table: dict, rows: list[dict] = (), shapes: dict | None = None) -> dict:
    """`table` (this sweep's, from `rows`) plus the entries already in `path`: other stages, arches,
    shapes and token counts accumulate across sweeps. For an (op, arch, shape) swept again: this
    sweep's winner if it also timed the old entry's config (one comparison, on one machine state),
    else the faster of the two timings (a narrower re-sweep, e.g. --tile-n 64 alone, replaced a
    whole sweep's winner; delete the file to start over). Old entries flyquant would refuse (a
    value no kernel takes) are dropped, and said so; a file it cannot read as a table (not JSON,
    malformed) is set aside as <path>.bak (or .bak1, ...) instead of stopping the merge after a
    sweep."""
    if not path.exists():
        return table
    try:
        old = tuning._load_tuning(str(path.resolve()), path.stat().st_mtime).entries
    except env.EnvError as exc:
        backup, n = path.with_name(path.name + ".bak"), 0
        while backup.exists():
            n += 1
            backup = path.with_name(f"{path.name}.bak{n}")
        path.replace(backup)
        print(f"the tuning table {path} was set aside as {backup}: {exc}")
        return table
    medians = {i: e.get("median_us") for i, e in enumerate(json.loads(path.read_text())["entries"])}
    timed = {(_entry_key({"op": STAGES[r["stage"]].op, "arch": r["arch"], "shape": _tuned_shape(r, shapes)}),
              tuple(r[f] for f in tuning.TUNED_OPS[STAGES[r["stage"]].op][1]))
             for r in rows if r.get("impl") == "flyquant"}
    merged = {}
    for i, op, arch, shape, config in old:
        problem = select.tuning_entry_problem(op, shape, config)
        if problem:
            print(f"tuning table {path}: entries[{i}] ({op}, {arch}, {shape}) dropped: {problem}")
            continue
        e = {"op": op, "arch": arch, "shape": shape, "config": config}
        merged[_entry_key(e)] = e | ({"median_us": medians[i]} if medians[i] is not None else {})
    for e in table["entries"]:
        kept = merged.get(_entry_key(e))
        config = tuple(kept["config"].get(f) for f in tuning.TUNED_OPS[e["op"]][1]) if kept else None
        if kept is None or (_entry_key(e), config) in timed or e["median_us"] <= kept.get("median_us", float("inf")):
            merged[_entry_key(e)] = e
    return {"entries": list(merged.values())}


# ---- driver -------------------------------------------------------------------------------------


def _word_or_positive_ints(word: str):
    """An argparse type: "auto,1,4" -> ["auto", 1, 4] for word "auto" (a typo was a ValueError traceback
    mid-sweep, a 0 a negative grid)."""
    return lambda text: common.csv_list(text, lambda v: v if v == word else common.positive_int(v))


def _finite_float(text: str) -> float:
    value = float(text)
    if not math.isfinite(value):  # nan failed in torch.multinomial mid-sweep
        raise ValueError(f"{value} is not finite")
    return value


def parse_args(argv=None):
    ap = argparse.ArgumentParser(
        description=__doc__.split("\n\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter
    )
    ap.add_argument("--stage", type=int, choices=sorted(STAGES), default=2,
                    help="1: gate/up GEMM with the activation fused; 2: down GEMM (default 2)")
    ap.add_argument(
        "--shapes", type=common.csv_list, default=None, help=f"from {sorted(SHAPES)} (default {DEFAULT_SHAPES})"
    )
    ap.add_argument(
        "--tokens",
        type=common.positive_ints,
        default=None,
        help="token counts (default: each shape's list, " + ",".join(map(str, TOKENS)) + ")",
    )
    ap.add_argument(
        "--tile-n", type=common.positive_ints, default=None, help="default: every supported value"
    )
    ap.add_argument(
        "--tile-m", type=_word_or_positive_ints("auto"), default=["auto"], help="auto (the selector's block size) or values"
    )
    ap.add_argument(
        "--k-batch", type=_word_or_positive_ints("sel"), default=None,
        help=f"split-K values or 'sel' (default {K_BATCH_DEFAULT}; stage 1: 1)"
    )
    ap.add_argument(
        "--waves", type=_word_or_positive_ints("auto"), default=None, help=f"waves per workgroup or 'auto' (default {WAVES_DEFAULT})"
    )
    ap.add_argument("--skew", type=_finite_float, default=0.0, help="expert popularity exponent (0: uniform routing)")
    ap.add_argument(
        "--max-workgroups",
        type=common.positive_int,
        default=None,
        help=f"modelled: working workgroups emulated per config, at least one m-tile's (default {MAX_WORKGROUPS})",
    )
    ap.add_argument("--vs", type=common.csv_list, default=[],
                    help=f"peers beside the selector's rows (modelled: emulated; hardware: timed): {','.join(PEERS)}")
    common.add_common_args(ap)
    args = ap.parse_args(argv)
    for peer in args.vs:
        if peer not in PEERS:
            ap.error(f"unknown peer {peer!r}: choose from {sorted(PEERS)}")
    args.shapes = args.shapes or common.csv_list(QUICK_SHAPES if args.quick else DEFAULT_SHAPES)
    for name in args.shapes:
        if name not in SHAPES:
            ap.error(f"unknown shape {name!r}: choose from {sorted(SHAPES)}")
    args.k_batch = args.k_batch or common.csv_list("sel" if args.quick or args.stage == 1 else K_BATCH_DEFAULT)
    args.waves = args.waves or common.csv_list(WAVES_DEFAULT)
    args.max_workgroups = args.max_workgroups or (QUICK_MAX_WORKGROUPS if args.quick else MAX_WORKGROUPS)
    return args


def sweep(args, mode: str, archs: list[str], stage: Stage, device) -> tuple[list, list, list, list, list]:
    """Every (arch, shape, tokens, config) of the stage: a modelled or timed row, or the reason it
    has none. Returns (rows, configs the launcher refused, errors, the selector's plans, peer rows)."""
    rows, skipped, errors, plans, peer_rows = [], [], [], [], []
    weights = {}
    for arch in archs:
        if mode == "modelled":
            emu.enable(arch)  # the selector plans for the emulator's arch
        for name in args.shapes:
            shape = SHAPES[name]
            if name not in weights:
                weights[name] = Weights(stage, shape, args.seed, device)
                if mode == "hardware":
                    weights[name].fill(range(shape.experts))
            w = weights[name]
            for tokens in args.tokens or (QUICK_TOKENS if args.quick and shape.tokens == TOKENS else shape.tokens):
                chosen, plan_text = selector_choice(stage, shape, tokens, device)
                if chosen is None:
                    print(f"  {name} T={tokens} {arch}: no selector choice to mark ({plan_text})")
                plans.append({"arch": arch, "shape": name, "tokens": tokens, "plan": plan_text})
                auto_tile_m = (
                    chosen.tile_m
                    if chosen
                    else fq.moe_block_m(tokens, shape.topk, shape.experts, shape.model_dim, shape.inter_dim, device)
                )
                problems, first = {}, len(rows)
                for cfg in configs_for(stage, shape, args, chosen, auto_tile_m):
                    if cfg.tile_m not in problems:
                        problems[cfg.tile_m] = build_problem(stage, shape, tokens, cfg.tile_m, args.skew, args.seed,
                                                             device)
                    p = problems[cfg.tile_m]
                    try:
                        if mode == "modelled":
                            row = model_config(p, arch, cfg, args.max_workgroups, w)
                        else:
                            row = time_config(p, arch, cfg, w, args)
                    except ValueError as exc:  # the launcher refuses the config (e.g. split-K past the K steps)
                        skipped.append({"shape": name, "tokens": tokens, "arch": arch, **vars(cfg), "reason": str(exc)})
                        continue
                    except Exception as exc:  # a failed launch or check: reported, and the sweep goes on
                        errors.append(
                            {
                                "shape": name,
                                "tokens": tokens,
                                "arch": arch,
                                **vars(cfg),
                                "error": f"{type(exc).__name__}: {exc}",
                            }
                        )
                        print(
                            f"  {name} T={tokens} {arch} {config_label(vars(cfg))}: "
                            f"ERROR {errors[-1]['error']}"
                        )
                        continue
                    row["selected"] = cfg == chosen
                    rows.append(row)
                    print(f"  {name} T={tokens} {arch} {config_label(vars(cfg))}: done", flush=True)
                for peer in args.vs if mode == "modelled" else ():
                    peer_rows.append(PEERS[peer].compare(problems, rows[first:], arch, args.max_workgroups, w))
                    print(f"  {name} T={tokens} {arch} {peer}: {peer_rows[-1]['status']}", flush=True)
                if mode == "hardware":  # sorted with the selector's block size, as the API is called
                    base = problems.get(auto_tile_m) or build_problem(
                        stage, shape, tokens, auto_tile_m, args.skew, args.seed, device
                    )
                    rows += time_baselines(base, arch, w, args)
                    for peer in args.vs:  # the peer's GEMM timed as ours (bench/peers_aiter_gpu.py)
                        r = peers_aiter_gpu.time_stage(base, w, arch, args)
                        rows.append(timing_row(base, arch, r["timing"], r["impl"], {"config": r["config"]})
                                    if "timing" in r else r)

    return rows, skipped, errors, plans, peer_rows


def main(argv=None) -> dict:
    args = parse_args(argv)
    mode, archs = common.resolve_mode(args.mode, args.arch)
    stage = STAGES[args.stage]
    kernel = stage.kernel()  # after the emulator is enabled

    args.tile_n = args.tile_n or list(kernel.TILE_NS)
    for flag, values, allowed in (("--tile-n", args.tile_n, kernel.TILE_NS), ("--tile-m", args.tile_m, kernel.TILE_MS),
                                  ("--waves", args.waves, kernel.WAVE_COUNTS)):
        bad = [v for v in values if isinstance(v, int) and v not in allowed]
        if bad:  # else every config was refused by the launcher and the run ended with an empty table, rc 0
            raise SystemExit(f"{flag} {','.join(map(str, bad))}: the kernel takes {', '.join(map(str, allowed))}")
    device = "cuda" if mode == "hardware" else "cpu"
    label = common.HARDWARE_LABEL if mode == "hardware" else common.MODELLED_LABEL
    print(f"A16W4 MoE stage {stage.number}, tile_n sweep: {label}")
    sources = common.kernel_sources()
    rows, skipped, errors, plans, peer_rows = sweep(args, mode, archs, stage, device)

    print()
    common.print_table(list(_display(rows)), MODELLED_COLUMNS if mode == "modelled" else HARDWARE_COLUMNS)
    if skipped:
        print(
            f"\n{len(skipped)} configs refused by the launcher, e.g. {config_label(skipped[0])}: {skipped[0]['reason']}"
        )
    for e in errors:
        print(
            f"ERROR {e['shape']} T={e['tokens']} {e['arch']} {config_label(e)}: {e['error']}"
        )
    if not any(r.get("impl", "flyquant") == "flyquant" for r in rows):  # modelled rows are ours, unnamed
        errors.append({"error": "no flyquant config was measured"})
        print("ERROR: no flyquant config was measured (nothing to compare, no target evaluated)")
    if mode == "modelled":
        for r in rows:
            r["target_misses"] = target_misses(r)
            if r["target_misses"]:
                print(
                    f"target missed: {r['shape']} T={r['tokens']} {r['arch']} "
                    f"{config_label(r)}: " + "; ".join(r["target_misses"])
                )
        print(
            "\nreduction: 'exact' = every m-tile with work emulated; '~S/W' = S of the W m-tiles with work emulated "
            "(all their n-tiles and k-splits) and scaled by W/S (see the script's docstring)"
        )
        if stage.number == 2:
            print_upstream()
        for peer in args.vs:
            PEERS[peer].print_rows([r for r in peer_rows if r["peer"] == PEERS[peer].NAME])
    changed = common.warn_if_sources_changed(sources)
    stem = f"moe_gemm{stage.number}_tile_n_{mode}"
    environment = common.environment() | {"kernel_sources_changed": changed}
    payload = {
        "mode": mode,
        "label": label,
        "args": vars(args),
        "environment": environment,
        "shapes": {n: SHAPES[n] for n in args.shapes},
        "rows": rows,
        "skipped": skipped,
        "errors": errors,
        "plans": plans,
        "peers": peer_rows,
    }
    if mode == "modelled":
        if stage.number == 2:
            payload["upstream"] = {
                "source": UPSTREAM_SOURCE,
                "per_mfma": [
                    dict(zip(("shape", "tokens", "tile_m", "tile_n"), k), value=v) for k, v in UPSTREAM_PER_MFMA.items()
                ],
                "notes": UPSTREAM_NOTES,
                "targets": TARGETS,
            }
    json_path = common.write_json(args.out / f"{stem}.json", payload)  # first: the sweep is kept whatever follows
    if mode == "hardware":
        for arch in archs:
            path = args.out / f"tuning_{arch}.json"
            mine = [r for r in rows if r["arch"] == arch]
            table = merge_tuning(path, tuning_table(mine, SHAPES), mine, SHAPES)
            path = common.write_json(path, table)
            print(f"tuning table: {path} (use with FLYQUANT_TUNING={path.resolve()})")
    png_path = plot(rows, mode, args.out / f"{stem}.png", [r for r in peer_rows if r.get("status") == "ok"])
    print(f"\nwrote {json_path} and {png_path}")
    return payload


if __name__ == "__main__":
    sys.exit(1 if main()["errors"] else 0)
