"""Pure-PyTorch reference for every flyquant op: the numerical contract the kernels match.

MXFP8 quantize ops follow torchao main's MXFP8 bitwise contract (pytorch/ao PR 4725; formats.py
states it): E8M0 code 0 is 2^-127 and used, rceil rounds amax * fl32(1/448) up from its FP32
bits, floor takes amax's FP32 exponent, a NaN/Inf block is scale 0xFF with NaN elements. They
equal torchao 0.18's to_mx except on the blocks listed in tests/test_reference_mxfp8.py
(DIFFERS_FROM_018). MXFP4 follows the same contract with E2M1's constants and the extra mode
"even" (formats.py; tests/test_reference_mxfp4.py lists where 0.18 differs). Everything runs on any device;
nothing here imports a kernel.

Layouts (DESIGN.md):
- 1x32 (axis=-1): data (M, K) row-major, scales (M, K/32).
- 32x1 (axis=0): data (M, K) column-major (stride (1, M)), scales (K, M/32).
- 3D (E, N, K) along N: data column-major per expert (stride (N*K, 1, N)), scales (E, N/32, K),
  or (E, N/32, K/32) with 32x32 scale blocks.
- scale_layout "tcgen05": torchao's blocked layout with the shapes torchao 0.18 returns:
  1x32 (ceil(M/128)*128, ceil(K/32/4)*4); 32x1 flat (ceil(K/128)*128 * ceil(M/32/4)*4,);
  3D (E, ceil(K/128)*128 * ceil(N/32/4)*4) blocked per expert from the (K, N/32) transpose.
- scale_layout "mfma": aiter's e8m0_shuffle of the (non-reduced, reduced/32) matrix, rows padded
  to 256 and columns to 8 with zeros: 1x32 of (M, K/32); 32x1 of (K, M/32); 3D per expert of
  (K, N/32), shape (E, ceil(K/256)*256, ceil(N/32/8)*8).
  With 32x32 blocks both layouts first repeat each scale over its 32 K rows (as torchao does for
  tcgen05), since a GEMM consumer reads one scale per (K row, 32 N).
"""

from __future__ import annotations

import math
from typing import Optional

import torch

from . import formats, layouts, validate
from .formats import E2M1, E4M3, MX_BLOCK
from .layouts import gate_up_rows_from_interleaved, shuffle_scale_a16w4, shuffle_weight_a16w4  # noqa: F401  (reference names)
from .moe import moe_sorting  # noqa: F401  (reference name)

MXFP8_DTYPE = torch.float8_e4m3fn
SCALE_DTYPE = torch.float8_e8m0fnu
SCALE_BLOCK_K_CHOICES = (1, MX_BLOCK)


def _ceil_to(n: int, m: int) -> int:
    return (n + m - 1) // m * m


