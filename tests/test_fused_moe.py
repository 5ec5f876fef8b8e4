"""fq.fused_moe: the whole A16W4 MoE layer (moe_sorting, stage 1, stage 2) under flyquant.emu on
both arches: at most 3 launches and no other device work than allocation, no host
synchronisation, and the result against an exact float64 MoE of the dequantized weights.

Tolerance (derived, per element). Stage 1's a2 element is within T1 of the exact activation
(tests/test_moe_gemm1_kernel.py's bound: FP32 sums, the activation's error, one bf16 rounding).
Stage 2 sums each routed pair's w * (a2 @ W2^T + b2) (or a2 * w at stage 1): its FP32 sum is
within (K + 2) 2^-24 of the magnitude |w| (|W2| @ (|a| + T1) + |b2|), the a2 error enters as
|w| (|W2| @ T1), and a bf16 out rounds each contribution and each atomic add (2^-8 each, topk + 1
times the contributions' magnitude). The sum, times 1 + 2^-6 for second-order terms, bounds
|layer - exact| on every element; a wrong expert, slot, bias or weight moves elements far past it.
"""

from __future__ import annotations

import json

import pytest
import torch

import flyquant as fq
import flyquant.emu as emu
from flyquant import env, layouts, reference, select

from test_moe_gemm1_kernel import exact_and_tolerance
from test_moe_sorting_kernel import AtenOps

ARCHS = ("gfx950", "gfx942")
U_BF16 = 2.0**-8
U_F32 = 2.0**-24
MODEL_DIM, X_WIDTH = 224, 256  # true hidden size; x, w1's K and w2's N padded to 256
INTER_DIM, HALF, W2_K = 32, 64, 256  # true inter size; w1's gate/up halves 64 rows; w2's K 256


def layer(tokens, topk, num_experts, mask=None, biases=False, seed=0, apply_weights_at="stage2"):
    """A layer's tensors: routing over num_experts (global ids), the weights of the served ones;
    biases: b1 and b2, but no b2 for apply_weights_at="stage1" (refused there: api_moe.STAGE1_WEIGHTS_B2)."""
    g = torch.Generator().manual_seed(seed)
    served = list(range(num_experts)) if mask is None else [e for e in range(num_experts) if mask[e]]
    experts = len(served)
    w1f = torch.randn(experts, 2 * HALF, X_WIDTH, generator=g) * 0.1
    w2f = torch.randn(experts, X_WIDTH, W2_K, generator=g) * 0.1
    p1, s1 = reference.quantize_mxfp4(w1f)
    p2, s2 = reference.quantize_mxfp4(w2f)
    x = torch.randn(tokens, X_WIDTH, generator=g).to(torch.bfloat16)
    logits = torch.randn(tokens, num_experts, generator=g)
    logits[:, -1] = -1e9  # the last expert gets no tokens
    weights, ids = fq.moe_routing(logits, topk)
    return dict(
        x=x, ids=ids, weights=weights, served=served,
        mask=None if mask is None else torch.tensor(mask, dtype=torch.int32), packed=p1, scales=s1, p2=p2, s2=s2,
        w1=layouts.shuffle_weight_a16w4(p1, gate_up=True), w1_scale=layouts.shuffle_scale_a16w4(s1, experts, gate_up=True),
        w2=layouts.shuffle_weight_a16w4(p2), w2_scale=layouts.shuffle_scale_a16w4(s2, experts),
        b1=(torch.randn(experts, 2 * HALF, generator=g) * 0.5).to(torch.bfloat16) if biases else None,
        b2=(torch.randn(experts, X_WIDTH, generator=g) * 0.5).to(torch.bfloat16)
        if biases and apply_weights_at == "stage2" else None,
        topk=topk, experts=experts)


def run(p, activation, apply_weights_at="stage2", **kw):
    return fq.fused_moe(p["x"], p["w1"], p["w1_scale"], p["w2"], p["w2_scale"], p["weights"], p["ids"], b1=p["b1"],
                        b2=p["b2"], activation=activation, expert_mask=p["mask"], apply_weights_at=apply_weights_at,
                        model_dim=MODEL_DIM, inter_dim=INTER_DIM, **kw)


def exact_layer(p, activation, apply_weights_at):
    """(exact float64 output, bound) of the module docstring."""
    local = {e: i for i, e in enumerate(p["served"])}
    ids = p["ids"].clone().apply_(lambda e: local.get(e, 0))  # unserved pairs are skipped below
    at1 = apply_weights_at == "stage1"
    s1 = dict(x=p["x"], packed=p["packed"], scales=p["scales"], ids=ids, weights=p["weights"], bias=p["b1"],
              topk=p["topk"], model_dim=MODEL_DIM, inter_dim=INTER_DIM, half=HALF, experts=p["experts"])
    a_exact, t1 = exact_and_tolerance(s1, activation, at1)
    w2 = reference.dequantize_mxfp4(p["p2"], p["s2"]).double()[:, :MODEL_DIM, :INTER_DIM]
    b2 = torch.zeros(p["experts"], MODEL_DIM, dtype=torch.float64) if p["b2"] is None else p["b2"].double()[:, :MODEL_DIM]
    tokens, topk = p["ids"].shape
    out = torch.zeros(tokens, MODEL_DIM, dtype=torch.float64)
    bound, c_abs = torch.zeros_like(out), torch.zeros_like(out)
    for t in range(tokens):
        for s in range(topk):
            if int(p["ids"][t, s]) not in local:
                continue
            e, r = int(ids[t, s]), t * topk + s
            w = 1.0 if at1 else float(p["weights"][t, s])
            a, da = a_exact[r], t1[r]
            out[t] += w * (w2[e] @ a + b2[e])
            mag = abs(w) * (w2[e].abs() @ (a.abs() + da) + b2[e].abs())
            bound[t] += (INTER_DIM + 2) * U_F32 * mag + abs(w) * (w2[e].abs() @ da)
            c_abs[t] += mag
    bound += (1 + topk) * U_BF16 * c_abs
    return out, (1 + 2.0**-6) * bound


