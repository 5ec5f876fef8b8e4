"""PyTorch reference for the MXFP8 grouped GEMMs of MoE training (forward/dgrad and wgrad).

Both operands are dequantized to FP32 (each E4M3 element times 2^(scale - 127); scale code 0xFF
is NaN) and multiplied per token group in FP32, then rounded once to out_dtype. The dequantize is
exact unless it leaves FP32's range: from scale code 247 on, an element of 256 or more is 2^128
or more (quantizing finite FP32 input near its largest value gives such blocks), inf here, so a
product with a small other operand is inf (and cancelling ones NaN) where the kernels, which
apply both scales to the product, give the finite value.
Token groups follow torchao's contract: `offs` (E,) int32 holds cumulative group ends along M
(non-decreasing, last <= M, empty groups allowed); rows from offs[-1] on belong to no group.

Checks come in two halves: `check_*` look only at dtypes, shapes, strides and devices (safe
while torch.compile traces), `check_*_offs` read offs' values on the host. The reference reads
offs to slice its groups anyway (a host synchronisation on a GPU), so it always checks them.
"""

from __future__ import annotations

import torch

from . import layouts, validate
from .formats import MX_BLOCK
from .reference import MXFP8_DTYPE, SCALE_DTYPE, mxfp8_dequantize

OUT_DTYPES = (torch.bfloat16, torch.float32)
SCALE_LAYOUTS = (None, "mfma")  # the forward/dgrad GEMM's scales: row-major, or aiter's e8m0_shuffle


def _out_dtype(out_dtype) -> None:
    if out_dtype not in OUT_DTYPES:
        raise TypeError(f"out_dtype must be one of (bfloat16, float32), got {out_dtype!r}")


def _operand(data, scales, name: str, ndim: int) -> None:
    validate.tensor(data, name, (MXFP8_DTYPE,), ndim=ndim)
    validate.tensor(scales, f"{name}_scale", (SCALE_DTYPE,), ndim=ndim)
    validate.same_device(name, data, f"{name}_scale", scales)