def _quantize_rows(x: torch.Tensor, scaling_mode: str, fmt=E4M3) -> tuple[torch.Tensor, torch.Tensor]:
    """Blocks of 32 along the last dim of x (..., K) -> (element bytes (..., K) uint8, codes (..., K/32))."""
    *lead, k = x.shape
    codes, elems = formats.mx_quantize_blocks(x.reshape(*lead, k // MX_BLOCK, MX_BLOCK), scaling_mode, fmt)
    return elems.reshape(*lead, k), codes


def _layout_scales_2d(scales: torch.Tensor, scale_layout: Optional[str], flat: bool) -> torch.Tensor:
    """Plain (rows, cols) scales -> the requested layout; `flat`: tcgen05 result stays 1D (32x1)."""
    if scale_layout == "mfma":
        return layouts.mfma_shuffle_scales(scales)
    if scale_layout == "tcgen05":
        blocked = layouts.tcgen05_blocked(scales)
        if flat:
            return blocked
        return blocked.view(_scale_shape_2d(*scales.shape, scale_layout, flat=False))
    return scales


def _scale_shape_2d(rows: int, cols: int, scale_layout: Optional[str], flat: bool) -> tuple:
    if scale_layout == "mfma":
        return layouts.mfma_scales_shape(rows, cols)
    if scale_layout == "tcgen05":
        shape = (_ceil_to(rows, layouts.TCGEN05_TILE_ROWS), _ceil_to(cols, layouts.TCGEN05_TILE_COLS))
        return (shape[0] * shape[1],) if flat else shape
    return (rows, cols)


def check_mxfp8_2d(x, axis, scaling_mode, scale_layout, offs) -> int:
    axis = validate.mxfp8_2d_axis(x, axis)
    validate.scaling_mode(scaling_mode)
    validate.scale_layout(scale_layout)
    if axis == 1:
        validate.block_dim(x, 1, "x", "K")
    else:
        validate.block_dim(x, 0, "x", "M")
    if offs is not None:
        validate.offs(offs, x, x.shape[0])
    validate.contiguous(x, "x")  # the kernels' layout; refused on every backend alike
    return axis


def mxfp8_quantize(x, axis=-1, scaling_mode="rceil", scale_layout=None, offs=None):
    """MXFP8-quantize a 2D (M, K) BF16/FP16/FP32 tensor in blocks of 32 along `axis`.

    axis=-1 (1x32): data (M, K) row-major, scales (M, K/32). axis=0 (32x1): data (M, K) with
    stride (1, M), scales (K, M/32). Returns (float8_e4m3fn data, float8_e8m0fnu scales).
    offs: int32 token-group end offsets along M (torchao's contract, validated: non-decreasing,
    last == M, group sizes multiples of 128). Blocks never straddle such groups, so offs changes
    only the tcgen05 layout of 32x1 scales, which is then laid out per group (torchao's
    torch_to_blocked_2d_K_groups on the (K, M/32) scales); for 1x32 the per-group layout
    (torch_to_blocked_2d_M_groups) equals the global one.
    """
    axis = check_mxfp8_2d(x, axis, scaling_mode, scale_layout, offs)
    if axis == 1:
        data, scales = _quantize_rows(x, scaling_mode)
        data = data.view(MXFP8_DTYPE)
        return data, _layout_scales_2d(scales.view(SCALE_DTYPE), scale_layout, flat=False)
    data_t, scales = _quantize_rows(x.t(), scaling_mode)  # (K, M), (K, M/32)
    data = data_t.view(MXFP8_DTYPE).t()  # (M, K), stride (1, M)
    scales = scales.view(SCALE_DTYPE)
    if scale_layout == "tcgen05" and offs is not None:
        return data, layouts.tcgen05_blocked_col_groups(scales, offs.to("cpu", torch.int64) // MX_BLOCK)
    return data, _layout_scales_2d(scales, scale_layout, flat=True)


def mxfp8_quantize_empty(x, axis=-1, scale_layout=None, offs=None):
    """Uninitialised outputs with the shapes, strides and dtypes of mxfp8_quantize (for fake
    tensor implementations)."""
    axis = validate.mxfp8_2d_axis(x, axis)
    m, k = x.shape
    if axis == 1:
        data = torch.empty((m, k), dtype=MXFP8_DTYPE, device=x.device)
        shape = _scale_shape_2d(m, k // MX_BLOCK, scale_layout, flat=False)
    else:
        data = torch.empty_strided((m, k), (1, m), dtype=MXFP8_DTYPE, device=x.device)
        shape = _scale_shape_2d(k, m // MX_BLOCK, scale_layout, flat=True)
    return data, torch.empty(shape, dtype=SCALE_DTYPE, device=x.device)


def mxfp8_quantize_dual(x, scaling_mode="rceil"):
    """Both orientations of a 2D tensor: ((data_1x32, scales_1x32), (data_32x1, scales_32x1)),
    plain scale layouts; M and K must both be multiples of 32."""
    check_mxfp8_dual(x, scaling_mode)
    return mxfp8_quantize(x, -1, scaling_mode), mxfp8_quantize(x, 0, scaling_mode)


def check_mxfp8_dual(x, scaling_mode):
    validate.high_precision(x, "x", ndim=2)
    validate.scaling_mode(scaling_mode)
    validate.block_dim(x, 1, "x", "K")
    validate.block_dim(x, 0, "x", "M")
    validate.contiguous(x, "x")


def check_mxfp8_3d(w, scaling_mode, scale_block_k, scale_layout):
    validate.high_precision(w, "w", ndim=3)
    validate.scaling_mode(scaling_mode)
    validate.scale_layout(scale_layout)
    if scale_block_k not in SCALE_BLOCK_K_CHOICES:
        raise ValueError(f"scale_block_k must be one of {SCALE_BLOCK_K_CHOICES}, got {scale_block_k!r}")
    validate.block_dim(w, 1, "w", "N")
    if scale_block_k == MX_BLOCK:
        validate.block_dim(w, 2, "w", "K", block=scale_block_k)
    return validate.mxfp8_3d_transposed(w)  # refused alike on every backend


def _layout_scales_3d(scales: torch.Tensor, scale_block_k: int, scale_layout: Optional[str]) -> torch.Tensor:
    """Plain (E, N/32, K or K/32) -> per-expert layouts of the (K, N/32) transpose."""
    if scale_layout is None:
        return scales
    per_k_row = scales.transpose(1, 2)  # (E, K or K/32, N/32)
    if scale_block_k != 1:
        per_k_row = per_k_row.repeat_interleave(scale_block_k, dim=1)
    if per_k_row.shape[0] == 0:  # no experts: the layout's per-expert shape, 0 of them
        shape = _scale_shape_2d(*per_k_row.shape[1:], scale_layout, flat=scale_layout == "tcgen05")
        return scales.new_empty((0, *shape))
    if scale_layout == "tcgen05":
        return torch.stack([layouts.tcgen05_blocked(s) for s in per_k_row])
    return torch.stack([layouts.mfma_shuffle_scales(s) for s in per_k_row])


def mxfp8_quantize_3d(w, scaling_mode="rceil", scale_block_k=1, scale_layout=None):
    """MXFP8-quantize expert weights (E, N, K) along N.

    scale_block_k=1: one scale per 32 (N) x 1 (K), scales (E, N/32, K). scale_block_k=32: one per
    32 x 32 tile (the amax over the 1024 values), scales (E, N/32, K/32). Data (E, N, K) with
    stride (N*K, 1, N) (column-major per expert). Layouts: see the module docstring.

    w is contiguous, or the transpose of a contiguous (E, K, N) tensor, strides (N*K, 1, N), as
    torchao's MXFP8 grouped GEMM passes its expert weights: quantized along the contiguous dim
    (scale_block_k=1: no copy of w). The outputs are those of w.contiguous(), strides included
    (torchao main's test_cuda_mx_3d_cutedsl_numerics, variants 32x1_t and 32x32_t: the same data
    strides).
    """
    check_mxfp8_3d(w, scaling_mode, scale_block_k, scale_layout)
    e, n, k = w.shape
    if scale_block_k == 1:
        data_t, scales_t = _quantize_rows(w.transpose(1, 2), scaling_mode)  # (E, K, N), (E, K, N/32)
        data = data_t.transpose(1, 2)
        scales = scales_t.transpose(1, 2).contiguous()
    else:
        nb, kb = n // MX_BLOCK, k // MX_BLOCK
        tiles = w.reshape(e, nb, MX_BLOCK, kb, MX_BLOCK).permute(0, 1, 3, 2, 4)  # (E, N/32, K/32, 32n, 32k)
        scales, elems = formats.mx_quantize_blocks(tiles.reshape(e, nb, kb, MX_BLOCK * MX_BLOCK), scaling_mode, E4M3)
        elems = elems.view(e, nb, kb, MX_BLOCK, MX_BLOCK).permute(0, 1, 3, 2, 4).reshape(e, n, k)
        data = elems.transpose(1, 2).contiguous().transpose(1, 2)
    scales = scales.view(SCALE_DTYPE)
    return data.view(MXFP8_DTYPE), _layout_scales_3d(scales, scale_block_k, scale_layout)


def mxfp8_quantize_3d_empty(w, scale_block_k=1, scale_layout=None):
    """Uninitialised outputs with the shapes, strides and dtypes of mxfp8_quantize_3d."""
    e, n, k = w.shape
    data = torch.empty_strided((e, n, k), (n * k, 1, n), dtype=MXFP8_DTYPE, device=w.device)
    if scale_layout is None:
        shape = (e, n // MX_BLOCK, k // scale_block_k)
    else:
        shape = (e,) + _scale_shape_2d(k, n // MX_BLOCK, scale_layout, flat=scale_layout == "tcgen05")
    return data, torch.empty(shape, dtype=SCALE_DTYPE, device=w.device)


def mxfp4_blocks(n: int) -> int:
    """Blocks of 32 covering n elements (a trailing partial block counts as a whole one)."""
    return -(-n // MX_BLOCK)


def mxfp4_quantize(x, axis=-1, scaling_mode="floor", scale_layout=None, shuffle=None):
    """MXFP4-quantize x (..., K) BF16/FP16/FP32, leading dims flattened to M rows (a 1-D x is one
    row), in blocks of 32 along `axis`:

    - axis=-1 (rowwise): data (M, ceil(K/32) * 16) uint8, scales (M, ceil(K/32)).
    - axis=0 (columnwise, cast-transpose): x^T quantized along M: data (K, ceil(M/32) * 16),
      scales (K, ceil(M/32)).

    Data: packed E2M1, element 2i in the low nibble. Scales: float8_e8m0fnu. scaling_mode "floor",
    "rceil" or "even" (formats' module docstring: torchao main's contract with E2M1's constants).
    A trailing partial block is quantized as if zero-padded to 32 elements; its padding nibbles are
    0, also in a NaN/Inf block (whose other nibbles are E2M1_NAN_BLOCK_CODE, scale 0xFF).
    Zero-size x gives empty outputs of these shapes.

    Rowwise only: scale_layout="mfma" returns layouts.mfma_shuffle_scales(scales) (aiter's
    e8m0_shuffle, (ceil(M/256)*256, ceil(ceil(K/32)/8)*8), padding 0); shuffle="a4w4" returns
    layouts.shuffle_weight_a4w4(data) (aiter's shuffle_weight(data, layout=(16, 16)); M % 16 == 0,
    K % 64 == 0).
    """
    axis = validate.mxfp4_quantize_args(x, axis, scaling_mode, scale_layout, shuffle)
    x2 = x.reshape(math.prod(x.shape[:-1]), x.shape[-1])
    rows = x2 if axis == -1 else x2.t()
    n = rows.shape[1]
    padded = torch.nn.functional.pad(rows, (0, mxfp4_blocks(n) * MX_BLOCK - n))
    codes, scales = _quantize_rows(padded, scaling_mode, E2M1)
    codes[:, n:] = 0
    data = formats.pack_fp4(codes)
    if shuffle == "a4w4" and data.numel():
        data = layouts.shuffle_weight_a4w4(data)
    return data, _layout_scales_2d(scales.view(SCALE_DTYPE), scale_layout, flat=False)


def mxfp4_quantize_empty(x, axis=-1, scale_layout=None):
    """Uninitialised outputs with the shapes and dtypes of mxfp4_quantize (fake tensors)."""
    m, k = math.prod(x.shape[:-1]), x.shape[-1]
    rows, n = (m, k) if axis == -1 else (k, m)
    nb = mxfp4_blocks(n)
    return (torch.empty((rows, nb * MX_BLOCK // 2), dtype=torch.uint8, device=x.device),
            torch.empty(_scale_shape_2d(rows, nb, scale_layout, flat=False), dtype=SCALE_DTYPE, device=x.device))


def mxfp4_quantize_dual(x, scaling_mode="floor"):
    """Both orientations of mxfp4_quantize: ((rowwise data, scales), (columnwise data, scales))."""
    validate.mxfp4_quantize_args(x, -1, scaling_mode, None, None)
    return mxfp4_quantize(x, -1, scaling_mode), mxfp4_quantize(x, 0, scaling_mode)


def quantize_mxfp4(w, scaling_mode="floor"):
    """The weight-oriented name of mxfp4_quantize(w, axis=-1): (..., K) -> (uint8 (..., ceil(K/32)
    * 16), float8_e8m0fnu (..., ceil(K/32))), w's leading dims kept."""
    validate.mxfp4_quantize_args(w, -1, scaling_mode, None, None, name="w")
    return weight_shaped(w, *mxfp4_quantize(w, -1, scaling_mode))


MXFP4_3D_SHUFFLES = (None, "a16w4")


def check_mxfp4_3d(w, scaling_mode, shuffle, gate_up) -> None:
    """mxfp4_quantize_3d's checks (both backends): w (E, N, K) BF16/FP16/FP32 contiguous; shuffle
    None or "a16w4" (then N % 32 == 0 and K % 256 == 0: the layouts' tiles); gate_up a bool, only
    with the shuffle."""
    validate.high_precision(w, "w", ndim=3)
    validate.mxfp4_quantize_args(w, -1, scaling_mode, None, None, name="w")
    if shuffle not in MXFP4_3D_SHUFFLES:
        raise ValueError(f"shuffle must be one of {MXFP4_3D_SHUFFLES}, got {shuffle!r}")
    if not isinstance(gate_up, bool):
        raise ValueError(f"gate_up must be a bool, got {gate_up!r}")
    if gate_up and shuffle is None:
        raise ValueError("gate_up=True describes the a16w4 shuffle's row order: pass shuffle='a16w4'")
    if shuffle:
        validate.multiple_of(w.shape[1], layouts.A16W4_SCALE_ROWS, "w.shape[1] (N, rows per expert, for the a16w4 shuffle)")
        validate.multiple_of(w.shape[2], MX_BLOCK * layouts.A16W4_SCALE_COLS, "w.shape[2] (K, for the a16w4 shuffle)")


def mxfp4_quantize_3d(w, scaling_mode="floor", shuffle=None, gate_up=False):
    """MXFP4-quantize expert weights w (E, N, K) along K: (uint8 (E, N, ceil(K/32) * 16),
    float8_e8m0fnu (E, N, ceil(K/32))), quantize_mxfp4's bytes; shuffle="a16w4": those bytes
    permuted by shuffle_weight_a16w4(data, 16, gate_up) and shuffle_scale_a16w4(scales, E,
    gate_up) (aiter's layouts for its A16W4 MoE; same shapes)."""
    check_mxfp4_3d(w, scaling_mode, shuffle, gate_up)
    packed, scales = quantize_mxfp4(w, scaling_mode)
    if shuffle:
        return layouts.shuffle_weight_a16w4(packed, 16, gate_up), layouts.shuffle_scale_a16w4(scales, w.shape[0], gate_up)
    return packed, scales


def weight_shaped(w, packed, scales):
    """Rowwise (M, .) outputs viewed with w's leading dims (quantize_mxfp4's shapes)."""
    lead = tuple(w.shape[:-1])
    return packed.view(*lead, packed.shape[-1]), scales.view(*lead, scales.shape[-1])


def _check_scales(scales, name="scales"):
    validate.tensor(scales, name, (SCALE_DTYPE, torch.uint8))


def dequantize_mxfp4(packed, scales):
    """(..., K/2) packed E2M1 + (..., K/32) E8M0 -> FP32 (..., K) = value * 2^(code - 127)
    (code 0 is 2^-127, 0xFF is NaN)."""
    validate.tensor(packed, "packed", (torch.uint8, torch.float4_e2m1fn_x2))
    _check_scales(scales)
    k = packed.shape[-1] * 2
    if packed.dim() < 1 or packed.shape[-1] % (MX_BLOCK // 2):
        raise ValueError(f"packed.shape[-1] (K/2) must be a multiple of {MX_BLOCK // 2} (whole blocks), got shape {tuple(packed.shape)}")
    validate.shape(scales, "scales", tuple(packed.shape[:-1]) + (k // MX_BLOCK,))
    values = formats.e2m1_decode(formats.unpack_fp4(packed))
    s = formats.e8m0_decode(scales)
    return (values.view(*s.shape, MX_BLOCK) * s.unsqueeze(-1)).view(*packed.shape[:-1], k)


def _check_orientation(data, strides, axis, quantize) -> None:
    """The data's strides are those `quantize` gives for `axis` (dims of size 1 aside): on a
    square matrix the strides are all that tells a 1x32 result from a 32x1 one."""
    if any(n > 1 and st != want for n, st, want in zip(data.shape, data.stride(), strides)):
        raise ValueError(
            f"data with axis={axis} must have the strides {quantize} returns, {strides} for shape "
            f"{tuple(data.shape)}; got {data.stride()} (the other orientation's output? pass its axis)")


def mxfp8_dequantize(data, scales, axis=-1):
    """MXFP8 data + plain-layout scales -> FP32 with data's shape (row-major).

    2D axis=-1: data row-major, scales (M, K/32). 2D axis=0: data stride (1, M), scales (K,
    M/32). 3D (E, N, K) data stride (N*K, 1, N), axis=1 (or -2): scales (E, N/32, K), or (E,
    N/32, K/32) for 32x32 blocks. The data's strides must be the quantize output's for that axis.
    """
    validate.tensor(data, "data", (MXFP8_DTYPE, torch.uint8), ndim=(2, 3))
    _check_scales(scales)
    values = data.view(MXFP8_DTYPE).to(torch.float32)
    s = formats.e8m0_decode(scales)
    if data.dim() == 2:
        m, k = data.shape
        if axis in (-1, 1):
            validate.block_dim(data, 1, "data", "K")
            validate.shape(scales, "scales", (m, k // MX_BLOCK))
            _check_orientation(data, (k, 1), axis, "mxfp8_quantize(x, axis=-1)")
            return (values.view(m, k // MX_BLOCK, MX_BLOCK) * s.unsqueeze(-1)).view(m, k)
        if axis in (0, -2):
            validate.block_dim(data, 0, "data", "M")
            validate.shape(scales, "scales", (k, m // MX_BLOCK))
            _check_orientation(data, (1, m), axis, "mxfp8_quantize(x, axis=0)")
            per_elem = s.repeat_interleave(MX_BLOCK, dim=1)  # (K, M)
            return (values * per_elem.t()).contiguous()
        raise ValueError(f"axis must be -1 or 0 for 2D data, got {axis!r}")
    if axis not in (1, -2):
        raise ValueError(f"axis must be 1 (N) for 3D (E, N, K) data, got {axis!r}")
    e, n, k = data.shape
    validate.block_dim(data, 1, "data", "N")
    _check_orientation(data, (n * k, 1, n), axis, "mxfp8_quantize_3d")
    if tuple(scales.shape) == (e, n // MX_BLOCK, k):
        per_elem = s.repeat_interleave(MX_BLOCK, dim=1)
    else:
        validate.shape(scales, "scales", (e, n // MX_BLOCK, k // MX_BLOCK))
        per_elem = s.repeat_interleave(MX_BLOCK, dim=1).repeat_interleave(MX_BLOCK, dim=2)
    return (values * per_elem).contiguous()


# ------------------------------------------------------------------------------------------------
# A16W4 MoE stage 2 (down projection)
# ------------------------------------------------------------------------------------------------


def check_moe_gemm2(a2, w2, w2_scale, sorted_ids, sorted_weights, sorted_expert_ids, num_valid_ids, topk, block_m):
    validate.high_precision(a2, "a2", ndim=2)
    validate.tensor(w2, "w2", (torch.uint8, torch.float4_e2m1fn_x2), ndim=3)
    validate.tensor(w2_scale, "w2_scale", (SCALE_DTYPE, torch.uint8), ndim=(2, 3))
    validate.tensor(sorted_ids, "sorted_ids", (torch.int32,), ndim=1)
    validate.tensor(sorted_weights, "sorted_weights", (torch.float32,), ndim=1)
    validate.tensor(sorted_expert_ids, "sorted_expert_ids", (torch.int32,), ndim=1)
    validate.tensor(num_valid_ids, "num_valid_ids", (torch.int32,), ndim=1)
    for name, t in (("w2", w2), ("w2_scale", w2_scale), ("sorted_ids", sorted_ids), ("sorted_weights", sorted_weights),
                    ("sorted_expert_ids", sorted_expert_ids), ("num_valid_ids", num_valid_ids)):
        validate.same_device("a2", a2, name, t)
    _check_sorted_args(topk, block_m, sorted_ids, sorted_weights, sorted_expert_ids)
    if a2.shape[0] % topk:  # 0 rows (an expert-parallel rank with no tokens) is an empty batch
        raise ValueError(f"a2.shape[0] (tokens * topk rows) = {a2.shape[0]} must be a multiple of topk = {topk}")
    experts, n_pad, k_half = w2.shape
    expected = (experts, n_pad, 2 * k_half // MX_BLOCK)
    if w2_scale.dim() == 2:
        expected = (experts * n_pad, expected[2])
    validate.shape(w2_scale, "w2_scale", expected)


MOE_TOKEN_BITS = 24  # sorted id = (slot << 24) | token
MOE_TOKEN_MASK = (1 << MOE_TOKEN_BITS) - 1
OUT_ALIGN_BYTES = 4  # the kernel adds bf16 column pairs with packed 4-byte atomics


def check_moe_gemm2_call(a2, w2, w2_scale, sorted_ids, sorted_weights, sorted_expert_ids, num_valid_ids, topk,
                         block_m, out=None, bias=None, model_dim=None, inter_dim=None) -> tuple[int, int, int]:
    """Everything both backends check before running the stage-2 GEMM (so they accept and refuse
    the same calls): types, shapes, devices, the true sizes, bias (E, >= model_dim), out (T,
    model_dim), no input requiring grad. Reads no tensor's values nor addresses (no host
    synchronisation; torch.compile traces it); check_moe_gemm2_memory is the part on addresses.
    Returns (model_dim, inter_dim, tokens)."""
    check_moe_gemm2(a2, w2, w2_scale, sorted_ids, sorted_weights, sorted_expert_ids, num_valid_ids, topk, block_m)
    model_dim, inter_dim = moe_true_dims(a2, w2, model_dim, inter_dim)
    experts = w2.shape[0]
    tokens = a2.shape[0] // topk
    if bias is not None:
        validate.high_precision(bias, "bias", ndim=2)
        validate.same_device("a2", a2, "bias", bias)
        if bias.shape[0] != experts or bias.shape[1] < model_dim:
            raise ValueError(f"bias must have shape (E = {experts}, >= model_dim = {model_dim}), got {tuple(bias.shape)}")
    if out is not None:
        validate.tensor(out, "out", (torch.bfloat16, torch.float32), ndim=2)
        validate.same_device("a2", a2, "out", out)
        validate.shape(out, "out", (tokens, model_dim))
    validate.no_autograd("moe_gemm2_a16w4", dict(a2=a2, sorted_weights=sorted_weights, bias=bias, out=out))
    return model_dim, inter_dim, tokens


def check_moe_gemm2_memory(out, a2, w2, w2_scale, sorted_ids, sorted_weights, sorted_expert_ids, num_valid_ids,
                           bias=None) -> None:
    """The checks on addresses, made on real tensors (inside the op, not while tracing): out is
    4-byte aligned (the kernel adds bf16 column pairs with 4-byte atomics; both backends refuse
    alike) and shares no memory with any input."""
    if out.data_ptr() % OUT_ALIGN_BYTES:
        raise ValueError(f"out must start at a {OUT_ALIGN_BYTES}-byte aligned address (a bf16 out at an even "
                         f"element offset): results are added as bf16 pairs; got address {out.data_ptr():#x}")
    validate.no_overlap(out, "out", dict(a2=a2, w2=w2, w2_scale=w2_scale, sorted_ids=sorted_ids,
                                         sorted_weights=sorted_weights, sorted_expert_ids=sorted_expert_ids,
                                         num_valid_ids=num_valid_ids, bias=bias))


def check_moe_gemm2_values(sorted_ids, sorted_expert_ids, num_valid_ids, topk, block_m, tokens, experts) -> None:
    """The checks that read the sorted arrays (a host synchronisation on a GPU): num_valid_ids[0]
    counts whole blocks (or all rows; negative: none), and every row in use (below it, token < T)
    has a slot below topk and lies in a block whose expert id is in [0, E). The device path drops
    such rows and blocks instead (checked with FLYQUANT_DEBUG=1; the rows of a partial block may
    be dropped too: the kernel counts whole tiles)."""
    used = max(0, min(int(num_valid_ids[0]), sorted_ids.shape[0]))
    if used % block_m and used < sorted_ids.shape[0]:
        raise ValueError(f"num_valid_ids[0] = {int(num_valid_ids[0])} must be a multiple of block_m = {block_m} "
                         f"(whole blocks, as moe_sorting gives), at least len(sorted_ids), or negative (no rows)")
    ids = sorted_ids[:used].to("cpu", torch.int64)
    live = (ids & MOE_TOKEN_MASK) < tokens
    slot = torch.bitwise_right_shift(ids, MOE_TOKEN_BITS)
    bad = live & ((slot < 0) | (slot >= topk))
    if bad.any():
        row = int(bad.nonzero()[0])
        raise ValueError(f"sorted_ids[{row}] = {int(ids[row]):#x} has slot {int(slot[row])}: a row in use (below "
                         f"num_valid_ids[0], token < T = {tokens}) must have a slot in [0, topk = {topk})")
    blocks = torch.unique(torch.arange(used)[live] // block_m)
    expert = sorted_expert_ids.to("cpu", torch.int64)[blocks]
    bad = (expert < 0) | (expert >= experts)
    if bad.any():
        block = int(blocks[bad.nonzero()[0]])
        raise ValueError(f"sorted_expert_ids[{block}] = {int(expert[bad][0])} must be in [0, E = w2.shape[0] = "
                         f"{experts}) (block {block} holds rows in use)")


def _check_sorted_args(topk, block_m, sorted_ids, sorted_weights, sorted_expert_ids) -> None:
    """topk and block_m positive ints; the sorted arrays' lengths agree with block_m (both stages)."""
    if not isinstance(topk, int) or topk <= 0:
        raise ValueError(f"topk must be a positive int, got {topk!r}")
    if not isinstance(block_m, int) or block_m <= 0:
        raise ValueError(f"block_m must be a positive int, got {block_m!r}")
    validate.shape(sorted_weights, "sorted_weights", tuple(sorted_ids.shape))
    blocks = (sorted_ids.shape[0] + block_m - 1) // block_m
    if sorted_expert_ids.shape[0] < blocks:
        raise ValueError(f"sorted_expert_ids must have ceil(len(sorted_ids) / block_m) = {blocks} entries, got {sorted_expert_ids.shape[0]}")


def moe_true_dims(a2, w2, model_dim=None, inter_dim=None) -> tuple[int, int]:
    """The true (model_dim, inter_dim): given, or the padded weights' N and a2's width."""
    _, n_pad, k_half = w2.shape
    model_dim = n_pad if model_dim is None else model_dim
    inter_dim = a2.shape[1] if inter_dim is None else inter_dim
    if not 0 < model_dim <= n_pad:
        raise ValueError(f"model_dim = {model_dim} must be in [1, w2.shape[1] = {n_pad}]")
    if not 0 < inter_dim <= min(2 * k_half, a2.shape[1]):
        raise ValueError(f"inter_dim = {inter_dim} must be in [1, min(K = 2 * w2.shape[2] = {2 * k_half}, a2.shape[1] = {a2.shape[1]})]")
    return model_dim, inter_dim


def moe_gemm2_a16w4(a2, w2, w2_scale, sorted_ids, sorted_weights, sorted_expert_ids, num_valid_ids, topk, block_m,
                    out=None, bias=None, apply_weights=True, out_dtype=torch.bfloat16, model_dim=None, inter_dim=None,
                    nlane=16):
    """FP32 reference of the A16W4 MoE down projection (aiter torch_moe_stage2, per_1x32 weights).

    out[t] (+)= sum over the pairs (t, slot) routed to expert e of
        w_(t,slot) * (a2[t * topk + slot, :inter_dim] @ W[e][:model_dim, :inter_dim]^T + bias[e])
    where W[e] = dequantize_mxfp4 of the unshuffled weights, w the sorted routing weight (1 when
    apply_weights is False). Computed in FP32, rounded once to the output dtype.

    a2: (T * topk, >= inter_dim) BF16/FP16/FP32, token-major stage-1 output. w2: (E, N, K/2)
    packed FP4 and w2_scale: (E*N, K/32) or (E, N, K/32) E8M0, both shuffled as the kernel takes
    them (shuffle_weight_a16w4 with `nlane`, shuffle_scale_a16w4; N, K may be padded beyond
    model_dim, inter_dim). sorted_*, num_valid_ids: moe_sorting's outputs for this block_m; only
    rows below num_valid_ids[0] whose token is < T count. bias: (E, >= model_dim). out: (T,
    model_dim), added into in its own dtype (out_dtype is then not used); None: a new out_dtype
    tensor. model_dim / inter_dim default to N and a2.shape[1].
    """
    model_dim, inter_dim, tokens = check_moe_gemm2_call(
        a2, w2, w2_scale, sorted_ids, sorted_weights, sorted_expert_ids, num_valid_ids, topk, block_m, out=out,
        bias=bias, model_dim=model_dim, inter_dim=inter_dim)
    if out is not None:
        check_moe_gemm2_memory(out, a2, w2, w2_scale, sorted_ids, sorted_weights, sorted_expert_ids, num_valid_ids,
                               bias)
    experts, n_pad, _ = w2.shape
    check_moe_gemm2_values(sorted_ids, sorted_expert_ids, num_valid_ids, topk, block_m, tokens, experts)

    w = layouts.unshuffle_weight_a16w4(w2, nlane)
    s = layouts.unshuffle_scale_a16w4(w2_scale, experts).reshape(experts, n_pad, -1)
    weight = dequantize_mxfp4(w, s)[:, :model_dim, :inter_dim]  # (E, model_dim, inter_dim) FP32

    rows = torch.arange(sorted_ids.shape[0], device=a2.device)
    token = sorted_ids & MOE_TOKEN_MASK
    slot = torch.bitwise_right_shift(sorted_ids, MOE_TOKEN_BITS)
    valid = (rows < num_valid_ids[0]) & (token < tokens)
    expert = sorted_expert_ids[rows // block_m]
    acc = torch.zeros(tokens, model_dim, dtype=torch.float32, device=a2.device)
    for e in torch.unique(expert[valid]).tolist():
        sel = valid & (expert == e)
        t, k = token[sel].long(), slot[sel].long()
        y = a2[t * topk + k, :inter_dim].to(torch.float32) @ weight[e].t()
        if bias is not None:
            y = y + bias[e, :model_dim].to(torch.float32)
        if apply_weights:
            y = y * sorted_weights[sel].unsqueeze(1)
        acc.index_add_(0, t, y)
    if out is None:
        return acc.to(out_dtype)
    out.copy_(out.to(torch.float32) + acc)
    return out


# ------------------------------------------------------------------------------------------------
# A16W4 MoE stage 1: gate/up projection with the activation fused
# ------------------------------------------------------------------------------------------------

MOE_ACTIVATIONS = ("silu", "gelu", "swiglu_oai")
GELU_TANH_C = 0.7978845608028654  # sqrt(2 / pi)
GELU_TANH_CUBIC = 0.044715


def moe_activation(g: torch.Tensor, u: torch.Tensor, activation: str, alpha: float = 1.702, limit: float = 7.0):
    """act(gate, up) in the tensors' dtype (the contract: FP32), elementwise:

    - "silu":  silu(g) * u = g * sigmoid(g) * u (the SwiGLU of Mixtral / DeepSeek / Qwen MoE).
    - "gelu":  gelu_tanh(g) * u, gelu_tanh(g) = g/2 * (1 + tanh(sqrt(2/pi) * (g + 0.044715 g^3))).
    - "swiglu_oai" (GPT-OSS): g' = min(g, limit), u' = clamp(u, -limit, limit),
      (u' + 1) * g' * sigmoid(alpha * g'). This is what transformers' GPT-OSS experts compute in
      `_apply_gate` (there on the even/odd interleaved columns of gate_up_proj) and what aiter's
      torch_moe_stage1 reference computes with its `swiglu` helper (there on gate rows then up
      rows, as here). The clamps are torch.clamp: a NaN stays NaN.
    NaN and Inf propagate as these formulas do in IEEE arithmetic (e.g. silu(-inf) * u is NaN)."""
    if activation == "silu":
        return g * torch.sigmoid(g) * u
    if activation == "gelu":
        return 0.5 * g * (1 + torch.tanh(GELU_TANH_C * (g + GELU_TANH_CUBIC * g * g * g))) * u
    if activation == "swiglu_oai":
        g = g.clamp(max=limit)
        u = u.clamp(min=-limit, max=limit)
        return (u + 1) * (g * torch.sigmoid(alpha * g))
    raise ValueError(f"activation must be one of {MOE_ACTIVATIONS}, got {activation!r}")


def moe_stage1_true_dims(x, w1, model_dim=None, inter_dim=None) -> tuple[int, int]:
    """The true (model_dim, inter_dim): given, or x's width and half the weights' rows."""
    _, n2, k_half = w1.shape
    model_dim = x.shape[1] if model_dim is None else model_dim
    inter_dim = n2 // 2 if inter_dim is None else inter_dim
    if not isinstance(model_dim, int) or not 0 < model_dim <= min(2 * k_half, x.shape[1]):
        raise ValueError(f"model_dim = {model_dim} must be in [1, min(K = 2 * w1.shape[2] = {2 * k_half}, x.shape[1] = {x.shape[1]})]")
    if not isinstance(inter_dim, int) or not 0 < inter_dim <= n2 // 2:
        raise ValueError(f"inter_dim = {inter_dim} must be in [1, w1.shape[1] / 2 = {n2 // 2}]")
    return model_dim, inter_dim


def check_moe_gemm1_call(x, w1, w1_scale, sorted_ids, sorted_weights, sorted_expert_ids, num_valid_ids, topk,
                         block_m, bias=None, activation="silu", out=None, model_dim=None,
                         inter_dim=None) -> tuple[int, int, int]:
    """Everything both backends check before running stage 1 (no tensor values or addresses read):
    types, shapes, devices, the true sizes, bias (E, w1.shape[1]) in w1's row order, out
    (T * topk, >= inter_dim) bf16, the activation name. Returns (model_dim, inter_dim, tokens)."""
    validate.high_precision(x, "x", ndim=2)
    validate.tensor(w1, "w1", (torch.uint8, torch.float4_e2m1fn_x2), ndim=3)
    validate.tensor(w1_scale, "w1_scale", (SCALE_DTYPE, torch.uint8), ndim=(2, 3))
    for name, t, dt in (("sorted_ids", sorted_ids, torch.int32), ("sorted_weights", sorted_weights, torch.float32),
                        ("sorted_expert_ids", sorted_expert_ids, torch.int32), ("num_valid_ids", num_valid_ids, torch.int32)):
        validate.tensor(t, name, (dt,), ndim=1)
        validate.same_device("x", x, name, t)
    for name, t in (("w1", w1), ("w1_scale", w1_scale)):
        validate.same_device("x", x, name, t)
    _check_sorted_args(topk, block_m, sorted_ids, sorted_weights, sorted_expert_ids)
    if activation not in MOE_ACTIVATIONS:
        raise ValueError(f"activation must be one of {MOE_ACTIVATIONS}, got {activation!r}")
    experts, n2, k_half = w1.shape
    if n2 % 2:
        raise ValueError(f"w1.shape[1] = {n2} must be even (gate rows then up rows)")
    expected = (experts, n2, 2 * k_half // MX_BLOCK)
    if w1_scale.dim() == 2:
        expected = (experts * n2, expected[2])
    validate.shape(w1_scale, "w1_scale", expected)
    model_dim, inter_dim = moe_stage1_true_dims(x, w1, model_dim, inter_dim)
    tokens = x.shape[0]
    if bias is not None:
        validate.high_precision(bias, "bias", ndim=2)
        validate.same_device("x", x, "bias", bias)
        validate.shape(bias, "bias", (experts, n2))
    if out is not None:
        validate.tensor(out, "out", (torch.bfloat16,), ndim=2)
        validate.same_device("x", x, "out", out)
        if out.shape[0] != tokens * topk or out.shape[1] < inter_dim:
            raise ValueError(f"out must have shape (T * topk = {tokens * topk}, >= inter_dim = {inter_dim}), got {tuple(out.shape)}")
    validate.no_autograd("moe_gemm1_a16w4", dict(x=x, sorted_weights=sorted_weights, bias=bias, out=out))
    return model_dim, inter_dim, tokens


def moe_gemm1_a16w4(x, w1, w1_scale, sorted_ids, sorted_weights, sorted_expert_ids, num_valid_ids, topk, block_m,
                    bias=None, activation="silu", alpha=1.702, limit=7.0, apply_weights=False, out=None,
                    model_dim=None, inter_dim=None, nlane=16):
    """FP32 reference of the A16W4 MoE stage 1 (gate/up projection, activation fused).

    For every sorted row below num_valid_ids[0] with token t < T (slot k, expert e of its block):
        g = x[t, :model_dim] @ Wg[e]^T + bg[e],   u = x[t, :model_dim] @ Wu[e]^T + bu[e]
        out[t * topk + k, :inter_dim] = bf16(act(g, u) * (w_r if apply_weights else 1))
    in FP32, rounded once to bf16 (moe_activation gives act; the bias enters before it, as in
    aiter's torch_moe_stage1 and transformers' GPT-OSS experts). Wg[e] and Wu[e] are rows
    [0, inter_dim) and [P, P + inter_dim) of the dequantized w1[e], P = w1.shape[1] / 2.

    x: (T, >= model_dim) BF16/FP16/FP32. w1: (E, 2 * P, K / 2) packed FP4 and w1_scale:
    (E * 2P, K / 32) or (E, 2P, K / 32) E8M0, shuffled with gate_up=True (shuffle_weight_a16w4
    with `nlane`, shuffle_scale_a16w4); P >= inter_dim and K >= model_dim may be padding.
    bias: (E, 2 * P) in w1's row order (gate_up_rows_from_interleaved gives it from GPT-OSS's).
    out: (T * topk, >= inter_dim) bf16: rows that no routed pair maps to, and columns past
    inter_dim, keep their values; None: a zeroed (T * topk, inter_dim) bf16 tensor. Returns out.
    """
    model_dim, inter_dim, tokens = check_moe_gemm1_call(
        x, w1, w1_scale, sorted_ids, sorted_weights, sorted_expert_ids, num_valid_ids, topk, block_m, bias=bias,
        activation=activation, out=out, model_dim=model_dim, inter_dim=inter_dim)
    experts, n2, _ = w1.shape
    check_moe_gemm2_values(sorted_ids, sorted_expert_ids, num_valid_ids, topk, block_m, tokens, experts)
    if out is None:
        out = torch.zeros(tokens * topk, inter_dim, dtype=torch.bfloat16, device=x.device)
    else:
        validate.no_overlap(out, "out", dict(x=x, w1=w1, w1_scale=w1_scale, sorted_ids=sorted_ids,
                                             sorted_weights=sorted_weights, sorted_expert_ids=sorted_expert_ids,
                                             num_valid_ids=num_valid_ids, bias=bias))
    half = n2 // 2
    w = layouts.unshuffle_weight_a16w4(w1, nlane, gate_up=True)
    s = layouts.unshuffle_scale_a16w4(w1_scale, experts, gate_up=True).reshape(experts, n2, -1)
    weight = dequantize_mxfp4(w, s)[:, :, :model_dim]  # (E, 2P, model_dim) FP32

    rows = torch.arange(sorted_ids.shape[0], device=x.device)
    token = sorted_ids & MOE_TOKEN_MASK
    slot = torch.bitwise_right_shift(sorted_ids, MOE_TOKEN_BITS)
    valid = (rows < num_valid_ids[0]) & (token < tokens)
    expert = sorted_expert_ids[rows // block_m]
    for e in torch.unique(expert[valid]).tolist():
        sel = valid & (expert == e)
        t, k = token[sel].long(), slot[sel].long()
        xe = x[t, :model_dim].to(torch.float32)
        g = xe @ weight[e, :inter_dim].t()
        u = xe @ weight[e, half:half + inter_dim].t()
        if bias is not None:
            g = g + bias[e, :inter_dim].to(torch.float32)
            u = u + bias[e, half:half + inter_dim].to(torch.float32)
        a = moe_activation(g, u, activation, alpha, limit)
        if apply_weights:
            a = a * sorted_weights[sel].unsqueeze(1)
        out[t * topk + k, :inter_dim] = a.to(torch.bfloat16)
    return out


# The grouped GEMMs' reference has its own module (which imports this one), re-exported here.
from . import reference_grouped_mm as _grouped_mm  # noqa: E402

mxfp8_grouped_mm = _grouped_mm.mxfp8_grouped_mm
mxfp8_grouped_mm_wgrad = _grouped_mm.mxfp8_grouped_mm_wgrad
