"""The MXFP8 grouped GEMMs of MoE training, public API: ``torch.library`` custom ops with fakes
(so ``torch.compile(fullgraph=True)`` traces them), each dispatched by the selector to its FlyDSL
kernel on gfx942 and gfx950 (kernels/mxfp8_grouped_mm.py, the launcher
``select_grouped_mm.GROUPED_MM_KERNELS`` names) or to the reference (``flyquant.reference_grouped_mm``, which
states the numerics).

offs' values are checked where the host holds them: always on the reference path (it reads
offs to slice its groups: a host synchronisation on a GPU), on the kernel path only for CPU
tensors (the emulator). On a GPU the kernel path does not synchronise to check them: offs that
break the contract give undefined results there.
"""

from __future__ import annotations

from typing import Optional

import torch

from . import reference_grouped_mm as ref
from . import select_grouped_mm, validate


def _run(plan, reference_fn, check_offs, out_shape, args, out_dtype, signed_zeros, **options) -> torch.Tensor:
    """The plan's backend: the reference, or the kernel launcher writing every row of out
    (signed_zeros: the kernel's operand promise; the reference reads any operands)."""
    if plan.backend == "reference":
        return reference_fn(*args, out_dtype, **options)
    check_host_offs(check_offs, args[4], args[0].shape[0])
    out = torch.empty(out_shape, dtype=out_dtype, device=args[0].device)
    config = {k: v for k, v in plan.config.items() if k != "launcher"}
    select_grouped_mm.grouped_mm_launcher(plan)(*args, out=out, arch=plan.arch, signed_zeros=signed_zeros, **options, **config)
    return out


@torch.library.custom_op("flyquant::mxfp8_grouped_mm", mutates_args=())
def _grouped_mm_op(a: torch.Tensor, a_scale: torch.Tensor, b: torch.Tensor, b_scale: torch.Tensor,
                   offs: torch.Tensor, out_dtype: torch.dtype, scale_layout: Optional[str] = None,
                   signed_zeros: bool = True) -> torch.Tensor:
    ref.check_grouped_mm(a, a_scale, b, b_scale, offs, out_dtype, scale_layout)  # torch.ops.flyquant.* callers too
    plan = select_grouped_mm.plan_mxfp8_grouped_mm(a, b, offs, out_dtype, signed_zeros, scale_layout)
    return _run(plan, ref.mxfp8_grouped_mm, ref.check_grouped_mm_offs, (a.shape[0], b.shape[1]),
                (a, a_scale, b, b_scale, offs), out_dtype, signed_zeros, scale_layout=scale_layout)


@_grouped_mm_op.register_fake
def _(a, a_scale, b, b_scale, offs, out_dtype, scale_layout=None, signed_zeros=True):
    ref.check_grouped_mm(a, a_scale, b, b_scale, offs, out_dtype, scale_layout)  # as the op (metadata only)
    return a.new_empty((a.shape[0], b.shape[1]), dtype=out_dtype)


def mxfp8_grouped_mm(a, a_scale, b, b_scale, offs, out_dtype=torch.bfloat16, scale_layout=None, signed_zeros=True):
    """MXFP8 grouped GEMM (MoE forward and dgrad): out (M, N), out[offs[g-1]:offs[g]] =
    deq(a)[rows] @ deq(b[g])^T, rows from offs[-1] on 0.

    a (M, K) float8_e4m3fn row-major, a_scale (M, K/32) float8_e8m0fnu (fq.mxfp8_quantize(x,
    axis=-1)); b (E, N, K) float8_e4m3fn contiguous, b_scale (E, N, K/32) (scales along K); offs
    (E,) int32 on a's device: cumulative token-group ends, non-decreasing, last <= M, any group
    sizes (empty ones too); K a multiple of 32; out_dtype bfloat16 or float32. deq(v) = E4M3(v) *
    2^(scale - 127), scale 0xFF NaN. From expert weights w (E, N, K): d, s =
    fq.mxfp8_quantize_3d(w.transpose(1, 2)) quantizes along K (the 3D quantize's dim 1; of w
    itself it would quantize along N), b = d.transpose(1, 2), b_scale = s.transpose(1,
    2).contiguous(), or s itself with scale_layout="mfma" (flyquant.training does this).
    scale_layout "mfma": both scales in aiter's e8m0_shuffle layout, as fq.mxfp8_quantize(x, -1,
    scale_layout="mfma") and the 3D quantize above with scale_layout="mfma" write them (b_scale
    (E, N padded to 256, K/32 padded to 8)): the layout the gfx950 kernel reads with the fewest
    instructions. Scales carry no layout tag: where M and N are multiples of 256 and K/32 of 8,
    plain and "mfma" scales have the same shape, and the wrong scale_layout gives wrong values,
    no error. signed_zeros=False: a and b are as flyquant's quantize ops write them with
    signed_zeros=False (validate.SIGNED_ZEROS_DOC). See the module docstring for when offs'
    values are checked.
    """
    ref.check_grouped_mm(a, a_scale, b, b_scale, offs, out_dtype, scale_layout)
    return _grouped_mm_op(a, a_scale, b, b_scale, offs, out_dtype, scale_layout, validate.flag(signed_zeros, "signed_zeros"))


