"""The public API: each call asks the selector for a plan, then runs the FlyDSL kernel or the
reference. The kernel-backed ops are ``torch.library`` custom ops with fake implementations, so
``torch.compile`` traces them without graph breaks.
"""

from __future__ import annotations

import functools
import math
import operator
from typing import Optional

import torch

from . import env, layouts, moe, reference, select, validate
from .select import Plan

# ---------------------------------------------------------------------------------------------
# MXFP8 quantize
# ---------------------------------------------------------------------------------------------


@torch.library.custom_op("flyquant::mxfp8_quantize", mutates_args=())
def _mxfp8_quantize_op(
    x: torch.Tensor, axis: int, scaling_mode: str, scale_layout: Optional[str], offs: Optional[torch.Tensor]
) -> tuple[torch.Tensor, torch.Tensor]:
    plan = select.plan_mxfp8_quantize(x, axis, scaling_mode, scale_layout, offs)
    if plan.backend == "reference":
        return reference.mxfp8_quantize(x, axis, scaling_mode, scale_layout, offs)
    from .kernels import mxfp8_quantize_2d as k

    launch = k.quantize_1x32 if axis == 1 else k.quantize_32x1
    return launch(x, arch=plan.arch, scaling_mode=scaling_mode, scale_layout=scale_layout, offs=offs)


@_mxfp8_quantize_op.register_fake
def _(x, axis, scaling_mode, scale_layout, offs):
    return reference.mxfp8_quantize_empty(x, axis, scale_layout, offs)


def mxfp8_quantize(x, axis=-1, scaling_mode="rceil", scale_layout=None, offs=None):
    """MXFP8-quantize a 2D (M, K) BF16/FP16/FP32 tensor in blocks of 32 along `axis`.

    axis=-1 (1x32): data (M, K) row-major, scales (M, K/32). axis=0 (32x1): data (M, K)
    column-major (stride (1, M)), scales (K, M/32). scaling_mode "floor" | "rceil";
    scale_layout None | "tcgen05" | "mfma"; offs: int32 token-group end offsets along M
    (torchao's grouped-GEMM contract). Returns (float8_e4m3fn data, float8_e8m0fnu scales).
    """
    axis = reference.check_mxfp8_2d(x, axis, scaling_mode, scale_layout, offs)
    return _mxfp8_quantize_op(x, axis, scaling_mode, scale_layout, offs)


@torch.library.custom_op("flyquant::mxfp8_quantize_dual", mutates_args=())
def _mxfp8_quantize_dual_op(x: torch.Tensor, scaling_mode: str) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    plan = select.plan_mxfp8_quantize_dual(x, scaling_mode)
    if plan.backend == "reference":
        (d0, s0), (d1, s1) = reference.mxfp8_quantize_dual(x, scaling_mode)
    else:
        from .kernels import mxfp8_quantize_2d as k

        (d0, s0), (d1, s1) = k.quantize_dual(x, arch=plan.arch, scaling_mode=scaling_mode)
    return d0, s0, d1, s1


@_mxfp8_quantize_dual_op.register_fake
def _(x, scaling_mode):
    return (*reference.mxfp8_quantize_empty(x, -1), *reference.mxfp8_quantize_empty(x, 0))


def mxfp8_quantize_dual(x, scaling_mode="rceil"):
    """Both orientations from one read of x: ((data_1x32, scales_1x32), (data_32x1, scales_32x1))."""
    reference.check_mxfp8_dual(x, scaling_mode)
    d0, s0, d1, s1 = _mxfp8_quantize_dual_op(x, scaling_mode)
    return (d0, s0), (d1, s1)


@torch.library.custom_op("flyquant::mxfp8_quantize_3d", mutates_args=())
def _mxfp8_quantize_3d_op(
    w: torch.Tensor, scaling_mode: str, scale_block_k: int, scale_layout: Optional[str]
) -> tuple[torch.Tensor, torch.Tensor]:
    plan = select.plan_mxfp8_quantize_3d(w, scaling_mode, scale_block_k, scale_layout)
    if plan.backend == "reference":
        return reference.mxfp8_quantize_3d(w, scaling_mode, scale_block_k, scale_layout)
    from .kernels import mxfp8_quantize_3d as k

    return k.quantize_3d(w, arch=plan.arch, scaling_mode=scaling_mode, scale_block_k=scale_block_k,
                         scale_layout=scale_layout)


