"""fq.moe_gemm1_a16w4 (custom op + fake, selector plan, explain) under flyquant.emu on both arches,
and stage 1 then stage 2 end to end against an FP32 torch MoE of the dequantized weights.

End-to-end tolerance (derived). Stage 1's a2 element is within T1 = 2^-8 |a| + (1 + 2^-8) P of the
exact activation a (tests/test_moe_gemm1_kernel.py), computed here per element in float64. Stage 2
(no bias, bf16 out, k_batch chosen by the selector) then sums w_k * (a2 @ W2^T): its own error is
bounded as in tests/test_moe_gemm2_kernel.py (FP32 accumulation, bf16 rounding of each contribution
and of each atomic add), and the a2 errors enter linearly: sum_k |w_k| (T1 @ |W2|^T). Both bounds
are computed in float64 from the dequantized weights; their sum (times 1 + 2^-6 for second-order
terms) bounds |layer - exact| on every element.
"""

from __future__ import annotations

import re

import pytest
import torch

import flyquant as fq
from flyquant import layouts, reference, select

from test_moe_gemm1_kernel import exact_and_tolerance, make_problem, SENTINEL
from test_moe_gemm2_kernel import make_problem as stage2_problem
from test_moe_safety import set_backend

ARCHS = ("gfx950", "gfx942")
U_BF16 = 2.0**-8
U_F32 = 2.0**-24


@pytest.fixture
def flydsl_arch(monkeypatch):
    def use(arch):
        monkeypatch.setenv("FLYQUANT_BACKEND", "flydsl")
        monkeypatch.setenv("FLYQUANT_ARCH", arch)
    return use


def _call(p, activation, apply_weights=False, out=None):
    return fq.moe_gemm1_a16w4(p["x"], p["w1"], p["w1_scale"], *p["sorting"], topk=p["topk"], block_m=p["block_m"],
                              bias=p["bias"], activation=activation, apply_weights=apply_weights, out=out,
                              model_dim=p["model_dim"], inter_dim=p["inter_dim"])


@pytest.mark.parametrize("arch", ARCHS)
def test_api_runs_the_kernel_within_the_bound(arch, flydsl_arch, capsys):
    flydsl_arch(arch)
    p = make_problem(6, 2, 4, 224, 48, 64, 256, 16, seed=21, bias_dtype=torch.bfloat16)
    plan = fq.explain(fq.moe_gemm1_a16w4, p["x"], p["w1"], p["w1_scale"], *p["sorting"], topk=2, block_m=16,
                      bias=p["bias"], activation="swiglu_oai", model_dim=224, inter_dim=48)
    assert plan.backend == "flydsl" and plan.arch == arch and "moe_gemm1_a16w4_swiglu_oai" in capsys.readouterr().out
    import flyquant.emu as emu

    out = torch.full((12, 48), SENTINEL, dtype=torch.bfloat16)
    with emu.record() as launches:
        got = _call(p, "swiglu_oai", True, out=out)
    assert got is out and len(launches) == 1 and launches[0].stats.kernel.startswith("moe_gemm1_a16w4_swiglu_oai")
    exact, tol = exact_and_tolerance(p, "swiglu_oai", True)
    assert ((got.double() - exact).abs() <= tol).all()
    # torch.compile traces the op (fake implementation), same values
    compiled = torch.compile(lambda x: _call(dict(p, x=x), "swiglu_oai", True), fullgraph=True, backend="eager")
    assert torch.equal(compiled(p["x"]), got)


def test_reference_backend_and_errors(monkeypatch):
    monkeypatch.setenv("FLYQUANT_BACKEND", "reference")
    p = make_problem(3, 2, 3, 256, 32, 32, 256, 16, seed=22, skip_expert=None)
    got = _call(p, "gelu")
    ref = reference.moe_gemm1_a16w4(p["x"], p["w1"], p["w1_scale"], *p["sorting"], topk=2, block_m=16,
                                    activation="gelu")
    assert torch.equal(got, ref)
    with pytest.raises(ValueError, match="activation must be one of"):
        _call(p, "tanh")
    with pytest.raises(ValueError, match="out must have shape"):
        _call(p, "silu", out=torch.zeros(3, 32, dtype=torch.bfloat16))


