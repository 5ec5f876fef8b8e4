"""MXFP8 reference (flyquant.reference) against torchao 0.18's to_mx, bit for bit outside the
blocks where torchao main's contract (which flyquant follows: tests/test_mxfp8_contract.py)
differs from 0.18. Those blocks are exactly the classes of DIFFERS_FROM_018 below; every
comparison with 0.18 goes through assert_matches_018, which checks each differing block is in a
documented class (and the crafted blocks name the class each of them is in).

Shapes are small (a few blocks per dimension) so the whole file runs in seconds; each is chosen
for a stated reason next to it.
"""

import pytest
import torch

from flyquant import formats
from flyquant import reference as R
from flyquant.formats import E4M3_NAN, E8M0_NAN

import oracles

MODES = ("floor", "rceil")
U8 = torch.uint8


@pytest.fixture(scope="module")
def tao():
    return oracles.torchao()


def _bytes(t):
    return t.view(U8)


def assert_bytes(actual, expected):
    torch.testing.assert_close(_bytes(actual), _bytes(expected), rtol=0, atol=0)


def to_mx_1x32(tao, x, mode):
    """torchao's (data, scales) along the last dim; FP16 goes in as its exact FP32 upcast."""
    if x.dtype == torch.float16:
        x = x.float()
    scales, data = tao.to_mx(x.contiguous(), torch.float8_e4m3fn, 32, tao.Mode(mode))
    return data, scales


# Where torchao 0.18's to_mx differs from torchao main's contract (E4M3, one block):
DIFFERS_FROM_018 = {
    "nonfinite": "floor: a NaN or Inf in the block; rceil: an Inf and no NaN. 0.18 gives Inf "
                 "blocks a finite scale (floor 0xF7, rceil 0xFE) with the Inf as +-448 and the rest "
                 "scaled by it, and floor NaN blocks 0xFF with only the NaN element NaN",
    "floor_code0": "floor, scale code 0 (amax < 2^-118) with a nonzero element: 0.18 multiplies by "
                   "2^126, not 2^127 (elements half their value)",
    "rceil_code0": "rceil, scale code 0 (amax * fl32(1/448) <= 2^-127) with a nonzero element: 0.18 "
                   "does not scale the elements (they underflow to +-0)",
    "rceil_log2": "rceil, descale = amax * fl32(1/448) above a power of two 2^e by a relative 2^-17 or "
                  "less: 0.18 takes ceil(log2(amax / 448)) in FP32, which rounds to e, so its scale "
                  "is one code lower (elements twice as large, saturating)",
}


# Per element format: its largest value and the smallest block amax whose floor scale code is not 0
# (floor(log2 amax) - emax > -127: E4M3 emax 8, E2M1 emax 2).
_FORMAT_BOUNDS = {"E4M3": (448.0, 2.0**-118), "E2M1": (6.0, 2.0**-124)}


def difference_classes(x: torch.Tensor, mode: str, fmt=formats.E4M3) -> dict:
    """(..., 32) blocks -> {DIFFERS_FROM_018 class: bool (...)}: the blocks in that class (for
    MXFP4, fmt E2M1, the same classes with 6 in place of 448; "even" has floor's). Computed from x
    alone, never from flyquant's quantizer (else a reference that wrongly gave a block scale code 0
    would excuse its own error)."""
    max_value, floor_code1 = _FORMAT_BOUNDS["E4M3" if fmt is formats.E4M3 else "E2M1"]
    x = x.to(torch.float32)
    nan, inf = x.isnan().any(-1), x.isinf().any(-1)
    amax = x.abs().amax(-1)
    nonzero = amax > 0
    if mode in ("floor", "even"):  # "even" rounds amax up at most to the next power of two: a superset
        return {"nonfinite": nan | inf, "floor_code0": nonzero & (amax < floor_code1)}
    descale = amax * torch.tensor(1 / max_value, dtype=torch.float32)  # rceil's FP32 product
    mant, _ = torch.frexp(descale.double())  # descale = mant * 2^e, mant in [0.5, 1)
    excess = mant * 2 - 1  # relative excess over the power of two below
    return {"nonfinite": inf & ~nan, "rceil_code0": nonzero & (descale <= 2.0**-127),
            "rceil_log2": (excess > 0) & (excess <= 2.0**-17)}


