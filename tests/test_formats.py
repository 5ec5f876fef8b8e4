"""flyquant.formats: element encoders, E8M0, FP4 packing and the MX scale rule.

Expected bits come from hand derivation (tables below), from Python's exact float arithmetic,
or from independent oracles (torch's own float8 cast, torchao's FP4 encoder, FP32 torch.log2).
"""

import math

import pytest
import torch

from flyquant import formats as F

from oracles import torchao

INF, NAN = float("inf"), float("nan")


def _bits_to_f32(bits) -> torch.Tensor:
    return torch.tensor(bits, dtype=torch.int64).to(torch.int32).view(torch.float32)


# ------------------------------------------------------------------------------------------------
# E8M0
# ------------------------------------------------------------------------------------------------


def test_e8m0_decode_every_code():
    codes = torch.arange(256, dtype=torch.int32).to(torch.uint8)
    got = F.e8m0_decode(codes)
    for c in range(255):
        # code c is 2^(c - 127); 2^-127 (code 0) is an FP32 subnormal, exactly representable
        assert got[c].item() == math.ldexp(1.0, c - 127), c
    assert math.isnan(got[255].item())
    # the float8_e8m0fnu view decodes the same
    assert torch.equal(F.e8m0_decode(codes.view(torch.float8_e8m0fnu))[:255], got[:255])


def test_e8m0_encode_clamps_to_representable_exponents():
    exps = torch.tensor([-200, -128, -127, -1, 0, 1, 127, 128, 300])
    assert F.e8m0_encode(exps).tolist() == [0, 0, 0, 126, 127, 128, 254, 254, 254]


# ------------------------------------------------------------------------------------------------
# FP8 E4M3
# ------------------------------------------------------------------------------------------------

# (value, expected byte), derived by hand: E4M3 = s eeee mmm, bias 7, subnormal step 2^-9.
E4M3_TABLE = [
    (0.0, 0x00),
    (-0.0, 0x80),
    (1.0, 0x38),  # exponent 7 + 0 = 0b0111, mantissa 0
    (-2.5, 0xC2),  # 2.5 = 1.25 * 2^1: exponent 8 = 0b1000, mantissa 0b010
    (448.0, 0x7E),  # 1.75 * 2^8: exponent 15, mantissa 0b110 (0b111 is NaN)
    (-448.0, 0xFE),
    (464.0, 0x7E),  # halfway to 480 (not representable): saturates
    (1e30, 0x7E),  # saturation
    (INF, 0x7E),  # saturation, not NaN
    (-INF, 0xFE),
    (NAN, 0x7F),
    (2.0**-6, 0x08),  # smallest normal
    (2.0**-9, 0x01),  # smallest subnormal
    (2.0**-10, 0x00),  # half the smallest subnormal: tie to even (0)
    (3 * 2.0**-10, 0x02),  # 1.5 steps: tie to even (2)
    (-(2.0**-12), 0x80),  # underflow keeps the sign
    (1.0625, 0x38),  # 1 + 1/16 is halfway between 1 and 1.125: tie to even (mantissa 0)
    (1.1875, 0x3A),  # 1 + 3/16: halfway between 1.125 and 1.25: tie to even (mantissa 2)
    (15.5 * 2.0**-9, 0x10),  # 7.75 steps rounds up across into the normal 2^-5 (0x10)
]


@pytest.mark.parametrize("value,expected", E4M3_TABLE)
def test_e4m3_encode_table(value, expected):
    assert F.e4m3_encode(torch.tensor([value])).item() == expected


def test_e4m3_encode_matches_torch_cast_on_every_bf16_and_random_fp32():
    # every BF16 bit pattern (finite, clamped into range where torch's cast is defined as ours)
    bf16 = torch.arange(1 << 16, dtype=torch.int32).to(torch.int16).view(torch.bfloat16).float()
    bf16 = bf16[torch.isfinite(bf16)].clamp(-F.E4M3_MAX, F.E4M3_MAX)
    # random FP32 bit patterns in range: all exponents, all mantissa bits (2^20 values: < 1 s)
    gen = torch.Generator().manual_seed(0)
    raw = torch.randint(0, 1 << 31, (1 << 20,), generator=gen, dtype=torch.int64).to(torch.int32).view(torch.float32)
    raw = raw[torch.isfinite(raw)].clamp(-F.E4M3_MAX, F.E4M3_MAX)
    for x in (bf16, raw, -raw):
        assert torch.equal(F.e4m3_encode(x), x.to(torch.float8_e4m3fn).view(torch.uint8))