# (tokens, topk, experts, mask, activation, biases, apply_weights_at): T 1 / 3 / 17 / 130, topk 1 / 4 / 8,
# silu and GPT-OSS's swiglu_oai, biases on/off, an expert-parallel mask, an expert with no tokens
CASES = [
    (1, 4, 8, None, "swiglu_oai", True, "stage2"),
    (3, 1, 4, None, "silu", False, "stage2"),
    (17, 4, 8, [1, 0, 1, 1, 0, 1, 1, 1], "silu", True, "stage2"),
    (3, 2, 6, [1, 1, 0, 1, 1, 1], "swiglu_oai", True, "stage1"),
    (130, 8, 9, None, "silu", False, "stage2"),  # 1040 pairs: several blocks per expert, topk 8
]


@pytest.mark.parametrize("arch", ARCHS)
@pytest.mark.parametrize("case", CASES, ids=[f"T{c[0]}-k{c[1]}-E{c[2]}-{c[4]}-{'mask' if c[3] else 'all'}-{c[6]}"
                                             for c in CASES])
def test_layer_three_launches_no_host_sync_within_the_bound(arch, case, monkeypatch):
    monkeypatch.setenv("FLYQUANT_BACKEND", "flydsl")
    monkeypatch.setenv("FLYQUANT_ARCH", arch)
    tokens, topk, experts, mask, activation, biases, at = case
    p = layer(tokens, topk, experts, mask, biases, seed=tokens + experts, apply_weights_at=at)
    with emu.record() as launches, AtenOps() as seen:
        got = run(p, activation, at)
    kernels = [r.kernel for r in launches]
    assert len(kernels) == 3 and kernels[0].startswith("moe_sorting") and kernels[1].startswith("moe_gemm1") \
        and kernels[2].startswith("moe_gemm2"), kernels
    # allocations and metadata-only views (the scales as uint8 codes) aside
    device_work = [op for op in seen.ops if not op.startswith(("flyquant.", "aten.empty", "aten.view.dtype", "aten.detach"))]
    assert device_work == [], device_work  # no memset, no copy, no _local_scalar_dense (host sync)
    exact, bound = exact_layer(p, activation, at)
    assert (bound < 0.1 * exact.abs().max()).all()  # tight enough to see a wrong element (topk 8: 9 roundings)
    err = (got.double() - exact).abs()
    assert bool((err <= bound).all()), float((err - bound).max())


def test_reference_backend_gives_the_same_layer(monkeypatch):
    monkeypatch.setenv("FLYQUANT_BACKEND", "reference")
    p = layer(3, 2, 4, None, True, seed=5)
    got = run(p, "swiglu_oai")
    exact, bound = exact_layer(p, "swiglu_oai", "stage2")
    assert bool(((got.double() - exact).abs() <= bound).all())


@pytest.mark.parametrize("backend", ["reference", *ARCHS])
def test_special_values_stay_in_their_token(backend, monkeypatch):
    """A NaN in one token's x and an Inf in another's routing weight leave every other token's output
    bit-identical (17 tokens x top-4 over 8 experts: rows of several tokens share each tile)."""
    monkeypatch.setenv("FLYQUANT_BACKEND", "reference" if backend == "reference" else "flydsl")
    monkeypatch.setenv("FLYQUANT_ARCH", "gfx950" if backend == "reference" else backend)
    p = layer(17, 4, 8, None, True, seed=12)
    clean = run(p, "swiglu_oai")
    dirty = dict(p, x=p["x"].clone(), weights=p["weights"].clone())
    dirty["x"][3, 17] = float("nan")
    dirty["weights"][9, 1] = float("inf")
    got = run(dirty, "swiglu_oai")
    assert got[3].isnan().any() and not got[9].isfinite().all()
    others = [t for t in range(17) if t not in (3, 9)]
    assert torch.equal(got[others], clean[others])


def test_out_of_range_ids_dropped_unless_debugging(monkeypatch):
    monkeypatch.setenv("FLYQUANT_BACKEND", "flydsl")
    monkeypatch.setenv("FLYQUANT_ARCH", "gfx950")
    p = layer(3, 2, 4, None, False, seed=6)
    bad = dict(p, ids=p["ids"].clone())
    bad["ids"][1, 0] = 9
    got = run(bad, "silu", out_dtype=torch.float32)
    keep = dict(p, weights=p["weights"].clone())
    keep["weights"][1, 0] = 0.0  # the dropped pair contributes nothing
    want = run(keep, "silu", out_dtype=torch.float32)
    torch.testing.assert_close(got, want, rtol=0, atol=0)
    args = (bad["x"], bad["w1"], bad["w1_scale"], bad["w2"], bad["w2_scale"], bad["weights"], bad["ids"])
    kw = dict(b1=bad["b1"], b2=bad["b2"], expert_mask=bad["mask"], model_dim=MODEL_DIM, inter_dim=INTER_DIM)
    assert len(fq.explain(fq.fused_moe, *args, **kw)) == 3  # explain reads no values either
    monkeypatch.setenv("FLYQUANT_DEBUG", "1")
    with pytest.raises(ValueError, match="topk_ids must lie in"):
        run(bad, "silu")
    # explain refuses what the call refuses: the ids are read under FLYQUANT_DEBUG=1 (it planned them)
    a2 = torch.zeros(6, INTER_DIM, dtype=torch.bfloat16)
    sizes = dict(model_dim=MODEL_DIM, inter_dim=INTER_DIM)
    for fn, fn_args, fn_kw in ((fq.fused_moe, args, kw), (fq.moe_sorting, (bad["ids"], bad["weights"], 4, 16), {}),
                               (fq.moe_stage2, (a2, bad["ids"], bad["weights"], bad["w2"], bad["w2_scale"]), sizes)):
        with pytest.raises(ValueError, match="topk_ids must lie in"):
            fq.explain(fn, *fn_args, **fn_kw)