def documented_018_differences(x: torch.Tensor, mode: str, fmt=formats.E4M3) -> torch.Tensor:
    """(..., 32) blocks -> bool (...): the block is in a DIFFERS_FROM_018 class."""
    classes = list(difference_classes(x, mode, fmt).values())
    return torch.stack(classes).any(0)


def assert_matches_018(data, scales, ref_data, ref_scales, x, mode, what="", fmt=formats.E4M3):
    """Our (data, scales) equal 0.18's on every block outside documented_018_differences; returns
    the number of blocks that differ (all of them documented). x, data, ref_data: (..., 32)
    blocks along the last dim (data: a block's bytes, 32 E4M3 or 16 packed E2M1); scales: (...)."""
    x = x.reshape(-1, 32)
    d, rd = _bytes(data).reshape(x.shape[0], -1), _bytes(ref_data).reshape(x.shape[0], -1)
    differ = (_bytes(scales).reshape(-1) != _bytes(ref_scales).reshape(-1)) | (d != rd).any(-1)
    documented = documented_018_differences(x, mode, fmt)
    undocumented = (differ & ~documented).nonzero().flatten()
    assert undocumented.numel() == 0, f"{what}: blocks {undocumented[:8].tolist()} differ from torchao 0.18 undocumented"
    return int(differ.sum())


def _wide_random(shape, dtype, seed):
    """Normal samples times 2^e with e uniform per element over most of the dtype's range, so
    blocks mix magnitudes and scales vary across the whole E8M0 range without overflowing."""
    gen = torch.Generator().manual_seed(seed)
    lo, hi = (-24, 15) if dtype == torch.float16 else (-140, 120)
    e = torch.randint(lo, hi, shape, generator=gen).float()
    rows = torch.randint(lo, hi, shape[:-1] + (1,), generator=gen).float()  # per-row bias: varied block amax
    return (torch.randn(shape, generator=gen) * torch.exp2(((e + rows) / 2).floor())).to(dtype)


# ------------------------------------------------------------------------------------------------
# random data
# ------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32, torch.float16])
def test_1x32_random_matches_to_mx(tao, mode, dtype):
    x = _wide_random((64, 256), dtype, seed=10)  # 64 rows x 8 blocks
    data, scales = R.mxfp8_quantize(x, axis=-1, scaling_mode=mode)
    ref_data, ref_scales = to_mx_1x32(tao, x, mode)
    assert data.dtype == torch.float8_e4m3fn and scales.dtype == torch.float8_e8m0fnu
    assert data.shape == (64, 256) and data.stride() == (256, 1) and scales.shape == (64, 8)
    assert documented_018_differences(x.reshape(-1, 32), mode).sum() == 0  # nothing excused: 0.18's bytes
    assert assert_matches_018(data, scales, ref_data, ref_scales, x, mode) == 0


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32, torch.float16])
def test_32x1_random_matches_to_mx_of_transpose(tao, mode, dtype):
    x = _wide_random((96, 64), dtype, seed=11)  # M = 96: 3 blocks along M, no 128 alignment needed
    data, scales = R.mxfp8_quantize(x, axis=0, scaling_mode=mode)
    ref_data_t, ref_scales = to_mx_1x32(tao, x.t(), mode)  # torchao's dim1 path: to_mx of x^T
    assert data.shape == (96, 64) and data.stride() == (1, 96) and scales.shape == (64, 3)
    assert documented_018_differences(x.t().reshape(-1, 32), mode).sum() == 0  # nothing excused
    assert assert_matches_018(data.t(), scales, ref_data_t, ref_scales, x.t(), mode) == 0


def test_fp16_quantizes_as_its_fp32_upcast():
    # FP16 subnormals (2^-24..), normals and the FP16 maximum 65504; 32 x 128: one block along M
    gen = torch.Generator().manual_seed(12)
    bits = torch.randint(0, 0x7C00, (32, 128), generator=gen).to(torch.int16)
    bits[0, :32] = torch.arange(1, 33)  # a block of FP16 subnormals
    bits[1, 0] = 0x7BFF  # 65504
    sign = torch.randint(0, 2, (32, 128), generator=gen).to(torch.int16) << 15
    x = (bits | sign).view(torch.float16)
    for mode in MODES:
        for axis in (-1, 0):
            a, b = R.mxfp8_quantize(x, axis, mode), R.mxfp8_quantize(x.float(), axis, mode)
            assert_bytes(a[0], b[0])
            assert_bytes(a[1], b[1])


