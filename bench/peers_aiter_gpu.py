"""`--vs aiter` in hardware mode (a ROCm GPU): aiter's kernels timed beside our rows, with the same
method (common.time_gpu: events around each call, warm-up, cache flush, median and minimum).

- aiter's Triton MXFP4 MoE path, launched through Triton normally (`kernel[grid](...)`) with the
  arguments, grid and config bench/peers_aiter_moe.py builds for the emulator: one stage
  (`time_stage`, for bench/moe_tile_n.py) or the layer (`time_layer`, for bench/moe_layer.py:
  alignment, stage 1, stage 2 and the torch top-k sum, all in the timed call).
- aiter's CK `fused_moe` (aiter.fused_moe.fused_moe) on the same x, routing, weights and biases as
  our layer row, when `import aiter` works: bf16 x MXFP4 (QuantType.per_1x32) goes to aiter's
  CK-Tile A16W4 stages only with ActivationType.Swiglu (aiter/fused_moe.py), so that is what it
  runs on every shape (dsr1's silu included): the row says so.

Not run here (no ROCm GPU on the machine where this was written): tests/test_bench.py's `gpu` test
is the check.
"""

from __future__ import annotations

import dataclasses

import torch

import common
import peers_aiter_moe as pam
from moe_problem import STAGES, Problem, Weights


def _triton_layer(s, t: dict, pw1, pw2, arch: str):
    """A callable running aiter's Triton layer on the GPU tensors t (x, topk_ids, topk_weights)."""
    x, ids = t["x"], t["topk_ids"].to(torch.int32)
    tokens, numel = x.shape[0], ids.numel()
    cfg = pam.aiter_config(arch, tokens)
    p1 = Problem(STAGES[1], s, tokens, cfg["BLOCK_SIZE_M"], (), x.contiguous(), None, None, 0, ids,
                 t["topk_weights"].float())
    a2 = torch.empty(numel, s.inter_dim, dtype=torch.bfloat16, device=x.device)
    out2 = torch.empty(numel, s.model_dim, dtype=torch.bfloat16, device=x.device)
    p2 = dataclasses.replace(p1, stage=STAGES[2], a=a2)

    def run():
        (sorted_ids, expert_ids, post_padded), launches = pam.align_launches(ids, s.experts, cfg["BLOCK_SIZE_M"])
        for fn, grid, args in launches:
            fn[grid](**args, num_warps=pam.TRITON_DEFAULT_WARPS, num_stages=pam.TRITON_DEFAULT_STAGES)
        for p, pw, out in ((p1, pw1, a2), (p2, pw2, out2)):
            fn, grid, args, options = pam.gemm_launch(p, pw, cfg, sorted_ids, expert_ids, post_padded, out)
            fn[grid](**args, **options)
        return out2.view(tokens, s.topk, s.model_dim).sum(dim=1)

    return run, pam.config_label(cfg)


def _ck_fused_moe(s, t: dict):
    """A callable running aiter's CK fused_moe on moe_layer.make_layer's tensors (already in aiter's
    A16W4 shuffled layouts, padded, as fq.fused_moe takes them), or None and why not."""
    try:
        import aiter
        from aiter.fused_moe import fused_moe
    except Exception as exc:  # aiter raises RuntimeError, ImportError, OSError... without ROCm pieces
        return None, f"aiter not importable ({type(exc).__name__}: {exc})"
    k1, k2 = t["w1"].shape[2] * 2, t["w2"].shape[2] * 2  # padded model_dim and inter_dim
    x = torch.nn.functional.pad(t["x"], (0, k1 - s.model_dim))  # zero columns meet w1's padding

    def run():
        return fused_moe(x, t["w1"], t["w2"], t["topk_weights"], t["topk_ids"], activation=aiter.ActivationType.Swiglu,
                         quant_type=aiter.QuantType.per_1x32, w1_scale=t["w1_scale"], w2_scale=t["w2_scale"],
                         hidden_pad=k1 - s.model_dim, intermediate_pad=k2 - s.inter_dim, bias1=t["b1"], bias2=t["b2"])

    return run, "aiter.fused_moe.fused_moe (CK-Tile A16W4: aiter's Swiglu, our biases)"


def _timed(label: str, head: dict, make, args) -> dict:
    """head + the timing ("timing": common.Timing) of the call make() builds, or why there is none."""
    try:
        call, config = make()
        if call is None:
            return head | {"impl": label, "error": config}
        t = common.time_gpu(call, warmup=args.warmup, iters=args.iters, flush=not args.no_flush)
    except Exception as exc:  # a peer that fails is reported, never replaced by a number
        return head | {"impl": label, "error": f"{type(exc).__name__}: {exc}"}
    return head | {"impl": label, "config": config, "timing": t}


def time_layer(s, t: dict, arch: str, args) -> list[dict]:
    """aiter's Triton layer and aiter's CK fused_moe timed on the GPU tensors t of moe_layer.make_layer
    (`s`: its moe_problem.MoeShape at the true sizes); weights random at the true sizes."""
    pw1, pw2 = (pam.PeerWeights(Weights(STAGES[n], s, args.seed, "cuda")).fill(range(s.experts)) for n in (1, 2))
    head = {"shape": s.name, "arch": arch, "tokens": t["x"].shape[0]}
    rows = [_timed("aiter triton", head, lambda: _triton_layer(s, t, pw1, pw2, arch), args),
            _timed("aiter ck fused_moe", head, lambda: _ck_fused_moe(s, t), args)]
    for r in rows:
        if "timing" in r:
            r.update(dataclasses.asdict(r.pop("timing")))  # the columns of our layer row's timing
    return rows


def time_stage(p: Problem, ours: Weights, arch: str, args) -> dict:
    """aiter's Triton GEMM of p's stage, timed on the GPU (alignment outside the timed call, as our
    stage rows take moe_sorting's output as given); p.a the stage's activations on the GPU. The row
    has "timing" (common.Timing) or "error"."""
    pw = pam.PeerWeights(ours).fill(range(p.shape.experts))

    def make():
        cfg = pam.aiter_config(arch, p.tokens)
        (sorted_ids, expert_ids, post_padded), launches = pam.align_launches(
            p.topk_ids.to(p.a.device), p.shape.experts, cfg["BLOCK_SIZE_M"])
        for fn, grid, a in launches:
            fn[grid](**a, num_warps=pam.TRITON_DEFAULT_WARPS, num_stages=pam.TRITON_DEFAULT_STAGES)
        cols = p.shape.inter_dim if p.stage.number == 1 else pw.n
        out = torch.empty(p.topk_ids.numel(), cols, dtype=torch.bfloat16, device=p.a.device)
        fn, grid, a, options = pam.gemm_launch(p, pw, cfg, sorted_ids, expert_ids, post_padded, out)
        return (lambda: fn[grid](**a, **options)), pam.config_label(cfg)

    head = {"stage": p.stage.number, "shape": p.shape.name, "arch": arch, "tokens": p.tokens}
    return _timed("aiter triton", head, make, args)