def test_bad_input(monkeypatch):
    monkeypatch.setenv("FLYQUANT_BACKEND", "reference")
    p = layer(2, 2, 4, None, False, seed=7)
    with pytest.raises(ValueError, match="apply_weights_at must be one of"):
        run(p, "silu", "both")
    with pytest.raises(ValueError, match=r"x.shape\[0\] = 1 must equal topk_ids.shape\[0\] = 2"):
        fq.fused_moe(p["x"][:1], p["w1"], p["w1_scale"], p["w2"], p["w2_scale"], p["weights"], p["ids"])
    with pytest.raises(ValueError, match="w2.shape\\[0\\] = 3 must equal w1.shape\\[0\\] = 4"):
        fq.fused_moe(p["x"], p["w1"], p["w1_scale"], p["w2"][:3], p["w2_scale"], p["weights"], p["ids"])
    with pytest.raises(ValueError, match="activation must be one of"):
        run(p, "tanh")
    # a list expert_mask was an AttributeError ('list' object has no attribute 'shape'), a string
    # out_dtype torch.empty's TypeError naming no argument
    with pytest.raises(TypeError, match="expert_mask must be a torch.Tensor, got list"):
        run(dict(p, mask=[1, 1, 1, 1]), "silu")
    # a mask serving more experts than the weights hold: the kernel path dropped the pairs of the
    # last ones, the reference named its internal sorted_expert_ids; serving fewer ran either way.
    # A value, so read under FLYQUANT_DEBUG=1 (a host synchronisation), as the routing ids are
    monkeypatch.setenv("FLYQUANT_DEBUG", "1")
    for mask, served in (([1, 1, 1, 1, 1], 5), ([1, 0, 1, 1], 3)):
        with pytest.raises(ValueError, match=f"expert_mask serves {served} experts but w1 and w2 hold 4"):
            run(dict(p, mask=torch.tensor(mask, dtype=torch.int32)), "silu")
    monkeypatch.delenv("FLYQUANT_DEBUG")
    with pytest.raises(TypeError, match=r"out_dtype must be one of \(bfloat16, float32\), got 'bfloat16'"):
        run(p, "silu", out_dtype="bfloat16")
    # topk_weights, b1, b2, out, w2_scale given as a list or string: AttributeErrors from the autograd and
    # device checks ("'list' object has no attribute 'requires_grad'"), as moe_stage2's topk_weights,
    # bias and a2; now each is named, before moe_sorting zeroes a given out
    out = torch.full((2, MODEL_DIM), 7.0)
    for key, bad, name in (("weights", [1.0], "topk_weights"), ("b1", [1.0], "b1"), ("b2", "b2", "b2"),
                           ("w2_scale", "s", "w2_scale")):
        with pytest.raises(TypeError, match=f"{name} must be a torch.Tensor, got"):
            run(dict(p, **{key: bad}), "silu", out=out)
        assert bool((out == 7).all())
    with pytest.raises(TypeError, match="out must be a torch.Tensor, got list"):
        run(p, "silu", out=[[0.0]])
    a2 = torch.zeros(4, W2_K, dtype=torch.bfloat16)
    for args, name in (((a2, p["ids"], [1.0], p["w2"], p["w2_scale"]), "topk_weights"),
                       (([1.0], p["ids"], p["weights"], p["w2"], p["w2_scale"]), "a2")):
        with pytest.raises(TypeError, match=f"{name} must be a torch.Tensor, got list"):
            fq.moe_stage2(*args)
    with pytest.raises(TypeError, match="bias must be a torch.Tensor, got list"):
        fq.moe_stage2(a2, p["ids"], p["weights"], p["w2"], p["w2_scale"], bias=[1.0])
    # routing on another device than x / a2: the message named moe_buf, which the caller never passed
    meta_ids, meta_weights = p["ids"].to("meta"), p["weights"].to("meta")
    with pytest.raises(ValueError, match=r"topk_ids must be on the device of x \(cpu\), got meta"):
        fq.fused_moe(p["x"], p["w1"], p["w1_scale"], p["w2"], p["w2_scale"], meta_weights, meta_ids)
    with pytest.raises(ValueError, match=r"topk_ids must be on the device of a2 \(cpu\), got meta"):
        fq.moe_stage2(a2, meta_ids, meta_weights, p["w2"], p["w2_scale"])


