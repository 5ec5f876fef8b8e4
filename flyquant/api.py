"""The public API: each call asks the selector for a plan, then runs the FlyDSL kernel or the
reference. The kernel-backed ops are ``torch.library`` custom ops with fake implementations, so
``torch.compile`` traces them without graph breaks.

Here: the MXFP8 and MXFP4 quantize ops, the pure-PyTorch ops, explain(), which covers every op,
and warmup() (the MoE stages and the MXFP8 quantize ops a model will run). The A16W4 MoE ops live
in flyquant/api_moe.py (re-exported here), the MXFP8 grouped GEMMs in flyquant/grouped_mm.py.
"""

from __future__ import annotations

import inspect
import math
from collections.abc import Iterable
from typing import Optional

import torch

from . import api_moe, layouts, reference, reference_moe, select, validate
from .formats import MX_BLOCK
from .moe import ID_DTYPES, MAX_TOPK
from .select import Plan

# ---------------------------------------------------------------------------------------------
# MXFP8 quantize
# ---------------------------------------------------------------------------------------------


@torch.library.custom_op("flyquant::mxfp8_quantize", mutates_args=())
def _mxfp8_quantize_op(
    x: torch.Tensor, axis: int, scaling_mode: str, scale_layout: Optional[str], offs: Optional[torch.Tensor],
    signed_zeros: bool = True,
) -> tuple[torch.Tensor, torch.Tensor]:
    axis = validate.mxfp8_2d_axis(x, axis)  # torch.ops callers: the launchers check all else, not the axis
    plan = select.plan_mxfp8_quantize(x, axis, scaling_mode, scale_layout, offs, signed_zeros)
    if plan.backend == "reference":
        return reference.mxfp8_quantize(x, axis, scaling_mode, scale_layout, offs, signed_zeros)
    from .kernels import mxfp8_quantize_2d as k

    launch = k.quantize_1x32 if axis == 1 else k.quantize_32x1
    return launch(x, arch=plan.arch, scaling_mode=scaling_mode, scale_layout=scale_layout, offs=offs,
                  signed_zeros=signed_zeros)


# The fakes run the public functions' checks (metadata only on FakeTensors: validate.tracing), so that
# a torch.ops.flyquant.* call refused when it runs is refused while traced, and its axis is read alike


@_mxfp8_quantize_op.register_fake
def _(x, axis, scaling_mode, scale_layout, offs, signed_zeros=True):
    axis = reference.check_mxfp8_2d(x, axis, scaling_mode, scale_layout, offs)
    return reference.mxfp8_quantize_empty(x, axis, scale_layout, offs)


def mxfp8_quantize(x, axis=-1, scaling_mode="rceil", scale_layout=None, offs=None, signed_zeros=True):
    """MXFP8-quantize a 2D (M, K) BF16/FP16/FP32 tensor in blocks of 32 along `axis`.

    axis=-1 (1x32): data (M, K) row-major, scales (M, K/32). axis=0 (32x1): data (M, K)
    column-major (stride (1, M)), scales (K, M/32). scaling_mode "floor" | "rceil";
    scale_layout None | "tcgen05" | "mfma"; offs: int32 token-group end offsets along M
    (torchao's grouped-GEMM contract; non-decreasing, the last == M, every group a multiple of
    128 rows, else a ValueError). Returns (float8_e4m3fn data, float8_e8m0fnu scales).
    signed_zeros=False: zeros +0 (validate.SIGNED_ZEROS_DOC), for fq.mxfp8_grouped_mm(...,
    signed_zeros=False) on gfx942.
    """
    axis = reference.check_mxfp8_2d(x, axis, scaling_mode, scale_layout, offs)
    return _mxfp8_quantize_op(x, axis, scaling_mode, scale_layout, offs, validate.flag(signed_zeros, "signed_zeros"))


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
    reference.check_mxfp8_dual(x, scaling_mode)
    return (*reference.mxfp8_quantize_empty(x, -1), *reference.mxfp8_quantize_empty(x, 0))


