"""The public API: names of DESIGN.md, clear errors on bad input, torch.compile tracing,
explain(). Numerics of each path are tested against the reference elsewhere; here the backend
is forced to the reference where only the API layer is under test."""

import os
import re

import pytest
import torch

import flyquant as fq
from flyquant import moe

DESIGN_NAMES = [
    "mxfp8_quantize", "mxfp8_quantize_dual", "mxfp8_quantize_3d", "quantize_mxfp4", "mxfp4_quantize", "mxfp4_quantize_dual", "shuffle_weight_a16w4",
    "shuffle_scale_a16w4", "moe_sorting", "moe_gemm2_a16w4", "explain", "mxfp8_dequantize", "dequantize_mxfp4",
    "reference", "emu", "moe_block_m",
]


def test_public_names():
    for name in DESIGN_NAMES:
        assert hasattr(fq, name), name
        if name not in ("reference", "emu", "explain", "moe_block_m"):
            assert hasattr(fq.reference, name), f"reference.{name}"
    import flyquant.compat.torchao  # noqa: F401


def test_moe_modules_names_stay_reachable_where_they_were():
    """The MoE halves split out of flyquant.api and flyquant.reference (api_moe, reference_moe):
    their public names still resolve, to the same objects, under the old modules."""
    from flyquant import api, api_moe, reference_moe

    for name in reference_moe.__all__:
        assert getattr(fq.reference, name) is getattr(reference_moe, name), name
    with pytest.raises(AttributeError, match="no_such_name"):
        fq.reference.no_such_name
    for name in ("APPLY_WEIGHTS_AT", "fused_moe", "moe_block_m", "moe_gemm1_a16w4", "moe_gemm2_a16w4", "moe_sorting",
                 "moe_stage2"):
        assert getattr(api, name) is getattr(api_moe, name), name


X = torch.zeros(64, 64, dtype=torch.bfloat16)


@pytest.mark.parametrize("call, error, match", [
    (lambda: fq.mxfp8_quantize(X.to(torch.int32)), TypeError, "x must have dtype"),
    (lambda: fq.mxfp8_quantize(X[:, :48]), ValueError, r"x.shape\[1\] \(K, quantized in blocks of 32\) = 48"),
    (lambda: fq.mxfp8_quantize(X[:40], axis=0), ValueError, r"x.shape\[0\] \(M, quantized in blocks of 32\) = 40"),
    (lambda: fq.mxfp8_quantize(X[None]), ValueError, "x must be 2D"),
    (lambda: fq.mxfp8_quantize(X, axis=2), ValueError, "axis must be"),
    (lambda: fq.mxfp8_quantize(X, scaling_mode="even"), ValueError, "scaling_mode must be one of"),
    (lambda: fq.mxfp8_quantize(X, scale_layout="blocked"), ValueError, "scale_layout must be one of"),
    (lambda: fq.mxfp8_quantize(X, offs=torch.tensor([64], dtype=torch.int64)), TypeError, "offs must have dtype"),
    (lambda: fq.mxfp8_quantize(X, offs=torch.tensor([32, 64], dtype=torch.int32)), ValueError, "multiple of 128"),
    (lambda: fq.mxfp8_quantize(X, offs=torch.tensor([128], dtype=torch.int32)), ValueError, r"offs\[-1\] must equal M"),
    (lambda: fq.mxfp8_quantize_dual(X[:, :40]), ValueError, "K, quantized in blocks of 32"),
    (lambda: fq.mxfp8_quantize_3d(X), ValueError, "w must be 3D"),
    (lambda: fq.mxfp8_quantize_3d(X[None], scale_block_k=16), ValueError, "scale_block_k must be one of"),
    (lambda: fq.quantize_mxfp4(X[:, :48]), ValueError, "w must be contiguous"),
    (lambda: fq.moe_sorting(torch.tensor([[0, 9]]), torch.ones(1, 2), 8, 16), ValueError, "expert"),
])
def test_bad_input_is_a_clear_error(call, error, match, reference_backend):
    with pytest.raises(error, match=match):
        call()


def _moe_inputs(tokens=3, topk=2, experts=4, model_dim=64, inter_dim=256, block_m=16):
    g = torch.Generator().manual_seed(0)
    w = torch.randn(experts, model_dim, inter_dim, generator=g, dtype=torch.float32)
    packed, scales = fq.quantize_mxfp4(w)
    w2, s2 = fq.shuffle_weight_a16w4(packed), fq.shuffle_scale_a16w4(scales, experts)
    ids = torch.randint(0, experts, (tokens, topk), generator=g, dtype=torch.int32)
    sorted_ = fq.moe_sorting(ids, torch.rand(tokens, topk, generator=g), experts, block_m)
    a2 = torch.randn(tokens * topk, inter_dim, generator=g).to(torch.bfloat16)
    return a2, w2, s2, sorted_, topk, block_m


