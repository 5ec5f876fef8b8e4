"""Pure-PyTorch reference for the A16W4 MoE GEMMs (BF16 activations, MXFP4 expert weights): stage 1,
the gate/up projection with the activation fused (moe_gemm1_a16w4), and stage 2, the down
projection (moe_gemm2_a16w4), with the checks both backends share. flyquant.reference gives the
same names (fq.reference.moe_gemm1_a16w4 and so on).

Weights come shuffled as the kernels take them (shuffle_weight_a16w4 / shuffle_scale_a16w4,
aiter's layouts); the reference unshuffles them, dequantizes them exactly to FP32
(dequantize_mxfp4), computes every routed pair in FP32 and rounds once to the output dtype. Rows
are moe_sorting's: sorted id (slot << 24) | token, one expert per block of block_m rows.

Checks come in three parts: check_moe_gemm*_call look only at dtypes, shapes and devices (safe
while torch.compile traces), check_moe_gemm2_memory at addresses, check_moe_gemm2_values at the
sorted arrays' values (a host synchronisation on a GPU: the reference always runs it, the kernel
path only with FLYQUANT_DEBUG=1).
"""

from __future__ import annotations

import math

import torch

from . import layouts, validate
from .formats import F32_MAX, MX_BLOCK
from .reference import SCALE_DTYPE, dequantize_mxfp4

__all__ = [  # flyquant.reference gives these names too (its __getattr__)
    "GELU_TANH_C",
    "GELU_TANH_CUBIC",
    "MOE_ACTIVATIONS",
    "MOE_TOKEN_BITS",
    "MOE_TOKEN_MASK",
    "OUT_ALIGN_BYTES",
    "check_moe_gemm1_call",
    "check_moe_gemm2",
    "check_moe_gemm2_call",
    "check_moe_gemm2_memory",
    "check_moe_gemm2_values",
    "moe_activation",
    "moe_gemm1_a16w4",
    "moe_gemm2_a16w4",
    "moe_stage1_true_dims",
    "moe_true_dims",
]

# ------------------------------------------------------------------------------------------------
# A16W4 MoE stage 2 (down projection)
# ------------------------------------------------------------------------------------------------