@_mxfp8_quantize_3d_op.register_fake
def _(w, scaling_mode, scale_block_k, scale_layout):
    return reference.mxfp8_quantize_3d_empty(w, scale_block_k, scale_layout)


def mxfp8_quantize_3d(w, scaling_mode="rceil", scale_block_k=1, scale_layout=None):
    """Per-expert MXFP8 quantize of (E, N, K) along N: data (E, N, K) with stride (N*K, 1, N),
    scales (E, N/32, K), or (E, N/32, K/32) with scale_block_k=32 (32x32 scale blocks). w is
    contiguous or the transpose of a contiguous (E, K, N) tensor (torchao's expert weights)."""
    reference.check_mxfp8_3d(w, scaling_mode, scale_block_k, scale_layout)
    return _mxfp8_quantize_3d_op(w, scaling_mode, scale_block_k, scale_layout)


# ---------------------------------------------------------------------------------------------
# MXFP4 quantize
# ---------------------------------------------------------------------------------------------


@torch.library.custom_op("flyquant::mxfp4_quantize", mutates_args=())
def _mxfp4_quantize_op(x: torch.Tensor, axis: int, scaling_mode: str, scale_layout: Optional[str] = None,
                       shuffle: Optional[str] = None) -> tuple[torch.Tensor, torch.Tensor]:
    plan = select.plan_mxfp4_quantize(x, axis, scaling_mode, shuffle, scale_layout=scale_layout)
    if plan.backend == "reference":
        return reference.mxfp4_quantize(x, axis, scaling_mode, scale_layout, shuffle)
    from .kernels import mxfp4_quantize as rows
    from .kernels import mxfp4_quantize_cols as cols

    x2 = x.reshape(math.prod(x.shape[:-1]), x.shape[-1])
    if axis == 0:
        return cols.quantize_cols(x2, arch=plan.arch, scaling_mode=scaling_mode)
    return rows.quantize_rows(x2, arch=plan.arch, scaling_mode=scaling_mode, shuffle=shuffle, scale_layout=scale_layout)


@_mxfp4_quantize_op.register_fake
def _(x, axis, scaling_mode, scale_layout=None, shuffle=None):
    return reference.mxfp4_quantize_empty(x, axis, scale_layout)


def mxfp4_quantize(x, axis=-1, scaling_mode="floor", scale_layout=None, shuffle=None):
    """MXFP4-quantize x (..., K) BF16/FP16/FP32, leading dims flattened to M rows, in blocks of 32
    along `axis`: -1 (rowwise): (uint8 (M, ceil(K/32) * 16) packed E2M1, float8_e8m0fnu (M,
    ceil(K/32))); 0 (columnwise, cast-transpose): x^T quantized along M, (K, ceil(M/32) * 16) and
    (K, ceil(M/32)). scaling_mode "floor" | "rceil" | "even" (flyquant.reference.mxfp4_quantize
    states the contract). Rowwise only, written by the same kernel in one pass: scale_layout="mfma"
    gives the scales as aiter's e8m0_shuffle, (ceil(M/256)*256, ceil(ceil(K/32)/8)*8), padding 0;
    shuffle="a4w4" gives the data as aiter's shuffle_weight(data, layout=(16, 16)) (gemm_a4w4's
    layout; M % 16 == 0 and K % 64 == 0)."""
    axis = validate.mxfp4_quantize_args(x, axis, scaling_mode, scale_layout, shuffle)
    return _mxfp4_quantize_op(x, axis, scaling_mode, scale_layout, shuffle)


