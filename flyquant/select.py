"""The selector: (device, arch, shape, dtype, options) -> a plan naming a kernel and its
configuration, or the PyTorch reference and why.

Where a call runs:
- a ROCm GPU tensor on gfx942/gfx950: the FlyDSL kernel for that arch;
- a CPU tensor with `flyquant.emu` enabled (or ``FLYQUANT_BACKEND=flydsl`` with ``FLYQUANT_ARCH``
  on a machine without a ROCm device): the same FlyDSL kernel, executed by the emulator;
- anything else (CPU without the emulator, CUDA, other AMD archs, unsupported options): the
  reference, with the reason in the plan.

Environment: ``FLYQUANT_BACKEND=auto|reference|flydsl`` forces a backend, ``FLYQUANT_ARCH``
forces the target arch, ``FLYQUANT_CONFIG`` (JSON object) overrides configuration fields for
debugging, ``FLYQUANT_TUNING`` names a JSON tuning table written by ``bench/`` on hardware.
The planning functions are pure given those variables: the same inputs give the same plan.
"""

from __future__ import annotations

import functools
import json
import os
from dataclasses import dataclass, field
from typing import Any

import torch

from .arch import ARCHS

BACKENDS = ("auto", "reference", "flydsl")


@dataclass(frozen=True)
class Plan:
    """What the selector decided for one call."""

    op: str
    backend: str  # "flydsl" | "reference"
    where: str  # "rocm" | "emulator" | "cpu" | "cuda" | ...
    arch: str | None = None
    kernel: str | None = None
    config: dict[str, Any] = field(default_factory=dict)
    reasons: tuple[str, ...] = ()

    def __str__(self) -> str:
        head = f"{self.op}: {self.backend}"
        if self.backend == "flydsl":
            head += f" kernel {self.kernel} for {self.arch} on {self.where}"
        else:
            head += f" (PyTorch reference on {self.where})"
        lines = [head]
        lines += [f"  {k} = {v}" for k, v in self.config.items()]
        lines += [f"  because {r}" for r in self.reasons]
        return "\n".join(lines)


class BackendError(RuntimeError):
    """A forced backend cannot run this call here."""


def _env_backend() -> str:
    backend = os.environ.get("FLYQUANT_BACKEND", "auto").strip().lower() or "auto"
    if backend not in BACKENDS:
        raise ValueError(f"FLYQUANT_BACKEND={backend!r}: expected one of {BACKENDS}")
    return backend


def _env_arch() -> str | None:
    arch = os.environ.get("FLYQUANT_ARCH", "").strip().lower() or None
    if arch is not None and arch not in ARCHS:
        raise ValueError(f"FLYQUANT_ARCH={arch!r}: expected one of {sorted(ARCHS)}")
    return arch


@functools.lru_cache(maxsize=None)
def _rocm_arch_of(index: int) -> str:
    name = torch.cuda.get_device_properties(index).gcnArchName
    return name.split(":")[0]


def rocm_device_present() -> bool:
    """True when a ROCm GPU is present (cached; never raises or hangs without ROCm)."""
    from . import emu

    return emu.rocm_device_present()


def _emulator_arch() -> str | None:
    from . import emu

    return emu.arch() if emu.enabled() else None


@dataclass(frozen=True)
class Target:
    """Where a call on a given device can run a FlyDSL kernel, or why not."""

    where: str
    arch: str | None
    reason: str


