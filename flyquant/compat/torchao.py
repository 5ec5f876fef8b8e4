"""torchao 0.18's FlyDSL MXFP8 quantize ops and its MXFP8 grouped-GEMM training entry point
(``to_mxfp8_then_scaled_grouped_mm``, routed by install()), served by flyquant.

Same names, signatures and return contracts as
``torchao.prototype.moe_training.kernels.mxfp8.quant.mxfp8_quantize_{2d_1x32,2d_32x1,3d}_flydsl``,
so torchao's MXFP8 MoE training can call flyquant without changing call sites. Differences, all
in the direction of doing more: both scale modes on gfx942 and gfx950, ``offs`` and
``blocked_scale_output`` are implemented (torchao 0.18 raises NotImplementedError), no M % 32
requirement beyond the quantized dimension, and CPU tensors work (reference or emulator).
``stage_count`` has no meaning on AMD (no TMA pipeline) and is accepted for parity.

Errors: bad input raises TorchaoInputError, which is both an AssertionError (what torchao's
FlyDSL wrappers raise for what they assert, with their wording first, e.g. "Only block_size=32
is supported", "M (40) must be a multiple of block_size (32)") and a ValueError (what flyquant's
native API raises; our own explanation follows torchao's words). torchao's NotImplementedError
for 3D scale block sizes is TorchaoUnsupportedError (NotImplementedError and ValueError).
The 3D function also takes the transposed view torchao's grouped GEMM passes (see
flyquant.reference.mxfp8_quantize_3d); other non-contiguous inputs are refused.
"""

from __future__ import annotations

import contextlib

import torch

from .. import api, validate
from ..formats import MX_BLOCK


class TorchaoInputError(ValueError, AssertionError):
    """Bad input to a torchao-compatible function: catchable as torchao's AssertionError and as
    flyquant's ValueError."""


class TorchaoDtypeError(TorchaoInputError, TypeError):
    """An input dtype neither torchao (BF16, FP32) nor flyquant (also FP16) takes; flyquant's
    native API raises TypeError for it."""


class TorchaoUnsupportedError(ValueError, NotImplementedError):
    """A parameter value torchao's FlyDSL wrappers reject with NotImplementedError."""


def _fail(torchao_words: str, detail: str = "") -> None:
    raise TorchaoInputError(torchao_words + (f" ({detail})" if detail else ""))


@contextlib.contextmanager
def _as_torchao_errors():
    """Any ValueError of the native API below becomes a TorchaoInputError, a TypeError a
    TorchaoDtypeError (same message)."""
    try:
        yield
    except TorchaoInputError:
        raise
    except ValueError as exc:
        raise TorchaoInputError(str(exc)) from exc
    except TypeError as exc:
        raise TorchaoDtypeError(str(exc)) from exc


def _check_input(x: torch.Tensor, ndim: int, block_size: int, allow_transposed_3d: bool = False) -> None:
    """torchao's assertions, in its order and words (except that flyquant takes CPU tensors and
    FP16 too)."""
    if not isinstance(x, torch.Tensor) or x.dim() != ndim:
        got = tuple(x.shape) if isinstance(x, torch.Tensor) else type(x).__name__
        _fail(f"input tensor must be {ndim}D", f"got {got}")
    if x.dtype not in (torch.bfloat16, torch.float16, torch.float32):
        raise TorchaoDtypeError(f"Input tensor must be float32 or bfloat16 (flyquant also takes float16; got {x.dtype})")
    if not x.is_contiguous() and not (allow_transposed_3d and x.transpose(1, 2).is_contiguous()):
        _fail("Input tensor must be contiguous (row-major)", f"got strides {x.stride()} for shape {tuple(x.shape)}")
    if not validate.is_int(block_size) or block_size != MX_BLOCK:  # an int, as scale_block_dim1/2
        _fail(f"Only block_size={MX_BLOCK} is supported", f"got {block_size!r}")


def _mode(scaling_mode):
    # torchao passes strings; accept its ScaleCalculationMode enum too. Anything else as given, for the
    # error to show it (str() made None "'none'")
    mode = getattr(scaling_mode, "value", scaling_mode)
    return mode.lower() if isinstance(mode, str) else mode


