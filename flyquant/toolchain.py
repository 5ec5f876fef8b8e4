"""Compile FlyDSL kernels for gfx942/gfx950 on any machine, and read what was generated.

FlyDSL picks its target from the environment (``ARCH`` for the compiler, ``FLYDSL_GPU_ARCH`` for
``get_rocm_arch()`` that kernel code may call) and links with ``$ROCM_PATH/llvm/bin/ld.lld``.
Without ROCm we point ``ROCM_PATH`` at a directory whose ``ld.lld`` runs the LLD shipped by the
``ziglang`` package (Debian's lld is too old for code object v6). Our kernels call no
device-library math, so no ROCm bitcode is needed.

A FlyDSL ``@flyc.jit`` function freezes its target at its first call, and loads its code object
once, on the device current at its first launch (hipModuleLoadData gives a module valid on that
device only). So kernel families build one jit function per arch and device (``launcher_cache``)
and call it inside ``target(arch, device)``, which makes the tensors' GPU the current device.

FlyDSL takes its target and cache directory only from ``os.environ`` (its ``env`` options are
re-read on every access; there is no per-call argument), so ``target`` sets them and holds
``launch_lock``, a process-wide re-entrant lock, for the whole block: threads compile and
launch one at a time, and every variable is restored when the block ends.

The cache (``$FLYQUANT_CACHE_DIR``, default ``$XDG_CACHE_HOME/flyquant`` or
``~/.cache/flyquant``) holds code this process loads: FlyDSL's pickled kernels, the emulator's
HIP stand-in (a shared object) and the linker script. So it must be private: every directory
flyquant reads code from is owned by the user and writable by no one else, directories flyquant
creates are 0700, and a directory that fails the check is a ``CacheDirError`` naming it and the
fix, never used.
"""

from __future__ import annotations

import contextlib
import fcntl
import functools
import hashlib
import io
import os
import re
import stat
import sys
import tempfile
import threading
from dataclasses import dataclass
from pathlib import Path

from . import env
from .arch import arch_info, occupancy


class ToolchainError(RuntimeError):
    """Something needed to compile kernels is missing."""


class CacheDirError(ToolchainError):
    """A cache directory (or a file in it) that other users could write: code loaded from it
    could be theirs."""


launch_lock = threading.RLock()
"""Held for the whole of a ``target()`` block and by ``flyquant.emu.enable``: FlyDSL reads its
target and cache directory from os.environ, which all threads share."""

_launch_device: list[int | None] = [None]  # the GPU of the innermost target() block (launch_lock guards it)
_in_target = threading.local()  # .depth: the target() blocks this thread is inside

_GROUP_OTHER_WRITE = stat.S_IWGRP | stat.S_IWOTH
_GROUP_OTHER_SEARCH = stat.S_IXGRP | stat.S_IXOTH
_CACHE_WHY = (
    "flyquant loads code from its cache (FlyDSL's pickled kernels, the emulator's HIP library, the linker "
    "script), so every directory in it must be owned by you (uid {uid}) and writable by no one else"
)


def _unsafe(path, problem: str, fix: str, source: str) -> CacheDirError:
    why = _CACHE_WHY.format(uid=os.geteuid())
    return CacheDirError(f"unsafe cache directory {path} ({source}): {problem}. {why}. Fix: {fix}")


def _check_private(path: Path, st: os.stat_result, source: str, fix_root: str) -> None:
    """`path` (stat `st`) is owned by us and not writable by group or others."""
    if st.st_uid != os.geteuid():
        fix = f"point {fix_root} at a new directory (flyquant creates it 0700)"
        raise _unsafe(path, f"it is owned by uid {st.st_uid}", fix, source)
    if st.st_mode & _GROUP_OTHER_WRITE:
        raise _unsafe(
            path, f"group or others can write it (mode {stat.S_IMODE(st.st_mode):#o})",
            f"chmod go-w {path} (or chmod 700), or point {fix_root} at a new directory", source,
        )  # fmt: skip


def _check_ancestor(path: Path, source: str, fix_root: str) -> None:
    """A directory above the cache: others may write it only with the sticky bit (as /tmp), else
    they could rename the cache away and put their own in its place."""
    st = os.stat(path)
    if st.st_mode & _GROUP_OTHER_WRITE and not st.st_mode & stat.S_ISVTX:
        raise _unsafe(
            path, f"group or others can write it (mode {stat.S_IMODE(st.st_mode):#o}, no sticky bit), so they could "
            "replace the cache directory inside it", f"chmod go-w {path}, or point {fix_root} at a directory elsewhere", source,
        )  # fmt: skip