@pytest.mark.parametrize("backend", ("reference", "flydsl"))
def test_a_given_out_is_checked_before_it_is_zeroed(backend, monkeypatch):
    # moe_sorting zeroes out before stage 1 reads x: out=x (same shape and dtype when the weights
    # are not padded) gave a wrong layer with no error, and an out of the wrong shape or dtype
    # was zeroed before stage 2 refused it. Both are refused up front, out and x left as given.
    monkeypatch.setenv("FLYQUANT_BACKEND", backend)
    monkeypatch.setenv("FLYQUANT_ARCH", "gfx950")
    p = layer(3, 2, 4, None, True, seed=10)
    args = (p["w1"], p["w1_scale"], p["w2"], p["w2_scale"], p["weights"], p["ids"])
    x = p["x"].clone()
    with pytest.raises(ValueError, match="out must not overlap the input x"):
        fq.fused_moe(x, *args, b1=p["b1"], b2=p["b2"], out=x)
    assert torch.equal(x, p["x"])
    for bad, match in ((torch.full((3, 100), 7.0, dtype=torch.bfloat16), r"out must have shape \(3, 256\)"),
                       (torch.full((3, 256), 7.0, dtype=torch.float16), "out must have dtype in")):
        with pytest.raises((ValueError, TypeError), match=match):
            fq.fused_moe(p["x"], *args, b1=p["b1"], b2=p["b2"], out=bad)
        assert bool((bad == 7).all())
    # an input requiring grad: named as given (stage 1 named its sorted_weights), out left as given
    out = torch.full((3, 256), 7.0, dtype=torch.float32)
    for name, grad in (("x", dict(x=p["x"].clone().requires_grad_())),
                       ("topk_weights", dict(weights=p["weights"].clone().requires_grad_()))):
        q = dict(p, **grad)
        with pytest.raises(ValueError, match=f"fused_moe does not support autograd: {name} requires grad"):
            fq.fused_moe(q["x"], q["w1"], q["w1_scale"], q["w2"], q["w2_scale"], q["weights"], q["ids"], out=out)
        assert bool((out == 7).all())
    # a separate out: the layer, as without one
    fq.fused_moe(p["x"], *args, b1=p["b1"], b2=p["b2"], out=out)
    assert torch.equal(out, fq.fused_moe(p["x"], *args, b1=p["b1"], b2=p["b2"], out_dtype=torch.float32))


@pytest.mark.parametrize("view", ("column slice", "transpose"))
def test_a_non_contiguous_out_costs_one_copy(view, monkeypatch):
    # the layer goes into a contiguous buffer the sorting launch zeroes, then one copy into out;
    # out itself went through moe_buf.zero_(), stage 2's out.contiguous() and its copy back (three
    # more launches on a GPU). The columns of a wider buffer past out's are left as they were.
    monkeypatch.setenv("FLYQUANT_BACKEND", "flydsl")
    monkeypatch.setenv("FLYQUANT_ARCH", "gfx950")
    p = layer(3, 2, 4, None, True, seed=11)
    want = run(p, "silu", out_dtype=torch.float32)
    if view == "column slice":
        wide = torch.full((3, MODEL_DIM + 32), 7.0)
        out = wide[:, :MODEL_DIM]
    else:
        wide = torch.full((MODEL_DIM, 3), 7.0)
        out = wide.t()
    writes = []
    for name in ("zero_", "copy_", "contiguous", "clone"):
        method = getattr(torch.Tensor, name)

        def logged(self, *args, method=method, name=name, **kw):
            if self.untyped_storage().data_ptr() == wide.untyped_storage().data_ptr():
                writes.append(name)
            return method(self, *args, **kw)

        monkeypatch.setattr(torch.Tensor, name, logged)
    got = run(p, "silu", out=out)
    monkeypatch.undo()
    assert writes == ["copy_"], writes
    assert got is out and torch.equal(out, want)
    if view == "column slice":
        assert bool((wide[:, MODEL_DIM:] == 7).all())


def test_a_config_refused_when_planning_leaves_out_as_given(monkeypatch):
    # FLYQUANT_CONFIG tiles and waves that fit no wave split of stage 1 (gate/up pairs of 64
    # columns over 4 waves; stage 2 takes them) are an EnvError when stage 1 plans, which came
    # after moe_sorting had zeroed out: fused_moe plans both stages first when it is set.
    monkeypatch.setenv("FLYQUANT_BACKEND", "flydsl")
    monkeypatch.setenv("FLYQUANT_ARCH", "gfx950")
    monkeypatch.setenv("FLYQUANT_CONFIG", '{"tile_m": 16, "tile_n": 64, "waves": 4}')
    p = layer(3, 2, 4, None, True, seed=10)
    out = torch.full((3, 256), 7.0, dtype=torch.float32)
    with pytest.raises(env.EnvError, match="no wave split fits"):
        fq.fused_moe(p["x"], p["w1"], p["w1_scale"], p["w2"], p["w2_scale"], p["weights"], p["ids"], b1=p["b1"],
                     b2=p["b2"], out=out)
    assert bool((out == 7).all())


