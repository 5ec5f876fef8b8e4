"""One unusual value alone in otherwise ordinary data, for every quantize kernel family, bit-exact
against the reference. The kernels decide per wave whether to take a rare path (the exact amax,
the NaN/Inf patch, gfx942's FP32 encoder), reducing flags over each lane's blocks, rows or
columns: a value that is the only trigger in its wave, placed where a lane holds its last
position, is what checks that every position enters the reduction. (The other kernel tests put
several special blocks in one wave, where any one of them takes the whole wave to the rare path.)
"""

from __future__ import annotations

import pytest
import torch

import flyquant.emu as emu
from flyquant import reference
from flyquant.kernels import mxfp4_quantize as k4
from flyquant.kernels import mxfp4_quantize_cols as kc
from flyquant.kernels import mxfp4_quantize_dual as kd
from flyquant.kernels import mxfp8_quantize_2d as q2
from flyquant.kernels import mxfp8_quantize_3d as q3

from test_mxfp4_kernels import assert_same

ARCHS = ("gfx950", "gfx942")
HUGE = 2.0**122  # BF16 0x7C80: read as FP16 (gfx950's packed amax) a signalling NaN, not Inf or NaN


def _random(shape, dtype, seed):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(*shape, generator=g).to(dtype)


def _flat(pairs):
    """The dual kernels' ((data, scales), (data, scales)) as one tuple of tensors."""
    return tuple(t for pair in pairs for t in pair)


def _families(mode):
    """(name, kernel(x, arch), reference(x), input shape) of each quantize kernel family."""
    return [
        ("mxfp4 rows", lambda x, a: k4.quantize_rows(x, arch=a, scaling_mode=mode),
         lambda x: reference.mxfp4_quantize(x, -1, mode), (64, 128)),
        ("mxfp4 cols", lambda x, a: kc.quantize_cols(x, arch=a, scaling_mode=mode),
         lambda x: reference.mxfp4_quantize(x, 0, mode), (64, 128)),
        ("mxfp4 dual", lambda x, a: _flat(kd.quantize_dual(x, arch=a, scaling_mode=mode)),
         lambda x: reference.mxfp4_quantize(x, -1, mode) + reference.mxfp4_quantize(x, 0, mode), (64, 128)),
        ("mxfp4 dual tail", lambda x, a: _flat(kd.quantize_dual(x, arch=a, scaling_mode=mode)),
         lambda x: reference.mxfp4_quantize(x, -1, mode) + reference.mxfp4_quantize(x, 0, mode), (37, 75)),
        ("mxfp8 1x32", lambda x, a: q2.quantize_1x32(x, arch=a, scaling_mode=mode),
         lambda x: reference.mxfp8_quantize(x, -1, mode), (256, 256)),
        ("mxfp8 32x1", lambda x, a: q2.quantize_32x1(x, arch=a, scaling_mode=mode),
         lambda x: reference.mxfp8_quantize(x, 0, mode), (256, 256)),
        ("mxfp8 dual", lambda x, a: _flat(q2.quantize_dual(x, arch=a, scaling_mode=mode)),
         lambda x: _flat(reference.mxfp8_quantize_dual(x, mode)), (256, 256)),
        ("mxfp8 3d", lambda x, a: q3.quantize_3d(x, arch=a, scaling_mode=mode),
         lambda x: reference.mxfp8_quantize_3d(x, mode), (2, 64, 128)),
    ]


@pytest.mark.parametrize("arch", ARCHS)
def test_a_lone_bf16_value_past_2_121(arch):
    """gfx950 takes BF16 pairs through the FP16 maximum and redoes a wave's amax exactly when a
    pattern reaches 2^121 (kernels' spec.suspicious): 2^122 is finite, and read as FP16 a
    signalling NaN that the maximum quiets; alone in its wave it must still take the exact path."""
    emu.enable(arch)
    for i, (name, kernel, ref, shape) in enumerate(_families("floor")):
        x = _random(shape, torch.bfloat16, i)
        x[(1,) * (len(shape) - 2) + (40 % shape[-2], 50)] = HUGE
        assert_same(kernel(x, arch), ref(x), f"{name} {shape} with 2^122")


@pytest.mark.parametrize("arch", ARCHS)
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32], ids=["bf16", "fp32"])
def test_a_lone_non_finite_value_in_a_lanes_last_position(arch, dtype):
    """NaN / Inf as the wave's only special value: in column 7 (a lane's last column of the column
    kernels: 8 columns of 16-bit x, 4 of FP32), in row 31 (the dual kernels' last row a lane owns)
    and, rowwise, in the last block of a tile."""
    emu.enable(arch)
    for i, (name, kernel, ref, shape) in enumerate(_families("rceil")):
        for j, (row, col, value) in enumerate(((70, 7, float("nan")), (31, 40, -float("inf")), (63, 127, float("inf")))):
            x = _random(shape, dtype, 10 * i + j)
            lead = (1,) * (len(shape) - 2)
            x[lead + (row % shape[-2], col % shape[-1])] = value
            assert_same(kernel(x, arch), ref(x), f"{name} {shape} with {value} at {(row, col)}")


@pytest.mark.parametrize("dtype,mode,rows,scale", [(torch.bfloat16, "floor", 7, 2.0**-124),
                                                   (torch.float16, "rceil", 15, 60000.0)], ids=["bf16-tiny", "fp16-large"])
def test_gfx942_dual_encoder_range_in_a_lanes_last_row(dtype, mode, rows, scale):
    """gfx942's 16-bit FP4 encoder covers blocks whose scale fits (module docstring of
    kernels/_mxfp4_common.py); a block outside it (BF16 amax below 2^-122, FP16 above 49152) takes
    the FP32 encoder: alone in its wave, in the row the dual kernel's lane owns last."""
    emu.enable("gfx942")
    x = _random((64, 128), dtype, 3)
    x[rows, 32:64] = (torch.linspace(-1, 1, 32) * scale).to(dtype)
    got = _flat(kd.quantize_dual(x, arch="gfx942", scaling_mode=mode))
    assert_same(got, reference.mxfp4_quantize(x, -1, mode) + reference.mxfp4_quantize(x, 0, mode), "gfx942 dual")