def mxfp8_quantize_2d_1x32_flydsl(
    x: torch.Tensor,
    block_size: int = 32,
    scaling_mode: str = "rceil",
    stage_count: int = 2,
    offs: torch.Tensor = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """(M, K) -> e4m3fn data (M, K) row-major, e8m0 scales (M, K/32). offs (token-group ends)
    as flyquant.mxfp8_quantize takes it: non-decreasing, the last == M, groups of 128-row multiples."""
    _check_input(x, 2, block_size)
    if x.shape[1] % MX_BLOCK:
        _fail(f"K must be a multiple of {MX_BLOCK}", f"got K = {x.shape[1]}")
    with _as_torchao_errors():
        return api.mxfp8_quantize(x, axis=-1, scaling_mode=_mode(scaling_mode), offs=offs)


def mxfp8_quantize_2d_32x1_flydsl(
    x: torch.Tensor,
    block_size: int = 32,
    scaling_mode: str = "rceil",
    stage_count: int = 2,
    blocked_scale_output: bool = False,
    offs: torch.Tensor = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """(M, K) -> e4m3fn data (M, K) with stride (1, M), e8m0 scales (K, M/32), or torchao's
    blocked (tcgen05) scales with blocked_scale_output=True (per token group when offs is given;
    offs as flyquant.mxfp8_quantize takes it: non-decreasing, the last == M, groups of 128-row
    multiples)."""
    _check_input(x, 2, block_size)
    if x.shape[0] % MX_BLOCK:
        _fail(f"M ({x.shape[0]}) must be a multiple of block_size ({MX_BLOCK})")
    with _as_torchao_errors():
        layout = "tcgen05" if validate.flag(blocked_scale_output, "blocked_scale_output") else None
        return api.mxfp8_quantize(x, axis=0, scaling_mode=_mode(scaling_mode), scale_layout=layout, offs=offs)


def mxfp8_quantize_3d_flydsl(
    x: torch.Tensor,
    block_size: int = 32,
    scale_block_dim1: int = 32,
    scale_block_dim2: int = 1,
    scaling_mode: str = "rceil",
    stage_count: int = 2,
    blocked_scale_output: bool = False,
) -> tuple[torch.Tensor, torch.Tensor]:
    """(E, N, K) along N -> data stride (N*K, 1, N), scales (E, N/32, K) (or K/32 with
    scale_block_dim2=32), or torchao's blocked scales (E, rows * cols) with blocked_scale_output.
    x contiguous, or the transpose of a contiguous (E, K, N) tensor."""
    if not validate.is_int(scale_block_dim1) or scale_block_dim1 != MX_BLOCK:
        raise TorchaoUnsupportedError(
            f"mxfp8_quantize_3d_flydsl: scale_block_dim1 must be {MX_BLOCK} (got {scale_block_dim1}).")
    # ints, as block_size: 32.0 or True got past `in` and the native API refused them, naming its scale_block_k
    if not validate.is_int(scale_block_dim2) or scale_block_dim2 not in (1, MX_BLOCK):
        raise TorchaoUnsupportedError(
            f"mxfp8_quantize_3d_flydsl: scale_block_dim2 must be 1 or {MX_BLOCK} (got {scale_block_dim2}).")
    _check_input(x, 3, block_size, allow_transposed_3d=True)
    if x.shape[1] % MX_BLOCK:
        _fail("N must be divisible by block_size", f"got N = {x.shape[1]}")
    if scale_block_dim2 == MX_BLOCK and x.shape[2] % MX_BLOCK:
        _fail(f"K ({x.shape[2]}) must be divisible by BLOCK_SIZE ({MX_BLOCK})")
    with _as_torchao_errors():
        layout = "tcgen05" if validate.flag(blocked_scale_output, "blocked_scale_output") else None
        return api.mxfp8_quantize_3d(x, scaling_mode=_mode(scaling_mode), scale_block_k=scale_block_dim2,
                                     scale_layout=layout)


# ------------------------------------------------------------------------------------------------
# install(): torchao's MXFP8 MoE training importable beside flydsl 0.4.2, its FlyDSL entry points
# served by flyquant
# ------------------------------------------------------------------------------------------------

# torchao's modules that bind the FlyDSL entry points by name (the MX dim1 cast imports the 32x1
# one from `quant` at call time, so patching the module attribute routes it).
TORCHAO_FLYDSL_MODULES = (
    "torchao.prototype.moe_training.kernels.mxfp8.quant",
    "torchao.prototype.moe_training.kernels.mxfp8",
)
ENTRY_POINTS = ("mxfp8_quantize_2d_1x32_flydsl", "mxfp8_quantize_2d_32x1_flydsl", "mxfp8_quantize_3d_flydsl")


def _flydsl_vector_shim():
    """flydsl.expr.vector as torchao imports it (flydsl 0.4.2 has none): the MLIR vector dialect's
    ops plus flydsl.expr.ReductionOp. torchao's kernels built on it are never run once its entry
    points are routed to flyquant; the module only has to import."""
    import types

    import flydsl.expr as fx
    from flydsl._mlir.dialects import vector as mlir_vector

    shim = types.ModuleType("flydsl.expr.vector", "flyquant shim: torchao's view of flydsl.expr.vector")
    shim.__dict__.update({k: v for k, v in vars(mlir_vector).items() if not k.startswith("__")})
    shim.ReductionOp = fx.ReductionOp
    shim.__flyquant_shim__ = True
    return shim


def install() -> list[str]:
    """Make torchao's MXFP8 training (torchao.prototype.moe_training, its kernels.mxfp8 package,
    the MX linear's FLYDSL dim1 cast) importable with flydsl 0.4.2 and route its MXFP8 entry
    points to flyquant. Exactly these attributes are set:

    - ``flydsl.expr.vector`` (sys.modules and flydsl.expr): a shim, when flydsl has none;
    - ``mxfp8_quantize_{2d_1x32,2d_32x1,3d}_flydsl`` in ``torchao.prototype.moe_training.kernels.mxfp8``
      and its ``.quant`` module -> this module's functions of those names;
    - ``_to_mxfp8_then_scaled_grouped_mm`` in ``torchao.prototype.moe_training`` (what
      MXFP8TrainingOpConfig's weight wrapper calls for ``torch._grouped_mm``, through
      ``moe_training.utils._quantize_then_scaled_grouped_mm``) and in
      ``torchao.prototype.moe_training.mxfp8_grouped_mm`` -> ``to_mxfp8_then_scaled_grouped_mm``
      below, which runs flyquant.training.mxfp8_grouped_mm. Code that bound torchao's function
      by name before install() keeps torchao's.

    Returns what it changed, one line each; a second call changes nothing and returns []. Nothing
    happens at import of flyquant: only this call patches. Raises ImportError when torchao or
    flydsl is not installed.
    """
    import importlib
    import sys

    import flydsl.expr as fx

    changed = []
    if "flydsl.expr.vector" not in sys.modules:
        try:
            importlib.import_module("flydsl.expr.vector")
        except ImportError:
            shim = _flydsl_vector_shim()
            sys.modules["flydsl.expr.vector"] = shim
            fx.vector = shim
            changed.append("flydsl.expr.vector: shim (flydsl 0.4.2 has none; torchao imports it)")
    here = sys.modules[__name__]
    for module_name in TORCHAO_FLYDSL_MODULES:
        module = importlib.import_module(module_name)
        for name in ENTRY_POINTS:
            ours = getattr(here, name)
            if getattr(module, name, None) is not ours:
                setattr(module, name, ours)
                changed.append(f"{module_name}.{name} -> flyquant.compat.torchao.{name}")
    for module_name in TORCHAO_GROUPED_MM_MODULES:
        module = importlib.import_module(module_name)
        theirs = getattr(module, GROUPED_MM_ENTRY_POINT)
        if theirs is not to_mxfp8_then_scaled_grouped_mm:
            _TORCHAO_GROUPED_MM.setdefault("original", theirs)
            setattr(module, GROUPED_MM_ENTRY_POINT, to_mxfp8_then_scaled_grouped_mm)
            changed.append(f"{module_name}.{GROUPED_MM_ENTRY_POINT} -> "
                           "flyquant.compat.torchao.to_mxfp8_then_scaled_grouped_mm")
    return changed


# torchao's differentiable MXFP8 grouped GEMM, where it is defined and where the MoE training
# config's dispatch (moe_training.utils) imports it from at call time.
TORCHAO_GROUPED_MM_MODULES = ("torchao.prototype.moe_training.mxfp8_grouped_mm", "torchao.prototype.moe_training")
GROUPED_MM_ENTRY_POINT = "_to_mxfp8_then_scaled_grouped_mm"
_TORCHAO_GROUPED_MM: dict = {}  # "original": torchao's function, kept for its EMULATED and SM100 paths


def to_mxfp8_then_scaled_grouped_mm(A, B_t, offs=None, bias=None, out_dtype=torch.bfloat16, kernel_preference=None,
                                    wgrad_with_hp=False, scale_calculation_mode="rceil",
                                    pad_token_groups_for_grouped_mm=False):
    """torchao 0.18's ``_to_mxfp8_then_scaled_grouped_mm`` served by flyquant.training.mxfp8_grouped_mm.

    Calls torchao's own function when it can run them itself: kernel_preference EMULATED (torchao's
    PyTorch emulation, asked for by name) or torchao's SM100 kernels available. Otherwise (its
    AUTO on AMD or CPU, where torchao asserts) flyquant's op, with wgrad_with_hp and
    pad_token_groups_for_grouped_mm as torchao's recipes set them, then ``+ bias`` as torchao does.
    An MXTensor A (pre-quantized activations, torchao's expert-parallel dispatch) goes in as
    training's a_quantized, with torchao's conditions (E4M3 elements, blocks of 32, row-major
    scales, wgrad_with_hp). Bad A, B_t, offs or out_dtype raises TorchaoInputError
    (TorchaoDtypeError for a dtype): an AssertionError as torchao's own checks raise.
    """
    try:
        from torchao.prototype.moe_training import mxfp8_grouped_mm as theirs
    except ImportError as exc:  # without install(): flydsl 0.4.2's missing flydsl.expr.vector, named alone
        raise ImportError(f"to_mxfp8_then_scaled_grouped_mm needs torchao.prototype.moe_training, which did not "
                          f"import ({exc}): call flyquant.compat.torchao.install() first") from exc
    from torchao.prototype.mx_formats.config import ScaleCalculationMode
    from torchao.quantization.quantize_.common import KernelPreference

    from .. import training

    if kernel_preference is None:
        kernel_preference = KernelPreference.AUTO
    if kernel_preference == KernelPreference.EMULATED or theirs._SM100_KERNELS_AVAILABLE:
        original = _TORCHAO_GROUPED_MM.get("original")
        if original is None:
            raise RuntimeError("call flyquant.compat.torchao.install() first: it keeps torchao's own function")
        if isinstance(scale_calculation_mode, str):  # our default "rceil": torchao's to_mx compares enums only
            scale_calculation_mode = ScaleCalculationMode(scale_calculation_mode.lower())
        return original(A, B_t, offs, bias, out_dtype, kernel_preference, wgrad_with_hp, scale_calculation_mode,
                        pad_token_groups_for_grouped_mm)
    if kernel_preference != KernelPreference.AUTO:
        _fail("kernel_preference must be AUTO or EMULATED", f"got {kernel_preference}")
    with _as_torchao_errors():  # a recipe flag that is not a bool (torchao would take "no" as true)
        wgrad_with_hp = validate.flag(wgrad_with_hp, "wgrad_with_hp")
        validate.flag(pad_token_groups_for_grouped_mm, "pad_token_groups_for_grouped_mm")
    a_quantized = _mxtensor_parts(A, wgrad_with_hp) if isinstance(A, theirs.MXTensor) else None
    if offs is None:
        _fail("group_end_offsets must be provided for 2d-3d grouped mm")
    mode = _mode(scale_calculation_mode)
    try:  # torchao asserts on bad input: its callers catch AssertionError, which flyquant's errors were not
        if a_quantized is not None:
            training._check_quantized(A, a_quantized, wgrad_with_hp)
        training._check(A, B_t, offs, out_dtype, mode, quantized=a_quantized is not None)
    except TypeError as exc:
        raise TorchaoDtypeError(str(exc)) from exc
    except ValueError as exc:
        raise TorchaoInputError(str(exc)) from exc
    out = training.mxfp8_grouped_mm(A, B_t, offs, out_dtype, mode, wgrad_with_hp, pad_token_groups_for_grouped_mm,
                                    a_quantized)
    return out if bias is None else out + bias.to(out.dtype)


def _mxtensor_parts(A, wgrad_with_hp: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """(qdata, scale) of an MXTensor A under torchao's own conditions, asserted in its words."""
    for ok, message in ((A.elem_dtype == torch.float8_e4m3fn,
                         f"Expected MXTensor with elem_dtype float8_e4m3fn, but got {A.elem_dtype}"),
                        (A.block_size == MX_BLOCK, f"Expected MXTensor block_size={MX_BLOCK}, but got {A.block_size}"),
                        (not A.is_swizzled_scales, "MXTensor input scales must be unswizzled for grouped GEMM"),
                        (A.qdata.ndim == 2 and A.scale.ndim == 2, "MXTensor input_act data and scale must be 2D"),
                        (wgrad_with_hp, "only `wgrad_with_hp` recipe is supported for MXTensor inputs because backward "
                                        "needs the high-precision activations to quantize along dim1 for weight gradients")):
        if not ok:
            _fail(message)
    return A.qdata, A.scale
