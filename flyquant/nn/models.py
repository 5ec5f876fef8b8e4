"""Swaps of flyquant.nn.MoEExperts into transformers' MoE models.

`from_gpt_oss_experts` / `patch_gpt_oss` convert transformers' GPT-OSS experts (bf16/fp32
`gate_up_proj` (E, hidden, 2 * inter) with interleaved gate/up columns, `down_proj` (E, inter,
hidden), their biases) or the MXFP4 checkpoint tensors (`gate_up_proj_blocks` (E, 2 * inter,
hidden / 32, 16) uint8, `gate_up_proj_scales` (E, 2 * inter, hidden / 32) uint8 E8M0 codes, and
`down_proj_blocks` / `down_proj_scales` (E, hidden, inter / 32, 16) / (E, hidden, inter / 32)),
the latter taken as they are (no requantization). `from_transformers_experts` / `patch_moe` convert
the experts modules of transformers' experts interface (most of its MoE models, GPT-OSS included).
"""

from __future__ import annotations

from collections.abc import Mapping

import torch

from .. import layouts, validate
from ..formats import MX_BLOCK
from .experts import FLOAT_WEIGHTS, FP4_BLOCK_BYTES, SCALE_DTYPES, MoEExperts, raw_bytes

# ---- GPT-OSS ------------------------------------------------------------------------------------

GPT_OSS_TENSORS = ("gate_up_proj", "gate_up_proj_bias", "down_proj", "down_proj_bias",
                   "gate_up_proj_blocks", "gate_up_proj_scales", "down_proj_blocks", "down_proj_scales")
GPT_OSS_WEIGHTS = ("gate_up_proj", "down_proj", "gate_up_proj_blocks", "down_proj_blocks")  # a checkpoint's layer
GPT_OSS_BIASES = ("gate_up_proj_bias", "down_proj_bias")


def _gpt_oss_tensors(experts) -> dict:
    """The named tensors of a GPT-OSS experts module or of a mapping (checkpoint keys, with or
    without a prefix ending in '.')."""
    if isinstance(experts, Mapping):
        found = {}
        for key, value in experts.items():
            name = key.rsplit(".", 1)[-1]
            if name in GPT_OSS_TENSORS:
                if name in found:
                    raise ValueError(f"two tensors named {name!r} in the mapping (pass one layer's experts)")
                found[name] = value
        return found
    return {name: getattr(experts, name) for name in GPT_OSS_TENSORS
            if isinstance(getattr(experts, name, None), torch.Tensor)}


def _swiglu_params(experts, config) -> tuple[float, float]:
    alpha = getattr(experts, "alpha", None)
    limit = getattr(experts, "limit", None)
    if alpha is None:
        alpha = getattr(config, "swiglu_alpha", 1.702)
    if limit is None:
        limit = getattr(config, "swiglu_limit", 7.0)
    return alpha, limit  # checked by MoEExperts (float() took "7" as 7.0)


