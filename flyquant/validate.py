"""Input checks shared by the reference, the public API and the kernel launchers.

Each check raises TypeError (wrong type or dtype) or ValueError (wrong rank, shape, value,
device or layout) with a message that names the argument and the rule it broke.
"""

from __future__ import annotations

import math
import numbers
import operator
from typing import Iterable, Optional

import torch
from torch._guards import detect_fake_mode

from .formats import MX_BLOCK, MXFP4_SCALING_MODES, SCALING_MODES

HIGH_PRECISION_DTYPES = (torch.bfloat16, torch.float16, torch.float32)
SCALE_LAYOUTS = (None, "tcgen05", "mfma")
OFFS_GROUP_MULTIPLE = 128  # torchao's grouped-GEMM contract: every token group is a multiple of 128


def _dtype_names(dtypes: Iterable[torch.dtype]) -> str:
    return ", ".join(str(d).replace("torch.", "") for d in dtypes)


def tracing(*tensors) -> bool:
    """Whether there are no values or addresses to check: while torch.compile traces, under an
    active FakeTensorMode (make_fx, export), or when a given tensor is fake or wraps one (the ops'
    fakes, functionalization; data_ptr() is 0)."""
    return torch.compiler.is_compiling() or fake(*tensors)


def fake(*tensors) -> bool:
    """Under an active FakeTensorMode, or a given tensor is fake or wraps one (no values, no addresses)."""
    return detect_fake_mode(tensors) is not None


def tensor(x, name: str, dtypes: Optional[Iterable[torch.dtype]] = None, ndim=None) -> None:
    """`x` is a torch.Tensor, with a dtype in `dtypes` and rank `ndim` (an int or a tuple of ints)."""
    if not isinstance(x, torch.Tensor):
        raise TypeError(f"{name} must be a torch.Tensor, got {type(x).__name__}")
    # else "must be contiguous, got strides (0, 0)" or torch's dispatch error; not while tracing (dynamo's strict
    # mode in an autograd.Function's backward refuses .layout; traced tensors are dense)
    if not torch.compiler.is_compiling() and (x.layout != torch.strided or x.is_nested):
        raise TypeError(f"{name} must be a dense tensor (torch.strided), got {'a nested tensor' if x.is_nested else x.layout}")
    if dtypes is not None:
        dtypes = tuple(dtypes)
        if x.dtype not in dtypes:
            raise TypeError(f"{name} must have dtype in ({_dtype_names(dtypes)}), got {x.dtype}")
    if ndim is not None:
        allowed = (ndim,) if isinstance(ndim, int) else tuple(ndim)
        if x.dim() not in allowed:
            want = " or ".join(f"{n}D" for n in allowed)
            raise ValueError(f"{name} must be {want}, got {x.dim()}D with shape {tuple(x.shape)}")


def high_precision(x, name: str, ndim=None) -> None:
    """A BF16/FP16/FP32 tensor of the given rank (the inputs of every quantize op)."""
    tensor(x, name, HIGH_PRECISION_DTYPES, ndim)


def is_int(value) -> bool:
    """An int that is not a bool (True would otherwise pass as 1 for topk, block_m, k_batch ...); a
    SymInt too (a size traced under torch.compile(dynamic=True), as the ops' fakes see it)."""
    return isinstance(value, (int, torch.SymInt)) and not isinstance(value, bool)


def as_int(value):
    """A numpy integer as an int, anything else unchanged (the checks then name it): the public
    ops take sizes and axes computed with numpy as the ints they are (a bool stays a bool)."""
    return int(value) if isinstance(value, numbers.Integral) and not isinstance(value, bool) else value


def integer(value) -> int | None:
    """value as an int when it is an integer (numpy's too: operator.index), not a bool; else None."""
    if isinstance(value, bool):
        return None
    try:
        return operator.index(value)
    except TypeError:
        return None


def flag(value, name: str) -> bool:
    """`value` if it is a bool (an int or a string such as "false" would pass a truth test)."""
    if not isinstance(value, bool):
        raise ValueError(f"{name} must be a bool, got {value!r}")
    return value


SIGNED_ZEROS_DOC = """signed_zeros=False: every zero element is written +0 (E4M3 0x00), never -0 (0x80):
the same values, bytes that differ from torchao's where an element rounds to -0. Only the
MXFP8 grouped GEMM on gfx942 gains: given signed_zeros=False it reads such operands as FNUZ
codes without rewriting them (FP8 is FNUZ there, where 0x80 is NaN), which its operands must
then be: no 0x80 byte, and NaN codes only in blocks whose scale is NaN (0xFF), as these
quantize ops write them."""


