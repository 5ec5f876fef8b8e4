"""MXFP8 quantize along a column dimension: 3D expert weights (E, N, K) along N, the 2D 32x1
orientation ((M, K) along M: E = 1, scales transposed) and the fused dual kernel (32x1 and 1x32
from one read of the tile).

Math (flyquant.reference.mxfp8_quantize_3d / mxfp8_quantize(axis=0) / mxfp8_quantize_dual,
bit-exact): blocks of 32 consecutive rows of one column (scale_block_k = 32: 32 rows x 32
columns), the scale rule and element conversion of _mx_common. Data out: per expert
column-major, element (n, k) at k * N + n (stride (N*K, 1, N); 32x1: (1, M)). Scales: 3D (E,
N/32, K) or (E, N/32, K/32); 32x1 (K, M/32); or a padded layout of the (K, N/32) matrix per expert.
The transposed 3D view (strides (N*K, 1, N)) is quantized along its contiguous dim: see
quantize_3d.

The kernel (work split, tails) is kernels/_mx_col.py's build_col (its row-major outputs:
kernels/_mx_col_rows.py); here its plan and the torch-facing launchers.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from flyquant import toolchain, validate
from flyquant.arch import arch_info

from . import _mx_common as mx
from ._mx_col import MAX_WAVES, _cached_col
from ._mx_col_rows import ROWS_PER_LANE, TILE_ROWS, rows_3d_t
from ._mx_common import MX_BLOCK, WAVE

MAX_LAUNCH_BYTES = mx.MAX_LAUNCH_BYTES  # per expert (data) and for the whole scale tensor
# Consecutive column tiles per wave: amortizes a wave's setup (~70 instructions, a fifth of a
# tile) while every 8 tiles of a row still start a new wave.
TILES_PER_WAVE = 8
TORCH_DTYPES = {torch.bfloat16: "bf16", torch.float16: "fp16", torch.float32: "fp32"}


@dataclass(frozen=True)
class ColPlan:
    tile_rows: int  # 128 (8 lane row groups) or 64 (4)
    tile_cols: int  # columns per tile: 128 bytes of a row per 8 lanes
    waves: int  # waves per workgroup
    tiles_per_wave: int  # consecutive column tiles per wave
    grid: tuple  # (column groups, row tiles, experts)


def plan_col(shape, dtype: torch.dtype, arch: str, block_k: int = 1, kind: str = "3d") -> ColPlan:
    """Tile and work split for quantizing (E, N, K) along N (2D: E = 1) on `arch`.

    Tile rows: 128, or 64 for N = 64 (32 x 1 blocks, not dual), where a 128-row tile would
    leave half its lanes idle; for other N the 128-row tiles' full-line column stores win. A
    wave walks up to TILES_PER_WAVE consecutive column tiles of one row tile, workgroups of up
    to 4 waves. 3d_t: 64 (FP32: 32) rows x 128 columns (_mx_col_rows.rows_3d_t)."""
    e, n, k = shape
    arch_info(arch)
    elem_bytes = torch.empty((), dtype=dtype).element_size()
    rows = TILE_ROWS[1] if (n == TILE_ROWS[1] and block_k == 1 and kind != "dual") else TILE_ROWS[0]
    rows = rows_3d_t(elem_bytes) if kind == "3d_t" else rows
    width = (WAVE // (rows // ROWS_PER_LANE)) * (mx.PIECE_BYTES // elem_bytes)
    col_tiles, row_tiles = -(-k // width), -(-n // rows)
    tpw = max(1, min(TILES_PER_WAVE, col_tiles))
    waves = max(1, min(MAX_WAVES, -(-col_tiles // tpw)))
    return ColPlan(rows, width, waves, tpw, (-(-col_tiles // (waves * tpw)), row_tiles, e))


# ------------------------------------------------------------------------------------------------
# Torch-facing launchers
# ------------------------------------------------------------------------------------------------


def matrix_too_large(shape, dtype: torch.dtype) -> str | None:
    """Why the column kernel cannot take a tensor of `shape` ((E, N, K) or (N, K)): one expert's
    matrix of 2 GiB or more (its buffers use 32-bit byte offsets); None when it can."""
    n, k = shape[-2:]
    if n * k * torch.empty((), dtype=dtype).element_size() < MAX_LAUNCH_BYTES:
        return None
    return f"{tuple(shape)} {dtype}: the column kernel (32x1, dual, 3D) takes matrices below 2 GiB (32-bit buffer offsets)"


def launch_col(x, data, scales, *, arch, scaling_mode, kind, scale_layout, block_k=1, offs=None, dims=0,
               expert_bytes=0, rows_out=None, signed_zeros=True):
    """Launch the column kernel on contiguous x (E, N, K) (2D: (N, K), E = 1) into `data`
    (column-major per expert; 3d_t: row-major) and `scales` (uint8, laid out as the kind/layout
    says)."""
    e, n, k = x.shape if x.dim() == 3 else (1, *x.shape)
    dtype = TORCH_DTYPES[x.dtype]
    too_large = matrix_too_large(x.shape, x.dtype)
    if too_large or scales.numel() >= MAX_LAUNCH_BYTES:
        raise ValueError(too_large or f"{tuple(x.shape)}: the scales must stay below 2 GiB (32-bit buffer offsets)")
    cfg = plan_col((e, n, k), x.dtype, arch, block_k, kind)
    grouped = offs is not None
    width = cfg.tile_cols
    groups = offs.numel() if grouped else 0
    offs_arg = offs if grouped else torch.zeros(1, dtype=torch.int32, device=x.device)
    q1, s1 = rows_out if rows_out is not None else (offs_arg, offs_arg)  # dual: the 1x32 outputs
    with toolchain.target(arch, x.device):  # the launcher of x's GPU (toolchain.launcher_cache)
        launch = _cached_col(arch, dtype, scaling_mode, kind, scale_layout, block_k, grouped, cfg.waves, cfg.tile_rows,
                             signed_zeros)
        launch(
            x, data.view(torch.uint8), scales, q1, s1, offs_arg, n, k, k * x.element_size(), cfg.tiles_per_wave,
            -(-k // width), n // MX_BLOCK, dims, expert_bytes, scales.numel(), groups, groups.bit_length(),
            *cfg.grid, stream=toolchain.stream(x),
        )


def quantize_3d(w: torch.Tensor, *, arch: str, scaling_mode: str = "rceil", scale_block_k: int = 1, scale_layout=None,
                signed_zeros: bool = True):
    """MXFP8 quantize of expert weights (E, N, K) along N on `arch`, as
    flyquant.reference.mxfp8_quantize_3d: data (E, N, K) float8_e4m3fn with stride (N*K, 1, N);
    scales float8_e8m0fnu (E, N/32, K) (scale_block_k=32: (E, N/32, K/32)), or per expert the
    "tcgen05" (flat) / "mfma" layout of the (K, N/32) matrix, zero padded.

    w contiguous: the column kernel. w the transpose of a contiguous (E, K, N) tensor x (strides
    (N*K, 1, N)): N is contiguous, read in place, and x's row-major layout is the data's (N*K, 1,
    N). scale_block_k=1: the 1x32 kernel on x's (E*K, N) rows, whose (E*K, N/32) scales are the
    per-expert (K, N/32) matrices the layouts start from (_transposed_3d). scale_block_k=32: the
    column kernel's 3d_t variant on x (a 32 x 32 block of w is one of x; data stored row-major,
    codes at their places in w's scales). signed_zeros=False: zeros +0 (validate.SIGNED_ZEROS_DOC)."""
    validate.high_precision(w, "w", ndim=3)
    validate.scaling_mode(scaling_mode)
    validate.scale_layout(scale_layout)
    if scale_block_k not in (1, MX_BLOCK):
        raise ValueError(f"scale_block_k must be 1 or {MX_BLOCK}, got {scale_block_k!r}")
    validate.block_dim(w, 1, "w", "N")
    if scale_block_k == MX_BLOCK:
        validate.block_dim(w, 2, "w", "K", block=scale_block_k)
    transposed = validate.mxfp8_3d_transposed(w)
    if transposed and scale_block_k == 1:
        return _transposed_3d(w, arch, scaling_mode, scale_layout, signed_zeros)
    e, n, k = w.shape
    data = torch.empty_strided((e, n, k), (n * k, 1, n), dtype=torch.float8_e4m3fn, device=w.device)
    nb = n // MX_BLOCK
    if scale_layout is None:
        scales = torch.empty((e, nb, k // scale_block_k), dtype=torch.uint8, device=w.device)
        dims = expert_bytes = 0
    else:
        prows, pcols = mx.scale_layout_shape(k, nb, scale_layout)
        shape = (e, prows * pcols) if scale_layout == "tcgen05" else (e, prows, pcols)
        scales = mx.scale_tensor(shape, (prows, pcols) != (k, nb), w.device)
        dims, expert_bytes = mx.layout_dims(scale_layout, pcols), prows * pcols
    x, kind = (w.transpose(1, 2), "3d_t") if transposed else (w, "3d")
    launch_col(x, data, scales, arch=arch, scaling_mode=scaling_mode, kind=kind, scale_layout=scale_layout,
               block_k=scale_block_k, dims=dims, expert_bytes=expert_bytes, signed_zeros=signed_zeros)
    return data, scales.view(torch.float8_e8m0fnu)


def transposed_layout_direct(e: int, k: int, scale_layout) -> bool:
    """Whether the 1x32 kernel writes a transposed 3D w's scale layout itself (_transposed_3d): K
    fills whole layout row tiles (and there are rows)."""
    row_tile = {None: 1, "tcgen05": mx.TCGEN05_TILE_ROWS, "mfma": mx.MFMA_ROW_PAD}[scale_layout]
    return k % row_tile == 0 and e * k > 0


def _transposed_3d(w, arch, scaling_mode, scale_layout, signed_zeros):
    """quantize_3d of w (E, N, K) with strides (N*K, 1, N), through the 1x32 kernel on the
    contiguous (E*K, N) matrix w.transpose(1, 2) is. Plain scales (E, N/32, K) are the transpose
    of its (E, K, N/32) scales, made contiguous like those of a contiguous w (one pass over the
    scales, 1/32 of the data; the input is never copied). A layout of the per-expert (K, N/32) matrices is the 1x32
    kernel's own layout of the (E*K, N/32) matrix when K fills whole layout row tiles (128 rows
    for tcgen05, 256 for mfma: each expert then owns its tiles, as models' K do); otherwise the
    plain scales are laid out per expert afterwards (flyquant.reference's layout, torch ops on
    the scales, 1/32 of the data)."""
    from flyquant import reference
    from .mxfp8_quantize_2d import quantize_1x32

    e, n, k = w.shape
    rows = w.transpose(1, 2).reshape(e * k, n)  # a view: w's storage, row-major
    direct = transposed_layout_direct(e, k, scale_layout)
    data, scales = quantize_1x32(rows, arch=arch, scaling_mode=scaling_mode,
                                 scale_layout=scale_layout if direct else None, signed_zeros=signed_zeros)
    data = data.view(e, k, n).transpose(1, 2)
    if scale_layout is None:
        return data, scales.view(e, k, n // MX_BLOCK).transpose(1, 2).contiguous()
    if direct:
        per_expert = scales.numel() // e
        if scale_layout == "tcgen05":
            return data, scales.reshape(e, per_expert)
        return data, scales.reshape(e, per_expert // scales.shape[1], scales.shape[1])
    plain = scales.view(e, k, n // MX_BLOCK).transpose(1, 2)
    return data, reference._layout_scales_3d(plain, 1, scale_layout)
