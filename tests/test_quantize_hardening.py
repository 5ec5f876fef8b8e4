"""Issue 21's MXFP8 quantize memory findings as regression tests, both arches, under the strict
memory of tests/conftest.py (every launch may touch only its tensor arguments' bytes).

- Finding 1: 32x1 with K % 4 != 0 stored (4 - K % 4) * M/32 scale bytes past the scales (the
  column offset sat in the scalar offset, which the buffer range check does not cover); an
  allocator canary after the scales proves nothing was written there, even in loose mode.
- Finding 7: 1x32 on tail shapes loaded up to 4 KiB past its input (the scalar offset of loads
  4..7 of a tile), and the scale layouts read past their inputs too.
"""

from __future__ import annotations

import pytest
import torch

import flyquant as fq
from flyquant import reference
from flyquant.kernels import mxfp8_quantize_2d as q2

ARCHS = ("gfx950", "gfx942")
CANARY = 0xA5


def _assert_same(got, want, what):
    for i, (g, w) in enumerate(zip(got, want)):
        assert g.dtype == w.dtype and tuple(g.shape) == tuple(w.shape) and g.stride() == w.stride(), f"{what} {i}"
        assert torch.equal(g.view(torch.uint8), w.view(torch.uint8)), f"{what} output {i} differs"


@pytest.mark.parametrize("arch", ARCHS)
def test_32x1_scales_stay_inside_for_every_k_tail(arch, monkeypatch):
    # Finding 1's reproducer shapes: M in 32..128, K = 1 + 4 j (K % 4 == 1), plus K % 4 == 2, 3;
    # the flyquant.emu strict memory fails any store past the scales tensor.
    monkeypatch.setenv("FLYQUANT_BACKEND", "flydsl")
    monkeypatch.setenv("FLYQUANT_ARCH", arch)
    g = torch.Generator().manual_seed(21)
    for m, k in ((32, 1), (64, 5), (96, 9), (128, 33), (32, 2), (64, 3), (32, 6), (96, 7), (32, 67)):
        x = torch.randn(m, k, generator=g).to(torch.bfloat16)
        _assert_same(fq.mxfp8_quantize(x, axis=0), reference.mxfp8_quantize(x, 0), f"32x1 {(m, k)}")