@pytest.mark.parametrize("backend", ("reference", "flydsl"))
def test_stage_arguments_are_checked_before_out_is_zeroed(backend, monkeypatch):
    # The stages checked their own arguments when they ran, after moe_sorting had zeroed out: a bad
    # activation, limit, b1, b2 or w2_scale raised, and a given out was left zeroed. Both biases
    # were named "bias" (stage 1's and stage 2's parameter), which did not say which one was wrong,
    # and stage 2's inputs on another device were said to be off a2's (internal to the layer).
    monkeypatch.setenv("FLYQUANT_BACKEND", backend)
    monkeypatch.setenv("FLYQUANT_ARCH", "gfx950")
    p = layer(3, 2, 4, None, True, seed=11)
    out = torch.full((3, 256), 7.0, dtype=torch.float32)
    for bad, match in ((dict(activation="relu"), "activation must be one of"),
                       (dict(limit=-1.0, activation="swiglu_oai"), "limit must be >= 0"),
                       (dict(alpha=float("nan"), activation="swiglu_oai"), "alpha must be finite"),
                       # stage 2 added b2 unweighted: not the docstring's layer (helper-72)
                       (dict(apply_weights_at="stage1"), "b2 with apply_weights_at='stage1': a2 carries the routing"),
                       (dict(b1=p["b1"][:, :10]), r"b1 must have shape \(4, 128\)"),
                       (dict(b2=p["b2"][:1]), r"b2 must have shape \(E = 4"),
                       (dict(b2=p["b2"].to(torch.float64)), "b2 must have dtype in"),
                       (dict(w2_scale=p["w2_scale"][:, :1]), "w2_scale must have shape"),
                       # stage 2's device checks named its a2, internal to the layer
                       (dict(b2=p["b2"].to("meta")), r"b2 must be on the device of x"),
                       (dict(w2=p["w2"].to("meta")), r"w2 must be on the device of x")):
        q = dict(p, **{k: v for k, v in bad.items() if k in p})
        kw = {k: v for k, v in bad.items() if k not in p}
        with pytest.raises((ValueError, TypeError), match=match):
            fq.fused_moe(q["x"], q["w1"], q["w1_scale"], q["w2"], q["w2_scale"], q["weights"], q["ids"], b1=q["b1"],
                         b2=q["b2"], out=out, **kw)
        assert bool((out == 7).all()), bad


def test_a_forced_kernel_refuses_a_stage_shape_before_out_is_zeroed(monkeypatch):
    # inter_dim 48: stage 1's kernel takes it (multiples of 16), stage 2's not (32). Under
    # FLYQUANT_BACKEND=flydsl the BackendError came from stage 2, after moe_sorting had zeroed out
    # and stage 1 had run; both stages plan first now
    monkeypatch.setenv("FLYQUANT_BACKEND", "flydsl")
    monkeypatch.setenv("FLYQUANT_ARCH", "gfx950")
    p = layer(3, 2, 4, seed=11)
    out = torch.full((3, MODEL_DIM), 7.0, dtype=torch.bfloat16)
    with emu.record() as launches, pytest.raises(select.BackendError, match="inter_dim in multiples of 32, got .* = 48"):
        fq.fused_moe(p["x"], p["w1"], p["w1_scale"], p["w2"], p["w2_scale"], p["weights"], p["ids"], out=out,
                     model_dim=MODEL_DIM, inter_dim=48)
    assert not launches and bool((out == 7).all())


def test_gate_up_halves_off_the_kernels_scale_groups(monkeypatch):
    """w1 with gate and up halves of 112 rows (2P = 224: the shuffles take it, the stage-1 kernel takes
    2P in multiples of 64): stage 1 is planned on the reference (explain says why) and the layer runs,
    as on the reference backend; under FLYQUANT_BACKEND=flydsl a BackendError before out is zeroed
    (helper-73: planned as the kernel, then refused by its launcher after moe_sorting zeroed out)."""
    g = torch.Generator().manual_seed(3)
    experts, half, k, n = 2, 112, 256, 256
    p1, s1 = reference.quantize_mxfp4(torch.randn(experts, 2 * half, k, generator=g) * 0.1)
    p2, s2 = reference.quantize_mxfp4(torch.randn(experts, n, 256, generator=g) * 0.1)
    args = (torch.randn(3, k, generator=g).to(torch.bfloat16),
            layouts.shuffle_weight_a16w4(p1, gate_up=True), layouts.shuffle_scale_a16w4(s1, experts, gate_up=True),
            layouts.shuffle_weight_a16w4(p2), layouts.shuffle_scale_a16w4(s2, experts),
            *fq.moe_routing(torch.randn(3, experts, generator=g), 1))
    kw = dict(model_dim=n, inter_dim=96)
    monkeypatch.setenv("FLYQUANT_ARCH", "gfx950")
    plans = fq.explain(fq.fused_moe, *args, **kw)
    assert [plan.backend for plan in plans] == ["flydsl", "reference", "flydsl"], plans
    assert any("w1.shape[1] = 224" in r for r in plans[1].reasons), plans[1]
    with emu.record() as launches:
        got = fq.fused_moe(*args, **kw)
    assert [r.kernel.split("_")[1] for r in launches] == ["sorting", "gemm2"]
    monkeypatch.setenv("FLYQUANT_BACKEND", "reference")
    torch.testing.assert_close(got, fq.fused_moe(*args, **kw), rtol=0.02, atol=0.02)
    monkeypatch.setenv("FLYQUANT_BACKEND", "flydsl")
    out = torch.full((3, n), 7.0, dtype=torch.bfloat16)
    with emu.record() as launches, pytest.raises(select.BackendError, match="w1.shape\\[1\\] = 224"):
        fq.fused_moe(*args, out=out, **kw)
    assert not launches and bool((out == 7).all())


