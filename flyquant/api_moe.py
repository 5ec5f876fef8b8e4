"""The public A16W4 MoE ops (BF16 activations, MXFP4 expert weights): moe_sorting, the stage-1
and stage-2 GEMMs, moe_stage2 and the whole layer (fused_moe). Each call asks the selector for a
plan, then runs the FlyDSL kernel or the reference (flyquant.reference_moe; moe_sorting's is
flyquant.moe). The kernel-backed ops are ``torch.library`` custom ops with fake implementations,
so ``torch.compile`` traces them without graph breaks. flyquant.api re-exports the ops; its
explain() and warmup() cover them.
"""

from __future__ import annotations

import functools
from typing import Optional

import torch

from . import env, moe, reference_moe, select, validate
from .select import Plan

# ---------------------------------------------------------------------------------------------
# A16W4 MoE stage 2
# ---------------------------------------------------------------------------------------------


@torch.library.custom_op("flyquant::moe_gemm2_a16w4_", mutates_args=("out",))
def _moe_gemm2_op(
    out: torch.Tensor,
    a2: torch.Tensor,
    w2: torch.Tensor,
    w2_scale: torch.Tensor,
    sorted_ids: torch.Tensor,
    sorted_weights: torch.Tensor,
    sorted_expert_ids: torch.Tensor,
    num_valid_ids: torch.Tensor,
    topk: int,
    block_m: int,
    bias: Optional[torch.Tensor],
    apply_weights: bool,
    model_dim: int,
    inter_dim: int,
) -> None:
    args = (a2, w2, w2_scale, sorted_ids, sorted_weights, sorted_expert_ids, num_valid_ids)
    reference_moe.check_moe_gemm2_memory(out, *args, bias)  # addresses: on real tensors, both backends
    plan = select.plan_moe_gemm2_a16w4(a2, w2, topk, block_m, model_dim, inter_dim, out.dtype, bias is not None,
                                       apply_weights)
    if plan.backend == "reference":
        reference_moe.moe_gemm2_a16w4(
            *args, topk, block_m, out=out, bias=bias, apply_weights=apply_weights, model_dim=model_dim,
            inter_dim=inter_dim,
        )
        return
    from .kernels import moe_gemm2_a16w4 as k

    k.moe_gemm2_a16w4(
        *args, arch=plan.arch, topk=topk, block_m=block_m, out=out, bias=bias, apply_weights=apply_weights,
        model_dim=model_dim, inter_dim=inter_dim, tile_m=plan.config["tile_m"], tile_n=plan.config["tile_n"],
        k_batch=plan.config["k_batch"], waves=plan.config["waves"],
    )


# The fakes check as both backends do (no values or addresses), so a torch.ops.flyquant.* call refused
# when it runs is refused while traced


@_moe_gemm2_op.register_fake
def _(out, a2, w2, w2_scale, sorted_ids, sorted_weights, sorted_expert_ids, num_valid_ids, topk, block_m, bias,
      apply_weights, model_dim, inter_dim):
    reference_moe.check_moe_gemm2_call(a2, w2, w2_scale, sorted_ids, sorted_weights, sorted_expert_ids, num_valid_ids,
                                       topk, block_m, out=out, bias=bias, model_dim=model_dim, inter_dim=inter_dim)


def _debug_values(*tensors) -> bool:
    """Whether FLYQUANT_DEBUG's checks of tensor values (a host synchronisation) run: not on fake
    tensors (make_fx, a FakeTensorMode: there are no values); under torch.compile they break the
    graph and run eagerly."""
    return env.flag("FLYQUANT_DEBUG") and (torch.compiler.is_compiling() or not validate.fake(*tensors))


def _check_out_dtype(out_dtype) -> None:
    """The MoE output dtypes the stage-2 kernel accumulates into: bf16 or fp32 (anything else, a
    string included, is a TypeError naming out_dtype)."""
    if out_dtype not in (torch.bfloat16, torch.float32):
        raise TypeError(f"out_dtype must be one of (bfloat16, float32), got {out_dtype!r}")


