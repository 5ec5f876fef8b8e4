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
from flyquant.nn.experts import EXTRA_STATE_KEYS

ARCHS = ("gfx950", "gfx942")
U_BF16 = 2.0**-8
U_F32 = 2.0**-24
DERIV_G = 1.2  # |d act / d g| <= 1.2 (|u| + 1) (tests/test_reference_moe1.py)
ACT_ERR = 2.0**-20


def exact_moe(x, w1, b1, w2, b2, ids, weights, activation, u_out, alpha=1.702, limit=7.0):
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
            a = reference.moe_activation(g, u, activation, alpha, limit)
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


def check_layer(dtype, activation="swiglu_oai", biases=True, seed=0, **swiglu):
    """swiglu: alpha / limit, passed to the module and to the exact MoE (the defaults when absent)."""
    p = dense_layer(EXPERTS, MODEL, INTER, TOKENS, TOPK, seed, biases)
    m = MoEExperts.from_dense(p["w1"], p["w2"], p["b1"], p["b2"], activation=activation, **swiglu)
    x = p["x"].to(dtype)
    got = m(x, p["ids"], p["weights"])
    assert got.dtype == dtype and got.shape == x.shape
    if dtype == torch.float32:  # stage 2 wrote FP32: a BF16 output widened would fit the bound (a2's rounding dominates)
        assert (got != got.bfloat16().float()).any()
    b1 = None if p["b1"] is None else p["b1"].float()
    exact, bound = exact_moe(x.to(torch.bfloat16), dequantized(p["w1"], MODEL), b1, dequantized(p["w2"], INTER), p["b2"],
                             p["ids"], p["weights"], activation, U_F32 if dtype == torch.float32 else U_BF16, **swiglu)
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
    check_layer(torch.bfloat16, alpha=1.3, limit=1.0, seed=2)  # a tight clamp and another slope reach the kernel


def test_from_dense_matches_the_exact_moe_on_the_reference(monkeypatch):
    monkeypatch.setenv("FLYQUANT_BACKEND", "reference")
    check_layer(torch.float32)
    check_layer(torch.bfloat16, activation="silu", biases=False, seed=1)
    check_layer(torch.float32, alpha=1.3, limit=1.0, seed=2)
    check_layer(torch.float32, activation="gelu", seed=3)


def test_warmup_compiles_what_forward_runs(moe_launcher_configs):
    """MoEExperts.warmup runs forward on zeros, so a forward afterwards (GPT-OSS's layer: fp32 b1,
    biases, swiglu_oai with its alpha / limit, int64 ids from torch.topk) asks for no kernel
    configuration the warm-up did not compile; fq.warmup's defaults (no stage-2 bias, a bf16
    stage-1 one, int32 ids) would have left all three for the first call."""
    p = dense_layer(EXPERTS, MODEL, INTER, TOKENS, TOPK, seed=3)
    m = MoEExperts.from_dense(p["w1"], p["w2"], p["b1"], p["b2"], activation="swiglu_oai", alpha=1.5, limit=6.0)
    m.warmup(TOPK, tokens=(TOKENS,), dtype=torch.float32)
    warmed = set(moe_launcher_configs)
    moe_launcher_configs.clear()
    weights, ids = torch.topk(torch.randn(TOKENS, EXPERTS).softmax(-1), TOPK)
    m(p["x"], ids, weights)
    called = set(moe_launcher_configs)
    assert len(called) == 3 and called <= warmed
    moe_launcher_configs.clear()
    fq.warmup(model_dim=MODEL + 16, inter_dim=INTER, experts=EXPERTS, topk=TOPK, tokens=(TOKENS,),
              activation="swiglu_oai", stage1_bias=True, alpha=1.5, limit=6.0)  # model_dim padded to 32, as forward
    assert not called & set(moe_launcher_configs)
    with pytest.raises(ValueError, match=r"topk must be an int in \[1, experts = 8\]"):
        m.warmup(9)
    with pytest.raises(TypeError, match="tokens must be a sequence of token counts"):
        m.warmup(TOPK, tokens=4)