def real_number(value, name: str) -> None:
    """A real number (int or float, numpy's too), not a bool or a string: float() would take True as
    1.0 and "7" as 7.0, and fail on None naming nothing."""
    if isinstance(value, bool) or not isinstance(value, numbers.Real):
        raise TypeError(f"{name} must be a real number, got {value!r}")


def multiple_of(value: int, divisor: int, what: str, zero: bool = False) -> None:
    """`value` (described by `what`, e.g. "x.shape[1] (K)") is a positive multiple of `divisor`
    (zero: or 0)."""
    if value < 0 or (value == 0 and not zero) or value % divisor:
        raise ValueError(f"{what} = {value} must be a {'' if zero else 'positive '}multiple of {divisor}")


def block_dim(x: torch.Tensor, dim: int, name: str, label: str, block: int = MX_BLOCK) -> None:
    """The dimension quantized in blocks is a positive multiple of the block size."""
    multiple_of(x.shape[dim], block, f"{name}.shape[{dim}] ({label}, quantized in blocks of {block})")


def scaling_mode(mode, modes=SCALING_MODES) -> None:
    if mode not in modes:
        raise ValueError(f"scaling_mode must be one of {modes}, got {mode!r}")


MXFP4_SCALE_LAYOUTS = (None, "mfma")
MXFP4_SHUFFLES = (None, "a4w4")
A4W4_ROW_MULTIPLE, A4W4_K_MULTIPLE = 16, 64  # aiter shuffle_weight(layout=(16, 16)): 16 rows x 32 bytes


def mxfp4_quantize_args(x, axis, scaling_mode_, scale_layout_, shuffle, name: str = "x") -> int:
    """The checks of every MXFP4 quantize path: x BF16/FP16/FP32 of rank >= 1, contiguous; axis
    -1 / x.dim() - 1 (rowwise) or 0 / -x.dim() (columnwise; a 1-D x is one row); a mode of
    MXFP4_SCALING_MODES; scale_layout None or "mfma" and shuffle None or "a4w4", both rowwise only,
    "a4w4" with M (leading dims flattened) % 16 == 0 and K % 64 == 0. Returns the axis as -1 or 0."""
    high_precision(x, name)
    if x.dim() < 1:
        raise ValueError(f"{name} must have at least 1 dimension")
    # -1 and 0 as TransformerEngine's flattened (M, K) view has them (a 1-D x: one row, so 0 is
    # columnwise); of a 2-D or higher x also its last dim's and its first dim's other names
    last, first = ((-1, x.dim() - 1), (0, -x.dim())) if x.dim() > 1 else ((-1,), (0,))
    axis = as_int(axis)
    if not is_int(axis) or axis not in last + first:
        raise ValueError(f"axis must be {' or '.join(map(str, last))} (rowwise, blocks along the last dim) or "
                         f"{' or '.join(map(str, first))} (columnwise, along the flattened leading dims), got {axis!r}")
    scaling_mode(scaling_mode_, MXFP4_SCALING_MODES)
    if scale_layout_ not in MXFP4_SCALE_LAYOUTS:
        raise ValueError(f"scale_layout must be one of {MXFP4_SCALE_LAYOUTS}, got {scale_layout_!r}")
    if shuffle not in MXFP4_SHUFFLES:
        raise ValueError(f"shuffle must be one of {MXFP4_SHUFFLES}, got {shuffle!r}")
    contiguous(x, name)
    axis = 0 if axis in first else -1
    if axis == 0 and (scale_layout_ is not None or shuffle is not None):
        given = ", ".join(f"{k}={v!r}" for k, v in (("scale_layout", scale_layout_), ("shuffle", shuffle)) if v is not None)
        raise ValueError(f"{given}: rowwise only (axis=-1); the columnwise quantize returns plain outputs")
    if shuffle == "a4w4":
        m = math.prod(x.shape[:-1])
        if m % A4W4_ROW_MULTIPLE or x.shape[-1] % A4W4_K_MULTIPLE:
            raise ValueError(f"shuffle='a4w4' needs M (rows, leading dims flattened) = {m} a multiple of "
                             f"{A4W4_ROW_MULTIPLE} and K = {x.shape[-1]} a multiple of {A4W4_K_MULTIPLE} "
                             "(aiter's shuffle_weight tiles of 16 rows x 64 FP4 values)")
    return axis


def scale_layout(layout) -> None:
    if layout not in SCALE_LAYOUTS:
        raise ValueError(f"scale_layout must be one of {SCALE_LAYOUTS}, got {layout!r}")


