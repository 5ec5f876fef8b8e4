"""MXFP8 MoE training: the grouped GEMM of routed experts as an autograd op.

``mxfp8_grouped_mm(A, B_t, offs)`` has the contract of torchao 0.18's
``_to_mxfp8_then_scaled_grouped_mm`` (its recipes: MXFP8 forward, dgrad and wgrad, or the wgrad
in high precision; token groups padded or not; the bias is the caller's): A (M, K) high
precision, token-grouped by offs; B_t (E, K, N) the transposed expert weights; out (M, N),
out[group g] = A[g] @ B_t[g]. Every MXFP8 GEMM is fq.mxfp8_grouped_mm /
fq.mxfp8_grouped_mm_wgrad (FlyDSL kernel or reference, as the selector plans) on operands
quantized by flyquant's MXFP8 quantize ops:

- forward: A 1x32 along K; B_t along K (fq.mxfp8_quantize_3d of B_t, (E, K, N) quantized along
  its dim 1), used as (E, N, K).
- dgrad: grad_out 1x32 along N; B_t along N (fq.mxfp8_quantize_3d of B_t^T: the transposed-view
  path when B_t is contiguous), used as (E, K, N); grad_A = grouped GEMM on the same offs.
- wgrad: grad_out and A quantized 32x1 along M; grad_B_t[g] = A[g]^T @ grad_out[g].

Where FP8 is FNUZ (gfx942) every operand is quantized with signed_zeros=False (zeros +0) and the
GEMMs told so: they read the codes as they are, without the per-dword rewrite of -0 and the NaN
probe that arbitrary OCP operands need there (validate.SIGNED_ZEROS_DOC).

The forward takes any token group sizes. The backward's 32x1 blocks must not straddle groups:
every group size must be a multiple of 32 and M a multiple of 32 (a ValueError where the host
holds offs; on a GPU a device-side assert, which stops the step at the next synchronisation
without adding one), unless
- wgrad_with_hp: grad_B_t[g] = A[g]^T @ grad_out[g] by torch._grouped_mm in the operands'
  (promoted) dtype, as torchao's MXFP8_RCEIL_WGRAD_WITH_HP recipe computes it; or
- pad_token_groups_for_grouped_mm: every group is moved to a 32-aligned start in a zero-padded
  copy of A (and of grad_out in the backward) with its size rounded up to 32, the GEMMs run on
  the copies and the token rows are gathered back. Where the rows go is computed on offs' device
  (no host synchronisation), so the copies have the bound M + 31 E rows (rounded up to 32); the
  padding rows are zeros, which change no 1x32 or 32x1 block's scale, so every block of a
  group's rows is quantized as torchao's padded recipe quantizes it. The caller's offs are
  checked (non-decreasing, last <= M) where the host holds them, except while torch.compile
  traces.
Gradients come back in A's and B_t's dtypes.

Pre-quantized activations (torchao's MXTensor A, e.g. from its expert-parallel MXFP8 dispatch):
a_quantized = (data, scales), A quantized 1x32 along K with row-major scales; A itself is then
only autograd's handle for its gradient (its shape, dtype and device are read, not its values).
As in torchao, wgrad_with_hp is required (B_t's gradient from A's dequantized values: the 32x1
blocks of B_t's MXFP8 gradient need A in high precision), the forward's B_t is quantized with
row-major scales to match, and where FP8 is FNUZ the forward GEMM reads A's bytes as arbitrary
OCP codes (signed_zeros=True).
"""

from __future__ import annotations

import torch

from . import api, grouped_mm, reference, select, select_grouped_mm, validate
from .arch import arch_info
from .formats import MX_BLOCK
from .reference_grouped_mm import OUT_DTYPES, check_grouped_mm_offs

# The forward and dgrad GEMMs' scales come from the quantize kernels in aiter's e8m0_shuffle
# layout: the one the gfx950 kernel reads with the fewest instructions, and no re-layout pass.
SCALE_LAYOUT = "mfma"


