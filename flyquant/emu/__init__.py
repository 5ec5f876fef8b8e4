"""flyquant.emu: run FlyDSL's compiled gfx942/gfx950 code objects on the CPU.

    import flyquant.emu as emu
    emu.enable("gfx950")          # before the first FlyDSL launch; or FLYQUANT_EMU=gfx950
    with emu.record() as launches:
        my_flydsl_launcher(x_cpu, out_cpu, stream=0)
    launches[0].stats             # the interpreter's counters for that launch

``enable`` loads a stand-in for the HIP runtime (see ``runtime``) so that FlyDSL's launcher
runs unchanged on CPU tensors: "device" memory is host memory and each kernel launch runs in
the wave64 interpreter (``interp``) before the launch call returns. It is process-wide
because FlyDSL's runtime library binds to whichever HIP library is loaded first, and it is
refused on a machine with a ROCm device (there the real GPU runs the kernels).

A kernel that fails in the interpreter (unknown instruction, bad address, endless wave, an LDS
race between the waves of a workgroup (``lds_races``), in strict memory mode two workgroups
storing different bytes to one address (``store_races``)) makes the FlyDSL launch call raise
``EmuLaunchError`` in the calling thread, with the interpreter's exception as its ``__cause__``.
"""

from __future__ import annotations

import contextlib
import os
import threading
import warnings
import weakref

from .alloc import aligned, aligned_empty, device_like_allocations, misaligned
from .codeobject import CodeObject, CodeObjectError, KernelInfo
from .memory import EmuMemoryError, Memory
from .errors import EmuError
from .runtime import LaunchRecord, Runtime

ENV_VAR = "FLYQUANT_EMU"

_runtime: Runtime | None = None
_arch: str | None = None


class EmuLaunchError(RuntimeError):
    """A kernel failed under the emulator; ``__cause__`` is the interpreter's exception.

    Raised asynchronously in the launching thread right after the launch call returns: the
    HIP stand-in schedules it with no arguments, and the instance picks up the exception the
    launch callback stored for this thread.
    """

    def __init__(self, *args):
        if not args and _runtime is not None:
            pending = _runtime.pending.pop(threading.get_ident(), None)
            if pending is not None:
                what, cause = pending
                super().__init__(f"{what} failed: {type(cause).__name__}: {cause}")
                self.__cause__ = cause
                return
        super().__init__(*args or ("emulated kernel launch failed",))


KFD_NODES = "/sys/class/kfd/kfd/topology/nodes"


def rocm_device_present() -> bool:
    """Is there a real ROCm GPU? No /dev/kfd means no; otherwise the KFD topology says (a node with
    SIMDs is a GPU, a CPU node has none), or, without it, FlyDSL's device query (which runs
    rocm_agent_enumerator from PATH and counts a failure as no GPU: a ROCm torch from pip on a
    machine without /opt/rocm/bin in PATH would have gone unnoticed)."""
    if not os.path.exists("/dev/kfd"):
        return False
    try:
        nodes = sorted(os.listdir(KFD_NODES))
    except OSError:
        nodes = []
    if nodes:
        return any(_kfd_simds(os.path.join(KFD_NODES, node, "properties")) > 0 for node in nodes)
    from flydsl.runtime.device import get_rocm_device_count

    return get_rocm_device_count() > 0


def _kfd_simds(path: str) -> int:
    """simd_count of a KFD topology node's properties file (0 if unreadable)."""
    try:
        with open(path) as f:
            for line in f:
                key, _, value = line.partition(" ")
                if key == "simd_count":
                    return int(value)
    except (OSError, ValueError):
        pass
    return 0


