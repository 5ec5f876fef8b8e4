"""The 3D quantize on the transposed view torchao's MXFP8 grouped GEMM passes (issue 19 item 2):
w (E, N, K) with strides (N*K, 1, N), the .transpose(-2, -1) of a contiguous (E, K, N) tensor.

Expected outputs follow torchao main's test_cuda_mx_3d_cutedsl_numerics, variant 32x1_t: the
blocks run along the contiguous dim, so the data is to_mx of the contiguous tensor along its last
dim, transposed (strides (N*K, 1, N), asserted), and the scales are its scales, transposed
(values; flyquant returns them contiguous, (E, N/32, K), as for a contiguous w). Inputs are normal
values (no scale code 0 or 1, no NaN/Inf) so torchao 0.18's to_mx is an exact oracle here.
Variant 32x32_t (scale_block_k=32 on the view) is refused on both paths (no kernel reads 32 x 32
tiles along the contiguous dim yet), as is every other non-contiguous layout, with one error
naming the two layouts accepted.
"""

from __future__ import annotations

import pytest
import torch

import flyquant as fq
from flyquant import reference as R
from flyquant.kernels import mxfp8_quantize_3d as q3

import oracles

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


# (E, N, K): one expert with K = 256 (the mfma/tcgen05 layouts straight from the 1x32 kernel);
# three experts with K = 40 (layouts not whole row tiles: laid out per expert afterwards).
SHAPES = [(1, 96, 256), (3, 64, 40)]


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
    accepted = r"\(8192, 128, 1\) \(row-major\) or, with scale_block_k=1, \(8192, 1, 128\)"
    for bad, kw in ((base[:, :, ::2], {}), (base[:, :, :64], {}), (w, {"scale_block_k": 32}),
                    (base[:1].expand(2, 64, 128), {})):
        with pytest.raises(ValueError, match=r"w must be contiguous \(row-major\), got strides"):
            fq.mxfp8_quantize_3d(bad, "floor", **kw)
    with pytest.raises(ValueError, match=accepted.replace("8192", "4096").replace("128", "64")):
        fq.mxfp8_quantize_3d(w, "floor", scale_block_k=32)