@pytest.mark.parametrize("model_dim,inter_dim", [(240, 48), (224, 40), (232, 64)])
def test_sizes_off_the_kernel_steps_go_to_the_reference(model_dim, inter_dim, flydsl_arch, monkeypatch):
    """model_dim off 32 or inter_dim off 16 (true sizes of padded weights): the kernel does not take
    them, so the default backend plans the reference, says why and gives its answer; forcing the
    kernel is an error naming the size."""
    monkeypatch.setenv("FLYQUANT_ARCH", "gfx950")
    p = make_problem(5, 2, 3, model_dim, inter_dim, 64, 256, 16, seed=23)
    plan = fq.explain(fq.moe_gemm1_a16w4, p["x"], p["w1"], p["w1_scale"], *p["sorting"], topk=2, block_m=16,
                      activation="silu", model_dim=model_dim, inter_dim=inter_dim)
    assert plan.backend == "reference" and any("multiples of" in r for r in plan.reasons), plan.reasons
    ref = reference.moe_gemm1_a16w4(p["x"], p["w1"], p["w1_scale"], *p["sorting"], topk=2, block_m=16,
                                    activation="silu", model_dim=model_dim, inter_dim=inter_dim)
    assert torch.equal(_call(p, "silu"), ref)
    flydsl_arch("gfx950")
    with pytest.raises(select.BackendError, match=f"inter_dim = {inter_dim}, model_dim = {model_dim}"):
        _call(p, "silu")
    # stage 2: N = model_dim in 16s, K = inter_dim in 32s (each case here is off one of them)
    monkeypatch.delenv("FLYQUANT_BACKEND")
    q = stage2_problem(5, 2, 3, model_dim, inter_dim, 16, w_n=256, w_k=256)
    args = (q["a2"], q["w2"], q["w2_scale"], *q["sorting"])
    plan = fq.explain(fq.moe_gemm2_a16w4, *args, topk=2, block_m=16, model_dim=model_dim, inter_dim=inter_dim)
    assert plan.backend == "reference" and any("multiples of" in r for r in plan.reasons), plan.reasons
    ref = reference.moe_gemm2_a16w4(*args, topk=2, block_m=16, model_dim=model_dim, inter_dim=inter_dim)
    assert torch.equal(fq.moe_gemm2_a16w4(*args, topk=2, block_m=16, model_dim=model_dim, inter_dim=inter_dim), ref)


def _dense_layer(p, w2_packed, w2_scales, model_dim, inter_dim):
    """(exact layer output, bound) in float64: FP32 torch MoE of the dequantized weights as the value,
    the module docstring's bound from stage 1's T1 and stage 2's accumulation and roundings."""
    a_exact, t1 = exact_and_tolerance(p, "silu", False)
    w2 = reference.dequantize_mxfp4(w2_packed, w2_scales).double()[:, :model_dim, :inter_dim]
    tokens, topk = p["ids"].shape
    out = torch.zeros(tokens, model_dim, dtype=torch.float64)
    bound = torch.zeros_like(out)
    c_abs = torch.zeros_like(out)
    for t in range(tokens):
        for s in range(topk):
            e, w = int(p["ids"][t, s]), float(p["weights"][t, s])
            a, da = a_exact[t * topk + s], t1[t * topk + s]
            y = w * (w2[e] @ a)
            out[t] += y
            # stage 2 on the bf16 a2 (|a| + da): FP32 sum, own bf16 rounding, a2's error through W2
            mag = abs(w) * (w2[e].abs() @ (a.abs() + da))
            bound[t] += (inter_dim + 2) * U_F32 * mag + abs(w) * (w2[e].abs() @ da)
            c_abs[t] += mag
    n = topk
    bound += U_BF16 * c_abs + n * U_BF16 * c_abs  # each contribution's bf16 rounding and each atomic add
    return out, (1 + 2.0**-6) * bound


