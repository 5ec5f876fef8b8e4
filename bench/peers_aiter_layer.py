"""aiter's Triton MXFP4 MoE layer beside our fq.fused_moe row (`bench/moe_layer.py --vs aiter`).

aiter's Triton path for one layer, as its MXFP4 MoE callers run it: moe_align_block_size (its 4
Triton launches) once, with the BLOCK_SIZE_M of the config aiter's get_optimal_moe_config picks at
the token count, then stage 1 (`_fused_moe_kernel_mxfp4_silu`: x (T, model_dim) -> a2
(T * topk, inter_dim), silu(g) * u) and stage 2 (`_fused_moe_kernel_mxfp4`, top_k = 1: a2 ->
(T, topk, model_dim), routing weight multiplied) with that config and those aligned arrays, then
the top-k sum, which aiter leaves to a torch op (`.sum(dim=1)`): aiter has no kernel of its own
for it, so it is done here by torch, not counted, and its compulsory bytes are given
(`topk_sum_bytes`). The loading, arguments, grids and per-stage reduction are
bench/peers_aiter_moe.py's; this module chains the stages.

Same inputs as our layer row: x, topk_ids and topk_weights. Weights: random MXFP4 bytes and E8M0
codes at the true sizes, drawn per expert (moe_problem.Weights.dense; the instruction stream does
not depend on their values), not our row's shuffled bytes. aiter has no MXFP4 kernel with
GPT-OSS's clamped swiglu or biases: on those shapes its layer computes silu(g) * u without bias,
and the row says so.

Reduction: the same m-blocks (a systematic sample by fill, sized so the wider stage's workgroups
fit --max-workgroups) run in both stages, so stage 2 reads the a2 rows stage 1 wrote; each stage is
scaled to its blocks with work and idle workgroups (peers_aiter_moe.run_stage).

Check: every routed row (t, slot) that ran, against float64 from x: route * W2 @ act(W1 x) with
act the exact silu(g) * u, within stage 2's bound on the a2 it read plus |route| |W2| @ (stage 1's
bound on that row) (the error stage 1 leaves in a2, carried through stage 2); tokens with all
their top-k rows run also have the bf16 top-k sum checked (sum of the bounds, plus one bf16
rounding).
"""

from __future__ import annotations

import dataclasses

import torch

import common
import flyquant.emu as emu
import peers
import peers_aiter_moe as pam
from flyquant import reference
from moe_problem import BF16_BYTES, STAGES, MoeShape, Problem, Weights

NAME = pam.NAME
TOPK_SUM = "top-k sum: a torch op after stage 2 (aiter has no kernel for it), not counted"


def moe_shape(layer) -> MoeShape:
    """moe_layer.LayerShape as the stage code takes it, at the true sizes (no padding)."""
    return MoeShape(layer.name, layer.model_dim, layer.inter_dim, layer.experts, layer.topk, layer.model_dim,
                    layer.inter_dim, layer.activation, layer.biases)


def topk_sum_bytes(tokens: int, s: MoeShape) -> int:
    """The least traffic of the top-k sum: read stage 2's (T, topk, model_dim) bf16, write (T, model_dim)."""
    return tokens * (s.topk + 1) * s.model_dim * BF16_BYTES


def check(p1: Problem, pw1, p2: Problem, pw2, out2: torch.Tensor, kept_ids: torch.Tensor) -> dict:
    """The routed rows that ran and the complete tokens' top-k sums against float64 (module docstring)."""
    s, numel = p1.shape, p1.topk_ids.numel()
    rows = sorted(kept_ids[kept_ids < numel].tolist())
    exact, bound = {}, {}
    for r in rows:
        t, slot = divmod(r, s.topk)
        act, act_bound = pam.tolerance(p1, pw1, r)
        _, out_bound = pam.tolerance(p2, pw2, r)
        w2 = reference.dequantize_mxfp4(pw2.w[int(p1.topk_ids[t, slot])], pw2.scale[int(p1.topk_ids[t, slot])]).double()
        route = float(p1.topk_weights[t, slot])
        exact[r] = route * (w2 @ act)
        bound[r] = out_bound + abs(route) * (w2.abs() @ act_bound)
    ratios = [float(((out2[r].double() - exact[r]).abs() / bound[r]).max()) for r in rows]
    done = [t for t in range(p1.tokens) if all(t * s.topk + k in exact for k in range(s.topk))]
    summed = out2.view(p1.tokens, s.topk, -1).sum(dim=1)  # aiter's callers' op, in bf16
    sum_ratios = []
    for t in done:
        want = sum(exact[t * s.topk + k] for k in range(s.topk))
        err = sum(bound[t * s.topk + k] for k in range(s.topk))
        sum_ratios.append(float(((summed[t].double() - want).abs() / (pam.U_BF16 * (want.abs() + err) + err)).max()))
    worst = max(ratios + sum_ratios, default=0.0)
    return {"rows_checked": len(rows), "tokens_summed": len(done),
            "rows_outside_tolerance": sum(x > 1 for x in ratios + sum_ratios), "max_err_over_tol": worst}


