"""The A16W4 MoE stage-1 reference (flyquant.reference.moe_gemm1_a16w4) against an independent
formulation: weights shuffled by aiter's own functions (gate_up=True) and dequantized by aiter's
FP4/E8M0 decoders, then a per-token loop over the routing (no sorting) in float64 with torch's
own activations (F.silu, F.gelu(approximate="tanh")) and GPT-OSS's gate written out on
interleaved columns, as transformers' GptOssExperts applies it.

Tolerance (per element, derived). The reference computes g and u in FP32 (K products and one bias
add: |dg| <= (K + 1) * 2^-24 * (|x| @ |Wg|^T + |bg|), likewise du), applies the activation in FP32
(a few roundings of terms of size |g|, |u|: at most 2^-20 * (|g| + 1) * (|u| + 1) together) and
rounds once to bf16 (2^-8 relative). The activations' partial derivatives are bounded:
|d act / dg| <= 1.2 * (|u| + 1) (silu: sigmoid(g) * (1 + g * (1 - sigmoid(g))) <= 1.1; gelu_tanh'
<= 1.13; g * sigmoid(1.702 g)' <= 1.1, times |u + 1| for GPT-OSS) and |d act / du| <= |g| + 1, so
    |ref - exact| <= 2^-8 * |exact| + (1 + 2^-8) * (1.2 (|u| + 1) dg + (|g| + 1) du
                                                   + 2^-20 (|g| + 1)(|u| + 1)) (* |w| with weights).
A gate/up swap, a wrong row or a missing bias moves elements by O(|g|), far outside this.
"""

import pytest
import torch
import torch.nn.functional as F

from flyquant import layouts
from flyquant import reference as R
from flyquant.moe import moe_sorting

import oracles
from test_moe_sorting import random_routing

FP32_EPS = 2.0**-24
BF16_U = 2.0**-8
DERIV_G = 1.2
ACT_ROUNDING = 2.0**-20


def gpt_oss_gate(gate, up, alpha=1.702, limit=7.0):
    """transformers' GptOssExperts gate on already de-interleaved gate / up values (float64)."""
    gate = torch.minimum(gate, torch.tensor(limit, dtype=gate.dtype))
    up = torch.maximum(torch.minimum(up, torch.tensor(limit, dtype=up.dtype)), torch.tensor(-limit, dtype=up.dtype))
    return (up + 1) * (gate * torch.sigmoid(gate * alpha))


def act64(g, u, activation):
    if activation == "silu":
        return F.silu(g) * u
    if activation == "gelu":
        return F.gelu(g, approximate="tanh") * u
    return gpt_oss_gate(g, u)


def make_problem(tokens, topk, experts, half, k_pad, seed, bias_on=True):
    """w: (E, 2 * half, k_pad) gate rows then up rows, quantized (floor); x bf16; bias (E, 2*half)."""
    gen = torch.Generator().manual_seed(seed)
    w = torch.randn(experts, 2 * half, k_pad, generator=gen) * 0.1
    packed, scales = R.quantize_mxfp4(w, "floor")
    topk_ids, topk_weights = random_routing(tokens, topk, experts, seed, skew=True)
    x = torch.randn(tokens, k_pad, generator=gen).bfloat16()
    bias = torch.randn(experts, 2 * half, generator=gen) if bias_on else None
    return packed, scales, topk_ids, topk_weights, x, bias


def dense_expected(x, packed, scales, topk_ids, topk_weights, bias, activation, apply_weights, model_dim, inter_dim):
    """(expected (T*topk, inter_dim) float64, the tolerance of the module docstring)."""
    aiter = oracles.aiter_fp4_utils()
    weight = (aiter.mxfp4_to_f32(packed) * aiter.e8m0_to_f32(scales).repeat_interleave(32, dim=-1)).double()
    half = weight.shape[1] // 2
    k = model_dim
    tokens, topk = topk_ids.shape
    out = torch.zeros(tokens * topk, inter_dim, dtype=torch.float64)
    tol = torch.zeros_like(out)
    for t in range(tokens):
        xt = x[t, :k].double()
        for s in range(topk):
            e = int(topk_ids[t, s])
            wg, wu = weight[e, :inter_dim, :k], weight[e, half:half + inter_dim, :k]
            bg = bias[e, :inter_dim].double() if bias is not None else torch.zeros(inter_dim, dtype=torch.float64)
            bu = bias[e, half:half + inter_dim].double() if bias is not None else torch.zeros(inter_dim, dtype=torch.float64)
            g, u = wg @ xt + bg, wu @ xt + bu
            dg = (k + 1) * FP32_EPS * (wg.abs() @ xt.abs() + bg.abs())
            du = (k + 1) * FP32_EPS * (wu.abs() @ xt.abs() + bu.abs())
            wt = float(topk_weights[t, s]) if apply_weights else 1.0
            a = act64(g, u, activation) * wt
            prop = DERIV_G * (u.abs() + 1) * dg + (g.abs() + 1) * du + ACT_ROUNDING * (g.abs() + 1) * (u.abs() + 1)
            out[t * topk + s] = a
            tol[t * topk + s] = BF16_U * a.abs() + (1 + BF16_U) * abs(wt) * prop
    return out, tol


