"""MXFP4 reference (flyquant.reference.mxfp4_quantize / quantize_mxfp4) against torchao 0.18's
to_mx (all three modes, finite input) and aiter's pure-torch per_1x32_f4_quant ("even"), byte
for byte. flyquant follows torchao main's contract (formats.py), which differs from 0.18 only on
the block classes of test_reference_mxfp8.DIFFERS_FROM_018 (with 6 in place of 448); every
comparison with 0.18 checks that each differing block is in one of them."""

import pytest
import torch

from flyquant import formats
from flyquant import reference as R
from flyquant.formats import E2M1, E8M0_NAN

import oracles
from test_reference_mxfp8 import _next_up, _wide_random, assert_matches_018, crafted_blocks, documented_018_differences

MODES = ("floor", "rceil", "even")
U8 = torch.uint8


@pytest.fixture(scope="module")
def tao():
    return oracles.torchao()


def to_mx_fp4(tao, x, mode):
    """torchao 0.18's (packed, scales) along the last dim; FP16 as its exact FP32 upcast."""
    if x.dtype == torch.float16:
        x = x.float()
    scales, packed = tao.to_mx(x.contiguous(), torch.float4_e2m1fn_x2, 32, tao.Mode(mode))
    return packed.view(U8), scales.view(U8)


def assert_018(tao, x, mode, what):
    """Rowwise quantize of x (M, 32k) equals 0.18's outside the documented blocks; returns how many
    blocks differ."""
    packed, scales = R.mxfp4_quantize(x, -1, mode)
    ref_packed, ref_scales = to_mx_fp4(tao, x, mode)
    assert packed.shape == ref_packed.shape and scales.shape == ref_scales.shape
    return assert_matches_018(packed, scales, ref_packed, ref_scales, x, mode, what, fmt=E2M1)


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32, torch.float16])
def test_random_matches_to_mx(tao, mode, dtype):
    x = _wide_random((48, 128), dtype, seed=30)  # 192 blocks with scales across the E8M0 range
    assert documented_018_differences(x.reshape(-1, 32), mode, E2M1).sum() == 0  # nothing excused
    assert assert_018(tao, x, mode, "rowwise") == 0


@pytest.mark.parametrize("mode", MODES)
def test_columnwise_is_rowwise_of_the_transpose(tao, mode):
    x = _wide_random((96, 64), torch.bfloat16, seed=32)  # 3 blocks along M per column
    packed, scales = R.mxfp4_quantize(x, 0, mode)
    assert packed.shape == (64, 48) and scales.shape == (64, 3)
    ref_packed, ref_scales = to_mx_fp4(tao, x.t().contiguous(), mode)
    assert documented_018_differences(x.t().reshape(-1, 32), mode, E2M1).sum() == 0  # nothing excused
    assert assert_matches_018(packed, scales, ref_packed, ref_scales, x.t(), mode, "columnwise", fmt=E2M1) == 0


def fp4_blocks(dtype):
    """The MXFP8 crafted blocks plus E2M1's own boundaries: amax at and just above 6 * 2^k
    (rceil), at 1.5 / 1.75 times a power of two ("even" rounds from mantissa 0.75), the element
    ties 0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5 (round to even) and values up to 8 (saturation)."""
    blocks = crafted_blocks(dtype)
    for k in ((-20, -1, 0, 12) if dtype == torch.float16 else (-100, -1, 0, 20)):
        blocks[f"amax_6_pow2_{k}"] = torch.full((32,), 6 * 2.0**k, dtype=dtype)
        blocks[f"amax_above_6_pow2_{k}"] = torch.full((32,), _next_up(6 * 2.0**k, dtype), dtype=dtype)
        blocks[f"amax_1.5_pow2_{k}"] = torch.full((32,), 1.5 * 2.0**k, dtype=dtype)
        blocks[f"amax_1.75_pow2_{k}"] = torch.full((32,), 1.75 * 2.0**k, dtype=dtype)
    ties = torch.tensor([0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0, 6.0] * 4) * torch.tensor([1.0, -1.0]).repeat(16)
    blocks["element_ties"] = ties.to(dtype)  # amax 6: every mode keeps the scale 1 (code 127)
    blocks["saturation"] = torch.linspace(-8, 7.9, 32).to(dtype)  # floor: amax 7.9 -> code 127, 6..8 -> 6
    return blocks


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_crafted_blocks_match_to_mx(tao, mode, dtype):
    blocks = fp4_blocks(dtype)
    assert_018(tao, torch.stack(list(blocks.values())), mode, "crafted")