@torch.library.custom_op("flyquant::mxfp4_quantize_dual", mutates_args=())
def _mxfp4_quantize_dual_op(x: torch.Tensor, scaling_mode: str
                            ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    plan = select.plan_mxfp4_quantize_dual(x, scaling_mode)
    if plan.backend == "reference":
        (d1, s1), (d0, s0) = reference.mxfp4_quantize_dual(x, scaling_mode)
    else:
        from .kernels import mxfp4_quantize_dual as k

        (d1, s1), (d0, s0) = k.quantize_dual(x.reshape(math.prod(x.shape[:-1]), x.shape[-1]), arch=plan.arch,
                                             scaling_mode=scaling_mode)
    return d1, s1, d0, s0


@_mxfp4_quantize_dual_op.register_fake
def _(x, scaling_mode):
    return (*reference.mxfp4_quantize_empty(x, -1), *reference.mxfp4_quantize_empty(x, 0))


def mxfp4_quantize_dual(x, scaling_mode="floor"):
    """Both orientations of mxfp4_quantize from one read of x, in one kernel launch:
    ((rowwise data, scales), (columnwise data, scales)), the bytes of mxfp4_quantize(x, -1) and
    mxfp4_quantize(x, 0) (plain layouts)."""
    validate.mxfp4_quantize_args(x, -1, scaling_mode, None, None)
    d1, s1, d0, s0 = _mxfp4_quantize_dual_op(x, scaling_mode)
    return (d1, s1), (d0, s0)


def quantize_mxfp4(w, scaling_mode="floor"):
    """The weight-oriented name of mxfp4_quantize(w, axis=-1), w's leading dims kept: (...,
    ceil(K/32) * 16) uint8 and (..., ceil(K/32)) float8_e8m0fnu."""
    validate.mxfp4_quantize_args(w, -1, scaling_mode, None, None, name="w")
    return reference.weight_shaped(w, *_mxfp4_quantize_op(w, -1, scaling_mode))


@torch.library.custom_op("flyquant::mxfp4_quantize_3d", mutates_args=())
def _mxfp4_quantize_3d_op(w: torch.Tensor, scaling_mode: str, shuffle: Optional[str], gate_up: bool
                          ) -> tuple[torch.Tensor, torch.Tensor]:
    e, n, k = w.shape
    plan = select.plan_mxfp4_quantize(w, -1, scaling_mode, shuffle, gate_up, op="mxfp4_quantize_3d")
    if plan.backend == "reference":
        return reference.mxfp4_quantize_3d(w, scaling_mode, shuffle, gate_up)
    from .kernels import mxfp4_quantize as rows

    variant = ("a16w4_gate_up" if gate_up else "a16w4") if shuffle else None
    packed, scales = rows.quantize_rows(w.reshape(e * n, k), arch=plan.arch, scaling_mode=scaling_mode, shuffle=variant,
                                        rows_per_expert=n)
    return packed.view(e, n, -1), scales.view(e, n, -1)


@_mxfp4_quantize_3d_op.register_fake
def _(w, scaling_mode, shuffle, gate_up):
    return reference.weight_shaped(w, *reference.mxfp4_quantize_empty(w, -1))


def mxfp4_quantize_3d(w, scaling_mode="floor", shuffle=None, gate_up=False):
    """MXFP4-quantize expert weights w (E, N, K) along K in one launch: (uint8 (E, N, ceil(K/32) *
    16), float8_e8m0fnu (E, N, ceil(K/32))); shuffle="a16w4" writes them directly in the layouts
    of shuffle_weight_a16w4(., 16, gate_up) / shuffle_scale_a16w4(., E, gate_up) (N % 32 == 0,
    K % 256 == 0)."""
    reference.check_mxfp4_3d(w, scaling_mode, shuffle, gate_up)
    return _mxfp4_quantize_3d_op(w, scaling_mode, shuffle, gate_up)


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
    reference.check_moe_gemm2_memory(out, *args, bias)  # addresses: on real tensors, both backends
    plan = select.plan_moe_gemm2_a16w4(a2, w2, topk, block_m, model_dim, inter_dim, out.dtype, bias is not None)
    if plan.backend == "reference":
        reference.moe_gemm2_a16w4(
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


@_moe_gemm2_op.register_fake
def _(out, a2, w2, w2_scale, sorted_ids, sorted_weights, sorted_expert_ids, num_valid_ids, topk, block_m, bias,
      apply_weights, model_dim, inter_dim):
    return None


def _check_out_dtype(out_dtype) -> None:
    """The MoE output dtypes the stage-2 kernel accumulates into: bf16 or fp32."""
    validate.tensor(torch.empty(0, dtype=out_dtype), "out_dtype", (torch.bfloat16, torch.float32))


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
    A negative num_valid_ids[0] means no rows. out must not overlap an input, and no input may
    require grad (the op has no backward). Weights that were not shuffled cannot be told from
    shuffled ones (a permutation of the same bytes): they give wrong values, no error.
    """
    model_dim, inter_dim, tokens = reference.check_moe_gemm2_call(
        a2, w2, w2_scale, sorted_ids, sorted_weights, sorted_expert_ids, num_valid_ids, topk, block_m, out=out,
        bias=bias, model_dim=model_dim, inter_dim=inter_dim)
    if env.flag("FLYQUANT_DEBUG"):
        reference.check_moe_gemm2_values(sorted_ids, sorted_expert_ids, num_valid_ids, topk, block_m, tokens,
                                         w2.shape[0])
    if out is None:
        _check_out_dtype(out_dtype)
        out = torch.zeros(tokens, model_dim, dtype=out_dtype, device=a2.device)
    _moe_gemm2_op(out, a2, w2, w2_scale, sorted_ids, sorted_weights, sorted_expert_ids, num_valid_ids, topk,
                  block_m, bias, apply_weights, model_dim, inter_dim)
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
    plan = select.plan_moe_gemm1_a16w4(x, w1, topk, block_m, model_dim, inter_dim, bias is not None, activation)
    kw = dict(bias=bias, activation=activation, alpha=alpha, limit=limit, apply_weights=apply_weights, out=out,
              model_dim=model_dim, inter_dim=inter_dim)
    if plan.backend == "reference":
        reference.moe_gemm1_a16w4(*args, topk, block_m, **kw)
        return
    from .kernels import moe_gemm1_a16w4 as k

    k.moe_gemm1_a16w4(*args, arch=plan.arch, topk=topk, block_m=block_m, tile_m=plan.config["tile_m"],
                      tile_n=plan.config["tile_n"], waves=plan.config["waves"], **kw)


@_moe_gemm1_op.register_fake
def _(out, x, w1, w1_scale, sorted_ids, sorted_weights, sorted_expert_ids, num_valid_ids, topk, block_m, bias,
      activation, alpha, limit, apply_weights, model_dim, inter_dim):
    return None


def moe_gemm1_a16w4(x, w1, w1_scale, sorted_ids, sorted_weights, sorted_expert_ids, num_valid_ids, topk, block_m,
                    bias=None, activation="silu", alpha=1.702, limit=7.0, apply_weights=False, out=None,
                    model_dim=None, inter_dim=None):
    """MoE gate/up projection with the activation fused: for every routed pair (token t, slot k,
    expert e), a2[t*topk + k, :inter_dim] = bf16(act(x[t] @ Wg[e]^T + bg[e], x[t] @ Wu[e]^T + bu[e])),
    times the routing weight when apply_weights (flyquant.reference.moe_gemm1_a16w4 is the contract).

    x: (T, model_dim) bf16 (other float dtypes run the reference); w1, w1_scale: (E, 2P, K/2) MXFP4
    gate rows then up rows and their E8M0 scales, shuffled with gate_up=True (aiter's stage-1
    layout; gate_up_rows_from_interleaved converts GPT-OSS's interleaved weights); the sorted_* and
    num_valid_ids: moe_sorting's outputs for `block_m`. bias: (E, 2P) in w1's row order.
    activation: "silu" | "gelu" (tanh) | "swiglu_oai" (GPT-OSS, with alpha and limit).
    out: (T*topk, >= inter_dim) bf16, rows of routed pairs written, the others untouched; None: a
    zeroed (T*topk, inter_dim) tensor. model_dim / inter_dim: the true sizes when the weights are
    padded. Kernel path: one launch, no host synchronisation; rows with an out-of-range slot or
    expert id are dropped (with FLYQUANT_DEBUG=1 they raise, as the reference always does).
    """
    model_dim, inter_dim, tokens = reference.check_moe_gemm1_call(
        x, w1, w1_scale, sorted_ids, sorted_weights, sorted_expert_ids, num_valid_ids, topk, block_m, bias=bias,
        activation=activation, out=out, model_dim=model_dim, inter_dim=inter_dim)
    if env.flag("FLYQUANT_DEBUG"):
        reference.check_moe_gemm2_values(sorted_ids, sorted_expert_ids, num_valid_ids, topk, block_m, tokens,
                                         w1.shape[0])
    if out is None:
        out = torch.zeros(tokens * topk, inter_dim, dtype=torch.bfloat16, device=x.device)
    _moe_gemm1_op(out, x, w1, w1_scale, sorted_ids, sorted_weights, sorted_expert_ids, num_valid_ids, topk, block_m,
                  bias, activation, float(alpha), float(limit), bool(apply_weights), model_dim, inter_dim)
    return out


def moe_block_m(tokens: int, topk: int, experts: int, model_dim: int, inter_dim: int, device=None) -> int:
    """The block size the selector wants moe_sorting to use for this MoE shape (its tile_m)."""
    _check_moe_sizes(tokens=tokens, topk=topk, experts=experts, model_dim=model_dim, inter_dim=inter_dim)
    return select.moe_block_m(tokens, topk, experts, model_dim, inter_dim, torch.device(device or "cpu"))


def _check_moe_sizes(**sizes) -> None:
    """MoE shape arguments: ints, tokens >= 0 and the others >= 1 (they divide)."""
    for name, value in sizes.items():
        low = 0 if name == "tokens" else 1
        try:
            ok = not isinstance(value, bool) and operator.index(value) >= low
        except TypeError:
            ok = False
        if not ok:
            raise ValueError(f"{name} must be an int >= {low}, got {value!r}")


def moe_stage2(a2, topk_ids, topk_weights, w2, w2_scale, *, bias=None, out_dtype=torch.bfloat16, model_dim=None,
               inter_dim=None):
    """From routing (topk_ids, topk_weights (tokens, topk)) and the stage-1 output a2 to the layer
    output: moe_sorting with the selector's block size (which also zeroes the output), then
    moe_gemm2_a16w4 adding into it. Two launches on the kernel path and no host synchronisation:
    routing ids outside [0, E) are dropped there (FLYQUANT_DEBUG=1 and the reference refuse them)."""
    validate.tensor(topk_ids, "topk_ids", (torch.int32, torch.int64), ndim=2)
    validate.tensor(w2, "w2", (torch.uint8, torch.float4_e2m1fn_x2), ndim=3)
    tokens, topk = topk_ids.shape
    experts = w2.shape[0]
    _check_moe_sizes(topk=topk, experts=experts)
    model_dim, inter_dim = reference.moe_true_dims(a2, w2, model_dim, inter_dim)
    block_m = select.moe_block_m(tokens, topk, experts, model_dim, inter_dim, a2.device)
    _check_out_dtype(out_dtype)
    out = torch.empty(tokens, model_dim, dtype=out_dtype, device=a2.device)
    sorted_ = moe_sorting(topk_ids, topk_weights, experts, block_m, moe_buf=out)
    return moe_gemm2_a16w4(a2, w2, w2_scale, *sorted_, topk=topk, block_m=block_m, out=out, bias=bias,
                           model_dim=model_dim, inter_dim=inter_dim)


def warmup(*, model_dim: int, inter_dim: int, experts: int, topk: int, tokens=(1,), quantize_shapes=(),
           scaling_mode: str = "rceil", device=None, activation: Optional[str] = None, stage1_bias: bool = False,
           stage1_weights: bool = False) -> list[Plan]:
    """Compile (into FlyDSL's disk cache) the kernels a model will use, by running each op once
    on zeros: the MoE stage 2 for every token count in `tokens` (true model_dim / inter_dim;
    the weights padded as the shuffles require), with `activation` given the stage 1 before it
    (with a bias when stage1_bias, the routing weight when stage1_weights), and the 1x32, 32x1 and
    dual MXFP8 quantize of every (M, K) in `quantize_shapes`. Returns the plans that ran."""
    _check_moe_sizes(model_dim=model_dim, inter_dim=inter_dim, experts=experts, topk=topk)
    for t in tokens:
        _check_moe_sizes(tokens=t)
    device = torch.device(device or ("cuda" if select.rocm_device_present() else "cpu"))
    plans = []
    # Weights padded as aiter's shuffles require (N to 32, K to 256), the true sizes passed along.
    w_n, w_k = -(-model_dim // 32) * 32, -(-inter_dim // 256) * 256
    w2 = torch.zeros(experts, w_n, w_k // 2, dtype=torch.uint8, device=device)
    scales = torch.full((experts, w_n, w_k // 32), 127, dtype=torch.uint8, device=device)
    w2_scale = layouts.shuffle_scale_a16w4(scales.view(torch.float8_e8m0fnu), experts)
    if activation is not None:  # stage 1: K = model_dim padded to 256, gate and up halves of w_k rows
        k1 = -(-model_dim // 256) * 256
        w1 = torch.zeros(experts, 2 * w_k, k1 // 2, dtype=torch.uint8, device=device)
        s1 = torch.full((experts, 2 * w_k, k1 // 32), 127, dtype=torch.uint8, device=device)
        w1_scale = layouts.shuffle_scale_a16w4(s1.view(torch.float8_e8m0fnu), experts, gate_up=True)
        b1 = torch.zeros(experts, 2 * w_k, dtype=torch.bfloat16, device=device) if stage1_bias else None
    for t in tokens:
        ids = (torch.arange(t * topk, device=device, dtype=torch.int32) % experts).view(t, topk)
        a2 = torch.zeros(t * topk, inter_dim, dtype=torch.bfloat16, device=device)
        block_m = select.moe_block_m(t, topk, experts, model_dim, inter_dim, device)
        sorted_ = moe_sorting(ids, torch.ones(t, topk, device=device), experts, block_m)
        if activation is not None:
            x = torch.zeros(t, model_dim, dtype=torch.bfloat16, device=device)
            plans.append(select.plan_moe_gemm1_a16w4(x, w1, topk, block_m, model_dim, inter_dim, stage1_bias, activation))
            moe_gemm1_a16w4(x, w1, w1_scale, *sorted_, topk=topk, block_m=block_m, bias=b1, activation=activation,
                            apply_weights=stage1_weights, out=a2, model_dim=model_dim, inter_dim=inter_dim)
        plans.append(select.plan_moe_gemm2_a16w4(a2, w2, topk, block_m, model_dim, inter_dim, torch.bfloat16, False))
        moe_gemm2_a16w4(a2, w2, w2_scale, *sorted_, topk=topk, block_m=block_m, model_dim=model_dim,
                        inter_dim=inter_dim)
    for m, k in quantize_shapes:
        x = torch.zeros(m, k, dtype=torch.bfloat16, device=device)
        for axis in (1, 0):
            plans.append(select.plan_mxfp8_quantize(x, axis, scaling_mode, None, None))
            mxfp8_quantize(x, axis, scaling_mode)
        plans.append(select.plan_mxfp8_quantize_dual(x, scaling_mode))
        mxfp8_quantize_dual(x, scaling_mode)
    return plans


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
    rows = topk_ids.shape[0] * topk_ids.shape[1] + num_experts * block_m - topk_ids.shape[1]
    new = functools.partial(topk_ids.new_empty, dtype=torch.int32)
    return new(rows), topk_ids.new_empty(rows, dtype=torch.float32), new(-(-rows // block_m)), new(2)


def moe_sorting(topk_ids, topk_weights, num_experts, block_m, expert_mask=None, moe_buf=None):
    """Group the routing pairs by expert into blocks of block_m rows (flyquant.moe.moe_sorting's
    contract and outputs): on the kernel path one launch with no host synchronisation, where
    ids outside [0, num_experts) are dropped (with FLYQUANT_DEBUG=1 they raise, as the reference
    always does). moe_buf: a tensor zeroed in the same launch (the stage-2 output, as aiter's
    moe_sorting zeroes moe_buf)."""
    moe.check_moe_sorting(topk_ids, topk_weights, num_experts, block_m, expert_mask,
                          check_ids=env.flag("FLYQUANT_DEBUG"))
    if moe_buf is not None:
        validate.tensor(moe_buf, "moe_buf")
        validate.same_device("topk_ids", topk_ids, "moe_buf", moe_buf)
    return _moe_sorting_op(topk_ids, topk_weights, num_experts, block_m, expert_mask, moe_buf)


# ---------------------------------------------------------------------------------------------
# Pure-PyTorch ops: they run on the tensors' device; the selector's plan says so.
# ---------------------------------------------------------------------------------------------

mxfp8_dequantize = reference.mxfp8_dequantize
dequantize_mxfp4 = reference.dequantize_mxfp4
shuffle_weight_a16w4 = layouts.shuffle_weight_a16w4
shuffle_scale_a16w4 = layouts.shuffle_scale_a16w4


def explain(fn, *args, **kwargs) -> Plan:
    """The selector's plan for `fn(*args, **kwargs)`, printed and returned, without running it
    (fused_moe: its three plans, sorting, stage 1, stage 2)."""
    planners = {
        mxfp8_quantize: _explain_mxfp8,
        mxfp8_quantize_dual: _explain_dual,
        mxfp8_quantize_3d: _explain_3d,
        mxfp4_quantize: _explain_mxfp4,
        quantize_mxfp4: _explain_quantize_mxfp4,
        mxfp4_quantize_3d: _explain_mxfp4_3d,
        mxfp4_quantize_dual: _explain_mxfp4_dual,
        moe_gemm2_a16w4: _explain_moe,
        moe_gemm1_a16w4: _explain_moe1,
        moe_sorting: _explain_sorting,
    }
    from .grouped_mm import EXPLAINERS  # the module imports after this one (flyquant/__init__.py)

    planners.update(EXPLAINERS)
    if fn is fused_moe:  # three ops: three plans
        plans = _explain_fused_moe(*args, **kwargs)
        for plan in plans:
            print(plan)
        return plans
    planner = planners.get(fn)
    if planner is None:
        name = getattr(fn, "__name__", repr(fn))
        plan = Plan(name, "reference", "tensor's device", reasons=(f"{name} is a pure-PyTorch op with no kernel",))
    else:
        plan = planner(*args, **kwargs)
    print(plan)
    return plan


def _explain_mxfp8(x, axis=-1, scaling_mode="rceil", scale_layout=None, offs=None):
    axis = reference.check_mxfp8_2d(x, axis, scaling_mode, scale_layout, offs)
    return select.plan_mxfp8_quantize(x, axis, scaling_mode, scale_layout, offs)


def _explain_dual(x, scaling_mode="rceil"):
    reference.check_mxfp8_dual(x, scaling_mode)
    return select.plan_mxfp8_quantize_dual(x, scaling_mode)


def _explain_mxfp4(x, axis=-1, scaling_mode="floor", scale_layout=None, shuffle=None):
    axis = validate.mxfp4_quantize_args(x, axis, scaling_mode, scale_layout, shuffle)
    return select.plan_mxfp4_quantize(x, axis, scaling_mode, shuffle, scale_layout=scale_layout)


def _explain_mxfp4_dual(x, scaling_mode="floor"):
    validate.mxfp4_quantize_args(x, -1, scaling_mode, None, None)
    return select.plan_mxfp4_quantize_dual(x, scaling_mode)


def _explain_quantize_mxfp4(w, scaling_mode="floor"):
    validate.mxfp4_quantize_args(w, -1, scaling_mode, None, None, name="w")
    return select.plan_mxfp4_quantize(w, -1, scaling_mode)


def _explain_mxfp4_3d(w, scaling_mode="floor", shuffle=None, gate_up=False):
    reference.check_mxfp4_3d(w, scaling_mode, shuffle, gate_up)
    return select.plan_mxfp4_quantize(w, -1, scaling_mode, shuffle, gate_up, op="mxfp4_quantize_3d")


def _explain_3d(w, scaling_mode="rceil", scale_block_k=1, scale_layout=None):
    reference.check_mxfp8_3d(w, scaling_mode, scale_block_k, scale_layout)
    return select.plan_mxfp8_quantize_3d(w, scaling_mode, scale_block_k, scale_layout)


def _explain_moe(a2, w2, w2_scale, sorted_ids, sorted_weights, sorted_expert_ids, num_valid_ids, topk, block_m,
                 out=None, bias=None, apply_weights=True, out_dtype=torch.bfloat16, model_dim=None, inter_dim=None):
    reference.check_moe_gemm2(a2, w2, w2_scale, sorted_ids, sorted_weights, sorted_expert_ids, num_valid_ids,
                              topk, block_m)
    model_dim, inter_dim = reference.moe_true_dims(a2, w2, model_dim, inter_dim)
    dtype = out.dtype if out is not None else out_dtype
    return select.plan_moe_gemm2_a16w4(a2, w2, topk, block_m, model_dim, inter_dim, dtype, bias is not None)


def _explain_moe1(x, w1, w1_scale, sorted_ids, sorted_weights, sorted_expert_ids, num_valid_ids, topk, block_m,
                  bias=None, activation="silu", alpha=1.702, limit=7.0, apply_weights=False, out=None, model_dim=None,
                  inter_dim=None):
    model_dim, inter_dim, _ = reference.check_moe_gemm1_call(
        x, w1, w1_scale, sorted_ids, sorted_weights, sorted_expert_ids, num_valid_ids, topk, block_m, bias=bias,
        activation=activation, out=out, model_dim=model_dim, inter_dim=inter_dim)
    return select.plan_moe_gemm1_a16w4(x, w1, topk, block_m, model_dim, inter_dim, bias is not None, activation)


def _explain_sorting(topk_ids, topk_weights, num_experts, block_m, expert_mask=None, moe_buf=None):
    moe.check_moe_sorting(topk_ids, topk_weights, num_experts, block_m, expert_mask, check_ids=False)
    return select.plan_moe_sorting(topk_ids, topk_weights, num_experts, block_m, expert_mask)


# ---------------------------------------------------------------------------------------------
# The whole A16W4 MoE layer
# ---------------------------------------------------------------------------------------------

APPLY_WEIGHTS_AT = ("stage1", "stage2")


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
    order, b2 (E, N). expert_mask (num_experts,): the experts served here; w1/w2 hold those only,
    in order (local ids). apply_weights_at: "stage2" (default) or "stage1" (a2 carries the routing
    weight). out: (T, model_dim), overwritten; None: a new out_dtype tensor. model_dim / inter_dim:
    the true sizes when the weights are padded (default x.shape[1] and w1.shape[1] / 2).
    Routing ids outside [0, num_experts) are dropped on the kernel path (checked only with
    FLYQUANT_DEBUG=1; the reference path always refuses them). fq.moe_routing gives topk_weights
    and topk_ids from router logits.
    """
    tokens, topk, num_experts, model_dim, inter_dim, block_m = _fused_moe_sizes(
        x, w1, w2, topk_ids, expert_mask, apply_weights_at, model_dim, inter_dim)
    if out is None:
        _check_out_dtype(out_dtype)
        out = torch.empty(tokens, model_dim, dtype=out_dtype, device=x.device)
    sorted_ = moe_sorting(topk_ids, topk_weights, num_experts, block_m, expert_mask=expert_mask, moe_buf=out)
    a2 = torch.empty(tokens * topk, inter_dim, dtype=torch.bfloat16, device=x.device)  # rows of routed pairs written
    moe_gemm1_a16w4(x, w1, w1_scale, *sorted_, topk=topk, block_m=block_m, bias=b1, activation=activation,
                    alpha=alpha, limit=limit, apply_weights=apply_weights_at == "stage1", out=a2,
                    model_dim=model_dim, inter_dim=inter_dim)
    return moe_gemm2_a16w4(a2, w2, w2_scale, *sorted_, topk=topk, block_m=block_m, out=out, bias=b2,
                           apply_weights=apply_weights_at == "stage2", model_dim=model_dim, inter_dim=inter_dim)


def _fused_moe_sizes(x, w1, w2, topk_ids, expert_mask, apply_weights_at, model_dim, inter_dim):
    """fused_moe's own checks and sizes: (tokens, topk, num_experts, model_dim, inter_dim, block_m);
    the stage ops check the rest."""
    if apply_weights_at not in APPLY_WEIGHTS_AT:
        raise ValueError(f"apply_weights_at must be one of {APPLY_WEIGHTS_AT}, got {apply_weights_at!r}")
    validate.tensor(x, "x", ndim=2)
    validate.tensor(topk_ids, "topk_ids", moe.ID_DTYPES, ndim=2)
    validate.tensor(w1, "w1", ndim=3)
    validate.tensor(w2, "w2", ndim=3)
    tokens, topk = topk_ids.shape
    if x.shape[0] != tokens:
        raise ValueError(f"x.shape[0] = {x.shape[0]} must equal topk_ids.shape[0] = {tokens} (one routing row per token)")
    experts = w1.shape[0]
    if w2.shape[0] != experts:
        raise ValueError(f"w2.shape[0] = {w2.shape[0]} must equal w1.shape[0] = {experts} (the experts held here)")
    num_experts = experts if expert_mask is None else expert_mask.shape[0]
    model_dim = x.shape[1] if model_dim is None else model_dim
    inter_dim = w1.shape[1] // 2 if inter_dim is None else inter_dim
    _check_moe_sizes(topk=topk, experts=experts, model_dim=model_dim, inter_dim=inter_dim)
    block_m = select.moe_block_m(tokens, topk, experts, model_dim, inter_dim, x.device)
    return tokens, topk, num_experts, model_dim, inter_dim, block_m


def _explain_fused_moe(x, w1, w1_scale, w2, w2_scale, topk_weights, topk_ids, *, b1=None, b2=None,
                       activation="silu", alpha=1.702, limit=7.0, expert_mask=None, apply_weights_at="stage2",
                       out=None, out_dtype=torch.bfloat16, model_dim=None, inter_dim=None) -> tuple[Plan, Plan, Plan]:
    """The three plans fused_moe runs: sorting, stage 1, stage 2 (on the same block_m)."""
    tokens, topk, num_experts, model_dim, inter_dim, block_m = _fused_moe_sizes(
        x, w1, w2, topk_ids, expert_mask, apply_weights_at, model_dim, inter_dim)
    a2 = torch.empty(tokens * topk, inter_dim, dtype=torch.bfloat16, device=x.device)
    dtype = out.dtype if out is not None else out_dtype
    return (select.plan_moe_sorting(topk_ids, topk_weights, num_experts, block_m, expert_mask),
            select.plan_moe_gemm1_a16w4(x, w1, topk, block_m, model_dim, inter_dim, b1 is not None, activation),
            select.plan_moe_gemm2_a16w4(a2, w2, topk, block_m, model_dim, inter_dim, dtype, b2 is not None))