def resolve_target(device: torch.device) -> Target:
    """Device + environment -> the arch to compile for (None: reference only) and why."""
    backend = _env_backend()
    forced_arch = _env_arch()
    if backend == "reference":
        return Target(device.type, None, "FLYQUANT_BACKEND=reference")
    if device.type == "cuda" and torch.version.hip:
        arch = forced_arch or _rocm_arch_of(device.index if device.index is not None else torch.cuda.current_device())
        if arch in ARCHS:
            return Target("rocm", arch, f"ROCm device {device} is {arch}")
        return _refuse(backend, Target("rocm", None, f"{arch} has no flyquant kernels (they target {sorted(ARCHS)})"))
    if device.type == "cpu":
        emu_arch = _emulator_arch()
        if emu_arch is not None:
            arch = forced_arch or emu_arch
            return Target("emulator", arch, f"CPU tensor with flyquant.emu enabled: {arch} code runs emulated")
        if backend == "flydsl":
            if rocm_device_present():
                raise BackendError(
                    "FLYQUANT_BACKEND=flydsl with CPU tensors while a ROCm device is present: move the "
                    "tensors to the GPU (the emulator never replaces a real device)"
                )
            if forced_arch is None:
                raise BackendError("FLYQUANT_BACKEND=flydsl on CPU tensors needs FLYQUANT_ARCH=gfx942|gfx950")
            from . import emu

            emu.enable(forced_arch)
            return Target("emulator", forced_arch, f"FLYQUANT_BACKEND=flydsl FLYQUANT_ARCH={forced_arch} on CPU")
        return Target("cpu", None, "CPU tensor and flyquant.emu not enabled (flyquant.emu.enable(arch) runs kernels)")
    return _refuse(backend, Target(device.type, None, f"{device.type} device: flyquant kernels target AMD GPUs"))


def _refuse(backend: str, target: Target) -> Target:
    if backend == "flydsl":
        raise BackendError(f"FLYQUANT_BACKEND=flydsl, but {target.reason}")
    return target


def config_overrides() -> dict[str, Any]:
    """FLYQUANT_CONFIG: a JSON object of configuration fields forced for debugging."""
    raw = os.environ.get("FLYQUANT_CONFIG", "").strip()
    if not raw:
        return {}
    value = json.loads(raw)
    if not isinstance(value, dict):
        raise ValueError(f"FLYQUANT_CONFIG must be a JSON object, got {raw!r}")
    return value


@functools.lru_cache(maxsize=8)
def _load_tuning(path: str, mtime: float) -> dict[tuple, dict]:
    with open(path) as f:
        table = json.load(f)
    entries = {}
    for e in table.get("entries", []):
        key = (e["op"], e["arch"], tuple(sorted((k, v) for k, v in e["shape"].items())))
        entries[key] = dict(e["config"])
    return entries


def tuned_config(op: str, arch: str, shape: dict[str, Any]) -> dict[str, Any]:
    """The tuning table's configuration for exactly this (op, arch, shape), or {}."""
    path = os.environ.get("FLYQUANT_TUNING", "").strip()
    if not path:
        return {}
    table = _load_tuning(path, os.path.getmtime(path))
    return table.get((op, arch, tuple(sorted(shape.items()))), {})


def reference_plan(op: str, target: Target, *reasons: str) -> Plan:
    return Plan(op=op, backend="reference", where=target.where, reasons=(target.reason, *reasons))


def _forced_reference(reason: str) -> None:
    if _env_backend() == "flydsl":
        raise BackendError(f"FLYQUANT_BACKEND=flydsl, but {reason}")


# ---------------------------------------------------------------------------------------------
# Per-op planning. Each returns a Plan; shapes/dtypes the kernels do not serve go to the reference
# with the reason (or raise under FLYQUANT_BACKEND=flydsl).
# ---------------------------------------------------------------------------------------------


def _kernel_plan(op: str, target: Target, kernel: str, config: dict, shape_key: dict, *reasons: str) -> Plan:
    config = {**config, **tuned_config(op, target.arch, shape_key), **config_overrides()}
    return Plan(op, "flydsl", target.where, target.arch, kernel, config, (target.reason, *reasons))


def _flydsl_unavailable() -> str | None:
    try:
        import flydsl.compiler  # noqa: F401
    except Exception as exc:  # any import failure means the kernel path is not usable
        return f"FlyDSL cannot be imported ({type(exc).__name__}: {exc})"
    return None


def _reference_or_raise(op: str, target: Target, reason: str) -> Plan:
    _forced_reference(reason)
    return reference_plan(op, target, reason)