def enable(arch: str = "gfx950") -> None:
    """Run FlyDSL kernels on the CPU from now on, compiling for `arch` by default.

    Must run before FlyDSL's runtime library is first loaded (before the first launch in the
    process). Calling it again only changes the default compile target. Sets ``ARCH``,
    ``FLYDSL_GPU_ARCH`` and ``ROCM_PATH`` (a linker for code object v6) for FlyDSL, under
    ``toolchain``'s launch lock (so never in the middle of another thread's launch).
    Raises EmuError on a machine with a ROCm device and when FlyDSL already bound to a real HIP;
    an EnvError when FLYQUANT_EMU_MAX_WAVE_INSTRUCTIONS is not a positive integer (the
    interpreter is imported here, so the variable is checked now, not in the first launch).
    """
    global _runtime, _arch
    from .. import toolchain
    from ..arch import arch_info
    from . import interp  # noqa: F401  (reads and checks FLYQUANT_EMU_MAX_WAVE_INSTRUCTIONS)

    arch_info(arch)  # ValueError for anything but gfx942/gfx950
    with toolchain.launch_lock:
        if _runtime is None:
            if rocm_device_present():
                raise EmuError("a ROCm GPU is present: kernels run on it, flyquant.emu stays off")
            _runtime = Runtime(EmuLaunchError)
        # The single place that points FlyDSL's compiler at the target (see flyquant.toolchain).
        os.environ.update(ARCH=arch, FLYDSL_GPU_ARCH=arch, ROCM_PATH=toolchain.rocm_path())
        _arch = arch


def enabled() -> bool:
    return _runtime is not None


def arch() -> str | None:
    """The arch given to `enable` (the default compile target), None when not enabled."""
    return _arch


def _require() -> Runtime:
    if _runtime is None:
        raise EmuError(f"flyquant.emu is not enabled: call flyquant.emu.enable(arch) or set {ENV_VAR}")
    return _runtime


def global_memory() -> Memory:
    """The Memory the interpreter accesses global memory through."""
    return _require().memory


def track(*tensors) -> None:
    """Register the exact bytes of these tensors' storage as valid memory until they are freed.

    Needed in strict mode (``strict_memory``), where only tracked tensors, hipMalloc'd memory
    and the launch's own kernarg segment are valid: then an access past a tensor's end fails.
    """
    mem = global_memory()
    for t in tensors:
        storage = t.untyped_storage()
        if storage.nbytes():
            key = mem.register(storage.data_ptr(), storage.nbytes())
            weakref.finalize(t, mem.unregister, key)


@contextlib.contextmanager
def strict_memory():
    """Inside this block, only tracked tensors, hipMalloc'd memory and kernarg segments are valid.
    The mode is the process's (every thread's launches), from the first open block until the last
    one ends, which brings back the mode before it (overlapping blocks of two threads left it on,
    or off inside the second)."""
    mem = global_memory()
    with _strict_lock:
        if _strict_open[0] == 0:
            _strict_open[1] = mem.strict
        _strict_open[0] += 1
        mem.strict = True
    try:
        yield
    finally:
        with _strict_lock:
            _strict_open[0] -= 1
            if _strict_open[0] == 0:
                mem.strict = _strict_open[1]


_strict_lock = threading.Lock()
_strict_open: list = [0, False]  # strict_memory blocks open, the mode before the first


def launches() -> list[LaunchRecord]:
    """Records of the launches since the last `reset()`, at most the last runtime.RECORDS_KEPT
    (oldest first); record() keeps every launch of its block."""
    return list(_require().records)


def reset() -> None:
    _require().records.clear()


@contextlib.contextmanager
def record():
    """Collect the records of the launches this thread makes inside the block into the yielded
    list (another thread's launches meanwhile are not among them)."""
    runtime = _require()
    collected: list[LaunchRecord] = []
    with runtime._lock:
        runtime.recorders.append((threading.get_ident(), collected))
    try:
        yield collected
    finally:  # by identity: an enclosing record() block's list may be equal (both empty)
        with runtime._lock:
            runtime.recorders[:] = [r for r in runtime.recorders if r[1] is not collected]


def _enable_from_environment() -> None:
    from .. import env
    from ..arch import ARCHS

    value = env.choice(ENV_VAR, sorted(ARCHS))  # EnvError naming FLYQUANT_EMU for anything else
    if value is None:
        return
    if rocm_device_present():
        warnings.warn(f"{ENV_VAR}={value} ignored: a ROCm GPU is present", RuntimeWarning, stacklevel=3)
        return
    enable(value)


_enable_from_environment()

__all__ = [
    "CodeObject",
    "CodeObjectError",
    "EmuError",
    "EmuLaunchError",
    "EmuMemoryError",
    "KernelInfo",
    "LaunchRecord",
    "Memory",
    "aligned",
    "aligned_empty",
    "arch",
    "device_like_allocations",
    "enable",
    "enabled",
    "launches",
    "global_memory",
    "misaligned",
    "record",
    "reset",
    "rocm_device_present",
    "strict_memory",
    "track",
]