# Directories already checked in this process: path -> (st_dev, st_ino, st_uid, st_mode) at the
# check; a later call only stats the directory itself and checks again if anything changed.
_checked: dict[str, tuple[int, int, int, int]] = {}
_checked_lock = threading.Lock()


def _identity(st: os.stat_result) -> tuple[int, int, int, int]:
    return st.st_dev, st.st_ino, st.st_uid, st.st_mode


def private_dir(root, *parts: str, source: str = "FLYQUANT_CACHE_DIR", tree: bool = False) -> Path:
    """``root/parts``, created if missing (every directory created 0700) and checked: `root` and
    every directory below it up to the result exist as directories owned by this user and not
    writable by group or others; directories above `root` are not writable by group or others
    unless sticky. With `tree`, every entry inside the result is checked the same way (FlyDSL
    creates its own subdirectories and pickles there; under a umask such as 002 they are
    group-writable: where a directory on the way denies group and others its search permission, as
    the ones flyquant creates do, no one else can reach them, and such an entry of ours loses its
    group write bit instead of being refused; one others can write is refused). Symlinks are
    resolved first. Raises
    CacheDirError naming the directory, the problem and the fix; `source` says where `root`
    came from (the variable that names it)."""
    fix_root = source if source.isupper() else "FLYQUANT_CACHE_DIR"
    path = Path(root, *parts)
    key = str(path)
    try:
        st = os.stat(path)
    except FileNotFoundError:
        st = None
    if st is not None and _checked.get(key) == _identity(st):
        return path
    real_root = Path(os.path.realpath(root))
    levels = [real_root, *(real_root.joinpath(*parts[: i + 1]) for i in range(len(parts)))]
    for ancestor in reversed(real_root.parents):
        if ancestor.exists():
            _check_ancestor(ancestor, source, fix_root)
        else:
            levels.insert(0, ancestor)  # created by us below, so checked as ours
    levels = sorted(set(levels), key=lambda p: len(p.parts))
    sealed = False  # a level denies group and others its search permission: no one else reaches below
    for level in levels:
        try:
            os.mkdir(level, 0o700)
            os.chmod(level, 0o700)  # whatever the umask
        except FileExistsError:
            pass
        except OSError as exc:
            raise CacheDirError(
                f"cannot create cache directory {level} ({source}): {exc.strerror}. "
                f"Fix: point {fix_root} at a directory you can create"
            ) from None
        st = os.stat(level)
        if not stat.S_ISDIR(st.st_mode):
            raise _unsafe(level, "it is not a directory", f"remove it, or point {fix_root} elsewhere", source)
        _check_private(level, st, source, fix_root)
        sealed = sealed or not st.st_mode & _GROUP_OTHER_SEARCH
    if tree:
        for entry in _walk(levels[-1]):
            try:
                entry_stat = os.stat(entry)
            except FileNotFoundError:  # a temporary file another process just renamed
                continue
            if sealed and entry_stat.st_uid == os.geteuid() and entry_stat.st_mode & _GROUP_OTHER_WRITE == stat.S_IWGRP:
                os.chmod(entry, stat.S_IMODE(entry_stat.st_mode) & ~stat.S_IWGRP)
                continue
            _check_private(entry, entry_stat, source, fix_root)
    with _checked_lock:
        _checked[key] = _identity(os.stat(path))
    return path


def _walk(top: Path):
    for dirpath, dirnames, filenames in os.walk(top):
        for name in (*dirnames, *filenames):
            yield Path(dirpath, name)


def private_file(path: Path, source: str = "FLYQUANT_CACHE_DIR") -> Path:
    """A file flyquant is about to load or run: a regular file owned by this user that group and
    others cannot write (its directory was checked by private_dir)."""
    st = os.lstat(path)
    if not stat.S_ISREG(st.st_mode):
        raise _unsafe(path, "it is not a regular file", "remove it (flyquant rebuilds it)", source)
    _check_private(path, st, source, source if source.isupper() else "FLYQUANT_CACHE_DIR")
    return path


def cache_dir() -> Path:
    """flyquant's own cache: $FLYQUANT_CACHE_DIR (an absolute path), else $XDG_CACHE_HOME/flyquant
    (when an absolute path, as the XDG spec says), else ~/.cache/flyquant; created 0700 if missing
    and checked private (see private_dir) on every call."""
    configured = env.absolute_path("FLYQUANT_CACHE_DIR")
    if configured is not None:
        return private_dir(configured)
    xdg = os.environ.get("XDG_CACHE_HOME", "")
    if os.path.isabs(xdg):
        return private_dir(Path(xdg) / "flyquant", source="$XDG_CACHE_HOME/flyquant; FLYQUANT_CACHE_DIR is unset")
    return private_dir(Path.home() / ".cache" / "flyquant", source="the default; FLYQUANT_CACHE_DIR is unset")