def contiguous(x: torch.Tensor, name: str) -> None:
    if not x.is_contiguous():
        raise ValueError(f"{name} must be contiguous (row-major), got strides {x.stride()} for shape {tuple(x.shape)}")


def mxfp8_3d_transposed(w: torch.Tensor) -> bool:
    """Which of the two (E, N, K) layouts the 3D quantize accepts w has: False for contiguous
    (strides (N*K, K, 1)), True for the transpose of a contiguous (E, K, N) tensor (strides
    (N*K, 1, N): N, the quantized dim, is the contiguous one). Anything else is refused with the
    same error on every backend."""
    if w.is_contiguous():
        return False
    if w.transpose(1, 2).is_contiguous():
        return True
    e, n, k = w.shape
    raise ValueError(
        f"w must be contiguous (row-major), got strides {w.stride()} for shape {tuple(w.shape)}; the 3D "
        f"quantize takes (E, N, K) with strides {(n * k, k, 1)} (row-major) or {(n * k, 1, n)} (the "
        f"transpose of a contiguous (E, K, N) tensor, quantized along its contiguous dim N)")


def same_device(name_a: str, a: torch.Tensor, name_b: str, b: torch.Tensor) -> None:
    if a.device != b.device:
        raise ValueError(f"{name_b} must be on the device of {name_a} ({a.device}), got {b.device}")


def device(value, name: str = "device") -> torch.device:
    """torch.device(value) for a torch.device, a device string or an index; torch's own errors for a
    malformed one ('gpu', '', 1.5, True) name no argument. A well-formed device torch cannot reach
    (an index without an accelerator) keeps torch's error."""
    if isinstance(value, torch.device):
        return value
    want = f"{name} must be a torch.device, a device string such as 'cpu' or 'cuda:0', or a device index"
    if isinstance(value, str):
        try:
            return torch.device(value)
        except RuntimeError as exc:
            raise ValueError(f"{want}, got {value!r} ({exc})") from None
    if isinstance(value, bool) or not isinstance(value, numbers.Integral):
        raise TypeError(f"{want}, got {value!r}")
    if value < 0:
        raise ValueError(f"{want}, got {value!r}")
    return torch.device(int(value))


def shape(x: torch.Tensor, name: str, expected: tuple) -> None:
    if tuple(x.shape) != tuple(expected):
        raise ValueError(f"{name} must have shape {tuple(expected)}, got {tuple(x.shape)}")


def mxfp8_2d_axis(x, axis) -> int:
    """Check a 2D MXFP8 quantize input and normalize `axis`: 1 ("1x32", blocks along K, axis -1
    or 1) or 0 ("32x1", blocks along M, axis 0 or -2)."""
    high_precision(x, "x", ndim=2)
    axis = as_int(axis)
    if is_int(axis):  # not a bool or a float: True or 1.0 would equal 1 in the tuples below
        if axis in (-1, 1):
            return 1
        if axis in (0, -2):
            return 0
    raise ValueError(f"axis must be -1 or 1 (1x32, blocks along K) or 0 or -2 (32x1, blocks along M), got {axis!r}")


def offs(group_offs, x: torch.Tensor, rows: int) -> None:
    """torchao's token-group contract: `offs` is a 1D contiguous int32 tensor of group end offsets
    along the `rows` (M) dimension, on x's device, non-decreasing, ending at `rows`, and every
    group size (including the first, from 0) a multiple of 128. Reads the values (a host sync
    on a GPU), except while torch.compile traces, where there are none: the op's body checks them
    when the graph runs (nor of a FakeTensor). Contiguous on every backend, so a call succeeds or
    fails the same way on both: the kernels read offs as a packed int32 array."""
    offs_tensor(group_offs, "x", x)
    if not tracing(group_offs):
        offs_values(group_offs, rows, OFFS_GROUP_MULTIPLE, exact_end=True)


def offs_tensor(group_offs, x_name: str, x: torch.Tensor) -> None:
    """The structure of a token-group `offs` (no values read, so safe while torch.compile
    traces): a 1D contiguous int32 tensor of at least one group end offset, on x's device."""
    tensor(group_offs, "offs", (torch.int32,), ndim=1)
    same_device(x_name, x, "offs", group_offs)
    if not group_offs.is_contiguous():
        raise ValueError(
            f"offs must be contiguous (stride 1), got stride {group_offs.stride()[0]}: pass offs.contiguous()"
        )
    if group_offs.numel() == 0:
        raise ValueError("offs must hold at least one group end offset")


