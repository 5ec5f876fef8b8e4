"""Session setup: without a ROCm GPU, FlyDSL kernels run under flyquant.emu, in strict memory.

The emulator must be enabled before FlyDSL's runtime library is first loaded (the first
launch), so it is done once, when pytest starts. Tests marked ``gpu`` (marker registered in
pyproject.toml) need a real MI300X/MI355X and are skipped here. On a machine with a ROCm GPU it
is the other way round: the emulator stays off (flyquant.emu.enable refuses), so only the ``gpu``
tests run (and only on a gfx942/gfx950, the arch torch reports); the others are skipped there.

Every test runs in the emulator's strict memory mode (fixture ``strict_launch_memory``): a
kernel launch may touch only the bytes of the tensors handed to that launch (each tensor's own
extent, not its whole storage), hipMalloc'd memory, its kernarg segment and tensors a test
tracked itself. An access anywhere else, past a tensor's end included, fails the launch and so
the test that made it. Strict mode also fails a launch in which two workgroups store different
bytes to one address (flyquant.emu.store_races). A test that must see the loose mode opts out
with ``@pytest.mark.loose_memory("why")``.

Each test starts with the emulator's default compile target, DEFAULT_EMU_ARCH (fixture
``default_emu_arch``), whatever arch an earlier test enabled.

The emulator completes every load at once, so it cannot see a missing s_waitcnt: instead every
kernel a test compiles through ``toolchain.compile_only`` (each family's compile tests and the
benches' resource rows) has its final ISA checked by tests/isa_waits.py (fixture
``isa_waits_checked``), and a missing or too loose wait fails that test.
"""

import contextlib
import functools
import importlib

import pytest
import torch
from flydsl.compiler.jit_function import JitFunction

import flyquant.emu as emu
from flyquant import select, toolchain
from flyquant.arch import ARCHS

import isa_waits

DEFAULT_EMU_ARCH = "gfx950"  # the default compile target; tests pick their arch with toolchain.target


def pytest_configure(config):
    if not emu.rocm_device_present() and not emu.enabled():
        emu.enable(DEFAULT_EMU_ARCH)


def pytest_collection_modifyitems(config, items):
    if not emu.rocm_device_present():
        skip = {True: pytest.mark.skip(reason="needs a real MI300X/MI355X: no ROCm device on this machine")}
    else:  # the emulator stays off (flyquant.emu.enable refuses): only the gpu tests can run, on gfx942/gfx950
        arch = gpu_arch()
        skip = {False: pytest.mark.skip(reason="runs under flyquant.emu, which stays off while a ROCm GPU is "
                                               "present (the default run on a machine without one covers it)")}
        if arch not in ARCHS:
            seen = arch or "no ROCm GPU"
            skip[True] = pytest.mark.skip(reason=f"needs an MI300X/MI355X (gfx942/gfx950); torch sees {seen}")
    for item in items:
        marker = skip.get("gpu" in item.keywords)
        if marker is not None:
            item.add_marker(marker)


def gpu_arch() -> str | None:
    """The arch of torch's first ROCm GPU (as the selector reads it), None if torch has none."""
    if not (torch.version.hip and torch.cuda.is_available()):
        return None
    return select._rocm_arch_of(0)


_DATA_PTR = torch.Tensor.data_ptr  # the real one (raw-address launchers get a recording one)


def tensor_extent(t: torch.Tensor) -> tuple[int, int] | None:
    """(first byte address, byte count) a tensor's elements span, None when it has none."""
    if t.numel() == 0:
        return None
    item = t.element_size()
    lo = sum((n - 1) * s for n, s in zip(t.shape, t.stride()) if s < 0)
    hi = sum((n - 1) * s for n, s in zip(t.shape, t.stride()) if s > 0)
    return _DATA_PTR(t) + lo * item, (hi - lo + 1) * item


# Torch-facing launchers that hand FlyDSL raw addresses instead of tensors: while one runs,
# every tensor whose address it takes (data_ptr) is valid memory, outputs it allocates included.
RAW_ADDRESS_LAUNCHERS = (("flyquant.kernels.moe_gemm2_a16w4", "moe_gemm2_a16w4"),
                         ("flyquant.kernels.moe_gemm1_a16w4", "moe_gemm1_a16w4"),
                         ("flyquant.kernels.mxfp8_grouped_mm", "grouped_mm"),
                         ("flyquant.kernels.mxfp8_grouped_mm", "grouped_mm_wgrad"))