# ------------------------------------------------------------------------------------------------
# crafted finite blocks
# ------------------------------------------------------------------------------------------------


def _next_down(v: float, dtype) -> float:
    """The largest value of `dtype` below the positive normal `v`."""
    int_dtype = torch.int16 if dtype in (torch.bfloat16, torch.float16) else torch.int32
    return (torch.tensor([v], dtype=dtype).view(int_dtype) - 1).view(dtype).item()


def _next_up(v: float, dtype) -> float:
    int_dtype = torch.int16 if dtype in (torch.bfloat16, torch.float16) else torch.int32
    return (torch.tensor([v], dtype=dtype).view(int_dtype) + 1).view(dtype).item()


def crafted_blocks(dtype) -> dict:
    """Named 32-element blocks that probe every branch of the scale rule and the encoder."""
    info = torch.finfo(dtype)
    sub = _next_up(0.0, dtype)  # smallest subnormal: 2^-149 (FP32), 2^-133 (BF16)
    ramp = torch.arange(1, 33, dtype=torch.float64)
    signs = torch.tensor([1.0, -1.0]).repeat(16).double()
    blocks = {
        "zeros": torch.zeros(32),
        "negative_zeros": torch.full((32,), -0.0),
        "signed_zeros": signs * 0.0,
        "smallest_subnormal": torch.full((32,), sub) * signs,
        "subnormal_ramp": ramp * sub * signs,
        "max_is_subnormal": torch.cat((torch.full((31,), sub), torch.tensor([_next_down(info.tiny, dtype)]))),
        "smallest_normal": torch.full((32,), info.tiny),
        "floor_code0_scale": torch.cat((torch.tensor([2.0**-120]), ramp[1:] * 2.0**-126)),  # floor code 0
        "rceil_code0_scale": torch.full((32,), 448 * 2.0**-128) * signs,  # descale 2^-128 -> code 0
        "rceil_just_above_code0": torch.full((32,), _next_up(448 * 2.0**-127, dtype)),
        "saturates_480": torch.cat((torch.tensor([480.0, -479.0]), torch.ones(30))),
        "saturates_below_512": torch.cat((torch.tensor([_next_down(512.0, dtype)]), ramp[1:])),
        "fp8_max": torch.full((32,), 448.0) * signs,
        "dtype_max": torch.full((32,), info.max) * signs,
        "full_exponent_range": torch.exp2(torch.linspace(-133 if dtype == torch.bfloat16 else -149, 127, 32).round()) * signs,
        "mixed_tiny_and_huge": torch.tensor([2.0**-100, 2.0**100] * 16),
    }
    for k in (-120, -20, 0, 8, 9, 100):  # amax exactly at / just below a power of two
        blocks[f"amax_pow2_{k}"] = torch.cat((torch.tensor([2.0**k]), ramp[1:] / 64 * 2.0**k))
        blocks[f"amax_below_pow2_{k}"] = torch.cat((torch.tensor([_next_down(2.0**k, dtype)]), ramp[1:] / 64 * 2.0**k))
    for k in (-100, 0, 20, 100):  # amax exactly 448 * 2^k and just above (rceil's ceil boundary)
        blocks[f"amax_448_pow2_{k}"] = torch.full((32,), 448 * 2.0**k)
        blocks[f"amax_above_448_pow2_{k}"] = torch.full((32,), _next_up(448 * 2.0**k, dtype))
    return {name: b.to(dtype) for name, b in blocks.items()}


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_crafted_blocks_match_to_mx(tao, mode, dtype):
    blocks = crafted_blocks(dtype)
    x = torch.stack(list(blocks.values()))  # one block per row
    data, scales = R.mxfp8_quantize(x, -1, mode)
    ref_data, ref_scales = to_mx_1x32(tao, x, mode)
    differ = [name for i, name in enumerate(blocks)
              if not (torch.equal(_bytes(scales[i]), _bytes(ref_scales[i]))
                      and torch.equal(_bytes(data[i]), _bytes(ref_data[i])))]
    expected = CRAFTED_018_DIFFERENCES[(dtype, mode)]
    assert differ == list(expected)  # every other crafted block: 0.18's bytes exactly
    classes = difference_classes(x, mode)
    names = list(blocks)
    for name, cls in expected.items():
        assert classes[cls][names.index(name)], (name, cls)