def _mxfp8_plan(op: str, x: torch.Tensor, kind: str, scaling_mode: str, scale_layout, extra: dict) -> Plan:
    target = resolve_target(x.device)
    if target.arch is None:
        return reference_plan(op, target)
    missing = _flydsl_unavailable()
    if missing:
        return _reference_or_raise(op, target, missing)
    from .kernels import mxfp8_quantize as k

    config = k.plan(kind, tuple(x.shape), x.dtype, target.arch)
    name = k.kernel_name(kind, scaling_mode, x.dtype, target.arch)
    shape_key = {"kind": kind, "shape": "x".join(map(str, x.shape)), "dtype": str(x.dtype).replace("torch.", "")}
    layout = f"scales written in the {scale_layout} layout by the kernel" if scale_layout else "plain scales"
    return _kernel_plan(op, target, name, {**config, **extra}, shape_key, layout)


def plan_mxfp8_quantize(x: torch.Tensor, axis: int, scaling_mode: str, scale_layout, offs) -> Plan:
    """1x32 (axis 1) or 32x1 (axis 0) MXFP8 quantize of a 2D tensor (inputs already validated)."""
    kind = "1x32" if axis == 1 else "32x1"
    return _mxfp8_plan("mxfp8_quantize", x, kind, scaling_mode, scale_layout, {"token_groups": offs is not None})


def plan_mxfp8_quantize_dual(x: torch.Tensor, scaling_mode: str) -> Plan:
    return _mxfp8_plan("mxfp8_quantize_dual", x, "dual", scaling_mode, None, {})


def plan_mxfp8_quantize_3d(w: torch.Tensor, scaling_mode: str, scale_block_k: int, scale_layout) -> Plan:
    return _mxfp8_plan("mxfp8_quantize_3d", w, "3d", scaling_mode, scale_layout, {"scale_block_k": scale_block_k})


def plan_moe_gemm2_a16w4(a2, w2, topk, block_m, model_dim, inter_dim, out_dtype, has_bias) -> Plan:
    """The A16W4 stage-2 GEMM: tile_n and split-K for this shape; block_m is the caller's."""
    op = "moe_gemm2_a16w4"
    target = resolve_target(a2.device)
    if target.arch is None:
        return reference_plan(op, target)
    missing = _flydsl_unavailable()
    if missing:
        return _reference_or_raise(op, target, missing)
    from .kernels import moe_gemm2_a16w4 as k

    tokens, experts = a2.shape[0] // topk, w2.shape[0]
    unsupported = k.unsupported(a2.dtype, block_m, model_dim, inter_dim, w2.shape, out_dtype, target.arch)
    if unsupported:
        return _reference_or_raise(op, target, unsupported)
    tile_m, tile_n, k_batch = k.choose_config(tokens, topk, experts, model_dim, inter_dim, target.arch)
    if block_m % tile_m:
        tile_m = block_m if block_m in k.TILE_M_CHOICES else tile_m
    config = {"tile_m": tile_m, "tile_n": tile_n, "k_batch": k_batch, "out_dtype": str(out_dtype).replace("torch.", ""),
              "bias": has_bias}
    shape_key = {"tokens": tokens, "topk": topk, "experts": experts, "model_dim": model_dim, "inter_dim": inter_dim}
    name = k.kernel_name(tile_m, tile_n, target.arch)
    conversion = "hardware FP4->BF16 conversion" if target.arch == "gfx950" else "software FP4 unpack"
    return _kernel_plan(op, target, name, config, shape_key, conversion)


def moe_block_m(tokens: int, topk: int, experts: int, model_dim: int, inter_dim: int, device: torch.device) -> int:
    """The tile_m the stage-2 kernel wants for this shape: sort with it (reference: any works)."""
    target = resolve_target(device)
    if target.arch is None or _flydsl_unavailable():
        return 32
    from .kernels import moe_gemm2_a16w4 as k

    tuned = tuned_config("moe_gemm2_a16w4", target.arch, {"tokens": tokens, "topk": topk, "experts": experts,
                                                          "model_dim": model_dim, "inter_dim": inter_dim})
    forced = config_overrides()
    return forced.get("tile_m", tuned.get("tile_m", k.choose_config(tokens, topk, experts, model_dim, inter_dim,
                                                                     target.arch)[0]))