def from_gpt_oss_experts(experts, config=None, scaling_mode: str = "floor") -> MoEExperts:
    """A MoEExperts (activation "swiglu_oai") from transformers' GPT-OSS experts.

    experts: a GptOssExperts module, or a mapping of its tensors (a checkpoint's, the keys' last
    component naming them). Either float weights: gate_up_proj (E, hidden, 2 * inter) applied as
    x @ gate_up_proj with the gate in the even columns and the up projection in the odd ones,
    gate_up_proj_bias (E, 2 * inter) interleaved alike, down_proj (E, inter, hidden), down_proj_bias
    (E, hidden) -- quantized to MXFP4 with `scaling_mode`; or the MXFP4 checkpoint tensors
    gate_up_proj_blocks (E, 2 * inter, hidden / 32, 16) uint8 (rows interleaved gate/up),
    gate_up_proj_scales (E, 2 * inter, hidden / 32) uint8 E8M0 codes, down_proj_blocks (E, hidden,
    inter / 32, 16), down_proj_scales (E, hidden, inter / 32) -- taken bit for bit. alpha / limit:
    the module's, else config.swiglu_alpha / swiglu_limit, else 1.702 / 7.0."""
    t = _gpt_oss_tensors(experts)
    alpha, limit = _swiglu_params(experts, config)
    b1, b2 = t.get("gate_up_proj_bias"), t.get("down_proj_bias")
    if "gate_up_proj_blocks" in t or "down_proj_blocks" in t:
        return _from_gpt_oss_mxfp4(t, b1, b2, alpha, limit)
    missing = [n for n in ("gate_up_proj", "down_proj") if n not in t]
    if missing:
        raise ValueError(f"GPT-OSS experts need gate_up_proj and down_proj (or their _blocks/_scales); missing {missing}")
    for name in ("gate_up_proj", "down_proj"):
        w = t[name]
        if isinstance(w, torch.Tensor) and w.dtype not in FLOAT_WEIGHTS:  # e.g. transformers' Mxfp4GptOssExperts
            raise ValueError(f"{name} must be a float tensor (bf16/fp16/fp32/fp64) or come as {name}_blocks/_scales; "
                             f"got {w.dtype}")
        validate.tensor(w, name, FLOAT_WEIGHTS, ndim=3)  # a mapping's value may be anything
    gate_up, down = t["gate_up_proj"].detach(), t["down_proj"].detach()
    e, hidden, two_inter = gate_up.shape
    if tuple(down.shape) != (e, two_inter // 2, hidden):
        raise ValueError(f"down_proj must have shape (E, inter, hidden) = {(e, two_inter // 2, hidden)}, got {tuple(down.shape)}")
    if b1 is not None:  # named as given (layouts would name it gate_up_bias), as the checkpoint path does
        validate.tensor(b1, "gate_up_proj_bias", FLOAT_WEIGHTS, ndim=2)
        validate.shape(b1, "gate_up_proj_bias", (e, two_inter))
    if b2 is not None:  # named as given (from_dense would name it b2), as the checkpoint path does
        validate.tensor(b2, "down_proj_bias", FLOAT_WEIGHTS, ndim=2)
        validate.shape(b2, "down_proj_bias", (e, hidden))
    w1, b1 = layouts.gate_up_rows_from_interleaved(gate_up, None if b1 is None else b1.detach())
    return MoEExperts.from_dense(w1, down.transpose(1, 2), b1, None if b2 is None else b2.detach(),
                                 activation="swiglu_oai", alpha=alpha, limit=limit, scaling_mode=scaling_mode)


def _checkpoint_tensor(t, name, shape_desc, ndim, dtypes=(torch.uint8,)):
    if name not in t:
        raise ValueError(f"GPT-OSS MXFP4 experts need {name} {shape_desc}; it is missing")
    x = t[name]
    if not isinstance(x, torch.Tensor) or x.dtype not in dtypes or x.dim() != ndim:
        got = f"{x.dtype} with shape {tuple(x.shape)}" if isinstance(x, torch.Tensor) else type(x).__name__
        raise ValueError(f"{name} must be {shape_desc} {'/'.join(str(d)[6:] for d in dtypes)}, got {got}")
    return x.detach()


def _from_gpt_oss_mxfp4(t, b1, b2, alpha, limit) -> MoEExperts:
    gu_b = _checkpoint_tensor(t, "gate_up_proj_blocks", "(E, 2 * inter, hidden / 32, 16)", 4)
    gu_s = _checkpoint_tensor(t, "gate_up_proj_scales", "(E, 2 * inter, hidden / 32)", 3, SCALE_DTYPES)
    dn_b = _checkpoint_tensor(t, "down_proj_blocks", "(E, hidden, inter / 32, 16)", 4)
    dn_s = _checkpoint_tensor(t, "down_proj_scales", "(E, hidden, inter / 32)", 3, SCALE_DTYPES)
    e, two_inter, hb, blk = gu_b.shape
    if blk != FP4_BLOCK_BYTES or two_inter % 2 or (two_inter // 2) % MX_BLOCK:
        raise ValueError(f"gate_up_proj_blocks must have shape (E, 2 * inter, hidden / 32, 16) with inter a multiple "
                         f"of 32, got {tuple(gu_b.shape)}")
    inter, hidden = two_inter // 2, hb * MX_BLOCK
    want = {"gate_up_proj_scales": (gu_s, (e, two_inter, hb)),
            "down_proj_blocks": (dn_b, (e, hidden, inter // MX_BLOCK, FP4_BLOCK_BYTES)),
            "down_proj_scales": (dn_s, (e, hidden, inter // MX_BLOCK))}
    for name, (x, shape) in want.items():
        if tuple(x.shape) != shape:
            raise ValueError(f"{name} must have shape {shape} (from gate_up_proj_blocks {tuple(gu_b.shape)}), "
                             f"got {tuple(x.shape)}")
    w1 = gu_b.reshape(e, two_inter, hidden // 2)
    s1 = raw_bytes(gu_s)
    w1 = torch.cat([w1[:, 0::2], w1[:, 1::2]], dim=1)  # interleaved rows -> gate rows then up rows
    s1 = torch.cat([s1[:, 0::2], s1[:, 1::2]], dim=1)
    if b1 is not None:
        validate.tensor(b1, "gate_up_proj_bias", FLOAT_WEIGHTS, ndim=2)
        validate.shape(b1, "gate_up_proj_bias", (e, two_inter))
        b1 = torch.cat([b1[:, 0::2], b1[:, 1::2]], dim=1)
    if b2 is not None:
        validate.tensor(b2, "down_proj_bias", FLOAT_WEIGHTS, ndim=2)
        validate.shape(b2, "down_proj_bias", (e, hidden))
    return MoEExperts.from_mxfp4(w1, s1, dn_b.reshape(e, hidden, inter // 2), dn_s, b1, b2,
                                 activation="swiglu_oai", alpha=alpha, limit=limit)


def patch_gpt_oss(model, checkpoint: Mapping | None = None, scaling_mode: str = "floor"):
    """Swap the experts of every GPT-OSS MoE block (transformers' GptOssMLP) of `model` for a
    MoEExperts, in place, keeping each block's router; returns the model.

    checkpoint: optionally the checkpoint's tensors (a state_dict-like mapping with keys
    '<block path>.experts.gate_up_proj_blocks' etc.): a block whose weights it holds takes them
    (MXFP4 tensors bit for bit, float ones quantized with `scaling_mode`), with the biases it holds
    and, where it holds none, the block's own; the other blocks quantize their own float weights."""
    from transformers.models.gpt_oss.modeling_gpt_oss import GptOssMLP

    if checkpoint is not None and not isinstance(checkpoint, Mapping):
        raise TypeError(f"checkpoint must be a mapping of tensors (a state_dict) or None, got {type(checkpoint).__name__}")
    config = getattr(model, "config", None)
    blocks = [(name, m) for name, m in model.named_modules() if isinstance(m, GptOssMLP)]
    if not blocks:
        raise ValueError(f"no GPT-OSS MoE block (transformers GptOssMLP) in {type(model).__name__}")
    experts_path = {name: f"{name}.experts" if name else "experts" for name, _ in blocks}  # name "": model is a block
    patched = [name for name, block in blocks if isinstance(block.experts, MoEExperts)]
    if patched:  # else "GPT-OSS experts need gate_up_proj and down_proj", naming neither the block nor the cause
        raise ValueError(f"{experts_path[patched[0]]} is already a MoEExperts: patch_gpt_oss ran on this model")
    converted, sources = [], []  # every block converted before any is swapped: an error leaves the model as it was
    for name, block in blocks:
        source = block.experts
        if checkpoint is not None:
            prefix = experts_path[name] + "."
            layer = {k: v for k, v in checkpoint.items() if k.startswith(prefix) and "." not in k[len(prefix):]}
            if any(k[len(prefix):] in GPT_OSS_WEIGHTS for k in layer):
                source = layer
        sources.append(source)
        with torch.no_grad():
            new = from_gpt_oss_experts(source, config, scaling_mode=scaling_mode)
        # the router picks among its E experts at the block's width: a checkpoint layer of other sizes
        # (ids past its experts are dropped on the device, silently) must not replace the experts
        experts, hidden = block.router.weight.shape
        want = (experts, hidden, getattr(block.experts, "intermediate_size", new.inter_dim))
        if (new.num_experts, new.model_dim, new.inter_dim) != want:
            origin = "the checkpoint" if isinstance(source, Mapping) else "the block"
            raise ValueError(f"{experts_path[name]}: the experts from {origin} have (E, hidden, inter) = "
                             f"{(new.num_experts, new.model_dim, new.inter_dim)}, the block (router, config) {want}")
        if isinstance(source, Mapping):
            # biases it lacks are the block's (e.g. a checkpoint's MXFP4 tensors alone: they were dropped),
            # taken once its sizes are known to be the block's
            own = _gpt_oss_tensors(block.experts)
            lacking = {prefix + b: own[b] for b in GPT_OSS_BIASES if b in own and prefix + b not in source}
            if lacking:
                with torch.no_grad():
                    new = from_gpt_oss_experts({**lacking, **source}, config, scaling_mode=scaling_mode)
            alpha, limit = _swiglu_params(block.experts, config)  # the block's, checked (not assigned past the checks)
            new._set_config(new.w1, new.w2, new.model_dim, new.inter_dim, new.activation, alpha, limit)
        converted.append((block, new))
    given = [k for k in (checkpoint or ()) if k.rsplit(".", 1)[-1] in GPT_OSS_WEIGHTS]
    if given and not any(isinstance(b, Mapping) for b in sources):  # e.g. keys of another prefix: all ignored
        raise ValueError(f"checkpoint holds GPT-OSS expert weights ({given[0]!r}, ...) but none under an experts path "
                         f"of the model ({experts_path[blocks[0][0]]!r}, ...): its key prefix does not match the model's")
    for block, new in converted:
        block.experts = new
    return model


# ---- any transformers MoE model (its experts interface) -------------------------------------------

EXPERTS_FLAGS = ("has_gate", "is_concatenated", "is_transposed", "has_bias")  # set by @use_experts_implementation
ACTIVATION_PROBE = torch.linspace(-8.0, 8.0, 161)


def _is_experts_module(m) -> bool:
    """Whether m is an experts module of transformers' experts interface (a class decorated with
    transformers.integrations.moe.use_experts_implementation), as ~70 of its MoE models have."""
    return all(hasattr(m, f) for f in EXPERTS_FLAGS) and callable(getattr(type(m), "_apply_gate", None))


def _gated_activation(experts) -> str:
    """Our activation name for act(gate) * up with the module's act_fn, identified by its values (the
    class names vary across transformers' models); anything else is refused."""
    import torch.nn.functional as F

    act = getattr(experts, "act_fn", None)
    if not callable(act):
        raise ValueError(f"{type(experts).__name__} has no act_fn: its gated activation is unknown")
    device = experts.gate_up_proj.device  # a meta skeleton's (built to load a state_dict into): probed on the CPU
    x = ACTIVATION_PROBE.to("cpu" if device.type == "meta" else device)
    with torch.no_grad():
        y = act(x)
    for name, f in (("silu", F.silu), ("gelu", lambda v: F.gelu(v, approximate="tanh"))):
        if torch.allclose(y.float(), f(x), rtol=1e-5, atol=1e-6):
            return name
    raise ValueError(f"{type(experts).__name__}: its activation {act!r} is neither silu nor tanh-approximated "
                     "gelu, the gated activations the kernels fuse")


def from_transformers_experts(experts, config=None, scaling_mode: str = "floor") -> MoEExperts:
    """A MoEExperts from an experts module of transformers' experts interface (Mixtral, Qwen2/3-MoE,
    DeepSeek-V2/V3, GLM-4 MoE, OLMoE, GPT-OSS and the other models whose experts class is decorated
    with `use_experts_implementation`), its float weights quantized to MXFP4 with `scaling_mode`.

    Taken: gated experts (gate_up_proj and down_proj, stored concatenated [gate; up], transposed or
    not, with or without biases) whose gate is transformers' default act(gate) * up with act silu or
    tanh-approximated gelu, and GPT-OSS's clamped swiglu (from_gpt_oss_experts; its rows are
    interleaved). Refused with the reason: experts without a gate, with a post-expert norm, with
    another gating, flagged interleaved with the default gate (which splits [gate; up]), sharded for
    expert parallelism, or with quantized (non-float) weights."""
    name = type(experts).__name__
    if not _is_experts_module(experts):
        raise ValueError(f"{name} is not an experts module of transformers' experts interface "
                         "(a class decorated with use_experts_implementation)")
    from transformers.integrations.moe import _default_apply_gate

    refused = [why for why, bad in (
        ("it has no gate projection (has_gate=False)", not experts.has_gate),
        # transformers' default gate splits [gate; up] whatever the flag says (chunk(2)), and only
        # models with their own gate store the rows interleaved: which one this module means is unknown
        ("its gate_up rows are flagged interleaved (is_concatenated=False) but it has transformers' default gate, "
         "which reads them as [gate; up]", not experts.is_concatenated and type(experts)._apply_gate is _default_apply_gate),
        ("it applies a norm after each expert", getattr(experts, "has_post_expert_norm", False)),
        ("it is sharded for expert parallelism", getattr(experts, "_is_expert_parallel", False))) if bad]
    if refused:
        raise ValueError(f"{name}: {refused[0]}, which fq.fused_moe does not compute")
    if type(experts)._apply_gate is not _default_apply_gate:
        from transformers.models.gpt_oss.modeling_gpt_oss import GptOssExperts

        if isinstance(experts, GptOssExperts):
            return from_gpt_oss_experts(experts, config, scaling_mode=scaling_mode)
        raise ValueError(f"{name}: its gating ({name}._apply_gate) is not act(gate) * up, which fq.fused_moe fuses")
    for attr in ("gate_up_proj", "down_proj"):
        w = getattr(experts, attr, None)
        if not isinstance(w, torch.Tensor) or w.dtype not in FLOAT_WEIGHTS or w.dim() != 3:
            got = f"{w.dtype} {tuple(w.shape)}" if isinstance(w, torch.Tensor) else type(w).__name__
            raise ValueError(f"{name}.{attr} must be a 3-D float tensor (bf16/fp16/fp32/fp64), got {got}")
    w1, w2 = experts.gate_up_proj.detach(), experts.down_proj.detach()
    if experts.is_transposed:  # stored (E, in, out), applied as x @ w
        w1, w2 = w1.transpose(1, 2), w2.transpose(1, 2)
    b1 = experts.gate_up_proj_bias.detach() if experts.has_bias else None
    b2 = experts.down_proj_bias.detach() if experts.has_bias else None
    return MoEExperts.from_dense(w1, w2, b1, b2, activation=_gated_activation(experts), scaling_mode=scaling_mode)


def patch_moe(model, scaling_mode: str = "floor"):
    """Swap every experts module of transformers' experts interface in `model` (from_transformers_experts:
    Mixtral, Qwen2/3-MoE, DeepSeek-V2/V3, GLM-4 MoE, OLMoE, GPT-OSS, ...) for a MoEExperts, in place,
    keeping the routers; returns the model. Every module is converted before any is swapped, so a
    refused one leaves the model as it was. For inference: MoEExperts computes no gradients.
    GPT-OSS's MXFP4 checkpoint tensors are taken bit for bit by patch_gpt_oss(model, checkpoint)."""
    if _is_experts_module(model):
        raise ValueError(f"{type(model).__name__} is itself an experts module: convert it with from_transformers_experts")
    config = getattr(model, "config", None)
    found = [(parent, child_name, f"{path}.{child_name}" if path else child_name, child)
             for path, parent in model.named_modules() for child_name, child in parent.named_children()
             if _is_experts_module(child)]
    if not found:
        done = any(isinstance(m, MoEExperts) for m in model.modules())
        raise ValueError(f"{type(model).__name__} has no experts module of transformers' experts interface"
                         + (" left: patch_moe or patch_gpt_oss ran on this model" if done else ""))
    converted = []
    for parent, child_name, path, child in found:
        try:
            with torch.no_grad():
                converted.append((parent, child_name, from_transformers_experts(child, config, scaling_mode)))
        except ValueError as e:
            raise ValueError(f"{path}: {e}") from e
    for parent, child_name, new in converted:
        setattr(parent, child_name, new)
    return model