_CODE0_FP32 = ("max_is_subnormal", "smallest_normal", "floor_code0_scale", "rceil_code0_scale",
               "rceil_just_above_code0", "amax_pow2_-120", "amax_below_pow2_-120")
_CODE0_BF16 = ("smallest_subnormal", "subnormal_ramp") + _CODE0_FP32
# The crafted blocks where 0.18 differs, in crafted_blocks order, with their class. (FP32's
# rceil_just_above_code0, 448 * 2^-127 + 1 ulp, is code 0 under both; BF16 holds no such value.)
CRAFTED_018_DIFFERENCES = {
    (torch.float32, "floor"): dict.fromkeys(_CODE0_FP32, "floor_code0"),
    (torch.float32, "rceil"): {**dict.fromkeys(_CODE0_FP32, "rceil_code0"),
                               **dict.fromkeys(("amax_above_448_pow2_-100", "amax_above_448_pow2_20",
                                                "amax_above_448_pow2_100"), "rceil_log2")},
    (torch.bfloat16, "floor"): dict.fromkeys(_CODE0_BF16, "floor_code0"),
    (torch.bfloat16, "rceil"): dict.fromkeys(tuple(n for n in _CODE0_BF16 if n != "rceil_just_above_code0"),
                                             "rceil_code0"),
}

# One block per class with both byte sets worked by hand: (mode, amax, 0.18's code and element
# byte, the contract's code and element byte).
DIFFERENCES = [
    # floor_code0: amax 2^-120 -> code 0 (2^-127). 0.18 multiplies by 2^126: 2^-120 * 2^126 = 64
    # = 0x68; the contract by 2^127: 128 = 0x70.
    ("floor", 2.0**-120, 0, 0x68, 0, 0x70),
    # rceil_code0: descale 2^-130 * fl32(1/448) < 2^-127 -> code 0. 0.18 leaves 2^-130 unscaled:
    # 0x00; the contract: 2^-130 * 2^127 = 0.125 = 2^(4 - 7) = 0x20.
    ("rceil", 2.0**-130, 0, 0x00, 0, 0x20),
    # rceil_log2: amax one FP32 ulp above 448 * 2^20 -> descale 2^20 (1 + ~2^-23). 0.18's FP32
    # log2 gives 20.0: code 147, and the element saturates at 448 = 0x7E; the contract rounds up
    # to 2^21: code 148, 224.00003 -> 224 = 0x76.
    ("rceil", _next_up(448 * 2.0**20, torch.float32), 147, 0x7E, 148, 0x76),
]


@pytest.mark.parametrize("mode,amax,code_018,elem_018,code,elem", DIFFERENCES)
def test_documented_018_differences_worked(tao, mode, amax, code_018, elem_018, code, elem):
    x = torch.full((1, 32), amax)
    data, scales = R.mxfp8_quantize(x, -1, mode)
    ref_data, ref_scales = to_mx_1x32(tao, x, mode)
    assert _bytes(ref_scales).item() == code_018 and (_bytes(ref_data) == elem_018).all()
    assert _bytes(scales).item() == code and (_bytes(data) == elem).all()
    assert documented_018_differences(x, mode).item()


# ------------------------------------------------------------------------------------------------
# NaN and Inf (torchao's refined semantics, pytorch/ao PR 4725)
# ------------------------------------------------------------------------------------------------

