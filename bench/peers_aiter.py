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

MXFP4 (the fp4_* kinds): aiter's Triton `_dynamic_mxfp4_quant_kernel`
(aiter/ops/triton/_triton_kernels/quant.py, which imports only Triton) launched by its own
wrapper `dynamic_mxfp4_quant` (aiter/ops/triton/quant.py): that file is executed from its path
with the two aiter modules it imports (the kernels file above and its logger, both torch/Triton
only) placed in sys.modules for the duration of the load and removed after, so `import aiter`
never runs. The wrapper then runs as it is (its shape-dependent block sizes, warps, stages; the
scale tensor it allocates as a transposed (blocks, M) buffer); its launch `kernel[grid](...)` is
caught, compiled for the row's arch (bench/peers.py) and run under flyquant.emu. Its only
rounding is "even" (SCALING_MODE 0); other modes' rows say so. fp4_32x1 is the wrapper on the
transposed view of x (it reads by strides, no copy), as the MXFP8 32x1 cast above. The outputs
are compared byte for byte with flyquant.reference (data, and scales by index: aiter's are
column-major). aiter's Triton has no dual, a4w4-shuffled or a16w4 quantize: a user runs this
kernel and then torch shuffles (or its fused_rms_mxfp4_quant, which also applies RMSNorm).
"""

from __future__ import annotations

import contextlib
import importlib.util
import sys
from pathlib import Path

import torch

import peers

NAME = "aiter triton"
BLOCK_OUT_DIM, BLOCK_QUANT_DIM, NUM_WARPS = 128, 32, 8  # aiter's downcast_to_mxfp
ROUNDING = {"rceil": 0, "floor": 1}  # DequantScaleRoundingMode.ROUND_UP / ROUND_DOWN
NO_KERNEL = {"dual": "aiter has no cast to both orientations at once", "3d": "aiter has no 3D (per-expert) MXFP8 cast"}
MXFP4_MODE = "even"  # dynamic_mxfp4_quant's only rounding (SCALING_MODE=0)
MXFP4_AXIS = {"fp4_1x32": -1, "fp4_32x1": 0}  # the kinds aiter has a Triton kernel for
MXFP4_NO_KERNEL = {
    "fp4_dual": "aiter has no MXFP4 quantize to both orientations at once (two launches: fp4_1x32, fp4_32x1)",
    "fp4_a4w4": "aiter's Triton MXFP4 quantize writes the plain layout (a4w4: shuffle_weight and e8m0_shuffle after)",
    "fp4_3d_a16w4": "aiter's Triton MXFP4 quantize writes the plain layout (a16w4: its torch shuffles after)",
}
_module = None
_mxfp4_wrapper = None


def _aiter_file(relative: str, name: str):
    """The module of aiter/<relative>, executed from its path (no `import aiter`)."""
    spec = importlib.util.find_spec("aiter")
    if spec is None or not spec.submodule_search_locations:
        raise ImportError("aiter (amd-aiter) is not installed")
    module_spec = importlib.util.spec_from_file_location(name, Path(spec.submodule_search_locations[0]) / relative)
    module = importlib.util.module_from_spec(module_spec)
    module_spec.loader.exec_module(module)
    return module


def load():
    """aiter's quant_moe Triton kernels module, loaded by file path."""
    global _module
    if _module is None:
        _module = _aiter_file("ops/triton/_triton_kernels/quant_moe.py", "aiter_triton_quant_moe")
    return _module


@contextlib.contextmanager
def _modules_named(modules: dict):
    """`modules` in sys.modules under their aiter names while the block runs, then removed."""
    previous = {name: sys.modules.get(name) for name in modules}
    sys.modules.update(modules)
    try:
        yield
    finally:
        for name, module in previous.items():
            if module is None:
                sys.modules.pop(name, None)
            else:
                sys.modules[name] = module