def mxfp8_quantize_dual(x, scaling_mode="rceil"):
    """Both orientations from one read of x: ((data_1x32, scales_1x32), (data_32x1, scales_32x1))."""
    reference.check_mxfp8_dual(x, scaling_mode)
    d0, s0, d1, s1 = _mxfp8_quantize_dual_op(x, scaling_mode)
    return (d0, s0), (d1, s1)


@torch.library.custom_op("flyquant::mxfp8_quantize_3d", mutates_args=())
def _mxfp8_quantize_3d_op(
    w: torch.Tensor, scaling_mode: str, scale_block_k: int, scale_layout: Optional[str], signed_zeros: bool = True
) -> tuple[torch.Tensor, torch.Tensor]:
    plan = select.plan_mxfp8_quantize_3d(w, scaling_mode, scale_block_k, scale_layout, signed_zeros)
    if plan.backend == "reference":
        return reference.mxfp8_quantize_3d(w, scaling_mode, scale_block_k, scale_layout, signed_zeros)
    from .kernels import mxfp8_quantize_3d as k

    return k.quantize_3d(w, arch=plan.arch, scaling_mode=scaling_mode, scale_block_k=scale_block_k,
                         scale_layout=scale_layout, signed_zeros=signed_zeros)


@_mxfp8_quantize_3d_op.register_fake
def _(w, scaling_mode, scale_block_k, scale_layout, signed_zeros=True):
    scale_block_k = reference.check_mxfp8_3d(w, scaling_mode, scale_block_k, scale_layout)
    return reference.mxfp8_quantize_3d_empty(w, scale_block_k, scale_layout)


def mxfp8_quantize_3d(w, scaling_mode="rceil", scale_block_k=1, scale_layout=None, signed_zeros=True):
    """Per-expert MXFP8 quantize of (E, N, K) along N: data (E, N, K) with stride (N*K, 1, N),
    scales (E, N/32, K), or (E, N/32, K/32) with scale_block_k=32 (32x32 scale blocks). w is
    contiguous or the transpose of a contiguous (E, K, N) tensor (torchao's expert weights).
    signed_zeros=False: zeros +0 (validate.SIGNED_ZEROS_DOC)."""
    scale_block_k = reference.check_mxfp8_3d(w, scaling_mode, scale_block_k, scale_layout)
    return _mxfp8_quantize_3d_op(w, scaling_mode, scale_block_k, scale_layout, validate.flag(signed_zeros, "signed_zeros"))


# ---------------------------------------------------------------------------------------------
# MXFP4 quantize
# ---------------------------------------------------------------------------------------------


def _rows(x: torch.Tensor) -> torch.Tensor:
    """Contiguous x (..., K) as the (M, K) matrix the MXFP4 kernels take, strides (K, 1): a
    reshape keeps a single element's strides, which torch calls contiguous whatever they are
    (x[::4, ::64]: (256, 64)), and FlyDSL refused a tensor with no stride of 1 (a RuntimeError
    naming neither x nor the op)."""
    m, k = math.prod(x.shape[:-1]), x.shape[-1]
    return x.as_strided((m, k), (k, 1))


@torch.library.custom_op("flyquant::mxfp4_quantize", mutates_args=())
def _mxfp4_quantize_op(x: torch.Tensor, axis: int, scaling_mode: str, scale_layout: Optional[str] = None,
                       shuffle: Optional[str] = None) -> tuple[torch.Tensor, torch.Tensor]:
    axis = validate.mxfp4_quantize_args(x, axis, scaling_mode, scale_layout, shuffle)  # the launchers do not
    plan = select.plan_mxfp4_quantize(x, axis, scaling_mode, shuffle, scale_layout=scale_layout)
    if plan.backend == "reference":
        return reference.mxfp4_quantize(x, axis, scaling_mode, scale_layout, shuffle)
    from .kernels import mxfp4_quantize as rows
    from .kernels import mxfp4_quantize_cols as cols

    x2 = _rows(x)
    if axis == 0:
        return cols.quantize_cols(x2, arch=plan.arch, scaling_mode=scaling_mode)
    return rows.quantize_rows(x2, arch=plan.arch, scaling_mode=scaling_mode, shuffle=shuffle, scale_layout=scale_layout)