def _nonfinite_input(dtype):
    """Rows: NaN, +Inf, -Inf in a block of ones, an all-NaN block, then a finite block of ones.
    Expected by hand: non-finite blocks -> scale 0xFF and 0x7F everywhere. The finite block:
    amax 1.0 -> floor 0 - 8 = -8 / rceil ceil(log2(1/448)) = ceil(-8.8) = -8 -> code 119, and
    1.0 * 2^8 = 256 -> 0 1111 000 = 0x78."""
    x = torch.ones(5, 32)
    x[0, 3], x[1, 3], x[2, 3] = float("nan"), float("inf"), float("-inf")
    x[3] = float("nan")
    return x.to(dtype)


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_nonfinite_blocks_hand_derived(mode, dtype):
    x = _nonfinite_input(dtype)
    expected_scales = [E8M0_NAN] * 4 + [119]
    data, scales = R.mxfp8_quantize(x, -1, mode)
    assert _bytes(scales).flatten().tolist() == expected_scales
    assert (_bytes(data[:4]) == E4M3_NAN).all() and (_bytes(data[4]) == 0x78).all()
    # the same blocks along M (32x1) and along N (3D)
    data, scales = R.mxfp8_quantize(x.t().contiguous(), 0, mode)
    assert _bytes(scales).flatten().tolist() == expected_scales
    assert (_bytes(data.t()[:4]) == E4M3_NAN).all() and (_bytes(data.t()[4]) == 0x78).all()
    data, scales = R.mxfp8_quantize_3d(x.t().contiguous().unsqueeze(0), mode)
    assert _bytes(scales).flatten().tolist() == expected_scales


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_torchao_018_differs_on_nonfinite(tao, dtype):
    """torchao 0.18 predates PR 4725. Rows as in _nonfinite_input (NaN, +Inf, -Inf, all NaN):
    floor gives +-Inf blocks the scale 0xF7 (Inf's exponent field 255 - 8) and keeps the Inf as
    +-448 (0x7E/0xFE) with the ones flushed to 0; NaN blocks get 0xFF but only the NaN element is
    a NaN byte. rceil gives Inf blocks 0xFE (and +-448), NaN blocks all-NaN like the new rule."""
    x = _nonfinite_input(dtype)[:4]
    data, scales = to_mx_1x32(tao, x, "floor")
    assert _bytes(scales).flatten().tolist() == [0xFF, 0xF7, 0xF7, 0xFF]
    assert _bytes(data[1, 3]).item() == 0x7E and _bytes(data[2, 3]).item() == 0xFE
    assert (_bytes(data[:3, :3]) == 0x00).all()  # finite elements of NaN/Inf blocks: 0, not NaN
    data, scales = to_mx_1x32(tao, x, "rceil")
    assert _bytes(scales).flatten().tolist() == [0xFF, 0xFE, 0xFE, 0xFF]
    assert _bytes(data[1, 3]).item() == 0x7E and (_bytes(data[1, :3]) == 0x00).all()
    assert (_bytes(data[0]) == E4M3_NAN).all()  # here 0.18 already agrees


# ------------------------------------------------------------------------------------------------
# 3D, dual, layouts
# ------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("scale_block_k", [1, 32])
def test_3d_matches_torchao_reference(tao, mode, scale_block_k):
    w = _wide_random((2, 64, 96), torch.bfloat16, seed=13)  # E=2, N = 2 blocks, K = 3 blocks of 32
    data, scales = R.mxfp8_quantize_3d(w, mode, scale_block_k)
    ref_data, ref_scales = tao.moe._mxfp8_quantize_reference_3d(
        w, block_size=32, scale_block_dim1=32, scale_block_dim2=scale_block_k, scaling_mode=mode,
        blocked_scale_output=False,
    )
    if scale_block_k == 32:
        ref_scales = ref_scales.squeeze(-1)  # torchao's 32x32 reference keeps a trailing 1
    assert data.shape == (2, 64, 96) and data.stride() == (64 * 96, 1, 64)
    assert scales.shape == ((2, 2, 96) if scale_block_k == 1 else (2, 2, 3))
    assert_bytes(data, ref_data)
    assert_bytes(scales, ref_scales)


def test_dual_is_both_orientations():
    x = _wide_random((64, 96), torch.bfloat16, seed=14)
    (d0, s0), (d1, s1) = R.mxfp8_quantize_dual(x, "rceil")
    for a, b in zip((d0, s0, d1, s1), R.mxfp8_quantize(x, -1) + R.mxfp8_quantize(x, 0)):
        assert_bytes(a, b)
    assert d1.stride() == (1, 64)