def test_element_ties_round_to_even():
    """Scale code 127 (amax 6, all modes): 0.25 -> 0 (0x0), 0.75 -> 1.0 (0x2), 1.25 -> 1.0 (0x2),
    1.75 -> 2.0 (0x4), 2.5 -> 2 (0x4), 3.5 -> 4 (0x6), 5 -> 4 (0x6), 6 (0x7); negatives | 0x8."""
    x = fp4_blocks(torch.float32)["element_ties"].reshape(1, 32)
    want = torch.tensor([0x0, 0x2, 0x2, 0x4, 0x4, 0x6, 0x6, 0x7] * 4) | torch.tensor([0, 8]).repeat(16)
    for mode in MODES:
        packed, scales = R.mxfp4_quantize(x, -1, mode)
        assert scales.view(U8).item() == 127
        assert torch.equal(formats.unpack_fp4(packed)[0], want.to(U8))


# One block per 0.18 difference class with both byte sets worked by hand: (mode, amax, 0.18's
# code and element nibble, the contract's code and nibble).
DIFFERENCES = [
    # floor_code0: 2^-125 has field 2 -> code 0 (2^-127). 0.18 multiplies by 2^126: 2 = 0x4; the
    # contract by 2^127: 4 = 0x6.
    ("floor", 2.0**-125, 0, 0x4, 0, 0x6),
    ("even", 2.0**-125, 0, 0x4, 0, 0x6),
    # rceil_code0: 2^-128 * fl32(1/6) < 2^-127 -> code 0. 0.18 leaves 2^-128 unscaled: 0; the
    # contract: 2^-128 * 2^127 = 0.5 = 0x1.
    ("rceil", 2.0**-128, 0, 0x0, 0, 0x1),
    # rceil_log2: one FP32 ulp above 6 * 2^20: descale 2^20 (1 + ~2^-23). 0.18's FP32 log2 gives
    # 20: code 147 and the element saturates at 6 = 0x7; the contract rounds up: 148, 3.0 = 0x5.
    ("rceil", _next_up(6 * 2.0**20, torch.float32), 147, 0x7, 148, 0x5),
]


@pytest.mark.parametrize("mode,amax,code_018,elem_018,code,elem", DIFFERENCES)
def test_documented_018_differences_worked(tao, mode, amax, code_018, elem_018, code, elem):
    x = torch.full((1, 32), amax)
    packed, scales = R.mxfp4_quantize(x, -1, mode)
    ref_packed, ref_scales = to_mx_fp4(tao, x, mode)
    assert ref_scales.item() == code_018 and (ref_packed == elem_018 * 0x11).all()
    assert scales.view(U8).item() == code and (packed == elem * 0x11).all()
    assert documented_018_differences(x, mode, E2M1).item()


def test_even_matches_aiters_torch_quant_where_its_scale_rule_agrees():
    """aiter's per_1x32_f4_quant rounds amax / 4 to E8M0 from mantissa 0.5 on, "even" from 0.75
    on; on blocks whose amax mantissa is outside [0.5, 0.75) both give the same scale, and the
    elements (aiter: x / scale, its RNE saturating encoder) must match byte for byte."""
    aiter_quant = oracles.aiter_per_1x32_f4_quant()
    x = _wide_random((64, 256), torch.float32, seed=33)
    amax = x.view(64, 8, 32).abs().amax(-1)
    mant = amax.view(torch.int32) & 0x7FFFFF
    agree = ((mant < 0x400000) | (mant >= 0x600000)) & (amax >= 2.0**-120)  # normal amax / 4 too
    packed, scales = R.mxfp4_quantize(x, -1, "even")
    a_packed, a_scales = aiter_quant(x)
    a_packed, a_scales = a_packed.view(U8).view(64, 8, 16), a_scales.view(U8)
    assert agree.sum() > 300
    assert torch.equal(scales.view(U8)[agree], a_scales[agree])
    assert torch.equal(packed.view(64, 8, 16)[agree], a_packed[agree])
    # amax 1.5 (mantissa 0.5): "even" keeps 2^-2 (1.5 * 4 = 6 -> 0x7); aiter rounds 0.375 up to
    # 2^-1 (code 126, 1.5 * 2 = 3 -> 0x5)
    one = torch.full((1, 32), 1.5)
    assert R.mxfp4_quantize(one, -1, "even")[1].view(U8).item() == 125
    a_packed, a_scales = aiter_quant(one)
    assert a_scales.view(U8).item() == 126 and (a_packed.view(U8) == 0x55).all()


