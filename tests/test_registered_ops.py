"""The registered ops, torch.ops.flyquant.*, called directly: each refuses what its public function
refuses before anything launches (helper-71: the grouped GEMMs' ops launched on a short a_scale
or offs, reading past the tensors, and took int64 offs as int32; the MXFP4 ops read a
non-contiguous x as if it were contiguous). The MXFP4 and grouped GEMM op bodies run their
public functions' checks; the MXFP8 quantize and MoE ops' launchers and references check their
own inputs (the MXFP8 op body only the axis). The kernel backend is forced, so a missing check
would launch under strict memory instead of raising. The fakes run the same checks (helper-76: a refused call traced, and the MXFP4 fake read axis 1 as columnwise),
and the checks of values and addresses wait for real tensors."""

from __future__ import annotations

import pytest
import torch
from torch._subclasses.fake_tensor import FakeTensorMode

import flyquant as fq
from flyquant import moe, reference

BF16, E8M0 = torch.bfloat16, torch.float8_e8m0fnu
ops = torch.ops.flyquant


@pytest.fixture(autouse=True)
def kernel_backend(monkeypatch):
    monkeypatch.setenv("FLYQUANT_BACKEND", "flydsl")


def _refused(call, exc, words):
    with pytest.raises(exc, match=words):
        call()


X = torch.randn(64, 256, dtype=BF16)
W = torch.randn(2, 64, 128, dtype=BF16)

QUANTIZE_CASES = {
    "mxfp8_quantize": [
        (lambda: ops.mxfp8_quantize(X[:, ::2], 1, "rceil", None, None), ValueError, "x must be contiguous"),
        (lambda: ops.mxfp8_quantize(X, 7, "rceil", None, None), ValueError, "axis must be"),
        (lambda: ops.mxfp8_quantize(X, 0, "rceil", None, torch.tensor([32, 64])), TypeError, "offs must have dtype"),
    ],
    "mxfp8_quantize_dual": [(lambda: ops.mxfp8_quantize_dual(X[:, ::2], "rceil"), ValueError, "contiguous")],
    "mxfp8_quantize_3d": [(lambda: ops.mxfp8_quantize_3d(W, "rceil", 7, None), ValueError, "scale_block_k")],
    "mxfp4_quantize": [
        (lambda: ops.mxfp4_quantize(X[:, ::2], -1, "floor", None, None), ValueError, "x must be contiguous"),
        (lambda: ops.mxfp4_quantize(X[:, ::2], 0, "floor", None, None), ValueError, "x must be contiguous"),
        (lambda: ops.mxfp4_quantize(X[:8], -1, "floor", None, "a4w4"), ValueError, "multiple of 16"),
    ],
    "mxfp4_quantize_dual": [(lambda: ops.mxfp4_quantize_dual(X[:, ::2], "floor"), ValueError, "contiguous")],
    "mxfp4_quantize_3d": [
        (lambda: ops.mxfp4_quantize_3d(W[:, :, ::2], "floor", None, False), ValueError, "w must be contiguous"),
        (lambda: ops.mxfp4_quantize_3d(torch.randn(2, 64, 96, dtype=BF16), "floor", "a16w4", False), ValueError,
         "multiple of 256"),
    ],
}


