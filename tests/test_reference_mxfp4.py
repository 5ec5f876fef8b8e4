"""MXFP4 quantize/dequantize (flyquant.reference) against torchao 0.18's to_mx and aiter's
pure-PyTorch FP4 decode."""

import pytest
import torch

from flyquant import reference as R
from flyquant.formats import E8M0_NAN

import oracles
from test_reference_mxfp8 import _next_up, _wide_random, crafted_blocks

MODES = ("floor", "rceil")
U8 = torch.uint8


@pytest.fixture(scope="module")
def tao():
    return oracles.torchao()


def to_mx_fp4(tao, w, mode):
    if w.dtype == torch.float16:
        w = w.float()
    scales, packed = tao.to_mx(w.contiguous(), torch.float4_e2m1fn_x2, 32, tao.Mode(mode))
    return packed.view(U8), scales.view(U8)


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32, torch.float16])
def test_random_weights_match_to_mx(tao, mode, dtype):
    w = _wide_random((2, 32, 128), dtype, seed=30)  # expert weights (E, N, K): 4 blocks per row
    packed, scales = R.quantize_mxfp4(w, mode)
    ref_packed, ref_scales = to_mx_fp4(tao, w, mode)
    assert packed.dtype == U8 and packed.shape == (2, 32, 64)
    assert scales.dtype == torch.float8_e8m0fnu and scales.shape == (2, 32, 4)
    assert torch.equal(packed, ref_packed)
    assert torch.equal(scales.view(U8), ref_scales)


def _fp4_blocks(dtype):
    """The MXFP8 crafted blocks plus amax at and just above 6 * 2^k (E2M1's rceil boundary)."""
    blocks = crafted_blocks(dtype)
    for k in (-100, -1, 0, 20):
        blocks[f"amax_6_pow2_{k}"] = torch.full((32,), 6 * 2.0**k, dtype=dtype)
        blocks[f"amax_above_6_pow2_{k}"] = torch.full((32,), _next_up(6 * 2.0**k, dtype), dtype=dtype)
    return blocks


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_crafted_blocks_match_to_mx(tao, mode, dtype):
    blocks = _fp4_blocks(dtype)
    x = torch.stack(list(blocks.values()))
    packed, scales = R.quantize_mxfp4(x, mode)
    ref_packed, ref_scales = to_mx_fp4(tao, x, mode)
    for i, name in enumerate(blocks):
        assert scales.view(U8)[i].item() == ref_scales[i].item(), name
        assert torch.equal(packed[i], ref_packed[i]), name


def test_hand_derived_block_and_nibble_order():
    """amax 6 = 1.5 * 2^2: floor 2 - 2 = 0 -> code 127; rceil ceil(log2(6/6)) = 0 -> 127.
    Elements unscaled: 6 -> 0x7, 0.5 -> 0x1; element 0 in the low nibble: byte 0x17."""
    x = torch.full((1, 32), 0.5)
    x[0, 0] = 6.0
    for mode in MODES:
        packed, scales = R.quantize_mxfp4(x, mode)
        assert scales.view(U8).item() == 127
        assert packed[0, 0].item() == 0x17 and (packed[0, 1:] == 0x11).all()


@pytest.mark.parametrize("mode", MODES)
def test_nonfinite_blocks(mode):
    """NaN/Inf block: scale 0xFF, every nibble E2M1_NAN_BLOCK_CODE (0x7) -> bytes 0x77.
    The finite block of ones: floor 0 - 2 / rceil ceil(log2(1/6)) = ceil(-2.58): code 125, and
    1 * 4 = 4.0 -> 0x6 -> bytes 0x66."""
    x = torch.ones(3, 32)
    x[0, 7], x[1, 30] = float("nan"), float("-inf")
    packed, scales = R.quantize_mxfp4(x, mode)
    assert scales.view(U8).tolist() == [[E8M0_NAN], [E8M0_NAN], [125]]
    assert (packed[:2] == 0x77).all() and (packed[2] == 0x66).all()


def test_dequantize_matches_aiters_decode():
    aiter = oracles.aiter_fp4_utils()
    w = _wide_random((2, 32, 128), torch.float32, seed=31)
    packed, scales = R.quantize_mxfp4(w, "floor")
    scales[0, 0, 0] = torch.tensor(0, dtype=U8).view(torch.float8_e8m0fnu)  # code 0: 2^-127
    expected = aiter.mxfp4_to_f32(packed) * aiter.e8m0_to_f32(scales).repeat_interleave(32, dim=-1)
    torch.testing.assert_close(R.dequantize_mxfp4(packed, scales), expected, rtol=0, atol=0)
    assert R.dequantize_mxfp4(packed.view(torch.float4_e2m1fn_x2), scales).shape == (2, 32, 128)


def test_bad_input_raises():
    with pytest.raises(TypeError, match="w must have dtype"):
        R.quantize_mxfp4(torch.zeros(4, 64, dtype=torch.int8))
    with pytest.raises(ValueError, match=r"K, quantized in blocks of 32\) = 48"):
        R.quantize_mxfp4(torch.zeros(4, 48))
    with pytest.raises(ValueError, match="scaling_mode"):
        R.quantize_mxfp4(torch.zeros(4, 64), "even")
    with pytest.raises(ValueError, match="scales must have shape"):
        R.dequantize_mxfp4(torch.zeros(4, 32, dtype=U8), torch.zeros(4, 3, dtype=torch.float8_e8m0fnu))
    with pytest.raises(TypeError, match="packed must have dtype"):
        R.dequantize_mxfp4(torch.zeros(4, 32), torch.zeros(4, 2, dtype=torch.float8_e8m0fnu))
