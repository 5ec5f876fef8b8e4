"""MoEExperts: one MoE layer's experts as the A16W4 kernels take them, running fq.fused_moe.

It holds MXFP4 w1 (gate rows then up rows) and w2, pre-shuffled, their E8M0 scales shuffled to
match, optional biases, the activation and its parameters, and the true and padded sizes.
Padding (zero weights, zero bias) is what the shuffles and the kernels' tiles need:

    K = model_dim padded to 256   (w1's reduced dim; the scale shuffle takes K in tiles of 256)
    P = inter_dim padded to 256   (w1's gate and up halves, w2's reduced dim)
    N = model_dim padded to 32    (w2's rows, the scale shuffle's 32-row tiles)

so GPT-OSS's 2880 becomes K = P = 3072 and N = 2880. Weights are converted once, on the device
they live on; the module's buffers are the converted tensors and the layer's sizes and
activation travel in its state_dict (extra state), so state_dict round-trips.
"""

from __future__ import annotations

from collections.abc import Mapping

import torch

from .. import api, api_moe, layouts, reference_moe, validate
from ..formats import MX_BLOCK
from ..moe import MAX_TOPK

K_ALIGN = 256  # w1's K: shuffle_scale_a16w4 takes K / 32 in tiles of 8 columns
P_ALIGN = 256  # the gate/up halves and w2's K (stage 2 reduces over P in the same 256-wide tiles)
N_ALIGN = 32   # w2's rows: shuffle_scale_a16w4's 32-row tiles
MODEL_CHUNK = 32  # the stage-1 kernel reads x in 32-column chunks (model_dim a multiple of it)
INTER_CHUNK = 32  # stage 2 reduces over inter_dim in 32-column chunks (stage 1 writes 16-wide MFMA columns)
SCALE_PAD_CODE = 0  # E8M0 code the floor quantize gives an all-zero block (2^-127); the padding FP4 codes are 0
FP4_BLOCK_BYTES = MX_BLOCK // 2  # 16 packed bytes per 32-element block
ACTIVATIONS = ("silu", "gelu", "swiglu_oai")
EXTRA_STATE_KEYS = ("model_dim", "inter_dim", "activation", "alpha", "limit")  # get_extra_state's order
FLOAT_WEIGHTS = (torch.bfloat16, torch.float16, torch.float32, torch.float64)
PACKED_DTYPES = (torch.uint8, torch.float4_e2m1fn_x2)
SCALE_DTYPES = (torch.float8_e8m0fnu, torch.uint8)


