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
    quantize = [r.kernel for r in launches if r.kernel.startswith("mxfp4_rows_")]  # from_dense: 2 per expert
    assert len(quantize) == 2 * EXPERTS and all(f"_fp32_{arch}_" in name for name in quantize)
    layer = [r for r in launches if not r.kernel.startswith("mxfp4_rows_")]
    assert [r.kernel.split("_a16w4")[0].split("_e")[0] for r in layer] == ["moe_sorting", "moe_gemm1", "moe_gemm2"]
    assert all(r.kernel.endswith(arch) for r in layer)
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


def test_a_state_dict_is_checked_like_the_constructor(monkeypatch):
    """load_state_dict took the extra state's sizes and activation through int() / float(): a
    float, bool or oversized model_dim, or a negative swiglu limit, loaded silently."""
    monkeypatch.setenv("FLYQUANT_BACKEND", "reference")
    p = dense_layer(EXPERTS, MODEL, INTER, TOKENS, TOPK, seed=3)
    m = MoEExperts.from_dense(p["w1"], p["w2"], p["b1"], p["b2"], activation="swiglu_oai")
    good = m.state_dict()
    key = next(k for k in good if k.endswith("_extra_state"))
    for change, error, match in [(dict(model_dim=63.7), ValueError, "model_dim must be an int"),
                                 (dict(inter_dim=True), ValueError, "inter_dim must be an int"),
                                 (dict(model_dim=10 * MODEL), ValueError, "do not fit the padded weights"),
                                 (dict(limit=-1.0), ValueError, "limit must be >= 0"),
                                 (dict(alpha="1.7"), TypeError, "alpha must be a real number"),
                                 (dict(activation="relu"), ValueError, "activation must be one of")]:
        with pytest.raises(error, match=match):
            m.load_state_dict({**good, key: {**good[key], **change}})
    m.load_state_dict(good)  # and the module kept what it had
    assert (m.model_dim, m.activation, m.limit) == (MODEL, "swiglu_oai", 7.0)


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


# ---- GPT-OSS: transformers' own model, its experts swapped --------------------------------------

# The tiny model: 2 layers (one sliding-window, one full attention), hidden 64, intermediate 64
# (multiples of 32: the checkpoint's MXFP4 blocks; padded to K = P = 256 for the shuffles), 8 experts,
# top-2, 2 heads of 32 (1 KV head), vocab 128, 6 tokens. Expert weights std 0.3 and biases std 0.5
# (transformers' init, 0.02 and 0, would make the MoE a rounding error beside the residual and never
# reach swiglu's clamp at 7).
OSS = dict(vocab_size=128, hidden_size=64, intermediate_size=64, num_hidden_layers=2, num_attention_heads=2,
           num_key_value_heads=1, head_dim=32, num_local_experts=8, num_experts_per_tok=2, sliding_window=4,
           max_position_embeddings=64)
SEQ = 6
# Logits: no bound is derived through attention and norms; instead the scale of error bf16 activations
# bring: transformers' own logits moved by rounding each experts module's input to bf16 (d_bf16). The
# kernels round twice as often (x and a2, 2^-9 relative each) plus FP32 sums, so about 2 d_bf16;
# LOGIT_RATIO allows 2x more for how the two propagate through 2 layers. Measured: 1.44 d_bf16 on both
# arches and the reference (0.0031 on logits of max 0.58); a wrong gate/up order or limit fails the
# per-block bound first.
LOGIT_RATIO = 4.0


