"""The HIP stand-in: build it, load it before FlyDSL's runtime, and serve its launches.

FlyDSL launches through its JIT runtime library (libfly_jit_runtime.so), which links
``libamdhip64.so.7``. We compile ``hip_stub.c`` into a library with that soname and the same
symbol versions (``hip_stub.map``) and load it with RTLD_GLOBAL: when FlyDSL later loads its
runtime, the dynamic loader finds a library of that soname already loaded and binds to it.
FlyDSL's launcher then runs unchanged on CPU tensors (it reads only data_ptr/shape/stride).

A launch arrives in ``_on_launch`` with the code object, kernel name, grid (workgroups),
block, dynamic LDS bytes and ``kernelParams`` (one pointer per explicit kernel argument).
We pack the kernel-argument segment as HIP does, by the metadata's ``.args`` offsets and
sizes, hidden arguments included, and run the interpreter on it.
"""

from __future__ import annotations

import collections
import ctypes
import hashlib
import os
import platform
import shutil
import subprocess
import tempfile
import threading
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from . import codeobject
from .errors import EmuError
from .memory import Memory

SONAME = "libamdhip64.so.7"
_SOURCES = ("hip_stub.c", "hip_stub.map")
KERNARG_ALIGN = 64  # HIP allocates kernarg segments 64-byte aligned (AQL packet convention)
KERNARG_GRANULE = 16  # strict memory: the segment counts as readable up to a multiple of this (launch())
# hipModuleLaunchKernel always describes a 3-dimensional NDRange, whose grid is a whole number
# of workgroups: hidden_grid_dims is 3 and every hidden_remainder_* is 0.
GRID_DIMS = 3


@dataclass(frozen=True)
class LaunchRecord:
    """One emulated launch: what ran, and the interpreter's statistics for it."""

    kernel: str
    arch: str
    grid: tuple[int, int, int]  # workgroups
    block: tuple[int, int, int]  # work-items per workgroup
    dynamic_lds: int
    stats: Any  # the interpreter's LaunchStats


# --- building the stub ---------------------------------------------------------------------------


def _compiler() -> str:
    for candidate in (os.environ.get("CC"), "cc", "gcc", "clang"):
        if candidate and shutil.which(candidate):
            return candidate
    raise EmuError("flyquant.emu needs a C compiler (cc, gcc or clang; or $CC) to build its HIP stand-in")


def stub_path() -> Path:
    """Where the stub for the current sources and machine lives: <cache>/emu/<hash of sources and
    machine>/libamdhip64.so.7 (a home shared with an aarch64 host holds both builds), its directory
    created 0700 if missing and checked private (toolchain.private_dir)."""
    from ..toolchain import cache_dir, private_dir

    here = Path(__file__).resolve().parent
    digest = hashlib.sha256(platform.machine().encode())
    for name in _SOURCES:
        digest.update((here / name).read_bytes())
    return private_dir(cache_dir(), "emu", digest.hexdigest()[:16]) / SONAME