def moe_gemm2_a16w4(a2, w2, w2_scale, sorted_ids, sorted_weights, sorted_expert_ids, num_valid_ids, topk, block_m,
                    out=None, bias=None, apply_weights=True, out_dtype=torch.bfloat16, model_dim=None,
                    inter_dim=None):
    """MoE down projection: out[t] (+)= sum_k w_tk * (a2[t*topk + k] @ W2[e]^T + bias[e]).

    a2: (tokens * topk, inter_dim) BF16 stage-1 output (token-major); w2, w2_scale: MXFP4 weights
    and E8M0 scales laid out by shuffle_weight_a16w4 / shuffle_scale_a16w4; the sorted_* tensors
    and num_valid_ids: moe_sorting's outputs for `block_m` (use moe_block_m() to choose it).
    out given: results are added into it; None: a zeroed out_dtype (bf16 or fp32) output.
    model_dim / inter_dim: the true sizes when the weights are padded (default: their shapes).

    Rows in use (below num_valid_ids[0], token < T) whose slot is not below topk, and blocks whose
    expert id is outside [0, E), are dropped on the kernel path (nothing is read for them); with
    FLYQUANT_DEBUG=1 they raise a ValueError (a host synchronisation), as the reference always does.
    A (token, slot) pair held by two rows in use raises likewise (the kernel may skip its rows).
    A negative num_valid_ids[0] means no rows. out must not overlap an input, and no input may
    require grad (the op has no backward). Weights that were not shuffled cannot be told from
    shuffled ones (a permutation of the same bytes): they give wrong values, no error.
    """
    topk, block_m, model_dim, inter_dim = map(validate.as_int, (topk, block_m, model_dim, inter_dim))
    model_dim, inter_dim, tokens = reference_moe.check_moe_gemm2_call(
        a2, w2, w2_scale, sorted_ids, sorted_weights, sorted_expert_ids, num_valid_ids, topk, block_m, out=out,
        bias=bias, model_dim=model_dim, inter_dim=inter_dim)
    validate.flag(apply_weights, "apply_weights")  # "no" was torch's schema error naming the internal op
    if _debug_values(sorted_ids):
        reference_moe.check_moe_gemm2_values(sorted_ids, sorted_expert_ids, num_valid_ids, topk, block_m, tokens,
                                             w2.shape[0])
    if out is None:
        _check_out_dtype(out_dtype)
        out = torch.zeros(tokens, model_dim, dtype=out_dtype, device=a2.device)
    # the scales as uint8 codes: torch.compile's inductor fails on a mutating custom op given an E8M0
    # tensor ("auto_functionalized_v2 was not removed", torch 2.13); both paths take either dtype
    _moe_gemm2_op(out, a2, w2, w2_scale.view(torch.uint8), sorted_ids, sorted_weights, sorted_expert_ids, num_valid_ids,
                  topk, block_m, bias, apply_weights, model_dim, inter_dim)
    return out


# ---------------------------------------------------------------------------------------------
# A16W4 MoE stage 1
# ---------------------------------------------------------------------------------------------


@torch.library.custom_op("flyquant::moe_gemm1_a16w4_", mutates_args=("out",))
def _moe_gemm1_op(
    out: torch.Tensor,
    x: torch.Tensor,
    w1: torch.Tensor,
    w1_scale: torch.Tensor,
    sorted_ids: torch.Tensor,
    sorted_weights: torch.Tensor,
    sorted_expert_ids: torch.Tensor,
    num_valid_ids: torch.Tensor,
    topk: int,
    block_m: int,
    bias: Optional[torch.Tensor],
    activation: str,
    alpha: float,
    limit: float,
    apply_weights: bool,
    model_dim: int,
    inter_dim: int,
) -> None:
    args = (x, w1, w1_scale, sorted_ids, sorted_weights, sorted_expert_ids, num_valid_ids)
    validate.no_overlap(out, "out", dict(x=x, w1=w1, w1_scale=w1_scale, sorted_ids=sorted_ids,
                                         sorted_weights=sorted_weights, sorted_expert_ids=sorted_expert_ids,
                                         num_valid_ids=num_valid_ids, bias=bias))
    plan = select.plan_moe_gemm1_a16w4(x, w1, topk, block_m, model_dim, inter_dim, bias is not None, activation,
                                       apply_weights, alpha, limit, _out_row(out))
    kw = dict(bias=bias, activation=activation, alpha=alpha, limit=limit, apply_weights=apply_weights, out=out,
              model_dim=model_dim, inter_dim=inter_dim)
    if plan.backend == "reference":
        reference_moe.moe_gemm1_a16w4(*args, topk, block_m, **kw)
        return
    from .kernels import moe_gemm1_a16w4 as k

    k.moe_gemm1_a16w4(*args, arch=plan.arch, topk=topk, block_m=block_m, tile_m=plan.config["tile_m"],
                      tile_n=plan.config["tile_n"], waves=plan.config["waves"], **kw)