# ------------------------------------------------------------------------------------------------
# FP4 E2M1
# ------------------------------------------------------------------------------------------------

# (value, expected code): E2M1 = s ee m, bias 1, grid {0, .5, 1, 1.5, 2, 3, 4, 6} = codes 0..7.
E2M1_TABLE = [
    (0.0, 0x0), (-0.0, 0x8), (0.5, 0x1), (1.0, 0x2), (6.0, 0x7), (-6.0, 0xF),
    (0.25, 0x0),  # tie between 0 and 0.5: even (0)
    (0.75, 0x2),  # tie between 0.5 (code 1) and 1.0 (code 2): even
    (1.25, 0x2),  # tie between 1.0 (2) and 1.5 (3): even
    (1.75, 0x4),  # tie between 1.5 (3) and 2.0 (4): even
    (2.5, 0x4),  # tie between 2 (4) and 3 (5)
    (3.5, 0x6),  # tie between 3 (5) and 4 (6)
    (5.0, 0x6),  # tie between 4 (6) and 6 (7): even = 4
    (5.5, 0x7),
    (7.0, 0x7), (1e9, 0x7), (INF, 0x7), (-INF, 0xF),  # saturation
    (NAN, F.E2M1_NAN_BLOCK_CODE),
]


@pytest.mark.parametrize("value,expected", E2M1_TABLE)
def test_e2m1_encode_table(value, expected):
    assert F.e2m1_encode(torch.tensor([value])).item() == expected


def test_e2m1_encode_matches_torchao_on_a_dense_grid():
    f32_to_f4_unpacked = torchao().f32_to_f4_unpacked
    # every multiple of 2^-6 in [-8, 8] (hits all ties) plus random magnitudes over many binades
    grid = torch.arange(-512, 513, dtype=torch.float32) / 64
    gen = torch.Generator().manual_seed(1)
    rand = torch.randn(1 << 16, generator=gen) * torch.exp2(torch.randint(-12, 6, (1 << 16,), generator=gen).float())
    for x in (grid, rand):
        assert torch.equal(F.e2m1_encode(x), f32_to_f4_unpacked(x))


def test_e2m1_decode_and_pack_order():
    codes = torch.arange(16, dtype=torch.uint8)
    assert F.e2m1_decode(codes).tolist() == list(F.E2M1_VALUES) + [-v for v in F.E2M1_VALUES]
    # element 0 in the low nibble: [1, 2, 3, 4] -> 0x21, 0x43
    assert F.pack_fp4(torch.tensor([[1, 2, 3, 4]], dtype=torch.uint8)).tolist() == [[0x21, 0x43]]
    every_byte = torch.arange(256, dtype=torch.int32).to(torch.uint8)
    assert torch.equal(F.pack_fp4(F.unpack_fp4(every_byte)), every_byte)


# ------------------------------------------------------------------------------------------------
# The MX scale rule
# ------------------------------------------------------------------------------------------------


def test_e8m0_reciprocal_every_code():
    codes = torch.arange(256, dtype=torch.int32).to(torch.uint8)
    got = F.e8m0_reciprocal(codes)
    for c in range(255):  # 2^(127 - c): code 0 -> 2^127, code 254 -> the FP32 subnormal 2^-127
        assert got[c].item() == math.ldexp(1.0, 127 - c), c
    assert math.isnan(got[255].item())


E4M3_RCEIL_TIE = 0x04600001  # 1.75 * 2^-119 * (1 + 2^-23): kernels/_mx_common.RCEIL_SUBNORMAL_TIE


