"""flyquant.nn: MoEExperts (fq.fused_moe as a module) and the GPT-OSS swap, against an exact float64
MoE of the dequantized weights and against transformers' own GPT-OSS model.

Tolerance (per element, derived as in tests/test_fused_moe.py). The module rounds the activations
to bf16 (its contract), so the exact value e is the float64 MoE of x.bf16() with the MXFP4-
dequantized weights. Stage 1: g and u are FP32 sums over model_dim products, |dg| <= (M + 1)
2^-24 (|Wg| @ |x| + |bg|) (likewise du); the activation moves by at most P = 1.2 (|u| + 1) dg +
(|g| + 1) du (its partial derivatives) plus its own 2^-20 (|g| + 1)(|u| + 1); a2 rounds once to
bf16: T1 = 2^-8 |a| + (1 + 2^-8) P'. Stage 2 sums w (W2 @ a2 + b2) in FP32, (I + 2) 2^-24 of the
contributions' magnitude |w| (|W2| @ (|a| + T1) + |b2|), with a2's error entering as |w| |W2| @ T1;
the output rounds each contribution and each add, (1 + topk) u_out times the magnitude (u_out
2^-8 for a bf16 out, 2^-24 for fp32). The sum, times 1 + 2^-6, bounds |module - e| elementwise.
A wrong expert, swapped gate/up, lost bias, padding read as data or wrong routing weight moves
elements by O(|e|), far past it (asserted: bound < 5% of max |e|).
"""

from __future__ import annotations

import io

import pytest
import torch

import flyquant as fq
from flyquant import layouts, reference
from flyquant.nn import MoEExperts, from_gpt_oss_experts, patch_gpt_oss

ARCHS = ("gfx950", "gfx942")
U_BF16 = 2.0**-8
U_F32 = 2.0**-24
DERIV_G = 1.2  # |d act / d g| <= 1.2 (|u| + 1) (tests/test_reference_moe1.py)
ACT_ERR = 2.0**-20


def exact_moe(x, w1, b1, w2, b2, ids, weights, activation, u_out):
    """(float64 exact MoE output, its bound) of the module docstring. x (T, M) as the kernels see it
    (bf16 values); w1 (E, 2I, M) gate rows then up rows, w2 (E, M, I) float64 dequantized weights."""
    x = x.double()
    tokens, topk = ids.shape
    experts, two_i, model = w1.shape
    inter = two_i // 2
    b1 = torch.zeros(experts, two_i, dtype=torch.float64) if b1 is None else b1.double()
    b2 = torch.zeros(experts, model, dtype=torch.float64) if b2 is None else b2.double()
    out = torch.zeros(tokens, model, dtype=torch.float64)
    bound, mag_sum = torch.zeros_like(out), torch.zeros_like(out)
    for t in range(tokens):
        for s in range(topk):
            e, w = int(ids[t, s]), float(weights[t, s])
            wg, wu, bg, bu = w1[e, :inter], w1[e, inter:], b1[e, :inter], b1[e, inter:]
            g, u = wg @ x[t] + bg, wu @ x[t] + bu
            dg = (model + 1) * U_F32 * (wg.abs() @ x[t].abs() + bg.abs())
            du = (model + 1) * U_F32 * (wu.abs() @ x[t].abs() + bu.abs())
            a = reference.moe_activation(g, u, activation)
            prop = DERIV_G * (u.abs() + 1) * dg + (g.abs() + 1) * du + ACT_ERR * (g.abs() + 1) * (u.abs() + 1)
            t1 = U_BF16 * a.abs() + (1 + U_BF16) * prop
            out[t] += w * (w2[e] @ a + b2[e])
            mag = abs(w) * (w2[e].abs() @ (a.abs() + t1) + b2[e].abs())
            bound[t] += (inter + 2) * U_F32 * mag + abs(w) * (w2[e].abs() @ t1)
            mag_sum[t] += mag
    bound += (1 + topk) * u_out * mag_sum
    return out, (1 + 2.0**-6) * bound


def dense_layer(experts, model, inter, tokens, topk, seed, biases=True):
    g = torch.Generator().manual_seed(seed)
    w1 = torch.randn(experts, 2 * inter, model, generator=g) * 0.15
    w2 = torch.randn(experts, model, inter, generator=g) * 0.15
    b1 = torch.randn(experts, 2 * inter, generator=g) * 0.5 if biases else None
    b2 = torch.randn(experts, model, generator=g) * 0.5 if biases else None
    x = torch.randn(tokens, model, generator=g)
    weights, ids = fq.moe_routing(torch.randn(tokens, experts, generator=g), topk, softmax_after_topk=True)
    return dict(w1=w1, w2=w2, b1=b1, b2=b2, x=x, weights=weights, ids=ids)


