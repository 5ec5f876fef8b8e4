"""A16W4 MoE stage 1 (gate/up projection, activation fused): the torch-facing launcher.

Stage 1 (gate/up projection, activation fused) runs the same kernel with stage=1:

    a2[t * topk + k, j] = bf16(act(x[t] @ Wg[e][j]^T + bg[e, j], x[t] @ Wu[e][j]^T + bu[e, j]) (* w_r))

w1 shuffled with gate_up=True is, byte for byte, a plain shuffled (2P, K) matrix whose 16-row block
2j holds gate rows 16j.. and block 2j + 1 up rows 16j.. (its 32-row scale group j: gate half, up
half), so the main loop is stage 2's on N = 2 * inter_dim (true), K = the hidden size; A's rows
are x[token]; waves own whole (gate, up) block pairs, so the epilogue applies the activation in
registers and stores bf16 to a2 (no atomics, no split K: k_batch is 1). A tile with at most
SPARSE_ROWS live rows (most tiles at small and medium token counts) first compacts its live rows
through LDS, so the activation runs on them only (kernels/_a16w4_stage1_epilogue.py).
sigmoid = 1 / (1 + 2^(-z log2 e)) by v_exp_f32 and v_rcp_f32 (1 ulp each on hardware): with the
roundings of z * log2 e, of 1 + e and of the final products, the activation's relative error is
at most (|z| + 8) * 2^-24 (z the sigmoid's argument; gelu adds 4 * 2^-24 * 2c(|g| + 0.044715|g|^3)
for computing z), plus 2^-126 * |g u| absolute where the hardware flushes a denormal sigmoid to 0.
NaN and Inf propagate as in the reference's formulas, but for one gelu tail: where torch's FP32
1 + tanh(y) rounds to 0 (y below about -9, g below about -5) and u is infinite, the reference
gives 0 * inf = NaN and the kernel, whose 2 sigmoid(2y) stays nonzero down to y of about -44,
the infinity the exact formula gives. An x or a2 past one 32-bit buffer (2 GiB)
runs as one launch per window of tokens (token_windows), as stage 2 does. x and a2 rows may
start at any even byte (an odd row stride in elements): the 16-byte x loads and the 4- or 8-byte
a2 stores are then unaligned, which ROCm's unaligned buffer access serves (as the quantize
kernels' loads; not verified on hardware); a2 has no atomics, so it needs no 4-byte alignment.

The kernel is kernels/_a16w4_main_loop.py's (build_moe_gemm2_a16w4 with stage=1), its epilogue
kernels/_a16w4_stage1_epilogue.py's, its constants and helpers kernels/_a16w4_common.py.
"""

from __future__ import annotations

import torch

from flyquant import reference_moe, toolchain, validate
from flyquant.arch import arch_info

from ._a16w4_common import (
    ACTIVATIONS, BIAS_DTYPES, K_CHUNK, MAX_SORTED_ROWS, MFMA_MN, TILE_MS, TILE_NS, WAVE_COUNTS,
    check_inputs, check_sorted_lengths, resolve_tiles, launch_geometry, default_waves, Gemm2Config, k_iterations, m_grid,
    m_tiling, kernel_row_stride,
)
from ._a16w4_main_loop import _cached_launcher

STAGE1_DOC = __doc__