@_moe_gemm1_op.register_fake
def _(out, x, w1, w1_scale, sorted_ids, sorted_weights, sorted_expert_ids, num_valid_ids, topk, block_m, bias,
      activation, alpha, limit, apply_weights, model_dim, inter_dim):
    reference_moe.check_moe_gemm1_call(x, w1, w1_scale, sorted_ids, sorted_weights, sorted_expert_ids, num_valid_ids,
                                       topk, block_m, bias=bias, activation=activation, out=out, model_dim=model_dim,
                                       inter_dim=inter_dim, limit=limit, alpha=alpha)


def moe_gemm1_a16w4(x, w1, w1_scale, sorted_ids, sorted_weights, sorted_expert_ids, num_valid_ids, topk, block_m,
                    bias=None, activation="silu", alpha=1.702, limit=7.0, apply_weights=False, out=None,
                    model_dim=None, inter_dim=None):
    """MoE gate/up projection with the activation fused: for every routed pair (token t, slot k,
    expert e), a2[t*topk + k, :inter_dim] = bf16(act(x[t] @ Wg[e]^T + bg[e], x[t] @ Wu[e]^T + bu[e])),
    times the routing weight when apply_weights (flyquant.reference.moe_gemm1_a16w4 is the contract).

    x: (T, model_dim) bf16 (other float dtypes run the reference); w1, w1_scale: (E, 2P, K/2) MXFP4
    gate rows then up rows and their E8M0 scales, shuffled with gate_up=True (aiter's stage-1
    layout; flyquant.layouts.gate_up_rows_from_interleaved converts GPT-OSS's interleaved
    weights); the sorted_* and num_valid_ids: moe_sorting's outputs for `block_m`. bias: (E, 2P)
    in w1's row order.
    activation: "silu" | "gelu" (tanh) | "swiglu_oai" (GPT-OSS, with alpha and limit).
    out: (T*topk, >= inter_dim) bf16, rows of routed pairs written, the others untouched; None: a
    zeroed (T*topk, inter_dim) tensor. model_dim / inter_dim: the true sizes when the weights are
    padded. Kernel path: one launch, no host synchronisation; rows with an out-of-range slot or
    expert id are dropped, rows repeating a (token, slot) pair may be skipped (with FLYQUANT_DEBUG=1
    both raise, as the reference always does).
    """
    topk, block_m, model_dim, inter_dim = map(validate.as_int, (topk, block_m, model_dim, inter_dim))
    model_dim, inter_dim, tokens = reference_moe.check_moe_gemm1_call(
        x, w1, w1_scale, sorted_ids, sorted_weights, sorted_expert_ids, num_valid_ids, topk, block_m, bias=bias,
        activation=activation, out=out, model_dim=model_dim, inter_dim=inter_dim, limit=limit, alpha=alpha)
    validate.flag(apply_weights, "apply_weights")  # bool() took "no" for True: weighted rows, no error
    if _debug_values(sorted_ids):
        reference_moe.check_moe_gemm2_values(sorted_ids, sorted_expert_ids, num_valid_ids, topk, block_m, tokens,
                                             w1.shape[0])
    if out is None:
        out = torch.zeros(tokens * topk, inter_dim, dtype=torch.bfloat16, device=x.device)
    _moe_gemm1_op(out, x, w1, w1_scale.view(torch.uint8), sorted_ids, sorted_weights, sorted_expert_ids, num_valid_ids,
                  topk, block_m, bias, activation, float(alpha), float(limit), apply_weights, model_dim, inter_dim)  # as stage 2
    return out


def moe_block_m(tokens: int, topk: int, experts: int, model_dim: int, inter_dim: int, device=None) -> int:
    """The block size the selector wants moe_sorting to use for this MoE shape (its tile_m)."""
    check_moe_sizes(tokens=tokens, topk=topk, experts=experts, model_dim=model_dim, inter_dim=inter_dim)
    device = validate.device(device if device is not None else "cpu")  # `device or` made device=0 the CPU
    return select.moe_block_m(*map(int, (tokens, topk, experts, model_dim, inter_dim)), device)


def check_moe_sizes(**sizes) -> None:
    """MoE shape arguments: ints, tokens >= 0 and the others >= 1 (they divide)."""
    for name, value in sizes.items():
        low = 0 if name == "tokens" else 1
        n = validate.integer(value)
        if n is None or n < low:
            raise ValueError(f"{name} must be an int >= {low}, got {value!r}")