def test_moe_bad_inputs(reference_backend):
    a2, w2, s2, sorted_, topk, block_m = _moe_inputs()
    with pytest.raises(TypeError, match="a2 must have dtype"):
        fq.moe_gemm2_a16w4(a2.to(torch.int8), w2, s2, *sorted_, topk=topk, block_m=block_m)
    with pytest.raises(ValueError, match="a2.shape\\[0\\]"):
        fq.moe_gemm2_a16w4(a2[:5], w2, s2, *sorted_, topk=topk, block_m=block_m)
    with pytest.raises(ValueError, match="w2_scale must have shape"):
        fq.moe_gemm2_a16w4(a2, w2, s2[:, :32], *sorted_, topk=topk, block_m=block_m)
    with pytest.raises(ValueError, match="model_dim"):
        fq.moe_gemm2_a16w4(a2, w2, s2, *sorted_, topk=topk, block_m=block_m, model_dim=1000)
    with pytest.raises(ValueError, match="out must have shape"):
        fq.moe_gemm2_a16w4(a2, w2, s2, *sorted_, topk=topk, block_m=block_m, out=torch.zeros(2, 64))
    with pytest.raises(TypeError, match="out_dtype"):
        fq.moe_gemm2_a16w4(a2, w2, s2, *sorted_, topk=topk, block_m=block_m, out_dtype=torch.float16)
    meta = sorted_[0].to("meta")
    with pytest.raises(ValueError, match="sorted_ids must be on the device of a2"):
        fq.moe_gemm2_a16w4(a2, w2, s2, meta, *sorted_[1:], topk=topk, block_m=block_m)


def test_moe_gemm2_out_is_added_into(reference_backend):
    a2, w2, s2, sorted_, topk, block_m = _moe_inputs()
    fresh = fq.moe_gemm2_a16w4(a2, w2, s2, *sorted_, topk=topk, block_m=block_m, out_dtype=torch.float32)
    base = torch.full_like(fresh, 2.0)
    out = fq.moe_gemm2_a16w4(a2, w2, s2, *sorted_, topk=topk, block_m=block_m, out=base)
    assert out is base
    torch.testing.assert_close(out, fresh + 2.0, rtol=0, atol=1e-6)


def test_torch_compile_traces_without_graph_breaks(reference_backend):
    x = torch.randn(64, 64, dtype=torch.bfloat16)

    def step(x):
        (d0, s0), (d1, s1) = fq.mxfp8_quantize_dual(x)
        d3, s3 = fq.mxfp8_quantize_3d(x.view(2, 32, 64))
        p4, t4 = fq.mxfp4_quantize(x[:, :40].contiguous(), axis=0, scaling_mode="even")
        w4, u4 = fq.mxfp4_quantize_3d(x.view(2, 32, 64))
        a4, b4 = fq.mxfp4_quantize(x, scale_layout="mfma", shuffle="a4w4")  # the fake's padded scales
        (e4, f4), (g4, h4) = fq.mxfp4_quantize_dual(x[:, :40].contiguous())
        return d0, s0, d1, s1, d3, s3, p4, t4, w4, u4, a4, b4, e4, f4, g4, h4

    compiled = torch.compile(step, fullgraph=True, backend="eager")
    for got, want in zip(compiled(x), step(x)):
        assert got.shape == want.shape and got.stride() == want.stride() and got.dtype == want.dtype
        assert torch.equal(got.view(torch.uint8), want.view(torch.uint8))

    a2, w2, s2, sorted_, topk, block_m = _moe_inputs()
    moe = torch.compile(lambda a: fq.moe_gemm2_a16w4(a, w2, s2, *sorted_, topk=topk, block_m=block_m),
                        fullgraph=True, backend="eager")
    torch.testing.assert_close(moe(a2), fq.moe_gemm2_a16w4(a2, w2, s2, *sorted_, topk=topk, block_m=block_m))