def check_moe_gemm2(a2, w2, w2_scale, sorted_ids, sorted_weights, sorted_expert_ids, num_valid_ids, topk, block_m):
    validate.high_precision(a2, "a2", ndim=2)
    validate.tensor(w2, "w2", (torch.uint8, torch.float4_e2m1fn_x2), ndim=3)
    validate.tensor(w2_scale, "w2_scale", (SCALE_DTYPE, torch.uint8), ndim=(2, 3))
    validate.tensor(sorted_ids, "sorted_ids", (torch.int32,), ndim=1)
    validate.tensor(sorted_weights, "sorted_weights", (torch.float32,), ndim=1)
    validate.tensor(sorted_expert_ids, "sorted_expert_ids", (torch.int32,), ndim=1)
    validate.tensor(num_valid_ids, "num_valid_ids", (torch.int32,), ndim=1)
    for name, t in (("w2", w2), ("w2_scale", w2_scale), ("sorted_ids", sorted_ids), ("sorted_weights", sorted_weights),
                    ("sorted_expert_ids", sorted_expert_ids), ("num_valid_ids", num_valid_ids)):
        validate.same_device("a2", a2, name, t)
    _check_sorted_args(topk, block_m, sorted_ids, sorted_weights, sorted_expert_ids)
    if a2.shape[0] % topk:  # 0 rows (an expert-parallel rank with no tokens) is an empty batch
        raise ValueError(f"a2.shape[0] (tokens * topk rows) = {a2.shape[0]} must be a multiple of topk = {topk}")
    experts, n_pad, k_half = w2.shape
    expected = (experts, n_pad, 2 * k_half // MX_BLOCK)
    if w2_scale.dim() == 2:
        expected = (experts * n_pad, expected[2])
    validate.shape(w2_scale, "w2_scale", expected)


MOE_TOKEN_BITS = 24  # sorted id = (slot << 24) | token
MOE_TOKEN_MASK = (1 << MOE_TOKEN_BITS) - 1
OUT_ALIGN_BYTES = 4  # the kernel adds bf16 column pairs with packed 4-byte atomics


def check_moe_gemm2_call(a2, w2, w2_scale, sorted_ids, sorted_weights, sorted_expert_ids, num_valid_ids, topk,
                         block_m, out=None, bias=None, model_dim=None, inter_dim=None,
                         bias_name="bias") -> tuple[int, int, int]:
    """Everything both backends check before running the stage-2 GEMM (so they accept and refuse
    the same calls): types, shapes, devices, the true sizes, bias (E, >= model_dim), out (T,
    model_dim), no input requiring grad; errors name bias bias_name (fused_moe: b2). Reads no tensor's
    values nor addresses (no host synchronisation; torch.compile traces it); check_moe_gemm2_memory
    is the part on addresses. Returns (model_dim, inter_dim, tokens)."""
    check_moe_gemm2(a2, w2, w2_scale, sorted_ids, sorted_weights, sorted_expert_ids, num_valid_ids, topk, block_m)
    model_dim, inter_dim = moe_true_dims(a2, w2, model_dim, inter_dim)
    experts = w2.shape[0]
    tokens = a2.shape[0] // topk
    if bias is not None:
        validate.high_precision(bias, bias_name, ndim=2)
        validate.same_device("a2", a2, bias_name, bias)
        if bias.shape[0] != experts or bias.shape[1] < model_dim:
            raise ValueError(f"{bias_name} must have shape (E = {experts}, >= model_dim = {model_dim}), got {tuple(bias.shape)}")
    if out is not None:
        validate.tensor(out, "out", (torch.bfloat16, torch.float32), ndim=2)
        validate.same_device("a2", a2, "out", out)
        validate.shape(out, "out", (tokens, model_dim))
        validate.no_self_overlap(out, "out")
    validate.no_autograd("moe_gemm2_a16w4", dict(a2=a2, sorted_weights=sorted_weights, bias=bias, out=out))
    return model_dim, inter_dim, tokens


def check_out_aligned(out) -> None:
    """The stage-2 out starts at a 4-byte aligned address (on a real tensor)."""
    if out.data_ptr() % OUT_ALIGN_BYTES:
        raise ValueError(f"out must start at a {OUT_ALIGN_BYTES}-byte aligned address (a bf16 out at an even "
                         f"element offset): results are added as bf16 pairs; got address {out.data_ptr():#x}")


def check_moe_gemm2_memory(out, a2, w2, w2_scale, sorted_ids, sorted_weights, sorted_expert_ids, num_valid_ids,
                           bias=None) -> None:
    """The checks on addresses, made on real tensors (inside the op, not while tracing): out is
    4-byte aligned (the kernel adds bf16 column pairs with 4-byte atomics; both backends refuse
    alike) and shares no memory with any input."""
    check_out_aligned(out)
    validate.no_overlap(out, "out", dict(a2=a2, w2=w2, w2_scale=w2_scale, sorted_ids=sorted_ids,
                                         sorted_weights=sorted_weights, sorted_expert_ids=sorted_expert_ids,
                                         num_valid_ids=num_valid_ids, bias=bias))


def check_moe_gemm2_values(sorted_ids, sorted_expert_ids, num_valid_ids, topk, block_m, tokens, experts) -> None:
    """The checks that read the sorted arrays (a host synchronisation on a GPU): num_valid_ids[0]
    counts whole blocks (or all rows; negative: none), and every row in use (below it, token < T)
    has a slot below topk, holds a (token, slot) pair no other row in use holds, and lies in a
    block whose expert id is in [0, E). The device path checks with FLYQUANT_DEBUG=1; otherwise
    it drops bad rows and blocks (the rows of a partial block too: the kernel counts whole tiles)
    and may skip a repeated pair's rows (its grid holds T * topk rows in use)."""
    used = max(0, min(int(num_valid_ids[0]), sorted_ids.shape[0]))
    if used % block_m and used < sorted_ids.shape[0]:
        raise ValueError(f"num_valid_ids[0] = {int(num_valid_ids[0])} must be a multiple of block_m = {block_m} "
                         f"(whole blocks, as moe_sorting gives), at least len(sorted_ids), or negative (no rows)")
    ids = sorted_ids[:used].to("cpu", torch.int64)
    live = (ids & MOE_TOKEN_MASK) < tokens
    slot = torch.bitwise_right_shift(ids, MOE_TOKEN_BITS)
    bad = live & ((slot < 0) | (slot >= topk))
    if bad.any():
        row = int(bad.nonzero()[0])
        raise ValueError(f"sorted_ids[{row}] = {int(ids[row]):#x} has slot {int(slot[row])}: a row in use (below "
                         f"num_valid_ids[0], token < T = {tokens}) must have a slot in [0, topk = {topk})")
    pairs, first = torch.unique(ids[live], return_inverse=True)
    if pairs.numel() < int(live.sum()):
        # the kernels size their grid for at most T * topk rows in use (kernels._a16w4_common.m_grid)
        seen = torch.zeros(pairs.numel(), dtype=torch.bool)
        for row, pair in zip(live.nonzero().flatten().tolist(), first.tolist()):
            if seen[pair]:
                raise ValueError(f"sorted_ids[{row}] = {int(ids[row]):#x} repeats a (token, slot) pair of an earlier "
                                 "row in use: each routed pair is one row, as moe_sorting gives")
            seen[pair] = True
    blocks = torch.unique(torch.arange(used)[live] // block_m)
    expert = sorted_expert_ids.to("cpu", torch.int64)[blocks]
    bad = (expert < 0) | (expert >= experts)
    if bad.any():
        block = int(blocks[bad.nonzero()[0]])
        raise ValueError(f"sorted_expert_ids[{block}] = {int(expert[bad][0])} must be in [0, E = w2.shape[0] = "
                         f"{experts}) (block {block} holds rows in use)")


def _check_sorted_args(topk, block_m, sorted_ids, sorted_weights, sorted_expert_ids) -> None:
    """topk and block_m positive ints; the sorted arrays' lengths agree with block_m (both stages)."""
    if not validate.is_int(topk) or topk <= 0:
        raise ValueError(f"topk must be a positive int, got {topk!r}")
    if not validate.is_int(block_m) or block_m <= 0:
        raise ValueError(f"block_m must be a positive int, got {block_m!r}")
    validate.shape(sorted_weights, "sorted_weights", tuple(sorted_ids.shape))
    blocks = (sorted_ids.shape[0] + block_m - 1) // block_m
    if sorted_expert_ids.shape[0] < blocks:
        raise ValueError(f"sorted_expert_ids must have ceil(len(sorted_ids) / block_m) = {blocks} entries, got {sorted_expert_ids.shape[0]}")


def moe_true_dims(a2, w2, model_dim=None, inter_dim=None) -> tuple[int, int]:
    """The true (model_dim, inter_dim): given, or the padded weights' N and a2's width."""
    _, n_pad, k_half = w2.shape
    model_dim = n_pad if model_dim is None else validate.as_int(model_dim)
    inter_dim = a2.shape[1] if inter_dim is None else validate.as_int(inter_dim)
    if not validate.is_int(model_dim) or not 0 < model_dim <= n_pad:
        raise ValueError(f"model_dim = {model_dim} must be in [1, w2.shape[1] = {n_pad}]")
    if not validate.is_int(inter_dim) or not 0 < inter_dim <= min(2 * k_half, a2.shape[1]):
        raise ValueError(f"inter_dim = {inter_dim} must be in [1, min(K = 2 * w2.shape[2] = {2 * k_half}, a2.shape[1] = {a2.shape[1]})]")
    return model_dim, inter_dim


def moe_gemm2_a16w4(a2, w2, w2_scale, sorted_ids, sorted_weights, sorted_expert_ids, num_valid_ids, topk, block_m,
                    out=None, bias=None, apply_weights=True, out_dtype=torch.bfloat16, model_dim=None, inter_dim=None,
                    nlane=16):
    """FP32 reference of the A16W4 MoE down projection (aiter torch_moe_stage2, per_1x32 weights).

    out[t] (+)= sum over the pairs (t, slot) routed to expert e of
        w_(t,slot) * (a2[t * topk + slot, :inter_dim] @ W[e][:model_dim, :inter_dim]^T + bias[e])
    where W[e] = dequantize_mxfp4 of the unshuffled weights, w the sorted routing weight (1 when
    apply_weights is False). Computed in FP32, rounded once to the output dtype.

    a2: (T * topk, >= inter_dim) BF16/FP16/FP32, token-major stage-1 output. w2: (E, N, K/2)
    packed FP4 and w2_scale: (E*N, K/32) or (E, N, K/32) E8M0, both shuffled as the kernel takes
    them (shuffle_weight_a16w4 with `nlane`, shuffle_scale_a16w4; N, K may be padded beyond
    model_dim, inter_dim). sorted_*, num_valid_ids: moe_sorting's outputs for this block_m; only
    rows below num_valid_ids[0] whose token is < T count. bias: (E, >= model_dim). out: (T,
    model_dim), added into in its own dtype (out_dtype is then not used); None: a new out_dtype
    tensor. model_dim / inter_dim default to N and a2.shape[1].
    """
    model_dim, inter_dim, tokens = check_moe_gemm2_call(
        a2, w2, w2_scale, sorted_ids, sorted_weights, sorted_expert_ids, num_valid_ids, topk, block_m, out=out,
        bias=bias, model_dim=model_dim, inter_dim=inter_dim)
    if out is not None:
        check_moe_gemm2_memory(out, a2, w2, w2_scale, sorted_ids, sorted_weights, sorted_expert_ids, num_valid_ids,
                               bias)
    experts, n_pad, _ = w2.shape
    check_moe_gemm2_values(sorted_ids, sorted_expert_ids, num_valid_ids, topk, block_m, tokens, experts)

    w = layouts.unshuffle_weight_a16w4(w2, nlane)
    s = layouts.unshuffle_scale_a16w4(w2_scale, experts).reshape(experts, n_pad, -1)
    weight = dequantize_mxfp4(w, s)[:, :model_dim, :inter_dim]  # (E, model_dim, inter_dim) FP32

    rows = torch.arange(sorted_ids.shape[0], device=a2.device)
    token = sorted_ids & MOE_TOKEN_MASK
    slot = torch.bitwise_right_shift(sorted_ids, MOE_TOKEN_BITS)
    valid = (rows < num_valid_ids[0]) & (token < tokens)
    expert = sorted_expert_ids[rows // block_m]
    acc = torch.zeros(tokens, model_dim, dtype=torch.float32, device=a2.device)
    for e in torch.unique(expert[valid]).tolist():
        sel = valid & (expert == e)
        t, k = token[sel].long(), slot[sel].long()
        y = a2[t * topk + k, :inter_dim].to(torch.float32) @ weight[e].t()
        if bias is not None:
            y = y + bias[e, :model_dim].to(torch.float32)
        if apply_weights:
            y = y * sorted_weights[sel].unsqueeze(1)
        acc.index_add_(0, t, y)
    if out is None:
        return acc.to(out_dtype)
    out.copy_(out.to(torch.float32) + acc)
    return out


# ------------------------------------------------------------------------------------------------
# A16W4 MoE stage 1: gate/up projection with the activation fused
# ------------------------------------------------------------------------------------------------

MOE_ACTIVATIONS = ("silu", "gelu", "swiglu_oai")
GELU_TANH_C = 0.7978845608028654  # sqrt(2 / pi)
GELU_TANH_CUBIC = 0.044715


def moe_activation(g: torch.Tensor, u: torch.Tensor, activation: str, alpha: float = 1.702, limit: float = 7.0):
    """act(gate, up) in the tensors' dtype (the contract: FP32), elementwise:

    - "silu":  silu(g) * u = g * sigmoid(g) * u (the SwiGLU of Mixtral / DeepSeek / Qwen MoE).
    - "gelu":  gelu_tanh(g) * u, gelu_tanh(g) = g/2 * (1 + tanh(sqrt(2/pi) * (g + 0.044715 g^3))).
    - "swiglu_oai" (GPT-OSS): g' = min(g, limit), u' = clamp(u, -limit, limit),
      (u' + 1) * g' * sigmoid(alpha * g'). This is what transformers' GPT-OSS experts compute in
      `_apply_gate` (there on the even/odd interleaved columns of gate_up_proj) and what aiter's
      torch_moe_stage1 reference computes with its `swiglu` helper (there on gate rows then up
      rows, as here). The clamps are torch.clamp: a NaN stays NaN.
    NaN and Inf propagate as these formulas do in IEEE arithmetic (e.g. silu(-inf) * u is NaN)."""
    if activation == "silu":
        return g * torch.sigmoid(g) * u
    if activation == "gelu":
        return 0.5 * g * (1 + torch.tanh(GELU_TANH_C * (g + GELU_TANH_CUBIC * g * g * g))) * u
    if activation == "swiglu_oai":
        g = g.clamp(max=limit)
        u = u.clamp(min=-limit, max=limit)
        return (u + 1) * (g * torch.sigmoid(alpha * g))
    raise ValueError(f"activation must be one of {MOE_ACTIVATIONS}, got {activation!r}")


def moe_stage1_true_dims(x, w1, model_dim=None, inter_dim=None) -> tuple[int, int]:
    """The true (model_dim, inter_dim): given, or x's width and half the weights' rows."""
    _, n2, k_half = w1.shape
    model_dim = x.shape[1] if model_dim is None else validate.as_int(model_dim)
    inter_dim = n2 // 2 if inter_dim is None else validate.as_int(inter_dim)
    if not validate.is_int(model_dim) or not 0 < model_dim <= min(2 * k_half, x.shape[1]):
        raise ValueError(f"model_dim = {model_dim} must be in [1, min(K = 2 * w1.shape[2] = {2 * k_half}, x.shape[1] = {x.shape[1]})]")
    if not validate.is_int(inter_dim) or not 0 < inter_dim <= n2 // 2:
        raise ValueError(f"inter_dim = {inter_dim} must be in [1, w1.shape[1] / 2 = {n2 // 2}]")
    return model_dim, inter_dim


def check_activation_args(activation: str, alpha, limit) -> None:
    """alpha and limit real numbers (whatever the activation: float() took "7", True, a tensor);
    swiglu_oai's alpha finite in FP32 (a NaN or infinite one, or one past FLT_MAX, gave a NaN
    layer or a step for the sigmoid, without an error) and its limit >= 0 (+inf: no clamp). A
    negative or NaN limit has no meaning, and the kernels' clamps (v_med3_f32) and torch.clamp
    would disagree on it; a finite one above FLT_MAX is +inf in FP32 (torch.clamp refuses it, the
    kernels took it for a finite clamp): refused on both backends."""
    validate.real_number(alpha, "alpha")
    validate.real_number(limit, "limit")
    if activation != "swiglu_oai":
        return
    if not abs(float(alpha)) <= F32_MAX:  # NaN too
        raise ValueError(f"alpha must be finite in FP32 (|alpha| <= FLT_MAX) for swiglu_oai (g * sigmoid(alpha * "
                         f"g); GPT-OSS: 1.702), got {alpha!r}")
    if not (float(limit) >= 0 and (float(limit) <= F32_MAX or float(limit) == math.inf)):
        raise ValueError(f"limit must be >= 0 for swiglu_oai, at most FLT_MAX = {F32_MAX!r} or inf (no clamp) (u is "
                         f"clamped to [-limit, limit], g to at most limit; GPT-OSS: 7.0), got {limit!r}")


def check_moe_gemm1_call(x, w1, w1_scale, sorted_ids, sorted_weights, sorted_expert_ids, num_valid_ids, topk,
                         block_m, bias=None, activation="silu", out=None, model_dim=None,
                         inter_dim=None, limit=7.0, alpha=1.702, bias_name="bias") -> tuple[int, int, int]:
    """Everything both backends check before running stage 1 (no tensor values or addresses read):
    types, shapes, devices, the true sizes, bias (E, w1.shape[1]) in w1's row order, out
    (T * topk, >= inter_dim) bf16, the activation name, alpha and limit (check_activation_args);
    errors name bias bias_name (fused_moe: b1). Returns (model_dim, inter_dim, tokens)."""
    validate.high_precision(x, "x", ndim=2)
    validate.tensor(w1, "w1", (torch.uint8, torch.float4_e2m1fn_x2), ndim=3)
    validate.tensor(w1_scale, "w1_scale", (SCALE_DTYPE, torch.uint8), ndim=(2, 3))
    for name, t, dt in (("sorted_ids", sorted_ids, torch.int32), ("sorted_weights", sorted_weights, torch.float32),
                        ("sorted_expert_ids", sorted_expert_ids, torch.int32), ("num_valid_ids", num_valid_ids, torch.int32)):
        validate.tensor(t, name, (dt,), ndim=1)
        validate.same_device("x", x, name, t)
    for name, t in (("w1", w1), ("w1_scale", w1_scale)):
        validate.same_device("x", x, name, t)
    _check_sorted_args(topk, block_m, sorted_ids, sorted_weights, sorted_expert_ids)
    if activation not in MOE_ACTIVATIONS:
        raise ValueError(f"activation must be one of {MOE_ACTIVATIONS}, got {activation!r}")
    check_activation_args(activation, alpha, limit)
    experts, n2, k_half = w1.shape
    if n2 % 2:
        raise ValueError(f"w1.shape[1] = {n2} must be even (gate rows then up rows)")
    expected = (experts, n2, 2 * k_half // MX_BLOCK)
    if w1_scale.dim() == 2:
        expected = (experts * n2, expected[2])
    validate.shape(w1_scale, "w1_scale", expected)
    model_dim, inter_dim = moe_stage1_true_dims(x, w1, model_dim, inter_dim)
    tokens = x.shape[0]
    if bias is not None:
        validate.high_precision(bias, bias_name, ndim=2)
        validate.same_device("x", x, bias_name, bias)
        validate.shape(bias, bias_name, (experts, n2))
    if out is not None:
        validate.tensor(out, "out", (torch.bfloat16,), ndim=2)
        validate.same_device("x", x, "out", out)
        if out.shape[0] != tokens * topk or out.shape[1] < inter_dim:
            raise ValueError(f"out must have shape (T * topk = {tokens * topk}, >= inter_dim = {inter_dim}), got {tuple(out.shape)}")
        validate.no_self_overlap(out, "out")
    validate.no_autograd("moe_gemm1_a16w4", dict(x=x, sorted_weights=sorted_weights, bias=bias, out=out))
    return model_dim, inter_dim, tokens


def moe_gemm1_a16w4(x, w1, w1_scale, sorted_ids, sorted_weights, sorted_expert_ids, num_valid_ids, topk, block_m,
                    bias=None, activation="silu", alpha=1.702, limit=7.0, apply_weights=False, out=None,
                    model_dim=None, inter_dim=None, nlane=16):
    """FP32 reference of the A16W4 MoE stage 1 (gate/up projection, activation fused).

    For every sorted row below num_valid_ids[0] with token t < T (slot k, expert e of its block):
        g = x[t, :model_dim] @ Wg[e]^T + bg[e],   u = x[t, :model_dim] @ Wu[e]^T + bu[e]
        out[t * topk + k, :inter_dim] = bf16(act(g, u) * (w_r if apply_weights else 1))
    in FP32, rounded once to bf16 (moe_activation gives act; the bias enters before it, as in
    aiter's torch_moe_stage1 and transformers' GPT-OSS experts). Wg[e] and Wu[e] are rows
    [0, inter_dim) and [P, P + inter_dim) of the dequantized w1[e], P = w1.shape[1] / 2.

    x: (T, >= model_dim) BF16/FP16/FP32. w1: (E, 2 * P, K / 2) packed FP4 and w1_scale:
    (E * 2P, K / 32) or (E, 2P, K / 32) E8M0, shuffled with gate_up=True (shuffle_weight_a16w4
    with `nlane`, shuffle_scale_a16w4); P >= inter_dim and K >= model_dim may be padding.
    bias: (E, 2 * P) in w1's row order (gate_up_rows_from_interleaved gives it from GPT-OSS's).
    out: (T * topk, >= inter_dim) bf16: rows that no routed pair maps to, and columns past
    inter_dim, keep their values; None: a zeroed (T * topk, inter_dim) bf16 tensor. Returns out.
    """
    model_dim, inter_dim, tokens = check_moe_gemm1_call(
        x, w1, w1_scale, sorted_ids, sorted_weights, sorted_expert_ids, num_valid_ids, topk, block_m, bias=bias,
        activation=activation, out=out, model_dim=model_dim, inter_dim=inter_dim, limit=limit, alpha=alpha)
    experts, n2, _ = w1.shape
    check_moe_gemm2_values(sorted_ids, sorted_expert_ids, num_valid_ids, topk, block_m, tokens, experts)
    if out is None:
        out = torch.zeros(tokens * topk, inter_dim, dtype=torch.bfloat16, device=x.device)
    else:
        validate.no_overlap(out, "out", dict(x=x, w1=w1, w1_scale=w1_scale, sorted_ids=sorted_ids,
                                             sorted_weights=sorted_weights, sorted_expert_ids=sorted_expert_ids,
                                             num_valid_ids=num_valid_ids, bias=bias))
    half = n2 // 2
    w = layouts.unshuffle_weight_a16w4(w1, nlane, gate_up=True)
    s = layouts.unshuffle_scale_a16w4(w1_scale, experts, gate_up=True).reshape(experts, n2, -1)
    weight = dequantize_mxfp4(w, s)[:, :, :model_dim]  # (E, 2P, model_dim) FP32

    rows = torch.arange(sorted_ids.shape[0], device=x.device)
    token = sorted_ids & MOE_TOKEN_MASK
    slot = torch.bitwise_right_shift(sorted_ids, MOE_TOKEN_BITS)
    valid = (rows < num_valid_ids[0]) & (token < tokens)
    expert = sorted_expert_ids[rows // block_m]
    for e in torch.unique(expert[valid]).tolist():
        sel = valid & (expert == e)
        t, k = token[sel].long(), slot[sel].long()
        xe = x[t, :model_dim].to(torch.float32)
        g = xe @ weight[e, :inter_dim].t()
        u = xe @ weight[e, half:half + inter_dim].t()
        if bias is not None:
            g = g + bias[e, :inter_dim].to(torch.float32)
            u = u + bias[e, half:half + inter_dim].to(torch.float32)
        a = moe_activation(g, u, activation, alpha, limit)
        if apply_weights:
            a = a * sorted_weights[sel].unsqueeze(1)
        out[t * topk + k, :inter_dim] = a.to(torch.bfloat16)
    return out
