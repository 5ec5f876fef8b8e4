"""The A16W4 MoE stage-2 reference against an independent dense computation: weights shuffled by
aiter's own functions and dequantized by aiter's FP4/E8M0 decoders, then a per-token loop over
the routing (no sorting) in float64.

Tolerance: both sides sum the same FP32 products; the reference in FP32 (inner products of length
inter_dim, then <= topk additions), the check in float64. Each FP32 sum of n terms is within
n * 2^-24 * sum|terms| of exact, so |error| <= (inter_dim + topk + 1) * 2^-24 * S with S the sum of
|w| * (|a| @ |W|^T + |b|) per output element; asserted element-wise.
"""

import pytest
import torch

from flyquant import reference as R
from flyquant.moe import moe_sorting

import oracles
from test_moe_sorting import random_routing

FP32_EPS = 2.0**-24


def make_problem(tokens, topk, experts, n_pad, k_pad, seed):
    gen = torch.Generator().manual_seed(seed)
    w = torch.randn(experts, n_pad, k_pad, generator=gen) * 0.05
    packed, scales = R.quantize_mxfp4(w, "floor")
    topk_ids, topk_weights = random_routing(tokens, topk, experts, seed)
    a2 = torch.randn(tokens * topk, k_pad, generator=gen).bfloat16()
    bias = torch.randn(experts, n_pad, generator=gen)
    return packed, scales, topk_ids, topk_weights, a2, bias


def dense_expected(a2, packed, scales, topk_ids, topk_weights, topk, bias, apply_weights, model_dim, inter_dim,
                   expert_map=None):
    """out[t] = sum_k w_tk * (a2[t*topk+k] @ W[e]^T + b[e]) in float64, plus the bound's scale S."""
    aiter = oracles.aiter_fp4_utils()
    weight = (aiter.mxfp4_to_f32(packed) * aiter.e8m0_to_f32(scales).repeat_interleave(32, dim=-1)).double()
    weight = weight[:, :model_dim, :inter_dim]
    tokens = topk_ids.shape[0]
    out = torch.zeros(tokens, model_dim, dtype=torch.float64)
    scale = torch.zeros_like(out)
    for t in range(tokens):
        for k in range(topk):
            e = int(topk_ids[t, k])
            if expert_map is not None:
                if expert_map[e] < 0:
                    continue  # another rank serves this expert
                e = expert_map[e]
            a = a2[t * topk + k, :inter_dim].double()
            wt = topk_weights[t, k].double() if apply_weights else 1.0
            b = bias[e, :model_dim].double() if bias is not None else 0.0
            out[t] += wt * (weight[e] @ a + b)
            scale[t] += abs(wt) * (weight[e].abs() @ a.abs() + (b.abs() if bias is not None else 0.0))
    return out, scale


def assert_within_bound(actual, expected, scale, terms):
    err = (actual.double() - expected).abs()
    bound = (terms + 1) * FP32_EPS * scale
    assert (err <= bound).all(), f"max excess {(err - bound).max().item()}"


