"""The toolchain: a small FlyDSL kernel builds for gfx942 and gfx950 on this CPU machine; kernel
launchers are built per device and run on their tensors' one."""

import contextlib
import re
import sys

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


def test_launchers_are_built_per_gpu(monkeypatch):
    """FlyDSL loads a launcher's code object on the device current at its first launch, a module
    valid there only: launcher_cache builds one per GPU, keyed by the innermost target(arch,
    device) block, which makes that GPU current (torch.cuda.device, recorded here: there is no GPU
    on this machine); CPU tensors (flyquant.emu) share one. A lookup outside a block is refused:
    it would get whichever launcher the key None holds (a red-team found the 32x1, dual and 3D
    quantize looking theirs up before entering the block, so every GPU shared one)."""
    entered = []

    @contextlib.contextmanager
    def current(index):
        entered.append(index)
        yield

    monkeypatch.setattr(torch.cuda, "device", current)
    built = []
    launcher = toolchain.launcher_cache(lambda cfg, waves=1: built.append((cfg, waves)) or object())
    with toolchain.target("gfx950", torch.device("cuda", 1)):
        one = launcher("cfg", waves=2)
        assert launcher("cfg", waves=2) is one
        with toolchain.target("gfx950", torch.device("cuda", 0)):
            zero = launcher("cfg", waves=2)
        assert launcher("cfg", waves=2) is one  # the outer block's GPU again
        other = launcher("cfg", waves=3)
    with toolchain.target("gfx950", torch.device("cpu")):
        cpu = launcher("cfg", waves=2)
        assert launcher("cfg", waves=2) is cpu
    with pytest.raises(toolchain.ToolchainError, match="inside toolchain.target"):
        launcher("cfg", waves=2)
    assert len({id(one), id(zero), id(other), id(cpu)}) == 4
    assert built == [("cfg", 2), ("cfg", 2), ("cfg", 3), ("cfg", 2)]
    assert entered == [1, 0]


def test_cpu_tensors_reach_no_launch_without_the_emulator(monkeypatch):
    """With the emulator off (a machine with a ROCm GPU), a launcher handed CPU tensors would pass
    host addresses to the GPU (a memory fault that aborts the process): every launch takes its
    stream from toolchain.stream, which refuses them, but for compile_only."""
    import flyquant.emu as emu
    from flyquant.kernels import mxfp8_quantize_2d as q2

    monkeypatch.setattr(emu, "enabled", lambda: False)
    x = torch.zeros(4, 64, dtype=torch.bfloat16)
    with pytest.raises(toolchain.ToolchainError, match="flyquant.emu is off"):
        q2.quantize_1x32(x, arch="gfx950")
    # compile_only launches nothing: CPU tensors give it their shapes (the benches' resource rows)
    monkeypatch.setattr(q2, "_cached_1x32", toolchain.launcher_cache(q2.build_1x32))  # a fresh launcher: it compiles
    assert toolchain.compile_only("gfx950", lambda t: q2.quantize_1x32(t, arch="gfx950"), x)


def test_every_kernel_family_launches_on_its_tensors_device(monkeypatch):
    """Each kernel family's launcher runs inside target(arch, the device of its tensors): one that
    left the device out would launch a GPU's tensors on whichever GPU is current."""
    from test_fused_moe import layer, run
    from test_grouped_mm import fwd_inputs, offs, wgrad_inputs

    import flyquant as fq

    real, seen = toolchain.target, []

    def recording(arch, device=None):
        seen.append((sys._getframe(1).f_globals["__name__"].rsplit(".", 1)[-1], device))
        return real(arch, device)

    monkeypatch.setattr(toolchain, "target", recording)
    x = torch.randn(64, 64).to(torch.bfloat16)
    fq.mxfp8_quantize(x)
    fq.mxfp8_quantize(x, axis=0)
    fq.mxfp8_quantize_3d(x.view(2, 32, 64))
    fq.mxfp4_quantize(x)
    fq.mxfp4_quantize(x, axis=0)
    fq.mxfp4_quantize_dual(x)
    run(layer(4, 2, 4), "silu")
    fq.mxfp8_grouped_mm(*fwd_inputs(64, 32, 64, 2), offs(32, 64))
    fq.mxfp8_grouped_mm_wgrad(*wgrad_inputs(64, 32, 64), offs(32, 64))
    families = {"mxfp8_quantize_2d", "mxfp8_quantize_3d", "mxfp4_quantize", "mxfp4_quantize_cols",
                "mxfp4_quantize_dual", "moe_sorting", "moe_gemm1_a16w4", "moe_gemm2_a16w4", "mxfp8_grouped_mm"}
    assert families <= {module for module, _ in seen}, seen
    assert all(device == torch.device("cpu") for _, device in seen), seen


@pytest.mark.gpu
def test_gpu_kernels_run_on_each_gpu_while_another_is_current(monkeypatch):
    """On a machine with two or more MI300X/MI355X: with cuda:0 current, kernels launched for
    tensors on cuda:1 run there (transformers' device_map spreads a model so), then on cuda:0 too,
    each GPU with launchers of its own: quantize bit-exact with the reference, the MoE layer
    within its bound, the grouped GEMM the same bits on both GPUs."""
    if torch.cuda.device_count() < 2:
        pytest.skip("needs two GPUs")
    from test_fused_moe import exact_layer, layer, run
    from test_grouped_mm import fwd_inputs, offs

    import flyquant as fq
    from flyquant import reference

    monkeypatch.setenv("FLYQUANT_BACKEND", "flydsl")
    torch.cuda.set_device(0)
    x = torch.randn(256, 512).to(torch.bfloat16)
    p = layer(16, 2, 4)
    gemm = fwd_inputs(128, 64, 256, 2) + (offs(64, 128),)
    products = []
    for dev in ("cuda:1", "cuda:0"):
        for axis in (-1, 0):  # the 1x32 kernel's launchers, the column kernel's
            for got, want in zip(fq.mxfp8_quantize(x.to(dev), axis=axis), reference.mxfp8_quantize(x, axis)):
                assert torch.equal(got.cpu().view(torch.uint8), want.view(torch.uint8)), (dev, axis)
        for got, want in zip(fq.mxfp4_quantize(x.to(dev)), reference.mxfp4_quantize(x)):
            assert torch.equal(got.cpu().view(torch.uint8), want.view(torch.uint8)), dev
        moe = run({k: v.to(dev) if isinstance(v, torch.Tensor) else v for k, v in p.items()}, "silu").cpu()
        exact, bound = exact_layer(p, "silu", "stage2")
        assert bool(((moe.double() - exact).abs() <= bound).all()), dev
        products.append(fq.mxfp8_grouped_mm(*(t.to(dev) for t in gemm)).cpu())
        assert torch.cuda.current_device() == 0
    assert torch.equal(products[0].view(torch.int16), products[1].view(torch.int16))
