"""Compile FlyDSL kernels for gfx942/gfx950 on any machine, and read what was generated.

FlyDSL picks its target from the environment (``ARCH`` for the compiler, ``FLYDSL_GPU_ARCH`` for
``get_rocm_arch()`` that kernel code may call) and links with ``$ROCM_PATH/llvm/bin/ld.lld``.
Without ROCm we point ``ROCM_PATH`` at a directory whose ``ld.lld`` runs the LLD shipped by the
``ziglang`` package (Debian's lld is too old for code object v6). Our kernels call no
device-library math, so no ROCm bitcode is needed.

A FlyDSL ``@flyc.jit`` function freezes its target at its first call, so kernel families build
one jit function per arch (a cached builder) and call it inside ``target(arch)``.
"""

from __future__ import annotations

import contextlib
import functools
import hashlib
import io
import os
import re
import sys
import tempfile
from dataclasses import dataclass
from pathlib import Path

from .arch import arch_info, occupancy


class ToolchainError(RuntimeError):
    """Something needed to compile kernels is missing."""


def cache_dir() -> Path:
    """flyquant's own cache (emulator runtime, linker shim): $FLYQUANT_CACHE_DIR or ~/.cache/flyquant."""
    root = os.environ.get("FLYQUANT_CACHE_DIR") or Path.home() / ".cache" / "flyquant"
    return Path(root)


def _lld_works(lld: Path) -> bool:
    return lld.is_file() and os.access(lld, os.X_OK)


@functools.lru_cache(maxsize=None)
def rocm_path() -> str:
    """A ROCM_PATH whose llvm/bin/ld.lld links code object v6: ROCm's own, else a ziglang shim."""
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
    shim = cache_dir() / "rocm-shim"
    lld = shim / "llvm" / "bin" / "ld.lld"
    script = f'#!/bin/sh\nexec "{sys.executable}" -m ziglang ld.lld "$@"\n'
    if not lld.exists() or lld.read_text() != script:
        lld.parent.mkdir(parents=True, exist_ok=True)
        tmp = lld.with_suffix(f".tmp{os.getpid()}")
        tmp.write_text(script)
        tmp.chmod(0o755)
        tmp.replace(lld)  # atomic: concurrent first uses never see a half-written script
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
def kernel_cache_dir() -> str:
    """FlyDSL's disk cache for our kernels, one directory per version of their sources.

    FlyDSL's cache key does not cover every helper a kernel reaches (module attributes, closure
    objects), so an edited kernel could be served stale bytes: keying the directory on a hash of
    the kernel sources and the FlyDSL version rules that out.
    """
    import flydsl

    from . import kernels

    digest = hashlib.sha256(flydsl.__version__.encode())
    for path in sorted(Path(kernels.__file__).parent.glob("*.py")):
        digest.update(path.name.encode() + path.read_bytes())
    return str(cache_dir() / "flydsl" / digest.hexdigest()[:16])


@contextlib.contextmanager
def target(arch: str):
    """Compile (and launch) FlyDSL kernels for `arch` inside this block (a cache directory of
    the user's own, FLYDSL_RUNTIME_CACHE_DIR, is respected)."""
    arch_info(arch)
    cache = os.environ.get("FLYDSL_RUNTIME_CACHE_DIR") or kernel_cache_dir()
    with _environ(ARCH=arch, FLYDSL_GPU_ARCH=arch, ROCM_PATH=rocm_path(), FLYDSL_RUNTIME_CACHE_DIR=cache):
        yield


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


__all__ = ["ToolchainError", "KernelReport", "cache_dir", "rocm_path", "target", "compile_only", "parse_isa"]