def choose_config1(tokens: int, topk: int, experts: int, model_dim: int, inter_dim: int, arch: str) -> tuple[int, int]:
    """(tile_m, tile_n) for stage 1: tile_m as stage 2; tile_n (over N = 2 * inter_dim) the largest
    that still gives every CU a workgroup streaming weights (no split K here), else the smallest."""
    info = arch_info(arch)
    tile_m, m_tiles = m_tiling(tokens, topk, experts)
    n = 2 * inter_dim
    fitting = [t for t in TILE_NS if m_tiles * -(-n // t) >= info.compute_units]
    return tile_m, max(fitting) if fitting else TILE_NS[0]


def moe_gemm1_a16w4(
    x,  # (T, >= model_dim) bf16, unit stride along K
    w1,  # (E, 2P, w_k / 2) uint8 / float4_e2m1fn_x2, shuffle_weight_a16w4(gate_up=True)
    w1_scale,  # (E * 2P, w_k / 32) or (E, 2P, w_k / 32) e8m0 / uint8, shuffle_scale_a16w4(gate_up=True)
    sorted_ids, sorted_weights, sorted_expert_ids, num_valid_ids,  # moe_sorting's outputs
    *,
    arch: str,
    topk: int,
    block_m: int,
    out=None,  # (T * topk, >= inter_dim) bf16, unit column stride: rows of routed pairs written
    bias=None,  # (E, 2P) bf16 / f32, w1's row order
    activation: str = "silu",
    alpha: float = 1.702,
    limit: float = 7.0,
    apply_weights: bool = False,
    model_dim: int | None = None,
    inter_dim: int | None = None,
    tile_m: int | None = None,
    tile_n: int | None = None,
    waves: int | None = None,
):
    """Launch the A16W4 stage-1 GEMM (STAGE1_DOC) on the tensors' device, on torch's current stream,
    without a host synchronisation. Returns out (a new zeroed (T * topk, inter_dim) bf16 when None)."""
    info = arch_info(arch)
    if activation not in ACTIVATIONS:
        raise ValueError(f"activation must be one of {ACTIVATIONS}, got {activation!r}")
    reference_moe.check_activation_args(activation, alpha, limit)  # as the reference
    experts, w_n, w_k = check_inputs("x", x, "w1", w1, "w1_scale", w1_scale, sorted_ids, sorted_weights,
                                     sorted_expert_ids, num_valid_ids, topk, 4 * MFMA_MN,
                                     "2P: gate and up halves of 32-row scale groups")
    model_dim = x.shape[1] if model_dim is None else model_dim
    inter_dim = w_n // 2 if inter_dim is None else inter_dim
    if not (0 < inter_dim <= w_n // 2 and inter_dim % MFMA_MN == 0):
        raise ValueError(f"inter_dim = {inter_dim} must be a multiple of {MFMA_MN} in [1, w1.shape[1] / 2 = {w_n // 2}]")
    if not (0 < model_dim <= min(w_k, x.shape[1]) and model_dim % K_CHUNK == 0):
        raise ValueError(f"model_dim = {model_dim} must be a multiple of {K_CHUNK} in [1, min(K = {w_k}, x.shape[1] = {x.shape[1]})]")
    tokens = x.shape[0]
    rows = check_sorted_lengths(sorted_ids, sorted_weights, sorted_expert_ids, num_valid_ids, block_m)
    if rows > MAX_SORTED_ROWS:
        raise ValueError(f"len(sorted_ids) = {rows} must be at most {MAX_SORTED_ROWS} (32-bit byte offsets)")
    if out is not None:
        validate.tensor(out, "out", (torch.bfloat16,), ndim=2)
        validate.same_device("x", x, "out", out)
        if out.shape[0] != tokens * topk or out.shape[1] < inter_dim:
            raise ValueError(f"out must have shape (T * topk = {tokens * topk}, >= inter_dim = {inter_dim}), got {tuple(out.shape)}")
        validate.no_self_overlap(out, "out")
        validate.no_overlap(out, "out", dict(x=x, w1=w1, w1_scale=w1_scale, sorted_ids=sorted_ids,
                                             sorted_weights=sorted_weights, sorted_expert_ids=sorted_expert_ids,
                                             num_valid_ids=num_valid_ids, bias=bias))
    validate.no_autograd("moe_gemm1_a16w4", dict(x=x, sorted_weights=sorted_weights, bias=bias, out=out))
    if bias is not None:
        validate.tensor(bias, "bias", ndim=2)
        validate.same_device("x", x, "bias", bias)
        validate.shape(bias, "bias", (experts, w_n))
        if bias.dtype not in BIAS_DTYPES or bias.stride(1) != 1 or not w_n <= bias.stride(0) < 1 << 31:
            bias = bias.to(torch.float32 if bias.dtype not in BIAS_DTYPES else bias.dtype).contiguous()
    sorted_ids, sorted_weights, sorted_expert_ids, num_valid_ids, w1, w1_scale = (
        t.contiguous() for t in (sorted_ids, sorted_weights, sorted_expert_ids, num_valid_ids, w1, w1_scale))
    if x.stride(1) != 1:
        x = x[:, :model_dim].contiguous()
    if out is not None and out.stride(1) != 1:
        result = out
        fresh = moe_gemm1_a16w4(x, w1, w1_scale, sorted_ids, sorted_weights, sorted_expert_ids, num_valid_ids, arch=arch,
                                topk=topk, block_m=block_m, out=out.contiguous(), bias=bias, activation=activation,
                                alpha=alpha, limit=limit, apply_weights=apply_weights, model_dim=model_dim,
                                inter_dim=inter_dim, tile_m=tile_m, tile_n=tile_n, waves=waves)
        return result.copy_(fresh)
    if out is None:
        out = torch.zeros(tokens * topk, inter_dim, dtype=torch.bfloat16, device=x.device)
    x_row_bytes, out_token_bytes = x.stride(0) * 2, topk * out.stride(0) * 2
    out_span = (topk, out.shape[1] * 2, out.stride(0) * 2)  # a2's rows of one token (token_windows)

    auto_m, auto_n = choose_config1(tokens, topk, experts, model_dim, inter_dim, arch)
    tile_m, tile_n = resolve_tiles(block_m, tile_m, tile_n, auto_m, auto_n)
    n_kt = k_iterations(model_dim)
    if waves is None:
        waves = default_waves(tile_m, tile_n, n_kt, 1, pair=True)
    if not validate.is_int(waves) or waves not in WAVE_COUNTS:
        raise ValueError(f"waves must be one of {WAVE_COUNTS}, got {waves!r}")
    wn, wk, windows = launch_geometry(1, x, 1, model_dim, out_span, tile_m, tile_n, 1, waves, n_kt)
    cfg = Gemm2Config(
        arch=info.name, out_dtype=torch.bfloat16, tile_m=tile_m, tile_n=tile_n, k_batch=1, wn=wn, wk=wk,
        model_dim=2 * inter_dim, inter_dim=model_dim, w_n=w_n, w_k=w_k, a_stride=kernel_row_stride(x.stride(0)), topk=topk,
        block_m=block_m, apply_weights=bool(apply_weights), bias_dtype=None if bias is None else bias.dtype,
        stage=1, activation=activation, alpha=float(alpha), limit=float(limit), out_stride=kernel_row_stride(out.stride(0)),
        windowed=len(windows) > 1,
    )
    grid_m, compact = m_grid(tokens, topk, experts, rows, tile_m)
    if grid_m == 0:
        return out
    stream = toolchain.stream(x)
    with toolchain.target(info.name, x.device):
        for t0, n in windows:
            # the window's x rows and a2 rows start at 64-bit host-computed addresses
            x_bytes = ((n - 1) * x.stride(0) + x.shape[1]) * 2
            out_bytes = ((n * topk - 1) * out.stride(0) + out.shape[1]) * 2
            _cached_launcher(cfg)(
                x.data_ptr() + t0 * x_row_bytes, x_bytes, w1.data_ptr(), w1_scale.data_ptr(), sorted_ids.data_ptr(),
                sorted_weights.data_ptr(), sorted_expert_ids.data_ptr(), num_valid_ids.data_ptr(),
                out.data_ptr() + t0 * out_token_bytes, out_bytes, 0 if bias is None else bias.data_ptr(),
                0 if bias is None else bias.stride(0), n, rows, experts, grid_m, int(compact), t0, tokens, stream=stream,
            )
    return out