@pytest.mark.parametrize("backend", ("reference", "flydsl"))
def test_outputs_with_elements_sharing_memory_are_refused(backend, monkeypatch):
    # An expand()ed out: stage 1 wrote every routed row into one (a wrong a2, no error), stage 2 and
    # moe_sorting's moe_buf failed in torch ('more than one element of the written-to tensor refers
    # to a single memory location', a RuntimeError). And fused_moe zeroed a bf16 out at an odd
    # element offset before stage 2 refused it. All are ValueErrors before anything is written.
    monkeypatch.setenv("FLYQUANT_BACKEND", backend)
    monkeypatch.setenv("FLYQUANT_ARCH", "gfx950")
    p = layer(3, 2, 4, None, False, seed=11)
    sorted_ = fq.moe_sorting(p["ids"], p["weights"], 4, 16)
    shared = r"out must not have elements sharing memory .* strides \(0, 1\)"
    with pytest.raises(ValueError, match=shared):
        fq.moe_gemm1_a16w4(p["x"], p["w1"], p["w1_scale"], *sorted_, topk=2, block_m=16,
                           out=torch.zeros(1, HALF, dtype=torch.bfloat16).expand(6, HALF))
    with pytest.raises(ValueError, match=shared):
        fq.moe_gemm2_a16w4(torch.zeros(6, HALF, dtype=torch.bfloat16), p["w2"], p["w2_scale"], *sorted_, topk=2,
                           block_m=16, out=torch.zeros(1, X_WIDTH).expand(3, X_WIDTH))
    with pytest.raises(ValueError, match=r"moe_buf must not have elements sharing memory"):
        fq.moe_sorting(p["ids"], p["weights"], 4, 16, moe_buf=torch.zeros(1, 8).expand(4, 8))
    store = torch.full((3, X_WIDTH + 2), 7.0, dtype=torch.bfloat16)
    with pytest.raises(ValueError, match="out must start at a 4-byte aligned address"):
        fq.fused_moe(p["x"], p["w1"], p["w1_scale"], p["w2"], p["w2_scale"], p["weights"], p["ids"],
                     out=store[:, 1:1 + X_WIDTH])
    assert bool((store == 7).all())


def test_torch_compile_traces_the_layer(monkeypatch):
    monkeypatch.setenv("FLYQUANT_BACKEND", "flydsl")
    monkeypatch.setenv("FLYQUANT_ARCH", "gfx950")
    p = layer(3, 2, 4, None, True, seed=8)
    eager = run(p, "swiglu_oai")
    compiled = torch.compile(lambda x: run(dict(p, x=x), "swiglu_oai"), fullgraph=True, backend="eager")
    assert torch.equal(compiled(p["x"]), eager)



def test_torch_compile_traces_new_token_counts(monkeypatch):
    """A second token count makes torch.compile trace with symbolic sizes and strides: the layer
    checks sorted them (a "sort with non-constant keys" failure at the second batch size)."""
    monkeypatch.setenv("FLYQUANT_BACKEND", "flydsl")
    monkeypatch.setenv("FLYQUANT_ARCH", "gfx950")
    torch._dynamo.reset()
    torch._dynamo.utils.counters.clear()
    compiled = torch.compile(lambda p: run(p, "silu"), fullgraph=True, backend="eager")
    for tokens in (3, 5, 6):
        p = layer(tokens, 2, 4, seed=tokens)
        assert torch.equal(compiled(p), run(p, "silu")), tokens
    assert torch._dynamo.utils.counters["stats"]["unique_graphs"] == 2  # the static graph, then the dynamic one


@pytest.mark.parametrize("tuned_tokens", [4, 100])  # an entry near the traced token counts, one serving none
def test_torch_compile_reads_the_tuning_table(tmp_path, monkeypatch, tuned_tokens):
    """With FLYQUANT_TUNING set, torch.compile(fullgraph=True) failed at the table's file read while
    tracing (helper-68). The table is now read as a constant when tracing (a graph compiled with it
    keeps it): the compiled layer equals the eager one, on the tuned config where it applies."""
    monkeypatch.setenv("FLYQUANT_BACKEND", "flydsl")
    monkeypatch.setenv("FLYQUANT_ARCH", "gfx950")
    shape = {"tokens": tuned_tokens, "topk": 2, "experts": 4, "model_dim": MODEL_DIM, "inter_dim": INTER_DIM}
    path = tmp_path / "tuning.json"
    path.write_text(json.dumps({"entries": [{"op": "moe_gemm2_a16w4", "arch": "gfx950", "shape": shape,
                                             "config": {"tile_m": 16, "tile_n": 64, "k_batch": 1, "waves": 1}}]}))
    monkeypatch.setenv("FLYQUANT_TUNING", str(path))
    torch._dynamo.reset()
    compiled = torch.compile(lambda p: run(p, "silu"), fullgraph=True, backend="eager")
    for tokens in (3, 5, 6):
        p = layer(tokens, 2, 4, seed=tokens)
        with emu.record() as launches:
            got = compiled(p)
        assert torch.equal(got, run(p, "silu")), tokens
        assert ("_16x64_kb1_w1x1" in launches[-1].kernel) == (tuned_tokens == 4), launches[-1].kernel


def test_torch_compile_refuses_out_sharing_x(monkeypatch):
    """fused_moe(out=x) zeroes out before stage 1 reads x: eager refuses it by address; under
    torch.compile (no addresses) it returned zeros. Now refused there too, for x itself or a view
    of it, by tensor identity (any view of x's tensor counts)."""
    monkeypatch.setenv("FLYQUANT_BACKEND", "flydsl")
    monkeypatch.setenv("FLYQUANT_ARCH", "gfx950")
    p = layer(4, 2, 4, seed=3)
    x = torch.zeros(4, X_WIDTH, dtype=torch.bfloat16)
    x[:, :MODEL_DIM] = p["x"][:, :MODEL_DIM]
    for out_of in (lambda h: h[:, :MODEL_DIM], lambda h: h.view(4, X_WIDTH)[:, :MODEL_DIM]):
        with pytest.raises(ValueError, match="out must not overlap the input x"):
            run(dict(p, x=x), "silu", out=out_of(x))
        torch._dynamo.reset()
        compiled = torch.compile(lambda h, out_of=out_of: run(dict(p, x=h), "silu", out=out_of(h)), fullgraph=True,
                                 backend="eager")
        with pytest.raises(Exception, match="out must not share memory with the input x"):
            compiled(x.clone())


