"""aiter's Triton MXFP4 MoE GEMMs beside our A16W4 rows (`bench/moe_tile_n.py --vs aiter`).

The kernels (amd-aiter 0.1.7, aiter/ops/triton/_triton_kernels/): stage 1 is
`_fused_moe_kernel_mxfp4_silu` (moe_op_mxfp4_silu_fused.py: gate and up columns interleaved in one
N tile, silu(g) * u fused, output (T * topk, inter_dim)), stage 2 `_fused_moe_kernel_mxfp4`
(moe_op_mxfp4.py: output (T, topk, model_dim) with the routing weight multiplied; the top-k sum is
a separate torch op, not counted). Both take A in bf16 and the expert weights as plain MXFP4
(E, N, K/2) bytes with (E, N, K/32) E8M0 scales (no shuffle), and compute
`tl.dot_scaled(a, None, "bf16", b, b_scales, "e2m1")`: Triton upcasts the FP4 weights to bf16 in
registers and runs the bf16 MFMA (16x16x32 on gfx950, 16x16x16 on gfx942), as our kernels do, so
useful MFMAs are counted the same way (moe_problem.useful_mfmas). aiter has no MXFP4 kernel with
GPT-OSS's clamped swiglu or a bias: on those shapes its stage-1 row computes silu(g) * u without
bias (the same main loop, a cheaper epilogue), and says so.

They are loaded by path without `import aiter` (which needs ROCm): aiter/ops/triton is given a
package of its own name (`PACKAGE`) whose subpackages point at aiter's directories without running
their __init__ files, so the kernels' relative imports (pid_grid, remap_xcd, _silu_exp2, ...)
resolve to aiter's files. The launch arguments are those of aiter's wrappers fused_moe_mxfp4 and
fused_moe_mxfp4_silu (moe_op_mxfp4*.py: the small-batch EM bound, the grid, the strides), the
configuration aiter's own get_optimal_moe_config(bf16, use_mxfp4=True, M=tokens) returns for the
arch (configs/moe/MI350X-MOE-MX_FP4.json on gfx950; MI300X has no MX_FP4 file, so aiter falls back
to its default 256x256x64 config there; aiter's arch_info.is_fp4_avail() is gfx950 only).

Routing: the same top-k ids and weights as our row, aligned by aiter's own Triton
moe_align_block_size (its four stage kernels, launched as its wrapper moe_align_block_size_triton
does, run under flyquant.emu): every expert padded to BLOCK_SIZE_M rows, sorted ids t * topk + slot,
padding id T * topk. Weights: the same dense FP4 bytes and E8M0 codes as our row's (before aiter's
A16W4 shuffles, moe_problem.Weights.dense), at their true sizes (GPT-OSS's 2880, not the 3072 the
CK shuffle needs), A the true columns of our row's activations.

Reduction, as for our rows: when the m-blocks with work need more than max_workgroups workgroups
(cdiv(N, BLOCK_SIZE_N) each), a systematic sample of S of the W blocks (by fill) runs alone (the
aligned arrays gathered to those blocks, num_tokens_post_padded = S * BLOCK_SIZE_M) and is scaled
by W / S; the launch's other workgroups (pid past the m-blocks in use: the grid is sized by the
wrapper's EM bound) exit at the kernel's first check and are costed from a launch without work.
Each sampled routed row is checked against float64 recomputation from the dequantized weights
within a bound derived from bf16 output rounding and K (`tolerance`).
"""

from __future__ import annotations

import importlib
import importlib.util
import sys
import types
from pathlib import Path

import torch

import common
import flyquant.emu as emu
import peers
from flyquant import reference
from moe_problem import FP4_PER_BYTE, MX_BLOCK, Problem, Weights, systematic_sample

