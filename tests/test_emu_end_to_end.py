"""FlyDSL kernels (tests/emu_kernels.py) compiled for gfx942 and gfx950 and run under
flyquant.emu through FlyDSL's normal launcher on CPU tensors.

Every launch runs in strict memory mode with its tensors tracked, so a stray access outside
them (by the kernel or by the emulator) fails the test. Expected values are computed on the
host independently of the kernels: exactly where the arithmetic is exact, otherwise with a
tolerance derived from the f32 rounding of the sums.
"""

from __future__ import annotations

import emu_kernels as K
import numpy as np
import pytest
import torch

import flyquant.emu as emu
from flyquant import toolchain
from flyquant.emu import interp


ARCHS = ("gfx942", "gfx950")
F32_EPS = 2.0**-24  # unit roundoff of f32 (round to nearest)


def run(arch: str, launch, *args, tensors=(), **kwargs) -> emu.LaunchRecord:
    """Launch through FlyDSL for `arch` with only `tensors` valid memory; the launch's record."""
    emu.track(*tensors)
    with toolchain.target(arch), emu.strict_memory(), emu.record() as records:
        launch(*args, stream=0, **kwargs)
    (record,) = records
    assert record.arch == arch and record.stats is not None
    return record


def _backed(n: int, capacity: int, fill: float) -> tuple[torch.Tensor, torch.Tensor]:
    """A length-n tensor whose storage continues with `fill` up to `capacity` elements."""
    backing = torch.full((capacity,), fill)
    return backing, backing[:n]


@pytest.mark.parametrize("arch", ARCHS)
def test_vector_add(arch):
    # (20, 100): neither dimension is a multiple of the 8x64 tile, so the last row of tiles and
    # the last column of tiles are partly outside the tensor and rely on the predicates.
    m, n = 20, 100
    torch.manual_seed(1)
    a, b = torch.randn(m, n), torch.randn(m, n)
    backing, c_flat = _backed(m * n, m * n + 8 * 64, fill=-7.0)  # sentinel catches tail stores
    c = c_flat.view(m, n)
    record = run(arch, K.vector_add(arch), a, b, c, tensors=(a, b, backing))
    assert record.grid == (3, 2, 1) and record.block == (128, 1, 1)
    torch.testing.assert_close(c, a + b, rtol=0, atol=0)  # one f32 add per element: exact
    assert torch.all(backing[m * n :] == -7.0)


@pytest.mark.parametrize("arch", ARCHS)
def test_block_sum_through_lds(arch):
    blocks = 2  # two workgroups of 4 waves: LDS is per workgroup, barriers per workgroup
    torch.manual_seed(2)
    x = torch.randn(blocks * K.BLOCK_SUM_THREADS)
    out = torch.zeros(blocks)
    run(arch, K.block_sum(arch), x, out, blocks, tensors=(x, out))
    # The kernel's tree: at each step slot t += slot t + stride, stride 128, 64, ..., 1.
    slots = x.numpy().reshape(blocks, K.BLOCK_SUM_THREADS).copy()
    stride = K.BLOCK_SUM_THREADS // 2
    while stride:
        slots[:, :stride] = slots[:, :stride] + slots[:, stride : 2 * stride]  # f32 adds, same order
        stride //= 2
    np.testing.assert_array_equal(out.numpy(), slots[:, 0])


@pytest.mark.parametrize("arch", ARCHS)
def test_an_lds_race_between_waves_is_an_error(arch):
    # Without the barriers inside the tree, wave 0 reads slots that waves 1-3 write in the same
    # step. The interpreter runs the waves one after another, which would give some sum; the
    # race check (flyquant.emu.lds_races) stops the launch at the first such access instead.
    x, out = torch.randn(K.BLOCK_SUM_THREADS), torch.zeros(1)
    with pytest.raises(emu.EmuLaunchError, match=r"LdsRace: wave \d (reads|writes) LDS byte \d+, which wave \d "
                                           r"(wrote|read) with no s_barrier between them"):
        run(arch, K.block_sum(arch, barriers=False), x, out, 1, tensors=(x, out))


@pytest.mark.parametrize("arch", ARCHS)
def test_lds_read_before_any_write_holds_the_fill_not_zeros(arch):
    # LDS contents at a workgroup's start are undefined on hardware: every workgroup's LDS starts
    # as interp.LDS_FILL bytes, so a kernel relying on zeroed LDS (a histogram it forgot to clear)
    # shows; the second workgroup sees the fill again, not the first one's bytes.
    out = torch.zeros(2 * K.WAVE, dtype=torch.int32)
    run(arch, K.lds_before_write(arch), out, 1, 2, tensors=(out,))  # workgroup 0 writes its slots
    assert (out.view(torch.uint8) == interp.LDS_FILL).all()