def moe_stage2(a2, topk_ids, topk_weights, w2, w2_scale, *, bias=None, out_dtype=torch.bfloat16, model_dim=None,
               inter_dim=None):
    """From routing (topk_ids, topk_weights (tokens, topk)) and the stage-1 output a2 ((tokens *
    topk, inter_dim) bf16, token-major: row t * topk + k for token t's slot k) to the layer
    output: moe_sorting with the selector's block size (which also zeroes the output), then
    moe_gemm2_a16w4 adding into it. Two launches on the kernel path and no host synchronisation:
    routing ids outside [0, E) are dropped there (FLYQUANT_DEBUG=1 and the reference refuse them)."""
    tokens, topk, experts, model_dim, inter_dim, block_m = _moe_stage2_sizes(a2, topk_ids, w2, out_dtype, model_dim,
                                                                             inter_dim)
    validate.no_autograd("moe_stage2", dict(a2=a2, topk_weights=topk_weights, bias=bias))  # named as given
    out = torch.empty(tokens, model_dim, dtype=out_dtype, device=a2.device)
    sorted_ = moe_sorting(topk_ids, topk_weights, experts, block_m, moe_buf=out)
    return moe_gemm2_a16w4(a2, w2, w2_scale, *sorted_, topk=topk, block_m=block_m, out=out, bias=bias,
                           model_dim=model_dim, inter_dim=inter_dim)


def _moe_stage2_sizes(a2, topk_ids, w2, out_dtype, model_dim, inter_dim):
    """moe_stage2's own checks and sizes: (tokens, topk, experts, model_dim, inter_dim, block_m)."""
    validate.high_precision(a2, "a2", ndim=2)  # read below (its shape), before stage 2 checks it
    validate.tensor(topk_ids, "topk_ids", (torch.int32, torch.int64), ndim=2)
    validate.same_device("a2", a2, "topk_ids", topk_ids)  # else moe_sorting names its moe_buf, internal here
    validate.tensor(w2, "w2", (torch.uint8, torch.float4_e2m1fn_x2), ndim=3)
    tokens, topk = topk_ids.shape
    experts = w2.shape[0]
    check_moe_sizes(topk=topk, experts=experts)
    model_dim, inter_dim = reference_moe.moe_true_dims(a2, w2, model_dim, inter_dim)
    block_m = select.moe_block_m(tokens, topk, experts, model_dim, inter_dim, a2.device)
    _check_out_dtype(out_dtype)
    return tokens, topk, experts, model_dim, inter_dim, block_m


# ---------------------------------------------------------------------------------------------
# MoE sorting
# ---------------------------------------------------------------------------------------------