NAME = "aiter triton"
PACKAGE = "_aiter_ops_triton"  # aiter/ops/triton under a name of its own (module docstring)
_SUBPACKAGES = ("utils", "utils/_triton", "_triton_kernels")
KERNELS = {  # stage -> (file in _triton_kernels, kernel)
    1: ("moe_op_mxfp4_silu_fused", "_fused_moe_kernel_mxfp4_silu"),
    2: ("moe_op_mxfp4", "_fused_moe_kernel_mxfp4"),
}
ALIGN = "moe_align_block_size"
LAUNCH_OPTIONS = ("waves_per_eu", "matrix_instr_nonkdim", "kpack")  # aiter's config keys Triton takes as options
NUM_XCDS = 8  # aiter's get_num_xcds(): MI300 and MI35x
TRITON_DEFAULT_WARPS, TRITON_DEFAULT_STAGES = 4, 2  # a launch without options (the alignment kernels)
TARGET = 0.5  # issue 20: our wave-instructions per useful MFMA at most 0.5x aiter Triton's
U_BF16, U_F32 = 2.0**-8, 2.0**-24  # unit roundoffs
SILU_DERIV = 1.1  # max |silu'(g)| (1.0998 at g ~ 2.4)
ACT_ERR = 2.0**-20  # silu from v_exp_f32 and an f32 division, relative to (|g| + 1)(|u| + 1) (|g| < 100 here)
_root = None


def _module(name: str):
    """aiter/ops/triton/<name>.py ('/'-separated) imported inside PACKAGE."""
    global _root
    if _root is None:
        spec = importlib.util.find_spec("aiter")
        if spec is None or not spec.submodule_search_locations:
            raise ImportError("aiter (amd-aiter) is not installed")
        _root = Path(spec.submodule_search_locations[0]) / "ops" / "triton"
        for sub in ("", *_SUBPACKAGES):
            package = types.ModuleType(".".join([PACKAGE, *sub.split("/")]) if sub else PACKAGE)
            package.__path__ = [str(_root / sub)]
            sys.modules.setdefault(package.__name__, package)
    return importlib.import_module(f"{PACKAGE}.{name.replace('/', '.')}")


def aiter_config(arch: str, tokens: int) -> dict:
    """The configuration aiter's get_optimal_moe_config picks for MXFP4 on `arch` at `tokens`."""
    utils = _module("utils/moe_config_utils")
    with peers._compiling_for(arch):  # aiter reads the arch from Triton's active driver
        utils.get_moe_configs.cache_clear()  # cached by dtype only, not by arch
        return dict(utils.get_optimal_moe_config(torch.bfloat16, use_mxfp4=True, M=tokens))


def config_label(cfg: dict) -> str:
    return (f"{cfg['BLOCK_SIZE_M']}x{cfg['BLOCK_SIZE_N']}x{cfg['BLOCK_SIZE_K']} g{cfg['GROUP_SIZE_M']} "
            f"w{cfg['num_warps']} s{cfg['num_stages']}")


def align_launches(ids: torch.Tensor, experts: int, block: int):
    """aiter's moe_align_block_size_triton on topk ids (T, topk) int32, as its wrapper launches it:
    ((sorted_token_ids, expert_ids, num_tokens_post_padded), [(kernel, grid, args)] of its 4
    stage kernels), the buffers on ids' device."""
    kernels = _module(f"_triton_kernels/{ALIGN}")
    numel, dev = ids.numel(), ids.device
    max_padded = numel + experts * (block - 1)  # the callers' allocation (vLLM's): padding for every expert
    sorted_ids = emu.aligned(torch.full((max_padded,), numel, dtype=torch.int32, device=dev))
    expert_ids = emu.aligned(torch.full((peers.ceil_div(max_padded, block),), -1, dtype=torch.int32, device=dev))
    post_padded = emu.aligned(torch.zeros(1, dtype=torch.int32, device=dev))
    counts = emu.aligned(torch.zeros(experts + 1, experts, dtype=torch.int32, device=dev))
    cumsum = emu.aligned(torch.zeros(experts + 1, dtype=torch.int32, device=dev))
    flat = emu.aligned(ids.flatten().to(torch.int32))
    per_thread = peers.ceil_div(numel, experts)
    both = dict(num_experts=experts, tokens_cnts_ptr=counts)
    launches = (
        (1, (experts,), dict(topk_ids_ptr=flat, numel=numel, tokens_per_thread=per_thread)),
        (2, (experts,), {}),
        (3, (1,), dict(total_tokens_post_pad_ptr=post_padded, cumsum_ptr=cumsum, block_size=block)),
        (4, (experts,), dict(topk_ids_ptr=flat, sorted_token_ids_ptr=sorted_ids, expert_ids_ptr=expert_ids,
                             cumsum_ptr=cumsum, block_size=block, numel=numel, tokens_per_thread=per_thread)),
    )
    out = []
    for stage, grid, args in launches:
        fn = getattr(kernels, f"_moe_align_block_size_stage{stage}_kernel")
        out.append((fn, grid, {k: v for k, v in (both | args).items() if k in fn.arg_names}))
    return (sorted_ids, expert_ids, post_padded), out