def _grouped_mm_cases():
    a, a_scale = reference.mxfp8_quantize(torch.randn(96, 64, dtype=BF16), -1)
    b, b_scale = reference.mxfp8_quantize(torch.randn(3 * 48, 64, dtype=BF16), -1)
    b, b_scale = b.view(3, 48, 64), b_scale.view(3, 48, 2)
    x, x_scale = reference.mxfp8_quantize(torch.randn(64, 64, dtype=BF16), 0)
    y, y_scale = reference.mxfp8_quantize(torch.randn(64, 48, dtype=BF16), 0)
    ends = torch.tensor([40, 40, 90], dtype=torch.int32)
    fwd, wgrad = ops.mxfp8_grouped_mm, ops.mxfp8_grouped_mm_wgrad
    return {
        "mxfp8_grouped_mm": [
            (lambda: fwd(a, a_scale[:50], b, b_scale, ends, BF16), ValueError, "a_scale must have shape"),
            (lambda: fwd(a, a_scale, b[:1], b_scale, ends, BF16), ValueError, "must have shape"),
            (lambda: fwd(a, a_scale, b, b_scale, ends.long(), BF16), TypeError, "offs must have dtype"),
            (lambda: fwd(a, a_scale, b, b_scale, ends[2:], BF16), ValueError, "offs must have shape"),
            (lambda: fwd(a.view(torch.uint8).view(BF16), a_scale, b, b_scale, ends, BF16), TypeError,
             "a must have dtype"),
        ],
        "mxfp8_grouped_mm_wgrad": [
            (lambda: wgrad(x, x_scale[:10], y, y_scale, ends[:2] - 8, BF16), ValueError, "x_scale must have shape"),
            (lambda: wgrad(x.contiguous(), x_scale, y, y_scale, ends[:2] - 8, BF16), ValueError, "column-major"),
        ],
    }


