"""aiter's Triton MXFP8 cast beside our quantize rows (`bench/quantize.py --vs aiter`).

aiter (amd-aiter 0.1.7) casts to MXFP8 with `_downcast_to_mxfp` in
aiter/ops/triton/_triton_kernels/quant_moe.py (its wrapper `downcast_to_mxfp` in
aiter/ops/triton/quant_moe.py: 128 x 32 blocks, 8 warps, no autotuning). That file imports only
torch and Triton, so it is loaded by path, without `import aiter` (which needs ROCm), and compiled
for the chosen arch like torchao's kernels (bench/peers.py). The launch is the wrapper's: axis -1
(1x32) on the row-major input; axis 0 (32x1) on the transposed view of the input (the kernel
reads it by strides; no copy) into a (K, M) output, i.e. our column-major data and (K, M/32)
scales. Modes: rceil -> DequantScaleRoundingMode.ROUND_UP, floor -> ROUND_DOWN; aiter divides
the block max by 448 and takes the exponent of that quotient (rounded up or down), which is not
OCP's floor (a power of two of the max, minus 8), so floor outputs differ from to_mx: the row
says where. aiter has no 3D and no dual cast.
"""

from __future__ import annotations

import importlib.util
from pathlib import Path

import torch

import peers

NAME = "aiter triton"
BLOCK_OUT_DIM, BLOCK_QUANT_DIM, NUM_WARPS = 128, 32, 8  # aiter's downcast_to_mxfp
ROUNDING = {"rceil": 0, "floor": 1}  # DequantScaleRoundingMode.ROUND_UP / ROUND_DOWN
NO_KERNEL = {"dual": "aiter has no cast to both orientations at once", "3d": "aiter has no 3D (per-expert) MXFP8 cast"}
_module = None


def load():
    """aiter's quant_moe Triton kernels module, loaded by file path."""
    global _module
    if _module is None:
        spec = importlib.util.find_spec("aiter")
        if spec is None or not spec.submodule_search_locations:
            raise ImportError("aiter (amd-aiter) is not installed")
        path = Path(spec.submodule_search_locations[0]) / "ops/triton/_triton_kernels/quant_moe.py"
        module_spec = importlib.util.spec_from_file_location("aiter_triton_quant_moe", path)
        _module = importlib.util.module_from_spec(module_spec)
        module_spec.loader.exec_module(_module)
    return _module


def _launch(kind: str, mode: str, x: torch.Tensor, arch: str):
    rows, cols = x.shape
    src = x if kind == "1x32" else x.t()  # the wrapper's transpose(axis, -1): a view
    outer, quant = src.shape
    data = torch.empty(outer, quant, dtype=torch.float8_e4m3fn)
    scales = torch.empty(outer, quant // 32, dtype=torch.uint8)
    args = {
        "mx_tensor_ptr": data, "stride_mxt_outer": data.stride(0), "stride_mxt_quant": data.stride(1),
        "mx_scale_ptr": scales, "stride_mx_scale_outer": scales.stride(0), "stride_mx_scale_quant": scales.stride(1),
        "src_ptr": src, "stride_src_outer": src.stride(0), "stride_src_quant": src.stride(1),
        "outer_dim": outer, "quant_dim": quant, "BLOCK_SIZE_OUT_DIM": BLOCK_OUT_DIM,
        "BLOCK_SIZE_QUANT_DIM": BLOCK_QUANT_DIM, "DEQUANT_SCALE_ROUNDING_MODE": ROUNDING[mode],
    }
    kernel = peers.compile_kernel(load()._downcast_to_mxfp, arch, args, NUM_WARPS, 1)
    grid = (peers.ceil_div(outer, BLOCK_OUT_DIM), peers.ceil_div(quant, BLOCK_QUANT_DIM))
    stats = peers.run_kernel(kernel, grid, args)
    return data, scales, stats, peers.resources(kernel)


def peer_rows(kind: str, mode: str, x: torch.Tensor, arch: str, which: str) -> list[dict]:
    """One row: aiter's only configuration (`which` does not apply: there is no autotuning)."""
    if kind in NO_KERNEL:
        return [{"peer": NAME, "status": NO_KERNEL[kind]}]
    config = f"{BLOCK_OUT_DIM}x{BLOCK_QUANT_DIM} w{NUM_WARPS}"
    data, scales, stats, res = _launch(kind, mode, x, arch)
    row = {"peer": NAME, "config": config, "default": True, "best": True}
    return [row | peers.measured(stats, res, x, peers.difference(kind, mode, x, data, scales))]