def _lld_works(lld: Path) -> bool:
    return lld.is_file() and os.access(lld, os.X_OK)


def rocm_path() -> str:
    """A ROCM_PATH whose llvm/bin/ld.lld links code object v6: ROCm's own, else a ziglang shim
    (written again if the cache was deleted under this process: every later compile failed with
    "lld invocation failed")."""
    path = _rocm_path()
    if not os.path.exists(os.path.join(path, "llvm", "bin", "ld.lld")):
        _rocm_path.cache_clear()
        path = _rocm_path()
    return path


@functools.lru_cache(maxsize=None)
def _rocm_path() -> str:
    for candidate in (os.environ.get("ROCM_PATH"), "/opt/rocm"):
        if candidate and _lld_works(Path(candidate) / "llvm" / "bin" / "ld.lld"):
            return candidate
    try:
        import ziglang  # noqa: F401  (only its presence matters: `python -m ziglang ld.lld`)
    except ImportError:
        raise ToolchainError(
            "no ld.lld to link gfx942/gfx950 code objects: install ROCm, or the 'ziglang' package "
            "(pip install 'flyquant[cpu]')"
        ) from None
    root = cache_dir()
    shim = root / "rocm-shim"
    lld = private_dir(root, "rocm-shim", "llvm", "bin") / "ld.lld"
    script = f'#!/bin/sh\nexec "{sys.executable}" -m ziglang ld.lld "$@"\n'
    if not lld.exists() or lld.read_text() != script:
        tmp = lld.with_suffix(f".tmp{os.getpid()}")
        tmp.write_text(script)
        tmp.chmod(0o700)
        tmp.replace(lld)  # atomic: concurrent first uses never see a half-written script
    private_file(lld)  # FlyDSL runs it to link every kernel
    return str(shim)


@contextlib.contextmanager
def _environ(**values: str | None):
    old = {k: os.environ.get(k) for k in values}
    try:
        for k, v in values.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v
        yield
    finally:
        for k, v in old.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v


@functools.lru_cache(maxsize=None)
def _kernel_sources_digest() -> str:
    import flydsl

    from . import kernels

    digest = hashlib.sha256(flydsl.__version__.encode())
    for path in sorted(Path(kernels.__file__).parent.glob("*.py")):
        digest.update(path.name.encode() + path.read_bytes())
    return digest.hexdigest()[:16]


def kernel_cache_dir() -> str:
    """FlyDSL's disk cache for our kernels, one directory per version of their sources, checked
    private with everything in it (FlyDSL unpickles its entries) on every call.

    FlyDSL's cache key does not cover every helper a kernel reaches (module attributes, closure
    objects), so an edited kernel could be served stale bytes: keying the directory on a hash of
    the kernel sources and the FlyDSL version rules that out.
    """
    key = tuple(os.environ.get(v) for v in ("FLYQUANT_CACHE_DIR", "XDG_CACHE_HOME", "HOME"))  # cache_dir()'s inputs
    path = _kernel_dirs.get(key)
    if path is not None:  # the launch path: one stat when nothing changed since the full check
        try:
            if _checked.get(path) == _identity(os.stat(path)):
                return path
        except OSError:
            pass
    path = str(private_dir(cache_dir(), "flydsl", _kernel_sources_digest(), tree=True))
    _kernel_dirs[key] = path
    return path


_kernel_dirs: dict[tuple, str] = {}  # (FLYQUANT_CACHE_DIR, XDG_CACHE_HOME, HOME) -> kernel_cache_dir() checked