@pytest.mark.parametrize("mode", MODES)
def test_tcgen05_layouts_match_torchao(tao, mode):
    x = _wide_random((200, 160), torch.bfloat16, seed=15)  # M, K/32 = 5 and M/32 not tile multiples: padding
    plain = R.mxfp8_quantize(x, -1, mode)[1]
    _, blocked = R.mxfp8_quantize(x, -1, mode, scale_layout="tcgen05")
    assert blocked.shape == (256, 8)  # torchao's 1x32 shape (ceil(M/128)*128, ceil(K/32/4)*4)
    assert torch.equal(_bytes(blocked).flatten(), tao.to_blocked(_bytes(plain)))
    x = x[:192]  # 32x1 needs M % 32 == 0
    plain = R.mxfp8_quantize(x, 0, mode)[1]  # (160, 6)
    _, blocked = R.mxfp8_quantize(x, 0, mode, scale_layout="tcgen05")
    assert blocked.shape == (256 * 8,)  # torchao's 32x1 shape: flat
    assert torch.equal(_bytes(blocked), tao.to_blocked(_bytes(plain)))


@pytest.mark.parametrize("scale_block_k", [1, 32])
def test_tcgen05_3d_matches_torchao(tao, scale_block_k):
    w = _wide_random((2, 160, 64), torch.float32, seed=16)  # N/32 = 5: padded to 8 columns
    plain = R.mxfp8_quantize_3d(w, "rceil", scale_block_k)[1]
    _, blocked = R.mxfp8_quantize_3d(w, "rceil", scale_block_k, scale_layout="tcgen05")
    ref = tao.moe._to_blocked_per_group_3d_layout(plain, scale_block_dim2=scale_block_k)
    assert blocked.shape == ref.shape == (2, 128 * 8)
    assert_bytes(blocked, ref)


