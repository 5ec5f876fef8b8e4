"""Pure-PyTorch reference for every flyquant op: the numerical contract the kernels match.

MXFP8 quantize ops follow torchao main's MXFP8 bitwise contract (pytorch/ao PR 4725; formats.py
states it): E8M0 code 0 is 2^-127 and used, rceil rounds amax * fl32(1/448) up from its FP32
bits, floor takes amax's FP32 exponent, a NaN/Inf block is scale 0xFF with NaN elements. They
equal torchao 0.18's to_mx except on the blocks listed in tests/test_reference_mxfp8.py
(DIFFERS_FROM_018). MXFP4 follows the same contract with E2M1's constants and the extra mode
"even" (formats.py; tests/test_reference_mxfp4.py lists where 0.18 differs). Everything runs on any device;
nothing here imports a kernel.

This module holds the MX quantize and dequantize references and is the one namespace of the
contract (fq.reference.<op>): the A16W4 MoE GEMMs' reference (reference_moe.py) and the MXFP8
grouped GEMMs' (reference_grouped_mm.py) live in their own modules, their ops reachable here
(see the end); the weight shuffles and moe_sorting are re-exported from layouts and moe.

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


def _unsign_zeros(data: torch.Tensor, signed_zeros: bool) -> torch.Tensor:
    """signed_zeros=False: the E4M3 codes (uint8) with -0 (0x80) written +0, in place
    (validate.SIGNED_ZEROS_DOC)."""
    return data if signed_zeros else data.masked_fill_(data == formats.E4M3_SIGN, 0)  # -0 is the sign bit alone


def mxfp8_quantize(x, axis=-1, scaling_mode="rceil", scale_layout=None, offs=None, signed_zeros=True):
    """MXFP8-quantize a 2D (M, K) BF16/FP16/FP32 tensor in blocks of 32 along `axis`.

    axis=-1 (1x32): data (M, K) row-major, scales (M, K/32). axis=0 (32x1): data (M, K) with
    stride (1, M), scales (K, M/32). Returns (float8_e4m3fn data, float8_e8m0fnu scales).
    offs: int32 token-group end offsets along M (torchao's contract, validated: non-decreasing,
    last == M, group sizes multiples of 128). Blocks never straddle such groups, so offs changes
    only the tcgen05 layout of 32x1 scales, which is then laid out per group (torchao's
    torch_to_blocked_2d_K_groups on the (K, M/32) scales); for 1x32 the per-group layout
    (torch_to_blocked_2d_M_groups) equals the global one. signed_zeros=False: zeros +0
    (validate.SIGNED_ZEROS_DOC).
    """
    axis = check_mxfp8_2d(x, axis, scaling_mode, scale_layout, offs)
    if axis == 1:
        data, scales = _quantize_rows(x, scaling_mode)
        data = _unsign_zeros(data, signed_zeros).view(MXFP8_DTYPE)
        return data, _layout_scales_2d(scales.view(SCALE_DTYPE), scale_layout, flat=False)
    data_t, scales = _quantize_rows(x.t(), scaling_mode)  # (K, M), (K, M/32)
    data = _unsign_zeros(data_t, signed_zeros).view(MXFP8_DTYPE).t()  # (M, K), stride (1, M)
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


def check_mxfp8_3d(w, scaling_mode, scale_block_k, scale_layout) -> int:
    """The 3D MXFP8 quantize's checks, on every backend; returns scale_block_k as an int (numpy's
    integers are taken)."""
    validate.high_precision(w, "w", ndim=3)
    validate.scaling_mode(scaling_mode)
    validate.scale_layout(scale_layout)
    scale_block_k = validate.as_int(scale_block_k)
    if not validate.is_int(scale_block_k) or scale_block_k not in SCALE_BLOCK_K_CHOICES:  # not True or 32.0
        raise ValueError(f"scale_block_k must be one of {SCALE_BLOCK_K_CHOICES}, got {scale_block_k!r}")
    validate.block_dim(w, 1, "w", "N")
    if scale_block_k == MX_BLOCK:
        validate.block_dim(w, 2, "w", "K", block=scale_block_k)
    validate.mxfp8_3d_transposed(w)  # refused alike on every backend
    return scale_block_k


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
        return layouts.join_codes([layouts.tcgen05_blocked(s) for s in per_k_row])
    return layouts.join_codes([layouts.mfma_shuffle_scales(s) for s in per_k_row])


def mxfp8_quantize_3d(w, scaling_mode="rceil", scale_block_k=1, scale_layout=None, signed_zeros=True):
    """MXFP8-quantize expert weights (E, N, K) along N.

    scale_block_k=1: one scale per 32 (N) x 1 (K), scales (E, N/32, K). scale_block_k=32: one per
    32 x 32 tile (the amax over the 1024 values), scales (E, N/32, K/32). Data (E, N, K) with
    stride (N*K, 1, N) (column-major per expert). Layouts: see the module docstring.

    w is contiguous, or the transpose of a contiguous (E, K, N) tensor, strides (N*K, 1, N), as
    torchao's MXFP8 grouped GEMM passes its expert weights: quantized along the contiguous dim
    (scale_block_k=1: no copy of w). The outputs are those of w.contiguous(), strides included
    (torchao main's test_cuda_mx_3d_cutedsl_numerics, variants 32x1_t and 32x32_t: the same data
    strides). signed_zeros=False: zeros +0 (validate.SIGNED_ZEROS_DOC).
    """
    scale_block_k = check_mxfp8_3d(w, scaling_mode, scale_block_k, scale_layout)
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
    return _unsign_zeros(data, signed_zeros).view(MXFP8_DTYPE), _layout_scales_3d(scales, scale_block_k, scale_layout)


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


def _check_scales(scales, data_name, data):
    validate.tensor(scales, "scales", (SCALE_DTYPE, torch.uint8))
    validate.same_device(data_name, data, "scales", scales)  # else torch's error, naming neither


def dequantize_mxfp4(packed, scales):
    """(..., K/2) packed E2M1 + (..., K/32) E8M0 -> FP32 (..., K) = value * 2^(code - 127)
    (code 0 is 2^-127, 0xFF is NaN). K = 2 * packed.shape[-1], whole blocks: the quantized
    tensor's K0 % 32 != 0 comes back zero-padded to them (slice [..., :K0])."""
    validate.tensor(packed, "packed", (torch.uint8, torch.float4_e2m1fn_x2))
    _check_scales(scales, "packed", packed)
    if packed.dim() < 1 or packed.shape[-1] % (MX_BLOCK // 2):  # checked before shape[-1] is read (0-d)
        raise ValueError(f"packed.shape[-1] (K/2) must be a multiple of {MX_BLOCK // 2} (whole blocks), got shape {tuple(packed.shape)}")
    k = packed.shape[-1] * 2
    validate.shape(scales, "scales", tuple(packed.shape[:-1]) + (k // MX_BLOCK,))
    values = formats.e2m1_decode(formats.unpack_fp4(packed))
    s = formats.e8m0_decode(scales)
    return (values.view(*s.shape, MX_BLOCK) * s.unsqueeze(-1)).view(*packed.shape[:-1], k)


def _check_orientation(data, strides, axis, quantize, other=None) -> None:
    """The data's strides are those `quantize` gives for `axis` (dims of size 1 aside): on a
    square matrix the strides are all that tells a 1x32 result from a 32x1 one. other: (the
    other 2D orientation's strides, its axis), named in the error when the data has them."""
    def has(want):
        return all(n == 1 or st == w for n, st, w in zip(data.shape, data.stride(), want))

    if not has(strides):
        hint = (f"the other orientation's output? pass axis={other[1]}" if other and has(other[0])
                else "a strided view? pass the tensor the quantize returned")
        raise ValueError(
            f"data with axis={axis} must have the strides {quantize} returns, {strides} for shape "
            f"{tuple(data.shape)}; got {data.stride()} ({hint})")


def mxfp8_dequantize(data, scales, axis=-1):
    """MXFP8 data + plain-layout scales -> FP32 with data's shape (row-major).

    2D axis=-1: data row-major, scales (M, K/32). 2D axis=0: data stride (1, M), scales (K,
    M/32). 3D (E, N, K) data stride (N*K, 1, N), axis=1 (or -2): scales (E, N/32, K), or (E,
    N/32, K/32) for 32x32 blocks. The data's strides must be the quantize output's for that axis.
    """
    validate.tensor(data, "data", (MXFP8_DTYPE, torch.uint8), ndim=(2, 3))
    _check_scales(scales, "data", data)
    if not validate.is_int(axis):  # True or 1.0 would equal 1 in the tuples below
        raise ValueError(f"axis must be an int (-1 or 0 for 2D data, 1 for 3D), got {axis!r}")
    values = data.view(MXFP8_DTYPE).to(torch.float32)
    s = formats.e8m0_decode(scales)
    if data.dim() == 2:
        m, k = data.shape
        if axis in (-1, 1):
            validate.block_dim(data, 1, "data", "K")
            validate.shape(scales, "scales", (m, k // MX_BLOCK))
            _check_orientation(data, (k, 1), axis, "mxfp8_quantize(x, axis=-1)", ((1, m), 0))
            return (values.view(m, k // MX_BLOCK, MX_BLOCK) * s.unsqueeze(-1)).view(m, k)
        if axis in (0, -2):
            validate.block_dim(data, 0, "data", "M")
            validate.shape(scales, "scales", (k, m // MX_BLOCK))
            _check_orientation(data, (1, m), axis, "mxfp8_quantize(x, axis=0)", ((k, 1), -1))
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


# The grouped GEMMs' reference has its own module (which imports this one), re-exported here.
from . import reference_grouped_mm as _grouped_mm  # noqa: E402

mxfp8_grouped_mm = _grouped_mm.mxfp8_grouped_mm
mxfp8_grouped_mm_wgrad = _grouped_mm.mxfp8_grouped_mm_wgrad


# The A16W4 MoE GEMMs' reference has its own module too, which imports this one and may be imported
# first (api_moe imports it): its names (its __all__) are looked up there on first use (PEP 562),
# not imported here, so neither module ever reads the other half-initialised.
def __getattr__(name: str):
    from . import reference_moe

    if name in reference_moe.__all__:
        return getattr(reference_moe, name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
