"""Device-like placement of CPU tensors, so the emulator's line counts are a GPU's.

The emulator counts 128-byte lines by address (flyquant.emu.stats). hipMalloc places
allocations on 256-byte boundaries; torch's CPU allocator only on 64, so a CPU tensor may start
mid-line and show split lines that the same kernel never has on a GPU. Benches and tests that
report or assert coalescing put their tensors here first.
"""

from __future__ import annotations

import contextlib
import math

import torch

from .stats import LINE_BYTES

HIPMALLOC_ALIGN = 256  # bytes

_torch_empty, _torch_zeros, _torch_empty_strided = torch.empty, torch.zeros, torch.empty_strided


def aligned_empty(shape, dtype: torch.dtype, device="cpu", align: int = HIPMALLOC_ALIGN) -> torch.Tensor:
    """torch.empty starting at a multiple of `align` bytes. Untouched pages of a large CPU
    tensor cost no memory."""
    nbytes = math.prod(shape) * dtype.itemsize
    buf = _torch_empty(nbytes + align, dtype=torch.uint8, device=device)
    start = -buf.data_ptr() % align
    return buf[start : start + nbytes].view(dtype).view(shape)


def aligned(t: torch.Tensor, align: int = HIPMALLOC_ALIGN) -> torch.Tensor:
    """A contiguous copy of `t` in an `aligned_empty` tensor."""
    out = aligned_empty(tuple(t.shape), t.dtype, t.device, align)
    out.copy_(t)
    return out


@contextlib.contextmanager
def device_like_allocations():
    """Inside the block, torch.empty / zeros / empty_strided of CPU tensors (with at most dtype and
    device given) return tensors on `aligned_empty` storage: the outputs a launcher allocates then
    sit where hipMalloc would put them. Other calls go to torch unchanged; `misaligned` on the
    outputs checks that it took effect. Not thread-safe (it swaps torch's functions)."""

    def empty(*size, dtype=None, device=None, **other):
        shape = tuple(size[0]) if len(size) == 1 and isinstance(size[0], (tuple, list, torch.Size)) else size
        if other or (device is not None and torch.device(device).type != "cpu"):
            return _torch_empty(*size, dtype=dtype, device=device, **other)
        return aligned_empty(tuple(int(d) for d in shape), dtype or torch.get_default_dtype())

    def zeros(*size, dtype=None, device=None, **other):
        if other:
            return _torch_zeros(*size, dtype=dtype, device=device, **other)
        return empty(*size, dtype=dtype, device=device).zero_()

    def empty_strided(size, stride, dtype=None, device=None, **other):
        if other or (device is not None and torch.device(device).type != "cpu"):
            return _torch_empty_strided(size, stride, dtype=dtype, device=device, **other)
        extent = 1 + sum((n - 1) * st for n, st in zip(size, stride)) if all(size) else 0
        return aligned_empty((extent,), dtype or torch.get_default_dtype()).as_strided(size, stride)

    torch.empty, torch.zeros, torch.empty_strided = empty, zeros, empty_strided
    try:
        yield
    finally:
        torch.empty, torch.zeros, torch.empty_strided = _torch_empty, _torch_zeros, _torch_empty_strided


def misaligned(tensors, align: int = LINE_BYTES) -> int:
    """How many of `tensors` do not start on a 128-byte line (their line counts include a split)."""
    return sum(1 for t in tensors if t.numel() and t.data_ptr() % align)