@contextlib.contextmanager
def target(arch: str, device=None):
    """Compile (and launch) FlyDSL kernels for `arch` inside this block, on `device` (a
    torch.device: the tensors'; None or a CPU one, where flyquant.emu runs them, changes nothing).

    Holds ``launch_lock`` for the whole block (threads compile and launch one at a time; the
    lock is re-entrant, so blocks nest) and sets ``ARCH``, ``FLYDSL_GPU_ARCH``, ``ROCM_PATH`` and
    ``FLYDSL_RUNTIME_CACHE_DIR``, each restored (or removed) when the block ends. The cache is
    ``kernel_cache_dir()``, or a directory of the user's own in FLYDSL_RUNTIME_CACHE_DIR, checked
    private the same way (CacheDirError otherwise). A GPU `device` is the current device for the
    block (torch.cuda.device: a model spread over GPUs, with transformers' device_map, calls us
    on each while the current device stays cuda:0) and the key of ``launcher_cache``'s launchers."""
    arch_info(arch)
    with launch_lock:
        user_cache = os.environ.get("FLYDSL_RUNTIME_CACHE_DIR")
        if user_cache:
            cache = str(private_dir(user_cache, source="FLYDSL_RUNTIME_CACHE_DIR", tree=True))
        else:
            cache = kernel_cache_dir()
        _check_lockable(cache)
        _in_target.depth = getattr(_in_target, "depth", 0) + 1
        try:
            with _environ(ARCH=arch, FLYDSL_GPU_ARCH=arch, ROCM_PATH=rocm_path(), FLYDSL_RUNTIME_CACHE_DIR=cache), \
                    _on_device(device):
                yield
        finally:
            _in_target.depth -= 1


_lockable: set[str] = set()  # kernel cache directories _check_lockable passed in this process


def _check_lockable(cache: str) -> None:
    """FlyDSL guards each cache entry with flock on `<entry>.lock`, opened for writing even to read
    the entry: a read-only cache (a pre-warmed container image) raised a bare PermissionError, and
    a filesystem without flock (Lustre without -o flock, some FUSE mounts) made every compile wait
    600 s with no message (helper-79). Probed once per directory and process; a CacheDirError
    names the fix. Not with FLYDSL_RUNTIME_ENABLE_CACHE=0 (no disk cache)."""
    if cache in _lockable or os.environ.get("FLYDSL_RUNTIME_ENABLE_CACHE") == "0":
        return
    fix = ("point FLYQUANT_CACHE_DIR (or FLYDSL_RUNTIME_CACHE_DIR) at a writable directory on a local "
           "filesystem, or set FLYDSL_RUNTIME_ENABLE_CACHE=0 (no disk cache: each process compiles its kernels)")
    try:
        fd = os.open(os.path.join(cache, ".lock-probe"), os.O_RDWR | os.O_CREAT, 0o600)
    except OSError as exc:
        raise CacheDirError(f"cannot write in the kernel cache {cache} ({exc.strerror}): FlyDSL opens a lock "
                            f"file beside each entry, even to read it. Fix: {fix}") from None
    try:
        fcntl.flock(fd, fcntl.LOCK_SH | fcntl.LOCK_NB)
        fcntl.flock(fd, fcntl.LOCK_UN)
    except BlockingIOError:
        pass  # held by another process: locking works
    except OSError as exc:
        raise CacheDirError(f"the filesystem of the kernel cache {cache} does not support flock ({exc.strerror}): "
                            f"FlyDSL's locks would wait 600 s for every kernel. Fix: {fix}") from None
    finally:
        os.close(fd)
    _lockable.add(cache)


def stream(tensor):
    """The stream argument of a launch on `tensor`'s device: torch's current stream there (FlyDSL
    reads its handle), or 0 on the CPU, where flyquant.emu runs the kernels. A CPU tensor with
    the emulator off is a ToolchainError (a real GPU would be handed host addresses), but for
    compile_only (COMPILE_ONLY=1: FlyDSL compiles and launches nothing)."""
    if tensor.device.type != "cuda":
        from . import emu

        if not emu.enabled() and os.environ.get("COMPILE_ONLY") != "1":
            raise ToolchainError(f"a {tensor.device.type} tensor reaches a FlyDSL kernel launch, but flyquant.emu "
                                 "is off (kernels run on GPU tensors, or on CPU ones under the emulator)")
        return 0
    import torch

    return torch.cuda.current_stream(tensor.device)


@contextlib.contextmanager
def _on_device(device):
    """`device` current (torch.cuda.device) and launcher_cache's key inside the block, if a GPU."""
    if device is None or device.type != "cuda":
        yield
        return
    import torch

    index = torch.cuda.current_device() if device.index is None else device.index
    outer = _launch_device[0]
    _launch_device[0] = index
    try:
        with torch.cuda.device(index):
            yield
    finally:
        _launch_device[0] = outer