@pytest.mark.parametrize("backend", ["reference", "flydsl"])
def test_torch_compile_traces_quantize_with_offs(monkeypatch, backend):
    # offs' values are checked on the host in eager calls; while dynamo traces there are none (a
    # data-dependent branch broke the graph: torchao's blocked 32x1 call with offs)
    monkeypatch.setenv("FLYQUANT_BACKEND", backend)
    x = torch.randn(256, 64, dtype=torch.bfloat16)
    offs = torch.tensor([128, 128, 256], dtype=torch.int32)

    def step(x, offs):
        d0, s0 = fq.mxfp8_quantize(x, axis=0, scale_layout="tcgen05", offs=offs)
        d1, s1 = fq.mxfp8_quantize(x, axis=-1, scale_layout="tcgen05", offs=offs)
        return d0, s0, d1, s1

    torch._dynamo.reset()
    compiled = torch.compile(step, fullgraph=True, backend="eager")
    for got, want in zip(compiled(x, offs), step(x, offs)):
        assert got.shape == want.shape and got.stride() == want.stride() and got.dtype == want.dtype
        assert torch.equal(got.view(torch.uint8), want.view(torch.uint8))
    # the values are checked when the compiled graph runs (the op's body runs eagerly then)
    for bad in ([128, 64, 256], [-32, 128, 256], [256, 1000, 2**31 - 1], [0, 0, 0]):
        for fn in (step, compiled):
            with pytest.raises(ValueError, match="offs"):
                fn(x, torch.tensor(bad, dtype=torch.int32))


def test_reference_layouts_under_autocast(reference_backend):
    """Under torch.autocast, torch.stack / torch.cat promote their inputs' dtype and refuse E8M0
    ("Unexpected floating ScalarType"): the reference's per-expert and per-group scale layouts and
    the training op's reference GEMMs failed there. They join uint8 views (layouts.join_codes):
    the same bytes as without autocast."""
    from flyquant.training import mxfp8_grouped_mm

    w = torch.randn(2, 64, 64, dtype=torch.bfloat16)
    offs = torch.tensor([32, 64], dtype=torch.int32)
    calls = [lambda: fq.mxfp8_quantize_3d(w, scale_layout="mfma"),
             lambda: fq.mxfp8_quantize_3d(w, scale_layout="tcgen05"),
             lambda: fq.mxfp8_quantize(torch.cat([w, w]).reshape(256, 64), axis=0, scale_layout="tcgen05",
                                       offs=torch.tensor([128, 256], dtype=torch.int32))]
    for call in calls:
        want = call()
        with torch.autocast("cpu", dtype=torch.bfloat16):
            got = call()
        assert all(torch.equal(g.view(torch.uint8), h.view(torch.uint8)) for g, h in zip(got, want))
    A = torch.randn(64, 64, requires_grad=True)
    B_t = torch.randn(2, 64, 64, requires_grad=True)
    want = mxfp8_grouped_mm(A, B_t, offs)
    want.sum().backward()
    grads = A.grad.clone(), B_t.grad.clone()
    A.grad = B_t.grad = None
    with torch.autocast("cpu", dtype=torch.bfloat16):
        got = mxfp8_grouped_mm(A, B_t, offs)
        got.sum().backward()
    assert torch.equal(got, want) and torch.equal(A.grad, grads[0]) and torch.equal(B_t.grad, grads[1])


def test_explain_prints_the_plan(capsys, reference_backend):
    plan = fq.explain(fq.mxfp8_quantize, X, axis=0)
    assert plan.backend == "reference" and "FLYQUANT_BACKEND=reference" in capsys.readouterr().out
    plan = fq.explain(fq.quantize_mxfp4, X)
    assert plan.op == "mxfp4_quantize" and plan.backend == "reference" and plan.reasons == ("FLYQUANT_BACKEND=reference",)
    plan = fq.explain(fq.dequantize_mxfp4, X.to(torch.uint8)[:, :16], X.to(torch.float8_e8m0fnu)[:, :1])
    assert plan.backend == "reference" and "no kernel" in plan.reasons[0]


def test_warmup_runs_the_kernels_a_model_uses():
    import flyquant.emu as emu

    with emu.record() as launches:
        plans = fq.warmup(model_dim=48, inter_dim=224, experts=4, topk=2, tokens=(1, 3), quantize_shapes=[(32, 64)])
    assert [p.op for p in plans] == ["moe_sorting", "moe_gemm2_a16w4"] * 2 + ["mxfp8_quantize"] * 2 + ["mxfp8_quantize_dual"]
    assert all(p.backend == "flydsl" for p in plans)
    kernels = [rec.stats.kernel for rec in launches]
    assert sum(k.startswith("moe_gemm2_a16w4") for k in kernels) == 2
    assert any(k.startswith("mxfp8_1x32") for k in kernels) and any(k.startswith("mxfp8_dual") for k in kernels)