def tiny_gpt_oss(seed=0):
    """(model, checkpoint): a random fp32 GptOssForCausalLM whose expert weights are MXFP4 values, written
    in by transformers' own dequantization of the checkpoint tensors (`*_blocks`, `*_scales`, made here
    with our floor quantize) that `checkpoint` holds under the model's parameter names."""
    from transformers import GptOssConfig, GptOssForCausalLM
    from transformers.integrations.mxfp4 import convert_moe_packed_tensors

    torch.manual_seed(seed)
    model = GptOssForCausalLM(GptOssConfig(**OSS, attn_implementation="eager", experts_implementation="eager")).eval()
    g = torch.Generator().manual_seed(seed)
    e, h, i = OSS["num_local_experts"], OSS["hidden_size"], OSS["intermediate_size"]
    checkpoint = {}
    for n, layer in enumerate(model.model.layers):
        ex, prefix = layer.mlp.experts, f"model.layers.{n}.mlp.experts."
        for proj, rows, cols in (("gate_up_proj", 2 * i, h), ("down_proj", h, i)):
            packed, scales = reference.quantize_mxfp4(torch.randn(e, rows, cols, generator=g) * 0.3)
            blocks, codes = packed.view(e, rows, cols // 32, 16), scales.view(torch.uint8)
            checkpoint[prefix + proj + "_blocks"], checkpoint[prefix + proj + "_scales"] = blocks, codes
            with torch.no_grad():
                getattr(ex, proj).copy_(convert_moe_packed_tensors(blocks, codes, dtype=torch.float32))
        with torch.no_grad():
            ex.gate_up_proj_bias.copy_(torch.randn(e, 2 * i, generator=g) * 0.5)
            ex.down_proj_bias.copy_(torch.randn(e, h, generator=g) * 0.5)
        checkpoint[prefix + "gate_up_proj_bias"] = ex.gate_up_proj_bias.detach().clone()
        checkpoint[prefix + "down_proj_bias"] = ex.down_proj_bias.detach().clone()
    return model, checkpoint


def run_capturing(model, tokens, x_hook=None):
    """Logits and each experts module's (hidden_states, router_indices, routing_weights, output)."""
    caps = []
    handles = [layer.mlp.experts.register_forward_hook(
        lambda m, args, out: caps.append(tuple(a.detach().clone() for a in (*args, out))))
        for layer in model.model.layers]
    if x_hook is not None:
        handles += [layer.mlp.experts.register_forward_pre_hook(x_hook) for layer in model.model.layers]
    try:
        with torch.no_grad():
            logits = model(tokens).logits
    finally:
        for hnd in handles:
            hnd.remove()
    return logits, caps


def gpt_oss_exact(experts, x, ids, weights):
    """(transformers' own GptOssExperts forward in float64 on the bf16 activations the kernels see,
    exact_moe's value and bound) for one block."""
    import copy

    ex = copy.deepcopy(experts).double()
    with torch.no_grad():
        theirs = ex(x.to(torch.bfloat16).double(), ids, weights.double())
        gu, bgu = ex.gate_up_proj, ex.gate_up_proj_bias
        w1 = torch.cat([gu[..., 0::2].transpose(1, 2), gu[..., 1::2].transpose(1, 2)], dim=1)  # gate rows, up rows
        b1 = torch.cat([bgu[:, 0::2], bgu[:, 1::2]], dim=1)
        ours, bound = exact_moe(x.to(torch.bfloat16), w1, b1, ex.down_proj.transpose(1, 2), ex.down_proj_bias,
                                ids, weights, "swiglu_oai", U_F32)
    return theirs, ours, bound


BACKENDS = [("flydsl", "gfx950"), ("flydsl", "gfx942"), ("reference", "gfx950")]


@pytest.mark.parametrize("backend,arch", BACKENDS, ids=[f"{b}-{a}" for b, a in BACKENDS])
def test_patch_gpt_oss_agrees_with_transformers(backend, arch, monkeypatch):
    """Every MoE block within the derived bound of transformers' own float64 forward of the same
    (MXFP4-valued) weights on the block's bf16 input; routing unchanged; logits within LOGIT_RATIO times
    what rounding the experts' inputs to bf16 alone moves transformers' logits by."""
    import copy

    monkeypatch.setenv("FLYQUANT_BACKEND", backend)
    monkeypatch.setenv("FLYQUANT_ARCH", arch)
    model, _ = tiny_gpt_oss()
    tokens = torch.randint(0, OSS["vocab_size"], (1, SEQ), generator=torch.Generator().manual_seed(1))
    ref_logits, ref_caps = run_capturing(model, tokens)
    bf16_logits, _ = run_capturing(model, tokens, x_hook=lambda m, args: (args[0].bfloat16().float(), *args[1:]))
    reference_experts = [copy.deepcopy(layer.mlp.experts) for layer in model.model.layers]
    routers = [layer.mlp.router for layer in model.model.layers]
    assert patch_gpt_oss(model) is model
    assert all(isinstance(layer.mlp.experts, MoEExperts) for layer in model.model.layers)
    assert [layer.mlp.router for layer in model.model.layers] == routers  # the routers kept, as they were
    with fq.emu.record() as launches:
        logits, caps = run_capturing(model, tokens)
    assert len(launches) == (3 * OSS["num_hidden_layers"] if backend == "flydsl" else 0)
    report = []
    for n, ((x, ids, w, out), ref_cap) in enumerate(zip(caps, ref_caps)):
        assert torch.equal(ids, ref_cap[1]), f"layer {n}: routing changed"
        theirs, ours, bound = gpt_oss_exact(reference_experts[n], x, ids, w)
        torch.testing.assert_close(ours, theirs, rtol=1e-12, atol=1e-12)  # our exact MoE is transformers' math
        assert (bound < 0.05 * theirs.abs().max()).all()
        err = (out.double() - theirs).abs()
        assert bool((err <= bound).all()), f"layer {n}: worst excess {float((err - bound).max()):.3g}"
        report.append(float((err / bound).max()))
    d_kernel = float((logits - ref_logits).abs().max())
    d_bf16 = float((bf16_logits - ref_logits).abs().max())
    assert 0 < d_bf16 and d_kernel <= LOGIT_RATIO * d_bf16, (d_kernel, d_bf16, report)


def dequantized_module(m: MoEExperts):
    """(w1 (E, 2P, K), w2 (E, N, P)) fp32: the module's buffers unshuffled and dequantized."""
    e = m.num_experts
    w1 = layouts.unshuffle_weight_a16w4(m.w1, gate_up=True)
    s1 = layouts.unshuffle_scale_a16w4(m.w1_scale, e, gate_up=True).view(*w1.shape[:2], -1)
    w2 = layouts.unshuffle_weight_a16w4(m.w2)
    s2 = layouts.unshuffle_scale_a16w4(m.w2_scale, e).view(*w2.shape[:2], -1)
    return reference.dequantize_mxfp4(w1, s1), reference.dequantize_mxfp4(w2, s2)


def test_checkpoint_tensors_equal_transformers_dequantization():
    """The `*_blocks` / `*_scales` path: our converted weights dequantize to transformers' own
    dequantization of the same tensors (what the reference model holds), bit for bit, gate columns
    to gate rows and up columns to up rows; the float path requantizes them to the same bytes."""
    model, checkpoint = tiny_gpt_oss(seed=2)
    from_floats = [from_gpt_oss_experts(layer.mlp.experts, model.config) for layer in model.model.layers]
    theirs = [layer.mlp.experts for layer in model.model.layers]
    i, h = OSS["intermediate_size"], OSS["hidden_size"]
    patch_gpt_oss(model, checkpoint=checkpoint)
    for n, layer in enumerate(model.model.layers):
        m, t = layer.mlp.experts, theirs[n]
        assert (m.alpha, m.limit, m.activation, m.model_dim, m.inter_dim) == (1.702, 7.0, "swiglu_oai", h, i)
        w1, w2 = dequantized_module(m)
        p = m.padded_dims["P"]
        gate_up = t.gate_up_proj.detach()
        assert torch.equal(w1[:, :i, :h], gate_up[..., 0::2].transpose(1, 2))
        assert torch.equal(w1[:, p:p + i, :h], gate_up[..., 1::2].transpose(1, 2))
        assert torch.equal(w2[:, :h, :i], t.down_proj.detach().transpose(1, 2))
        assert (w1[:, i:p] == 0).all() and (w1[:, :, h:] == 0).all() and (w2[:, :, i:] == 0).all()
        b1 = t.gate_up_proj_bias.float()  # kept in fp32 (exact), stage 1's cheaper bias
        assert m.b1.dtype == torch.float32
        assert torch.equal(m.b1[:, :i], b1[:, 0::2]) and torch.equal(m.b1[:, p:p + i], b1[:, 1::2])
        for name, buf in m.named_buffers():
            assert torch.equal(buf.view(torch.uint8) if buf.dtype == torch.float8_e8m0fnu else buf,
                               getattr(from_floats[n], name).view(torch.uint8) if buf.dtype == torch.float8_e8m0fnu
                               else getattr(from_floats[n], name)), (n, name)


def test_bad_checkpoint_tensors_are_named():
    model, checkpoint = tiny_gpt_oss(seed=3)
    prefix = "model.layers.0.mlp.experts."
    layer0 = {k: v for k, v in checkpoint.items() if k.startswith(prefix)}
    bad = dict(layer0, **{prefix + "down_proj_scales": layer0[prefix + "down_proj_scales"][:, :, :1]})
    with pytest.raises(ValueError, match=r"down_proj_scales must have shape \(8, 64, 2\)"):
        from_gpt_oss_experts(bad, model.config)
    bad = dict(layer0, **{prefix + "gate_up_proj_blocks": layer0[prefix + "gate_up_proj_blocks"].float()})
    with pytest.raises(ValueError, match="gate_up_proj_blocks must be .* uint8, got torch.float32"):
        from_gpt_oss_experts(bad, model.config)
    bad = {k: v for k, v in layer0.items() if not k.endswith("down_proj_blocks")}
    with pytest.raises(ValueError, match="need down_proj_blocks"):
        from_gpt_oss_experts(bad, model.config)
    with pytest.raises(ValueError, match="no GPT-OSS MoE block"):
        patch_gpt_oss(torch.nn.Sequential(torch.nn.Linear(2, 2)))


@pytest.mark.parametrize("backend,arch", BACKENDS, ids=[f"{b}-{a}" for b, a in BACKENDS])
def test_no_tokens_and_routing_rows_named(backend, arch, monkeypatch):
    """An empty batch gives an empty output (forward reshaped the routing with reshape(0, -1), which
    torch refuses as ambiguous); routing whose rows do not match the tokens is a ValueError naming
    topk_ids / topk_weights (it was a bare reshape RuntimeError)."""
    monkeypatch.setenv("FLYQUANT_BACKEND", backend)
    monkeypatch.setenv("FLYQUANT_ARCH", arch)
    p = dense_layer(4, 64, 32, 5, 2, seed=4)
    m = MoEExperts.from_dense(p["w1"], p["w2"], p["b1"], p["b2"], activation="swiglu_oai")
    for dtype in (torch.float32, torch.bfloat16):
        got = m(p["x"][:0].to(dtype), p["ids"][:0], p["weights"][:0])
        assert got.shape == (0, 64) and got.dtype == dtype
    got = m(p["x"][None, :0], p["ids"][:0], p["weights"][:0])  # (B, S = 0, H) hidden states
    assert got.shape == (1, 0, 64)
    with pytest.raises(ValueError, match=r"topk_ids must have shape \(T, topk\) with T = 5 .* got \(4, 2\)"):
        m(p["x"], p["ids"][:4], p["weights"][:4])
    with pytest.raises(ValueError, match=r"topk_weights must have the shape of topk_ids \(5, 2\) .* got \(5, 3\)"):
        m(p["x"], p["ids"], torch.cat([p["weights"], p["weights"][:, :1]], 1))


def test_routing_shapes_are_checked_not_just_counted(monkeypatch):
    """forward compared only element counts: topk_weights transposed to (topk, T) paired each id with
    another pair's weight, and (T, topk) routing of half the tokens ran as top-1 routing of all of
    them (both a wrong output, no error). The weights must have the ids' shape, the ids (..., topk)."""
    monkeypatch.setenv("FLYQUANT_BACKEND", "reference")
    p = dense_layer(4, 64, 32, 5, 2, seed=6)
    m = MoEExperts.from_dense(p["w1"], p["w2"])
    with pytest.raises(ValueError, match=r"topk_weights must have the shape of topk_ids \(5, 2\) .* got \(2, 5\)"):
        m(p["x"], p["ids"], p["weights"].t())
    with pytest.raises(ValueError, match=r"topk_ids must have shape \(T, topk\) with T = 10 .* got \(5, 2\)"):
        m(torch.cat([p["x"], p["x"]]), p["ids"], p["weights"])
    with pytest.raises(TypeError, match="topk_ids must be a torch.Tensor, got list"):
        m(p["x"], p["ids"].tolist(), p["weights"])
    got = m(p["x"][None], p["ids"][None], p["weights"][None])  # (B, S, topk) routing of (B, S, H) states
    assert torch.equal(got[0], m(p["x"], p["ids"], p["weights"]))


def test_hidden_states_are_checked(monkeypatch):
    """forward took any tensor: int, bool or complex hidden states ran (the output converted back to
    their dtype: truncated, no error), a 0-d one was an IndexError, and hidden states on another device
    than the routing or a grad-requiring one were errors naming fused_moe's moe_buf and x."""
    monkeypatch.setenv("FLYQUANT_BACKEND", "reference")
    p = dense_layer(4, 64, 32, 5, 2, seed=7)
    m = MoEExperts.from_dense(p["w1"], p["w2"])
    for dtype in (torch.int64, torch.bool, torch.complex64):
        with pytest.raises(TypeError, match=f"hidden_states must have dtype in .*, got {dtype}"):
            m(p["x"].to(dtype), p["ids"], p["weights"])
    with pytest.raises(ValueError, match="hidden_states must have shape \\(..., model_dim = 64\\), got a 0-d tensor"):
        m(torch.tensor(1.0), p["ids"], p["weights"])
    with pytest.raises(ValueError, match=r"topk_ids must be on the device of hidden_states \(meta\), got cpu"):
        m(p["x"].to("meta"), p["ids"], p["weights"])
    with pytest.raises(ValueError, match=r"w1 \(the module's buffers\) must be on the device of hidden_states \(meta\)"):
        m(p["x"].to("meta"), p["ids"].to("meta"), p["weights"].to("meta"))
    with pytest.raises(ValueError, match="MoEExperts does not support autograd: hidden_states requires grad"):
        m(p["x"].requires_grad_(), p["ids"], p["weights"])


def test_sizes_must_be_ints():
    """MoEExperts(model_dim=63.7) kept int(63.7) = 63 and model_dim=True became 1 (the layer then ran
    on the wrong columns, no error); from_mxfp4(model_dim=40.5) too, or failed in a slice with biases."""
    p = dense_layer(2, 64, 32, 2, 1, seed=8)
    m = MoEExperts.from_dense(p["w1"], p["w2"])
    for bad in (63.7, True, "64"):
        with pytest.raises(ValueError, match=f"model_dim must be an int >= 1, got {bad!r}"):
            MoEExperts(m.w1, m.w1_scale, m.w2, m.w2_scale, model_dim=bad, inter_dim=32)
    with pytest.raises(ValueError, match="inter_dim must be an int >= 1, got 32.0"):
        MoEExperts(m.w1, m.w1_scale, m.w2, m.w2_scale, model_dim=64, inter_dim=32.0)
    p1, s1 = reference.quantize_mxfp4(p["w1"])
    p2, s2 = reference.quantize_mxfp4(p["w2"])
    with pytest.raises(ValueError, match="model_dim must be an int >= 1, got 40.5"):
        MoEExperts.from_mxfp4(p1, s1, p2, s2, model_dim=40.5)
    with pytest.raises(ValueError, match="inter_dim must be an int >= 1, got True"):
        MoEExperts.from_mxfp4(p1, s1, p2, s2, inter_dim=True)
    assert MoEExperts.from_mxfp4(p1, s1, p2, s2, model_dim=40).model_dim == 40


def test_empty_weights_are_refused_up_front():
    """from_dense / from_mxfp4 with no experts (or from_dense with inter or model 0) failed with
    torch's "cannot reshape tensor of 0 elements" RuntimeError, or an error about the shuffle's "w"."""
    w1, w2 = torch.randn(2, 64, 64), torch.randn(2, 64, 32)
    with pytest.raises(ValueError, match=r"w1.shape\[0\] \(E\) must be an int >= 1, got 0"):
        MoEExperts.from_dense(w1[:0], w2[:0])
    with pytest.raises(ValueError, match=r"w1.shape\[1\] / 2 \(inter\) must be an int >= 1, got 0"):
        MoEExperts.from_dense(w1[:, :0], w2[:, :, :0])
    with pytest.raises(ValueError, match=r"w1.shape\[2\] \(model\) must be an int >= 1, got 0"):
        MoEExperts.from_dense(w1[:, :, :0], w2[:, :0])
    p1, s1 = reference.quantize_mxfp4(w1[:0])
    p2, s2 = reference.quantize_mxfp4(w2[:0])
    with pytest.raises(ValueError, match=r"w1.shape\[0\] \(E\) must be an int >= 1, got 0"):
        MoEExperts.from_mxfp4(p1, s1, p2, s2)


def test_biases_on_another_device_are_refused():
    """A bias on another device than the weights built a module (its bias buffer there) whose forward
    then failed with "bias must be on the device of x" / "... of a2", fused_moe's internal names."""
    w1, w2 = torch.randn(2, 64, 64), torch.randn(2, 64, 32)
    with pytest.raises(ValueError, match=r"b1 must be on the device of w1 \(cpu\), got meta"):
        MoEExperts.from_dense(w1, w2, b1=torch.zeros(2, 64, device="meta"))
    p1, s1 = reference.quantize_mxfp4(w1)
    p2, s2 = reference.quantize_mxfp4(w2)
    with pytest.raises(ValueError, match=r"b2 must be on the device of w1 \(cpu\), got meta"):
        MoEExperts.from_mxfp4(p1, s1, p2, s2, b2=torch.zeros(2, 64, device="meta"))


def test_from_dense_takes_b2_of_the_model_width_only():
    """from_dense's b2 is (E, model) (its docstring), but a wider one was taken, its first model columns
    used and the rest dropped silently (from_gpt_oss_experts' float path too, while its checkpoint path
    refused the same down_proj_bias)."""
    w1, w2 = torch.randn(2, 64, 64), torch.randn(2, 64, 32)
    with pytest.raises(ValueError, match=r"b2 must have shape \(2, 64\), got \(2, 100\)"):
        MoEExperts.from_dense(w1, w2, b2=torch.zeros(2, 100))
    gate_up = torch.randn(2, 64, 64)
    with pytest.raises(ValueError, match=r"down_proj_bias must have shape \(2, 64\), got \(2, 65\)"):
        from_gpt_oss_experts({"gate_up_proj": gate_up, "down_proj": w2.transpose(1, 2), "down_proj_bias": torch.zeros(2, 65)})


def test_alpha_and_limit_must_be_real_numbers():
    """MoEExperts took alpha / limit through float(): "1.5" became 1.5, True 1.0, and None was float()'s
    TypeError naming neither."""
    p = dense_layer(2, 64, 32, 2, 1, seed=9)
    for name, bad in (("alpha", None), ("limit", "7"), ("alpha", True)):
        with pytest.raises(TypeError, match=f"{name} must be a real number, got {bad!r}"):
            MoEExperts.from_dense(p["w1"], p["w2"], activation="swiglu_oai", **{name: bad})


def test_a_negative_swiglu_limit_is_refused_when_the_module_is_built():
    """A negative (or NaN) limit built a swiglu_oai module whose every forward then refused it."""
    p = dense_layer(2, 64, 32, 2, 1, seed=10)
    for limit in (-1.0, float("nan")):
        with pytest.raises(ValueError, match="limit must be >= 0 for swiglu_oai"):
            MoEExperts.from_dense(p["w1"], p["w2"], activation="swiglu_oai", limit=limit)
    assert MoEExperts.from_dense(p["w1"], p["w2"], activation="silu", limit=-1.0).limit == -1.0  # unused by silu


def test_a_dtype_conversion_keeps_the_kernels_formats(monkeypatch):
    """module.half() / .to(torch.bfloat16) / .double() (as model.to(dtype) after patch_gpt_oss does)
    converted the E8M0 scales into floats (fp16 cannot hold their range) and the fp32 gate/up bias, and
    every forward then failed naming w1_scale. The buffers keep their dtypes and bytes; devices move."""
    monkeypatch.setenv("FLYQUANT_BACKEND", "reference")
    p = dense_layer(4, 64, 32, 5, 2, seed=11)
    m = MoEExperts.from_dense(p["w1"], p["w2"], p["b1"], p["b2"].bfloat16(), activation="swiglu_oai")
    given = {name: buf.clone() for name, buf in m.named_buffers()}
    want = m(p["x"], p["ids"], p["weights"])
    for convert in (torch.nn.Module.half, torch.nn.Module.double, lambda mod: mod.to("cpu", torch.bfloat16)):
        assert convert(m) is m
        for name, buf in m.named_buffers():
            assert buf.dtype == given[name].dtype and torch.equal(buf.view(torch.uint8), given[name].view(torch.uint8)), name
        assert torch.equal(m(p["x"], p["ids"], p["weights"]), want)
    assert all(buf.device.type == "meta" for buf in m.to("meta").buffers())
    m = MoEExperts.from_dense(p["w1"], p["w2"], p["b1"])
    with pytest.raises(TypeError, match="MoEExperts keeps its buffers in the kernels' formats"):
        m.type(torch.float16)  # Module.type converts the uint8 weights too: refused, the module unchanged
    assert m.w1.dtype == torch.uint8 and m.w1_scale.dtype == torch.float8_e8m0fnu


def test_a_malformed_extra_state_is_named(monkeypatch):
    """load_state_dict with an _extra_state missing a key was a bare KeyError ('inter_dim'), and one
    that is not a dict (None, an int) a "'NoneType' object is not subscriptable" TypeError."""
    monkeypatch.setenv("FLYQUANT_BACKEND", "reference")
    p = dense_layer(2, 64, 32, 2, 1, seed=12)
    m = MoEExperts.from_dense(p["w1"], p["w2"])
    good = m.state_dict()
    keys = r"\['activation', 'alpha', 'inter_dim', 'limit', 'model_dim'\]"
    with pytest.raises(ValueError, match=f"_extra_state must have the keys {keys}, got \\['model_dim'\\]"):
        m.load_state_dict({**good, "_extra_state": {"model_dim": 64}})
    with pytest.raises(ValueError, match="_extra_state must have the keys"):
        m.load_state_dict({**good, "_extra_state": {**good["_extra_state"], "bias": True}})
    for bad in (None, 5):
        with pytest.raises(TypeError, match=f"_extra_state must be a dict with keys {keys}, got {type(bad).__name__}"):
            m.load_state_dict({**good, "_extra_state": bad})
    m.load_state_dict(good)


def test_routing_weights_must_be_floats(monkeypatch):
    """forward cast topk_weights to fp32 whatever their dtype: int64 or bool weights ran as 0/1 and complex
    ones lost their imaginary part, no error (fused_moe itself refuses them)."""
    monkeypatch.setenv("FLYQUANT_BACKEND", "reference")
    p = dense_layer(2, 64, 32, 3, 1, seed=13)
    m = MoEExperts.from_dense(p["w1"], p["w2"])
    for dtype in (torch.int64, torch.bool, torch.complex64):
        with pytest.raises(TypeError, match=f"topk_weights must have dtype in .*, got {dtype}"):
            m(p["x"], p["ids"], p["weights"].to(dtype))
    assert torch.equal(m(p["x"], p["ids"], p["weights"].double()), m(p["x"], p["ids"], p["weights"]))



def test_checkpoint_experts_must_fit_the_block():
    """patch_gpt_oss took a checkpoint layer with other sizes than the block's: with fewer experts than
    the router picks from, the kernels dropped the ids past them (a wrong output, no error; the reference
    path failed only at the forward); more experts or a narrower width loaded silently too. The error
    leaves the model unchanged (the blocks before the bad one were already swapped)."""
    import re

    model, checkpoint = tiny_gpt_oss(seed=5)
    prefix = "model.layers.1.mlp.experts."
    fewer = {k: v[:4] if k.startswith(prefix) else v for k, v in checkpoint.items()}
    more = {k: torch.cat([v, v]) if k.startswith(prefix) else v for k, v in checkpoint.items()}
    narrow = {k: v for k, v in checkpoint.items() if not k.startswith(prefix + "down_proj")}  # hidden 32, no b2
    narrow[prefix + "gate_up_proj_blocks"] = checkpoint[prefix + "gate_up_proj_blocks"][:, :, :1]
    narrow[prefix + "gate_up_proj_scales"] = checkpoint[prefix + "gate_up_proj_scales"][:, :, :1]
    narrow[prefix + "down_proj_blocks"] = checkpoint[prefix + "down_proj_blocks"][:, :32]
    narrow[prefix + "down_proj_scales"] = checkpoint[prefix + "down_proj_scales"][:, :32]
    for bad, got in ((fewer, (4, 64, 64)), (more, (16, 64, 64)), (narrow, (8, 32, 64))):
        with pytest.raises(ValueError, match=re.escape(f"model.layers.1.mlp.experts: the experts from the checkpoint have "
                                                       f"(E, hidden, inter) = {got}, the block (router, config) (8, 64, 64)")):
            patch_gpt_oss(model, checkpoint=bad)
        assert not any(isinstance(layer.mlp.experts, MoEExperts) for layer in model.model.layers)  # none swapped


def test_patch_gpt_oss_twice_or_with_a_non_mapping_is_named():
    """A second patch_gpt_oss on the same model failed with "GPT-OSS experts need gate_up_proj and
    down_proj" (naming neither the block nor the cause), and a checkpoint that is not a mapping with
    "'list' object has no attribute 'items'"."""
    model, _ = tiny_gpt_oss(seed=6)
    with pytest.raises(TypeError, match="checkpoint must be a mapping of tensors .* got list"):
        patch_gpt_oss(model, checkpoint=[1, 2])
    patch_gpt_oss(model)
    with pytest.raises(ValueError, match=r"model.layers.0.mlp.experts is already a MoEExperts: patch_gpt_oss ran"):
        patch_gpt_oss(model)
    with pytest.raises(ValueError, match=r"^experts is already a MoEExperts"):  # one block as the model
        patch_gpt_oss(model.model.layers[0].mlp)


def test_float_gpt_oss_tensors_are_checked_by_their_names():
    """from_gpt_oss_experts' float path called .detach() on the mapping's values before checking them (a
    list was "'list' object has no attribute 'detach'"), and a wrong gate_up_proj_bias was named
    gate_up_bias (layouts' name) where the checkpoint path names it as given."""
    gate_up, down = torch.randn(2, 64, 64), torch.randn(2, 32, 64)
    with pytest.raises(TypeError, match="gate_up_proj must be a torch.Tensor, got list"):
        from_gpt_oss_experts({"gate_up_proj": [1.0], "down_proj": down})
    with pytest.raises(TypeError, match="gate_up_proj_bias must be a torch.Tensor, got list"):
        from_gpt_oss_experts({"gate_up_proj": gate_up, "down_proj": down, "gate_up_proj_bias": [1.0]})
    with pytest.raises(ValueError, match=r"gate_up_proj_bias must have shape \(2, 64\), got \(2, 5\)"):
        from_gpt_oss_experts({"gate_up_proj": gate_up, "down_proj": down, "gate_up_proj_bias": torch.zeros(2, 5)})


def test_a_state_dict_loads_codes_as_codes(monkeypatch):
    """The scales (and packed weights) are codes, float8_e8m0fnu or uint8 alike, but load_state_dict
    copied a uint8-coded state dict into an E8M0 module by value (code 127 became 2^7, code 134): every
    scale off, outputs 1e10 away, no error. Bytes load as they are; float values are refused."""
    monkeypatch.setenv("FLYQUANT_BACKEND", "reference")
    p = dense_layer(2, 64, 32, 3, 1, seed=14)
    m = MoEExperts.from_dense(p["w1"], p["w2"])
    as_uint8 = MoEExperts(m.w1, m.w1_scale.view(torch.uint8), m.w2, m.w2_scale.view(torch.uint8), model_dim=64, inter_dim=32)
    fresh = MoEExperts.from_dense(torch.zeros_like(p["w1"]), torch.zeros_like(p["w2"]))
    fresh.load_state_dict(as_uint8.state_dict())
    assert fresh.w1_scale.dtype == torch.float8_e8m0fnu
    assert torch.equal(fresh.w1_scale.view(torch.uint8), m.w1_scale.view(torch.uint8))
    assert torch.equal(fresh(p["x"], p["ids"], p["weights"]), m(p["x"], p["ids"], p["weights"]))
    as_uint8.load_state_dict(m.state_dict())  # and back
    assert torch.equal(as_uint8.w2_scale, m.w2_scale.view(torch.uint8))
    with pytest.raises(TypeError, match="MoEExperts' w1_scale must hold codes .* got torch.float32"):
        fresh.load_state_dict({**m.state_dict(), "w1_scale": m.w1_scale.float()})



def test_from_mxfp4_takes_a_scale_for_a_trailing_partial_block():
    """from_mxfp4 wanted M // 32 scale columns for w1's M = 2 * w1.shape[2] FP4 values (I // 32 for w2):
    with M = 48, one column, and the last 16 values of each row were read with the padding scale 2^-127
    (as zeros), silently. A partial block has its scale: 48 columns give from_dense's module."""
    p = dense_layer(2, 48, 48, 3, 1, seed=15)
    p1, s1 = reference.quantize_mxfp4(p["w1"])  # (2, 96, 32) bytes: 64 columns, the last 16 zero
    p2, s2 = reference.quantize_mxfp4(p["w2"])
    p1, p2 = p1[..., :24].contiguous(), p2[..., :24].contiguous()  # the 48 columns only
    with pytest.raises(ValueError, match=r"w1_scale must have shape \(2, 96, 2\), got \(2, 96, 1\)"):
        MoEExperts.from_mxfp4(p1, s1[..., :1], p2, s2)
    with pytest.raises(ValueError, match=r"w2_scale must have shape \(2, 48, 2\), got \(2, 48, 1\)"):
        MoEExperts.from_mxfp4(p1, s1, p2, s2[..., :1])
    m = MoEExperts.from_mxfp4(p1, s1, p2, s2)
    assert (m.model_dim, m.inter_dim) == (48, 48)
    dense = MoEExperts.from_dense(p["w1"], p["w2"])
    for name, buf in dense.named_buffers():
        assert torch.equal(buf.view(torch.uint8), getattr(m, name).view(torch.uint8)), name


def test_gpt_oss_swiglu_parameters_are_checked():
    """alpha / limit from the experts module or the config went through float() ("1.7" became 1.7), and
    patch_gpt_oss assigned the block's to a checkpoint-built module past MoEExperts' checks: a negative
    limit built a module whose every forward then refused it."""
    import types

    model, checkpoint = tiny_gpt_oss(seed=7)
    prefix = "model.layers.0.mlp.experts."
    layer0 = {k: v for k, v in checkpoint.items() if k.startswith(prefix)}
    with pytest.raises(TypeError, match="alpha must be a real number, got '1.7'"):
        from_gpt_oss_experts(layer0, types.SimpleNamespace(swiglu_alpha="1.7", swiglu_limit=7.0))
    model.model.layers[1].mlp.experts.limit = -1.0
    with pytest.raises(ValueError, match="limit must be >= 0 for swiglu_oai"):
        patch_gpt_oss(model, checkpoint=checkpoint)
    model.model.layers[1].mlp.experts.limit = 6.5
    patch_gpt_oss(model, checkpoint=checkpoint)
    assert model.model.layers[1].mlp.experts.limit == 6.5 and model.model.layers[0].mlp.experts.limit == 7.0


def test_patch_gpt_oss_of_one_block_takes_its_checkpoint():
    """patch_gpt_oss(block) on a GptOssMLP itself (its name in named_modules is "") looked for the keys
    '.experts.gate_up_proj_blocks' etc., so the block's checkpoint ("experts.*") was ignored and its
    float weights quantized instead, silently."""
    model, checkpoint = tiny_gpt_oss(seed=8)
    block, prefix = model.model.layers[0].mlp, "model.layers.0.mlp."
    own = {k[len(prefix):]: v for k, v in checkpoint.items() if k.startswith(prefix)}  # "experts.gate_up_proj_blocks", ...
    with torch.no_grad():
        block.experts.gate_up_proj.zero_()  # the float weights not loaded: only the checkpoint holds them
    assert patch_gpt_oss(block, checkpoint=own) is block
    want = from_gpt_oss_experts(own, model.config)
    for name, buf in want.named_buffers():
        assert torch.equal(buf.view(torch.uint8), getattr(block.experts, name).view(torch.uint8)), name


def test_a_checkpoint_none_of_whose_experts_match_is_refused():
    """A checkpoint whose keys have another prefix than the model's module paths (GptOssModel's 'layers.0...'
    for a GptOssForCausalLM) matched no block: every block quantized its float weights and the checkpoint
    was ignored, silently."""
    model, checkpoint = tiny_gpt_oss(seed=9)
    other_prefix = {k[len("model."):]: v for k, v in checkpoint.items()}
    with pytest.raises(ValueError, match=r"checkpoint holds MXFP4 expert tensors \('layers.0.mlp.experts.gate_up_proj_"
                                         r"blocks', ...\) but none under an experts path of the model "
                                         r"\('model.layers.0.mlp.experts', ...\)"):
        patch_gpt_oss(model, checkpoint=other_prefix)
    assert not any(isinstance(layer.mlp.experts, MoEExperts) for layer in model.model.layers)