@pytest.mark.parametrize("arch", ARCHS)
def test_stage1_then_stage2_end_to_end(arch, flydsl_arch):
    """A small Mixtral-style layer (silu, no biases): 5 tokens, top-2 of 4 experts, hidden 256
    (model_dim 224 true), inter 64 (32 true: padding), through fq.moe_sorting,
    fq.moe_gemm1_a16w4 and fq.moe_gemm2_a16w4, against the exact float64 MoE of the dequantized
    weights within the derived bound."""
    flydsl_arch(arch)
    md, idim, half, w_k = 224, 32, 64, 256
    p = make_problem(5, 2, 4, md, idim, half, w_k, 16, seed=23, skip_expert=None)
    gen = torch.Generator().manual_seed(24)
    w2f = torch.randn(4, w_k, 256, generator=gen) * 0.1  # (E, model_dim padded, inter padded to 256)
    w2_packed, w2_scales = reference.quantize_mxfp4(w2f)
    w2 = layouts.shuffle_weight_a16w4(w2_packed)
    w2_scale = layouts.shuffle_scale_a16w4(w2_scales, 4)
    a2 = fq.moe_gemm1_a16w4(p["x"], p["w1"], p["w1_scale"], *p["sorting"], topk=2, block_m=16, activation="silu",
                            model_dim=md, inter_dim=idim)
    out = fq.moe_gemm2_a16w4(a2, w2, w2_scale, *p["sorting"], topk=2, block_m=16, model_dim=md, inter_dim=idim)
    expected, bound = _dense_layer(p, w2_packed, w2_scales, md, idim)
    err = (out.double() - expected).abs()
    assert (err <= bound).all(), float((err - bound).max())
    assert (bound < 0.05 * expected.abs().max()).all()


def test_warmup_runs_stage1_before_stage2():
    """warmup(activation=...) runs the stage-1 kernel (bias, the activation in its name) before each
    stage 2, on weights padded as the shuffles require (model_dim 64 -> K 256, inter 224 -> 2 x 256 rows)."""
    import flyquant.emu as emu

    with emu.record() as launches:
        plans = fq.warmup(model_dim=64, inter_dim=224, experts=4, topk=2, tokens=(1, 3), activation="swiglu_oai",
                          stage1_bias=True)
    assert [p.op for p in plans] == ["moe_sorting", "moe_gemm1_a16w4", "moe_gemm2_a16w4"] * 2
    assert all(p.backend == "flydsl" for p in plans)
    kernels = [rec.stats.kernel for rec in launches if rec.stats.kernel.startswith("moe_gemm")]
    assert [k[:9] for k in kernels] == ["moe_gemm1", "moe_gemm2"] * 2
    assert all("swiglu_oai" in k and "_bias" in k for k in kernels[0::2])