@pytest.mark.parametrize("activation", R.MOE_ACTIVATIONS)
@pytest.mark.parametrize("bias_on,apply_weights", [(False, False), (True, True), (True, False)])
def test_matches_dense_computation(activation, bias_on, apply_weights):
    # 7 tokens x top-2 over 4 experts (skewed: uneven counts); gate/up halves of 48 rows padded to
    # 64 (aiter's gate_up shuffle: 16-row packs, scales in 32-row tiles), K = 256 with model_dim 224
    tokens, topk, experts, half, k, block_m = 7, 2, 4, 64, 256, 16
    model_dim, inter_dim = 224, 48
    packed, scales, topk_ids, topk_weights, x, bias = make_problem(tokens, topk, experts, half, k, seed=50,
                                                                   bias_on=bias_on)
    aiter = oracles.aiter_shuffle()
    w1 = aiter.shuffle_weight_a16w4(packed, 16, True)
    w1_scale = aiter.shuffle_scale_a16w4(scales.view(experts * 2 * half, k // 32), experts, True)
    sorting = moe_sorting(topk_ids, topk_weights, experts, block_m)
    out = R.moe_gemm1_a16w4(x, w1, w1_scale, *sorting, topk=topk, block_m=block_m, bias=bias, activation=activation,
                            apply_weights=apply_weights, model_dim=model_dim, inter_dim=inter_dim)
    assert out.dtype == torch.bfloat16 and out.shape == (tokens * topk, inter_dim)
    expected, tol = dense_expected(x, packed, scales, topk_ids, topk_weights, bias, activation, apply_weights,
                                   model_dim, inter_dim)
    err = (out.double() - expected).abs()
    assert (err <= tol).all(), f"max excess {(err - tol).max().item()}"
    # the tolerance is far below the size of the values (the test can fail)
    assert (tol < 0.05 * expected.abs().max()).all()


def test_untouched_rows_and_columns():
    """Rows no routed pair maps to and columns past inter_dim keep a given out's values; the pairs of
    an expert masked off (expert parallelism) are such rows."""
    tokens, topk, experts, half, k, block_m = 5, 2, 4, 32, 256, 16
    packed, scales, topk_ids, topk_weights, x, bias = make_problem(tokens, topk, experts, half, k, seed=51)
    w1 = layouts.shuffle_weight_a16w4(packed, gate_up=True)
    w1_scale = layouts.shuffle_scale_a16w4(scales, experts, gate_up=True)
    mask = torch.tensor([1, 0, 1, 1])  # expert 1 served elsewhere
    local = [0, 2, 3]
    w1l = layouts.shuffle_weight_a16w4(packed[local].contiguous(), gate_up=True)
    s1l = layouts.shuffle_scale_a16w4(scales[local].contiguous(), 3, gate_up=True)
    sorting = moe_sorting(topk_ids, topk_weights, experts, block_m, expert_mask=mask)
    sentinel = torch.full((tokens * topk, half + 3), 1234.0, dtype=torch.bfloat16)
    out = R.moe_gemm1_a16w4(x, w1l, s1l, *sorting, topk=topk, block_m=block_m, bias=bias[local], out=sentinel.clone(),
                            inter_dim=half)
    served = torch.tensor([mask[int(e)] == 1 for e in topk_ids.flatten()])
    assert (out[~served] == 1234.0).all() and (out[:, half:] == 1234.0).all()
    full = R.moe_gemm1_a16w4(x, w1, w1_scale, *moe_sorting(topk_ids, topk_weights, experts, block_m), topk=topk,
                             block_m=block_m, bias=bias)
    assert torch.equal(out[served, :half], full[served])
    assert served.sum() < served.numel()  # the routing does reach the masked expert


def test_nan_inf_propagate():
    """NaN / Inf in x reach every output of their token as IEEE arithmetic gives them (torch's formula)."""
    tokens, topk, experts, half, k, block_m = 3, 1, 2, 32, 256, 16
    packed, scales, topk_ids, topk_weights, x, bias = make_problem(tokens, topk, experts, half, k, seed=52)
    x[0, 5] = float("nan")
    x[1, 7] = float("inf")
    w1 = layouts.shuffle_weight_a16w4(packed, gate_up=True)
    w1_scale = layouts.shuffle_scale_a16w4(scales, experts, gate_up=True)
    sorting = moe_sorting(topk_ids, topk_weights, experts, block_m)
    for activation in R.MOE_ACTIVATIONS:
        out = R.moe_gemm1_a16w4(x, w1, w1_scale, *sorting, topk=topk, block_m=block_m, bias=bias,
                                activation=activation)
        assert out[0].isnan().all()  # NaN passes the GPT-OSS clamps too
        assert not out[1].isfinite().all()
        assert out[2].isfinite().all()


def test_gate_up_rows_from_interleaved_matches_gpt_oss_experts():
    """transformers' GPT-OSS layout: gate_up_proj (E, hidden, 2I) applied as x @ W, gate = even
    columns, up = odd columns, bias interleaved alike. The helper's gate-then-up rows (inter padded
    from 40 to 64), quantized and shuffled, give through the reference what the GPT-OSS expert
    computes on the interleaved weights (those weights MXFP4-representable, so the two sides hold the
    same values), within the docstring's tolerance."""
    experts, hidden, inter, pad, tokens, topk, block_m = 3, 256, 40, 64, 6, 2, 16
    gen = torch.Generator().manual_seed(53)
    rows = torch.randn(experts, 2 * inter, hidden, generator=gen) * 0.1
    rows = R.dequantize_mxfp4(*R.quantize_mxfp4(rows, "floor"))  # representable values
    gate_up_proj = torch.empty(experts, hidden, 2 * inter)
    gate_up_proj[..., 0::2] = rows[:, :inter].transpose(1, 2)
    gate_up_proj[..., 1::2] = rows[:, inter:].transpose(1, 2)
    gate_up_bias = torch.randn(experts, 2 * inter, generator=gen)
    w, b = R.gate_up_rows_from_interleaved(gate_up_proj, gate_up_bias, inter_pad=pad)
    assert w.shape == (experts, 2 * pad, hidden) and b.shape == (experts, 2 * pad)
    assert (w[:, inter:pad] == 0).all() and (w[:, pad + inter:] == 0).all() and (b[:, inter:pad] == 0).all()
    packed, scales = R.quantize_mxfp4(w, "floor")
    assert torch.equal(R.dequantize_mxfp4(packed, scales), w)  # lossless: the same values on both sides
    topk_ids, topk_weights = random_routing(tokens, topk, experts, 53)
    x = torch.randn(tokens, hidden, generator=gen).bfloat16()
    w1 = layouts.shuffle_weight_a16w4(packed, gate_up=True)
    w1_scale = layouts.shuffle_scale_a16w4(scales, experts, gate_up=True)
    out = R.moe_gemm1_a16w4(x, w1, w1_scale, *moe_sorting(topk_ids, topk_weights, experts, block_m), topk=topk,
                            block_m=block_m, bias=b, activation="swiglu_oai", inter_dim=inter)
    for t in range(tokens):
        for s in range(topk):
            e = int(topk_ids[t, s])
            gate_up = x[t].double() @ gate_up_proj[e].double() + gate_up_bias[e].double()
            g, u = gate_up[0::2], gate_up[1::2]
            expected = gpt_oss_gate(g, u)
            acc = (hidden + 1) * FP32_EPS * (x[t].double().abs() @ gate_up_proj[e].double().abs() + gate_up_bias[e].double().abs())
            tol = BF16_U * expected.abs() + (1 + BF16_U) * (
                DERIV_G * (u.abs() + 1) * acc[0::2] + (g.abs() + 1) * acc[1::2]
                + ACT_ROUNDING * (g.abs() + 1) * (u.abs() + 1))
            err = (out[t * topk + s].double() - expected).abs()
            assert (err <= tol).all(), (t, s, (err - tol).max().item())


def test_bad_input_raises():
    tokens, topk, experts, half, k, block_m = 4, 2, 2, 32, 256, 16
    packed, scales, topk_ids, topk_weights, x, bias = make_problem(tokens, topk, experts, half, k, seed=54)
    sorting = moe_sorting(topk_ids, topk_weights, experts, block_m)
    s1 = scales.view(experts * 2 * half, k // 32)
    with pytest.raises(ValueError, match="activation must be one of"):
        R.moe_gemm1_a16w4(x, packed, s1, *sorting, topk=topk, block_m=block_m, activation="relu")
    with pytest.raises(ValueError, match="bias must have shape"):
        R.moe_gemm1_a16w4(x, packed, s1, *sorting, topk=topk, block_m=block_m, bias=bias[:, :half])
    with pytest.raises(ValueError, match="out must have shape"):
        R.moe_gemm1_a16w4(x, packed, s1, *sorting, topk=topk, block_m=block_m,
                          out=torch.zeros(tokens, half, dtype=torch.bfloat16))
    with pytest.raises(ValueError, match="inter_dim = 40"):
        R.moe_gemm1_a16w4(x, packed, s1, *sorting, topk=topk, block_m=block_m, inter_dim=40)
    with pytest.raises(ValueError, match="model_dim = 300"):
        R.moe_gemm1_a16w4(x, packed, s1, *sorting, topk=topk, block_m=block_m, model_dim=300)
    with pytest.raises(ValueError, match="w1_scale must have shape"):
        R.moe_gemm1_a16w4(x, packed, s1[:, :4], *sorting, topk=topk, block_m=block_m)
    # the limits the kernel's accesses rely on, at the first size past them: out as wide as
    # inter_dim (a narrower one would be written past its rows), model_dim within x's width (not
    # only w1's K); and the true sizes are ints
    with pytest.raises(ValueError, match="out must have shape"):
        R.moe_gemm1_a16w4(x, packed, s1, *sorting, topk=topk, block_m=block_m,
                          out=torch.zeros(tokens * topk, half - 1, dtype=torch.bfloat16))
    with pytest.raises(ValueError, match=r"model_dim = 200 must be in \[1, min\(K = 2 \* w1.shape\[2\] = 256, x.shape\[1\] = 128\)"):
        R.moe_gemm1_a16w4(x[:, :128], packed, s1, *sorting, topk=topk, block_m=block_m, model_dim=200)
    for name in ("model_dim", "inter_dim"):
        with pytest.raises(ValueError, match=f"{name} = 16.0 must be in"):
            R.moe_gemm1_a16w4(x, packed, s1, *sorting, topk=topk, block_m=block_m, **{name: 16.0})


def test_activations_match_torch():
    """moe_activation against torch's own functions: silu, gelu with the tanh approximation, and
    GPT-OSS's swiglu as transformers' GptOssExperts computes it (the gate clamped from above only,
    the up projection both ways), on gates and ups reaching past the limit on both sides."""
    g = torch.linspace(-20, 20, 161)
    u = torch.linspace(9, -9, 161)
    torch.testing.assert_close(R.moe_activation(g, u, "silu"), F.silu(g) * u, rtol=1e-6, atol=1e-6)
    torch.testing.assert_close(R.moe_activation(g, u, "gelu"), F.gelu(g, approximate="tanh") * u, rtol=1e-6, atol=1e-6)
    alpha, limit = 1.702, 7.0
    gate, up = g.clamp(max=limit), u.clamp(-limit, limit)
    want = (up + 1) * gate * torch.sigmoid(gate * alpha)
    # atol far below g * sigmoid(alpha * g) at the clamp (-7: -4.6e-5), so a gate clamped below shows
    torch.testing.assert_close(R.moe_activation(g, u, "swiglu_oai", alpha, limit), want, rtol=1e-6, atol=1e-9)
    with pytest.raises(ValueError, match="gate_up_proj.shape"):
        R.gate_up_rows_from_interleaved(torch.zeros(2, 32, 7))