@_mxfp4_quantize_op.register_fake
def _(x, axis, scaling_mode, scale_layout=None, shuffle=None):
    axis = validate.mxfp4_quantize_args(x, axis, scaling_mode, scale_layout, shuffle)
    return reference.mxfp4_quantize_empty(x, axis, scale_layout)


def mxfp4_quantize(x, axis=-1, scaling_mode="floor", scale_layout=None, shuffle=None):
    """MXFP4-quantize x (..., K) BF16/FP16/FP32, leading dims flattened to M rows, in blocks of 32
    along `axis`: -1 (rowwise): (uint8 (M, ceil(K/32) * 16) packed E2M1, float8_e8m0fnu (M,
    ceil(K/32))); 0 (columnwise, cast-transpose): x^T quantized along M, (K, ceil(M/32) * 16) and
    (K, ceil(M/32)); a 1-D x is one row (axis=0: one-element columns). scaling_mode "floor" |
    "rceil" | "even" (flyquant.reference.mxfp4_quantize states the contract). Rowwise only, written
    by the same kernel in one pass: scale_layout="mfma" gives the scales as aiter's e8m0_shuffle,
    (ceil(M/256)*256, ceil(ceil(K/32)/8)*8), padding 0; shuffle="a4w4" gives the data as aiter's
    shuffle_weight(data, layout=(16, 16)) (gemm_a4w4's layout; M % 16 == 0 and K % 64 == 0)."""
    axis = validate.mxfp4_quantize_args(x, axis, scaling_mode, scale_layout, shuffle)
    return _mxfp4_quantize_op(x, axis, scaling_mode, scale_layout, shuffle)