@pytest.mark.parametrize("backend", ["reference", "gfx950"])
def test_negative_or_nan_swiglu_limit_is_refused(backend, monkeypatch):
    """swiglu_oai's limit must be >= 0 (inf: no clamp). A negative one made the kernels' v_med3_f32
    clamps and the reference's torch.clamp (min > max gives max) disagree silently: up to 0.31 apart
    where the reference gives 0. Refused alike on both backends; limit 0 and inf still run."""
    set_backend(monkeypatch, "reference" if backend == "reference" else "flydsl", "gfx950")
    p = make_problem(3, 2, 3, 256, 32, 32, 256, 16, seed=25, skip_expert=None)
    args = (p["x"], p["w1"], p["w1_scale"], *p["sorting"])
    for limit in (-1.0, float("nan")):
        with pytest.raises(ValueError, match="limit must be >= 0 for swiglu_oai"):
            fq.moe_gemm1_a16w4(*args, topk=2, block_m=16, activation="swiglu_oai", limit=limit)
        with pytest.raises(ValueError, match="limit must be >= 0 for swiglu_oai"):
            fq.explain(fq.moe_gemm1_a16w4, *args, topk=2, block_m=16, activation="swiglu_oai", limit=limit)
    for alpha in (float("nan"), float("inf"), -float("inf"), 1e39):  # a NaN layer or a step, without an error
        with pytest.raises(ValueError, match=r"alpha must be finite in FP32 \(\|alpha\| <= FLT_MAX\) for swiglu_oai"):
            fq.moe_gemm1_a16w4(*args, topk=2, block_m=16, activation="swiglu_oai", alpha=alpha)
    fq.moe_gemm1_a16w4(*args, topk=2, block_m=16, activation="silu", limit=-1.0, alpha=float("nan"))  # unused: not checked
    for limit in (0.0, float("inf")):  # the ends of the range run (values: the fuzzed limits' bound checks)
        got = fq.moe_gemm1_a16w4(*args, topk=2, block_m=16, activation="swiglu_oai", limit=limit)
        ref = reference.moe_gemm1_a16w4(*args, topk=2, block_m=16, activation="swiglu_oai", limit=limit)
        assert torch.equal(got.isfinite(), ref.isfinite()) and got.isfinite().all()


@pytest.mark.parametrize("backend", ["reference", "gfx950"])
def test_alpha_and_limit_must_be_real_numbers(backend, monkeypatch):
    """alpha and limit went through float(): "7" ran as 7.0 and True as 1.0 (no error), None or a list
    was float()'s TypeError naming neither argument, "x" its ValueError. Both backends and explain."""
    set_backend(monkeypatch, "reference" if backend == "reference" else "flydsl", "gfx950")
    p = make_problem(3, 2, 3, 256, 32, 32, 256, 16, seed=26, skip_expert=None)
    args = (p["x"], p["w1"], p["w1_scale"], *p["sorting"])
    for name in ("alpha", "limit"):
        for bad in ("7", True, None, [1.0]):
            for fn in (fq.moe_gemm1_a16w4, lambda *a, **k: fq.explain(fq.moe_gemm1_a16w4, *a, **k)):
                with pytest.raises(TypeError, match=re.escape(f"{name} must be a real number, got {bad!r}")):
                    fn(*args, topk=2, block_m=16, activation="swiglu_oai", **{name: bad})
    fq.moe_gemm1_a16w4(*args, topk=2, block_m=16, activation="swiglu_oai", alpha=2, limit=7)  # ints are numbers


@pytest.mark.parametrize("backend", ["reference", "gfx950"])
def test_apply_weights_must_be_a_bool(backend, monkeypatch):
    """Stage 1 took apply_weights through bool(): "no" ran as True (rows times their routing weight,
    no error); stage 2 passed it to its custom op, whose schema error named the internal
    flyquant::moe_gemm2_a16w4_ declaration (and took None or 0 as False). Both ops and explain."""
    set_backend(monkeypatch, "reference" if backend == "reference" else "flydsl", "gfx950")
    p = make_problem(3, 2, 3, 256, 32, 32, 256, 16, seed=27, skip_expert=None)
    q = stage2_problem(3, 2, 4, 64, 256, 16, seed=27)
    stage1 = (fq.moe_gemm1_a16w4, p["x"], p["w1"], p["w1_scale"], *p["sorting"])
    stage2 = (fq.moe_gemm2_a16w4, q["a2"], q["w2"], q["w2_scale"], *q["sorting"])
    for fn, *args in (stage1, stage2):
        for bad in ("no", 0, None):
            for call in (fn, lambda *a, fn=fn, **k: fq.explain(fn, *a, **k)):
                with pytest.raises(ValueError, match=re.escape(f"apply_weights must be a bool, got {bad!r}")):
                    call(*args, topk=2, block_m=16, apply_weights=bad)