def test_tcgen05_with_offs_is_torchaos_per_group_layout(tao):
    offs = torch.tensor([128, 128, 384, 512], dtype=torch.int32)  # includes an empty group
    x = _wide_random((512, 256), torch.bfloat16, seed=17)
    # 32x1: groups along M are scale-column groups of the (K, M/32) matrix
    plain = R.mxfp8_quantize(x, 0)[1]
    _, blocked = R.mxfp8_quantize(x, 0, scale_layout="tcgen05", offs=offs)
    ref, _ = tao.moe.torch_to_blocked_2d_K_groups(_bytes(plain), offs.long() // 32)
    ref = ref.flatten()
    assert torch.equal(_bytes(blocked), ref[: blocked.numel()]) and (ref[blocked.numel():] == 0).all()
    assert not torch.equal(_bytes(blocked), tao.to_blocked(_bytes(plain)))  # differs from the global layout
    # 1x32: groups along rows; with 128-multiple groups the per-group layout is the global one
    plain = R.mxfp8_quantize(x, -1)[1]
    _, blocked = R.mxfp8_quantize(x, -1, scale_layout="tcgen05", offs=offs)
    ref, _ = tao.moe.torch_to_blocked_2d_M_groups(_bytes(plain), offs.long())
    assert torch.equal(_bytes(blocked), ref[:512])


def test_mfma_layouts_are_aiters_e8m0_shuffle():
    aiter = oracles.aiter_fp4_utils()

    def aiter_shuffle_zero_padded(s):  # aiter leaves the padding uninitialised; ours is zero
        rows, cols = s.shape
        padded = torch.zeros((rows + 255) // 256 * 256, (cols + 7) // 8 * 8, dtype=U8)
        padded[:rows, :cols] = _bytes(s)
        return aiter.e8m0_shuffle(padded.view(torch.float8_e8m0fnu))

    x = _wide_random((288, 320), torch.bfloat16, seed=18)  # rows pad 288 -> 512, K/32 = 10 -> 16
    for axis in (-1, 0):
        plain = R.mxfp8_quantize(x, axis)[1]
        shuffled = R.mxfp8_quantize(x, axis, scale_layout="mfma")[1]
        assert_bytes(shuffled, aiter_shuffle_zero_padded(plain))
    w = _wide_random((2, 64, 96), torch.bfloat16, seed=19)
    for sbk in (1, 32):
        plain = R.mxfp8_quantize_3d(w, "rceil", sbk)[1]
        shuffled = R.mxfp8_quantize_3d(w, "rceil", sbk, scale_layout="mfma")[1]
        assert shuffled.shape == (2, 256, 8)
        for e in range(2):  # per expert, the (K, N/32) transpose, one row per K even for 32x32
            assert_bytes(shuffled[e], aiter_shuffle_zero_padded(plain[e].t().repeat_interleave(sbk, 0)))


@pytest.mark.parametrize("layout", [None, "tcgen05", "mfma"])
def test_empty_outputs_match_real_ones(layout):
    x = torch.randn(256, 96)
    for axis in (-1, 0):
        real, fake = R.mxfp8_quantize(x, axis, scale_layout=layout), R.mxfp8_quantize_empty(x, axis, layout)
        for a, b in zip(real, fake):
            assert (a.shape, a.stride(), a.dtype) == (b.shape, b.stride(), b.dtype)
    w = torch.randn(2, 64, 96)
    for sbk in (1, 32):
        real, fake = R.mxfp8_quantize_3d(w, "rceil", sbk, layout), R.mxfp8_quantize_3d_empty(w, sbk, layout)
        for a, b in zip(real, fake):
            assert (a.shape, a.stride(), a.dtype) == (b.shape, b.stride(), b.dtype)


# ------------------------------------------------------------------------------------------------
# dequantize
# ------------------------------------------------------------------------------------------------


def test_dequantize_matches_torchao_to_dtype(tao):
    x = _wide_random((64, 128), torch.float32, seed=20)
    data, scales = R.mxfp8_quantize(x, -1, "floor")
    expected = tao.to_dtype(data, scales, torch.float8_e4m3fn, 32, torch.float32)
    torch.testing.assert_close(R.mxfp8_dequantize(data, scales, -1), expected, rtol=0, atol=0, equal_nan=True)
    # 32x1 and 3D dequantize to the same values as the 1x32 dequantize of the transposed data
    data0, scales0 = R.mxfp8_quantize(x, 0, "floor")
    data1, scales1 = R.mxfp8_quantize(x.t().contiguous(), -1, "floor")
    torch.testing.assert_close(R.mxfp8_dequantize(data0, scales0, 0), R.mxfp8_dequantize(data1, scales1, -1).t())
    d3, s3 = R.mxfp8_quantize_3d(x.unsqueeze(0), "floor")
    torch.testing.assert_close(R.mxfp8_dequantize(d3, s3, 1)[0], R.mxfp8_dequantize(data0, scales0, 0), rtol=0, atol=0)


def test_dequantize_3d_32x32_blocks():
    """3D data with one scale per 32x32 tile (scale_block_k=32): each tile is its codes times its
    own scale, the tiles along K differing by 2^10 so that a scale taken from the wrong tile shows."""
    w = torch.randn(2, 64, 96, generator=torch.Generator().manual_seed(21))
    w[..., 32:64] *= 1024
    data, scales = R.mxfp8_quantize_3d(w, "floor", scale_block_k=32)
    assert scales.shape == (2, 2, 3)
    got = R.mxfp8_dequantize(data, scales, 1)
    for e in range(2):
        for i in range(2):
            for j in range(3):
                tile = data[e, 32 * i:32 * i + 32, 32 * j:32 * j + 32].float()
                scale = 2.0 ** (scales[e, i, j].view(U8).item() - 127)
                assert torch.equal(got[e, 32 * i:32 * i + 32, 32 * j:32 * j + 32], tile * scale), (e, i, j)


@pytest.mark.parametrize("axis", [-1, 0])
def test_unsigned_zeros_are_the_signed_bytes_without_minus_zero(axis):
    """signed_zeros=False (both orientations): the data bytes of the signed quantize with every -0
    (0x80) written as +0, the scales unchanged; x holds -0.0 and negatives that round to -0."""
    x = _wide_random((64, 64), torch.float32, seed=22)
    x[::3, ::5] = -0.0
    x[1::4, ::7] = -1e-30
    signed = R.mxfp8_quantize(x, axis, "floor")
    unsigned = R.mxfp8_quantize(x, axis, "floor", signed_zeros=False)
    want = _bytes(signed[0]).clone()
    assert (want == 0x80).sum() > 0
    want[want == 0x80] = 0
    assert_bytes(unsigned[0], want)
    assert unsigned[0].stride() == signed[0].stride()
    assert_bytes(unsigned[1], signed[1])


def test_dequantize_code0_is_2_pow_minus_127():
    data = torch.full((1, 32), 1.0).to(torch.float8_e4m3fn)
    scales = torch.zeros(1, 1, dtype=U8).view(torch.float8_e8m0fnu)
    assert (R.mxfp8_dequantize(data, scales) == 2.0**-127).all()
    scales = torch.full((1, 1), 0xFF, dtype=U8).view(torch.float8_e8m0fnu)
    assert R.mxfp8_dequantize(data, scales).isnan().all()


# ------------------------------------------------------------------------------------------------
# bad input
# ------------------------------------------------------------------------------------------------

BAD_2D = [
    (torch.zeros(64, 64, dtype=torch.int32), {}, TypeError, "dtype"),
    (torch.zeros(64, 64, dtype=torch.float64), {}, TypeError, "dtype"),
    ([[1.0]], {}, TypeError, "torch.Tensor"),
    (torch.zeros(2, 64, 64), {}, ValueError, "2D"),
    (torch.zeros(64, 48), {}, ValueError, r"K, quantized in blocks of 32\) = 48"),
    (torch.zeros(48, 64), {"axis": 0}, ValueError, r"M, quantized in blocks of 32\) = 48"),
    (torch.zeros(32, 0), {}, ValueError, r"K, quantized in blocks of 32\) = 0 must be a positive"),
    (torch.zeros(0, 64), {"axis": 0}, ValueError, r"M, quantized in blocks of 32\) = 0 must be a positive"),
    (torch.zeros(64, 64), {"axis": 2}, ValueError, "axis"),
    (torch.zeros(64, 64), {"scaling_mode": "ceil"}, ValueError, "scaling_mode"),
    (torch.zeros(64, 64), {"scale_layout": "blocked"}, ValueError, "scale_layout"),
    (torch.zeros(256, 64), {"offs": torch.tensor([128, 256])}, TypeError, "offs must have dtype"),
    (torch.zeros(256, 64), {"offs": torch.tensor([128, 200], dtype=torch.int32)}, ValueError, "offs\\[-1\\] must equal M"),
    (torch.zeros(256, 64), {"offs": torch.tensor([100, 256], dtype=torch.int32)}, ValueError, "multiple of 128"),
    (torch.zeros(256, 64), {"offs": torch.tensor([256, 128, 256], dtype=torch.int32)}, ValueError, "non-decreasing"),
]


@pytest.mark.parametrize("x,kwargs,exc,match", BAD_2D)
def test_bad_2d_input_raises(x, kwargs, exc, match):
    with pytest.raises(exc, match=match):
        R.mxfp8_quantize(x, **kwargs)


def test_bad_3d_and_dequantize_input_raises():
    with pytest.raises(ValueError, match="3D"):
        R.mxfp8_quantize_3d(torch.zeros(64, 64))
    with pytest.raises(ValueError, match=r"N, quantized in blocks of 32\) = 40"):
        R.mxfp8_quantize_3d(torch.zeros(2, 40, 64))
    with pytest.raises(ValueError, match=r"K, quantized in blocks of 32\) = 40"):
        R.mxfp8_quantize_3d(torch.zeros(2, 64, 40), scale_block_k=32)
    with pytest.raises(ValueError, match="scale_block_k"):
        R.mxfp8_quantize_3d(torch.zeros(2, 64, 64), scale_block_k=16)
    with pytest.raises(ValueError, match=r"N, quantized in blocks of 32\) = 0 must be a positive"):
        R.mxfp8_quantize_3d(torch.zeros(1, 0, 32))
    with pytest.raises(ValueError, match=r"M, quantized in blocks of 32\) = 40"):
        R.mxfp8_quantize_dual(torch.zeros(40, 64))
    data = torch.zeros(64, 64, dtype=torch.float8_e4m3fn)
    with pytest.raises(ValueError, match="scales must have shape"):
        R.mxfp8_dequantize(data, torch.zeros(64, 3, dtype=torch.float8_e8m0fnu))
    with pytest.raises(TypeError, match="scales must have dtype"):
        R.mxfp8_dequantize(data, torch.zeros(64, 2))