def test_warmup_checks_its_arguments_before_running():
    """MoEExperts.warmup's topk, dtype and ids_dtype, checked before forward runs, as fq.warmup checks
    them: a numpy topk was refused as out of range, topk 128 of 200 experts passed (refused by
    moe_sorting, naming topk_ids.shape[1]; with tokens=() not at all), and a dtype / ids_dtype that
    forward does not take was refused naming forward's hidden_states / topk_ids."""
    import numpy as np

    u8 = torch.uint8
    m = MoEExperts.from_mxfp4(torch.zeros(200, 64, 16, dtype=u8), torch.full((200, 64, 1), 127, dtype=u8),
                              torch.zeros(200, 32, 16, dtype=u8), torch.full((200, 32, 1), 127, dtype=u8), activation="silu")
    for tokens in ((1,), ()):
        with pytest.raises(ValueError, match=r"topk must be an int in \[1, 127 \(experts = 200\)\], got 128"):
            m.warmup(128, tokens=tokens)
    m.warmup(np.int64(2), tokens=())  # an int (no token counts: nothing runs)
    with pytest.raises(TypeError, match="ids_dtype must be torch.int32 or torch.int64"):
        m.warmup(2, ids_dtype=torch.float32)
    with pytest.raises(TypeError, match="dtype must be the hidden states' floating dtype"):
        m.warmup(2, dtype=torch.int32)


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


def test_pickle_and_deepcopy_round_trip(monkeypatch):
    """pickle.loads of a pickled MoEExperts failed (torch cannot unpickle float8_e8m0fnu tensors:
    multiprocessing's spawn and Ray send modules this way; red-team finding); the module comes back
    with the same buffers, dtypes included, and the same output, and the original keeps its own."""
    import copy
    import pickle

    monkeypatch.setenv("FLYQUANT_BACKEND", "reference")
    p = dense_layer(EXPERTS, MODEL, INTER, TOKENS, TOPK, seed=5)
    m = MoEExperts.from_dense(p["w1"], p["w2"], p["b1"], p["b2"], activation="swiglu_oai")
    for back in (pickle.loads(pickle.dumps(m)), copy.deepcopy(m)):
        for (name, got), (_, want) in zip(back.named_buffers(), m.named_buffers()):
            assert got.dtype == want.dtype and torch.equal(got.view(torch.uint8), want.view(torch.uint8)), name
        assert torch.equal(back(p["x"], p["ids"], p["weights"]), m(p["x"], p["ids"], p["weights"]))
    assert m.w1_scale.dtype == m.w2_scale.dtype == torch.float8_e8m0fnu


def test_a_state_dict_is_checked_like_the_constructor(monkeypatch):
    """load_state_dict took the extra state's sizes and activation through int() / float(): a
    float, bool or oversized model_dim, or a negative swiglu limit, loaded silently."""
    monkeypatch.setenv("FLYQUANT_BACKEND", "reference")
    p = dense_layer(EXPERTS, MODEL, INTER, TOKENS, TOPK, seed=3)
    m = MoEExperts.from_dense(p["w1"], p["w2"], p["b1"], p["b2"], activation="swiglu_oai")
    good = m.state_dict()
    key = next(k for k in good if k.endswith("_extra_state"))
    saved = {k: getattr(m, k) for k in EXTRA_STATE_KEYS}  # the dict form, as flyquant saved it before the tensor
    m.load_state_dict({**good, key: saved})
    for change, error, match in [(dict(model_dim=63.7), ValueError, "model_dim must be an int"),
                                 (dict(inter_dim=True), ValueError, "inter_dim must be an int"),
                                 (dict(model_dim=10 * MODEL), ValueError, "do not fit the padded weights"),
                                 (dict(limit=-1.0), ValueError, "limit must be >= 0"),
                                 (dict(alpha="1.7"), TypeError, "alpha must be a real number"),
                                 (dict(activation="relu"), ValueError, "activation must be one of")]:
        with pytest.raises(error, match=match):
            m.load_state_dict({**good, key: {**saved, **change}})
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
# reach swiglu's clamp). swiglu alpha 1.5 and limit 3 (GPT-OSS's: 1.702 and 7): a swap that dropped
# the config's values for the defaults would move the clamped elements past the bound.
OSS = dict(vocab_size=128, hidden_size=64, intermediate_size=64, num_hidden_layers=2, num_attention_heads=2,
           num_key_value_heads=1, head_dim=32, num_local_experts=8, num_experts_per_tok=2, sliding_window=4,
           max_position_embeddings=64, swiglu_alpha=1.5, swiglu_limit=3.0)
SEQ = 6
# Logits: no bound is derived through attention and norms; instead the scale of error bf16 activations
# bring: transformers' own logits moved by rounding each experts module's input to bf16 (d_bf16). The
# kernels round twice as often (x and a2, 2^-9 relative each) plus FP32 sums, so about 2 d_bf16;
# LOGIT_RATIO allows 2x more for how the two propagate through 2 layers. Measured: 0.94 d_bf16 on both
# arches and the reference (0.0022; each block's error at most 0.28 of its bound); a wrong gate/up
# order, alpha or limit fails the per-block bound first.
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
                                ids, weights, "swiglu_oai", U_F32, ex.alpha, ex.limit)
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
        assert (m.alpha, m.limit, m.activation, m.model_dim, m.inter_dim) == (1.5, 3.0, "swiglu_oai", h, i)
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
