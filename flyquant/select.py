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
Each variable, and the tuning table, is checked when read (``flyquant.env``): a bad value is
an ``EnvError`` (ValueError) naming the variable, the value and the expected form; a key that
is not a known field is refused with the list of known ones.
"""

from __future__ import annotations

import dataclasses
import functools
import math
from dataclasses import dataclass, field
from typing import Any

import torch

from . import env, tuning
from .arch import ARCHS
from .tuning import TUNED_OPS, config_overrides, loaded_table, tuned_entry

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


def forced_backend() -> str:
    """FLYQUANT_BACKEND (checked): auto, reference or flydsl."""
    env.warn_unknown()  # a misspelt FLYQUANT_* variable would otherwise be ignored silently
    return env.choice("FLYQUANT_BACKEND", BACKENDS, "auto")


def forced_arch() -> str | None:
    """FLYQUANT_ARCH (checked), None when unset: the compile target, over the emulator's."""
    return env.choice("FLYQUANT_ARCH", sorted(ARCHS))


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
    backend = forced_backend()
    forced = forced_arch()
    if backend == "reference":
        return Target(device.type, None, "FLYQUANT_BACKEND=reference")
    if device.type == "cuda" and torch.version.hip:
        arch = _rocm_arch_of(device.index if device.index is not None else torch.cuda.current_device())
        if forced is not None and forced != arch:
            # code compiled for FLYQUANT_ARCH was launched on the device's other arch (the reason
            # even named the device as FLYQUANT_ARCH's): a code object runs on its own arch only
            raise env.error("FLYQUANT_ARCH", env.raw("FLYQUANT_ARCH"),
                            f"the arch of ROCm device {device}, {arch}, or unset (kernels compiled for one arch "
                            "do not run on another)")
        if arch in ARCHS:
            return Target("rocm", arch, f"ROCm device {device} is {arch}")
        return _refuse(backend, Target("rocm", None, f"{arch} has no flyquant kernels (they target {sorted(ARCHS)})"))
    if device.type == "cpu":
        emu_arch = _emulator_arch()
        if emu_arch is not None:
            arch = forced or emu_arch
            return Target("emulator", arch, f"CPU tensor with flyquant.emu enabled: {arch} code runs emulated")
        if backend == "flydsl":
            if rocm_device_present():
                raise BackendError(
                    "FLYQUANT_BACKEND=flydsl with CPU tensors while a ROCm device is present: move the "
                    "tensors to the GPU (the emulator never replaces a real device)"
                )
            if forced is None:
                raise BackendError("FLYQUANT_BACKEND=flydsl on CPU tensors needs FLYQUANT_ARCH=gfx942|gfx950")
            from . import emu

            emu.enable(forced)
            return Target("emulator", forced, f"FLYQUANT_BACKEND=flydsl FLYQUANT_ARCH={forced} on CPU")
        return Target("cpu", None, "CPU tensor and flyquant.emu not enabled (flyquant.emu.enable(arch) runs kernels)")
    return _refuse(backend, Target(device.type, None, f"{device.type} device: flyquant kernels target AMD GPUs"))


def _refuse(backend: str, target: Target) -> Target:
    if backend == "flydsl":
        raise BackendError(f"FLYQUANT_BACKEND=flydsl, but {target.reason}")
    return target


def reference_plan(op: str, target: Target, *reasons: str) -> Plan:
    return Plan(op=op, backend="reference", where=target.where, reasons=(target.reason, *reasons))


def _forced_reference(reason: str) -> None:
    if forced_backend() == "flydsl":
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


