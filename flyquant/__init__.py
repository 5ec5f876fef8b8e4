"""flyquant: FlyDSL kernels for MX-format Mixture-of-Experts on AMD Instinct GPUs.

MXFP8 quantize (1x32, 32x1, dual, 3D per expert), MXFP4 quantize (rowwise, columnwise, dual, 3D
experts; aiter's a4w4/a16w4 layouts), the MXFP8 grouped GEMMs of MoE training (flyquant.training
wraps them in an autograd op) and the A16W4 MoE layer (moe_sorting, the stage-1 and stage-2 GEMMs,
fused_moe) for gfx942 (MI300X) and gfx950 (MI355X), each dispatched by a selector to a kernel or
the PyTorch reference (`flyquant.reference`); `flyquant.emu` runs the kernels on a CPU.
"""


def _installed_version() -> str | None:
    """pyproject.toml's version, as installed (None: no flyquant distribution is installed)."""
    from importlib import metadata

    try:
        return metadata.version("flyquant")
    except metadata.PackageNotFoundError:
        return None


def _check_kernels_beside_package(installed: bool) -> None:
    """flyquant.kernels must be this copy's: kernels/ beside flyquant/ (a checkout installed
    editable) or flyquant/kernels (a wheel). Imported from a checkout that is not installed
    editable (the current directory comes first on sys.path), the source tree's flyquant had no
    kernels (a ModuleNotFoundError at the first launch) or another copy's editable mapping
    supplied them (code of two versions mixed)."""
    from importlib import util
    from pathlib import Path

    here = Path(__file__).resolve().parent
    spec = util.find_spec(__name__ + ".kernels")
    found = Path(spec.origin).resolve().parent if spec is not None and spec.origin else None
    if found in (here / "kernels", here.parent / "kernels"):
        return
    fix = ("run from another directory to import the installed flyquant, or install this checkout with "
           "pip install -e . (the default editable mode maps kernels/ in; editable_mode=strict does not "
           "when run from the checkout's root)") if installed else "install this checkout: pip install -e ."
    raise ImportError(f"flyquant imported from {here} finds "
                      f"{'no flyquant.kernels module' if found is None else f'its kernels in {found}'} "
                      f"(the checkout's kernels/, which the install maps in): {fix}")


__version__ = _installed_version() or "unknown"  # this copy's, once the check below passes
_check_kernels_beside_package(__version__ != "unknown")
del _check_kernels_beside_package, _installed_version

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