def align(ids: torch.Tensor, experts: int, block: int, arch: str):
    """align_launches run under flyquant.emu: (sorted_token_ids, expert_ids, num_tokens_post_padded,
    common.Counts of its 4 launches)."""
    buffers, launches = align_launches(ids, experts, block)
    counts = []
    for fn, grid, args in launches:
        kernel = peers.compile_kernel(fn, arch, args, TRITON_DEFAULT_WARPS, TRITON_DEFAULT_STAGES)
        counts.append((1.0, common.Counts.of(peers.run_kernel(kernel, grid, args))))
    return *buffers, common.Counts.combine(counts)


class PeerWeights:
    """One stage's weights as aiter's Triton kernels take them, at the true sizes: FP4 bytes
    (E, N, K/2) and E8M0 codes (E, N, K/32), filled on demand from moe_problem.Weights.dense (stage
    1: gate rows then up rows, each inter_dim long)."""

    def __init__(self, ours: Weights):
        self.ours, s, st = ours, ours.shape, ours.stage
        self.n, self.k = st.n(s), st.k(s)
        self.w = emu.aligned_empty((s.experts, self.n, self.k // FP4_PER_BYTE), torch.uint8, ours.device)
        self.scale = emu.aligned_empty((s.experts, self.n, self.k // MX_BLOCK), torch.uint8, ours.device)
        self.filled: set[int] = set()

    def rows(self) -> torch.Tensor:
        """The rows of the padded layout (Stage.weight_shape) that hold the N true rows."""
        s, st = self.ours.shape, self.ours.stage
        if st.number == 1:
            return torch.cat([torch.arange(s.inter_dim), s.w_k + torch.arange(s.inter_dim)])
        return torch.arange(s.model_dim)

    def fill(self, experts) -> "PeerWeights":
        rows = self.rows().to(self.ours.device)
        for e in sorted(set(experts) - self.filled):
            packed, codes = self.ours.dense(e)
            self.w[e] = packed[0, rows, : self.k // FP4_PER_BYTE]
            self.scale[e] = codes[rows, : self.k // MX_BLOCK]
            self.filled.add(e)
        return self


def _gemm_args(p: Problem, pw: PeerWeights, cfg: dict, a, c, sorted_ids, expert_ids, post_padded) -> dict:
    """The kernel's arguments as aiter's wrapper passes them, constexprs and heuristics included."""
    s, stage = p.shape, p.stage.number
    topk = s.topk if stage == 1 else 1  # stage 2 reads a2 row by row: top_k=1 (as vLLM's second GEMM)
    args = dict(
        a_ptr=a, b_ptr=pw.w, c_ptr=c, a_scale_ptr=emu.aligned(torch.ones(1, device=a.device)),
        b_scale_ptr=emu.aligned(torch.ones(s.experts, device=a.device)), a_mx_scale_ptr=None, b_mx_scale_ptr=pw.scale,
        topk_weights_ptr=emu.aligned(p.topk_weights.float().to(a.device)), sorted_token_ids_ptr=sorted_ids,
        expert_ids_ptr=expert_ids, num_tokens_post_padded_ptr=post_padded, N=pw.n, K=pw.k,
        num_valid_tokens=p.topk_ids.numel(), stride_am=a.stride(0), stride_ak=a.stride(1),
        stride_be=pw.w.stride(0), stride_bk=pw.w.stride(2), stride_bn=pw.w.stride(1),
        stride_cm=c.stride(0), stride_cn=c.stride(1), stride_amxm=None, stride_amxk=None,
        stride_bmxe=pw.scale.stride(0), stride_bmxk=pw.scale.stride(2), stride_bmxn=pw.scale.stride(1),
        A_DTYPE_FORMAT="bf16", B_DTYPE_FORMAT="e2m1", MUL_ROUTED_WEIGHT=stage == 2, top_k=topk,
        compute_type=_module("_triton_kernels/" + KERNELS[stage][0]).tl.bfloat16,
        SWIZZLE_MX_A=False, SWIZZLE_MX_B=False,
        **{k: v for k, v in cfg.items() if k.isupper()},
    )
    if stage == 2:
        args["NUM_XCDS"] = NUM_XCDS
    return args


def gemm_launch(p: Problem, pw: PeerWeights, cfg: dict, sorted_ids, expert_ids, post_padded, out):
    """The stage's kernel as aiter's wrapper launches it on the given aligned arrays: (kernel without
    its heuristics, grid, arguments with the heuristics' values, launch options)."""
    stage = p.stage.number
    heuristics = getattr(_module("_triton_kernels/" + KERNELS[stage][0]), KERNELS[stage][1])
    a = p.a[:, : pw.k]  # the true columns: a view, strides as the wrapper passes them
    args = _gemm_args(p, pw, cfg, a, out, sorted_ids, expert_ids, post_padded)
    for name, rule in heuristics.values.items():
        args[name] = rule(args)
    options = {k: cfg[k] for k in LAUNCH_OPTIONS} | {"num_warps": cfg["num_warps"], "num_stages": cfg["num_stages"]}
    return heuristics.fn, (grid_size(p, pw, cfg, sorted_ids.numel()),), args, options


def _launch(p: Problem, pw: PeerWeights, arch: str, cfg: dict, sorted_ids, expert_ids, blocks: int, out):
    """Compile (Triton caches it per specialization) and run under flyquant.emu the stage's kernel
    with `blocks` m-blocks of the given aligned arrays in use (num_tokens_post_padded), on the grid
    the wrapper sizes for those arrays; returns (Counts, the compiled kernel)."""
    post_padded = emu.aligned(torch.tensor([blocks * cfg["BLOCK_SIZE_M"]], dtype=torch.int32))
    fn, grid, args, options = gemm_launch(p, pw, cfg, sorted_ids, expert_ids, post_padded, out)
    warps, stages = options.pop("num_warps"), options.pop("num_stages")
    kernel = peers.compile_kernel(fn, arch, args | options, warps, stages)
    return common.Counts.of(peers.run_kernel(kernel, grid, args), {"w": pw.w}), kernel


def grid_size(p: Problem, pw: PeerWeights, cfg: dict, sorted_len: int) -> int:
    """Workgroups aiter's wrapper launches: cdiv(EM, BLOCK_SIZE_M) * cdiv(N, BLOCK_SIZE_N), EM bounded
    by rows * top_k * BLOCK_SIZE_M when A has fewer rows than a block (its small-batch bound)."""
    bm = cfg["BLOCK_SIZE_M"]
    rows, topk = (p.tokens, p.shape.topk) if p.stage.number == 1 else (p.tokens * p.shape.topk, 1)
    em = min(sorted_len, rows * topk * bm) if rows < bm else sorted_len
    return peers.ceil_div(em, bm) * peers.ceil_div(pw.n, cfg["BLOCK_SIZE_N"])


def tolerance(p: Problem, pw: PeerWeights, row: int):
    """(exact float64, bound) for the output row of routed pair `row` (= t * topk + slot): FP32 sums
    of K exact products within (K + 1) 2^-24 sum|a||w| (stage 2: one more rounding for the routing
    weight); stage 1 rounds g and u to bf16 before the activation (the kernel's
    `accumulator.to(compute_type)` ahead of the split), so dg and du each gain 2^-8 (|g| + dg), and
    silu(g) * u moves by SILU_DERIV |u| dg + (|g| + 1) du plus ACT_ERR; one bf16 rounding (2^-8
    relative) of the result."""
    s, t, slot = p.shape, row // p.shape.topk, row % p.shape.topk
    e = int(p.topk_ids[t, slot])
    w = reference.dequantize_mxfp4(pw.w[e], pw.scale[e]).double()
    if p.stage.number == 2:
        a = p.a[row, : pw.k].double()
        route = float(p.topk_weights[t, slot])
        exact = route * (w @ a)
        err = (pw.k + 2) * U_F32 * abs(route) * (w.abs() @ a.abs())
        return exact, U_BF16 * exact.abs() + (1 + U_BF16) * err
    x = p.a[t, : pw.k].double()
    g, u = w[: s.inter_dim] @ x, w[s.inter_dim :] @ x
    dg, du = ((pw.k + 1) * U_F32 * (half.abs() @ x.abs()) for half in (w[: s.inter_dim], w[s.inter_dim :]))
    dg, du = dg + U_BF16 * (g.abs() + dg), du + U_BF16 * (u.abs() + du)
    exact = g * torch.sigmoid(g) * u
    prop = SILU_DERIV * u.abs() * dg + (g.abs() + 1) * du + ACT_ERR * (g.abs() + 1) * (u.abs() + 1)
    return exact, U_BF16 * exact.abs() + (1 + U_BF16) * prop


def check(p: Problem, pw: PeerWeights, out: torch.Tensor, sorted_ids: torch.Tensor, numel: int) -> dict:
    """The routed rows the sampled launch computed, against `tolerance`: rows checked, how many are
    outside their bound, and the largest |error| / bound."""
    rows = sorted_ids[sorted_ids < numel].tolist()
    worst, bad = 0.0, 0
    for r in rows:
        exact, bound = tolerance(p, pw, r)
        ratio = float(((out[r].double() - exact).abs() / bound).max())
        worst, bad = max(worst, ratio), bad + (ratio > 1)
    return {"rows_checked": len(rows), "rows_outside_tolerance": bad, "max_err_over_tol": worst}


def notes(p: Problem) -> list[str]:
    s = p.shape
    out = ["A bf16 x MXFP4 weights via dot_scaled: FP4 upcast to bf16, bf16 MFMA"]
    if p.stage.number == 1:
        out.append("g and u rounded to bf16 before silu(g)*u")
    if p.stage.number == 1 and (s.activation != "silu" or s.bias):
        out.append(f"no MXFP4 kernel with {s.activation}{' + bias' if s.bias else ''}: silu(g)*u without bias")
    if p.stage.number == 2:
        out.append("writes (T, topk, N); the top-k sum is a separate op (not counted)")
    return out


def sample_blocks(sorted_ids: torch.Tensor, post_padded: torch.Tensor, bm: int, numel: int, n_tiles: int,
                  max_workgroups: int) -> tuple[int, torch.Tensor]:
    """(W, the sampled m-blocks): the W m-blocks with work and a systematic sample of them by fill,
    as many as max_workgroups allows at n_tiles workgroups each (at least one)."""
    n_work = int(post_padded[0]) // bm
    fill = (sorted_ids[: n_work * bm].view(n_work, bm) < numel).sum(dim=1)
    sampled = max(1, min(n_work, max_workgroups // n_tiles))
    return n_work, systematic_sample(torch.arange(n_work), fill, sampled)


def run_stage(p: Problem, pw: PeerWeights, arch: str, cfg: dict, aligned: tuple, n_work: int, keep: torch.Tensor,
              out: torch.Tensor):
    """The stage's kernel on the m-blocks `keep` of the aligned (sorted_ids, expert_ids), scaled to
    the n_work blocks with work plus the launch's idle workgroups (module docstring); writes the
    kept routed rows of `out`. Returns (Counts, the compiled kernel, the kept sorted ids,
    workgroups launched, workgroups with work)."""
    s, bm = p.shape, cfg["BLOCK_SIZE_M"]
    sorted_ids, expert_ids = aligned
    n_tiles = peers.ceil_div(pw.n, cfg["BLOCK_SIZE_N"])
    sampled = len(keep)
    rows = (keep[:, None] * bm + torch.arange(bm)).flatten()
    kept_ids, kept_experts = emu.aligned(sorted_ids[rows]), emu.aligned(expert_ids[keep])
    pw.fill(kept_experts.tolist())
    work, kernel = _launch(p, pw, arch, cfg, kept_ids, kept_experts, sampled, out)
    idle, _ = _launch(p, pw, arch, cfg, kept_ids, kept_experts, 0, out)
    if work.workgroups_working != sampled * n_tiles or idle.workgroups_working:
        raise RuntimeError(f"aiter triton {s.name} T={p.tokens}: {work.workgroups_working:.0f} workgroups stored, "
                           f"expected {sampled * n_tiles}; a launch without work stored {idle.workgroups_working:.0f}")
    launched = grid_size(p, pw, cfg, sorted_ids.numel())
    per_idle = idle.scaled(1.0 / idle.workgroups_launched)
    working = n_work * n_tiles
    work_only = common.Counts.combine([(1.0, work), (-(work.workgroups_launched - sampled * n_tiles), per_idle)])
    total = common.Counts.combine([(n_work / sampled, work_only), (launched - working, per_idle)])
    return total, kernel, kept_ids, launched, working


def peer_row(p: Problem, ours: Weights, arch: str, max_workgroups: int, flyquant_row: dict) -> dict:
    """aiter's Triton GEMM for our row's problem, counted as our rows are (module docstring)."""
    s = p.shape
    cfg = aiter_config(arch, p.tokens)
    bm = cfg["BLOCK_SIZE_M"]
    sorted_ids, expert_ids, post_padded, align_counts = align(p.topk_ids, s.experts, bm, arch)
    pw = PeerWeights(ours)
    numel = p.topk_ids.numel()
    n_tiles = peers.ceil_div(pw.n, cfg["BLOCK_SIZE_N"])
    n_work, keep = sample_blocks(sorted_ids, post_padded, bm, numel, n_tiles, max_workgroups)
    out_cols = s.inter_dim if p.stage.number == 1 else pw.n  # row t * topk + slot, as aiter's wrappers' C
    out = emu.aligned(torch.zeros(numel, out_cols, dtype=torch.bfloat16))
    total, kernel, kept_ids, launched, working = run_stage(p, pw, arch, cfg, (sorted_ids, expert_ids), n_work, keep,
                                                           out)
    sampled = len(keep)
    res = peers.resources(kernel)
    glob = total.mem(common.GLOBAL_CLASSES)
    useful = flyquant_row["mfma_useful"]
    per_useful = total.wave_instructions / useful
    ratio = flyquant_row["instr_per_useful_mfma"] / per_useful
    return {
        "peer": NAME, "stage": p.stage.number, "shape": s.name, "tokens": p.tokens, "arch": arch,
        "config": config_label(cfg), "flyquant_config": f"{flyquant_row['tile_m']}x{flyquant_row['tile_n']} "
        f"kb{flyquant_row['k_batch']} {flyquant_row['waves']}w{' (selector)' if flyquant_row.get('selected') else ''}",
        "reduction": "exact" if sampled == n_work else f"~{sampled}/{n_work} blocks",
        "wg_launched": launched, "wg_working": working,
        "vgprs": res.vgprs, "agprs": res.agprs, "lds_bytes": res.lds_bytes, "spills": res.spills,
        "scratch_bytes": res.scratch_bytes, "workgroups_per_cu": res.workgroups_per_cu,
        "wave_instr": total.wave_instructions, "mfma": total.cls("mfma"), "mfma_useful": useful,
        "instr_per_useful_mfma": per_useful, "flyquant_instr_per_useful_mfma": flyquant_row["instr_per_useful_mfma"],
        "peer_vs_flyquant": 1 / ratio, "flyquant_vs_peer": ratio,
        "target_miss": None if ratio <= TARGET else f"flyquant/peer {ratio:.2f}: {ratio / TARGET:.2f}x the {TARGET} target",
        "coalescing_loads": common.coalescing(total.mem("vmem_load")),
        "coalescing_w_loads": common.coalescing(total.by_tensor["w"]),
        "global_bytes": glob.bytes, "compulsory_bytes": flyquant_row["compulsory_bytes"],
        "traffic_vs_compulsory": glob.bytes / flyquant_row["compulsory_bytes"],
        "flyquant_traffic_vs_compulsory": flyquant_row["traffic_vs_compulsory"],
        "align_wave_instr": align_counts.wave_instructions, "notes": notes(p), "counts": total.to_json(), "status": "ok",
    } | check(p, pw, out, kept_ids, numel)


def compare(problems: dict, ours: list[dict], arch: str, max_workgroups: int, weights: Weights) -> dict:
    """The peer's row beside one of our rows for a (shape, tokens): the selector's config, else our
    config with the fewest wave-instructions per useful MFMA; `problems` by tile_m. Failures are
    reported in the row (status), never replaced by a number."""
    head = {"peer": NAME, "arch": arch}
    if not ours:
        return head | {"status": "no flyquant row to compare with"}
    mine = next((r for r in ours if r.get("selected")), None) or min(ours, key=lambda r: r["instr_per_useful_mfma"])
    p = problems[mine["tile_m"]]
    head |= {"stage": p.stage.number, "shape": p.shape.name, "tokens": p.tokens}
    missing = peers.triton_missing()
    if missing:
        return head | {"status": missing}
    try:
        return peer_row(p, weights, arch, max_workgroups, mine)
    except Exception as exc:  # reported in the output; our rows and the other cases go on
        return head | {"status": f"error: {type(exc).__name__}: {exc}"}


COLUMNS = [
    ("stage", "stage"),
    ("shape", "shape"),
    ("tokens", "T"),
    ("arch", "arch"),
    ("config", "aiter config"),
    ("flyquant_config", "flyquant config"),
    ("reduction", "reduction"),
    ("wg_launched", "WG"),
    ("wg_working", "working"),
    ("instr_per_useful_mfma", "aiter /useful"),
    ("flyquant_instr_per_useful_mfma", "flyquant /useful"),
    ("peer_vs_flyquant", "peer/flyquant"),
    ("coalescing_w_loads", "coal w ld"),
    ("coalescing_loads", "coal ld"),
    ("traffic_vs_compulsory", "traffic/min"),
    ("flyquant_traffic_vs_compulsory", "flyquant traffic/min"),
    ("vgprs", "VGPR"),
    ("lds_bytes", "LDS B"),
    ("spills", "spill"),
    ("workgroups_per_cu", "WG/CU"),
    ("max_err_over_tol", "err/tol"),
]


TITLE = (f"{NAME} MXFP4 MoE GEMM under flyquant.emu (modelled, not timed; same routing, weights and activations "
         "as the flyquant rows; per useful MFMA as ours):")


def print_rows(rows: list[dict], title: str = TITLE, columns=COLUMNS) -> None:
    """The peer's table (stage rows, or peers_aiter_layer's layer rows), then its failures, outputs
    outside tolerance, missed targets and notes."""
    print("\n" + title)
    common.print_table([r for r in rows if r.get("status") == "ok"], columns)
    for r in rows:
        where = f"{r.get('shape')} T={r.get('tokens')} {r['arch']}"
        if r.get("status") != "ok":
            print(f"peer {r['peer']} on {where}: {r['status']}")
            continue
        if r["rows_outside_tolerance"]:
            checked = r["rows_checked"] + r.get("tokens_summed", 0)  # the layer's top-k sums too
            print(f"peer output outside tolerance: {where}: {r['rows_outside_tolerance']} of {checked} checked")
        if r.get("target_miss"):
            print(f"target missed (flyquant <= {TARGET}x aiter triton per useful MFMA): {where}: {r['target_miss']}")
    notes = dict.fromkeys(n for r in rows if r.get("status") == "ok" for n in r["notes"])
    print("aiter triton: " + "; ".join(notes) if notes else "")