def _mxfp8_plan(op: str, x: torch.Tensor, kind: str, scaling_mode: str, scale_layout, *why: str, signed_zeros=True,
                **extra) -> Plan:
    target = _kernel_target(op, x.device)
    if isinstance(target, Plan):
        return target
    from .kernels import mxfp8_quantize_2d as k
    from .kernels._mx_common import Spec
    from .kernels.mxfp8_quantize_3d import matrix_too_large

    too_large = kind != "1x32" and matrix_too_large(x.shape, x.dtype)  # 1x32 launches in row chunks
    if too_large:
        _forced_reference(too_large)
        return reference_plan(op, target, too_large)
    plan = k.plan(kind, tuple(x.shape), x.dtype, target.arch, extra.get("scale_block_k", 1))
    config = {**dataclasses.asdict(plan), **extra}
    spec = Spec(target.arch, _dtype_name(x.dtype), scaling_mode, signed_zeros)
    name = k.kernel_prefix(spec, kind, scale_layout, extra.get("scale_block_k", 1), bool(extra.get("token_groups")))
    conversion = "OCP FP8 conversion" if target.arch == "gfx950" else "OCP bits from the FNUZ converter"
    if not signed_zeros:
        conversion += ", every zero written +0 (signed_zeros=False)"
    layout = f"scales written in the {scale_layout} layout by the kernel" if scale_layout else "plain scales"
    return _kernel_plan(op, target, name, config, *why, conversion, layout)


def plan_mxfp8_quantize(x: torch.Tensor, axis: int, scaling_mode: str, scale_layout, offs, signed_zeros=True) -> Plan:
    """1x32 (axis 1) or 32x1 (axis 0) MXFP8 quantize of a 2D tensor (inputs already validated)."""
    kind = "1x32" if axis == 1 else "32x1"
    # token groups change the kernel only where the scales are blocked per group ("tcgen05")
    return _mxfp8_plan("mxfp8_quantize", x, kind, scaling_mode, scale_layout, signed_zeros=signed_zeros,
                       token_groups=offs is not None and scale_layout == "tcgen05")


def plan_mxfp8_quantize_dual(x: torch.Tensor, scaling_mode: str) -> Plan:
    return _mxfp8_plan("mxfp8_quantize_dual", x, "dual", scaling_mode, None)


def plan_mxfp8_quantize_3d(w: torch.Tensor, scaling_mode: str, scale_block_k: int, scale_layout, signed_zeros=True) -> Plan:
    if not w.is_contiguous() and w.transpose(1, 2).is_contiguous():
        e, n, k = w.shape
        if scale_block_k == 1:
            from .kernels.mxfp8_quantize_3d import transposed_layout_direct

            rows = w.transpose(1, 2).reshape(e * k, n)  # a view: the row-major (E*K, N) matrix w is
            why = ["w is the transpose of a contiguous (E, K, N): the 1x32 kernel on its (E*K, N) rows"]
            if scale_layout and not transposed_layout_direct(e, k, scale_layout):
                # the launcher then runs the plain-scale kernel (kernels.mxfp8_quantize_3d._transposed_3d)
                why.append(f"K = {k} does not fill whole {scale_layout} row tiles: plain scales from the kernel, laid "
                           "out per expert afterwards by torch ops")
                scale_layout = None
            return _mxfp8_plan("mxfp8_quantize_3d", rows, "1x32", scaling_mode, scale_layout, *why,
                               signed_zeros=signed_zeros)
        return _mxfp8_plan("mxfp8_quantize_3d", w.transpose(1, 2), "3d_t", scaling_mode, scale_layout,
                           "w is the transpose of a contiguous (E, K, N): the column kernel's 32x32 variant on "
                           "that tensor, data stored row-major (w's layout)", signed_zeros=signed_zeros,
                           scale_block_k=scale_block_k)
    return _mxfp8_plan("mxfp8_quantize_3d", w, "3d", scaling_mode, scale_layout, signed_zeros=signed_zeros,
                       scale_block_k=scale_block_k)


def _mxfp4_conversion(arch: str) -> str:
    return ("hardware scaled FP4 conversion (v_cvt_scalef32_pk_fp4)" if arch == "gfx950"
            else "software FP4 conversion (no FP4 instruction on gfx942)")


