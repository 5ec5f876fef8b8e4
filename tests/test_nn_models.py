"""flyquant.nn.patch_moe: any transformers MoE model whose experts class uses transformers' experts
interface (use_experts_implementation), checked on a tiny Qwen3-MoE (silu, [gate; up] rows, no
biases) against transformers' own forward with the bound and logit ratio of tests/test_nn.py, and
GPT-OSS through the same call; refusals leave the model as it was."""

from __future__ import annotations

import contextlib
import copy

import pytest
import torch

import flyquant as fq
from flyquant import reference
from flyquant.nn import MoEExperts, from_gpt_oss_experts, from_transformers_experts, patch_moe

from test_nn import BACKENDS, LOGIT_RATIO, SEQ, U_F32, exact_moe, run_capturing, tiny_gpt_oss

# inter 48: not a multiple of 32 (the padded block shares real weights), hidden 96 not of 64
QWEN = dict(vocab_size=128, hidden_size=96, intermediate_size=64, moe_intermediate_size=48, num_hidden_layers=2,
            num_attention_heads=2, num_key_value_heads=1, head_dim=32, num_experts=8, num_experts_per_tok=2,
            decoder_sparse_step=1, mlp_only_layers=[], norm_topk_prob=True, max_position_embeddings=64)


def mxfp4_values(w):
    """w with every 32-block along its last dim replaced by its MXFP4 (floor) value: a model holding
    these is what the kernels compute with, exactly (the quantize takes them back bit for bit)."""
    cols = -(-w.shape[-1] // 32) * 32
    padded = torch.nn.functional.pad(w, (0, cols - w.shape[-1]))
    return reference.dequantize_mxfp4(*reference.quantize_mxfp4(padded))[..., :w.shape[-1]]


def tiny_qwen3_moe(seed=0, **overrides):
    from transformers import Qwen3MoeConfig, Qwen3MoeForCausalLM

    torch.manual_seed(seed)
    config = Qwen3MoeConfig(**dict(QWEN, **overrides), attn_implementation="eager", experts_implementation="eager")
    model = Qwen3MoeForCausalLM(config).eval()
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for layer in model.model.layers:
            ex = layer.mlp.experts
            for w in (ex.gate_up_proj, ex.down_proj):
                w.copy_(mxfp4_values(torch.randn(w.shape, generator=g) * 0.3))
    return model


def check_qwen3(device: str):
    """Every MoE block within the derived bound of transformers' own float64 forward of the same
    (MXFP4-valued) weights on the block's bf16 input; routing and routers unchanged; logits within
    LOGIT_RATIO times what rounding the experts' inputs to bf16 alone moves transformers' logits by.
    Returns the launches flyquant.emu recorded (none on a GPU)."""
    model = tiny_qwen3_moe().to(device)
    tokens = torch.randint(0, QWEN["vocab_size"], (1, SEQ), generator=torch.Generator().manual_seed(1)).to(device)
    ref_logits, ref_caps = run_capturing(model, tokens)
    bf16_logits, _ = run_capturing(model, tokens, x_hook=lambda m, args: (args[0].bfloat16().float(), *args[1:]))
    reference_experts = [copy.deepcopy(layer.mlp.experts).cpu().double() for layer in model.model.layers]
    routers = [layer.mlp.gate for layer in model.model.layers]
    assert patch_moe(model) is model
    assert all(isinstance(layer.mlp.experts, MoEExperts) and layer.mlp.experts.activation == "silu"
               for layer in model.model.layers)
    assert [layer.mlp.gate for layer in model.model.layers] == routers
    with fq.emu.record() if fq.emu.enabled() else contextlib.nullcontext([]) as launches:
        logits, caps = run_capturing(model, tokens)
    for n, (cap, ref_cap) in enumerate(zip(caps, ref_caps)):
        x, ids, w, out = (t.cpu() for t in cap)
        assert torch.equal(ids, ref_cap[1].cpu()), f"layer {n}: routing changed"
        ex, xb = reference_experts[n], x.to(torch.bfloat16)
        with torch.no_grad():
            theirs = ex(xb.double(), ids, w.double())
            ours, bound = exact_moe(xb, ex.gate_up_proj, None, ex.down_proj, None, ids, w, "silu", U_F32)
        torch.testing.assert_close(ours, theirs, rtol=1e-12, atol=1e-12)  # our exact MoE is transformers' math
        assert (bound < 0.05 * theirs.abs().max()).all()
        err = (out.double() - theirs).abs()
        assert bool((err <= bound).all()), f"layer {n}: worst excess {float((err - bound).max()):.3g}"
    d_kernel = float((logits - ref_logits).abs().max())
    d_bf16 = float((bf16_logits - ref_logits).abs().max())
    assert 0 < d_bf16 and d_kernel <= LOGIT_RATIO * d_bf16, (d_kernel, d_bf16)
    return launches


@pytest.mark.parametrize("backend,arch", BACKENDS, ids=[f"{b}-{a}" for b, a in BACKENDS])
def test_patch_moe_agrees_with_transformers_qwen3(backend, arch, monkeypatch):
    """check_qwen3 under flyquant.emu (3 launches per layer) or on the reference path."""
    monkeypatch.setenv("FLYQUANT_BACKEND", backend)
    monkeypatch.setenv("FLYQUANT_ARCH", arch)
    launches = check_qwen3("cpu")
    assert len(launches) == (3 * QWEN["num_hidden_layers"] if backend == "flydsl" else 0)


@pytest.mark.gpu
def test_gpu_patch_moe_agrees_with_transformers_qwen3(monkeypatch):
    """check_qwen3 on a real MI300X/MI355X, through the kernels the selector picks for it."""
    monkeypatch.setenv("FLYQUANT_BACKEND", "flydsl")
    check_qwen3("cuda")


def same_buffers(a: MoEExperts, b: MoEExperts) -> bool:
    raw = lambda t: t.view(torch.uint8) if t.dtype == torch.float8_e8m0fnu else t  # noqa: E731
    return all(torch.equal(raw(x), raw(y)) for x, y in zip(a.buffers(), b.buffers())) and \
        (a.activation, a.alpha, a.limit, a.model_dim, a.inter_dim) == (b.activation, b.alpha, b.limit, b.model_dim, b.inter_dim)


def test_gpt_oss_through_patch_moe_is_patch_gpt_oss():
    """GPT-OSS (interleaved, transposed, biased, its own clamped swiglu) converts as from_gpt_oss_experts."""
    model, _ = tiny_gpt_oss(seed=4)
    want = [from_gpt_oss_experts(layer.mlp.experts, model.config) for layer in model.model.layers]
    patch_moe(model)
    assert all(same_buffers(layer.mlp.experts, w) for layer, w in zip(model.model.layers, want))


def test_layouts_are_read_as_transformers_applies_them():
    """The flags of the experts interface: transposed (E, in, out) weights give the same module as
    the (E, out, in) ones; biases are kept. Rows flagged interleaved with transformers' default gate
    are refused: that gate splits them as [gate; up] whatever the flag says (chunk(2)), and they
    were converted as interleaved, a different layer from transformers' own forward."""
    model = tiny_qwen3_moe(seed=5)
    ex = model.model.layers[0].mlp.experts
    want = from_transformers_experts(ex)
    flipped = copy.deepcopy(ex)
    e, two_i, h = ex.gate_up_proj.shape
    flipped.gate_up_proj = torch.nn.Parameter(ex.gate_up_proj.transpose(1, 2).contiguous())
    flipped.down_proj = torch.nn.Parameter(ex.down_proj.transpose(1, 2).contiguous())
    flipped.is_transposed = True
    assert same_buffers(from_transformers_experts(flipped), want)
    flipped.is_concatenated = False
    with pytest.raises(ValueError, match=r"flagged interleaved \(is_concatenated=False\) but it has transformers' "
                                         r"default gate"):
        from_transformers_experts(flipped)
    g = torch.Generator().manual_seed(0)
    biased = copy.deepcopy(ex)
    biased.gate_up_proj_bias = torch.nn.Parameter(torch.randn(e, two_i, generator=g))
    biased.down_proj_bias = torch.nn.Parameter(torch.randn(e, h, generator=g))
    biased.has_bias = True
    m = from_transformers_experts(biased)
    p = m.padded_dims["P"]
    assert torch.equal(m.b1[:, :two_i // 2], biased.gate_up_proj_bias[:, :two_i // 2].detach())
    assert torch.equal(m.b1[:, p:p + two_i // 2], biased.gate_up_proj_bias[:, two_i // 2:].detach())
    assert torch.equal(m.b2[:, :h], biased.down_proj_bias.detach())


def test_gelu_tanh_is_recognised_and_others_refused():
    assert from_transformers_experts(tiny_qwen3_moe(hidden_act="gelu_pytorch_tanh").model.layers[0].mlp.experts).activation == "gelu"
    model = tiny_qwen3_moe(hidden_act="relu")
    before = [layer.mlp.experts for layer in model.model.layers]
    with pytest.raises(ValueError, match=r"model\.layers\.0\.mlp\.experts: Qwen3MoeExperts: its activation .* neither silu"):
        patch_moe(model)
    assert [layer.mlp.experts for layer in model.model.layers] == before  # nothing swapped


def test_unsupported_experts_are_refused_by_name():
    model = tiny_qwen3_moe()
    ex = model.model.layers[1].mlp.experts
    ex.has_post_expert_norm = True
    with pytest.raises(ValueError, match=r"model\.layers\.1\.mlp\.experts: .* applies a norm after each expert"):
        patch_moe(model)
    assert not any(isinstance(m, MoEExperts) for m in model.modules())
    ex.has_post_expert_norm, ex.has_gate = False, False
    with pytest.raises(ValueError, match="no gate projection"):
        from_transformers_experts(ex)
    ex.has_gate = True
    floats = ex.gate_up_proj
    ex.gate_up_proj = torch.nn.Parameter(floats.detach().to(torch.int8), requires_grad=False)
    with pytest.raises(ValueError, match=r"Qwen3MoeExperts\.gate_up_proj must be a 3-D float tensor"):
        from_transformers_experts(ex)
    ex.gate_up_proj = floats
    del ex.act_fn
    with pytest.raises(ValueError, match="Qwen3MoeExperts has no act_fn"):
        from_transformers_experts(ex)
    with pytest.raises(ValueError, match="is not an experts module"):
        from_transformers_experts(torch.nn.Linear(2, 2))
    with pytest.raises(ValueError, match="itself an experts module"):
        patch_moe(model.model.layers[0].mlp.experts)
    patch_moe(model.model.layers[0])
    with pytest.raises(ValueError, match="no experts module .* left: patch_moe or patch_gpt_oss ran"):
        patch_moe(model.model.layers[0])


TINY = dict(hidden_size=64, intermediate_size=64, num_hidden_layers=2, num_attention_heads=2, num_key_value_heads=2,
            vocab_size=64, max_position_embeddings=64)
ROUTED = dict(num_experts_per_tok=2, moe_intermediate_size=32, first_k_dense_replace=0, n_group=1, topk_group=1)
MLA = dict(q_lora_rank=None, kv_lora_rank=32, qk_rope_head_dim=16, qk_nope_head_dim=16, v_head_dim=16)
FAMILIES = {
    "MixtralConfig": dict(num_local_experts=4, num_experts_per_tok=2),
    "Qwen2MoeConfig": dict(num_experts=4, num_experts_per_tok=2, moe_intermediate_size=32, shared_expert_intermediate_size=32),
    "OlmoeConfig": dict(num_experts=4, num_experts_per_tok=2),
    "DeepseekV3Config": dict(ROUTED, n_routed_experts=4, **MLA),
    "Glm4MoeConfig": dict(ROUTED, n_routed_experts=4, head_dim=32),
}


@pytest.mark.parametrize("family", FAMILIES)
def test_patch_moe_runs_other_families(family, monkeypatch):
    """Each family's MoE block calls its experts as patch_moe assumes (hidden states, top-k ids, top-k
    weights): logits within LOGIT_RATIO of what bf16 experts inputs alone move them by (on the
    reference path; the kernels are checked on Qwen3 above)."""
    import transformers

    monkeypatch.setenv("FLYQUANT_BACKEND", "reference")
    torch.manual_seed(0)
    config = getattr(transformers, family)(**TINY, **FAMILIES[family], attn_implementation="eager")
    model = transformers.AutoModelForCausalLM.from_config(config).eval()
    experts = [m for m in model.modules() if hasattr(m, "gate_up_proj")]
    g = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for ex in experts:
            for w in (ex.gate_up_proj, ex.down_proj):
                w.copy_(mxfp4_values(torch.randn(w.shape, generator=g) * 0.3))
    tokens = torch.randint(0, TINY["vocab_size"], (1, SEQ), generator=g)
    with torch.no_grad():
        ref = model(tokens).logits
        hooks = [ex.register_forward_pre_hook(lambda m, args: (args[0].bfloat16().float(), *args[1:])) for ex in experts]
        bf16 = model(tokens).logits
        for h in hooks:
            h.remove()
        patch_moe(model)
        assert sum(isinstance(m, MoEExperts) for m in model.modules()) == len(experts) == TINY["num_hidden_layers"]
        logits = model(tokens).logits
    d_kernel, d_bf16 = float((logits - ref).abs().max()), float((bf16 - ref).abs().max())
    assert 0 < d_bf16 and d_kernel <= LOGIT_RATIO * d_bf16, (d_kernel, d_bf16)


def test_a_patched_model_generates_and_round_trips(monkeypatch):
    """Decoding (a token per sequence and step) runs through the swapped experts and gives
    transformers' greedy tokens on this seed; a patched model's state_dict loads into another."""
    monkeypatch.setenv("FLYQUANT_BACKEND", "reference")
    model = tiny_qwen3_moe()
    tokens = torch.randint(0, QWEN["vocab_size"], (2, 5), generator=torch.Generator().manual_seed(3))
    with torch.no_grad():
        want = model.generate(tokens, max_new_tokens=3, do_sample=False)
        got = patch_moe(model).generate(tokens, max_new_tokens=3, do_sample=False)
        assert torch.equal(got, want)
        other = patch_moe(tiny_qwen3_moe(seed=1))
        other.load_state_dict(model.state_dict())
        assert torch.equal(other(tokens).logits, model(tokens).logits)


def test_a_meta_skeleton_is_patched_and_loaded(monkeypatch):
    """A model built on the meta device (to load a saved patched state_dict into, without
    allocating the float experts) is patched: the activation probe ran on the meta weights
    (Tensor.item() on a meta tensor). Loaded with assign=True, it gives the saved model's logits."""
    monkeypatch.setenv("FLYQUANT_BACKEND", "reference")
    from transformers import Qwen3MoeConfig, Qwen3MoeForCausalLM

    model = patch_moe(tiny_qwen3_moe())
    config = Qwen3MoeConfig(**QWEN, attn_implementation="eager", experts_implementation="eager")
    with torch.device("meta"):
        skeleton = patch_moe(Qwen3MoeForCausalLM(config))
    skeleton.load_state_dict(model.state_dict(), assign=True)
    skeleton.model.rotary_emb.inv_freq = model.model.rotary_emb.inv_freq  # a non-persistent buffer
    tokens = torch.randint(0, QWEN["vocab_size"], (2, 5), generator=torch.Generator().manual_seed(3))
    with torch.no_grad():
        assert torch.equal(skeleton.eval()(tokens).logits, model(tokens).logits)


def test_a_patched_model_saves_with_save_pretrained(monkeypatch, tmp_path):
    """save_pretrained (safetensors) stores tensors only: the experts' extra state was a dict, an
    AttributeError inside huggingface_hub. Its file loads back into a patched model."""
    from safetensors.torch import load_file

    monkeypatch.setenv("FLYQUANT_BACKEND", "reference")
    model = patch_moe(tiny_qwen3_moe())
    model.save_pretrained(tmp_path)
    other = patch_moe(tiny_qwen3_moe(seed=1))
    missing, unexpected = other.load_state_dict(load_file(tmp_path / "model.safetensors"), strict=False)
    assert missing == [] and unexpected == [], (missing, unexpected)
    tokens = torch.randint(0, QWEN["vocab_size"], (2, 5), generator=torch.Generator().manual_seed(3))
    with torch.no_grad():
        assert torch.equal(other(tokens).logits, model(tokens).logits)