@pytest.mark.parametrize("exp_field", list(range(0, 12)) + [100, 127, 135, 136, 200, 254])
def test_rceil_is_an_amax_mantissa_threshold(exp_field):
    """The kernels' rceil rule on amax's FP32 bits, code = max(eb - 8 + [mantissa > 0x600000], 0)
    except code 0 for amax 0x04600001, equals the contract's e8m0_rceil(amax * fl32(1/448)) for
    every amax with this exponent field (all 2^23 mantissas). Normal descales (eb >= 10) scale
    exactly by powers of two, so the binades listed stand for all; eb <= 9 are the subnormal
    descales (eb = 8 holds the one exception)."""
    mant = torch.arange(1 << 23, dtype=torch.int32)
    bits = (exp_field << 23) | mant
    amax = bits.view(torch.float32)
    want = F.e8m0_rceil(amax * F.f32_reciprocal(F.E4M3_MAX)).to(torch.int32)
    rule = (exp_field - 8 + (mant > 0x600000).to(torch.int32)).clamp(min=0)
    rule = torch.where(bits == E4M3_RCEIL_TIE, 0, rule)
    assert torch.equal(rule, want)


@pytest.mark.parametrize("mode,amax,code,mult", [
    ("floor", 2.0**-120, 0, 2.0**127),  # eb 7: code 0 is 2^-127, the multiplier 2^127
    ("floor", 0.0, 0, 2.0**127),
    ("rceil", 448 * 2.0**-127, 0, 2.0**127),  # descale exactly 2^-127
    ("rceil", 449 * 2.0**-127, 1, 2.0**126),  # just above: code 1
    ("rceil", 3.0 * 2.0**126, 246, 2.0**-119),
])
def test_mx_scale_contract_codes_and_multipliers(mode, amax, code, mult):
    c, m = F.mx_scale(torch.tensor([amax]), mode)
    assert c.item() == code and m.item() == mult


@pytest.mark.parametrize("mode,amax,code", [
    # E2M1 (max 6 = 1.5 * 2^2). floor: field - 2. 1.7 = 1.7 * 2^0 -> 125.
    ("floor", 1.7, 125),
    # even: + 2^21 carries from mantissa 0.75: 1.7 (0.7) stays -> 125; 1.75 -> 2^1 -> 126.
    ("even", 1.7, 125), ("even", 1.75, 126), ("even", 1.5, 125),
    # rceil: 1.7 * fl32(1/6) = 0.2833 -> 2^-1 -> 126; 6 * fl32(1/6) rounds to exactly 1 -> 127.
    ("rceil", 1.7, 126), ("rceil", 6.0, 127), ("rceil", 1.5, 125),
    # code 0 is 2^-127 (floor/even field <= 2; rceil descale <= 2^-127)
    ("floor", 2.0**-125, 0), ("even", 1.75 * 2.0**-126, 0), ("rceil", 6 * 2.0**-127, 0),
    # even: the largest finite FP32 rounds to field 255 -> code 253 (not NaN: the block is finite)
    ("even", 3.4028234663852886e38, 253), ("floor", 3.4028234663852886e38, 252),
])
def test_mx_scale_e2m1_codes(mode, amax, code):
    c, m = F.mx_scale(torch.tensor([amax]), mode, F.E2M1)
    assert c.item() == code and m.item() == math.ldexp(1.0, 127 - code)


def test_even_is_an_mxfp4_mode():
    with pytest.raises(ValueError, match="scaling_mode"):
        F.mx_scale(torch.ones(1), "even", F.E4M3)


@pytest.mark.parametrize("mode", F.SCALING_MODES)
def test_mx_scale_worked_block(mode):
    """A block worked by hand: amax 3.0 (others 1.0).
    floor: 3.0 = 1.5 * 2^1 -> floor(log2) = 1, minus E4M3's max power 8 -> scale 2^-7, code 120.
    rceil: 3 / 448 = 0.0067 = 2^-7.2 -> ceil = -7 -> code 120 too.
    Elements x * 2^7: 3.0 -> 384 = 1.5 * 2^8 -> 0 1111 100 = 0x7C; 1.0 -> 128 = 2^7 -> 0x70."""
    block = torch.ones(1, 32)
    block[0, 5] = 3.0
    code, elems = F.mx_quantize_blocks(block, mode, F.E4M3)
    assert code.tolist() == [120]
    assert elems[0, 5].item() == 0x7C
    assert (elems[0, torch.arange(32) != 5] == 0x70).all()


def test_mx_scale_rejects_unknown_mode():
    with pytest.raises(ValueError, match="scaling_mode"):
        F.mx_scale(torch.ones(1), "ceil")