def load_mxfp4_wrapper():
    """aiter/ops/triton/quant.py (dynamic_mxfp4_quant), its two aiter imports loaded by path."""
    global _mxfp4_wrapper
    if _mxfp4_wrapper is None:
        imports = {
            "aiter.ops.triton._triton_kernels.quant": _aiter_file("ops/triton/_triton_kernels/quant.py",
                                                                  "aiter_triton_quant_kernels"),
            "aiter.ops.triton.utils.logger": _aiter_file("ops/triton/utils/logger.py", "aiter_triton_logger"),
        }
        with _modules_named(imports):
            _mxfp4_wrapper = _aiter_file("ops/triton/quant.py", "aiter_triton_quant")
    return _mxfp4_wrapper


class _CaughtLaunch:
    """Stands for the wrapper's kernel: `kernel[grid](*args, **kwargs)` records the launch."""

    def __init__(self, kernel):
        self.kernel, self.launches = kernel, []

    def __getitem__(self, grid):
        return lambda *args, **kwargs: self.launches.append((grid, args, kwargs))


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
    if kind.startswith("fp4_"):
        return mxfp4_peer_rows(kind, mode, x, arch)
    if kind in NO_KERNEL:
        return [{"peer": NAME, "status": NO_KERNEL[kind]}]
    config = f"{BLOCK_OUT_DIM}x{BLOCK_QUANT_DIM} w{NUM_WARPS}"
    data, scales, stats, res = _launch(kind, mode, x, arch)
    row = {"peer": NAME, "config": config, "default": True, "best": True}
    return [row | peers.measured(stats, res, x, peers.difference(kind, mode, x, data, scales))]


def _mxfp4_launch(kind: str, x: torch.Tensor, arch: str):
    """dynamic_mxfp4_quant on x (fp4_1x32) or on its transposed view (fp4_32x1), its launch run
    under flyquant.emu: (data, scales, stats, resources, config)."""
    wrapper = load_mxfp4_wrapper()
    caught = _CaughtLaunch(wrapper._dynamic_mxfp4_quant_kernel)
    wrapper._dynamic_mxfp4_quant_kernel = caught
    try:
        data, scales = wrapper.dynamic_mxfp4_quant(x if MXFP4_AXIS[kind] == -1 else x.t(), MXFP4_MODE)
    finally:
        wrapper._dynamic_mxfp4_quant_kernel = caught.kernel
    ((grid, positional, kwargs),) = caught.launches
    names = caught.kernel.arg_names
    args = dict(zip(names, positional)) | {k: v for k, v in kwargs.items() if k in names}
    options = {k: v for k, v in kwargs.items() if k not in names}
    num_warps, num_stages = options.pop("num_warps"), options.pop("num_stages")
    kernel = peers.compile_kernel(caught.kernel, arch, args, num_warps, num_stages, **options)
    stats = peers.run_kernel(kernel, grid, args)
    config = (f"{args['BLOCK_SIZE_M']}x{args['BLOCK_SIZE_N']} iter{args['NUM_ITER']} w{num_warps} "
              f"s{args['NUM_STAGES']}")
    return data, scales, stats, peers.resources(kernel), config


def mxfp4_peer_rows(kind: str, mode: str, x: torch.Tensor, arch: str) -> list[dict]:
    """aiter's Triton MXFP4 quantize (one configuration: its wrapper's) on x, checked byte for byte
    against flyquant.reference."""
    from flyquant import reference

    if kind in MXFP4_NO_KERNEL:
        return [{"peer": NAME, "status": MXFP4_NO_KERNEL[kind]}]
    if mode != MXFP4_MODE:
        return [{"peer": NAME, "status": f"aiter's dynamic_mxfp4_quant only rounds {MXFP4_MODE!r} (not {mode})"}]
    data, scales, stats, res, config = _mxfp4_launch(kind, x, arch)
    want_d, want_s = reference.mxfp4_quantize(x, MXFP4_AXIS[kind], mode)
    diff = peers.byte_difference("flyquant.reference", (("data", data, want_d), ("scales", scales, want_s)))
    return [{"peer": NAME, "config": config, "default": True, "best": True} | peers.measured(stats, res, x, diff)]