def _moe_cases():
    tokens, experts, topk, model_dim, inter_dim, block_m = 4, 4, 2, 256, 256, 32
    x = torch.randn(tokens, model_dim, dtype=BF16)
    w1 = torch.zeros(experts, 2 * inter_dim, model_dim // 2, dtype=torch.uint8)
    w1_scale = torch.full((experts, 2 * inter_dim, model_dim // 32), 127, dtype=torch.uint8)
    w2 = torch.zeros(experts, model_dim, inter_dim // 2, dtype=torch.uint8)
    w2_scale = torch.full((experts, model_dim, inter_dim // 32), 127, dtype=torch.uint8)
    ids = torch.randint(0, experts, (tokens, topk), dtype=torch.int32)
    weights = torch.rand(tokens, topk)
    sorted_ = moe.moe_sorting(ids, weights, experts, block_m)
    a2 = torch.zeros(tokens * topk, inter_dim, dtype=BF16)
    out = torch.zeros(tokens, model_dim, dtype=BF16)
    stage1 = ("silu", 1.702, 7.0, False, model_dim, inter_dim)
    g1, g2 = ops.moe_gemm1_a16w4_, ops.moe_gemm2_a16w4_
    return {
        "moe_sorting": [
            (lambda: ops.moe_sorting(ids, weights[:2], experts, block_m, None, None), ValueError, "topk_weights"),
            (lambda: ops.moe_sorting(ids, weights, experts, block_m, torch.ones(2, dtype=torch.int32), None),
             ValueError, "expert_mask"),
        ],
        "moe_gemm1_a16w4_": [
            (lambda: g1(a2, x[:1], w1, w1_scale, *sorted_, topk, block_m, None, *stage1), ValueError,
             "out must have shape"),
            (lambda: g1(a2, x, w1, w1_scale[:1], *sorted_, topk, block_m, None, *stage1), ValueError, "w1_scale"),
        ],
        "moe_gemm2_a16w4_": [
            (lambda: g2(out, a2[:2], w2, w2_scale, *sorted_, topk, block_m, None, True, model_dim, inter_dim),
             ValueError, "out must have shape"),
            (lambda: g2(out, a2, w2, w2_scale[:1], *sorted_, topk, block_m, None, True, model_dim, inter_dim),
             ValueError, "w2_scale must have shape"),
            (lambda: g2(out, a2, w2, w2_scale, *sorted_, topk, block_m, None, True, model_dim, 4 * inter_dim),
             ValueError, "inter_dim"),
        ],
    }


def _all_cases():
    return {**QUANTIZE_CASES, **_grouped_mm_cases(), **_moe_cases()}


def test_every_registered_op_has_cases():
    registered = {s.name.removeprefix("flyquant::") for s in torch._C._jit_get_all_schemas()
                  if s.name.startswith("flyquant::")}
    assert registered == set(_all_cases())


@pytest.mark.parametrize("op", sorted(_all_cases()))
def test_registered_op_refuses_what_the_public_function_refuses(op):
    for call, exc, words in _all_cases()[op]:
        _refused(call, exc, words)


@pytest.mark.parametrize("op", sorted(_all_cases()))
def test_fake_refuses_what_the_op_refuses(op):
    cases = _all_cases()[op]
    with FakeTensorMode(allow_non_fake_inputs=True):
        for call, exc, words in cases:
            _refused(call, exc, words)


def test_fakes_read_the_axis_as_the_ops():
    """An axis written as x.dim() - 1 (or -2 for MXFP8's 32x1): the fake's outputs have the real
    outputs' shapes, dtypes and strides."""
    x3 = torch.randn(2, 32, 64, dtype=BF16)
    calls = [lambda: ops.mxfp4_quantize(X, 1, "floor", None, None), lambda: ops.mxfp4_quantize(x3, 2, "floor", None, None),
             lambda: ops.mxfp8_quantize(X, 1, "rceil", None, None), lambda: ops.mxfp8_quantize(X, -2, "rceil", None, None)]
    for call in calls:
        real = call()
        with FakeTensorMode(allow_non_fake_inputs=True):
            fake = call()
        assert [(t.shape, t.dtype, t.stride()) for t in fake] == [(t.shape, t.dtype, t.stride()) for t in real]


def test_value_and_address_checks_wait_for_real_tensors():
    """Under a FakeTensorMode (make_fx, the fakes) there are no offs values and every address is 0:
    fused_moe with its own out and the 32x1 quantize with offs trace (helper-76: "out must not
    overlap the input x", DataDependentOutputException), as under torch.compile."""
    from test_fused_moe import INTER_DIM, MODEL_DIM, layer

    p = layer(3, 2, 4)
    args = [p[k] for k in ("x", "w1", "w1_scale", "w2", "w2_scale", "weights", "ids")]
    x, offs = torch.randn(256, 64, dtype=BF16), torch.tensor([128, 256], dtype=torch.int32)
    mode = FakeTensorMode()
    fakes = [mode.from_tensor(t) for t in args]
    out = mode.from_tensor(torch.empty(3, MODEL_DIM, dtype=BF16))
    with mode:
        assert fq.fused_moe(*fakes, out=out, model_dim=MODEL_DIM, inter_dim=INTER_DIM).shape == (3, MODEL_DIM)
        data, scales = fq.mxfp8_quantize(mode.from_tensor(x), 0, offs=mode.from_tensor(offs))
        assert data.shape == (256, 64) and scales.shape == (64, 8)
    with FakeTensorMode(allow_non_fake_inputs=True) as active:  # a real offs inside an active fake mode
        assert fq.mxfp8_quantize(active.from_tensor(x), 0, offs=offs)[1].shape == (64, 8)
    with mode:
        with pytest.raises(ValueError, match="must not share memory"):  # a view of x: seen without addresses
            fq.fused_moe(*fakes, out=fakes[0][:, :MODEL_DIM], model_dim=MODEL_DIM, inter_dim=INTER_DIM)


def test_fakes_take_symbolic_sizes():
    """torch.compile(dynamic=True) with topk read from topk_ids' shape: the MoE ops' fakes check a
    SymInt topk as an int (helper-78: "topk must be a positive int, got s27")."""
    tokens, experts, model_dim, inter_dim, block_m = 4, 4, 256, 256, 32
    w2 = torch.zeros(experts, model_dim, inter_dim // 2, dtype=torch.uint8)
    w2_scale = torch.full((experts, model_dim, inter_dim // 32), 127, dtype=torch.uint8)
    ids = torch.randint(0, experts, (tokens, 2), dtype=torch.int32)
    weights, a2 = torch.rand(tokens, 2), torch.randn(tokens * 2, inter_dim, dtype=BF16)

    def stage2(a2, ids, weights):
        return fq.moe_gemm2_a16w4(a2, w2, w2_scale, *fq.moe_sorting(ids, weights, experts, block_m), topk=ids.shape[1],
                                  block_m=block_m, model_dim=model_dim, inter_dim=inter_dim)

    assert torch.equal(torch.compile(stage2, backend="aot_eager", dynamic=True)(a2, ids, weights), stage2(a2, ids, weights))
