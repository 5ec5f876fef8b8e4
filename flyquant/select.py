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

import dataclasses
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
        lines += [f"  - {r}" for r in self.reasons]
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


def _kernel_plan(op: str, target: Target, kernel: str, config: dict, *reasons: str) -> Plan:
    return Plan(op, "flydsl", target.where, target.arch, kernel, config, (target.reason, *reasons))


def _flydsl_unavailable() -> str | None:
    try:
        import flydsl.compiler  # noqa: F401
    except Exception as exc:  # any import failure means the kernel path is not usable
        return f"FlyDSL cannot be imported ({type(exc).__name__}: {exc})"
    return None


def _kernel_target(op: str, device: torch.device) -> Target | Plan:
    """The target to compile for, or the reference plan when this device runs no kernel."""
    target = resolve_target(device)
    if target.arch is None:
        return reference_plan(op, target)
    missing = _flydsl_unavailable()
    if missing:
        _forced_reference(missing)
        return reference_plan(op, target, missing)
    return target


_SHORT_DTYPE_NAMES = {torch.bfloat16: "bf16", torch.float16: "fp16", torch.float32: "fp32"}


def _dtype_name(dtype: torch.dtype) -> str:
    return _SHORT_DTYPE_NAMES.get(dtype) or str(dtype).replace("torch.", "")


def _mxfp8_plan(op: str, x: torch.Tensor, kind: str, scaling_mode: str, scale_layout, **extra) -> Plan:
    target = _kernel_target(op, x.device)
    if isinstance(target, Plan):
        return target
    from .kernels import mxfp8_quantize_2d as k
    from .kernels.mxfp8_quantize_3d import matrix_too_large

    too_large = kind != "1x32" and matrix_too_large(x.shape, x.dtype)  # 1x32 launches in row chunks
    if too_large:
        _forced_reference(too_large)
        return reference_plan(op, target, too_large)
    config = {**dataclasses.asdict(k.plan(kind, tuple(x.shape), x.dtype, target.arch)), **extra}
    name = f"mxfp8_{kind}_{scaling_mode}_{_dtype_name(x.dtype)}_{target.arch}"
    conversion = "OCP FP8 conversion" if target.arch == "gfx950" else "OCP bits from the FNUZ converter"
    layout = f"scales written in the {scale_layout} layout by the kernel" if scale_layout else "plain scales"
    return _kernel_plan(op, target, name, config, conversion, layout)


def plan_mxfp8_quantize(x: torch.Tensor, axis: int, scaling_mode: str, scale_layout, offs) -> Plan:
    """1x32 (axis 1) or 32x1 (axis 0) MXFP8 quantize of a 2D tensor (inputs already validated)."""
    kind = "1x32" if axis == 1 else "32x1"
    return _mxfp8_plan("mxfp8_quantize", x, kind, scaling_mode, scale_layout, token_groups=offs is not None)


def plan_mxfp8_quantize_dual(x: torch.Tensor, scaling_mode: str) -> Plan:
    return _mxfp8_plan("mxfp8_quantize_dual", x, "dual", scaling_mode, None)


def plan_mxfp8_quantize_3d(w: torch.Tensor, scaling_mode: str, scale_block_k: int, scale_layout) -> Plan:
    return _mxfp8_plan("mxfp8_quantize_3d", w, "3d", scaling_mode, scale_layout, scale_block_k=scale_block_k)


MOE_CONFIG_FIELDS = ("tile_m", "tile_n", "k_batch", "waves")


def _moe_config(target: Target, tokens, topk, experts, model_dim, inter_dim, block_m) -> dict:
    """(tile_m, tile_n, k_batch, waves): first principles (the kernel's choose_config and
    default_waves), then the tuning table, then FLYQUANT_CONFIG; tile_m must divide the caller's
    block_m."""
    from .kernels import moe_gemm2_a16w4 as k

    tile_m, tile_n, k_batch = k.choose_config(tokens, topk, experts, model_dim, inter_dim, target.arch)
    config = {"tile_m": tile_m, "tile_n": tile_n, "k_batch": k_batch}
    shape = {"tokens": tokens, "topk": topk, "experts": experts, "model_dim": model_dim, "inter_dim": inter_dim}
    config.update(tuned_config("moe_gemm2_a16w4", target.arch, shape))
    config.update({f: v for f, v in config_overrides().items() if f in MOE_CONFIG_FIELDS})
    if block_m is not None and block_m % config["tile_m"]:
        fitting = [m for m in k.TILE_MS if block_m % m == 0 and m <= config["tile_m"]]
        config["tile_m"] = max(fitting) if fitting else config["tile_m"]  # the launcher names the violation
    if "waves" not in config:  # for the tiles and split actually chosen
        config["waves"] = k.default_waves(config["tile_m"], config["tile_n"], k.k_iterations(inter_dim), config["k_batch"])
    return config


def plan_moe_gemm2_a16w4(a2, w2, topk, block_m, model_dim, inter_dim, out_dtype, has_bias) -> Plan:
    """The A16W4 stage-2 GEMM: tiles and split-K for this shape; block_m is the caller's sort."""
    op = "moe_gemm2_a16w4"
    target = _kernel_target(op, a2.device)
    if isinstance(target, Plan):
        return target
    if a2.dtype != torch.bfloat16:
        reason = f"the kernel takes bf16 activations, a2 is {_dtype_name(a2.dtype)}"
        _forced_reference(reason)
        return reference_plan(op, target, reason)
    tokens, experts = a2.shape[0] // topk, w2.shape[0]
    config = _moe_config(target, tokens, topk, experts, model_dim, inter_dim, block_m)
    name = (f"moe_gemm2_a16w4_{_dtype_name(out_dtype)}_{config['tile_m']}x{config['tile_n']}_kb{config['k_batch']}"
            f"_{config['waves']}w{'_bias' if has_bias else ''}_{target.arch}")
    conversion = "hardware FP4->BF16 conversion" if target.arch == "gfx950" else "software FP4 unpack"
    return _kernel_plan(op, target, name, config, conversion)


def moe_block_m(tokens: int, topk: int, experts: int, model_dim: int, inter_dim: int, device: torch.device) -> int:
    """The tile_m the stage-2 kernel wants for this shape: sort with it (the reference takes any)."""
    target = _kernel_target("moe_gemm2_a16w4", device)
    if isinstance(target, Plan):
        return REFERENCE_BLOCK_M
    return _moe_config(target, tokens, topk, experts, model_dim, inter_dim, None)["tile_m"]


REFERENCE_BLOCK_M = 32