@pytest.mark.parametrize("backend", ("reference", "flydsl"))
def test_torch_compile_with_inductor_runs_the_layer(backend, monkeypatch):
    """torch.compile's default backend (inductor) failed on the stage ops ("auto_functionalized_v2 was
    not removed": torch 2.13 cannot compile a mutating custom op given an E8M0 tensor); they take the
    scales as uint8 codes. The compiled layer gives the eager bytes."""
    monkeypatch.setenv("FLYQUANT_BACKEND", backend)
    monkeypatch.setenv("FLYQUANT_ARCH", "gfx950")
    torch._dynamo.reset()  # a fresh compile: the graph above ran with backend="eager"
    p = layer(3, 2, 4, None, True, seed=8)
    eager = run(p, "swiglu_oai")
    compiled = torch.compile(lambda x: run(dict(p, x=x), "swiglu_oai"), fullgraph=True)
    assert torch.equal(compiled(p["x"]), eager)

def test_explain_prints_the_three_plans(monkeypatch, capsys):
    monkeypatch.setenv("FLYQUANT_ARCH", "gfx942")
    p = layer(4, 2, 4, None, True, seed=9)
    plans = fq.explain(fq.fused_moe, p["x"], p["w1"], p["w1_scale"], p["w2"], p["w2_scale"], p["weights"], p["ids"],
                       b1=p["b1"], b2=p["b2"], activation="swiglu_oai", model_dim=MODEL_DIM, inter_dim=INTER_DIM)
    assert [plan.op for plan in plans] == ["moe_sorting", "moe_gemm1_a16w4", "moe_gemm2_a16w4"]
    assert all(plan.backend == "flydsl" and plan.arch == "gfx942" for plan in plans)
    printed = capsys.readouterr().out
    assert all(plan.kernel in printed for plan in plans)
    with emu.record() as launches:
        run(p, "swiglu_oai")
    assert len(launches) == 3
    for r, plan in zip(launches, plans):  # the launched kernels are the planned ones
        assert r.kernel == plan.kernel, (r.kernel, plan.kernel)


def test_explain_of_no_tokens_says_the_stages_launch_nothing(monkeypatch):
    """With no tokens fused_moe launches the sorting kernel only (each stage launcher returns before its
    launch); explain said the stages ran their kernels. Their plans now say nothing is launched."""
    monkeypatch.setenv("FLYQUANT_ARCH", "gfx950")
    p = layer(4, 2, 4, None, True, seed=9)
    args = (p["x"][:0], p["w1"], p["w1_scale"], p["w2"], p["w2_scale"], p["weights"][:0], p["ids"][:0])
    kw = dict(b1=p["b1"], b2=p["b2"], activation="swiglu_oai", model_dim=MODEL_DIM, inter_dim=INTER_DIM)
    plans = fq.explain(fq.fused_moe, *args, **kw)
    with emu.record() as launches:
        out = fq.fused_moe(*args, **kw)
    assert out.shape == (0, MODEL_DIM) and [r.kernel for r in launches] == [plans[0].kernel]
    assert [any("nothing is launched" in r for r in plan.reasons) for plan in plans] == [False, True, True]


@pytest.mark.parametrize("arch", ARCHS)
def test_stage_plans_name_the_launched_kernel(arch, monkeypatch):
    """explain()'s stage plans are the launched kernels' names. They were '<op>_<dtype>_<tiles>[_kb<k>]_<waves>w
    [_bias]_<arch>', a prefix of no launched name ('..._w<wn>x<wk>[_w][_bias]_n<N>_k<K>_<arch>'; stage 1's
    swiglu_oai also names alpha and limit, stage 2 an fp32 out 'f32'): the wave layout, the routing weight and
    the sizes the kernel is compiled for were not in the plan."""
    monkeypatch.setenv("FLYQUANT_ARCH", arch)
    p = layer(3, 2, 4, None, True, seed=10)
    for kw in (dict(activation="swiglu_oai", alpha=1.5, apply_weights_at="stage1", out_dtype=torch.float32, b2=None),
               dict(activation="silu"), dict(activation="gelu", b1=None, b2=None)):
        args = (p["x"], p["w1"], p["w1_scale"], p["w2"], p["w2_scale"], p["weights"], p["ids"])
        kw = dict(dict(b1=p["b1"], b2=p["b2"], model_dim=MODEL_DIM, inter_dim=INTER_DIM), **kw)
        plans = fq.explain(fq.fused_moe, *args, **kw)
        with emu.record() as launches:
            fq.fused_moe(*args, **kw)
        assert [r.kernel for r in launches] == [plan.kernel for plan in plans], kw
    a2 = torch.randn(6, INTER_DIM).to(torch.bfloat16)
    kw = dict(bias=p["b2"], out_dtype=torch.float32, model_dim=MODEL_DIM, inter_dim=INTER_DIM)
    plans = fq.explain(fq.moe_stage2, a2, p["ids"], p["weights"], p["w2"], p["w2_scale"], **kw)
    with emu.record() as launches:
        fq.moe_stage2(a2, p["ids"], p["weights"], p["w2"], p["w2_scale"], **kw)
    assert [r.kernel for r in launches] == [plan.kernel for plan in plans]