def _check(A, B_t, offs, out_dtype, scaling_mode, quantized=False) -> None:
    if not quantized:  # else A is only the gradient's handle: _check_quantized
        validate.high_precision(A, "A", ndim=2)
    validate.high_precision(B_t, "B_t", ndim=3)
    validate.same_device("A", A, "B_t", B_t)
    validate.offs_tensor(offs, "A", A)
    e, k, n = B_t.shape
    if A.shape[1] != k:
        raise ValueError(f"B_t.shape[1] = {k} must equal A.shape[1] = {A.shape[1]} (K)")
    validate.shape(offs, "offs", (e,))
    validate.block_dim(A, 1, "A", "K")
    validate.block_dim(B_t, 2, "B_t", "N")
    if not (B_t.is_contiguous() or B_t.transpose(1, 2).is_contiguous()):  # the 3D quantize's two layouts
        raise ValueError(f"B_t must be contiguous (E, K, N) or the transpose of a contiguous (E, N, K) tensor (strides "
                         f"{(k * n, n, 1)} or {(k * n, 1, k)}), got strides {B_t.stride()} for shape {tuple(B_t.shape)}")
    if out_dtype not in OUT_DTYPES:
        raise TypeError(f"out_dtype must be one of (bfloat16, float32), got {out_dtype!r}")
    validate.scaling_mode(scaling_mode)