@pytest.mark.parametrize("bias_on", [False, True])
@pytest.mark.parametrize("apply_weights", [True, False])
def test_matches_dense_computation(bias_on, apply_weights):
    # 9 tokens x top-2 over 4 experts; N = 64 (two 32-row scale tiles), K = 256 (one 256 K tile)
    tokens, topk, experts, n, k, block_m = 9, 2, 4, 64, 256, 16
    packed, scales, topk_ids, topk_weights, a2, bias = make_problem(tokens, topk, experts, n, k, seed=40)
    bias = bias if bias_on else None
    aiter = oracles.aiter_shuffle()
    w2 = aiter.shuffle_weight_a16w4(packed, 16, False)
    w2_scale = aiter.shuffle_scale_a16w4(scales.view(experts * n, k // 32), experts, False)
    sorting = moe_sorting(topk_ids, topk_weights, experts, block_m)
    out = R.moe_gemm2_a16w4(a2, w2, w2_scale, *sorting, topk=topk, block_m=block_m, bias=bias,
                            apply_weights=apply_weights, out_dtype=torch.float32)
    expected, scale = dense_expected(a2, packed, scales, topk_ids, topk_weights, topk, bias, apply_weights, n, k)
    assert out.dtype == torch.float32 and out.shape == (tokens, n)
    assert_within_bound(out, expected, scale, k + topk)
    # the default BF16 output is the FP32 result rounded once
    out_bf16 = R.moe_gemm2_a16w4(a2, w2, w2_scale, *sorting, topk=topk, block_m=block_m, bias=bias,
                                 apply_weights=apply_weights)
    assert out_bf16.dtype == torch.bfloat16 and torch.equal(out_bf16, out.bfloat16())


def test_out_accumulates_and_padded_dims_and_3d_scales():
    """GPT-OSS-style padding: weights (N, K) = (64, 512) hold model_dim 48 and inter_dim 400; the
    scales given in their (E, N, K/32) form; `out` holds earlier results that are added to."""
    tokens, topk, experts, n, k, block_m = 6, 2, 3, 64, 512, 32
    model_dim, inter_dim = 48, 400
    packed, scales, topk_ids, topk_weights, a2, bias = make_problem(tokens, topk, experts, n, k, seed=41)
    a2 = a2[:, :inter_dim].contiguous()
    aiter = oracles.aiter_shuffle()
    w2 = aiter.shuffle_weight_a16w4(packed, 16, False)
    w2_scale = aiter.shuffle_scale_a16w4(scales.view(experts * n, k // 32), experts, False).view(experts, n, k // 32)
    sorting = moe_sorting(topk_ids, topk_weights, experts, block_m)
    initial = torch.randn(tokens, model_dim)
    out = initial.clone()
    result = R.moe_gemm2_a16w4(a2, w2, w2_scale, *sorting, topk=topk, block_m=block_m, out=out, bias=bias,
                               model_dim=model_dim, inter_dim=inter_dim)
    assert result is out
    expected, scale = dense_expected(a2, packed, scales, topk_ids, topk_weights, topk, bias, True, model_dim, inter_dim)
    assert_within_bound(out - initial, expected, scale + initial.abs().double(), inter_dim + topk + 1)


def test_expert_mask_keeps_local_experts_only():
    """Expert parallelism: this rank serves global experts 1 and 3 (local 0 and 1) and holds only
    their weights; pairs routed elsewhere contribute nothing here."""
    tokens, topk, experts, n, k, block_m = 8, 2, 4, 32, 256, 16
    packed, scales, topk_ids, topk_weights, a2, _ = make_problem(tokens, topk, experts, n, k, seed=42)
    mask = torch.tensor([0, 1, 0, 1])
    local = [1, 3]
    aiter = oracles.aiter_shuffle()
    w2 = aiter.shuffle_weight_a16w4(packed[local].contiguous(), 16, False)
    w2_scale = aiter.shuffle_scale_a16w4(scales[local].reshape(2 * n, k // 32), 2, False)
    sorting = moe_sorting(topk_ids, topk_weights, experts, block_m, expert_mask=mask)
    out = R.moe_gemm2_a16w4(a2, w2, w2_scale, *sorting, topk=topk, block_m=block_m, out_dtype=torch.float32)
    expected, scale = dense_expected(a2, packed[local], scales[local], topk_ids, topk_weights, topk, None, True, n, k,
                                     expert_map=[-1, 0, -1, 1])
    assert_within_bound(out, expected, scale, k + topk)


def test_bad_input_raises():
    tokens, topk, experts, n, k, block_m = 4, 2, 2, 32, 256, 16
    packed, scales, topk_ids, topk_weights, a2, bias = make_problem(tokens, topk, experts, n, k, seed=43)
    sorting = moe_sorting(topk_ids, topk_weights, experts, block_m)
    s2 = scales.view(experts * n, k // 32)
    with pytest.raises(ValueError, match=r"a2.shape\[0\] \(tokens \* topk rows\) = 7"):
        R.moe_gemm2_a16w4(a2[:7], packed, s2, *sorting, topk=topk, block_m=block_m)
    with pytest.raises(ValueError, match="w2_scale must have shape"):
        R.moe_gemm2_a16w4(a2, packed, s2[:, :4], *sorting, topk=topk, block_m=block_m)
    with pytest.raises(TypeError, match="w2 must have dtype"):
        R.moe_gemm2_a16w4(a2, packed.float(), s2, *sorting, topk=topk, block_m=block_m)
    with pytest.raises(ValueError, match="sorted_expert_ids must have"):
        R.moe_gemm2_a16w4(a2, packed, s2, sorting[0], sorting[1], sorting[2][:1], sorting[3], topk=topk, block_m=block_m)
    with pytest.raises(ValueError, match="out must have shape"):
        R.moe_gemm2_a16w4(a2, packed, s2, *sorting, topk=topk, block_m=block_m, out=torch.zeros(tokens, n + 1))
    with pytest.raises(ValueError, match="inter_dim = 300"):
        R.moe_gemm2_a16w4(a2, packed, s2, *sorting, topk=topk, block_m=block_m, inter_dim=300)
    with pytest.raises(ValueError, match="bias must have shape"):
        R.moe_gemm2_a16w4(a2, packed, s2, *sorting, topk=topk, block_m=block_m, bias=bias[:1])


def test_bounds_that_keep_the_kernel_inside_its_tensors():
    """Each limit the kernel's accesses rely on, at the first size past it: inter_dim within a2's
    width (not only w2's K), bias as wide as model_dim, an expert id for every block of sorted_ids
    (the last one too); and the true sizes are ints."""
    tokens, topk, experts, n, k, block_m = 4, 2, 2, 32, 256, 16
    packed, scales, topk_ids, topk_weights, a2, bias = make_problem(tokens, topk, experts, n, k, seed=43)
    sorting = moe_sorting(topk_ids, topk_weights, experts, block_m)
    s2 = scales.view(experts * n, k // 32)
    call = lambda *args, **kw: R.moe_gemm2_a16w4(*args, topk=topk, block_m=block_m, **kw)  # noqa: E731
    with pytest.raises(ValueError, match=r"inter_dim = 256 must be in \[1, min\(K = 2 \* w2.shape\[2\] = 256, a2.shape\[1\] = 128\)"):
        call(a2[:, :128], packed, s2, *sorting, inter_dim=256)
    call(a2[:, :128], packed, s2, *sorting, inter_dim=128)  # the largest allowed
    with pytest.raises(ValueError, match="bias must have shape"):
        call(a2, packed, s2, *sorting, bias=bias[:, :n - 1])
    assert len(sorting[2]) == -(-len(sorting[0]) // block_m) > 1
    with pytest.raises(ValueError, match="sorted_expert_ids must have"):
        call(a2, packed, s2, sorting[0], sorting[1], sorting[2][:-1], sorting[3])
    for name in ("model_dim", "inter_dim"):
        with pytest.raises(ValueError, match=f"{name} = 16.0 must be in"):
            call(a2, packed, s2, *sorting, **{name: 16.0})


def test_sorted_ids_of_a_partial_last_block():
    """num_valid_ids[0] at least len(sorted_ids), which is not a whole number of blocks (its last
    rows cut off: here padding rows): the rows left are all in use, and the layer is the whole
    sorting's."""
    tokens, topk, experts, n, k, block_m = 4, 2, 2, 32, 256, 16
    packed, scales, topk_ids, topk_weights, a2, _ = make_problem(tokens, topk, experts, n, k, seed=44)
    ids, weights, expert_ids, num_valid = moe_sorting(topk_ids, topk_weights, experts, block_m)
    rows = len(ids) - 3
    assert rows % block_m and ((ids[rows:] & 0xFFFFFF) == tokens).all()  # the cut rows pad the last block
    s2 = scales.view(experts * n, k // 32)
    got = R.moe_gemm2_a16w4(a2, packed, s2, ids[:rows], weights[:rows], expert_ids,
                            torch.tensor([rows + 100, tokens], dtype=torch.int32), topk=topk, block_m=block_m)
    want = R.moe_gemm2_a16w4(a2, packed, s2, ids, weights, expert_ids, num_valid, topk=topk, block_m=block_m)
    assert torch.equal(got, want)
