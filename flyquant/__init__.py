"""flyquant: FlyDSL kernels for MX-format Mixture-of-Experts on AMD Instinct GPUs.

MXFP8 quantize (1x32, 32x1, dual, 3D per expert), MXFP4 quantize (rowwise, columnwise, dual, 3D
experts; aiter's a4w4/a16w4 layouts), the MXFP8 grouped GEMMs of MoE training (flyquant.training
wraps them in an autograd op) and the A16W4 MoE layer (moe_sorting, the stage-1 and stage-2 GEMMs,
fused_moe) for gfx942 (MI300X) and gfx950 (MI355X), each dispatched by a selector to a kernel or
the PyTorch reference (`flyquant.reference`); `flyquant.emu` runs the kernels on a CPU.
"""

from importlib import metadata as _metadata
from importlib import util as _util
from pathlib import Path as _Path


def _check_kernels_beside_package() -> None:
    """flyquant.kernels must be this copy's: kernels/ beside flyquant/ (a checkout, installed
    editable) or flyquant/kernels (a wheel). Run from a checkout whose flyquant was installed
    otherwise, the source tree's flyquant has no kernels (a ModuleNotFoundError at the first
    launch) or another copy's editable mapping supplies them (code of two versions mixed)."""
    here = _Path(__file__).resolve().parent
    spec = _util.find_spec(__name__ + ".kernels")
    found = _Path(spec.origin).resolve().parent if spec is not None and spec.origin else None
    if found not in (here / "kernels", here.parent / "kernels"):
        raise ImportError(
            f"flyquant imported from {here} finds its kernels {'nowhere' if found is None else f'in {found}'}: a "
            f"source checkout is importable as flyquant only when installed editable (pip install -e .), "
            f"else run from another directory (the installed flyquant is then imported)")


_check_kernels_beside_package()

from . import emu, nn, reference, training  # noqa: E402
from .api import (
    dequantize_mxfp4,
    explain,
    mxfp4_quantize,
    mxfp4_quantize_3d,
    mxfp4_quantize_dual,
    mxfp8_dequantize,
    mxfp8_quantize,
    mxfp8_quantize_3d,
    mxfp8_quantize_dual,
    quantize_mxfp4,
    shuffle_scale_a16w4,
    shuffle_weight_a16w4,
    warmup,
)
from .api_moe import fused_moe, moe_block_m, moe_gemm1_a16w4, moe_gemm2_a16w4, moe_sorting, moe_stage2
from .grouped_mm import mxfp8_grouped_mm, mxfp8_grouped_mm_wgrad
from .moe import moe_routing
from .select import Plan

try:
    __version__ = _metadata.version("flyquant")  # pyproject.toml's, as installed
except _metadata.PackageNotFoundError:  # imported from a source tree that was never installed
    __version__ = "unknown"

__all__ = [
    "Plan",
    "dequantize_mxfp4",
    "emu",
    "explain",
    "fused_moe",
    "moe_block_m",
    "moe_gemm1_a16w4",
    "moe_gemm2_a16w4",
    "moe_routing",
    "moe_sorting",
    "moe_stage2",
    "mxfp4_quantize",
    "mxfp4_quantize_3d",
    "mxfp4_quantize_dual",
    "mxfp8_dequantize",
    "mxfp8_grouped_mm",
    "mxfp8_grouped_mm_wgrad",
    "mxfp8_quantize",
    "mxfp8_quantize_3d",
    "mxfp8_quantize_dual",
    "nn",
    "quantize_mxfp4",
    "reference",
    "shuffle_scale_a16w4",
    "shuffle_weight_a16w4",
    "training",
    "warmup",
]