@torch.library.custom_op("flyquant::mxfp8_grouped_mm_wgrad", mutates_args=())
def _grouped_mm_wgrad_op(x: torch.Tensor, x_scale: torch.Tensor, y: torch.Tensor, y_scale: torch.Tensor,
                         offs: torch.Tensor, out_dtype: torch.dtype, signed_zeros: bool = True) -> torch.Tensor:
    ref.check_grouped_mm_wgrad(x, x_scale, y, y_scale, offs, out_dtype)
    plan = select_grouped_mm.plan_mxfp8_grouped_mm_wgrad(x, y, offs, out_dtype, signed_zeros)
    return _run(plan, ref.mxfp8_grouped_mm_wgrad, ref.check_grouped_mm_wgrad_offs,
                (offs.shape[0], y.shape[1], x.shape[1]), (x, x_scale, y, y_scale, offs), out_dtype, signed_zeros)


@_grouped_mm_wgrad_op.register_fake
def _(x, x_scale, y, y_scale, offs, out_dtype, signed_zeros=True):
    ref.check_grouped_mm_wgrad(x, x_scale, y, y_scale, offs, out_dtype)
    return x.new_empty((offs.shape[0], y.shape[1], x.shape[1]), dtype=out_dtype)


def mxfp8_grouped_mm_wgrad(x, x_scale, y, y_scale, offs, out_dtype=torch.bfloat16, signed_zeros=True):
    """MXFP8 grouped weight-gradient GEMM: out (E, N, K), out[g] = deq(y[g rows])^T @
    deq(x[g rows]), empty groups zero.

    x (M, K) and y (M, N) float8_e4m3fn quantized along M in blocks of 32 as
    fq.mxfp8_quantize(t, axis=0) returns them (data stride (1, M), scales (K, M/32) and (N,
    M/32)); offs (E,) int32 on x's device, every group size a multiple of 32 (no block straddles
    two groups), last <= M; out_dtype bfloat16 or float32. signed_zeros=False: x and y as
    fq.mxfp8_quantize writes them with signed_zeros=False (validate.SIGNED_ZEROS_DOC). See the
    module docstring for when offs' values are checked.
    """
    ref.check_grouped_mm_wgrad(x, x_scale, y, y_scale, offs, out_dtype)
    return _grouped_mm_wgrad_op(x, x_scale, y, y_scale, offs, out_dtype, validate.flag(signed_zeros, "signed_zeros"))


def check_host_offs(check_offs, offs, rows) -> None:
    """offs' values where the host holds them, as the reference checks them (the kernel path and explain)."""
    if offs.device.type == "cpu":
        check_offs(offs, rows)


def explain_grouped_mm(a, a_scale, b, b_scale, offs, out_dtype=torch.bfloat16, scale_layout=None, signed_zeros=True):
    ref.check_grouped_mm(a, a_scale, b, b_scale, offs, out_dtype, scale_layout)
    check_host_offs(ref.check_grouped_mm_offs, offs, a.shape[0])
    return select_grouped_mm.plan_mxfp8_grouped_mm(a, b, offs, out_dtype, validate.flag(signed_zeros, "signed_zeros"), scale_layout)


def explain_grouped_mm_wgrad(x, x_scale, y, y_scale, offs, out_dtype=torch.bfloat16, signed_zeros=True):
    ref.check_grouped_mm_wgrad(x, x_scale, y, y_scale, offs, out_dtype)
    check_host_offs(ref.check_grouped_mm_wgrad_offs, offs, x.shape[0])
    return select_grouped_mm.plan_mxfp8_grouped_mm_wgrad(x, y, offs, out_dtype, validate.flag(signed_zeros, "signed_zeros"))


EXPLAINERS = {mxfp8_grouped_mm: explain_grouped_mm, mxfp8_grouped_mm_wgrad: explain_grouped_mm_wgrad}