def launcher_cache(build):
    """``functools.lru_cache`` of a kernel family's launcher builder, one launcher per device:
    FlyDSL loads a launcher's code object on the device current at its first launch, a module
    valid there only, so each GPU needs launchers of its own. The device is part of the key (on
    the CPU, None), so a launcher is looked up inside ``target(arch, device)`` only: outside one
    it is a ToolchainError (a lookup there would get another GPU's launcher)."""
    cached = functools.lru_cache(maxsize=None)(lambda device, *args, **kwargs: build(*args, **kwargs))

    @functools.wraps(build)
    def launcher(*args, **kwargs):
        if not getattr(_in_target, "depth", 0):
            raise ToolchainError(f"{build.__name__}: a launcher is looked up inside toolchain.target(arch, device), "
                                 "whose device keys the cache")
        return cached(_launch_device[0], *args, **kwargs)

    return launcher


@dataclass(frozen=True)
class KernelReport:
    """What the compiler produced for one kernel: ISA text and resource use."""

    name: str
    arch: str
    isa: str
    vgprs: int
    agprs: int
    sgprs: int
    vgpr_spills: int
    sgpr_spills: int
    private_bytes: int
    lds_bytes: int
    max_workgroup_size: int

    @property
    def spills(self) -> int:
        return self.vgpr_spills + self.sgpr_spills + (1 if self.private_bytes else 0)

    def workgroups_per_cu(self, waves_per_workgroup: int | None = None) -> int:
        waves = waves_per_workgroup or max(1, self.max_workgroup_size // 64)
        return occupancy(self.arch, self.vgprs, self.agprs, self.lds_bytes, waves)

    def count(self, mnemonic: str) -> int:
        """How many times an instruction (exact mnemonic) appears in the ISA."""
        return len(re.findall(rf"^\s+{re.escape(mnemonic)}\b", self.isa, flags=re.M))


def _meta_int(isa: str, key: str, default: int = 0) -> int:
    m = re.search(rf"^\s*{re.escape(key)}:\s*(\d+)", isa, flags=re.M)
    return int(m.group(1)) if m else default


def _directive_int(isa: str, key: str, default: int = 0) -> int:
    m = re.search(rf"^\s*{re.escape(key)}\s+(\d+)", isa, flags=re.M)
    return int(m.group(1)) if m else default


def parse_isa(name: str, arch: str, isa: str) -> KernelReport:
    """Resource use from the final ISA's ``.amdhsa_*`` directives and metadata block."""
    return KernelReport(
        name=name,
        arch=arch,
        isa=isa,
        vgprs=_meta_int(isa, ".vgpr_count"),
        agprs=_meta_int(isa, ".agpr_count"),
        sgprs=_meta_int(isa, ".sgpr_count"),
        vgpr_spills=_meta_int(isa, ".vgpr_spill_count"),
        sgpr_spills=_meta_int(isa, ".sgpr_spill_count"),
        private_bytes=_directive_int(isa, ".amdhsa_private_segment_fixed_size"),
        lds_bytes=_directive_int(isa, ".amdhsa_group_segment_fixed_size"),
        max_workgroup_size=_meta_int(isa, ".max_flat_workgroup_size", 1024),
    )


def compile_only(arch: str, launch, *args, **kwargs) -> list[KernelReport]:
    """Compile what `launch(*args, **kwargs)` would launch, for `arch`, without running it.

    `launch` is a FlyDSL ``@flyc.jit`` function (or a Python function calling one); tensors may
    be CPU tensors used only for their shapes. Returns one report per kernel compiled. A jit
    function that already compiled this specialization in this process reuses it and dumps
    nothing, so pass a freshly built one (kernel families expose an uncached builder for this).
    """
    with tempfile.TemporaryDirectory(prefix="flyquant-isa-") as dump:
        with target(arch), _environ(
            COMPILE_ONLY="1",
            FLYDSL_DUMP_IR="1",
            FLYDSL_DUMP_DIR=dump,
            FLYDSL_RUNTIME_ENABLE_CACHE="0",
        ), contextlib.redirect_stdout(io.StringIO()):  # FlyDSL prints a line per dumped stage
            launch(*args, **kwargs)
        reports = []
        for isa_file in sorted(Path(dump).glob("*/22_final_isa.s")):
            name = re.sub(r"_\d+$", "", isa_file.parent.name)
            reports.append(parse_isa(name, arch, isa_file.read_text()))
    if not reports:
        raise ToolchainError(
            f"compiling for {arch} produced no kernel: nothing was launched, or `launch` had already "
            "compiled this specialization (pass a freshly built jit function)"
        )
    return reports


__all__ = [
    "CacheDirError",
    "KernelReport",
    "ToolchainError",
    "cache_dir",
    "compile_only",
    "kernel_cache_dir",
    "launch_lock",
    "launcher_cache",
    "parse_isa",
    "private_dir",
    "private_file",
    "rocm_path",
    "target",
]