def offs_values(group_offs: torch.Tensor, rows: int, multiple: int, exact_end: bool) -> None:
    """offs' values (read on the host: a sync on a GPU): non-decreasing from 0, the last equal to
    `rows` (exact_end) or at most `rows`, every group size a multiple of `multiple`."""
    ends = group_offs.to("cpu", torch.int64)
    sizes = torch.diff(ends, prepend=ends.new_zeros(1))
    if (sizes < 0).any():
        raise ValueError(f"offs must be non-decreasing from 0, got {ends.tolist()}")
    if exact_end and ends[-1].item() != rows:
        raise ValueError(f"offs[-1] must equal M = {rows} (the last group ends at the last row), got {ends[-1].item()}")
    if ends[-1].item() > rows:
        raise ValueError(f"offs[-1] must be at most M = {rows} (groups end within the rows), got {ends[-1].item()}")
    bad = sizes % multiple != 0
    if bad.any():
        raise ValueError(
            f"every token group size must be a multiple of {multiple}; "
            f"offs {ends.tolist()} gives sizes {sizes.tolist()}"
        )


def byte_extent(x: torch.Tensor) -> tuple[int, int] | None:
    """[first, last + 1) byte addresses of x's elements (strides of any sign), None when empty."""
    if x.numel() == 0:
        return None
    lo = sum((n - 1) * s for n, s in zip(x.shape, x.stride()) if s < 0)
    hi = sum((n - 1) * s for n, s in zip(x.shape, x.stride()) if s > 0)
    start = x.data_ptr() + lo * x.element_size()
    return start, x.data_ptr() + (hi + 1) * x.element_size()


def _root(t: torch.Tensor) -> torch.Tensor:
    """The tensor t is a view of (t itself if it is none's)."""
    return t if t._base is None else t._base


def no_overlap(out: torch.Tensor, out_name: str, inputs: dict) -> None:
    """The output `out` shares no memory with any input (name -> tensor or None), as torch's out=
    ops require: an input read after the output was written to would give a wrong result.
    Conservative: byte ranges that interleave without sharing an element count as overlapping.
    While torch.compile traces there are no addresses (nor storage offsets): an input that is
    `out`, or a view of the tensor `out` views, is refused whatever part it holds (memory shared
    any other way is not seen there; fused_moe(out=x) under torch.compile returned zeros). The
    same for FakeTensors (all at address 0)."""
    if tracing(out):
        for name, t in inputs.items():
            if t is not None and t.numel() and out.numel() and (t is out or _root(t) is _root(out)):
                raise ValueError(f"{out_name} must not share memory with the input {name} (under torch.compile a "
                                 f"view of the same tensor counts as shared); pass a separate {out_name} tensor")
        return
    span = byte_extent(out)
    if span is None:
        return
    for name, t in inputs.items():
        other = None if t is None or t.device != out.device else byte_extent(t)
        if other is not None and other[0] < span[1] and span[0] < other[1]:
            raise ValueError(f"{out_name} must not overlap the input {name} (the same memory would be read and "
                             f"written); pass a separate {out_name} tensor")


def no_self_overlap(out: torch.Tensor, name: str) -> None:
    """The output `out` has no two elements at one address (an expand()ed or stride-0 view, or
    strides that interleave): each would be written by several results, one of them kept. From
    the strides alone (no addresses: torch.compile traces it), conservatively: sorted by stride,
    each dim's stride is past the span of the smaller ones."""
    dims = []  # (|stride|, size) in increasing stride, by insertion: torch.compile cannot sort symbolic strides
    for size, stride in zip(out.shape, out.stride()):
        if size > 1:
            i = 0
            while i < len(dims) and dims[i][0] <= abs(stride):
                i += 1
            dims.insert(i, (abs(stride), size))
    span = 0  # elements covered by the dims of smaller stride, minus one
    for stride, size in dims:
        if stride <= span:
            raise ValueError(f"{name} must not have elements sharing memory (an expand()ed or overlapping view), got "
                             f"strides {out.stride()} for shape {tuple(out.shape)}; pass a tensor of its own")
        span += stride * (size - 1)


def no_autograd(op: str, inputs: dict) -> None:
    """None of the inputs (name -> tensor or None) requires grad while grad mode is on: `op` has no
    backward, and returning an output detached from the graph would lose the gradient silently.
    Anything else is left to the argument's own check (a list here was an AttributeError)."""
    if not torch.is_grad_enabled():
        return
    for name, t in inputs.items():
        if isinstance(t, torch.Tensor) and t.requires_grad:
            raise ValueError(f"{op} does not support autograd: {name} requires grad; detach {name} (or run "
                             f"under torch.no_grad()) if no gradient should flow through {op}")
