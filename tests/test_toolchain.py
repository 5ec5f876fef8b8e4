"""Compile-only: a small FlyDSL kernel builds for gfx942 and gfx950 on this CPU machine."""

import re

import pytest
import torch

from flyquant import toolchain
from flyquant.arch import ARCHS, occupancy


def _build_copy_kernel():
    """A fresh jit function per call: 128 threads each copy 4 fp32 (one 16-byte load/store)."""
    import flydsl.compiler as flyc
    import flydsl.expr as fx

    @flyc.kernel
    def toolchain_copy_kernel(src: fx.Tensor, dst: fx.Tensor, tiled_copy: fx.TiledCopy):
        tile = tiled_copy.tile_mn
        g_src = fx.flat_divide(src, tile)[None, None, fx.block_idx.x, 0]
        g_dst = fx.flat_divide(dst, tile)[None, None, fx.block_idx.x, 0]
        thr = tiled_copy.get_slice(fx.thread_idx.x)
        s = thr.partition_S(g_src)
        d = thr.partition_D(g_dst)
        r = fx.make_fragment_like(s)
        atom = fx.make_copy_atom(fx.UniversalCopy128b(), fx.Float32)
        fx.copy(atom, s, r)
        fx.copy(atom, r, d)

    @flyc.jit
    def toolchain_copy(src: fx.Tensor, dst: fx.Tensor, stream: fx.Stream = fx.Stream(None)):
        atom = fx.make_copy_atom(fx.UniversalCopy128b(), fx.Float32)
        tiled = fx.make_tiled_copy_tv(
            atom, fx.make_ordered_layout((8, 16), order=(1, 0)), fx.make_ordered_layout((1, 4), order=(0, 1))
        )
        tile_m, _ = tiled.tile_mn.unpack()
        rows, _ = src.shape.unpack()
        toolchain_copy_kernel(src, dst, tiled).launch(grid=(rows // tile_m, 1, 1), block=(128, 1, 1), stream=stream)

    return toolchain_copy


@pytest.mark.parametrize("arch", sorted(ARCHS))
def test_compile_only_reports_resources(arch):
    src = torch.zeros(16, 64)
    (report,) = toolchain.compile_only(arch, _build_copy_kernel(), src, torch.zeros_like(src), stream=0)
    assert report.name == "toolchain_copy_kernel"
    assert re.search(rf'\.amdgcn_target "amdgcn-amd-amdhsa-[a-z]*-{arch}\b', report.isa)
    assert 0 < report.vgprs <= 32 and report.agprs == 0 and report.sgprs > 0
    assert report.spills == 0 and report.lds_bytes == 0
    assert report.max_workgroup_size >= 128
    # 16 bytes per lane in and out: the copy atom asked for 128-bit accesses.
    wide_loads = report.count("global_load_dwordx4") + report.count("buffer_load_dwordx4")
    wide_stores = report.count("global_store_dwordx4") + report.count("buffer_store_dwordx4")
    assert wide_loads >= 1 and wide_stores >= 1
    assert report.workgroups_per_cu() == occupancy(arch, report.vgprs, 0, 0, 2)


def test_same_jit_function_does_not_recompile():
    build = _build_copy_kernel()
    src = torch.zeros(16, 64)
    toolchain.compile_only("gfx950", build, src, torch.zeros_like(src), stream=0)
    with pytest.raises(toolchain.ToolchainError, match="freshly built"):
        toolchain.compile_only("gfx950", build, src, torch.zeros_like(src), stream=0)


def test_unknown_arch_is_a_clear_error():
    with pytest.raises(ValueError, match="unsupported arch 'gfx90a'"):
        with toolchain.target("gfx90a"):
            pass


def test_occupancy_limits():
    # 128 VGPRs -> 4 waves per SIMD -> 16 waves per CU -> 4 workgroups of 4 waves.
    assert occupancy("gfx950", 128, 0, 0, 4) == 4
    # LDS: 64 KiB per CU on gfx942 fits two 32 KiB workgroups, gfx950's 160 KiB five.
    assert occupancy("gfx942", 32, 0, 32 * 1024, 1) == 2
    assert occupancy("gfx950", 32, 0, 32 * 1024, 1) == 5