class _Extents:
    """Tensor extents registered as valid memory, unregistered together."""

    def __init__(self, memory):
        self.memory, self.keys = memory, []

    def add(self, t):
        extent = tensor_extent(t) if isinstance(t, torch.Tensor) and t.device.type == "cpu" else None
        if extent is not None:
            self.keys.append(self.memory.register(*extent))

    def release(self):
        for key in self.keys:
            self.memory.unregister(key)


def _jit_call_tracked(call, memory):
    """A FlyDSL JIT call with its tensor arguments valid memory while it runs."""

    @functools.wraps(call)
    def tracked(self, *args, **kwargs):
        extents = _Extents(memory)
        try:
            for a in (*args, *kwargs.values()):
                extents.add(a)
            return call(self, *args, **kwargs)
        finally:
            extents.release()

    return tracked


def _raw_launcher_tracked(fn, memory):
    """A raw-address launcher with every tensor whose data_ptr it reads valid memory while it runs."""

    @functools.wraps(fn)
    def tracked(*args, **kwargs):
        extents = _Extents(memory)

        def recorded_data_ptr(t):
            extents.add(t)
            return _DATA_PTR(t)

        torch.Tensor.data_ptr = recorded_data_ptr
        try:
            return fn(*args, **kwargs)
        finally:
            torch.Tensor.data_ptr = _DATA_PTR
            extents.release()

    return tracked


@contextlib.contextmanager
def _launch_arguments_tracked(monkeypatch):
    """Register each launch's tensors (their extents) as valid memory for the duration of that
    launch: FlyDSL JIT calls' tensor arguments, and the raw-address launchers' tensors."""
    memory = emu.global_memory()
    monkeypatch.setattr(JitFunction, "__call__", _jit_call_tracked(JitFunction.__call__, memory))
    for module, name in RAW_ADDRESS_LAUNCHERS:
        mod = importlib.import_module(module)
        monkeypatch.setattr(mod, name, _raw_launcher_tracked(getattr(mod, name), memory))
    yield


@pytest.fixture(autouse=True)
def default_emu_arch():
    """Each test starts on DEFAULT_EMU_ARCH: emu.enable(arch) (tests, the demo and the bench scripts
    call it) changes the process-wide default target, so a test's outcome depended on which tests
    ran before it."""
    if emu.enabled() and emu.arch() != DEFAULT_EMU_ARCH:
        emu.enable(DEFAULT_EMU_ARCH)
    yield


@pytest.fixture(autouse=True)
def strict_launch_memory(request, monkeypatch):
    """Strict memory for every test (see the module docstring); ``loose_memory`` opts out."""
    if emu.rocm_device_present() or not emu.enabled() or request.node.get_closest_marker("loose_memory"):
        yield
        return
    with emu.strict_memory(), _launch_arguments_tracked(monkeypatch):
        yield


def _waits_checked(compile_only):
    @functools.wraps(compile_only)
    def checked(*args, **kwargs):
        reports = compile_only(*args, **kwargs)
        for rep in reports:
            found = isa_waits.violations(rep.isa)
            assert not found, f"{rep.name} ({rep.arch}): missing s_waitcnt\n" + "\n".join(found)
        return reports

    return checked


@pytest.fixture(autouse=True, scope="session")
def isa_waits_checked():
    """toolchain.compile_only checks each compiled ISA for missing waits (module docstring)."""
    original = toolchain.compile_only
    toolchain.compile_only = _waits_checked(original)
    yield
    toolchain.compile_only = original


@pytest.fixture
def reference_backend(monkeypatch):
    """Every op on the pure-PyTorch reference (FLYQUANT_BACKEND=reference)."""
    monkeypatch.setenv("FLYQUANT_BACKEND", "reference")


@pytest.fixture
def moe_launcher_configs(monkeypatch):
    """The configurations the MoE kernels' launchers are asked for while the test runs (sorting,
    stage 1, stage 2), in order: each distinct one is a kernel compiled (or loaded from the disk
    cache) once, so warming up a call means its configurations are among the warm-up's."""
    from flyquant.kernels import moe_gemm1_a16w4, moe_gemm2_a16w4, moe_sorting

    seen = []
    for module in (moe_gemm1_a16w4, moe_gemm2_a16w4, moe_sorting):
        build = module._cached_launcher
        monkeypatch.setattr(module, "_cached_launcher", lambda cfg, build=build: seen.append(cfg) or build(cfg))
    return seen
