"""A16W4 MoE stage 2 (down projection): the torch-facing launcher and its configuration choice.
The kernel (math, layouts, work split, main loop, pipeline, tile scan, memory safety, constraints)
is kernels/_a16w4_main_loop.py, shared with stage 1 (kernels/moe_gemm1_a16w4.py); its constants and
helpers are kernels/_a16w4_common.py, re-exported here."""

from __future__ import annotations

import torch

from flyquant import reference_moe, toolchain, validate
from flyquant.arch import arch_info

from ._a16w4_common import *  # noqa: F401,F403  (the kernel's constants and config, one namespace for callers)
from ._a16w4_common import (
    BIAS_DTYPES, K_CHUNK, KT, MAX_SORTED_ROWS, MFMA_MN, OUT_DTYPES, OUT_ELEM_BYTES,
    WAVE_COUNTS, check_inputs, check_sorted_lengths, resolve_tiles, launch_geometry, default_waves, Gemm2Config,
    k_iterations, m_grid, m_tiling, kernel_row_stride,
)
from ._a16w4_main_loop import _cached_launcher, build_moe_gemm2_a16w4  # noqa: F401  (tests patch the former here)


# ---- configuration choice ----------------------------------------------------------------------


def choose_config(tokens: int, topk: int, experts: int, model_dim: int, inter_dim: int, arch: str) -> tuple[int, int, int]:
    """(tile_m, tile_n, k_batch) for a call: tile_m covers the average rows per active expert;
    tile_n 256 once there are enough m-tiles to fill the GPU, else 128; k_batch the smallest
    split that gives every CU a workgroup streaming weights (at 1 token on a GPT-OSS-like shape,
    4 m-tiles x 24 n-tiles x 3 = 288 >= 256 CUs), within the K steps available."""
    info = arch_info(arch)
    tile_m, m_tiles = m_tiling(tokens, topk, experts)
    n_kt = k_iterations(inter_dim)
    tile_n = 256 if m_tiles * -(-model_dim // 256) >= info.compute_units else 128
    n_tiles = -(-model_dim // tile_n)
    k_batch = 1
    while m_tiles * n_tiles * k_batch < info.compute_units and 2 * (k_batch + 1) <= n_kt:
        k_batch += 1
    return tile_m, tile_n, k_batch


# ---- torch-facing launcher ---------------------------------------------------------------------


def moe_gemm2_a16w4(
    a2,  # (T * topk, >= inter_dim) bf16, row t * topk + slot, unit stride along K
    w2,  # (E, w_n, w_k / 2) uint8 / float4_e2m1fn_x2, shuffle_weight_a16w4(nlane=16)
    w2_scale,  # (E * w_n, w_k / 32) or (E, w_n, w_k / 32) e8m0 / uint8, shuffle_scale_a16w4
    sorted_ids,  # (R,) int32, moe_sorting
    sorted_weights,  # (R,) float32
    sorted_expert_ids,  # (>= ceil(R / block_m),) int32
    num_valid_ids,  # (2,) int32, read on the device only
    *,
    arch: str,
    topk: int,
    block_m: int,
    out=None,  # (T, model_dim) out_dtype contiguous: added into; None: zeros
    bias=None,  # (E, >= model_dim) bf16 / f32
    apply_weights: bool = True,
    out_dtype=torch.bfloat16,
    model_dim: int | None = None,  # true sizes when the weights are padded
    inter_dim: int | None = None,
    tile_m: int | None = None,
    tile_n: int | None = None,
    k_batch: int | None = None,
    waves: int | None = None,
):
    """Launch the A16W4 stage-2 GEMM for `arch` on the tensors' device, on torch's current stream
    (CPU tensors: the emulator, stream 0), without a host synchronisation. Returns out."""
    info = arch_info(arch)
    experts, w_n, w_k = check_inputs("a2", a2, "w2", w2, "w2_scale", w2_scale, sorted_ids, sorted_weights,
                                     sorted_expert_ids, num_valid_ids, topk, 2 * MFMA_MN,
                                     "N; scales come in 32-row groups")
    if a2.shape[0] % topk:
        raise ValueError(f"a2.shape[0] = {a2.shape[0]} must be a multiple of topk = {topk} (tokens * topk rows)")
    model_dim = w_n if model_dim is None else model_dim
    inter_dim = a2.shape[1] if inter_dim is None else inter_dim
    if not (0 < model_dim <= w_n and model_dim % MFMA_MN == 0):
        raise ValueError(f"model_dim = {model_dim} must be a multiple of {MFMA_MN} in [1, w2.shape[1] = {w_n}]")
    if not (0 < inter_dim <= min(w_k, a2.shape[1]) and inter_dim % K_CHUNK == 0):
        raise ValueError(f"inter_dim = {inter_dim} must be a multiple of {K_CHUNK} in [1, min(K = {w_k}, a2.shape[1] = {a2.shape[1]})]")
    tokens = a2.shape[0] // topk
    rows = check_sorted_lengths(sorted_ids, sorted_weights, sorted_expert_ids, num_valid_ids, block_m)
    if out_dtype not in OUT_DTYPES:
        raise TypeError(f"out_dtype must be one of {OUT_DTYPES}, got {out_dtype}")
    if out is not None:
        validate.tensor(out, "out", OUT_DTYPES, ndim=2)
        validate.shape(out, "out", (tokens, model_dim))
        validate.same_device("a2", a2, "out", out)
        reference_moe.check_moe_gemm2_memory(out, a2, w2, w2_scale, sorted_ids, sorted_weights, sorted_expert_ids,
                                             num_valid_ids, bias)  # the same refusals as the reference path
    validate.no_autograd("moe_gemm2_a16w4", dict(a2=a2, sorted_weights=sorted_weights, bias=bias, out=out))
    if bias is not None:
        validate.tensor(bias, "bias", ndim=2)
        validate.same_device("a2", a2, "bias", bias)
        if bias.shape[0] != experts or bias.shape[1] < model_dim:
            raise ValueError(f"bias must have shape (E = {experts}, >= model_dim = {model_dim}), got {tuple(bias.shape)}")
        # the kernel reads model_dim elements per expert row at bias + e * stride(0): any other
        # layout (a stride-0 expand shared by the experts, a column stride) or dtype is copied (small)
        if bias.dtype not in BIAS_DTYPES or bias.stride(1) != 1 or not model_dim <= bias.stride(0) < 1 << 31:
            bias = bias[:, :model_dim].to(torch.float32 if bias.dtype not in BIAS_DTYPES else bias.dtype).contiguous()
    # Layouts the kernel does not address (as the reference takes them): copies, in the kernel's
    # layout (weights: a one-time cost better paid by passing them contiguous)
    sorted_ids, sorted_weights, sorted_expert_ids, num_valid_ids, w2, w2_scale = (
        t.contiguous() for t in (sorted_ids, sorted_weights, sorted_expert_ids, num_valid_ids, w2, w2_scale))
    if a2.stride(1) != 1:
        a2 = a2[:, :inter_dim].contiguous()
    if out is not None and not out.is_contiguous():
        result = out
        out = moe_gemm2_a16w4(
            a2, w2, w2_scale, sorted_ids, sorted_weights, sorted_expert_ids, num_valid_ids, arch=arch, topk=topk,
            block_m=block_m, out=out.contiguous(), bias=bias, apply_weights=apply_weights, out_dtype=out_dtype,
            model_dim=model_dim, inter_dim=inter_dim, tile_m=tile_m, tile_n=tile_n, k_batch=k_batch, waves=waves)
        return result.copy_(out)
    out_elem = OUT_ELEM_BYTES[out_dtype if out is None else out.dtype]
    if rows > MAX_SORTED_ROWS:
        raise ValueError(f"len(sorted_ids) = {rows} must be at most {MAX_SORTED_ROWS} (32-bit byte offsets)")

    auto_m, auto_n, auto_kb = choose_config(tokens, topk, experts, model_dim, inter_dim, arch)
    tile_m, tile_n = resolve_tiles(block_m, tile_m, tile_n, auto_m, auto_n)
    n_kt = k_iterations(inter_dim)
    k_batch = min(auto_kb, n_kt) if k_batch is None else k_batch
    if not validate.is_int(k_batch) or not 1 <= k_batch <= n_kt:
        raise ValueError(f"k_batch must be an int in [1, ceil(inter_dim / {KT}) = {n_kt}], got {k_batch!r}")
    if waves is None:
        waves = default_waves(tile_m, tile_n, n_kt, k_batch)
    if not validate.is_int(waves) or waves not in WAVE_COUNTS:
        raise ValueError(f"waves must be one of {WAVE_COUNTS}, got {waves!r}")
    out_span = (1, model_dim * out_elem, model_dim * out_elem)  # out: one contiguous row per token
    wn, wk, windows = launch_geometry(2, a2, topk, inter_dim, out_span, tile_m, tile_n, k_batch, waves, n_kt)

    if out is None:
        out = torch.zeros(tokens, model_dim, dtype=out_dtype, device=a2.device)
    cfg = Gemm2Config(
        arch=info.name, out_dtype=out.dtype, tile_m=tile_m, tile_n=tile_n, k_batch=k_batch, wn=wn, wk=wk,
        model_dim=model_dim, inter_dim=inter_dim, w_n=w_n, w_k=w_k, a_stride=kernel_row_stride(a2.stride(0)), topk=topk,
        block_m=block_m, apply_weights=bool(apply_weights), bias_dtype=None if bias is None else bias.dtype,
        windowed=len(windows) > 1,
    )
    grid_m, compact = m_grid(tokens, topk, experts, rows, tile_m)
    if grid_m == 0:
        return out
    stream = toolchain.stream(a2)
    a2_row_bytes, out_row_bytes = a2.stride(0) * a2.element_size(), model_dim * out.element_size()
    with toolchain.target(info.name, a2.device):
        for t0, n in windows:
            # the window's a2 rows and out rows start at 64-bit host-computed addresses
            a2_bytes = ((n * topk - 1) * a2.stride(0) + a2.shape[1]) * a2.element_size()
            _cached_launcher(cfg)(
                a2.data_ptr() + t0 * topk * a2_row_bytes, a2_bytes, w2.data_ptr(), w2_scale.data_ptr(),
                sorted_ids.data_ptr(), sorted_weights.data_ptr(), sorted_expert_ids.data_ptr(), num_valid_ids.data_ptr(),
                out.data_ptr() + t0 * out_row_bytes, n * out_row_bytes, 0 if bias is None else bias.data_ptr(),
                0 if bias is None else bias.stride(0), n, rows, experts, grid_m, int(compact), t0, tokens, stream=stream,
            )
    return out