def layer_row(layer, t: dict, arch: str, max_workgroups: int, seed: int, ours: dict) -> dict:
    """aiter's Triton layer on our row's x and routing, counted as our row (`ours`: launches,
    wave_instructions, global_bytes, compulsory_bytes)."""
    s = moe_shape(layer)
    ids, tokens = t["topk_ids"].to(torch.int32), t["x"].shape[0]
    numel = ids.numel()
    cfg = pam.aiter_config(arch, tokens)
    bm = cfg["BLOCK_SIZE_M"]
    sorted_ids, expert_ids, post_padded, align_counts = pam.align(ids, s.experts, bm, arch)
    p1 = Problem(STAGES[1], s, tokens, bm, (), emu.aligned(t["x"].contiguous()), None, None,
                 int(ids.unique().numel()), ids, t["topk_weights"].float())
    pw1, pw2 = (pam.PeerWeights(Weights(STAGES[n], s, seed, "cpu")) for n in (1, 2))
    n_tiles = max(peers.ceil_div(pw.n, cfg["BLOCK_SIZE_N"]) for pw in (pw1, pw2))
    n_work, keep = pam.sample_blocks(sorted_ids, post_padded, bm, numel, n_tiles, max_workgroups)
    a2 = emu.aligned(torch.zeros(numel, s.inter_dim, dtype=torch.bfloat16))
    out2 = emu.aligned(torch.zeros(numel, s.model_dim, dtype=torch.bfloat16))
    aligned = (sorted_ids, expert_ids)
    c1, k1, kept_ids, wg1, _ = pam.run_stage(p1, pw1, arch, cfg, aligned, n_work, keep, a2)
    p2 = dataclasses.replace(p1, stage=STAGES[2], a=a2)
    c2, k2, _, wg2, _ = pam.run_stage(p2, pw2, arch, cfg, aligned, n_work, keep, out2)
    total = common.Counts.combine([(1.0, align_counts), (1.0, c1), (1.0, c2)])
    glob = total.mem(common.GLOBAL_CLASSES)
    ratio = ours["wave_instructions"] / total.wave_instructions
    notes = [TOPK_SUM, pam.notes(p1)[0], "a2 in bf16"]
    if s.activation != "silu" or s.bias:
        notes.append(f"no MXFP4 kernel with {s.activation}{' + bias' if s.bias else ''}: silu(g)*u without bias")
    res1, res2 = peers.resources(k1), peers.resources(k2)
    return {
        "peer": NAME, "shape": s.name, "tokens": tokens, "arch": arch, "config": pam.config_label(cfg),
        "reduction": "exact" if len(keep) == n_work else f"~{len(keep)}/{n_work} blocks",
        "launches": 6, "launches_counted": 6, "flyquant_launches": ours["launches"],
        "wg_launched": wg1 + wg2, "vgprs": f"{res1.vgprs}/{res2.vgprs}", "spills": res1.spills + res2.spills,
        "align_wave_instr": align_counts.wave_instructions, "stage1_wave_instr": c1.wave_instructions,
        "stage2_wave_instr": c2.wave_instructions, "wave_instr": total.wave_instructions,
        "flyquant_wave_instr": ours["wave_instructions"], "peer_vs_flyquant": 1 / ratio, "flyquant_vs_peer": ratio,
        "global_bytes": glob.bytes, "compulsory_bytes": ours["compulsory_bytes"],
        "traffic_vs_compulsory": glob.bytes / ours["compulsory_bytes"],
        "flyquant_traffic_vs_compulsory": ours["global_bytes"] / ours["compulsory_bytes"],
        "topk_sum_compulsory_bytes": topk_sum_bytes(tokens, s), "notes": notes, "counts": total.to_json(),
        "status": "ok",
    } | check(p1, pw1, p2, pw2, out2, kept_ids)


def compare(layer, t: dict, arch: str, max_workgroups: int, seed: int, ours: dict) -> dict:
    """layer_row, or the reason there is none (status), never a number in its place."""
    head = {"peer": NAME, "shape": layer.name, "tokens": t["x"].shape[0], "arch": arch}
    missing = peers.triton_missing()
    if missing:
        return head | {"status": missing}
    try:
        return layer_row(layer, t, arch, max_workgroups, seed, ours)
    except Exception as exc:  # reported in the output; our rows and the other cases go on
        return head | {"status": f"error: {type(exc).__name__}: {exc}"}


COLUMNS = [
    ("shape", "shape"), ("tokens", "T"), ("arch", "arch"), ("config", "aiter config"), ("reduction", "reduction"),
    ("launches", "launches"), ("flyquant_launches", "flyquant launches"), ("align_wave_instr", "align instr"),
    ("stage1_wave_instr", "stage 1 instr"), ("stage2_wave_instr", "stage 2 instr"), ("wave_instr", "aiter instr"),
    ("flyquant_wave_instr", "flyquant instr"), ("peer_vs_flyquant", "peer/flyquant"),
    ("traffic_vs_compulsory", "traffic/min"), ("flyquant_traffic_vs_compulsory", "flyquant traffic/min"),
    ("vgprs", "VGPR s1/s2"), ("spills", "spill"), ("max_err_over_tol", "err/tol"),
]


def print_rows(rows: list[dict]) -> None:
    pam.print_rows(rows, f"{NAME} MXFP4 MoE layer under flyquant.emu (modelled, not timed; same x and routing as the "
                   "flyquant rows; align + stage 1 + stage 2, the top-k sum not counted):", COLUMNS)