@pytest.mark.parametrize("arch", ARCHS)
def test_a_store_race_between_workgroups_is_an_error(arch):
    # Every workgroup stores its id to out[0]: run one after another they leave the last id; on
    # hardware any. In strict memory mode (this suite's) flyquant.emu.store_races stops it; one
    # workgroup alone is fine.
    out = torch.full((1,), -1, dtype=torch.int32)
    run(arch, K.last_block_id(arch), out, 1, tensors=(out,))
    assert int(out[0]) == 0
    with pytest.raises(emu.EmuLaunchError, match=r"StoreRace: workgroup \(1, 0, 0\) stores to 0x[0-9a-f]+, where "
                                                 r"workgroup \(0, 0, 0\) of the same launch stored a different byte"):
        run(arch, K.last_block_id(arch), out, 2, tensors=(out,))


@pytest.mark.parametrize("arch", ARCHS)
def test_cross_lane_shuffles(arch):
    torch.manual_seed(3)
    x = torch.randint(-1000, 1000, (K.WAVE,), dtype=torch.int32)
    out = torch.zeros(4 * K.WAVE, dtype=torch.int32)
    run(arch, K.wave_shuffles(arch), x, out, tensors=(x, out))
    lanes = np.arange(K.WAVE)
    xs = x.numpy()
    rows = out.numpy().reshape(4, K.WAVE)
    np.testing.assert_array_equal(rows[0], xs[lanes ^ K.SHUFFLE_XOR_MASK])
    np.testing.assert_array_equal(rows[1], xs[K.WAVE - 1 - lanes])
    np.testing.assert_array_equal(rows[2], np.full(K.WAVE, xs.sum()))  # integer sum: order-free
    np.testing.assert_array_equal(rows[3], np.full(K.WAVE, xs[K.READLANE_LANE]))


# K per dtype: two MFMA k-steps for f32 (k = 4) and gfx950 bf16 (k = 32), four for gfx942 bf16 (k = 16).
MFMA_K = {"f32": 8, "bf16": 64}
MFMA_DTYPES = {"f32": torch.float32, "bf16": torch.bfloat16}


@pytest.mark.parametrize("dtype", sorted(MFMA_K))
@pytest.mark.parametrize("arch", ARCHS)
def test_mfma_tile_against_matmul(arch, dtype):
    tile, k = K.MFMA_TILE, MFMA_K[dtype]
    launch = K.mfma_tile(arch, dtype)
    torch.manual_seed(4)
    # 1) Small integers: every product and partial sum is exact in f32, so any accumulation
    #    order gives the same bits: the result must equal matmul exactly (tests the data layout).
    a = torch.randint(-3, 4, (tile, k)).to(MFMA_DTYPES[dtype])
    b = torch.randint(-3, 4, (tile, k)).to(MFMA_DTYPES[dtype])
    c = torch.zeros(tile, tile)
    run(arch, launch, a, b, c, k, tensors=(a, b, c))
    torch.testing.assert_close(c, a.float() @ b.float().T, rtol=0, atol=0)
    # 2) Random values: the products of bf16 inputs are exact in f32 and f32 products round
    #    once; each of the two summations (MFMA's, matmul's) of k terms errs by at most
    #    k * u * sum|a||b| (u = 2^-24), so they differ by at most twice that, plus one rounding
    #    of each product for f32 inputs.
    a = torch.randn(tile, k).to(MFMA_DTYPES[dtype])
    b = torch.randn(tile, k).to(MFMA_DTYPES[dtype])
    c = torch.zeros(tile, tile)
    run(arch, launch, a, b, c, k, tensors=(a, b, c))
    reference = a.float() @ b.float().T
    bound = (2 * k + 2) * F32_EPS * (a.float().abs() @ b.float().abs().T)
    assert torch.all((c - reference).abs() <= bound)


@pytest.mark.parametrize("arch", ARCHS)
def test_buffer_out_of_range_tail(arch):
    n = 100  # 25 full 16-byte vectors: two tiles of 256 floats, the second mostly past the end
    tiles = 2
    capacity = tiles * K.TAIL_TILE
    torch.manual_seed(5)
    x_backing, x = _backed(n, capacity, fill=float("nan"))  # memory past X holds NaN ...
    x.copy_(torch.randn(n))
    y_backing, y = _backed(n, capacity, fill=-7.0)
    raw = torch.full((capacity,), -1.0)
    run(arch, K.buffer_tail(arch), x, y, raw, tiles, tensors=(x_backing, y_backing, raw))
    torch.testing.assert_close(raw[:n], x, rtol=0, atol=0)
    assert torch.all(raw[n:] == 0)  # ... but buffer loads past num_records read 0
    torch.testing.assert_close(y, x + 1, rtol=0, atol=0)
    assert torch.all(y_backing[n:] == -7.0)  # and buffer stores past it are dropped