@pytest.mark.loose_memory("checks the bytes after the scales with a canary, as the heap would see them")
@pytest.mark.parametrize("arch", ARCHS)
def test_32x1_leaves_the_bytes_after_the_scales(arch):
    # The kernel writes into a slice of a larger buffer; the bytes after the slice keep their
    # canary value (before the fix: (4 - K % 4) * M/32 of them were overwritten).
    m, k = 96, 5
    x = torch.randn(m, k).to(torch.bfloat16)
    data = torch.empty_strided((m, k), (1, m), dtype=torch.float8_e4m3fn)
    backing = torch.full((k * m // 32 + 64,), CANARY, dtype=torch.uint8)
    scales = backing[: k * m // 32].view(k, m // 32)
    q2.launch_col(x, data, scales, arch=arch, scaling_mode="rceil", kind="32x1", scale_layout=None)
    assert bool((backing[k * m // 32 :] == CANARY).all()), "32x1 wrote past its scales"
    want = reference.mxfp8_quantize(x, 0)
    _assert_same((data, scales.view(torch.float8_e8m0fnu)), want, "32x1 into a slice")


TAILS_1X32 = ((1, 32), (31, 32), (37, 32), (97, 64), (33, 96), (1, 3200))


@pytest.mark.parametrize("arch", ARCHS)
@pytest.mark.parametrize("dtype", (torch.bfloat16, torch.float16, torch.float32))
def test_1x32_tails_read_only_their_input(arch, dtype):
    # Finding 7's shapes, every dtype, plain scales and both layouts.
    g = torch.Generator().manual_seed(7)
    for m, k in TAILS_1X32:
        x = torch.randn(m, k, generator=g).to(dtype)
        for layout in (None, "tcgen05", "mfma"):
            got = q2.quantize_1x32(x, arch=arch, scaling_mode="floor", scale_layout=layout)
            _assert_same(got, reference.mxfp8_quantize(x, -1, "floor", layout), f"1x32 {(m, k)} {dtype} {layout}")


@pytest.mark.parametrize("arch", ARCHS)
def test_column_layouts_tails(arch):
    # 32x1 and 3D with the padded scale layouts on tails (K not a multiple of the tile).
    x = torch.randn(64, 37).to(torch.bfloat16)
    for layout in ("tcgen05", "mfma"):
        got = q2.quantize_32x1(x, arch=arch, scaling_mode="rceil", scale_layout=layout)
        _assert_same(got, reference.mxfp8_quantize(x, 0, "rceil", layout), f"32x1 {layout}")
    w = torch.randn(2, 32, 37).to(torch.float32)
    got = fq.kernels.mxfp8_quantize_3d.quantize_3d(w, arch=arch, scaling_mode="floor", scale_layout="mfma")
    _assert_same(got, reference.mxfp8_quantize_3d(w, "floor", 1, "mfma"), "3d mfma")


# ------------------------------------------------------------------------------------------------
# Findings 9-11: the same answer or the same error on every backend
# ------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("backend", ("reference", "flydsl"))
def test_zero_rows_give_empty_outputs(backend, monkeypatch):
    # Finding 10: 1x32 of a (0, K) tensor raised "range() arg 3 must not be zero" on the kernel
    # path; an empty batch is empty data and (all padding) scales, in every layout.
    monkeypatch.setenv("FLYQUANT_BACKEND", backend)
    monkeypatch.setenv("FLYQUANT_ARCH", "gfx950")
    x = torch.empty(0, 64, dtype=torch.bfloat16)
    for layout, scale_shape in ((None, (0, 2)), ("tcgen05", (0, 4)), ("mfma", (0, 8))):
        data, scales = fq.mxfp8_quantize(x, scale_layout=layout)
        assert tuple(data.shape) == (0, 64) and tuple(scales.shape) == scale_shape, layout


@pytest.mark.parametrize("backend", ("reference", "flydsl"))
def test_non_contiguous_input_is_refused_on_every_backend(backend, monkeypatch):
    # Finding 11: views worked on the reference and raised on the kernel path.
    monkeypatch.setenv("FLYQUANT_BACKEND", backend)
    monkeypatch.setenv("FLYQUANT_ARCH", "gfx942")
    x = torch.randn(64, 64).to(torch.bfloat16)
    for call in (lambda: fq.mxfp8_quantize(x.t()), lambda: fq.mxfp8_quantize(x[:, ::2][:, :32], axis=0),
                 lambda: fq.mxfp8_quantize_dual(x.t()), lambda: fq.mxfp8_quantize_3d(x[None].expand(2, 64, 64))):
        with pytest.raises(ValueError, match=r"must be contiguous \(row-major\), got strides"):
            call()


@pytest.mark.parametrize("arch", ARCHS)
def test_mxfp4_single_element_views_of_any_strides(arch, monkeypatch):
    # A one-element view is contiguous whatever its strides (x[::4, ::64]: (256, 64)); the MXFP4
    # ops handed its reshape, with no stride of 1, to FlyDSL, which raised a RuntimeError ("cannot
    # auto-mark layout-dynamic") naming neither x nor the op. The reference's bytes now.
    monkeypatch.setenv("FLYQUANT_BACKEND", "flydsl")
    monkeypatch.setenv("FLYQUANT_ARCH", arch)
    base = torch.randn(4, 64).to(torch.bfloat16)
    x, flat = base[::4, ::64], base.view(-1)[::2][:1]
    assert x.is_contiguous() and x.stride() == (256, 64) and flat.stride() == (2,)
    for got, want in ((fq.mxfp4_quantize(x), reference.mxfp4_quantize(x)),
                      (fq.mxfp4_quantize(flat), reference.mxfp4_quantize(flat)),
                      (fq.mxfp4_quantize(x, axis=0), reference.mxfp4_quantize(x, 0)),
                      (sum(fq.mxfp4_quantize_dual(x), ()), sum(reference.mxfp4_quantize_dual(x), ())),
                      (fq.mxfp4_quantize_3d(x[None]), reference.mxfp4_quantize_3d(x[None]))):
        _assert_same(got, want, "one element")


@pytest.mark.parametrize("backend", ("reference", "flydsl"))
def test_axis_and_scale_block_k_must_be_ints(backend, monkeypatch):
    # axis=True / False and 1.0 / 0.0 equal 1 / 0 in a tuple: mxfp8_quantize took True as 1x32
    # and mxfp4_quantize False as columnwise; scale_block_k=True ran as 1 and 32.0 passed the
    # check, then failed in torch's custom-op schema with a RuntimeError. All are ValueErrors.
    monkeypatch.setenv("FLYQUANT_BACKEND", backend)
    monkeypatch.setenv("FLYQUANT_ARCH", "gfx950")
    x = torch.randn(32, 64).to(torch.bfloat16)
    w = torch.randn(2, 32, 32).to(torch.bfloat16)
    for axis in (True, False, 1.0, 0.0, -1.0):
        with pytest.raises(ValueError, match="axis must be -1"):
            fq.mxfp8_quantize(x, axis=axis)
        with pytest.raises(ValueError, match="axis must be -1"):
            fq.mxfp4_quantize(x, axis=axis)
    for block_k in (True, 1.0, 32.0):
        with pytest.raises(ValueError, match="scale_block_k must be one of"):
            fq.mxfp8_quantize_3d(w, scale_block_k=block_k)


def test_dequantize_checks_the_orientation_of_square_data():
    # Finding 9: on a square matrix only the strides tell 1x32 data from 32x1 data; the wrong
    # axis used to dequantize silently wrong.
    x = torch.randn(64, 64)
    rows, cols = reference.mxfp8_quantize(x, -1, "floor"), reference.mxfp8_quantize(x, 0, "floor")
    with pytest.raises(ValueError, match=r"axis=0 must have the strides .* \(1, 64\).*pass axis=-1"):
        fq.mxfp8_dequantize(rows[0], cols[1], axis=0)
    with pytest.raises(ValueError, match=r"axis=-1 must have the strides .* \(64, 1\).*pass axis=0"):
        fq.mxfp8_dequantize(cols[0], rows[1], axis=-1)
    # a strided view of the right orientation is not the other one (the hint once said it was)
    for data, scales, axis in ((rows[0][::2], rows[1][::2], -1), (cols[0][:, ::2], cols[1][::2], 0)):
        with pytest.raises(ValueError, match=r"a strided view\? pass the tensor the quantize returned"):
            fq.mxfp8_dequantize(data, scales, axis=axis)
    # the right axes round-trip to the same values both ways (within E4M3's rounding)
    back_rows, back_cols = fq.mxfp8_dequantize(*rows, axis=-1), fq.mxfp8_dequantize(*cols, axis=0)
    torch.testing.assert_close(back_rows, x, rtol=2**-3, atol=2**-6)
    torch.testing.assert_close(back_cols, x, rtol=2**-3, atol=2**-6)
    w = torch.randn(2, 32, 32)
    data3, scales3 = reference.mxfp8_quantize_3d(w, "floor")
    with pytest.raises(ValueError, match="strides"):
        fq.mxfp8_dequantize(data3.contiguous(), scales3, axis=1)
    # axis=True read 3D data (or 2D 1x32 data) as axis 1, 0.0 2D data as axis 0
    for data, scales, axis in ((data3, scales3, True), (*rows, True), (*cols, 0.0)):
        with pytest.raises(ValueError, match="axis must be an int"):
            fq.mxfp8_dequantize(data, scales, axis=axis)


def test_dequantize_mxfp4_refuses_0d_packed():
    # packed.shape[-1] was read before the rank was checked: an IndexError, naming nothing
    with pytest.raises(ValueError, match=r"packed.shape\[-1\] \(K/2\) must be a multiple of 16 .* got shape \(\)"):
        fq.dequantize_mxfp4(torch.tensor(3, dtype=torch.uint8), torch.tensor(127, dtype=torch.uint8))


def test_dequantize_refuses_scales_on_another_device():
    # both failed in torch's multiply: "Tensor on device meta is not on the expected device cpu!"
    packed, scales = reference.mxfp4_quantize(torch.randn(4, 64))
    with pytest.raises(ValueError, match=r"scales must be on the device of packed \(cpu\), got meta"):
        fq.dequantize_mxfp4(packed, scales.to("meta"))
    data, scales8 = reference.mxfp8_quantize(torch.randn(32, 64))
    with pytest.raises(ValueError, match=r"scales must be on the device of data \(cpu\), got meta"):
        fq.mxfp8_dequantize(data, scales8.to("meta"))


def test_strict_memory_is_on_and_catches_a_launch_past_its_tensors():
    # The conftest fixture's own check: a 1x32 launch told its input holds twice the blocks it
    # has reads past the tensor's extent, which strict memory turns into a launch error.
    import flyquant.emu as emu
    from flyquant import toolchain

    assert emu.global_memory().strict
    x = torch.randn(4, 64).to(torch.bfloat16)
    q = torch.empty(8, 64, dtype=torch.uint8)
    s = torch.empty(8, 2, dtype=torch.uint8)
    nblocks = 2 * x.numel() // 32
    cfg = q2.plan_1x32((8, 64), x.dtype, "gfx950")
    with toolchain.target("gfx950"), pytest.raises(emu.EmuLaunchError, match="outside every known memory region"):
        q2._cached_1x32("gfx950", "bf16", "floor", None, cfg.waves)(
            x, q, s, nblocks, cfg.tiles_per_wave, 0, 2, 0, 0, 0, s.numel(), cfg.workgroups, stream=0)


def test_mxfp4_axis_names_the_last_or_the_first_dim():
    """Red-team findings: mxfp4_quantize took axis 1 of a 2-D x (its last dim) but refused -2 (its
    first, which mxfp8_quantize takes) and numpy integers. Now the last dim is -1 or x.dim() - 1,
    the first 0 or -x.dim(), numpy integers are ints (kernels, emulated); a 1-D x stays one row
    (TransformerEngine's flattening): axis 0 gives its one-element columns."""
    import numpy as np

    x = torch.randn(64, 96, generator=torch.Generator().manual_seed(3)).to(torch.bfloat16)
    rows, cols = fq.mxfp4_quantize(x, -1), fq.mxfp4_quantize(x, 0)
    for axis, want in ((1, rows), (np.int64(-1), rows), (-2, cols), (np.int32(0), cols)):
        _assert_same(fq.mxfp4_quantize(x, axis), want, f"axis {axis!r}")
    _assert_same(fq.mxfp8_quantize(x, axis=np.int64(-2)), fq.mxfp8_quantize(x, axis=0), "mxfp8 axis -2")
    v = x[5]
    _assert_same(fq.mxfp4_quantize(v, -1), reference.mxfp4_quantize(v.view(1, 96), -1), "1-D rowwise")
    _assert_same(fq.mxfp4_quantize(v, 0), reference.mxfp4_quantize(v.view(1, 96), 0), "1-D columnwise")
    x3 = x.view(4, 16, 96)
    _assert_same(fq.mxfp4_quantize(x3, -3), fq.mxfp4_quantize(x3, 0), "3-D axis -3")
    with pytest.raises(ValueError, match="axis must be -1 or 2 .* or 0 or -3"):
        fq.mxfp4_quantize(x3, 1)


def test_sparse_and_nested_inputs_are_named():
    # a sparse x was "x must be contiguous (row-major), got strides (0, 0)"; a nested one failed in
    # torch's dispatcher (red-team findings)
    sparse = torch.eye(64).to_sparse()
    nested = torch.nested.nested_tensor([torch.ones(32), torch.ones(64)], layout=torch.jagged)
    for x, what in ((sparse, "torch.sparse_coo"), (nested, "a nested tensor")):
        for op in (fq.mxfp4_quantize, fq.mxfp8_quantize):
            with pytest.raises(TypeError, match=f"x must be a dense tensor \\(torch.strided\\), got {what}"):
                op(x)


@pytest.mark.parametrize("backend", ("reference", "flydsl"))
def test_backward_through_a_quantize_is_a_clear_error(backend, monkeypatch):
    # Deliverable 5: quantize has no gradient; backward names the op instead of a silent zero.
    monkeypatch.setenv("FLYQUANT_BACKEND", backend)
    monkeypatch.setenv("FLYQUANT_ARCH", "gfx950")
    x = torch.randn(64, 64, requires_grad=True)
    data, _ = fq.mxfp8_quantize(x, axis=0)
    with pytest.raises(RuntimeError, match="flyquant.mxfp8_quantize.*no autograd formula"):
        data.float().sum().backward()


def test_explain_names_the_kernel_the_transposed_3d_view_runs(monkeypatch):
    # torchao's transposed expert weights (strides (N*K, 1, N)) run the 1x32 kernel on the (E*K, N)
    # rows the view is: explain says so (it named the column kernel), and that launch is what runs.
    import flyquant.emu as emu

    monkeypatch.setenv("FLYQUANT_ARCH", "gfx942")
    w = torch.randn(2, 64, 32).to(torch.bfloat16).transpose(1, 2).contiguous().transpose(1, 2)
    plan = fq.explain(fq.mxfp8_quantize_3d, w)
    assert plan.backend == "flydsl" and plan.kernel.startswith("mxfp8_1x32_rceil_bf16_gfx942")
    assert any("transpose" in r for r in plan.reasons)
    with emu.record() as launches:
        fq.mxfp8_quantize_3d(w)
    assert [r.kernel.startswith("mxfp8_1x32_rceil_bf16_gfx942") for r in launches] == [True]
    plan = fq.explain(fq.mxfp8_quantize_3d, w.contiguous())
    assert plan.kernel.startswith("mxfp8_3d_rceil_bf16_gfx942")