def plan_mxfp4_quantize(x: torch.Tensor, axis: int, scaling_mode: str, shuffle=None, gate_up=False,
                        op: str = "mxfp4_quantize", scale_layout=None) -> Plan:
    """MXFP4 quantize of x (inputs already validated; leading dims flattened to (M, K) rows):
    rowwise (axis -1) or columnwise (axis 0, cast-transpose); shuffle "a16w4" (3D expert weights,
    rowwise): the outputs written in aiter's A16W4 layouts by the same kernel; rowwise shuffle
    "a4w4" / scale_layout "mfma": the data / scales in aiter's gemm_a4w4 layouts, same kernel."""
    target = _kernel_target(op, x.device)
    if isinstance(target, Plan):
        return target
    from .kernels import _mxfp4_shuffles as shuffles
    from .kernels import mxfp4_quantize as rows
    from .kernels import mxfp4_quantize_cols as cols

    shape = (math.prod(x.shape[:-1]), x.shape[-1])
    if axis == -1:  # larger tensors in row chunks of whole experts / layout tiles
        align = rows.chunk_rows(shuffle, scale_layout, x.shape[1] if op == "mxfp4_quantize_3d" else None)
        too_large = rows.too_large(shape, x.dtype, align)
    else:
        too_large = cols.too_large(shape, x.dtype)
    if too_large:
        _forced_reference(too_large)
        return reference_plan(op, target, too_large)
    if axis == -1:
        chunk = rows.rows_per_launch(shape, x.dtype, align)
        first = (chunk, shape[1])  # the (first) launch's rows: the plan describes a launch
        config = dataclasses.asdict(rows.plan_rows(first, target.arch, shuffle, _dtype_name(x.dtype)))
        name = f"mxfp4_rows_{scaling_mode}_{_dtype_name(x.dtype)}_{target.arch}" + ("_tail" if shape[1] % 32 else "")
        if shuffle == "a4w4":
            k_align = shuffles.a4w4_k_align(target.arch, _dtype_name(x.dtype), shape[1])
            name += f"_a4w4_k{k_align}"
        elif shuffle:
            name += "_a16w4_gate_up" if gate_up else "_a16w4"
        name += "_padded" if shuffles.padded_rows(target.arch, _dtype_name(x.dtype), shuffle, -(-shape[1] // 32),
                                                 chunk // 16) else ""
        name += f"_{scale_layout}" if scale_layout else ""
        split = "one lane per block of 32, 16-byte loads and stores"
        if shuffle == "a4w4":
            split += "; data stored in aiter's shuffle_weight (16, 16) layout"
            two = shuffles.two_tile_steps(target.arch, _dtype_name(x.dtype), shuffle)
            split += (f"; a wave's tiles in one row tile, placed once; steps of {'two tiles' if two else 'one tile'}"
                      + ("; the row's last step drops its blocks past K" if k_align == 64 else ""))
        elif shuffle:
            split += f"; data and scales stored in aiter's a16w4 layouts{' (gate_up)' if gate_up else ''}"
        if scale_layout:
            split += "; scales stored in aiter's e8m0_shuffle layout (zero padding)"
        if chunk < shape[0]:
            split += (f"; {-(-shape[0] // chunk)} launches of up to {chunk} rows"
                      + (" (whole experts)" if shuffle and op == "mxfp4_quantize_3d" else "")
                      + ": one launch's buffers stay below 2 GiB (32-bit offsets)")
    else:
        config = dataclasses.asdict(cols.plan_cols(shape, x.dtype, target.arch))
        odd = x.element_size() == 2 and shape[1] % 2
        name = f"mxfp4_cols_{scaling_mode}_{_dtype_name(x.dtype)}_{target.arch}" + ("_odd" if odd else "")
        split = "a lane per 32 rows x 16 bytes of columns, 16-byte loads (whole lines) and stores"
    conversion = _mxfp4_conversion(target.arch)
    return _kernel_plan(op, target, name, config, split, conversion)


def plan_mxfp4_quantize_dual(x: torch.Tensor, scaling_mode: str) -> Plan:
    """Both MXFP4 quantizes of x (validated; flattened to (M, K)) in one kernel."""
    op = "mxfp4_quantize_dual"
    target = _kernel_target(op, x.device)
    if isinstance(target, Plan):
        return target
    from .kernels import mxfp4_quantize_dual as dual

    shape = (math.prod(x.shape[:-1]), x.shape[-1])
    too_large = dual.too_large(shape, x.dtype)
    if too_large:
        _forced_reference(too_large)
        return reference_plan(op, target, too_large)
    config = dataclasses.asdict(dual.plan_dual(shape, target.arch, x.dtype))
    name = f"mxfp4_dual_{scaling_mode}_{_dtype_name(x.dtype)}_{target.arch}" + ("_tail" if shape[1] % 32 else "")
    if dual.in_registers(shape[1], target.arch, x.dtype):
        split = ("a workgroup per 256 rows x 128-byte column tiles, a wave per tile: each lane loads 32 rows x "
                 "16 bytes (whole lines) and quantizes its columns' blocks in registers; the rows' blocks come "
                 "from the same registers, each split over the lanes that hold it, their data stored as whole "
                 "lines through LDS")
    else:
        split = ("a workgroup per 256 x 256 elements, its 4 waves walking tiles of 32 rows x 64 columns: "
                 + ("a lane per row block (16-byte loads)" if shape[1] % 32 else
                    "whole-line loads through LDS, a lane per row block")
                 + ", its elements transposed through LDS, a lane per column block; both outputs' data "
                 "stored as whole lines through LDS")
    conversion = _mxfp4_conversion(target.arch)
    return _kernel_plan(op, target, name, config, split, conversion)


def _moe_config_values(config: dict, source: str, inter_dim: int | None) -> None:
    """Values from the tuning table or FLYQUANT_CONFIG are among the kernel's; k_batch (stage 2's
    split of inter_dim) at most its K iterations for this shape (inter_dim None: no shape yet):
    past them the launcher's error named its own k_batch argument, not the variable, after
    fused_moe had zeroed out."""
    from .kernels import moe_gemm2_a16w4 as k

    allowed = {"tile_m": k.TILE_MS, "tile_n": k.TILE_NS, "waves": k.WAVE_COUNTS}
    for f, values in allowed.items():
        if f in config and config[f] not in values:
            raise env.EnvError(f"{source}: {f} = {config[f]}: expected one of {', '.join(map(str, values))}")
    n_kt = None if inter_dim is None else k.k_iterations(inter_dim)
    if n_kt is not None and config.get("k_batch", 1) > n_kt:
        raise env.EnvError(f"{source}: k_batch = {config['k_batch']}: expected at most ceil(inter_dim / {k.KT}) = "
                           f"{n_kt} for inter_dim = {inter_dim}")


def _tile_m_dividing(block_m: int, tile_m: int, tile_ms) -> int:
    """tile_m, or the largest smaller tile that divides the caller's block_m (a multiple of the
    smallest: _a16w4_target). A tile_m FLYQUANT_CONFIG forces is not replaced: an EnvError (a
    forced tile_m of 64 ran 16-row tiles under a caller's block_m of 16, silently)."""
    if block_m % tile_m == 0:
        return tile_m
    if "tile_m" in config_overrides():
        raise env.EnvError(f"FLYQUANT_CONFIG={env.raw('FLYQUANT_CONFIG')!r}: tile_m = {tile_m} does not divide the "
                           f"caller's block_m = {block_m} (the rows of a sorted block, one expert's): sort with a "
                           "multiple of it, or leave tile_m to the selector")
    return max(m for m in tile_ms if block_m % m == 0 and m <= tile_m)


def _a16w4_target(op: str, act: torch.Tensor, act_name: str, n: tuple[str, int], k: tuple[str, int],
                  block_m) -> Target | Plan:
    """The target of an A16W4 GEMM, or the reference plan: no kernel here, activations not bf16,
    true sizes off the kernel's steps (n: the output columns' (name, size), in 16-column MFMA
    blocks; k: the reduction's, in 32-element chunks), or a caller's block_m (the rows of a sorted
    block) that no row tile divides (the reference takes any)."""
    from .kernels._a16w4_common import K_CHUNK, MFMA_MN, TILE_MS

    target = _kernel_target(op, act.device)
    if isinstance(target, Plan):
        return target
    reason = None
    if act.dtype != torch.bfloat16:
        reason = f"the kernel takes bf16 activations, {act_name} is {_dtype_name(act.dtype)}"
    elif n[1] % MFMA_MN or k[1] % K_CHUNK:
        reason = (f"the kernel takes {n[0]} in multiples of {MFMA_MN} and {k[0]} in multiples of {K_CHUNK}, "
                  f"got {n[0]} = {n[1]}, {k[0]} = {k[1]}")
    elif block_m is not None and block_m % min(TILE_MS):
        reason = (f"the kernel's row tiles ({', '.join(map(str, TILE_MS))}) divide a sorted block: block_m must be a "
                  f"multiple of {min(TILE_MS)}, got {block_m}")
    if reason:
        _forced_reference(reason)
        return reference_plan(op, target, reason)
    return target


def _no_tokens(tokens: int) -> tuple[str, ...]:
    """An A16W4 stage plan's note when there is nothing to compute: the launcher returns before launching."""
    return ("no tokens: nothing is launched",) if tokens == 0 else ()


def _fp4_conversion(arch: str) -> str:
    return "hardware FP4->BF16 conversion" if arch == "gfx950" else "software FP4 unpack"


_CHECKED_TABLE: list = [None]  # the tuning table last checked whole (tuning.loaded_table's object)


def tuning_entry_problem(op: str, shape: dict, config: dict) -> str | None:
    """What no kernel takes in a tuning entry's config (values, k_batch within the shape's K
    iterations, the wave split where tile_m, tile_n and waves are all given), or None."""
    from .kernels import moe_gemm2_a16w4 as k

    stage1 = op == "moe_gemm1_a16w4"
    try:
        _moe_config_values(config, "", shape["inter_dim"])
        if all(f in config for f in ("tile_m", "tile_n", "waves")):
            n_kt = k.k_iterations(shape["model_dim"] if stage1 else shape["inter_dim"])
            k.default_layout(config["tile_m"], config["tile_n"], n_kt, config.get("k_batch", 1), config["waves"], stage1)
    except ValueError as exc:  # EnvError is one
        return str(exc).removeprefix(": ")
    return None


def check_moe_overrides() -> None:
    """FLYQUANT_CONFIG's values among the kernels' and every FLYQUANT_TUNING entry (check_tuning_table),
    for a caller that wants the errors before its first MoE plan (the benches); FLYQUANT_CONFIG's
    k_batch against a shape's K waits for the plan."""
    _moe_config_values(config_overrides(), f"FLYQUANT_CONFIG={env.raw('FLYQUANT_CONFIG')!r}", None)
    check_tuning_table()


def check_tuning_table() -> None:
    """Every entry of the FLYQUANT_TUNING table against the kernels (tuning_entry_problem), once per
    table read, an EnvError naming the first bad one: a bad entry was an error only when a batch of
    its token count arrived."""
    if torch.compiler.is_compiling():  # the traced table was checked when read (tuning._traced_entries)
        return
    table = loaded_table()
    if table is not _CHECKED_TABLE[0]:
        tuning.check_entries(table)
        _CHECKED_TABLE[0] = table


def _tuned_and_forced(op: str, arch: str, tokens, topk, experts, model_dim, inter_dim, block_m) -> tuple[dict, list]:
    """What overrides an A16W4 GEMM's first-principles config, each checked, and the plan's notes
    saying so: the tuning table's entry for this shape (tuning.tuned_entry: the nearest tuned token
    count), unless its tile_m does not divide the caller's block_m (the entry was timed on rows
    sorted at its tile_m: its tile_n and waves on other row tiles were never timed), then
    FLYQUANT_CONFIG's fields that the op has (TUNED_OPS)."""
    check_tuning_table()
    shape = {"tokens": tokens, "topk": topk, "experts": experts, "model_dim": model_dim, "inter_dim": inter_dim}
    entry = tuned_entry(op, arch, shape)
    tuned, notes = {}, []
    if entry is not None:
        i, t, config = entry
        source = f"FLYQUANT_TUNING entries[{i}] (tuned at {t} tokens{'' if t == tokens else ', the nearest'})"
        if block_m is not None and block_m % config.get("tile_m", block_m):
            notes.append(f"{source} not used: its tile_m {config['tile_m']} does not divide the sort's block_m "
                         f"{block_m}")
        else:
            tuned = config
    forced = {f: v for f, v in config_overrides().items() if f in TUNED_OPS[op][1]}
    _moe_config_values(forced, f"FLYQUANT_CONFIG={env.raw('FLYQUANT_CONFIG')!r}", inter_dim)
    from_table = [f for f in tuned if f not in forced]
    if from_table:
        notes.append(f"{', '.join(from_table)} from {source}")
    if forced:
        notes.append(f"{', '.join(forced)} forced by FLYQUANT_CONFIG")
    return tuned | forced, notes


def _wave_split_fits(config: dict, n_kt: int, pair: bool = False) -> None:
    """The final tiles and waves have a wave split (the launcher's default_layout), checked when planning:
    FLYQUANT_CONFIG / the tuning table can pick values valid alone but not together (one wave for 256
    columns), which failed at launch, after moe_sorting had zeroed the output, naming neither."""
    from .kernels import moe_gemm2_a16w4 as k

    try:
        k.default_layout(config["tile_m"], config["tile_n"], n_kt, config.get("k_batch", 1), config["waves"], pair)
    except ValueError as exc:
        sources = [f"{n}={env.raw(n)!r}" for n in ("FLYQUANT_CONFIG", "FLYQUANT_TUNING") if env.raw(n) is not None]
        raise env.EnvError(f"{' / '.join(sources) or 'the MoE config'}: {exc}; pick other tile_m / tile_n / waves") from None


def _moe_config(target: Target, tokens, topk, experts, model_dim, inter_dim, block_m) -> tuple[dict, list]:
    """(tile_m, tile_n, k_batch, waves) and the notes on where they came from: first principles
    (the kernel's choose_config and default_waves), then the tuning table, then FLYQUANT_CONFIG;
    tile_m must divide the caller's block_m."""
    from .kernels import moe_gemm2_a16w4 as k

    tile_m, tile_n, k_batch = k.choose_config(tokens, topk, experts, model_dim, inter_dim, target.arch)
    config = {"tile_m": tile_m, "tile_n": tile_n, "k_batch": k_batch}
    overrides, notes = _tuned_and_forced("moe_gemm2_a16w4", target.arch, tokens, topk, experts, model_dim, inter_dim,
                                         block_m)
    config.update(overrides)
    if block_m is not None:
        config["tile_m"] = _tile_m_dividing(block_m, config["tile_m"], k.TILE_MS)
    if "waves" not in config:  # for the tiles and split actually chosen
        config["waves"] = k.default_waves(config["tile_m"], config["tile_n"], k.k_iterations(inter_dim), config["k_batch"])
    _wave_split_fits(config, k.k_iterations(inter_dim))
    return config, notes


def plan_moe_gemm2_a16w4(a2, w2, topk, block_m, model_dim, inter_dim, out_dtype, has_bias, apply_weights=True) -> Plan:
    """The A16W4 stage-2 GEMM: tiles and split-K for this shape; block_m is the caller's sort."""
    op = "moe_gemm2_a16w4"
    target = _a16w4_target(op, a2, "a2", ("model_dim", model_dim), ("inter_dim", inter_dim), block_m)
    if isinstance(target, Plan):
        return target
    tokens, experts = a2.shape[0] // topk, w2.shape[0]
    config, notes = _moe_config(target, tokens, topk, experts, model_dim, inter_dim, block_m)
    from .kernels._a16w4_common import planned_name

    out_bytes = model_dim * torch.finfo(out_dtype).bits // 8
    # the launched kernel's own name, wave layout and token windows included
    name = planned_name(2, target.arch, config, a2, topk, inter_dim, (1, out_bytes, out_bytes), model_dim, inter_dim,
                        out_dtype=out_dtype, apply_weights=bool(apply_weights), bias=has_bias)
    return _kernel_plan(op, target, name, config, _fp4_conversion(target.arch), *notes, *_no_tokens(tokens))


def plan_moe_gemm1_a16w4(x, w1, topk, block_m, model_dim, inter_dim, has_bias, activation, apply_weights=False,
                         alpha=1.702, limit=7.0, out_row=None) -> Plan:
    """The A16W4 stage-1 GEMM (activation fused): tiles for this shape (no split K), then the tuning
    table, then FLYQUANT_CONFIG's tile_m / tile_n / waves (k_batch does not apply); block_m is the
    caller's sort."""
    op = "moe_gemm1_a16w4"
    target = _a16w4_target(op, x, "x", ("inter_dim", inter_dim), ("model_dim", model_dim), block_m)
    if isinstance(target, Plan):
        return target
    from .kernels import moe_gemm1_a16w4 as k
    from .kernels._a16w4_common import MFMA_MN, SPARSE_ROWS, planned_name

    if w1.shape[1] % (4 * MFMA_MN):  # the shuffles take halves of 16 rows (the launcher refused them after sorting)
        reason = (f"the kernel takes w1's gate and up halves in 32-row scale groups (w1.shape[1] a multiple of "
                  f"{4 * MFMA_MN}), got w1.shape[1] = {w1.shape[1]}")
        _forced_reference(reason)
        return reference_plan(op, target, reason)

    tokens, experts = x.shape[0], w1.shape[0]
    tile_m, tile_n = k.choose_config1(tokens, topk, experts, model_dim, inter_dim, target.arch)
    config = {"tile_m": tile_m, "tile_n": tile_n}
    overrides, notes = _tuned_and_forced(op, target.arch, tokens, topk, experts, model_dim, inter_dim, block_m)
    config.update(overrides)
    config["tile_m"] = _tile_m_dividing(block_m, config["tile_m"], k.TILE_MS)
    if "waves" not in config:
        config["waves"] = k.default_waves(config["tile_m"], config["tile_n"], k.k_iterations(model_dim), 1, pair=True)
    _wave_split_fits(config, k.k_iterations(model_dim), pair=True)
    cols, stride = (inter_dim, inter_dim) if out_row is None else out_row  # a2's (columns, row stride)
    name = planned_name(1, target.arch, config, x, 1, model_dim, (topk, 2 * cols, 2 * stride), model_dim, inter_dim,
                        apply_weights=bool(apply_weights), bias=has_bias, activation=activation, alpha=alpha, limit=limit)
    return _kernel_plan(op, target, name, config, _fp4_conversion(target.arch),
                        "gate and up columns in one workgroup: the activation fused (exp2/rcp), no split K; a tile "
                        f"of at most {SPARSE_ROWS} routed rows compacts them through LDS first", *notes,
                        *_no_tokens(tokens))


def plan_moe_sorting(topk_ids, topk_weights, num_experts: int, block_m: int, expert_mask) -> Plan:
    """moe_sorting (arguments already checked): the one-launch sorting kernel with its wave count,
    or the reference for what the kernel does not take (its limits, kernels.moe_sorting)."""
    op = "moe_sorting"
    target = _kernel_target(op, topk_ids.device)
    if isinstance(target, Plan):
        return target
    from .kernels import moe_sorting as k

    tokens, topk = topk_ids.shape
    pairs = tokens * topk
    reason = None
    if num_experts > k.MAX_EXPERTS:
        reason = f"num_experts = {num_experts} is above the kernel's {k.MAX_EXPERTS}"
    elif block_m > k.MAX_BLOCK_M:
        reason = f"block_m = {block_m} is above the kernel's {k.MAX_BLOCK_M}"
    elif pairs > k.MAX_PAIRS:
        reason = f"T * topk = {pairs} routed pairs: one sorting launch takes at most {k.MAX_PAIRS}"
    if reason:
        _forced_reference(reason)
        return reference_plan(op, target, reason)
    waves = k.choose_waves(pairs, num_experts, target.arch)
    mask_bytes = 0 if expert_mask is None else (expert_mask.element_size() if expert_mask.dtype in k.MASK_DTYPES else 1)
    spec = k.SortSpec(target.arch, num_experts, topk, block_m, k.ID_DTYPES[topk_ids.dtype],
                      k.WEIGHT_DTYPES[topk_weights.dtype], mask_bytes, waves)
    return _kernel_plan(op, target, spec.name, {"waves": waves},
                        "one workgroup sorts, extra ones zero moe_buf: one launch, no host synchronisation",
                        "ids outside [0, num_experts) are dropped (checked only with FLYQUANT_DEBUG=1)")


def moe_block_m(tokens: int, topk: int, experts: int, model_dim: int, inter_dim: int, device: torch.device) -> int:
    """The tile_m the stage-2 kernel wants for this shape: sort with it (the reference takes any)."""
    target = _kernel_target("moe_gemm2_a16w4", device)
    if isinstance(target, Plan):
        return REFERENCE_BLOCK_M
    return _moe_config(target, tokens, topk, experts, model_dim, inter_dim, None)[0]["tile_m"]


REFERENCE_BLOCK_M = 32