def test_explain_refuses_what_fused_moe_refuses(monkeypatch):
    # explain(fused_moe, ...) ran none of the stages' checks: a bad activation, b1, w1_scale or out
    # was planned as if it would run, int topk_weights failed inside the selector (KeyError:
    # torch.int32) and a list one with an AttributeError. explain(moe_stage2, ...) planned a wrong
    # w2_scale or bias alike. Each is now the op's own error.
    monkeypatch.setenv("FLYQUANT_ARCH", "gfx950")
    p = layer(3, 2, 4, None, True, seed=12)
    for bad, match in ((dict(activation="relu"), "activation must be one of"),
                       (dict(b1=p["b1"][:, :3]), r"b1 must have shape \(4, 128\)"),
                       (dict(w1_scale=p["w1_scale"][:, :1]), "w1_scale must have shape"),
                       (dict(out=torch.zeros(2, 2)), r"out must have shape \(3, 256\)"),
                       (dict(weights=p["weights"].int()), "topk_weights must have dtype in"),
                       (dict(weights=[1.0]), "topk_weights must be a torch.Tensor")):
        q = dict(p, **{k: v for k, v in bad.items() if k in p})
        kw = {k: v for k, v in bad.items() if k not in p}
        for fn in (fq.fused_moe, lambda *a, **k: fq.explain(fq.fused_moe, *a, **k)):
            with pytest.raises((ValueError, TypeError), match=match):
                fn(q["x"], q["w1"], q["w1_scale"], q["w2"], q["w2_scale"], q["weights"], q["ids"], b1=q["b1"],
                   b2=q["b2"], **kw)
    a2 = torch.zeros(6, W2_K, dtype=torch.bfloat16)
    for bad, match in ((dict(w2_scale=p["w2_scale"][:, :1]), "w2_scale must have shape"),
                       (dict(bias=p["b2"][:1]), r"bias must have shape \(E = 4")):
        args = (a2, p["ids"], p["weights"], p["w2"], bad.get("w2_scale", p["w2_scale"]))
        for fn in (fq.moe_stage2, lambda *a, **k: fq.explain(fq.moe_stage2, *a, **k)):
            with pytest.raises(ValueError, match=match):
                fn(*args, bias=bad.get("bias"))


def test_explain_of_stage_2_and_sorting_refuses_what_they_refuse(monkeypatch):
    # explain(moe_gemm2_a16w4, ...) checked neither bias, out nor out_dtype, explain(moe_sorting, ...)
    # not moe_buf: each wrong one was planned as if the call would run.
    monkeypatch.setenv("FLYQUANT_ARCH", "gfx950")
    p = layer(3, 2, 4, None, True, seed=13)
    sorted_ = fq.moe_sorting(p["ids"], p["weights"], 4, 16)
    a2 = torch.zeros(6, W2_K, dtype=torch.bfloat16)
    for bad, match in ((dict(bias=p["b2"][:1]), r"bias must have shape \(E = 4"),
                       (dict(out=torch.zeros(2, 2)), r"out must have shape \(3, 256\)"),
                       (dict(out_dtype=torch.float16), r"out_dtype must be one of \(bfloat16, float32\)")):
        for fn in (fq.moe_gemm2_a16w4, lambda *a, **k: fq.explain(fq.moe_gemm2_a16w4, *a, **k)):
            with pytest.raises((ValueError, TypeError), match=match):
                fn(a2, p["w2"], p["w2_scale"], *sorted_, topk=2, block_m=16, **bad)
    for fn in (fq.moe_sorting, lambda *a, **k: fq.explain(fq.moe_sorting, *a, **k)):
        with pytest.raises(TypeError, match="moe_buf must be a torch.Tensor, got list"):
            fn(p["ids"], p["weights"], 4, 16, moe_buf=[0.0])


@pytest.mark.gpu
def test_gpu_fused_moe_replays_from_a_cuda_graph(monkeypatch):
    """On a real MI300X/MI355X: fused_moe captured in a CUDA graph (the README says a serving engine
    can, as nothing synchronises with the host) and replayed on other tokens and routing written
    into the captured inputs gives the bytes of an eager call on them."""
    monkeypatch.setenv("FLYQUANT_BACKEND", "flydsl")
    first, other = (layer(17, 4, 8, None, True, seed=seed) for seed in (3, 4))
    second = dict(first, x=other["x"], ids=other["ids"], weights=other["weights"])  # first's weights
    static = {name: v.cuda() if isinstance(v, torch.Tensor) else v for name, v in first.items()}
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):  # compile and load the three kernels outside the capture
        run(static, "swiglu_oai")
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = run(static, "swiglu_oai")
    for p in (second, first):
        for name in ("x", "ids", "weights"):
            static[name].copy_(p[name])
        graph.replay()
        eager = run({name: v.cuda() if isinstance(v, torch.Tensor) else v for name, v in p.items()}, "swiglu_oai")
        assert torch.equal(out.view(torch.int16), eager.view(torch.int16))


@pytest.mark.gpu
@pytest.mark.parametrize("case", CASES, ids=[f"T{c[0]}-k{c[1]}-E{c[2]}-{c[4]}-{'mask' if c[3] else 'all'}-{c[6]}"
                                             for c in CASES])
def test_gpu_layer_within_the_bound(case, monkeypatch):
    """On a real MI300X/MI355X: the same layers through the kernels the selector picks for the
    device (sorting, stage 1, stage 2), within the same bound of the exact float64 layer."""
    monkeypatch.setenv("FLYQUANT_BACKEND", "flydsl")
    tokens, topk, experts, mask, activation, biases, at = case
    p = layer(tokens, topk, experts, mask, biases, seed=tokens + experts, apply_weights_at=at)
    on_device = {name: v.cuda() if isinstance(v, torch.Tensor) else v for name, v in p.items()}
    got = run(on_device, activation, at).cpu()
    exact, bound = exact_layer(p, activation, at)
    err = (got.double() - exact).abs()
    assert bool((err <= bound).all()), float((err - bound).max())