@torch.library.custom_op("flyquant::mxfp4_quantize_dual", mutates_args=())
def _mxfp4_quantize_dual_op(x: torch.Tensor, scaling_mode: str
                            ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    validate.mxfp4_quantize_args(x, -1, scaling_mode, None, None)
    plan = select.plan_mxfp4_quantize_dual(x, scaling_mode)
    if plan.backend == "reference":
        (d1, s1), (d0, s0) = reference.mxfp4_quantize_dual(x, scaling_mode)
    else:
        from .kernels import mxfp4_quantize_dual as k

        (d1, s1), (d0, s0) = k.quantize_dual(_rows(x), arch=plan.arch, scaling_mode=scaling_mode)
    return d1, s1, d0, s0


@_mxfp4_quantize_dual_op.register_fake
def _(x, scaling_mode):
    validate.mxfp4_quantize_args(x, -1, scaling_mode, None, None)
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
    reference.check_mxfp4_3d(w, scaling_mode, shuffle, gate_up)
    e, n, k = w.shape
    plan = select.plan_mxfp4_quantize(w, -1, scaling_mode, shuffle, gate_up, op="mxfp4_quantize_3d")
    if plan.backend == "reference":
        return reference.mxfp4_quantize_3d(w, scaling_mode, shuffle, gate_up)
    from .kernels import mxfp4_quantize as rows

    variant = ("a16w4_gate_up" if gate_up else "a16w4") if shuffle else None
    packed, scales = rows.quantize_rows(_rows(w), arch=plan.arch, scaling_mode=scaling_mode, shuffle=variant,
                                        rows_per_expert=n)
    return reference.weight_shaped(w, packed, scales)  # (no -1 in the view: E or N may be 0)


@_mxfp4_quantize_3d_op.register_fake
def _(w, scaling_mode, shuffle, gate_up):
    reference.check_mxfp4_3d(w, scaling_mode, shuffle, gate_up)
    return reference.weight_shaped(w, *reference.mxfp4_quantize_empty(w, -1))


def mxfp4_quantize_3d(w, scaling_mode="floor", shuffle=None, gate_up=False):
    """MXFP4-quantize expert weights w (E, N, K) along K in one launch (from 2 GiB on, one per
    chunk of whole experts): (uint8 (E, N, ceil(K/32) * 16), float8_e8m0fnu (E, N, ceil(K/32)));
    shuffle="a16w4" writes them directly in the layouts of shuffle_weight_a16w4(., 16, gate_up) /
    shuffle_scale_a16w4(., E, gate_up) (N % 32 == 0, K % 256 == 0)."""
    reference.check_mxfp4_3d(w, scaling_mode, shuffle, gate_up)
    return _mxfp4_quantize_3d_op(w, scaling_mode, shuffle, gate_up)


# ---------------------------------------------------------------------------------------------
# The A16W4 MoE ops live in flyquant/api_moe.py; flyquant.api.<op> names them too
# ---------------------------------------------------------------------------------------------

APPLY_WEIGHTS_AT = api_moe.APPLY_WEIGHTS_AT
fused_moe = api_moe.fused_moe
moe_block_m = api_moe.moe_block_m
moe_gemm1_a16w4 = api_moe.moe_gemm1_a16w4
moe_gemm2_a16w4 = api_moe.moe_gemm2_a16w4
moe_sorting = api_moe.moe_sorting
moe_stage2 = api_moe.moe_stage2


# ---------------------------------------------------------------------------------------------
# Warm-up: compile the kernels a model will use
# ---------------------------------------------------------------------------------------------


def warmup(*, model_dim: int, inter_dim: int, experts: int, topk: int, tokens=(1,), quantize_shapes=(),
           scaling_mode: str = "rceil", device=None, activation: Optional[str] = None, stage1_bias=False,
           stage1_weights: bool = False, stage2_bias=False, alpha: float = 1.702, limit: float = 7.0,
           out_dtype: torch.dtype = torch.bfloat16, ids_dtype: torch.dtype = torch.int32) -> list[Plan]:
    """Compile (into FlyDSL's disk cache) the kernels a model will use, by running each op once
    on zeros: for every token count in `tokens`, fq.fused_moe when `activation` is given (sorting,
    stage 1, stage 2), else fq.moe_stage2 (sorting, stage 2), on weights of the true model_dim /
    inter_dim padded as the shuffles require; then the 1x32, 32x1 and dual MXFP8 quantize of every
    (M, K) in `quantize_shapes`. Returns the plans that ran (per token count the sorting, stage 1
    and stage 2 plans, then the quantize ones).

    A kernel is compiled per configuration, so pass the model's: stage1_bias / stage2_bias False
    (no bias), True (bf16) or the bias dtype (flyquant.nn.MoEExperts keeps b1 in fp32; GPT-OSS has
    both biases); stage1_weights: the routing weight applied at stage 1 (fused_moe's
    apply_weights_at="stage1", which takes no stage2_bias); alpha / limit: swiglu_oai's;
    out_dtype: the layer's output dtype; ids_dtype: topk_ids' dtype (torch.topk gives int64).
    MoEExperts.warmup passes its own."""
    api_moe.check_moe_sizes(model_dim=model_dim, inter_dim=inter_dim, experts=experts, topk=topk)
    # numpy integers pass that check; as ints here, since the ops below refused a numpy topk or experts
    model_dim, inter_dim, experts, topk = map(validate.integer, (model_dim, inter_dim, experts, topk))
    if topk > min(experts, MAX_TOPK):  # else moe_sorting's error named its topk_ids, internal here
        raise ValueError(f"topk = {topk} must be at most min(experts = {experts}, {MAX_TOPK})")
    tokens, quantize_shapes = _warmup_lists(tokens, quantize_shapes)
    # before anything compiles: these were refused only when their op ran, naming its x
    validate.scaling_mode(scaling_mode)
    if activation is not None and activation not in reference_moe.MOE_ACTIVATIONS:
        raise ValueError(f"activation must be None or one of {reference_moe.MOE_ACTIVATIONS}, got {activation!r}")
    b1_dtype, b2_dtype = _warmup_bias(stage1_bias, "stage1_bias"), _warmup_bias(stage2_bias, "stage2_bias")
    # without an activation no stage 1 runs, so these would be ignored
    if (b1_dtype is not None or validate.flag(stage1_weights, "stage1_weights")) and activation is None:
        raise ValueError("stage1_bias / stage1_weights choose the stage-1 kernel warmed up: pass its activation too")
    if validate.flag(stage1_weights, "stage1_weights") and b2_dtype is not None:
        raise ValueError(api_moe.STAGE1_WEIGHTS_B2.format(what="stage2_bias with stage1_weights"))
    reference_moe.check_activation_args(activation, alpha, limit)
    api_moe._check_out_dtype(out_dtype)
    _check_ids_dtype(ids_dtype)
    # `device or ...` took device=0 (torch's accelerator 0) for the default
    device = validate.device(device if device is not None else ("cuda" if select.rocm_device_present() else "cpu"))
    plans = []
    # Weights padded as aiter's shuffles require (N to 32, K to 256), the true sizes passed along.
    w_n, w_k = -(-model_dim // 32) * 32, -(-inter_dim // 256) * 256
    w2 = torch.zeros(experts, w_n, w_k // 2, dtype=torch.uint8, device=device)
    scales = torch.full((experts, w_n, w_k // 32), 127, dtype=torch.uint8, device=device)
    w2_scale = layouts.shuffle_scale_a16w4(scales.view(torch.float8_e8m0fnu), experts)
    b2 = None if b2_dtype is None else torch.zeros(experts, w_n, dtype=b2_dtype, device=device)
    if activation is not None:  # stage 1: K = model_dim padded to 256, gate and up halves of w_k rows
        k1 = -(-model_dim // 256) * 256
        w1 = torch.zeros(experts, 2 * w_k, k1 // 2, dtype=torch.uint8, device=device)
        s1 = torch.full((experts, 2 * w_k, k1 // 32), 127, dtype=torch.uint8, device=device)
        w1_scale = layouts.shuffle_scale_a16w4(s1.view(torch.float8_e8m0fnu), experts, gate_up=True)
        b1 = None if b1_dtype is None else torch.zeros(experts, 2 * w_k, dtype=b1_dtype, device=device)
        layer = dict(b1=b1, b2=b2, activation=activation, alpha=alpha, limit=limit, out_dtype=out_dtype,
                     apply_weights_at="stage1" if stage1_weights else "stage2", model_dim=model_dim, inter_dim=inter_dim)
    for t in tokens:
        ids, weights = _warmup_routing(t, topk, experts, ids_dtype, device)
        if activation is not None:
            x = torch.zeros(t, model_dim, dtype=torch.bfloat16, device=device)
            plans += api_moe._explain_fused_moe(x, w1, w1_scale, w2, w2_scale, weights, ids, **layer)
            fused_moe(x, w1, w1_scale, w2, w2_scale, weights, ids, **layer)
        else:
            a2 = torch.zeros(t * topk, inter_dim, dtype=torch.bfloat16, device=device)
            stage2 = dict(bias=b2, out_dtype=out_dtype, model_dim=model_dim, inter_dim=inter_dim)
            plans += api_moe._explain_stage2(a2, ids, weights, w2, w2_scale, **stage2)
            moe_stage2(a2, ids, weights, w2, w2_scale, **stage2)
    for m, k in quantize_shapes:
        x = torch.zeros(m, k, dtype=torch.bfloat16, device=device)
        for axis in (1, 0):
            plans.append(select.plan_mxfp8_quantize(x, axis, scaling_mode, None, None))
            mxfp8_quantize(x, axis, scaling_mode)
        plans.append(select.plan_mxfp8_quantize_dual(x, scaling_mode))
        mxfp8_quantize_dual(x, scaling_mode)
    return plans


def _check_ids_dtype(ids_dtype) -> None:
    """A warm-up's ids_dtype (fq.warmup, MoEExperts.warmup): one the routing ids may have."""
    if ids_dtype not in ID_DTYPES:
        raise TypeError(f"ids_dtype must be torch.int32 or torch.int64 (topk_ids' dtype), got {ids_dtype!r}")


def _warmup_routing(tokens: int, topk: int, experts: int, ids_dtype, device):
    """A warm-up's routing: (topk_ids of ids_dtype cycling through the experts, unit weights)."""
    ids = (torch.arange(tokens * topk, device=device) % experts).view(tokens, topk).to(ids_dtype)
    return ids, torch.ones(tokens, topk, device=device)


def _warmup_bias(value, name: str):
    """warmup's stage1_bias / stage2_bias as the bias dtype to warm up: None (False: no bias), bf16
    (True) or the dtype given (bf16, fp16 or fp32, as the MoE ops take biases)."""
    # the MoE ops' bias dtypes, checked here: with tokens=() no op runs to refuse another
    if isinstance(value, torch.dtype) and value in validate.HIGH_PRECISION_DTYPES:
        return value
    if isinstance(value, bool):
        return torch.bfloat16 if value else None
    raise ValueError(f"{name} must be a bool or a floating torch.dtype (the bias dtype: bfloat16, float16 or float32), "
                     f"got {value!r}")


def _warmup_lists(tokens, quantize_shapes) -> tuple[tuple, tuple]:
    """warmup's token counts and (M, K) quantize shapes as tuples, checked (tokens=4 or one pair
    quantize_shapes=(M, K) were TypeErrors from the loops, naming neither argument)."""
    if isinstance(tokens, (str, bytes)) or not isinstance(tokens, Iterable):
        raise TypeError(f"tokens must be a sequence of token counts, e.g. (1, 4, 16), got {tokens!r}")
    tokens = tuple(tokens)
    for t in tokens:
        api_moe.check_moe_sizes(tokens=t)
    tokens = tuple(map(validate.integer, tokens))
    if isinstance(quantize_shapes, (str, bytes)) or not isinstance(quantize_shapes, Iterable):
        raise TypeError(f"quantize_shapes must be a sequence of (M, K) pairs, e.g. ((8192, 5120),), "
                        f"got {quantize_shapes!r}")
    quantize_shapes = tuple(quantize_shapes)
    pairs = []
    for shape in quantize_shapes:  # numpy integers too (as the token counts), a row of an array of pairs too
        pair = tuple(map(validate.integer, shape)) if isinstance(shape, Iterable) and not isinstance(shape, str) else ()
        if len(pair) != 2 or None in pair:
            raise TypeError(f"quantize_shapes must be a sequence of (M, K) pairs of ints, e.g. ((8192, 5120),), "
                            f"got {quantize_shapes!r}")
        pairs.append(pair)
    quantize_shapes = tuple(pairs)
    for i, (m, k) in enumerate(quantize_shapes):  # the dual quantize blocks both dims
        validate.multiple_of(m, MX_BLOCK, f"quantize_shapes[{i}][0] (M)")
        validate.multiple_of(k, MX_BLOCK, f"quantize_shapes[{i}][1] (K)")
    return tokens, quantize_shapes


# ---------------------------------------------------------------------------------------------
# Pure-PyTorch ops: they run on the tensors' device; the selector's plan says so.
# ---------------------------------------------------------------------------------------------

mxfp8_dequantize = reference.mxfp8_dequantize
dequantize_mxfp4 = reference.dequantize_mxfp4
shuffle_weight_a16w4 = layouts.shuffle_weight_a16w4
shuffle_scale_a16w4 = layouts.shuffle_scale_a16w4


# flyquant's modules of pure-PyTorch functions (the reference, the layouts, routing): explain() plans
# them as running no kernel (fq.mxfp8_dequantize, fq.shuffle_weight_a16w4, fq.moe_routing, ...)
PURE_MODULES = ("flyquant.reference", "flyquant.reference_moe", "flyquant.reference_grouped_mm", "flyquant.layouts",
                "flyquant.moe", "flyquant.formats")


def explain(fn, *args, **kwargs) -> Plan | tuple[Plan, ...]:
    """The selector's plan for `fn(*args, **kwargs)`, printed and returned, without running it
    (fused_moe: its three plans, sorting, stage 1, stage 2; moe_stage2: sorting, stage 2). fn is one
    of flyquant's kernel-backed ops or a pure-PyTorch function (PURE_MODULES); else a TypeError."""
    planners = {
        mxfp8_quantize: _explain_mxfp8,
        mxfp8_quantize_dual: _explain_dual,
        mxfp8_quantize_3d: _explain_3d,
        mxfp4_quantize: _explain_mxfp4,
        quantize_mxfp4: _explain_quantize_mxfp4,
        mxfp4_quantize_3d: _explain_mxfp4_3d,
        mxfp4_quantize_dual: _explain_mxfp4_dual,
        **api_moe.EXPLAINERS,
    }
    from .grouped_mm import EXPLAINERS  # the module imports after this one (flyquant/__init__.py)

    planners.update(EXPLAINERS)
    planner = planners.get(fn)
    name = getattr(fn, "__name__", repr(fn))
    if planner is None:
        # only what is pure PyTorch: anything else (moe_stage2 before it had a planner, the training
        # op, the torchao compat functions, None) was said to be "a pure-PyTorch op with no kernel"
        if getattr(fn, "__module__", None) not in PURE_MODULES:
            ops = ", ".join(sorted(getattr(op, "__name__", repr(op)) for op in planners))
            raise TypeError(f"explain takes one of flyquant's kernel-backed ops ({ops}) or a pure-PyTorch function "
                            f"of flyquant's {', '.join(PURE_MODULES)} modules; got {name} (for a function that calls "
                            "these ops, explain each op it calls)")
    try:  # the planners' own signatures are private: a missing argument named _explain_sorting()
        signature = inspect.signature(fn)
    except (TypeError, ValueError):  # no signature to check against
        signature = None
    if signature is not None:
        try:
            signature.bind(*args, **kwargs)
        except TypeError as exc:
            raise TypeError(f"explain({name}, ...): the arguments do not fit {name}{signature}: {exc}") from None
    if planner is None:
        plan = Plan(name, "reference", "tensor's device", reasons=(f"{name} is a pure-PyTorch op with no kernel",))
    else:
        plan = planner(*args, **kwargs)
    for each in plan if isinstance(plan, tuple) else (plan,):  # fused_moe: three ops, three plans
        print(each)
    return plan


def _explain_mxfp8(x, axis=-1, scaling_mode="rceil", scale_layout=None, offs=None, signed_zeros=True):
    axis = reference.check_mxfp8_2d(x, axis, scaling_mode, scale_layout, offs)
    return select.plan_mxfp8_quantize(x, axis, scaling_mode, scale_layout, offs, validate.flag(signed_zeros, "signed_zeros"))


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


def _explain_3d(w, scaling_mode="rceil", scale_block_k=1, scale_layout=None, signed_zeros=True):
    scale_block_k = reference.check_mxfp8_3d(w, scaling_mode, scale_block_k, scale_layout)
    return select.plan_mxfp8_quantize_3d(w, scaling_mode, scale_block_k, scale_layout,
                                         validate.flag(signed_zeros, "signed_zeros"))