@torch.library.custom_op("flyquant::moe_sorting", mutates_args=("moe_buf",))
def _moe_sorting_op(
    topk_ids: torch.Tensor,
    topk_weights: torch.Tensor,
    num_experts: int,
    block_m: int,
    expert_mask: Optional[torch.Tensor],
    moe_buf: Optional[torch.Tensor],
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    if moe_buf is not None:  # addresses: checked here, on real tensors (not while torch.compile traces)
        validate.no_overlap(moe_buf, "moe_buf", {"topk_ids": topk_ids, "topk_weights": topk_weights,
                                                 "expert_mask": expert_mask})
    plan = select.plan_moe_sorting(topk_ids, topk_weights, num_experts, block_m, expert_mask)
    if plan.backend == "reference":
        if moe_buf is not None:
            moe_buf.zero_()
        return tuple(t.clone() for t in moe.moe_sorting(topk_ids, topk_weights, num_experts, block_m, expert_mask))
    from .kernels import moe_sorting as k

    if expert_mask is not None:
        expert_mask = (expert_mask if expert_mask.dtype in k.MASK_DTYPES else expert_mask != 0).contiguous()
    if moe_buf is not None and not (moe_buf.is_contiguous() and moe_buf.nbytes % 4 == 0
                                    and moe_buf.nbytes < k.MAX_MOE_BUF_BYTES):
        moe_buf.zero_()  # the kernel zeroes whole dwords of a contiguous buffer
        moe_buf = None
    return k.moe_sorting(topk_ids.contiguous(), topk_weights.contiguous(), num_experts, block_m, expert_mask,
                         arch=plan.arch, moe_buf=moe_buf, waves=plan.config["waves"])


@_moe_sorting_op.register_fake
def _(topk_ids, topk_weights, num_experts, block_m, expert_mask, moe_buf):
    moe.check_moe_sorting(topk_ids, topk_weights, num_experts, block_m, expert_mask, check_ids=False)
    _check_moe_buf(topk_ids, moe_buf)
    rows = topk_ids.shape[0] * topk_ids.shape[1] + num_experts * block_m - topk_ids.shape[1]
    new = functools.partial(topk_ids.new_empty, dtype=torch.int32)
    return new(rows), topk_ids.new_empty(rows, dtype=torch.float32), new(-(-rows // block_m)), new(2)


def moe_sorting(topk_ids, topk_weights, num_experts, block_m, expert_mask=None, moe_buf=None):
    """Group the routing pairs by expert into blocks of block_m rows (flyquant.moe.moe_sorting's
    contract and outputs): on the kernel path one launch with no host synchronisation, where
    ids outside [0, num_experts) are dropped (with FLYQUANT_DEBUG=1 they raise, as the reference
    always does). moe_buf: a tensor zeroed in the same launch (the stage-2 output, as aiter's
    moe_sorting zeroes moe_buf) when it is contiguous, a whole number of 4-byte words and below
    2 GiB; any other by moe_buf.zero_() first (on a GPU, a launch of its own)."""
    num_experts, block_m = validate.as_int(num_experts), validate.as_int(block_m)
    moe.check_moe_sorting(topk_ids, topk_weights, num_experts, block_m, expert_mask,
                          check_ids=_debug_values(topk_ids))
    _check_moe_buf(topk_ids, moe_buf)
    return _moe_sorting_op(topk_ids, topk_weights, num_experts, block_m, expert_mask, moe_buf)


def _check_moe_buf(topk_ids, moe_buf) -> None:
    if moe_buf is not None:
        validate.tensor(moe_buf, "moe_buf")
        validate.same_device("topk_ids", topk_ids, "moe_buf", moe_buf)
        validate.no_self_overlap(moe_buf, "moe_buf")


# ---------------------------------------------------------------------------------------------
# The whole A16W4 MoE layer
# ---------------------------------------------------------------------------------------------

APPLY_WEIGHTS_AT = ("stage1", "stage2")
# with b2 the layer was sum_k (w_tk * act(..) @ W2^T + b2[e]), not fused_moe's docstring formula
STAGE1_WEIGHTS_B2 = ("{what}: a2 carries the routing weight, so stage 2 would add b2[e] "
                     "without it (not the layer's w_tk * b2[e]); use apply_weights_at='stage2' (the default)")


def fused_moe(x, w1, w1_scale, w2, w2_scale, topk_weights, topk_ids, *, b1=None, b2=None, activation="silu",
              alpha=1.702, limit=7.0, expert_mask=None, apply_weights_at="stage2", out=None,
              out_dtype=torch.bfloat16, model_dim=None, inter_dim=None):
    """The A16W4 MoE layer: out[t] = sum_k w_tk * (act(x[t] @ W1g[e]^T + b1g[e], x[t] @ W1u[e]^T +
    b1u[e]) @ W2[e]^T + b2[e]) over the routed pairs (e = topk_ids[t, k], w_tk = topk_weights[t, k]).

    Three ops, each one launch on the kernel path, with no host synchronisation (a serving engine
    can capture the call in a graph): moe_sorting (which also zeroes `out`), moe_gemm1_a16w4 (into
    a2, token-major (T * topk, inter_dim) bf16) and moe_gemm2_a16w4 (adding into `out`), all on the
    selector's block_m. Weights as the stage ops take them: w1 (E, 2P, K/2) gate rows then up rows
    shuffled with gate_up=True, w2 (E, N, P/2), scales shuffled to match; b1 (E, 2P) in w1's row
    order, b2 (E, N). expert_mask (num_experts,): the experts served here; w1/w2 hold those only, in
    order (local ids; their count is checked with FLYQUANT_DEBUG=1). apply_weights_at: "stage2"
    (default) or "stage1" (a2 carries the routing weight; without b2, which stage 2 would then add
    unweighted). out: (T, model_dim), overwritten (not contiguous: the layer is computed into a
    contiguous buffer and copied, a fourth launch); None: a new out_dtype tensor. model_dim /
    inter_dim: the true sizes when the weights are padded (default x.shape[1] and w1.shape[1] /
    2). Routing ids outside [0, num_experts) are dropped on the kernel path (checked only with
    FLYQUANT_DEBUG=1; the reference path always refuses them).
    fq.moe_routing gives topk_weights and topk_ids from router logits.
    """
    tokens, topk, num_experts, model_dim, inter_dim, block_m = _fused_moe_sizes(
        x, w1, w2, b2, topk_ids, expert_mask, apply_weights_at, model_dim, inter_dim)
    a2 = torch.empty(tokens * topk, inter_dim, dtype=torch.bfloat16, device=x.device)  # rows of routed pairs written
    _check_fused_moe(x, w1, w1_scale, w2, w2_scale, topk_weights, topk_ids, b1, b2, activation, alpha, limit,
                     expert_mask, out, out_dtype, a2, topk, block_m, model_dim, inter_dim)
    if out is None:
        out = torch.empty(tokens, model_dim, dtype=out_dtype, device=x.device)
    # stage 2 adds into a buffer moe_sorting zeroes in its launch: a contiguous one. Any other out
    # takes the sum by one copy (given to the ops, it would be zeroed, copied in and copied back)
    buf = out if out.is_contiguous() else torch.empty(tokens, model_dim, dtype=out.dtype, device=x.device)
    sorted_ = moe_sorting(topk_ids, topk_weights, num_experts, block_m, expert_mask=expert_mask, moe_buf=buf)
    moe_gemm1_a16w4(x, w1, w1_scale, *sorted_, topk=topk, block_m=block_m, bias=b1, activation=activation,
                    alpha=alpha, limit=limit, apply_weights=apply_weights_at == "stage1", out=a2,
                    model_dim=model_dim, inter_dim=inter_dim)
    moe_gemm2_a16w4(a2, w2, w2_scale, *sorted_, topk=topk, block_m=block_m, out=buf, bias=b2,
                    apply_weights=apply_weights_at == "stage2", model_dim=model_dim, inter_dim=inter_dim)
    return out if buf is out else out.copy_(buf)


def _check_fused_moe(x, w1, w1_scale, w2, w2_scale, topk_weights, topk_ids, b1, b2, activation, alpha, limit,
                     expert_mask, out, out_dtype, a2, topk, block_m, model_dim, inter_dim) -> None:
    """fused_moe's checks past _fused_moe_sizes, all before moe_sorting zeroes out; explain runs
    them too (it planned calls fused_moe refuses, and failed inside the selector on some)."""
    tokens = a2.shape[0] // topk
    # named as given (stage 1 would name its sorted_weights), before moe_sorting zeroes out
    validate.no_autograd("fused_moe", dict(x=x, topk_weights=topk_weights, b1=b1, b2=b2, out=out))
    if out is None:
        _check_out_dtype(out_dtype)
    else:
        _check_fused_moe_out(out, x, tokens, model_dim, dict(
            x=x, w1=w1, w1_scale=w1_scale, w2=w2, w2_scale=w2_scale, topk_weights=topk_weights, topk_ids=topk_ids,
            b1=b1, b2=b2, expert_mask=expert_mask))
    # The stages' own checks before moe_sorting zeroes out (a bad b1, activation or w2_scale left a
    # given out zeroed), on empty sorted arrays (no rows: the checks of their lengths hold)
    unsorted = _unsorted(x.device)
    reference_moe.check_moe_gemm1_call(x, w1, w1_scale, *unsorted, topk, block_m, bias=b1, activation=activation,
                                       model_dim=model_dim, inter_dim=inter_dim, limit=limit, alpha=alpha,
                                       bias_name="b1")
    for name, t in (("w2", w2), ("w2_scale", w2_scale), ("b2", b2)):  # stage 2's checks would name a2, internal
        if isinstance(t, torch.Tensor):  # anything else: stage 2's type checks name it
            validate.same_device("x", x, name, t)
    reference_moe.check_moe_gemm2_call(a2, w2, w2_scale, *unsorted, topk, block_m, bias=b2, model_dim=model_dim,
                                       inter_dim=inter_dim, bias_name="b2")
    # FLYQUANT_CONFIG / FLYQUANT_TUNING tiles are checked when a stage plans, after moe_sorting has
    # zeroed out, and so is FLYQUANT_BACKEND=flydsl's refusal of a shape one stage's kernel does
    # not take; with any of them set, both stages plan here first (the error leaves out as given)
    if (env.raw("FLYQUANT_CONFIG") is not None or env.raw("FLYQUANT_TUNING") is not None
            or select.forced_backend() == "flydsl"):
        select.plan_moe_gemm1_a16w4(x, w1, topk, block_m, model_dim, inter_dim, b1 is not None, activation)
        select.plan_moe_gemm2_a16w4(a2, w2, topk, block_m, model_dim, inter_dim, out_dtype if out is None else out.dtype,
                                    b2 is not None)


def _unsorted(device) -> list[torch.Tensor]:
    """Empty moe_sorting outputs, for a stage's checks before the sorting runs (no rows: the checks of
    their lengths hold)."""
    return [torch.empty(0, dtype=d, device=device) for d in (torch.int32, torch.float32, torch.int32, torch.int32)]


def _check_fused_moe_out(out, x, tokens, model_dim, inputs) -> None:
    """A given fused_moe out, checked before moe_sorting zeroes it (stage 2 checks it again, too
    late for a wrong out to be left as it was): stage 2's dtypes, (T, model_dim), x's device, and
    no memory shared with an input (out=x would zero x before stage 1 reads it: a wrong result,
    no error; while torch.compile traces, as validate.no_overlap can tell it), nor with itself;
    4-byte aligned (on real tensors only: no address while torch.compile traces)."""
    validate.tensor(out, "out", (torch.bfloat16, torch.float32), ndim=2)
    validate.same_device("x", x, "out", out)
    validate.shape(out, "out", (tokens, model_dim))
    validate.no_self_overlap(out, "out")
    validate.no_overlap(out, "out", {name: t for name, t in inputs.items() if isinstance(t, torch.Tensor)})
    if not validate.tracing(out):
        reference_moe.check_out_aligned(out)


def _fused_moe_sizes(x, w1, w2, b2, topk_ids, expert_mask, apply_weights_at, model_dim, inter_dim):
    """fused_moe's own checks and sizes: (tokens, topk, num_experts, model_dim, inter_dim, block_m);
    the stage ops check the rest."""
    if apply_weights_at not in APPLY_WEIGHTS_AT:
        raise ValueError(f"apply_weights_at must be one of {APPLY_WEIGHTS_AT}, got {apply_weights_at!r}")
    if apply_weights_at == "stage1" and b2 is not None:
        raise ValueError(STAGE1_WEIGHTS_B2.format(what="b2 with apply_weights_at='stage1'"))
    validate.tensor(x, "x", ndim=2)
    validate.tensor(topk_ids, "topk_ids", moe.ID_DTYPES, ndim=2)
    validate.same_device("x", x, "topk_ids", topk_ids)  # else moe_sorting names its moe_buf, internal here
    validate.tensor(w1, "w1", ndim=3)
    validate.tensor(w2, "w2", ndim=3)
    if expert_mask is not None:  # its length is num_experts, read below
        validate.tensor(expert_mask, "expert_mask", ndim=1)
    tokens, topk = topk_ids.shape
    if x.shape[0] != tokens:
        raise ValueError(f"x.shape[0] = {x.shape[0]} must equal topk_ids.shape[0] = {tokens} (one routing row per token)")
    experts = w1.shape[0]
    if w2.shape[0] != experts:
        raise ValueError(f"w2.shape[0] = {w2.shape[0]} must equal w1.shape[0] = {experts} (the experts held here)")
    num_experts = experts if expert_mask is None else expert_mask.shape[0]
    # the served count is a value: read when asked for (a host synchronisation), as the ids are
    if expert_mask is not None and not torch.compiler.is_compiling() and _debug_values(expert_mask):
        served = int((expert_mask != 0).sum())
        if served != experts:
            raise ValueError(f"expert_mask serves {served} experts but w1 and w2 hold {experts}: the weights hold "
                             "the served experts only, in order")
    model_dim = x.shape[1] if model_dim is None else validate.as_int(model_dim)
    inter_dim = w1.shape[1] // 2 if inter_dim is None else validate.as_int(inter_dim)
    check_moe_sizes(topk=topk, experts=experts, model_dim=model_dim, inter_dim=inter_dim)
    block_m = select.moe_block_m(tokens, topk, experts, model_dim, inter_dim, x.device)
    return tokens, topk, num_experts, model_dim, inter_dim, block_m


# ---------------------------------------------------------------------------------------------
# explain()'s planners for the ops above
# ---------------------------------------------------------------------------------------------


def _explain_moe(a2, w2, w2_scale, sorted_ids, sorted_weights, sorted_expert_ids, num_valid_ids, topk, block_m,
                 out=None, bias=None, apply_weights=True, out_dtype=torch.bfloat16, model_dim=None, inter_dim=None):
    # the op's checks (bias, out and out_dtype were not checked: a wrong one was planned)
    model_dim, inter_dim, _ = reference_moe.check_moe_gemm2_call(
        a2, w2, w2_scale, sorted_ids, sorted_weights, sorted_expert_ids, num_valid_ids, topk, block_m, out=out,
        bias=bias, model_dim=model_dim, inter_dim=inter_dim)
    validate.flag(apply_weights, "apply_weights")
    if out is None:
        _check_out_dtype(out_dtype)
    dtype = out.dtype if out is not None else out_dtype
    return select.plan_moe_gemm2_a16w4(a2, w2, topk, block_m, model_dim, inter_dim, dtype, bias is not None,
                                       apply_weights)


def _explain_moe1(x, w1, w1_scale, sorted_ids, sorted_weights, sorted_expert_ids, num_valid_ids, topk, block_m,
                  bias=None, activation="silu", alpha=1.702, limit=7.0, apply_weights=False, out=None, model_dim=None,
                  inter_dim=None):
    model_dim, inter_dim, _ = reference_moe.check_moe_gemm1_call(
        x, w1, w1_scale, sorted_ids, sorted_weights, sorted_expert_ids, num_valid_ids, topk, block_m, bias=bias,
        activation=activation, out=out, model_dim=model_dim, inter_dim=inter_dim, limit=limit, alpha=alpha)
    validate.flag(apply_weights, "apply_weights")
    return select.plan_moe_gemm1_a16w4(x, w1, topk, block_m, model_dim, inter_dim, bias is not None, activation,
                                       apply_weights, alpha, limit, None if out is None else _out_row(out))


def _explain_sorting(topk_ids, topk_weights, num_experts, block_m, expert_mask=None, moe_buf=None):
    moe.check_moe_sorting(topk_ids, topk_weights, num_experts, block_m, expert_mask, check_ids=_debug_values(topk_ids))
    _check_moe_buf(topk_ids, moe_buf)
    return select.plan_moe_sorting(topk_ids, topk_weights, num_experts, block_m, expert_mask)


def _explain_fused_moe(x, w1, w1_scale, w2, w2_scale, topk_weights, topk_ids, *, b1=None, b2=None,
                       activation="silu", alpha=1.702, limit=7.0, expert_mask=None, apply_weights_at="stage2",
                       out=None, out_dtype=torch.bfloat16, model_dim=None, inter_dim=None) -> tuple[Plan, Plan, Plan]:
    """The three plans fused_moe runs: sorting, stage 1, stage 2 (on the same block_m)."""
    tokens, topk, num_experts, model_dim, inter_dim, block_m = _fused_moe_sizes(
        x, w1, w2, b2, topk_ids, expert_mask, apply_weights_at, model_dim, inter_dim)
    a2 = torch.empty(tokens * topk, inter_dim, dtype=torch.bfloat16, device=x.device)
    _check_fused_moe(x, w1, w1_scale, w2, w2_scale, topk_weights, topk_ids, b1, b2, activation, alpha, limit,
                     expert_mask, out, out_dtype, a2, topk, block_m, model_dim, inter_dim)
    moe.check_moe_sorting(topk_ids, topk_weights, num_experts, block_m, expert_mask, check_ids=_debug_values(topk_ids))
    dtype = out.dtype if out is not None else out_dtype
    return (select.plan_moe_sorting(topk_ids, topk_weights, num_experts, block_m, expert_mask),
            select.plan_moe_gemm1_a16w4(x, w1, topk, block_m, model_dim, inter_dim, b1 is not None, activation,
                                        apply_weights_at == "stage1", alpha, limit),
            select.plan_moe_gemm2_a16w4(a2, w2, topk, block_m, model_dim, inter_dim, dtype, b2 is not None,
                                        apply_weights_at == "stage2"))


def _explain_stage2(a2, topk_ids, topk_weights, w2, w2_scale, *, bias=None, out_dtype=torch.bfloat16, model_dim=None,
                    inter_dim=None) -> tuple[Plan, Plan]:
    """The two plans moe_stage2 runs: sorting, stage 2 (on the same block_m)."""
    _, topk, experts, model_dim, inter_dim, block_m = _moe_stage2_sizes(a2, topk_ids, w2, out_dtype, model_dim,
                                                                        inter_dim)
    moe.check_moe_sorting(topk_ids, topk_weights, experts, block_m, check_ids=_debug_values(topk_ids))
    reference_moe.check_moe_gemm2_call(a2, w2, w2_scale, *_unsorted(a2.device), topk, block_m, bias=bias,
                                       model_dim=model_dim, inter_dim=inter_dim)
    return (select.plan_moe_sorting(topk_ids, topk_weights, experts, block_m, None),
            select.plan_moe_gemm2_a16w4(a2, w2, topk, block_m, model_dim, inter_dim, out_dtype, bias is not None))


def _out_row(out: torch.Tensor) -> tuple[int, int]:
    """(columns, row stride) of stage 1's a2 as its launcher writes it (a non-unit column stride: a contiguous copy)."""
    return (out.shape[1], out.stride(0) if out.stride(1) == 1 else out.shape[1])


EXPLAINERS = {moe_gemm2_a16w4: _explain_moe, moe_gemm1_a16w4: _explain_moe1, moe_sorting: _explain_sorting,
              fused_moe: _explain_fused_moe, moe_stage2: _explain_stage2}