def _check_quantized(A, a_quantized, wgrad_with_hp) -> tuple[torch.Tensor, torch.Tensor]:
    """A's pre-quantized (data, scales): E4M3 (M, K) and row-major E8M0 (M, K/32) on A's device."""
    if not wgrad_with_hp:
        raise ValueError("a pre-quantized A (a_quantized) needs wgrad_with_hp=True: B_t's MXFP8 gradient "
                         "quantizes A in 32x1 blocks from its high-precision values")
    if not (isinstance(a_quantized, (tuple, list)) and len(a_quantized) == 2):
        raise TypeError(f"a_quantized must be a (data, scales) pair, got {type(a_quantized).__name__}")
    data, scales = a_quantized
    validate.tensor(data, "a_quantized data", (torch.float8_e4m3fn,), ndim=2)
    validate.tensor(scales, "a_quantized scales", (torch.float8_e8m0fnu,), ndim=2)
    if tuple(A.shape) != tuple(data.shape) or A.dtype not in validate.HIGH_PRECISION_DTYPES:
        raise ValueError(f"A (shape {tuple(A.shape)}, dtype {A.dtype}) must have the pre-quantized data's shape "
                         f"{tuple(data.shape)} and a bf16/fp16/fp32 dtype (its gradient's)")
    validate.block_dim(data, 1, "a_quantized data", "K")
    validate.shape(scales, "a_quantized scales", (data.shape[0], data.shape[1] // MX_BLOCK))
    for t, name in ((data, "data"), (scales, "scales")):
        validate.same_device("A", A, f"a_quantized {name}", t)
    return data.contiguous(), scales.contiguous()


def _signed_zeros(t: torch.Tensor) -> bool:
    """Whether the operands keep -0: where FP8 is FNUZ (gfx942) they are quantized with +0 zeros,
    which that GEMM then reads without rewriting (validate.SIGNED_ZEROS_DOC); elsewhere the
    rewrite would only cost the quantize kernels instructions."""
    arch = select.resolve_target(t.device).arch
    return arch is None or not arch_info(arch).fnuz_fp8


def _along_k(B_t: torch.Tensor, scaling_mode: str, signed_zeros: bool,
             layout=SCALE_LAYOUT) -> tuple[torch.Tensor, torch.Tensor]:
    """B_t (E, K, N) quantized along K, as the GEMM's b (E, N, K) contiguous and its scales in
    `layout` ("mfma": each expert's (N, K/32) scales shuffled, what the 3D quantize writes; None:
    row-major (E, N, K/32), the 3D quantize's (E, K/32, N) transposed)."""
    data, scales = api.mxfp8_quantize_3d(B_t, scaling_mode, scale_layout=layout,
                                         signed_zeros=signed_zeros)  # data stride (K*N, 1, K)
    return data.transpose(1, 2), (scales if layout else scales.transpose(1, 2).contiguous())


def _padded_row_count(rows: int, groups: int) -> int:
    """The padded copy's rows: every group may grow by up to 31 rows (the bound, known on the host)."""
    return -(-(rows + (MX_BLOCK - 1) * groups) // MX_BLOCK) * MX_BLOCK


def _padded_rows(offs: torch.Tensor, rows: int) -> tuple[torch.Tensor, torch.Tensor, int]:
    """Token groups padded to multiples of 32 (module docstring): (where each of the `rows` rows
    goes (rows,) int64, the padded groups' ends (E,) int32, the padded row count), computed on
    offs' device. Rows past the last group go after the last padded group, still past it; with
    offs that are not non-decreasing the places are clamped into the copy (no access outside it)."""
    ends = offs.long()
    starts = torch.cat([ends.new_zeros(1), ends[:-1]])
    sizes = (ends - starts).clamp_min(0)
    padded_ends = ((sizes + MX_BLOCK - 1) // MX_BLOCK * MX_BLOCK).cumsum(0)
    padded_starts = torch.cat([padded_ends.new_zeros(1), padded_ends[:-1]])
    shift = torch.cat([padded_starts - starts, padded_ends[-1:] - ends[-1:]])  # per group, then past the last
    row = torch.arange(rows, device=offs.device)
    total = _padded_row_count(rows, offs.numel())
    dest = (row + shift[torch.searchsorted(ends, row, right=True)]).clamp_(0, total - 1)
    return dest, padded_ends.int(), total


def _scatter_rows(t: torch.Tensor, dest: torch.Tensor, rows: int) -> torch.Tensor:
    """t's rows at `dest` of a zero (FP8/E8M0: zero-byte) tensor of `rows` rows."""
    if t.element_size() == 1 and t.dtype != torch.uint8:  # float8 types: index_copy_ moves their bytes
        return _scatter_rows(t.view(torch.uint8), dest, rows).view(t.dtype)
    return t.new_zeros(rows, t.shape[1]).index_copy_(0, dest, t)


UNALIGNED_GROUPS = ("mxfp8_grouped_mm's backward quantizes each token group's rows in 32x1 blocks for B_t's "
                    "gradient: every group size must be a multiple of 32; pass pad_token_groups_for_grouped_mm=True "
                    "(groups padded on the device) or wgrad_with_hp=True")


def _check_wgrad_groups(offs) -> None:
    """The 32x1 wgrad's group sizes (module docstring). Where the host holds offs, a ValueError
    naming the sizes; on a GPU (and while torch.compile traces) a device-side assert, with no host
    synchronisation: a router's unaligned groups stop the step (the next synchronisation fails with
    the message) instead of giving B_t a gradient from blocks that straddle groups."""
    sizes = torch.diff(offs, prepend=offs.new_zeros(1))
    if offs.device.type == "cpu" and not validate.tracing(offs):
        if (sizes % MX_BLOCK != 0).any():
            raise ValueError(f"{UNALIGNED_GROUPS}; offs {offs.tolist()} gives sizes {sizes.tolist()}")
        return
    torch._assert_async((sizes % MX_BLOCK == 0).all(), UNALIGNED_GROUPS)


def _refuse_unsupported_gemms(A, B_t, offs, out_dtype, pad, wgrad_with_hp) -> None:
    """Under FLYQUANT_BACKEND=flydsl, a GEMM this call will run that the kernel does not take is a
    BackendError here, before the quantize launches (gfx942's K limit was refused after them, or
    in the backward after the forward had run)."""
    if select.forced_backend() != "flydsl":
        return
    _, k, n = B_t.shape
    rows = _padded_row_count(A.shape[0], offs.numel()) if pad else A.shape[0]
    gemms = [("mxfp8_grouped_mm", n, k, True),  # (op, n, k, run): as plan_grouped_mm_sizes takes them
             ("mxfp8_grouped_mm", k, n, A.requires_grad),  # dgrad: grad_out (M, N) x B_t along N
             ("mxfp8_grouped_mm_wgrad", k, n, B_t.requires_grad and not wgrad_with_hp)]
    for op, gemm_n, gemm_k, run in gemms:
        if run:
            select_grouped_mm.plan_grouped_mm_sizes(op, A.device, out_dtype, rows, gemm_n, gemm_k, B_t.shape[0])


class _MXFP8GroupedMM(torch.autograd.Function):
    @staticmethod
    def forward(ctx, A, B_t, offs, out_dtype, scaling_mode, wgrad_with_hp, pad_groups, a_data, a_scale):
        sz = _signed_zeros(B_t)
        dest = None
        rows = A.shape[0]
        if pad_groups:  # the GEMMs run on the padded copy; its rows are gathered back below
            dest, offs, rows = _padded_rows(offs, rows)
        if a_data is None:
            A = A if dest is None else _scatter_rows(A, dest, rows)
            a, a_sc = api.mxfp8_quantize(A.contiguous(), -1, scaling_mode, SCALE_LAYOUT, signed_zeros=sz)
            layout, gemm_sz = SCALE_LAYOUT, sz
        else:  # pre-quantized (module docstring): the backward dequantizes them for wgrad_with_hp
            a, a_sc = (t if dest is None else _scatter_rows(t, dest, rows) for t in (a_data, a_scale))
            layout, gemm_sz = None, True  # A's bytes may hold -0 (FNUZ's NaN): rewritten where FP8 is FNUZ
        b, b_scale = _along_k(B_t, scaling_mode, sz, layout)
        ctx.save_for_backward(A if a_data is None else None, B_t, offs, dest, *((a, a_sc) if a_data is not None else ()))
        ctx.a_dtype, ctx.rows = A.dtype, rows
        ctx.out_dtype, ctx.scaling_mode, ctx.signed_zeros, ctx.wgrad_with_hp = out_dtype, scaling_mode, sz, wgrad_with_hp
        out = grouped_mm.mxfp8_grouped_mm(a, a_sc, b, b_scale, offs, out_dtype, layout, signed_zeros=gemm_sz)
        return out if dest is None else out.index_select(0, dest)

    @staticmethod
    def backward(ctx, grad_out):
        A, B_t, offs, dest, *a_quantized = ctx.saved_tensors
        mode, out_dtype, sz = ctx.scaling_mode, ctx.out_dtype, ctx.signed_zeros
        quantized_wgrad = ctx.needs_input_grad[1] and ctx.rows > 0 and not ctx.wgrad_with_hp
        if quantized_wgrad:  # before any launch (the dgrad's casts and GEMM ran first, then this refused)
            validate.multiple_of(A.shape[0], MX_BLOCK, "A.shape[0] (M, the token rows: mxfp8_grouped_mm's backward "
                                 "quantizes them in 32x1 blocks for B_t's gradient)")
            _check_wgrad_groups(offs)
        grad_out = grad_out.contiguous() if dest is None else _scatter_rows(grad_out, dest, ctx.rows)
        grad_a = grad_b_t = None
        if ctx.needs_input_grad[0]:
            g, g_scale = api.mxfp8_quantize(grad_out, -1, mode, SCALE_LAYOUT, signed_zeros=sz)
            w, w_scale = _along_k(B_t.transpose(1, 2), mode, sz)  # B_t along N, as (E, K, N)
            grad_a = grouped_mm.mxfp8_grouped_mm(g, g_scale, w, w_scale, offs, out_dtype, SCALE_LAYOUT,
                                                 signed_zeros=sz).to(ctx.a_dtype)
            if dest is not None:
                grad_a = grad_a.index_select(0, dest)
        if ctx.needs_input_grad[1] and ctx.rows == 0:  # no tokens: no 32x1 block to quantize, zero gradient
            grad_b_t = torch.zeros(B_t.shape, dtype=B_t.dtype, device=B_t.device)
        elif ctx.needs_input_grad[1] and ctx.wgrad_with_hp:  # torchao's recipe: A[g]^T @ grad_out[g] unquantized
            if a_quantized:  # A's values: the pre-quantized ones
                A = reference.mxfp8_dequantize(*a_quantized).to(ctx.a_dtype)
            # torch._grouped_mm wants its out_dtype to be its operands' (an FP16/FP32 A with a BF16 grad_out
            # promotes to FP32) and 16-byte strides (a column-major A's row stride is M elements)
            dtype = torch.promote_types(A.dtype, grad_out.dtype)
            grad_b_t = torch._grouped_mm(A.to(dtype).contiguous().t(), grad_out.to(dtype), offs=offs,
                                         out_dtype=dtype).to(B_t.dtype)
        elif quantized_wgrad:  # the token rows in 32x1 blocks, checked above (quantize's error would name its x)
            x, x_scale = api.mxfp8_quantize(grad_out, 0, mode, signed_zeros=sz)
            y, y_scale = api.mxfp8_quantize(A.contiguous(), 0, mode, signed_zeros=sz)
            grad_b_t = grouped_mm.mxfp8_grouped_mm_wgrad(x, x_scale, y, y_scale, offs, out_dtype,
                                                         signed_zeros=sz).to(B_t.dtype)
        return grad_a, grad_b_t, None, None, None, None, None, None, None


def mxfp8_grouped_mm(A, B_t, offs, out_dtype=torch.bfloat16, scaling_mode="rceil", wgrad_with_hp=False,
                     pad_token_groups_for_grouped_mm=False, a_quantized=None):
    """Differentiable MXFP8 grouped GEMM of routed experts: (M, N), rows of group g = A[g] @ B_t[g].

    A (M, K) BF16/FP16/FP32, K a multiple of 32; B_t (E, K, N), contiguous or (as torchao passes
    it) the transpose of contiguous (E, N, K) weights, N a multiple of 32; offs (E,) int32 on A's device,
    cumulative token-group ends (non-decreasing, last <= M; rows after it give 0 and get zero
    gradient); out_dtype bfloat16 or float32; scaling_mode "rceil" or "floor". The backward needs
    group sizes and M multiples of 32, unless wgrad_with_hp (B_t's gradient by torch._grouped_mm,
    unquantized) or pad_token_groups_for_grouped_mm (groups padded to multiples of 32 on the
    device): torchao's options of the same names (module docstring). a_quantized: (data, scales)
    of A pre-quantized 1x32 (module docstring; needs wgrad_with_hp).
    """
    wgrad_with_hp = validate.flag(wgrad_with_hp, "wgrad_with_hp")
    pad = validate.flag(pad_token_groups_for_grouped_mm, "pad_token_groups_for_grouped_mm")
    a_data = a_scale = None
    if a_quantized is not None:
        a_data, a_scale = _check_quantized(A, a_quantized, wgrad_with_hp)
    _check(A, B_t, offs, out_dtype, scaling_mode, quantized=a_data is not None)
    if pad and not validate.tracing(offs):  # the GEMMs see only the padded ends (not while tracing: values)
        grouped_mm.check_host_offs(check_grouped_mm_offs, offs, A.shape[0])
    _refuse_unsupported_gemms(A, B_t, offs, out_dtype, pad, wgrad_with_hp)
    return _MXFP8GroupedMM.apply(A, B_t, offs, out_dtype, scaling_mode, wgrad_with_hp, pad, a_data, a_scale)
