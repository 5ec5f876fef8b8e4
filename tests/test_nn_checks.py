"""flyquant.nn's refusals and conversions: bad input to MoEExperts, from_gpt_oss_experts and
patch_gpt_oss named before anything runs or changes, routing checked, and what torch's module
machinery does to the buffers (dtype conversions, state dicts) keeping the kernels' formats. The
layers and the tiny GPT-OSS model are tests/test_nn.py's.
"""

from __future__ import annotations

import pytest
import torch

from flyquant import reference
from flyquant.nn import MoEExperts, from_gpt_oss_experts, patch_gpt_oss
from flyquant.nn.experts import EXTRA_STATE_KEYS

from test_nn import BACKENDS, dense_layer, tiny_gpt_oss


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
        m.load_state_dict({**good, "_extra_state": {**{k: getattr(m, k) for k in EXTRA_STATE_KEYS}, "bias": True}})
    for bad in (None, 5):
        with pytest.raises(TypeError, match=f"_extra_state must be an int64 tensor or a dict with keys {keys}, "
                                            f"got {type(bad).__name__}"):
            m.load_state_dict({**good, "_extra_state": bad})
    for bad, words in [(good["_extra_state"].float(), "int64 of shape \\(5,\\), got torch.float32"),
                       (good["_extra_state"][:4], "int64 of shape \\(5,\\), got torch.int64 \\(4,\\)"),
                       (good["_extra_state"].clone().index_fill_(0, torch.tensor([2]), 3), "activation index")]:
        with pytest.raises(ValueError, match=words):
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
    assert model.model.layers[1].mlp.experts.limit == 6.5 and model.model.layers[0].mlp.experts.limit == 3.0  # the config's


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
    with pytest.raises(ValueError, match=r"checkpoint holds GPT-OSS expert weights \('layers.0.mlp.experts.gate_up_proj_"
                                         r"blocks', ...\) but none under an experts path of the model "
                                         r"\('model.layers.0.mlp.experts', ...\)"):
        patch_gpt_oss(model, checkpoint=other_prefix)
    assert not any(isinstance(layer.mlp.experts, MoEExperts) for layer in model.model.layers)


def test_a_state_dict_of_other_sizes_is_a_size_mismatch(monkeypatch):
    """A state_dict whose padded weights have other shapes: torch's size mismatch, naming them. The
    extra state's sizes were checked first against the module's own weights (red-team finding):
    'model_dim = 64 ... do not fit the padded weights', listing the receiving module's shapes."""
    monkeypatch.setenv("FLYQUANT_BACKEND", "reference")
    small, large = dense_layer(4, 32, 32, 2, 1, seed=1), dense_layer(4, 64, 32, 2, 1, seed=2)
    m = MoEExperts.from_dense(small["w1"], small["w2"])
    with pytest.raises(RuntimeError, match=r"size mismatch for w2: copying a param with shape torch.Size\(\[4, 64, 128\]\)"):
        m.load_state_dict(MoEExperts.from_dense(large["w1"], large["w2"]).state_dict())
    assert m.model_dim == 32


def _same_experts(a: MoEExperts, b: MoEExperts) -> bool:
    return all(torch.equal(x.view(torch.uint8), y.view(torch.uint8)) if x.dtype != y.dtype or x.dtype.itemsize == 1
               else torch.equal(x, y) for (_, x), (_, y) in zip(a.named_buffers(), b.named_buffers()))


def test_a_checkpoint_without_biases_keeps_the_blocks_biases():
    """A checkpoint holding a layer's MXFP4 tensors but not its biases: the patched experts had no
    bias at all (every MoE output wrong, silently; red-team finding); now the block's own biases."""
    model, checkpoint = tiny_gpt_oss(seed=10)
    full = from_gpt_oss_experts({k: v for k, v in checkpoint.items() if k.startswith("model.layers.0.")}, model.config)
    assert full.b1 is not None and full.b1.abs().max() > 0
    patch_gpt_oss(model, checkpoint={k: v for k, v in checkpoint.items() if not k.endswith("_bias")})
    got = model.model.layers[0].mlp.experts
    assert got.b1 is not None and got.b2 is not None and _same_experts(got, full)


def test_a_checkpoint_of_float_weights_is_taken():
    """A checkpoint holding a layer's float weights (another model's state_dict) was ignored: the
    block quantized its own weights instead, silently (red-team finding)."""
    source, _ = tiny_gpt_oss(seed=11)
    model, _ = tiny_gpt_oss(seed=12)
    floats = {k: v for k, v in source.state_dict().items() if ".experts." in k}
    patch_gpt_oss(model, checkpoint=floats)
    for layer, src in zip(model.model.layers, source.model.layers):
        assert _same_experts(layer.mlp.experts, from_gpt_oss_experts(src.mlp.experts, source.config))