def dequantized(w, model_cols):
    """MXFP4 round trip of w along its last dim (zero-padded to a multiple of 32 first), as from_dense
    quantizes it (floor)."""
    cols = -(-model_cols // 32) * 32
    padded = torch.zeros(*w.shape[:-1], cols)
    padded[..., :model_cols] = w
    return reference.dequantize_mxfp4(*reference.quantize_mxfp4(padded)).double()[..., :model_cols]


# (model_dim, inter_dim): 80 = not a multiple of 32 (the padded block shares real weights), 48 of P = 256
# (a partial wave pair); E 8, T 5, top-2, GPT-OSS's clamped swiglu with biases, fp32 and bf16 hidden states.
MODEL, INTER, EXPERTS, TOKENS, TOPK = 80, 48, 8, 5, 2


def check_layer(dtype, activation="swiglu_oai", biases=True, seed=0):
    p = dense_layer(EXPERTS, MODEL, INTER, TOKENS, TOPK, seed, biases)
    m = MoEExperts.from_dense(p["w1"], p["w2"], p["b1"], p["b2"], activation=activation)
    x = p["x"].to(dtype)
    got = m(x, p["ids"], p["weights"])
    assert got.dtype == dtype and got.shape == x.shape
    b1 = None if p["b1"] is None else p["b1"].float()
    exact, bound = exact_moe(x.to(torch.bfloat16), dequantized(p["w1"], MODEL), b1, dequantized(p["w2"], INTER), p["b2"],
                             p["ids"], p["weights"], activation, U_F32 if dtype == torch.float32 else U_BF16)
    assert (bound < 0.05 * exact.abs().max()).all()
    err = (got.double() - exact).abs()
    assert bool((err <= bound).all()), f"worst excess {float((err - bound).max()):.3g}, max err {float(err.max()):.3g}"
    return m


@pytest.mark.parametrize("arch", ARCHS)
def test_from_dense_matches_the_exact_moe_on_the_kernels(arch, monkeypatch):
    monkeypatch.setenv("FLYQUANT_BACKEND", "flydsl")
    monkeypatch.setenv("FLYQUANT_ARCH", arch)
    with fq.emu.record() as launches:
        m = check_layer(torch.float32)
    assert [r.kernel.split("_a16w4")[0].split("_e")[0] for r in launches] == ["moe_sorting", "moe_gemm1", "moe_gemm2"]
    assert all(r.kernel.endswith(arch) for r in launches)
    assert m.padded_dims == dict(K=256, P=256, N=96)


def test_from_dense_matches_the_exact_moe_on_the_reference(monkeypatch):
    monkeypatch.setenv("FLYQUANT_BACKEND", "reference")
    check_layer(torch.float32)
    check_layer(torch.bfloat16, activation="silu", biases=False, seed=1)


def test_from_mxfp4_takes_the_codes_as_given(monkeypatch):
    """Packed FP4 + scales from the same quantization give the same buffers as from_dense, bit for bit."""
    inter = 64  # model 96 and inter 64: multiples of 32, packable unpadded
    p = dense_layer(EXPERTS, 96, inter, TOKENS, TOPK, seed=2)
    dense = MoEExperts.from_dense(p["w1"], p["w2"], p["b1"], p["b2"], activation="swiglu_oai")
    p1, s1 = reference.quantize_mxfp4(p["w1"])
    p2, s2 = reference.quantize_mxfp4(p["w2"])
    packed = MoEExperts.from_mxfp4(p1, s1.view(torch.uint8), p2, s2, p["b1"], p["b2"], activation="swiglu_oai")
    for name, buf in dense.named_buffers():
        assert torch.equal(buf.view(torch.uint8), getattr(packed, name).view(torch.uint8)), name
    # the padded layout unshuffles to the given codes: gate rows [0, I), up rows [P, P + I), zeros elsewhere
    w1 = layouts.unshuffle_weight_a16w4(packed.w1, gate_up=True)
    assert torch.equal(w1[:, :inter, :48], p1[:, :inter]) and torch.equal(w1[:, 256:256 + inter, :48], p1[:, inter:])
    assert (w1[:, inter:256] == 0).all() and (w1[:, 256 + inter:] == 0).all() and (w1[:, :, 48:] == 0).all()


def test_state_dict_round_trips(monkeypatch, tmp_path):
    monkeypatch.setenv("FLYQUANT_BACKEND", "reference")
    p = dense_layer(EXPERTS, MODEL, INTER, TOKENS, TOPK, seed=3)
    m = MoEExperts.from_dense(p["w1"], p["w2"], p["b1"], p["b2"], activation="swiglu_oai", alpha=1.5, limit=6.0)
    buf = io.BytesIO()
    torch.save(m.state_dict(), buf)
    buf.seek(0)
    q = dense_layer(EXPERTS, MODEL, INTER, TOKENS, TOPK, seed=4)
    other = MoEExperts.from_dense(q["w1"], q["w2"], q["b1"], q["b2"], activation="silu")
    assert not torch.equal(other(p["x"], p["ids"], p["weights"]), m(p["x"], p["ids"], p["weights"]))
    other.load_state_dict(torch.load(buf))
    assert (other.activation, other.alpha, other.limit, other.model_dim, other.inter_dim) == ("swiglu_oai", 1.5, 6.0, MODEL, INTER)
    assert torch.equal(other(p["x"], p["ids"], p["weights"]), m(p["x"], p["ids"], p["weights"]))


def test_bad_input():
    p = dense_layer(2, 64, 32, 2, 1, seed=5)
    with pytest.raises(ValueError, match=r"w2 must have shape \(E, model, inter\) = \(2, 64, 32\)"):
        MoEExperts.from_dense(p["w1"], p["w2"][:, :, :16])
    with pytest.raises(ValueError, match=r"b1 must have shape \(E, 2 \* inter\) = \(2, 64\)"):
        MoEExperts.from_dense(p["w1"], p["w2"], b1=p["b1"][:, :10])
    with pytest.raises(ValueError, match="activation must be one of"):
        MoEExperts.from_dense(p["w1"], p["w2"], activation="relu")
    m = MoEExperts.from_dense(p["w1"], p["w2"])
    with pytest.raises(ValueError, match="hidden_states.shape\\[-1\\] = 63 must equal model_dim = 64"):
        m(p["x"][:, :63], p["ids"], p["weights"])
    p1, s1 = reference.quantize_mxfp4(p["w1"])
    p2, s2 = reference.quantize_mxfp4(p["w2"])
    with pytest.raises(ValueError, match="w1_scale"):
        MoEExperts.from_mxfp4(p1, s1[:, :, :1], p2, s2)