def _pad(n: int, multiple: int) -> int:
    return -(-n // multiple) * multiple


def _padded_bias(b, name, w1, experts, rows, fill, dtype=None):
    """A (E, rows) bias from b (E, n) with n <= rows filled by `fill(out, b)`, on w1's device; None
    stays None. In `dtype`, else kept in bf16 or fp32 (fp16/fp64 become fp32)."""
    if b is None:
        return None
    validate.tensor(b, name, FLOAT_WEIGHTS, ndim=2)
    validate.same_device("w1", w1, name, b)  # else a module whose forward fails naming fused_moe's x or a2
    dtype = dtype or (b.dtype if b.dtype in (torch.bfloat16, torch.float32) else torch.float32)
    out = torch.zeros(experts, rows, dtype=dtype, device=b.device)
    fill(out, b.detach().to(dtype))
    return out


class MoEExperts(torch.nn.Module):
    """The experts of one MoE layer on fq.fused_moe (A16W4: bf16 activations, MXFP4 weights).

    forward(hidden_states (..., model_dim), topk_ids (T, topk), topk_weights (T, topk)) ->
    (..., model_dim) in hidden_states' dtype: out[t] = sum_k w_tk * (act(x[t] @ Wg[e]^T + bg[e],
    x[t] @ Wu[e]^T + bu[e]) @ W2[e]^T + b2[e]), e = topk_ids[t, k]. The activations enter the
    kernels as bf16; the output is accumulated in fp32 for fp32/fp64 hidden states, else bf16.

    Build with `from_dense` (float weights, quantized once) or `from_mxfp4` (packed FP4 + E8M0
    scales as quantized); the constructor takes the already padded, shuffled tensors.
    """

    def __init__(self, w1, w1_scale, w2, w2_scale, b1=None, b2=None, *, model_dim: int, inter_dim: int,
                 activation: str = "silu", alpha: float = 1.702, limit: float = 7.0):
        super().__init__()
        validate.tensor(w1, "w1", PACKED_DTYPES, ndim=3)
        validate.tensor(w2, "w2", PACKED_DTYPES, ndim=3)
        experts, two_p, _ = w1.shape
        if w2.shape[0] != experts or 2 * w2.shape[2] != two_p // 2:
            raise ValueError(f"w2 must have shape (E = {experts}, N, P / 2 = {two_p // 4}), got {tuple(w2.shape)}")
        self._set_config(w1, w2, model_dim, inter_dim, activation, alpha, limit)
        self.register_buffer("w1", w1)
        self.register_buffer("w1_scale", w1_scale)
        self.register_buffer("w2", w2)
        self.register_buffer("w2_scale", w2_scale)
        self.register_buffer("b1", b1)
        self.register_buffer("b2", b2)

    # pickle.loads cannot rebuild a float8_e8m0fnu tensor (torch.serialization's persistent_load
    # asks its untyped storage for a dtype), so the scale buffers travel as their uint8 bytes
    def __getstate__(self):
        state = dict(super().__getstate__())
        buffers = state["_buffers"]
        state["_e8m0_buffers"] = [k for k, v in buffers.items() if v is not None and v.dtype == torch.float8_e8m0fnu]
        state["_buffers"] = type(buffers)((k, v.view(torch.uint8) if k in state["_e8m0_buffers"] else v)
                                          for k, v in buffers.items())
        return state

    def __setstate__(self, state):
        e8m0 = state.pop("_e8m0_buffers", ())
        super().__setstate__(state)
        for k in e8m0:
            self._buffers[k] = self._buffers[k].view(torch.float8_e8m0fnu)

    @property
    def num_experts(self) -> int:
        return self.w1.shape[0]

    @property
    def padded_dims(self) -> dict:
        """The padded sizes: K (w1's reduced dim), P (gate/up half, w2's reduced dim), N (w2's rows)."""
        return dict(K=2 * self.w1.shape[2], P=self.w1.shape[1] // 2, N=self.w2.shape[1])

    # ---- constructors -------------------------------------------------------------------------

    @classmethod
    def from_dense(cls, w1, w2, b1=None, b2=None, *, activation: str = "silu", alpha: float = 1.702,
                   limit: float = 7.0, scaling_mode: str = "floor") -> "MoEExperts":
        """From float expert weights, quantized to MXFP4 once on their device (scaling_mode "floor",
        the OCP rule the GPT-OSS checkpoint used, or "rceil" / "even").

        w1: (E, 2 * inter, model) gate rows [0, inter) then up rows, bf16/fp16/fp32/fp64;
        w2: (E, model, inter); b1: (E, 2 * inter) in w1's row order; b2: (E, model)."""
        validate.tensor(w1, "w1", FLOAT_WEIGHTS, ndim=3)
        validate.tensor(w2, "w2", FLOAT_WEIGHTS, ndim=3)
        experts, two_inter, model = w1.shape
        if two_inter % 2:
            raise ValueError(f"w1.shape[1] = {two_inter} must be even (gate rows then up rows)")
        inter = two_inter // 2
        if tuple(w2.shape) != (experts, model, inter):
            raise ValueError(f"w2 must have shape (E, model, inter) = {(experts, model, inter)}, got {tuple(w2.shape)}")
        # up front: an empty one failed in a reshape or in the shuffles, naming neither weight
        api_moe.check_moe_sizes(**{"w1.shape[0] (E)": experts, "w1.shape[2] (model)": model,
                                   "w1.shape[1] / 2 (inter)": inter})
        validate.same_device("w1", w1, "w2", w2)
        if b2 is not None:  # (E, model) exactly: _down_bias takes from_mxfp4's padded (E, >= model) too
            validate.tensor(b2, "b2", FLOAT_WEIGHTS, ndim=2)
            validate.shape(b2, "b2", (experts, model))
        k, p, n = _pad(model, K_ALIGN), _pad(inter, P_ALIGN), _pad(model, N_ALIGN)
        qdtype = w1.dtype if w1.dtype in (torch.bfloat16, torch.float16, torch.float32) else torch.float32
        p1 = torch.empty(experts, 2 * p, k // 2, dtype=torch.uint8, device=w1.device)
        s1 = torch.empty(experts, 2 * p, k // MX_BLOCK, dtype=torch.float8_e8m0fnu, device=w1.device)
        p2 = torch.empty(experts, n, p // 2, dtype=torch.uint8, device=w1.device)
        s2 = torch.empty(experts, n, p // MX_BLOCK, dtype=torch.float8_e8m0fnu, device=w1.device)
        for e in range(experts):  # one expert at a time: padded float copies of one expert only
            d1 = torch.zeros(2, p, k, dtype=qdtype, device=w1.device)
            d1[:, :inter, :model] = w1[e].detach().reshape(2, inter, model)
            p1[e], s1[e] = (t.view(2 * p, -1) for t in api.quantize_mxfp4(d1, scaling_mode=scaling_mode))
            d2 = torch.zeros(n, p, dtype=qdtype, device=w2.device)
            d2[:model, :inter] = w2[e].detach()
            p2[e], s2[e] = api.quantize_mxfp4(d2, scaling_mode=scaling_mode)
        return cls._from_padded(p1, s1, p2, s2, _gate_up_bias(b1, w1, experts, inter, p), _down_bias(b2, w1, experts, model, n),
                                model, inter, activation, alpha, limit)

    @classmethod
    def from_mxfp4(cls, w1, w1_scale, w2, w2_scale, b1=None, b2=None, *, model_dim: int | None = None,
                   inter_dim: int | None = None, activation: str = "silu", alpha: float = 1.702,
                   limit: float = 7.0) -> "MoEExperts":
        """From MXFP4 expert weights as quantized (unshuffled), taken bit for bit:

        w1: (E, 2 * I, M / 2) packed FP4 (uint8, low nibble first), gate rows [0, I) then up rows;
        w1_scale: (E, 2 * I, ceil(M / 32)) E8M0 (float8_e8m0fnu or uint8 codes); w2: (E, M', I / 2) with
        M' >= model_dim rows; w2_scale: (E, M', ceil(I / 32)); b1 (E, 2 * I) in w1's row order, b2 (E, >=
        model_dim). model_dim / inter_dim: the true sizes when M / I include padding (default M, I)."""
        validate.tensor(w1, "w1", PACKED_DTYPES, ndim=3)
        validate.tensor(w2, "w2", PACKED_DTYPES, ndim=3)
        validate.tensor(w1_scale, "w1_scale", SCALE_DTYPES, ndim=3)
        validate.tensor(w2_scale, "w2_scale", SCALE_DTYPES, ndim=3)
        experts, two_i, m_half = w1.shape
        if two_i % 2:
            raise ValueError(f"w1.shape[1] = {two_i} must be even (gate rows then up rows)")
        i_rows, m_cols = two_i // 2, 2 * m_half
        # scale columns of the reduced dims: a trailing partial block (as if zero-padded) has one too; a
        # floor dropped it, and its elements were read with the padding scale 2^-127 (zeros), silently
        m_blocks, i_blocks = _pad(m_cols, MX_BLOCK) // MX_BLOCK, _pad(i_rows, MX_BLOCK) // MX_BLOCK
        api_moe.check_moe_sizes(**{"w1.shape[0] (E)": experts})  # none: an ambiguous reshape below
        validate.shape(w1_scale, "w1_scale", (experts, two_i, m_blocks))
        if w2.shape[0] != experts or 2 * w2.shape[2] != i_rows:
            raise ValueError(f"w2 must have shape (E = {experts}, rows, I / 2 = {i_rows // 2}), got {tuple(w2.shape)}")
        validate.shape(w2_scale, "w2_scale", (experts, w2.shape[1], i_blocks))
        for name, t in (("w1_scale", w1_scale), ("w2", w2), ("w2_scale", w2_scale)):
            validate.same_device("w1", w1, name, t)
        model = m_cols if model_dim is None else model_dim
        inter = i_rows if inter_dim is None else inter_dim
        api_moe.check_moe_sizes(model_dim=model, inter_dim=inter)
        if not 0 < model <= min(m_cols, w2.shape[1]):
            raise ValueError(f"model_dim = {model} must be in [1, min(2 * w1.shape[2], w2.shape[1]) = "
                             f"{min(m_cols, w2.shape[1])}]")
        if not 0 < inter <= i_rows:
            raise ValueError(f"inter_dim = {inter} must be in [1, w1.shape[1] / 2 = {i_rows}]")
        k, p, n = _pad(m_cols, K_ALIGN), _pad(i_rows, P_ALIGN), _pad(w2.shape[1], N_ALIGN)
        dev = w1.device
        p1 = torch.zeros(experts, 2, p, k // 2, dtype=torch.uint8, device=dev)
        p1[:, :, :i_rows, :m_half] = raw_bytes(w1).view(experts, 2, i_rows, m_half)
        s1 = torch.full((experts, 2, p, k // MX_BLOCK), SCALE_PAD_CODE, dtype=torch.uint8, device=dev)
        s1[:, :, :i_rows, :m_blocks] = raw_bytes(w1_scale).view(experts, 2, i_rows, -1)
        p2 = torch.zeros(experts, n, p // 2, dtype=torch.uint8, device=dev)
        p2[:, :w2.shape[1], :i_rows // 2] = raw_bytes(w2)
        s2 = torch.full((experts, n, p // MX_BLOCK), SCALE_PAD_CODE, dtype=torch.uint8, device=dev)
        s2[:, :w2.shape[1], :i_blocks] = raw_bytes(w2_scale)
        e8m0 = torch.float8_e8m0fnu
        return cls._from_padded(p1.view(experts, 2 * p, k // 2), s1.view(experts, 2 * p, -1).view(e8m0), p2,
                                s2.view(e8m0), _gate_up_bias(b1, w1, experts, i_rows, p), _down_bias(b2, w1, experts, model, n),
                                model, inter, activation, alpha, limit)

    @classmethod
    def _from_padded(cls, p1, s1, p2, s2, b1, b2, model, inter, activation, alpha, limit):
        """Padded, unshuffled packed weights (E, 2P, K/2), (E, N, P/2) and scales -> the module."""
        experts = p1.shape[0]
        return cls(layouts.shuffle_weight_a16w4(p1, gate_up=True),
                   layouts.shuffle_scale_a16w4(s1.reshape(experts * p1.shape[1], -1), experts, gate_up=True),
                   layouts.shuffle_weight_a16w4(p2),
                   layouts.shuffle_scale_a16w4(s2.reshape(experts * p2.shape[1], -1), experts),
                   b1, b2, model_dim=model, inter_dim=inter, activation=activation, alpha=alpha, limit=limit)

    # ---- forward and state ----------------------------------------------------------------------

    def forward(self, hidden_states: torch.Tensor, topk_ids: torch.Tensor, topk_weights: torch.Tensor) -> torch.Tensor:
        """The experts' output for hidden_states (..., model_dim) routed by topk_ids and topk_weights
        (tokens, topk) (note the order: ids first, as transformers' experts modules take them; fused_moe
        takes the weights first), in hidden_states' float dtype and shape."""
        # a float tensor: the output is converted back to its dtype (an int or bool one got the result
        # truncated, a complex one lost its imaginary part, silently)
        validate.tensor(hidden_states, "hidden_states", FLOAT_WEIGHTS)
        if hidden_states.dim() == 0:
            raise ValueError(f"hidden_states must have shape (..., model_dim = {self.model_dim}), got a 0-d tensor")
        if hidden_states.shape[-1] != self.model_dim:
            raise ValueError(f"hidden_states.shape[-1] = {hidden_states.shape[-1]} must equal model_dim = {self.model_dim}")
        x = hidden_states.reshape(-1, self.model_dim).to(torch.bfloat16)
        tokens = x.shape[0]
        # topk_ids / topk_weights: (..., topk), leading dims flattening to the tokens ((T, topk) as routers
        # give them). Element counts alone would take a transposed (topk, T) and pair ids and weights wrongly.
        validate.tensor(topk_ids, "topk_ids")
        validate.tensor(topk_weights, "topk_weights", FLOAT_WEIGHTS)  # int, bool or complex ones were cast to fp32
        topk = topk_ids.shape[-1] if topk_ids.dim() else 0
        if topk_ids.numel() != tokens * topk:
            raise ValueError(f"topk_ids must have shape (T, topk) with T = {tokens} (the tokens of hidden_states), "
                             f"got {tuple(topk_ids.shape)}")
        if topk_weights.shape != topk_ids.shape:
            raise ValueError(f"topk_weights must have the shape of topk_ids {tuple(topk_ids.shape)} (T = {tokens}, "
                             f"topk = {topk}), got {tuple(topk_weights.shape)}")
        # named here as given (fused_moe would name its moe_buf, x, w1)
        for name, t in (("topk_ids", topk_ids), ("topk_weights", topk_weights), ("w1 (the module's buffers)", self.w1)):
            validate.same_device("hidden_states", hidden_states, name, t)
        validate.no_autograd("MoEExperts", dict(hidden_states=hidden_states, topk_weights=topk_weights))
        # The kernels take model_dim and inter_dim in chunks of 32: run on
        # those (the weights and biases past the true sizes are zero, so the extra a2 columns and
        # outputs are 0) and keep the true columns. Only a model_dim off 32 costs a copy of x.
        model, inter = _pad(self.model_dim, MODEL_CHUNK), _pad(self.inter_dim, INTER_CHUNK)
        x = torch.nn.functional.pad(x, (0, model - self.model_dim)) if model != self.model_dim else x.contiguous()
        wide = hidden_states.dtype in (torch.float32, torch.float64)
        out = api_moe.fused_moe(x, self.w1, self.w1_scale, self.w2, self.w2_scale,
                                topk_weights.reshape(tokens, topk).to(torch.float32),
                                topk_ids.reshape(tokens, topk), b1=self.b1, b2=self.b2, activation=self.activation,
                                alpha=self.alpha, limit=self.limit,
                                out_dtype=torch.float32 if wide else torch.bfloat16, model_dim=model, inter_dim=inter)
        if model != self.model_dim:
            out = out[:, :self.model_dim]
        return out.to(hidden_states.dtype).reshape(hidden_states.shape)

    def warmup(self, topk: int, tokens=(1,), dtype: torch.dtype = torch.bfloat16,
               ids_dtype: torch.dtype = torch.int64) -> None:
        """Compile the kernels forward will run, ahead of serving: forward once per token count in
        `tokens` on zeros, routed top-`topk` (hidden states of `dtype`, which picks the output's
        accumulation; topk_ids of `ids_dtype`, torch.topk's int64 by default). A kernel is compiled
        per configuration, and forward is the one place that knows this layer's (its padded sizes,
        bias dtypes, activation, alpha and limit)."""
        counts, _ = api._warmup_lists(tokens, ())  # checked as fq.warmup checks its token counts
        # as fq.warmup takes topk (numpy ints too), at most moe_sorting's MAX_TOPK
        n, most = validate.integer(topk), min(self.num_experts, MAX_TOPK)
        if n is None or not 0 < n <= most:
            bound = f"experts = {self.num_experts}" if most == self.num_experts else f"{MAX_TOPK} (experts = {self.num_experts})"
            raise ValueError(f"topk must be an int in [1, {bound}], got {topk!r}")
        topk = n
        # named as this method's arguments (forward would name its hidden_states / topk_ids)
        if dtype not in FLOAT_WEIGHTS:
            raise TypeError(f"dtype must be the hidden states' floating dtype, one of {FLOAT_WEIGHTS}, got {dtype!r}")
        api._check_ids_dtype(ids_dtype)
        device = self.w1.device
        for t in counts:
            ids, weights = api._warmup_routing(t, topk, self.num_experts, ids_dtype, device)
            self.forward(torch.zeros(t, self.model_dim, dtype=dtype, device=device), ids, weights)

    def _apply(self, fn, recurse=True):
        # .to(dtype) / .half() / .bfloat16() convert every floating buffer, the E8M0 scales included (into
        # floats no forward takes; fp16 cannot even hold their range) and the fp32 gate/up bias: the buffers
        # are in the kernels' formats, so fn sees their bytes (uint8, which those leave alone) and only moves them.
        given = dict(self._buffers)
        self._buffers.update({name: b.contiguous().view(torch.uint8) for name, b in given.items() if b is not None})
        try:
            super()._apply(fn, recurse)
            converted = [name for name, b in self._buffers.items() if b is not None and b.dtype != torch.uint8]
            if converted:  # Module.type(dtype) converts integer tensors too
                raise TypeError(f"MoEExperts keeps its buffers in the kernels' formats; cannot convert {converted}")
            self._buffers.update({name: self._buffers[name].view(b.dtype) for name, b in given.items() if b is not None})
        except BaseException:
            self._buffers.update(given)
            raise
        return self

    def _load_from_state_dict(self, state_dict, prefix, *args):
        # The packed weights and scales are codes: torch's copy_ into a buffer of another dtype converts
        # values (uint8 scale codes into an E8M0 buffer: 127 -> 2^7 -> code 134), so bytes of one code
        # dtype load into another as they are, and a float tensor there is refused.
        codes = PACKED_DTYPES + SCALE_DTYPES
        for name in ("w1", "w1_scale", "w2", "w2_scale"):
            given, own = state_dict.get(prefix + name), getattr(self, name)
            if isinstance(given, torch.Tensor) and given.dtype != own.dtype:
                if given.dtype not in codes:
                    raise TypeError(f"MoEExperts' {prefix + name} must hold codes ({', '.join(str(d)[6:] for d in codes)}), "
                                    f"got {given.dtype}")
                state_dict[prefix + name] = given.view(own.dtype)
        # weights of other shapes are torch's "size mismatch" (not loaded): the extra state's sizes, checked
        # against the module's own weights, would raise first and name those
        if any(isinstance(state_dict.get(prefix + n), torch.Tensor) and state_dict[prefix + n].shape != getattr(self, n).shape
               for n in ("w1", "w2")) and prefix + "_extra_state" in state_dict:
            state_dict[prefix + "_extra_state"] = self.get_extra_state()
        super()._load_from_state_dict(state_dict, prefix, *args)

    def get_extra_state(self) -> torch.Tensor:
        """The sizes and activation as one int64 tensor (safetensors and save_pretrained take tensors
        only): model_dim, inter_dim, the activation's index in ACTIVATIONS, alpha's and limit's float64 bits."""
        bits = torch.tensor([self.alpha, self.limit], dtype=torch.float64).view(torch.int64)
        return torch.cat([torch.tensor([self.model_dim, self.inter_dim, ACTIVATIONS.index(self.activation)]), bits])

    def set_extra_state(self, state) -> None:
        """get_extra_state's tensor, or the dict of EXTRA_STATE_KEYS that flyquant saved before it."""
        keys = sorted(EXTRA_STATE_KEYS)
        if isinstance(state, torch.Tensor):
            if state.dtype != torch.int64 or tuple(state.shape) != (5,):
                raise ValueError(f"MoEExperts' _extra_state tensor must be int64 of shape (5,), got {state.dtype} "
                                 f"{tuple(state.shape)}")
            sizes, bits = state[:3].tolist(), state[3:].cpu().view(torch.float64).tolist()
            if not 0 <= sizes[2] < len(ACTIVATIONS):
                raise ValueError(f"MoEExperts' _extra_state activation index must be in [0, {len(ACTIVATIONS)}), "
                                 f"got {sizes[2]}")
            state = dict(zip(EXTRA_STATE_KEYS, [sizes[0], sizes[1], ACTIVATIONS[sizes[2]], *bits]))
        if not isinstance(state, Mapping):  # else a KeyError or "not subscriptable" naming no state
            raise TypeError(f"MoEExperts' _extra_state must be an int64 tensor or a dict with keys {keys}, "
                            f"got {type(state).__name__}")
        if set(state) != set(keys):
            raise ValueError(f"MoEExperts' _extra_state must have the keys {keys}, got {sorted(state)}")
        self._set_config(self.w1, self.w2, state["model_dim"], state["inter_dim"], state["activation"], state["alpha"],
                         state["limit"])

    def _set_config(self, w1, w2, model_dim, inter_dim, activation, alpha, limit) -> None:
        """The sizes and activation, checked as the constructor and a loaded state dict alike take them."""
        if activation not in ACTIVATIONS:
            raise ValueError(f"activation must be one of {ACTIVATIONS}, got {activation!r}")
        api_moe.check_moe_sizes(model_dim=model_dim, inter_dim=inter_dim)  # int() below took 63.7 as 63, True as 1
        if not 0 < model_dim <= min(2 * w1.shape[2], w2.shape[1]) or not 0 < inter_dim <= w1.shape[1] // 2:
            raise ValueError(f"model_dim = {model_dim} / inter_dim = {inter_dim} do not fit the padded weights "
                             f"w1 {tuple(w1.shape)}, w2 {tuple(w2.shape)}")
        reference_moe.check_activation_args(activation, alpha, limit)  # else refused by every forward, not here
        self.model_dim, self.inter_dim = int(model_dim), int(inter_dim)
        self.activation, self.alpha, self.limit = activation, float(alpha), float(limit)

    def extra_repr(self) -> str:
        d = self.padded_dims
        return (f"experts={self.num_experts}, model_dim={self.model_dim}, inter_dim={self.inter_dim}, "
                f"padded K={d['K']} P={d['P']} N={d['N']}, activation={self.activation!r}"
                + (f", alpha={self.alpha}, limit={self.limit}" if self.activation == "swiglu_oai" else "")
                + f", biases={self.b1 is not None}/{self.b2 is not None}")


def raw_bytes(t: torch.Tensor) -> torch.Tensor:
    return t if t.dtype == torch.uint8 else t.view(torch.uint8)


def _gate_up_bias(b1, w1, experts, inter, p):
    def fill(out, b):
        if tuple(b.shape) != (experts, 2 * inter):
            raise ValueError(f"b1 must have shape (E, 2 * inter) = {(experts, 2 * inter)}, got {tuple(b.shape)}")
        out.view(experts, 2, p)[:, :, :inter] = b.view(experts, 2, inter)
    # fp32 (exact for bf16): stage 1 adds it in fp32 and then loads it with no conversion (GPT-OSS-like,
    # gfx950, 16 tokens: 6.41 -> 6.37 wave-instructions per MFMA; bench/moe_stages_instr.py --bias-dtype bf16 / fp32)
    return _padded_bias(b1, "b1", w1, experts, 2 * p, fill, torch.float32)


def _down_bias(b2, w1, experts, model, n):
    def fill(out, b):
        if b.shape[0] != experts or b.shape[1] < model:
            raise ValueError(f"b2 must have shape (E = {experts}, >= model_dim = {model}), got {tuple(b.shape)}")
        out[:, :model] = b[:, :model]
    return _padded_bias(b2, "b2", w1, experts, n, fill)