def test_warmup_compiles_the_kernels_of_the_call_it_is_told(moe_launcher_configs):
    """A fused_moe call as GPT-OSS through flyquant.nn makes it (swiglu_oai with its own alpha and
    limit, an fp32 stage-1 bias, a bf16 stage-2 bias, torch.topk's int64 ids, an fp32 out) asks
    for no kernel configuration that warmup, told those, did not compile. Warmup used to take
    only a bf16 stage-1 bias, ran stage 2 without one and routed int32 ids: the first call then
    compiled all three kernels (the control below)."""
    sizes = dict(model_dim=64, inter_dim=96, experts=3, topk=2)
    layer = dict(activation="swiglu_oai", alpha=1.5, limit=6.0, out_dtype=torch.float32)
    plans = fq.warmup(**sizes, tokens=(3,), stage1_bias=torch.float32, stage2_bias=True, ids_dtype=torch.int64, **layer)
    assert [p.op for p in plans] == ["moe_sorting", "moe_gemm1_a16w4", "moe_gemm2_a16w4"]
    warmed = set(moe_launcher_configs)
    moe_launcher_configs.clear()
    fq.warmup(**sizes, tokens=(3,), stage1_bias=True, **{k: v for k, v in layer.items() if k != "out_dtype"})
    old_style = set(moe_launcher_configs)
    moe_launcher_configs.clear()
    g = torch.Generator().manual_seed(0)
    w1 = torch.randint(0, 256, (3, 2 * 256, 256 // 2), dtype=torch.uint8, generator=g)
    s1 = fq.shuffle_scale_a16w4(torch.full((3, 2 * 256, 256 // 32), 127, dtype=torch.uint8).view(torch.float8_e8m0fnu), 3,
                                gate_up=True)
    w2 = torch.randint(0, 256, (3, 64, 256 // 2), dtype=torch.uint8, generator=g)
    s2 = fq.shuffle_scale_a16w4(torch.full((3, 64, 256 // 32), 127, dtype=torch.uint8).view(torch.float8_e8m0fnu), 3)
    weights, ids = torch.topk(torch.randn(3, 3, generator=g).softmax(-1), 2)  # as transformers' routers: int64 ids
    out = fq.fused_moe(torch.randn(3, 64, generator=g).bfloat16(), w1, s1, w2, s2, weights, ids,
                       b1=torch.randn(3, 512, generator=g), b2=torch.randn(3, 64, generator=g).bfloat16(),
                       model_dim=64, inter_dim=96, **layer)
    called = set(moe_launcher_configs)
    assert ids.dtype == torch.int64 and out.dtype == torch.float32 and len(called) == 3
    assert called <= warmed
    assert not called & old_style  # what warmup compiled before it took these options


def test_warmup_runs_the_stage1_weights_variant(monkeypatch):
    """stage1_weights=True warms up the layer with the routing weights applied in stage 1 (the
    kernels a call with apply_weights_at="stage1" runs), not the default's."""
    from flyquant import api

    monkeypatch.setenv("FLYQUANT_BACKEND", "reference")
    seen = []
    monkeypatch.setattr(api, "fused_moe", lambda *args, **kw: seen.append(kw["apply_weights_at"]))
    sizes = dict(model_dim=64, inter_dim=64, experts=2, topk=1, activation="silu", device="cpu")
    for stage1_weights, want in ((True, "stage1"), (False, "stage2")):
        seen.clear()
        api.warmup(**sizes, tokens=(1, 2), stage1_weights=stage1_weights)
        assert seen == [want, want]


@pytest.mark.parametrize("axis", [-1, 0])
def test_reference_backend_honours_unsigned_zeros(reference_backend, axis):
    """signed_zeros=False on the reference backend (every CPU call without the emulator): the
    signed call's data bytes with each -0 (0x80) written as +0, the scales unchanged."""
    x = torch.randn(64, 64, generator=torch.Generator().manual_seed(3)).to(torch.bfloat16)
    x[::3] = -0.0
    x[1, :32] = -1e-30  # a block whose elements all round to -0
    signed = fq.mxfp8_quantize(x, axis)
    unsigned = fq.mxfp8_quantize(x, axis, signed_zeros=False)
    codes = signed[0].view(torch.uint8)
    assert (codes == 0x80).any()
    assert torch.equal(unsigned[0].view(torch.uint8), torch.where(codes == 0x80, 0, codes))
    assert torch.equal(unsigned[1].view(torch.uint8), signed[1].view(torch.uint8))


def test_explain_of_stage_2_plans_for_the_outs_dtype(monkeypatch):
    """explain(moe_gemm2_a16w4, ..., out=fp32 tensor) names the FP32-output kernel the call runs,
    not the BF16 default's."""
    from flyquant import select

    monkeypatch.setattr(select, "_emulator_arch", lambda: "gfx950")
    experts, tokens, n, k = 2, 4, 64, 256
    w2 = torch.zeros(experts, n, k // 2, dtype=torch.uint8)
    w2_scale = fq.shuffle_scale_a16w4(torch.full((experts, n, k // 32), 127, dtype=torch.uint8).view(torch.float8_e8m0fnu),
                                      experts)
    a2 = torch.zeros(tokens, k, dtype=torch.bfloat16)
    ids = (torch.arange(tokens) % experts).view(tokens, 1).to(torch.int32)
    sorting = moe.moe_sorting(ids, torch.ones(tokens, 1), experts, 16)
    plans = {dtype: fq.explain(fq.moe_gemm2_a16w4, a2, w2, w2_scale, *sorting, 1, 16,
                               out=torch.zeros(tokens, n, dtype=dtype)) for dtype in (torch.float32, torch.bfloat16)}
    for dtype, plan in plans.items():
        assert plan.kernel == select.plan_moe_gemm2_a16w4(a2, w2, 1, 16, n, k, dtype, False).kernel
    assert plans[torch.float32].kernel != plans[torch.bfloat16].kernel


def test_device_0_is_torchs_device_0():
    # device=0 (torch.device(0): accelerator 0) went through `device or "cpu"`: moe_block_m gave the
    # CPU's block size and warmup compiled and ran for the CPU, with no error
    sizes = dict(model_dim=64, inter_dim=64, experts=2, topk=1)
    try:
        want = torch.device(0)
    except RuntimeError as exc:  # no accelerator here: torch's own error, as for device="cuda:0"
        for call in (lambda: fq.moe_block_m(1, 1, 2, 64, 64, device=0), lambda: fq.warmup(**sizes, device=0)):
            with pytest.raises(RuntimeError) as info:
                call()
            assert str(info.value) == str(exc)
        return
    assert fq.moe_block_m(1, 1, 2, 64, 64, device=0) == fq.moe_block_m(1, 1, 2, 64, 64, device=want)



def test_a_malformed_device_is_named():
    """warmup / moe_block_m passed device to torch.device as it came: "gpu", "" or -1 were torch's
    RuntimeErrors ("Expected one of cpu, cuda, ... device type at start of device string: gpu") and 1.5,
    True or [0] its "device() received an invalid combination of arguments", none naming device."""
    sizes = dict(model_dim=64, inter_dim=64, experts=2, topk=1)
    want = "device must be a torch.device, a device string such as 'cpu' or 'cuda:0', or a device index, got"
    for bad, error in (("gpu", ValueError), ("", ValueError), ("cuda:x", ValueError), (-1, ValueError),
                       (1.5, TypeError), (True, TypeError), ([0], TypeError)):
        for call in (lambda: fq.warmup(**sizes, tokens=(1,), device=bad), lambda: fq.moe_block_m(1, 1, 2, 64, 64, device=bad)):
            with pytest.raises(error, match=re.escape(f"{want} {bad!r}")):
                call()
    assert fq.moe_block_m(1, 1, 2, 64, 64, device="cpu") == fq.moe_block_m(1, 1, 2, 64, 64, device=torch.device("cpu"))

def test_warmup_lists_are_checked():
    # tokens=4 ("'int' object is not iterable") and one (M, K) pair as quantize_shapes ("cannot
    # unpack non-iterable int object") were TypeErrors from warmup's loops, naming neither argument.
    sizes = dict(model_dim=64, inter_dim=64, experts=2, topk=1)
    with pytest.raises(TypeError, match="tokens must be a sequence of token counts"):
        fq.warmup(**sizes, tokens=4)
    for shapes in ((32, 64), [(32, 64, 1)], [(32.0, 64)], "32x64"):
        with pytest.raises(TypeError, match=r"quantize_shapes must be a sequence of \(M, K\) pairs"):
            fq.warmup(**sizes, tokens=(), quantize_shapes=shapes)
    with pytest.raises(ValueError, match="tokens must be an int >= 0"):
        fq.warmup(**sizes, tokens=(1, -1))



def test_warmup_takes_numpy_integers_as_ints(monkeypatch):
    """numpy integers passed the sizes' and token counts' check but were refused in quantize_shapes
    ("pairs of ints, got ((np.int64(32), ...") and, as topk / experts, by the ops warmup ran ("topk must
    be a positive int, got np.int32(2)", "experts must be an int"). They now run as the same ints."""
    import numpy as np

    monkeypatch.setenv("FLYQUANT_BACKEND", "reference")
    sizes = dict(model_dim=64, inter_dim=64, experts=4, topk=2)
    want = fq.warmup(**sizes, tokens=(1, 3), quantize_shapes=[(32, 64)], activation="silu")
    as_numpy = {k: np.int32(v) for k, v in sizes.items()}
    got = fq.warmup(**as_numpy, tokens=np.array([1, 3]), quantize_shapes=np.array([[32, 64]]), activation="silu")
    assert got == want and len(want) == 9

def test_ops_take_numpy_integers_as_ints():
    """Sizes and axes computed with numpy (np.int64 from an array's arithmetic) were refused as
    "must be an int" by the ops (red-team finding); each now gives what the same int gives, on the
    kernels (emulated). Floats and bools stay refused."""
    import numpy as np

    i64 = np.int64
    x = torch.randn(64, 64, generator=torch.Generator().manual_seed(1)).to(torch.bfloat16)
    same = [(fq.mxfp8_quantize(x, axis=i64(0)), fq.mxfp8_quantize(x, axis=0)),
            (fq.mxfp4_quantize(x, axis=np.int32(-1)), fq.mxfp4_quantize(x, axis=-1)),
            (fq.mxfp8_quantize_3d(x.view(1, 64, 64), scale_block_k=i64(32)), fq.mxfp8_quantize_3d(x.view(1, 64, 64), scale_block_k=32))]
    logits = torch.randn(5, 8, generator=torch.Generator().manual_seed(2))
    routing = fq.moe_routing(logits, 2)
    same += [(fq.moe_routing(logits, i64(2)), routing),
             (fq.moe_sorting(routing[1], routing[0], i64(8), i64(16)), fq.moe_sorting(routing[1], routing[0], 8, 16)),
             (moe.moe_sorting(routing[1], routing[0], i64(8), i64(16)), moe.moe_sorting(routing[1], routing[0], 8, 16))]
    a2, w2, s2, sorted_, topk, block_m = _moe_inputs()
    same.append((fq.moe_gemm2_a16w4(a2, w2, s2, *sorted_, topk=i64(topk), block_m=i64(block_m), model_dim=i64(64),
                                    inter_dim=i64(256)),
                 fq.moe_gemm2_a16w4(a2, w2, s2, *sorted_, topk=topk, block_m=block_m)))
    scales = torch.arange(2 * 32 * 8, dtype=torch.uint8).view(64, 8)
    same.append((fq.shuffle_scale_a16w4(scales, i64(2)), fq.shuffle_scale_a16w4(scales, 2)))
    for got, want in same:
        for g, w in zip(torch.utils._pytree.tree_leaves(got), torch.utils._pytree.tree_leaves(want)):
            assert torch.equal(g.view(torch.uint8), w.view(torch.uint8))
    assert fq.moe_block_m(i64(5), i64(2), i64(8), i64(256), i64(256)) == fq.moe_block_m(5, 2, 8, 256, 256)
    for bad in (2.0, True, np.float64(2)):
        with pytest.raises(ValueError, match="topk must be an int"):
            fq.moe_routing(logits, bad)
    with pytest.raises(ValueError, match="axis must be"):
        fq.mxfp4_quantize(x, axis=np.bool_(False))


def test_warmup_checks_sizes_and_modes_before_running_anything():
    # quantize_shapes off whole blocks, a bad scaling_mode or activation were refused only when their op
    # ran, after the MoE kernels were compiled and run, naming the quantize's x (a negative M: torch.zeros'
    # RuntimeError); an activation without tokens was not checked at all.
    sizes = dict(model_dim=64, inter_dim=64, experts=2, topk=1)
    import flyquant.emu as emu

    for shapes, match in (([(64, 64), (33, 64)], r"quantize_shapes\[1\]\[0\] \(M\) = 33 must be a positive multiple of 32"),
                          ([(32, 40)], r"quantize_shapes\[0\]\[1\] \(K\) = 40 must be"),
                          ([(-32, 64)], r"quantize_shapes\[0\]\[0\] \(M\) = -32 must be")):
        with emu.record() as launches, pytest.raises(ValueError, match=match):
            fq.warmup(**sizes, tokens=(1,), quantize_shapes=shapes)
        assert launches == []
    with pytest.raises(ValueError, match="scaling_mode must be one of"):
        fq.warmup(**sizes, tokens=(1,), scaling_mode="even", quantize_shapes=[(32, 32)])
    with pytest.raises(ValueError, match="activation must be None or one of"):
        fq.warmup(**sizes, tokens=(), activation="relu")
    # topk past experts failed in the first moe_sorting, naming its topk_ids (internal to warmup);
    # stage1_bias="no" warmed the bias variant, and without an activation both were ignored
    with emu.record() as launches, pytest.raises(ValueError, match=r"topk = 3 must be at most min\(experts = 2, 127\)"):
        fq.warmup(**dict(sizes, topk=3), tokens=(1,))
    assert launches == []
    for options, match in ((dict(activation="silu", stage1_bias="no"), "stage1_bias must be a bool or a floating torch.dtype"),
                           (dict(stage2_bias=torch.int32), "stage2_bias must be a bool or a floating torch.dtype"),
                           (dict(activation="swiglu_oai", limit=-1.0), "limit must be >= 0 for swiglu_oai"),
                           (dict(activation="silu", alpha="1.7"), "alpha must be a real number"),
                           (dict(activation="silu", out_dtype=torch.float16), "out_dtype must be one of"),
                           (dict(ids_dtype=torch.int16), "ids_dtype must be torch.int32 or torch.int64"),
                           (dict(activation="silu", stage1_weights=1), "stage1_weights must be a bool, got 1"),
                           (dict(stage1_bias=True), "stage1_bias / stage1_weights choose the stage-1 kernel"),
                           (dict(activation="silu", stage1_weights=True, stage2_bias=True),
                            "stage2_bias with stage1_weights: a2 carries the routing weight")):
        with emu.record() as launches, pytest.raises((ValueError, TypeError), match=match):
            fq.warmup(**sizes, tokens=(1,), **options)
        assert launches == []


def test_warmup_refuses_bias_dtypes_the_moe_ops_do_not_take():
    # stage1_bias / stage2_bias took any floating dtype: float64 (or an FP8 dtype) passed and was refused
    # by the first op that ran, naming its `bias` / `b1`, and with tokens=() not at all
    import flyquant.emu as emu

    sizes = dict(model_dim=64, inter_dim=64, experts=2, topk=1)
    for options in (dict(stage2_bias=torch.float64), dict(activation="silu", stage1_bias=torch.float64),
                    dict(activation="silu", stage2_bias=torch.float8_e4m3fn)):
        name = "stage1_bias" if "stage1_bias" in options else "stage2_bias"
        for tokens in ((1,), ()):
            with emu.record() as launches, pytest.raises(ValueError, match=rf"{name} must be a bool or a floating torch.dtype"):
                fq.warmup(**sizes, tokens=tokens, **options)
            assert launches == []


@pytest.mark.parametrize("arch", ["gfx950", "gfx942"])
def test_moe_stage2_two_launches_no_host_sync(arch, monkeypatch):
    # Issue 16 part 4: moe_stage2 = the sorting kernel (which zeroes the output) + the GEMM adding
    # into it; nothing reads the ids on the host (no _local_scalar_dense), so a graph can hold it.
    from test_moe_sorting_kernel import AtenOps

    monkeypatch.setenv("FLYQUANT_BACKEND", "flydsl")
    monkeypatch.setenv("FLYQUANT_ARCH", arch)
    g = torch.Generator().manual_seed(3)
    tokens, topk, experts, model_dim, inter_dim = 5, 2, 4, 64, 256
    w = torch.randn(experts, model_dim, inter_dim, generator=g)
    packed, scales = fq.quantize_mxfp4(w)
    w2, s2 = fq.shuffle_weight_a16w4(packed), fq.shuffle_scale_a16w4(scales, experts)
    ids = torch.randint(0, experts, (tokens, topk), generator=g, dtype=torch.int32)
    weights = torch.rand(tokens, topk, generator=g)
    a2 = torch.randn(tokens * topk, inter_dim, generator=g).to(torch.bfloat16)
    with fq.emu.record() as launches, AtenOps() as seen:
        out = fq.moe_stage2(a2, ids, weights, w2, s2, out_dtype=torch.float32)
    assert [r.kernel.split("_")[:2] for r in launches] == [["moe", "sorting"], ["moe", "gemm2"]]
    assert "aten._local_scalar_dense.default" not in seen.ops and "aten.zero_.default" not in seen.ops
    block_m = fq.moe_block_m(tokens, topk, experts, model_dim, inter_dim)
    want = fq.reference.moe_gemm2_a16w4(a2, w2, s2, *fq.reference.moe_sorting(ids, weights, experts, block_m),
                                        topk=topk, block_m=block_m, out=torch.zeros(tokens, model_dim))
    # fp32 out: the two differ only in summation order, each within (K + 2) u |a| . |w| per
    # contribution (K products and the two adds into out), u = 2^-24
    deq = fq.dequantize_mxfp4(packed, scales).abs()
    bound = torch.zeros(tokens, model_dim)
    for t in range(tokens):
        for k in range(topk):
            bound[t] += weights[t, k] * (a2[t * topk + k].float().abs() @ deq[ids[t, k]].t())
    assert bool(((out - want).abs() <= 2 * (inter_dim + 2) * 2.0**-24 * bound).all())


def test_explain_plans_moe_stage2_and_refuses_what_it_cannot_plan(capsys, monkeypatch):
    """explain() called everything without a planner "a pure-PyTorch op with no kernel": moe_stage2 (two
    kernel launches), the training op, the torchao compat functions, even None. moe_stage2 now gets
    its two plans; anything else that is not pure PyTorch is a TypeError listing the ops it plans."""
    from flyquant import training
    from flyquant.compat import torchao as compat

    monkeypatch.setenv("FLYQUANT_BACKEND", "flydsl")
    monkeypatch.setenv("FLYQUANT_ARCH", "gfx950")
    g = torch.Generator().manual_seed(4)
    tokens, topk, experts, model_dim, inter_dim = 3, 2, 4, 64, 256
    packed, scales = fq.quantize_mxfp4(torch.randn(experts, model_dim, inter_dim, generator=g))
    w2, s2 = fq.shuffle_weight_a16w4(packed), fq.shuffle_scale_a16w4(scales, experts)
    ids = torch.randint(0, experts, (tokens, topk), generator=g, dtype=torch.int32)
    weights = torch.rand(tokens, topk, generator=g)
    a2 = torch.randn(tokens * topk, inter_dim, generator=g).to(torch.bfloat16)
    sorting, gemm = fq.explain(fq.moe_stage2, a2, ids, weights, w2, s2)
    with fq.emu.record() as launches:
        fq.moe_stage2(a2, ids, weights, w2, s2)
    assert (sorting.op, gemm.op) == ("moe_sorting", "moe_gemm2_a16w4") and sorting.kernel == launches[0].kernel
    assert gemm.backend == "flydsl" and f"_{gemm.config['tile_m']}x{gemm.config['tile_n']}_" in launches[1].kernel
    for fn in (training.mxfp8_grouped_mm, compat.mxfp8_quantize_2d_1x32_flydsl, fq.warmup, None, "mxfp8_quantize"):
        with pytest.raises(TypeError, match="explain takes one of flyquant's kernel-backed ops .*moe_stage2"):
            fq.explain(fn, X)
    assert fq.explain(fq.moe_routing, torch.randn(2, 4), 2).backend == "reference"  # pure PyTorch: still planned


@pytest.mark.parametrize("fn, args, words", [
    (fq.moe_sorting, (), r"explain\(moe_sorting, ...\): the arguments do not fit moe_sorting\(topk_ids, .*missing a "
                         r"required argument: 'topk_ids'"),  # was a TypeError naming the private _explain_sorting()
    (fq.dequantize_mxfp4, (), r"dequantize_mxfp4\(packed, scales\): missing"),  # was planned, unchecked
    (fq.mxfp8_quantize, (X, -1, "rceil", None, None, True, 5), "too many positional arguments"),
])
def test_explain_checks_the_arguments_against_the_op(fn, args, words):
    with pytest.raises(TypeError, match=words):
        fq.explain(fn, *args)


def test_version_is_pyprojects():
    """fq.__version__ (helper-70: there was none) is the version pyproject.toml gives, as installed."""
    import tomllib
    from pathlib import Path

    pyproject = Path(__file__).resolve().parent.parent / "pyproject.toml"
    assert fq.__version__ == tomllib.loads(pyproject.read_text())["project"]["version"]


def test_a_source_tree_without_its_kernels_is_refused_at_import(tmp_path):
    """flyquant/ imported from a source tree that was not installed editable (helper-70: run from the
    checkout after `pip install .`) had no flyquant.kernels until the first launch failed, or took
    another copy's through an editable install's mapping; now `import flyquant` says so."""
    import shutil
    import subprocess
    import sys
    from pathlib import Path

    shutil.copytree(Path(fq.__file__).parent, tmp_path / "flyquant", ignore=shutil.ignore_patterns("kernels"))
    proc = subprocess.run([sys.executable, "-c", "import flyquant"], cwd=tmp_path, capture_output=True, text=True,
                          env={**os.environ, "PYTHONPATH": str(tmp_path)}, timeout=300)
    assert proc.returncode != 0 and f"flyquant imported from {tmp_path / 'flyquant'} finds " in proc.stderr, \
        proc.stderr[-2000:]
