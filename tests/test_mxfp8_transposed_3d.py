"""The 3D quantize on the transposed view torchao's MXFP8 grouped GEMM passes (issue 19 item 2):
w (E, N, K) with strides (N*K, 1, N), the .transpose(-2, -1) of a contiguous (E, K, N) tensor.

Expected outputs follow torchao main's test_cuda_mx_3d_cutedsl_numerics, variants 32x1_t and
32x32_t: the blocks run along the contiguous dim, so the data is to_mx of the contiguous tensor
along its last dim (32x32_t: of its 32 x 32 tiles, block size 1024), transposed (strides (N*K, 1,
N), asserted), and the scales are its scales, transposed (values; flyquant returns them
contiguous, (E, N/32, K) or (E, N/32, K/32), as for a contiguous w); blocked (tcgen05) scales are
torchao's to_blocked of the per-expert (K, N/32) matrix, 32x32_t's replicated over each block's
32 rows. Inputs are normal values (no scale code 0 or 1, no NaN/Inf) so torchao 0.18's to_mx is
an exact oracle here; the special values are test_mxfp8_contract's (variants 3d_t_k1, 3d_t_k32).
Every other non-contiguous layout is refused, with one error naming the two layouts accepted.
"""

from __future__ import annotations

import pytest
import torch

import flyquant as fq
import flyquant.emu as emu
from flyquant import api, toolchain
from flyquant import reference as R
from flyquant.kernels import _mx_col as col
from flyquant.kernels import _mx_col_rows as col_rows
from flyquant.kernels import mxfp8_quantize_3d as q3

import oracles
from test_moe_sorting_kernel import AtenOps

ARCHS = ("gfx950", "gfx942")
MODES = ("floor", "rceil")
DTYPES = (torch.bfloat16, torch.float16, torch.float32)
U8 = torch.uint8


@pytest.fixture(scope="module")
def tao():
    return oracles.torchao()