def test_hand_derived_block_and_nibble_order():
    """amax 6 = 1.5 * 2^2: floor/even 2 - 2 = 0 -> code 127; rceil 6 * fl32(1/6) = 1 -> 127.
    Elements unscaled: 6 -> 0x7, 0.5 -> 0x1; element 0 in the low nibble: byte 0x17."""
    x = torch.full((1, 32), 0.5)
    x[0, 0] = 6.0
    for mode in MODES:
        packed, scales = R.mxfp4_quantize(x, -1, mode)
        assert scales.view(U8).item() == 127
        assert packed[0, 0].item() == 0x17 and (packed[0, 1:] == 0x11).all()


@pytest.mark.parametrize("mode", MODES)
def test_nonfinite_blocks_and_tail_padding(mode):
    """NaN/Inf block: scale 0xFF, every nibble E2M1_NAN_BLOCK_CODE (0x7) -> bytes 0x77, except a
    partial block's padding nibbles (0). The finite block of ones: floor/even 0 - 2, rceil
    ceil(log2(1 * fl32(1/6))) = ceil(-2.58) = -2: code 125, 1 * 4 = 4.0 -> 0x6 -> bytes 0x66.
    K = 40: blocks of 32 and 8 (+ 24 zeros)."""
    x = torch.ones(3, 40)
    x[0, 7], x[1, 39] = float("nan"), float("-inf")
    packed, scales = R.mxfp4_quantize(x, -1, mode)
    assert scales.view(U8).tolist() == [[E8M0_NAN, 125], [125, E8M0_NAN], [125, 125]]
    assert (packed[0, :16] == 0x77).all() and (packed[1, 16:20] == 0x77).all()
    assert (packed[2, :20] == 0x66).all() and (packed[0, 16:20] == 0x66).all() and (packed[1, :16] == 0x66).all()
    assert (packed[:, 20:] == 0).all()  # padding


@pytest.mark.parametrize("axis", [-1, 0])
def test_tails_are_the_zero_padded_input(axis):
    """Any K (rowwise) or M (columnwise), primes included: the outputs are those of x zero-padded
    to whole blocks."""
    x = _wide_random((37, 67), torch.bfloat16, seed=34)
    packed, scales = R.mxfp4_quantize(x, axis, "rceil")
    rows = x if axis == -1 else x.t()
    padded = torch.nn.functional.pad(rows, (0, 96 - rows.shape[1]) if axis == -1 else (0, 64 - rows.shape[1]))
    want_packed, want_scales = R.mxfp4_quantize(padded.contiguous(), -1, "rceil")
    assert torch.equal(packed, want_packed) and torch.equal(scales.view(U8), want_scales.view(U8))


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("value", [0.0, -0.0, 1e-38, 2.0**-133])
def test_tail_padding_is_zero_whatever_the_elements_present(mode, value):
    """A partial block of zeros or of values at the bottom of FP32 (normal and subnormal) is
    quantized as the block padded with exact zeros: its scale comes from the elements present
    only (a padding value of its own would lift an all-zero or tiny block's scale)."""
    x = torch.full((2, 40), value)
    x[1, 5] = 3.0  # a second row whose first block is not tiny
    padded = torch.nn.functional.pad(x, (0, 24))
    for got, want in zip(R.mxfp4_quantize(x, -1, mode), R.mxfp4_quantize(padded, -1, mode)):
        assert torch.equal(got.view(U8), want.view(U8))
    if value == 0:
        assert (R.mxfp4_quantize(x, -1, mode)[1].view(U8)[:, 1] == 0).all()