def check_grouped_mm(a, a_scale, b, b_scale, offs, out_dtype, scale_layout=None) -> None:
    """mxfp8_grouped_mm's inputs, without reading offs' values."""
    _operand(a, a_scale, "a", 2)
    _operand(b, b_scale, "b", 3)
    validate.same_device("a", a, "b", b)
    m, k = a.shape
    e, n, kb = b.shape
    validate.block_dim(a, 1, "a", "K")
    if kb != k:
        raise ValueError(f"b.shape[2] = {kb} must equal a.shape[1] = {k} (K, the reduced dim)")
    if scale_layout not in SCALE_LAYOUTS:
        raise ValueError(f"scale_layout must be one of {SCALE_LAYOUTS}, got {scale_layout!r}")
    # the data's orientation before the scales' shapes: a wrong axis names itself
    if not a.is_contiguous():
        raise ValueError(f"a must be contiguous (row-major, quantized along K: fq.mxfp8_quantize(x, axis=-1)), "
                         f"got strides {a.stride()} for shape {tuple(a.shape)}")
    if not b.is_contiguous():
        along_n = b.transpose(1, 2).is_contiguous()  # what fq.mxfp8_quantize_3d(w) returns for w (E, N, K)
        hint = ("; that is the 3D quantize of w (E, N, K) along N: quantize w.transpose(1, 2), pass its data "
                "transposed back and its scales as fq.mxfp8_grouped_mm's docstring says") if along_n else ""
        raise ValueError(f"b must be contiguous (E, N, K) quantized along K, got strides {b.stride()} for shape "
                         f"{tuple(b.shape)}{hint}")
    if scale_layout == "mfma":  # each operand's (rows, K/32) scales shuffled; b's per expert
        validate.shape(a_scale, "a_scale", layouts.mfma_scales_shape(m, k // MX_BLOCK))
        validate.shape(b_scale, "b_scale", (e, *layouts.mfma_scales_shape(n, k // MX_BLOCK)))
    else:
        validate.shape(a_scale, "a_scale", (m, k // MX_BLOCK))
        validate.shape(b_scale, "b_scale", (e, n, k // MX_BLOCK))
    validate.offs_tensor(offs, "a", a)
    validate.shape(offs, "offs", (e,))
    _out_dtype(out_dtype)


def plain_scales(a, a_scale, b, b_scale, scale_layout):
    """(a_scale, b_scale) row-major, whatever scale_layout they come in."""
    if scale_layout is None:
        return a_scale, b_scale
    (m, k), (e, n, _) = a.shape, b.shape
    kb = k // MX_BLOCK
    a_plain = layouts.mfma_unshuffle_scales(a_scale)[:m, :kb]
    if e == 0:
        return a_plain, b_scale.new_empty((0, n, kb))
    return a_plain, layouts.join_codes([layouts.mfma_unshuffle_scales(s)[:n, :kb] for s in b_scale])


def check_grouped_mm_offs(offs, rows: int) -> None:
    """Any group sizes; the last end at most M."""
    validate.offs_values(offs, rows, 1, exact_end=False)


def _operand_32x1(data, scales, name: str) -> None:
    """A (M, C) operand quantized along M as mxfp8_quantize(x, axis=0) returns it."""
    _operand(data, scales, name, 2)
    m, c = data.shape
    validate.block_dim(data, 0, name, "M")
    if data.stride() != (1, m):  # before the scales' shape: a wrong axis names itself
        raise ValueError(f"{name} must be column-major (stride (1, {m}), quantized along M as mxfp8_quantize(x, "
                         f"axis=0) returns it), got strides {data.stride()} for shape {tuple(data.shape)}")
    validate.shape(scales, f"{name}_scale", (c, m // MX_BLOCK))


def check_grouped_mm_wgrad(x, x_scale, y, y_scale, offs, out_dtype) -> None:
    """mxfp8_grouped_mm_wgrad's inputs, without reading offs' values."""
    _operand_32x1(x, x_scale, "x")
    _operand_32x1(y, y_scale, "y")
    validate.same_device("x", x, "y", y)
    if y.shape[0] != x.shape[0]:
        raise ValueError(f"y.shape[0] = {y.shape[0]} must equal x.shape[0] = {x.shape[0]} (M, the token rows)")
    validate.offs_tensor(offs, "x", x)
    _out_dtype(out_dtype)


def check_grouped_mm_wgrad_offs(offs, rows: int) -> None:
    """Group sizes multiples of 32 (a 32x1 block never straddles two groups); last end at most M."""
    validate.offs_values(offs, rows, MX_BLOCK, exact_end=False)


def group_bounds(offs: torch.Tensor) -> list[tuple[int, int]]:
    """(first row, end row) of each token group of offs (cumulative group ends)."""
    ends = offs.tolist()
    return list(zip([0] + ends[:-1], ends))


def mxfp8_grouped_mm(a, a_scale, b, b_scale, offs, out_dtype=torch.bfloat16, scale_layout=None):
    """out (M, N): out[offs[g-1]:offs[g]] = deq(a)[rows] @ deq(b[g])^T, rows from offs[-1] on 0.

    a (M, K) float8_e4m3fn row-major with scales (M, K/32) (fq.mxfp8_quantize(x, axis=-1));
    b (E, N, K) float8_e4m3fn contiguous with scales (E, N, K/32) along K; offs (E,) int32 on a's
    device, any group sizes; K a multiple of 32; out_dtype bfloat16 or float32. Forward
    (a = activations, b = expert weights) and dgrad (a = grad_out, b = the weights along N).
    scale_layout "mfma": the scales in aiter's e8m0_shuffle layout, a_scale that of a's (M, K/32)
    scales, b_scale each expert's (E, N', K'/32 padded); what fq.mxfp8_quantize(x, -1,
    scale_layout="mfma") and, for weights w (E, N, K), fq.mxfp8_quantize_3d(w.transpose(1, 2),
    scale_layout="mfma") write.
    """
    check_grouped_mm(a, a_scale, b, b_scale, offs, out_dtype, scale_layout)
    check_grouped_mm_offs(offs, a.shape[0])
    a_scale, b_scale = plain_scales(a, a_scale, b, b_scale, scale_layout)
    e, n, k = b.shape
    a32 = mxfp8_dequantize(a, a_scale, axis=-1)
    b32 = mxfp8_dequantize(b.reshape(e * n, k), b_scale.reshape(e * n, k // MX_BLOCK), axis=-1).view(e, n, k)
    out = torch.zeros(a.shape[0], n, dtype=torch.float32, device=a.device)
    for g, (lo, hi) in enumerate(group_bounds(offs)):
        out[lo:hi] = a32[lo:hi] @ b32[g].t()
    return out.to(out_dtype)


def mxfp8_grouped_mm_wgrad(x, x_scale, y, y_scale, offs, out_dtype=torch.bfloat16):
    """out (E, N, K): out[g] = deq(y[g rows])^T @ deq(x[g rows]); empty groups give zeros.

    x (M, K) and y (M, N) float8_e4m3fn quantized along M in blocks of 32, as
    fq.mxfp8_quantize(t, axis=0) returns them (data stride (1, M), scales (K, M/32) and (N,
    M/32)); offs (E,) int32, every group size a multiple of 32, last <= M (rows after it unused).
    The weight gradient: x = grad_out, y = activations gives grad(B_t) (E, K_act, N_out).
    """
    check_grouped_mm_wgrad(x, x_scale, y, y_scale, offs, out_dtype)
    check_grouped_mm_wgrad_offs(offs, x.shape[0])
    x32 = mxfp8_dequantize(x, x_scale, axis=0)
    y32 = mxfp8_dequantize(y, y_scale, axis=0)
    out = torch.zeros(offs.shape[0], y.shape[1], x.shape[1], dtype=torch.float32, device=x.device)
    for g, (lo, hi) in enumerate(group_bounds(offs)):
        out[g] = y32[lo:hi].t() @ x32[lo:hi]
    return out.to(out_dtype)