def transposed_view(e, n, k, dtype, seed=0):
    """(E, N, K) view with strides (N*K, 1, N) of a contiguous (E, K, N) tensor."""
    g = torch.Generator().manual_seed(seed)
    block_scale = 2.0 ** torch.randint(-8, 8, (e, k, n // 32), generator=g).repeat_interleave(32, -1)
    x = (torch.randn(e, k, n, generator=g) * block_scale).to(dtype)
    w = x.transpose(1, 2)
    assert w.stride() == (n * k, 1, n)
    return x, w


def assert_same(got, want, what):
    assert got.dtype == want.dtype and tuple(got.shape) == tuple(want.shape), what
    assert got.stride() == want.stride(), f"{what}: strides {got.stride()} != {want.stride()}"
    assert torch.equal(got.view(U8), want.view(U8)), what


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_reference_is_torchaos_32x1_t(tao, mode, dtype):
    x, w = transposed_view(2, 64, 96, dtype)
    data, scales = R.mxfp8_quantize_3d(w, mode)
    s_ref, y_ref = tao.to_mx(x.contiguous(), torch.float8_e4m3fn, 32, tao.Mode(mode))
    y_ref, s_ref = y_ref.transpose(-2, -1), s_ref.transpose(-2, -1)
    assert data.stride() == y_ref.stride() == (64 * 96, 1, 64)
    assert torch.equal(data.view(U8), y_ref.view(U8))
    assert scales.shape == s_ref.shape == (2, 2, 96) and scales.is_contiguous()
    assert torch.equal(scales.view(U8), s_ref.contiguous().view(U8))
    # the same outputs as for the contiguous copy, strides included
    for a, b in zip((data, scales), R.mxfp8_quantize_3d(w.contiguous(), mode)):
        assert_same(a, b, "reference vs contiguous copy")


# (E, N, K): two experts with K = 256 (the mfma/tcgen05 layouts straight from the 1x32 kernel, per
# expert); three experts with K = 40 (layouts not whole row tiles: laid out per expert afterwards);
# two with K = 128 (whole 128-row tcgen05 tiles, straight from the kernel; mfma's 256-row tiles
# not: laid out afterwards).
SHAPES = [(2, 96, 256), (3, 64, 40), (2, 64, 128)]


@pytest.mark.parametrize("arch", ARCHS)
@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("dtype", DTYPES)
def test_kernel_equals_reference_on_the_view(arch, mode, dtype):
    for shape in SHAPES:
        x, w = transposed_view(*shape, dtype, seed=1)
        for layout in (None, "tcgen05", "mfma"):
            got = q3.quantize_3d(w, arch=arch, scaling_mode=mode, scale_layout=layout)
            want = R.mxfp8_quantize_3d(w, mode, 1, layout)
            for i, (g, r) in enumerate(zip(got, want)):
                assert_same(g, r, f"{shape} {layout} output {i}")


@pytest.mark.parametrize("backend", ("reference", "flydsl"))
def test_api_takes_the_view_without_a_copy(backend, monkeypatch):
    monkeypatch.setenv("FLYQUANT_BACKEND", backend)
    monkeypatch.setenv("FLYQUANT_ARCH", "gfx950")
    x, w = transposed_view(2, 64, 128, torch.bfloat16, seed=2)
    calls = []
    real = torch.Tensor.contiguous

    def spy(t, *a, **kw):
        if t.data_ptr() == x.data_ptr() and not t.is_contiguous():
            calls.append(t.shape)
        return real(t, *a, **kw)

    monkeypatch.setattr(torch.Tensor, "contiguous", spy)
    data, scales = fq.mxfp8_quantize_3d(w, "rceil")
    monkeypatch.setattr(torch.Tensor, "contiguous", real)
    assert calls == []  # w is never copied to a contiguous layout
    want = R.mxfp8_quantize_3d(w.contiguous(), "rceil")
    assert_same(data, want[0], "data")
    assert_same(scales, want[1], "scales")


@pytest.mark.parametrize("backend", ("reference", "flydsl"))
def test_other_layouts_are_refused_alike(backend, monkeypatch):
    monkeypatch.setenv("FLYQUANT_BACKEND", backend)
    monkeypatch.setenv("FLYQUANT_ARCH", "gfx942")
    _, w = transposed_view(2, 64, 64, torch.bfloat16)
    base = torch.randn(2, 64, 128).to(torch.bfloat16)
    for bad in (base[:, :, ::2], base[:, :, :64], base[:1].expand(2, 64, 128), w[:, :, ::2]):
        for block_k in (1, 32):
            with pytest.raises(ValueError, match=r"w must be contiguous \(row-major\), got strides"):
                fq.mxfp8_quantize_3d(bad, "floor", scale_block_k=block_k)
    accepted = r"\(4096, 64, 1\) \(row-major\) or \(4096, 1, 64\) \(the transpose of a contiguous"
    with pytest.raises(ValueError, match=accepted):
        fq.mxfp8_quantize_3d(base[:, :, :64], "floor", scale_block_k=32)


# ------------------------------------------------------------------------------------------------
# 32x32_t: scale_block_k=32 on the view (the column kernel's 3d_t variant)
# ------------------------------------------------------------------------------------------------


def torchaos_32x32_t(tao, x, mode):
    """torchao main's expectation for variant 32x32_t, built as its test builds it: x (E, N, K)
    contiguous (torchao's names; the quantized view is x.transpose(-2, -1)), its 32 x 32 tiles
    through to_mx with block size 1024. Returns (data, plain scales, tcgen05 scales (E, flat))."""
    e, n, k = x.shape
    tiles = x.view(e, n // 32, 32, k // 32, 32).permute(0, 1, 3, 2, 4).contiguous().view(e, n // 32, k // 32, 1024)
    s_ref, y_tiles = tao.to_mx(tiles, torch.float8_e4m3fn, 1024, tao.Mode(mode))
    y_ref = (y_tiles.view(e, n // 32, k // 32, 32, 32).permute(0, 1, 3, 2, 4).contiguous().view(e, n, k)
             .transpose(-2, -1))
    s_ref = s_ref.squeeze(-1).transpose(-2, -1)  # (E, K/32, N/32)
    replicated = s_ref.transpose(-2, -1).repeat_interleave(32, dim=1)  # (E, N, K/32): every row
    blocked = torch.stack([tao.to_blocked(replicated[i]).flatten() for i in range(e)])
    return y_ref, s_ref, blocked


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_reference_and_kernel_are_torchaos_32x32_t(tao, mode, dtype):
    x, w = transposed_view(2, 96, 160, dtype, seed=3)  # w (2, 96, 160) = x (2, 160, 96) transposed
    y_ref, s_ref, blocked = torchaos_32x32_t(tao, x, mode)
    assert y_ref.stride() == (96 * 160, 1, 96)
    for arch in ("reference", "gfx950"):
        for layout in (None, "tcgen05"):
            if arch == "reference":
                data, scales = R.mxfp8_quantize_3d(w, mode, 32, layout)
            else:
                data, scales = q3.quantize_3d(w, arch=arch, scaling_mode=mode, scale_block_k=32, scale_layout=layout)
            assert data.stride() == y_ref.stride(), arch
            assert torch.equal(data.view(U8), y_ref.view(U8)), arch
            if layout is None:
                assert scales.shape == s_ref.shape == (2, 3, 5) and scales.is_contiguous()
                assert torch.equal(scales.view(U8), s_ref.contiguous().view(U8)), arch
            else:
                assert torch.equal(scales.view(U8), blocked.view(U8)), arch


# (E, N, K) of w: N = 96 leaves the last column tile of the kernel's (E, K, N) input partly
# empty (64-column BF16/FP16, 32-column FP32 tiles: 2 and 3 tiles), K = 160 a partial 128-row
# tile; (1, 64, 256): whole row tiles, the tcgen05 layout's 128-row tiles filled.
SHAPES_32 = [(2, 96, 160), (1, 64, 256)]


@pytest.mark.parametrize("arch", ARCHS)
@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("dtype", DTYPES)
def test_kernel_equals_reference_on_the_view_32x32(arch, mode, dtype):
    for shape in SHAPES_32:
        x, w = transposed_view(*shape, dtype, seed=4)
        x[-1, 40, 50] = float("inf")  # one non-finite 32 x 32 block: 0xFF, NaN data
        for layout in (None, "tcgen05", "mfma"):
            got = q3.quantize_3d(w, arch=arch, scaling_mode=mode, scale_block_k=32, scale_layout=layout)
            want = R.mxfp8_quantize_3d(w, mode, 32, layout)
            for i, (g, r) in enumerate(zip(got, want)):
                assert_same(g, r, f"{shape} {layout} output {i}")


def test_api_runs_the_3d_t_kernel_on_the_view_without_a_copy(monkeypatch):
    """fq.mxfp8_quantize_3d on the flydsl path: explain() names the column kernel's 3d_t variant,
    one launch of it, and the op's body runs no aten op that copies (the reference's body copies
    w into tile order, so the check can fail)."""
    monkeypatch.setenv("FLYQUANT_BACKEND", "flydsl")
    monkeypatch.setenv("FLYQUANT_ARCH", "gfx942")
    x, w = transposed_view(2, 64, 128, torch.bfloat16, seed=5)
    plan = fq.explain(fq.mxfp8_quantize_3d, w, "rceil", 32)
    assert plan.backend == "flydsl" and plan.kernel == "mxfp8_3d_t_k32_rceil_bf16_gfx942"
    assert any("32x32 variant" in r for r in plan.reasons)
    with emu.record() as launches:
        got = fq.mxfp8_quantize_3d(w, "rceil", 32)
    assert len(launches) == 1 and launches[0].kernel.startswith("mxfp8_3d_t_k32_rceil_bf16_gfx942_r64_")
    want = R.mxfp8_quantize_3d(w.contiguous(), "rceil", 32)
    for g, r in zip(got, want):
        assert_same(g, r, "api")
    copies = ("copy", "clone", "contiguous", "_reshape_alias")
    with AtenOps() as body:
        api._mxfp8_quantize_3d_op._init_fn(w, "rceil", 32, None)
    assert body.ops and not [op for op in body.ops if any(c in op for c in copies)], body.ops
    monkeypatch.setenv("FLYQUANT_BACKEND", "reference")
    with AtenOps() as body:
        api._mxfp8_quantize_3d_op._init_fn(w, "rceil", 32, None)
    assert [op for op in body.ops if any(c in op for c in copies)]


@pytest.mark.parametrize("arch", ARCHS)
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_3d_t_stores_whole_lines_without_spills(arch, dtype):
    """3d_t: no scratch; the data stores write whole 128-byte lines (a row's 16 (FP32: 32) lanes
    store one line: coalescing 1, no line stored in part) and the loads are coalesced too."""
    e, n, k = 1, 256, 128  # w; the kernel reads x (1, 128, 256) row-major
    x = emu.aligned((torch.randn(e, k, n) * 30).to(dtype))
    with emu.device_like_allocations(), emu.record() as launches:
        q3.quantize_3d(x.transpose(1, 2), arch=arch, scaling_mode="rceil", scale_block_k=32)
    stats = launches[0].stats
    store = stats.memory["buffer_store_dwordx2" if dtype == torch.bfloat16 else "buffer_store_dword"]
    assert store.bytes == e * n * k and store.partial_store_lines == 0 and store.coalescing == 1.0
    assert stats.memory["buffer_load_dwordx4"].coalescing == 1.0
    plan = q3.plan_col((e, k, n), dtype, arch, 32, "3d_t")
    assert (plan.tile_rows, plan.tile_cols) == (col_rows.rows_3d_t(x.element_size()), 128)
    launch = col.build_col(arch, q3.TORCH_DTYPES[dtype], "rceil", "3d_t", None, 32, False, plan.waves, plan.tile_rows)
    q, s, o = torch.zeros(e * n * k, dtype=U8), torch.zeros(e * n * k // 1024, dtype=U8), torch.zeros(1, dtype=torch.int32)
    reports = toolchain.compile_only(arch, launch, x, q, s, o, o, o, k, n, n * x.element_size(), plan.tiles_per_wave,
                                     -(-n // plan.tile_cols), k // 32, 0, 0, s.numel(), 0, 0, *plan.grid, stream=0)
    assert len(reports) == 1 and reports[0].spills == 0, reports[0].name