def _sha256(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


def build_stub() -> Path:
    """Compile the stub if this version of its sources was not built yet, or what is there is not
    what was built (its SHA-256 beside it: a copy cut short, an emptied file; loading a truncated
    library killed the process with SIGBUS); returns its path, a file of this user's that no one
    else can write (toolchain.private_file: it is loaded next)."""
    from ..toolchain import private_file

    target = stub_path()
    checksum = target.with_name(SONAME + ".sha256")
    if target.exists():
        private_file(target)  # one another user could have written is refused, not rebuilt over
        if checksum.exists() and checksum.read_text() == _sha256(target):
            return target
    here = Path(__file__).resolve().parent
    with tempfile.TemporaryDirectory(dir=target.parent) as tmp:
        out = Path(tmp) / SONAME
        cmd = [
            _compiler(), "-O2", "-shared", "-fPIC", "-o", str(out),
            f"-Wl,-soname,{SONAME}", f"-Wl,--version-script={here / 'hip_stub.map'}",
            str(here / "hip_stub.c"), "-lpthread",
        ]  # fmt: skip
        result = subprocess.run(cmd, capture_output=True, text=True)
        if result.returncode != 0:
            raise EmuError(f"building the HIP stand-in failed ({' '.join(cmd)}):\n{result.stderr}")
        out.chmod(0o700)  # the linker's mode follows the umask (002: group-writable, refused when loaded)
        (Path(tmp) / "sha256").write_text(_sha256(out))
        out.replace(target)  # atomic: a concurrent first use never loads a half-written library
        (Path(tmp) / "sha256").replace(checksum)
    return private_file(target)


def loaded_libraries() -> list[str]:
    """Paths of the shared libraries mapped into this process."""
    with open("/proc/self/maps") as f:
        return sorted({line.split()[-1] for line in f if ".so" in line and "/" in line})


# --- kernel arguments ----------------------------------------------------------------------------


def _hidden_values(grid, block, dynamic_lds) -> dict[str, int]:
    """Values HIP writes for the hidden arguments it knows; any other hidden kind is left 0
    (null pointers: a kernel that dereferences one faults, as it would with features we lack)."""
    values = {"hidden_grid_dims": GRID_DIMS, "hidden_dynamic_lds_size": dynamic_lds}
    for axis, g, b in zip("xyz", grid, block):
        values[f"hidden_block_count_{axis}"] = g
        values[f"hidden_group_size_{axis}"] = b
        values[f"hidden_remainder_{axis}"] = 0
        values[f"hidden_global_offset_{axis}"] = 0
    return values


def pack_kernargs(
    kernel: codeobject.KernelInfo,
    params: list[bytes],
    grid: tuple[int, int, int],
    block: tuple[int, int, int],
    dynamic_lds: int,
) -> bytearray:
    """The kernel-argument segment: explicit arguments (their bytes, in `params` order) and
    hidden ones at the metadata's offsets; padding bytes are 0."""
    explicit = [a for a in kernel.args if not a.value_kind.startswith("hidden_")]
    if len(params) != len(explicit):
        raise EmuError(f"kernel {kernel.name}: {len(params)} argument values for {len(explicit)} arguments")
    segment = bytearray(kernel.kernarg_segment_size)
    hidden = _hidden_values(grid, block, dynamic_lds)
    values = iter(params)
    for arg in kernel.args:
        if arg.offset + arg.size > len(segment):
            raise EmuError(f"kernel {kernel.name}: argument at {arg.offset}+{arg.size} exceeds the kernarg segment")
        if arg.value_kind.startswith("hidden_"):
            value = hidden.get(arg.value_kind, 0)
            segment[arg.offset : arg.offset + arg.size] = value.to_bytes(arg.size, "little")
        else:
            data = next(values)
            if len(data) != arg.size:
                raise EmuError(f"kernel {kernel.name}: argument at {arg.offset} has {len(data)} bytes, not {arg.size}")
            segment[arg.offset : arg.offset + arg.size] = data
    return segment


def kernarg_buffer(segment: bytes) -> tuple[np.ndarray, int]:
    """The kernarg segment in host memory, KERNARG_ALIGN-aligned: (the buffer holding it, which
    must stay alive while the launch runs, and the segment's address)."""
    buffer = np.zeros(len(segment) + KERNARG_ALIGN, dtype=np.uint8)
    start = -buffer.ctypes.data % KERNARG_ALIGN
    buffer[start : start + len(segment)] = np.frombuffer(bytes(segment), dtype=np.uint8)
    return buffer, buffer.ctypes.data + start


def kernarg_readable_bytes(segment: bytes) -> int:
    """The bytes of a kernarg segment a launch may read: up to the next KERNARG_GRANULE boundary.
    LLVM widens scalar kernarg loads (7 dwords -> s_load_dwordx8) when the extra bytes share an
    aligned granule with used ones (such a read cannot cross a page); kernarg_buffer leaves room."""
    return max(-(-len(segment) // KERNARG_GRANULE) * KERNARG_GRANULE, 1)


def read_kernel_params(kernel: codeobject.KernelInfo, kernel_params: int) -> list[bytes]:
    """The bytes of each explicit argument from HIP's ``void **kernelParams``."""
    explicit = [a for a in kernel.args if not a.value_kind.startswith("hidden_")]
    if explicit and not kernel_params:
        raise EmuError(f"kernel {kernel.name}: launched without kernelParams but has {len(explicit)} arguments")
    pointers = ctypes.cast(kernel_params, ctypes.POINTER(ctypes.c_void_p))
    return [ctypes.string_at(pointers[i], a.size) for i, a in enumerate(explicit)]


# --- the runtime ----------------------------------------------------------------------------------

_LAUNCH_CB = ctypes.CFUNCTYPE(
    ctypes.c_int,
    ctypes.c_uint64, ctypes.c_void_p, ctypes.c_size_t, ctypes.c_char_p,
    ctypes.c_uint, ctypes.c_uint, ctypes.c_uint, ctypes.c_uint, ctypes.c_uint, ctypes.c_uint,
    ctypes.c_uint, ctypes.c_void_p, ctypes.c_void_p,
)  # fmt: skip
_ALLOC_CB = ctypes.CFUNCTYPE(None, ctypes.c_void_p, ctypes.c_size_t)
_OCCUPANCY_CB = ctypes.CFUNCTYPE(
    ctypes.c_int, ctypes.c_uint64, ctypes.c_void_p, ctypes.c_size_t, ctypes.c_char_p, ctypes.c_int, ctypes.c_size_t
)

RECORDS_KEPT = 1000  # emu.launches(): the last launches' records (about 10 KB each: a long run kept them all)


class Runtime:
    """The loaded stub and what it needs from Python: memory, code objects, launch records."""

    def __init__(self, error_type: type[BaseException]):
        for lib in loaded_libraries():
            name = os.path.basename(lib)
            if name.startswith("libfly_jit_runtime") or name.startswith("libamdhip64"):
                raise EmuError(
                    f"{lib} is already loaded in this process, so FlyDSL is bound to the real HIP runtime; "
                    "enable flyquant.emu before the first FlyDSL launch (or set FLYQUANT_EMU=gfx950|gfx942)"
                )
        self.path = build_stub()
        self.lib = ctypes.CDLL(str(self.path), mode=ctypes.RTLD_GLOBAL)
        self.memory = Memory()
        self.records: collections.deque[LaunchRecord] = collections.deque(maxlen=RECORDS_KEPT)
        self.recorders: list[tuple[int, list[LaunchRecord]]] = []  # (thread ident, emu.record()'s list)
        # thread id -> (what failed, its exception), raised there as EmuLaunchError
        self.pending: dict[int, tuple[str, BaseException]] = {}
        self._code_objects: dict[int, codeobject.CodeObject] = {}
        self._allocations: dict[int, int] = {}  # hipMalloc pointer -> memory region key
        self._lock = threading.Lock()
        self.executor = None  # interp.execute, imported at the first launch
        # The callbacks must outlive the library's use of them: keep them on self.
        self._callbacks = (_LAUNCH_CB(self._on_launch), _ALLOC_CB(self._on_alloc), _OCCUPANCY_CB(self._on_occupancy))
        api = ctypes.pythonapi
        self.lib.flyquant_emu_set_callbacks(
            *self._callbacks,
            ctypes.cast(api.PyGILState_Ensure, ctypes.c_void_p),
            ctypes.cast(api.PyGILState_Release, ctypes.c_void_p),
            ctypes.cast(api.PyThreadState_SetAsyncExc, ctypes.c_void_p),
            ctypes.c_void_p(id(error_type)),
        )
        self._error_type = error_type  # referenced by address from C: keep it alive

    def code_object(self, module_id: int, image: int, size: int) -> codeobject.CodeObject:
        co = self._code_objects.get(module_id)
        if co is None:
            co = self._code_objects[module_id] = codeobject.load(ctypes.string_at(image, size))
        return co

    def _kernel(self, co: codeobject.CodeObject, name: str) -> codeobject.KernelInfo:
        try:
            return co.kernels[name]
        except KeyError:
            raise EmuError(f"kernel {name!r} is not in the code object (it has {sorted(co.kernels)})") from None

    def launch(self, co, name, grid, block, dynamic_lds, kernel_params) -> LaunchRecord:
        """Pack the arguments, run the interpreter, record the launch."""
        kernel = self._kernel(co, name)
        segment = pack_kernargs(kernel, read_kernel_params(kernel, kernel_params), grid, block, dynamic_lds)
        buffer, address = kernarg_buffer(segment)  # noqa: F841 (buffer: keeps the segment alive)
        key = self.memory.register(address, kernarg_readable_bytes(segment), writable=False)
        try:
            if self.executor is None:
                from .interp import execute

                self.executor = execute
            stats = self.executor(co, name, grid, block, address, dynamic_lds, self.memory)
        finally:
            self.memory.unregister(key)
        record = LaunchRecord(name, co.arch, grid, block, dynamic_lds, stats)
        me = threading.get_ident()  # the launching thread: the stub calls back in it
        with self._lock:
            self.records.append(record)
            for thread, recorder in self.recorders:
                if thread == me:
                    recorder.append(record)
        return record

    # Callbacks from C. They must not raise: an exception is stored for the launching thread and
    # the stub makes Python raise `error_type` there once the launch call has returned.
    def _on_launch(self, module_id, image, size, name, gx, gy, gz, bx, by, bz, shared, _stream, params) -> int:
        what = f"kernel {name.decode()}"
        try:
            co = self.code_object(module_id, image, size)
            what = f"kernel {name.decode()} ({co.arch})"
            self.launch(co, name.decode(), (gx, gy, gz), (bx, by, bz), shared, params)
            return 0
        except BaseException as exc:  # noqa: BLE001 (re-raised in the launching thread)
            self.pending[threading.get_ident()] = (what, exc)
            return 1

    def _on_alloc(self, ptr, size) -> None:
        if size:
            self._allocations[ptr] = self.memory.register(ptr, size)
        elif ptr in self._allocations:
            self.memory.unregister(self._allocations.pop(ptr))

    def _on_occupancy(self, module_id, image, size, name, block_size, dynamic_lds) -> int:
        """Workgroups per CU for hipModuleOccupancyMaxActiveBlocksPerMultiprocessor (-1: error)."""
        try:
            from ..arch import WAVE_SIZE, occupancy

            co = self.code_object(module_id, image, size)
            kernel = self._kernel(co, name.decode())
            waves = -(-block_size // WAVE_SIZE)
            lds = kernel.group_segment_fixed_size + dynamic_lds
            return occupancy(co.arch, kernel.vgpr_count, kernel.agpr_count, lds, waves)
        except BaseException as exc:  # noqa: BLE001 (re-raised in the calling thread)
            self.pending[threading.get_ident()] = (f"occupancy query for kernel {name.decode()}", exc)
            return -1