def test_shapes_leading_dims_1d_and_empty():
    x = _wide_random((2, 3, 64), torch.float32, seed=35)
    packed, scales = R.mxfp4_quantize(x)
    flat_packed, flat_scales = R.mxfp4_quantize(x.reshape(6, 64))
    assert packed.shape == (6, 32) and torch.equal(packed, flat_packed) and torch.equal(scales, flat_scales)
    w_packed, w_scales = R.quantize_mxfp4(x, "floor")  # the weight-oriented name keeps the leading dims
    assert w_packed.shape == (2, 3, 32) and torch.equal(w_packed.reshape(6, 32), packed)
    assert torch.equal(w_scales.reshape(6, 2).view(U8), scales.view(U8))
    assert R.mxfp4_quantize(x[0, 0])[0].shape == (1, 32)  # 1-D: one row
    assert R.mxfp4_quantize(x[0, 0], 0)[0].shape == (64, 16)  # its columns: one element each
    for shape, axis, want in [((0, 5), -1, (0, 16)), ((0, 5), 0, (5, 0)), ((4, 0), -1, (4, 0)), ((4, 0), 0, (0, 16))]:
        p, s = R.mxfp4_quantize(torch.zeros(shape), axis)
        assert p.shape == want and s.shape == (want[0], want[1] // 16)
        empty = R.mxfp4_quantize_empty(torch.zeros(shape), axis)
        assert empty[0].shape == p.shape and empty[1].shape == s.shape and empty[1].dtype == s.dtype


def test_fp16_quantizes_as_its_fp32_upcast():
    x = _wide_random((8, 64), torch.float16, seed=36)
    for mode in MODES:
        a, b = R.mxfp4_quantize(x, -1, mode), R.mxfp4_quantize(x.float(), -1, mode)
        assert torch.equal(a[0], b[0]) and torch.equal(a[1].view(U8), b[1].view(U8))


def test_dequantize_matches_aiters_decode():
    aiter = oracles.aiter_fp4_utils()
    w = _wide_random((2, 32, 128), torch.float32, seed=31)
    packed, scales = R.quantize_mxfp4(w, "floor")
    scales[0, 0, 0] = torch.tensor(0, dtype=U8).view(torch.float8_e8m0fnu)  # code 0: 2^-127
    expected = aiter.mxfp4_to_f32(packed) * aiter.e8m0_to_f32(scales).repeat_interleave(32, dim=-1)
    torch.testing.assert_close(R.dequantize_mxfp4(packed, scales), expected, rtol=0, atol=0)
    assert R.dequantize_mxfp4(packed.view(torch.float4_e2m1fn_x2), scales).shape == (2, 32, 128)


@pytest.mark.parametrize("call,exc,match", [
    (lambda: R.mxfp4_quantize(torch.zeros(4, 64, dtype=torch.int8)), TypeError, "x must have dtype"),
    (lambda: R.mxfp4_quantize(torch.zeros(())), ValueError, "at least 1 dimension"),
    (lambda: R.mxfp4_quantize(torch.zeros(4, 64), scaling_mode="ceil"), ValueError, "scaling_mode must be one of"),
    (lambda: R.mxfp4_quantize(torch.zeros(4, 64), 1, "ceil"), ValueError, "scaling_mode must be one of"),
    (lambda: R.mxfp4_quantize(torch.zeros(4, 64, 2), 1), ValueError, "axis must be -1"),
    (lambda: R.mxfp4_quantize(torch.zeros(4, 64).t()), ValueError, "x must be contiguous"),
    (lambda: R.mxfp4_quantize(torch.zeros(4, 64), scale_layout="tcgen05"), ValueError, "scale_layout must be one of"),
    (lambda: R.mxfp4_quantize(torch.zeros(4, 64), shuffle="a16w4"), ValueError, "shuffle must be one of"),
    (lambda: R.mxfp4_quantize(torch.zeros(4, 64), shuffle="a4w4"), ValueError, r"M \(rows, leading dims flattened\) = 4"),
    (lambda: R.mxfp4_quantize(torch.zeros(16, 96), shuffle="a4w4"), ValueError, "K = 96 a multiple of 64"),
    (lambda: R.mxfp4_quantize(torch.zeros(64, 64), 0, scale_layout="mfma"), ValueError, "^scale_layout='mfma': rowwise only"),
    (lambda: R.quantize_mxfp4(torch.zeros(4, 64), "ceil"), ValueError, "scaling_mode must be one of"),
    (lambda: R.dequantize_mxfp4(torch.zeros(4, 32, dtype=U8), torch.zeros(4, 3, dtype=torch.float8_e8m0fnu)),
     ValueError, "scales must have shape"),
    (lambda: R.dequantize_mxfp4(torch.zeros(4, 24, dtype=U8), torch.zeros(4, 2, dtype=torch.float8_e8m0fnu)),
     ValueError, "multiple of 16"),
    (lambda: R.dequantize_mxfp4(torch.zeros(4, 32), torch.zeros(4, 2, dtype=torch.float8_e8m0fnu)),
     TypeError, "packed must have dtype"),
])
def test_bad_input_raises(call, exc, match):
    with pytest.raises(exc, match=match):
        call()
