"""torchao main's MXFP8 bitwise contract (pytorch/ao PR 4725), as a table, on flyquant.reference
and on every MXFP8 quantize kernel variant, both arches, every input dtype, every scale layout.

The contract, one block of 32 values x (flyquant.formats states it in full):
- amax = max |x| in FP32; a NaN or Inf anywhere: scale 0xFF, every element NaN (0x7F);
- floor: scale code = max(FP32 exponent field of amax - 8, 0);
- rceil: descale = amax * fl32(1/448) (FP32), rounded up to a power of two from its own FP32
  bits: a normal rounds up when any mantissa bit is set, a subnormal is code 0 up to 2^-127;
- elements: e4m3(x * 2^(127 - code)), round to nearest even, saturating at +-448; code 0 is
  2^-127 and is used like any other code.

Each row of CASES is one block; its expected bytes are derived by hand from those rules (the
comment says how). torchao's own table covers BF16 and FP32; FP16 rows are ours, by the same
rules. torchao accepts either NaN byte (0x7F, 0xFF) for a NaN element; flyquant writes 0x7F,
and so this table asks for 0x7F.

Worked row (rceil, FP32, 3.5 + 1 ulp = 0x40600001): amax * fl32(1/448) = 2^-7 * (1 + ~2^-23),
a mantissa bit set, so the scale rounds up to 2^-6 (code 121) and 3.5 * 2^6 = 224.00003 -> 224
(0x76). A BF16 or FP16 input holds exactly 3.5 there: descale 2^-7, code 120, 448 (0x7E).

Every kernel variant runs the same blocks laid out as 32 x 32 Latin squares (tile[i][j] =
block[(i + j) % 32]), so every row, column and 32 x 32 tile of a case holds that case's 32
values: one tensor serves 1x32, 32x1, dual and 3D (scale_block_k 1 and 32) alike.
"""

from __future__ import annotations

import pytest
import torch

from flyquant import formats, layouts
from flyquant import reference as R
from flyquant.kernels import mxfp8_quantize_2d as q2
from flyquant.kernels import mxfp8_quantize_3d as q3

ARCHS = ("gfx950", "gfx942")
MODES = ("floor", "rceil")
DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}
LAYOUTS = (None, "tcgen05", "mfma")
BLOCK = 32
U8 = torch.uint8
NAN = float("nan")
INF = float("inf")


def _from_f32_bits(bits: int, dtype) -> float:
    """The FP32 with these bits, rounded to `dtype` (nearest even)."""
    return torch.tensor([bits], dtype=torch.int32).view(torch.float32).to(dtype).item()


def _smallest_subnormal(dtype) -> float:
    width = torch.finfo(dtype).bits
    int_dtype = torch.int16 if width == 16 else torch.int32
    return torch.tensor([1], dtype=int_dtype).view(dtype).item()


def fill(value):
    """All 32 elements `value` (a float, or a function of the dtype)."""
    return lambda dtype: [value(dtype) if callable(value) else value] * BLOCK


def first(value, rest):
    """Element 0 `value`, the other 31 `rest` (floats, or functions of the dtype)."""
    def make(dtype):
        v0 = value(dtype) if callable(value) else value
        v = rest(dtype) if callable(rest) else rest
        return [v0] + [v] * (BLOCK - 1)
    return make


def tiny(dtype):
    return torch.finfo(dtype).tiny


def dmax(dtype):
    return torch.finfo(dtype).max


def neg(f):
    return lambda dtype: -f(dtype)


sub = _smallest_subnormal

# name, the block (function of the dtype), expected {selector: (scale code, byte of element 0,
# byte of elements 1..31)}. Selectors, most specific first: "<dtype> <mode>", "<dtype>",
# "<mode>", "*". Derivations: eb = FP32 exponent field of amax; floor code eb - 8 (>= 0);
# element = x * 2^(127 - code) rounded to E4M3.
CASES = [
    # amax 0: floor eb 0 -> 0; rceil descale 0 -> 0. Zeros stay +0.
    ("zero", fill(0.0), {"*": (0, 0x00, 0x00)}),
    # 2^-126 (BF16/FP32 smallest normal): floor eb 1 -> 0; rceil descale ~2^-134.8 (subnormal,
    # <= 2^-127) -> 0; 2^-126 * 2^127 = 2.0 = 0x40. FP16's smallest normal 2^-14: eb 113 -> 105
    # (rceil: 2^-14 * fl32(1/448) = 2^-23 * 1.14 -> 2^-22, 105 too); 2^-14 * 2^22 = 256 = 0x78.
    ("smallest_normal", fill(tiny), {"*": (0, 0x40, 0x40), "fp16": (105, 0x78, 0x78)}),
    # NaN or Inf anywhere: 0xFF and NaN elements, finite neighbours included.
    ("mixed_inf", first(INF, 1.0), {"*": (0xFF, 0x7F, 0x7F)}),
    ("mixed_neg_inf", first(-INF, 1.0), {"*": (0xFF, 0x7F, 0x7F)}),
    ("mixed_nan", first(NAN, 1.0), {"*": (0xFF, 0x7F, 0x7F)}),
    ("all_nan", fill(NAN), {"*": (0xFF, 0x7F, 0x7F)}),
    # 448 = 1.75 * 2^8: floor eb 135 -> 127; rceil descale 448 * fl32(1/448) rounds to 1.0 -> 127.
    ("positive_fp8_max", fill(448.0), {"*": (127, 0x7E, 0x7E)}),
    ("negative_fp8_max", fill(-448.0), {"*": (127, 0xFE, 0xFE)}),
    # dtype max (BF16/FP32 ~2^128): floor eb 254 -> 246, x * 2^-119 ~ 511.99 saturates to 448
    # (0x7E); rceil descale ~2^119.2 -> 247, x * 2^-120 ~ 256 -> 0x78. FP16 65504 = 1.999 * 2^15:
    # floor 134, 511.75 -> 448; rceil 146.2 -> 2^8: 135, 255.875 -> 256.
    ("positive_dtype_max", fill(dmax), {"floor": (246, 0x7E, 0x7E), "rceil": (247, 0x78, 0x78),
                                       "fp16 floor": (134, 0x7E, 0x7E), "fp16 rceil": (135, 0x78, 0x78)}),
    ("negative_dtype_max", fill(neg(dmax)), {"floor": (246, 0xFE, 0xFE), "rceil": (247, 0xF8, 0xF8),
                                            "fp16 floor": (134, 0xFE, 0xFE), "fp16 rceil": (135, 0xF8, 0xF8)}),
    # smallest subnormal: BF16 2^-133 -> code 0, 2^-133 * 2^127 = 2^-6 = 0x08 (E4M3's smallest
    # normal); FP32 2^-149 -> code 0, 2^-22 underflows to +-0; FP16 2^-24: eb 103 -> 95 (rceil
    # 2^-24 * 1.14 * 2^-9 -> 2^-32: 95), 2^-24 * 2^32 = 256.
    ("positive_smallest_subnormal", fill(sub), {"bf16": (0, 0x08, 0x08), "fp32": (0, 0x00, 0x00),
                                               "fp16": (95, 0x78, 0x78)}),
    ("negative_smallest_subnormal", fill(neg(sub)), {"bf16": (0, 0x88, 0x88), "fp32": (0, 0x80, 0x80),
                                                    "fp16": (95, 0xF8, 0xF8)}),
    # 1.0 sets the scale (floor 127 - 8; rceil 2^-8.8 -> 2^-8: 119), 1.0 -> 256 = 0x78; the
    # subnormal underflows to a zero of its sign.
    ("mixed_positive_underflow", first(sub, 1.0), {"*": (119, 0x00, 0x78)}),
    ("mixed_negative_underflow", first(neg(sub), 1.0), {"*": (119, 0x80, 0x78)}),
    # dtype max sets the scale (above), the ones underflow: 2^-119 / 2^-120 -> 0. FP16: 1.0 *
    # 2^-7 = 4 * 2^-9 (E4M3 subnormal 0x04), 2^-8 -> 0x02.
    ("mixed_saturation_and_underflow", first(dmax, 1.0), {
        "floor": (246, 0x7E, 0x00), "rceil": (247, 0x78, 0x00),
        "fp16 floor": (134, 0x7E, 0x04), "fp16 rceil": (135, 0x78, 0x02)}),
    # FP32 0x40600001 = 3.5 + 1 ulp (module docstring): rceil 121 / 0x76; floor eb 128 -> 120,
    # 448.00003 -> 448. BF16/FP16 hold 3.5: 120 / 0x7E in both modes.
    ("rceil_premature_bf16_lowers_scale", fill(lambda d: _from_f32_bits(0x40600001, d)), {
        "*": (120, 0x7E, 0x7E), "fp32 rceil": (121, 0x76, 0x76)}),
    # FP32 0x43FFFFFF = 512 - 2^-15: floor eb 135 -> 127, 511.99997 saturates to 448; rceil
    # 1.14 -> 2: 128, 255.99998 -> 256. BF16/FP16 round it to 512: 128 / 0x78 in both modes.
    ("floor_premature_bf16_raises_scale", fill(lambda d: _from_f32_bits(0x43FFFFFF, d)), {
        "*": (128, 0x78, 0x78), "fp32 floor": (127, 0x7E, 0x7E)}),
    # 480, between 448 and 512: floor 127 (scale 1), 480 saturates to 448; rceil 480/448 -> 2:
    # 128, 240 = 0x77.
    ("positive_satfinite", fill(480.0), {"floor": (127, 0x7E, 0x7E), "rceil": (128, 0x77, 0x77)}),
    ("negative_satfinite", fill(-480.0), {"floor": (127, 0xFE, 0xFE), "rceil": (128, 0xF7, 0xF7)}),
    # flyquant's own rows: the E8M0 byte 0 / 1 boundary. amax = 448 * 2^-127 (FP32 0x04600000,
    # BF16 0x0460): floor eb 8 -> 0; rceil descale rounds to 2^-127 exactly -> 0; x * 2^127 = 448.
    ("code0_top", fill(lambda d: _from_f32_bits(0x04600000, d)), {"*": (0, 0x7E, 0x7E),
                                                                  "fp16": (0, 0x00, 0x00)}),
    # FP32 one and two ulps above: the descale (an FP32 subnormal, grid 2^-149) rounds to 2^-127
    # for one ulp (code 0, 448.00005 -> 448), above it for two (code 1, 224.0001 -> 224 = 0x76);
    # floor stays code 0 and saturates at 448. (BF16/FP16 round these to 0x0460 / 0.)
    ("code0_top_plus_1ulp", fill(lambda d: _from_f32_bits(0x04600001, d)), {"*": (0, 0x7E, 0x7E),
                                                                            "fp16": (0, 0x00, 0x00)}),
    ("code1_bottom", fill(lambda d: _from_f32_bits(0x04600002, d)), {
        "*": (0, 0x7E, 0x7E), "fp32 rceil": (1, 0x76, 0x76), "fp16": (0, 0x00, 0x00)}),
    # BF16's next value up, 0x0461 = 1.7578125 * 2^-119: rceil code 1, x * 2^126 = 225 -> 224;
    # floor code 0, 450 -> 448. (FP32 holds it exactly too; FP16 flushes it to 0.)
    ("code1_bf16", fill(lambda d: _from_f32_bits(0x04610000, d)), {
        "*": (0, 0x7E, 0x7E), "rceil": (1, 0x76, 0x76), "fp16": (0, 0x00, 0x00)}),
]
NAMES = [c[0] for c in CASES]


def expected(dtype_name: str, mode: str) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(blocks (C, 32) in the dtype, expected data (C, 32) uint8, expected codes (C,) uint8)."""
    dtype = DTYPES[dtype_name]
    blocks, data, codes = [], [], []
    for name, make, table in CASES:
        for key in (f"{dtype_name} {mode}", dtype_name, mode, "*"):
            if key in table:
                code, b0, b = table[key]
                break
        blocks.append(torch.tensor(make(dtype), dtype=torch.float64).to(dtype))
        data.append([b0] + [b] * (BLOCK - 1))
        codes.append(code)
    return torch.stack(blocks), torch.tensor(data, dtype=U8), torch.tensor(codes, dtype=U8)


def latin(blocks: torch.Tensor) -> torch.Tensor:
    """(C, 32) -> (32, 32 * C): case c's 32 x 32 tile holds blocks[c][(i + j) % 32] at (i, j)."""
    idx = (torch.arange(BLOCK)[:, None] + torch.arange(BLOCK)[None, :]) % BLOCK
    return torch.cat([b[idx] for b in blocks], dim=1)


ROWS = 128  # four row tiles: a token group (offs) must be a multiple of 128 rows


def case_tensors(dtype_name, mode):
    """x (128, 32 C) and its expected plain outputs: data bytes (128, 32 C) (row-major view),
    1x32 codes (128, C), 32x1 codes (32 C, 4)."""
    blocks, data, codes = expected(dtype_name, mode)
    x = latin(blocks).repeat(ROWS // BLOCK, 1)
    want = latin(data).repeat(ROWS // BLOCK, 1)
    c = codes.numel()
    return x, want, codes.repeat(ROWS, 1), codes.repeat_interleave(BLOCK).reshape(c * BLOCK, 1).repeat(1, ROWS // BLOCK)


def _assert_case_bytes(got: torch.Tensor, want: torch.Tensor, case_of, what: str):
    g, w = got.contiguous().view(U8), want.contiguous().view(U8)
    assert g.shape == w.shape, what
    bad = (g != w).nonzero()
    if bad.numel():
        names = sorted({NAMES[case_of(*ix)] for ix in bad.tolist()})
        first = bad[0].tolist()
        raise AssertionError(f"{what}: {bad.shape[0]} bytes differ, cases {names}; first at {first}: "
                             f"got {g[tuple(first)].item():#04x}, want {w[tuple(first)].item():#04x}")


# ------------------------------------------------------------------------------------------------
# the reference
# ------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("dtype_name", list(DTYPES))
def test_reference_follows_the_contract(dtype_name, mode):
    blocks, data, codes = expected(dtype_name, mode)
    q, s = R.mxfp8_quantize(blocks, -1, mode)
    _assert_case_bytes(s.view(U8).flatten(), codes, lambda c: c, "scales")
    _assert_case_bytes(q, data, lambda c, _: c, "data")


FP32_RCEIL_BITS = [  # FP32 descale bits -> E8M0 code (smallest power of two >= it; 0xFF: NaN)
    (0x00000000, 0),  # zero
    (0x00000001, 0),  # 2^-149
    (0x00400000, 0),  # 2^-127: exactly code 0
    (0x00400001, 1),  # just above 2^-127
    (0x007FFFFF, 1),  # largest subnormal
    (0x00800000, 1),  # 2^-126: exactly code 1
    (0x1F800000, 63),  # 2^-64
    (0x1F800001, 64),
    (0x3F7FFFFF, 127),  # just below 1
    (0x3F800000, 127),  # 1
    (0x3F800001, 128),
    (0x5F800000, 191),  # 2^64
    (0x5F800001, 192),
    (0x7F000000, 254),  # 2^127: the largest code
    (0x7F000001, 0xFF),  # above 2^127: no code, NaN
    (0x7F7FFFFF, 0xFF),  # FP32 max
    (0x7F800000, 0xFF),  # Inf
    (0x7FC00000, 0xFF),  # NaN
]


def test_f32_to_e8m0_rceil_bit_patterns():
    bits = torch.tensor([b for b, _ in FP32_RCEIL_BITS], dtype=torch.int32).view(torch.float32)
    want = [c for _, c in FP32_RCEIL_BITS]
    assert formats.e8m0_rceil(bits).tolist() == want


# ------------------------------------------------------------------------------------------------
# every kernel variant, both arches
# ------------------------------------------------------------------------------------------------

# 3d_t: the 3D quantize of the transposed view (strides (N*K, 1, N)): k1 runs the 1x32 kernel,
# k32 the column kernel's 3d_t variant
VARIANTS = ["1x32", "32x1", "1x32_offs", "32x1_offs", "dual", "3d_k1", "3d_k32", "3d_t_k1", "3d_t_k32"]
ALL = [(a, d, m, v) for a in ARCHS for d in DTYPES for m in MODES for v in VARIANTS]


@pytest.mark.parametrize("arch,dtype_name,mode,variant", ALL, ids=["-".join(p) for p in ALL])
def test_kernels_follow_the_contract(arch, dtype_name, mode, variant):
    """Plain layout: the table's bytes exactly; "tcgen05" and "mfma": the reference's layout of
    those bytes (layouts are tested against torchao / aiter elsewhere). Strides asserted."""
    x, want, codes_rows, codes_cols = case_tensors(dtype_name, mode)
    m, k = x.shape
    by_col = lambda *ix: ix[-1] // BLOCK  # noqa: E731  case of a (row, col) data byte
    if variant == "dual":
        (d1, s1), (d2, s2) = q2.quantize_dual(x, arch=arch, scaling_mode=mode)
        assert d1.stride() == (k, 1) and d2.stride() == (1, m)
        _assert_case_bytes(d1, want, by_col, "dual 1x32 data")
        _assert_case_bytes(s1, codes_rows, lambda r, c: c, "dual 1x32 scales")
        _assert_case_bytes(d2, want, by_col, "dual 32x1 data")
        _assert_case_bytes(s2, codes_cols, lambda r, c: r // BLOCK, "dual 32x1 scales")
        return
    if variant.startswith("3d_t"):  # w = the transpose of x's (E, 32, 32 C) experts: N = 32 C, K = 32
        block_k = 1 if variant == "3d_t_k1" else BLOCK
        e = ROWS // BLOCK
        w = x.reshape(e, BLOCK, k).transpose(1, 2)  # (E, 32 C, 32), strides (32 k, 1, k)
        want_codes = codes_rows[:BLOCK * e:BLOCK].reshape(e, -1, 1).repeat(1, 1, BLOCK // block_k)
        for layout in LAYOUTS:
            d, s = q3.quantize_3d(w, arch=arch, scaling_mode=mode, scale_block_k=block_k, scale_layout=layout)
            assert d.stride() == w.stride(), layout
            _assert_case_bytes(d, want.reshape(e, BLOCK, k).transpose(1, 2), lambda _, n, __: n // BLOCK,
                               f"{variant} data {layout}")
            ref = R._layout_scales_3d(want_codes.view(torch.float8_e8m0fnu), block_k, layout)
            _assert_case_bytes(s, ref, lambda *ix: 0, f"{variant} scales {layout}")
            if layout is None:
                _assert_case_bytes(s, want_codes, lambda _, c, __: c, f"{variant} scales")
        return
    if variant.startswith("3d"):
        block_k = 1 if variant == "3d_k1" else BLOCK
        w = x.reshape(ROWS // BLOCK, BLOCK, k)  # (E, N = 32, K)
        e = w.shape[0]
        want_codes = codes_cols[:, :e].t().reshape(e, 1, k)[..., ::block_k]  # (E, 1, K / block_k)
        for layout in LAYOUTS:
            d, s = q3.quantize_3d(w, arch=arch, scaling_mode=mode, scale_block_k=block_k, scale_layout=layout)
            assert d.stride() == (BLOCK * k, 1, BLOCK), layout
            _assert_case_bytes(d, want.reshape(e, BLOCK, k), by_col, f"3d data {layout}")
            ref = R._layout_scales_3d(want_codes.contiguous().view(torch.float8_e8m0fnu), block_k, layout)
            _assert_case_bytes(s, ref, lambda *ix: 0, f"3d scales {layout}")
            if layout is None:
                _assert_case_bytes(s, want_codes, lambda *ix: ix[-1] * block_k // BLOCK, "3d scales")
        return
    axis_rows = variant.startswith("1x32")
    offs = torch.tensor([ROWS], dtype=torch.int32) if variant.endswith("offs") else None
    plain = codes_rows if axis_rows else codes_cols
    for layout in LAYOUTS:
        if axis_rows:
            d, s = q2.quantize_1x32(x, arch=arch, scaling_mode=mode, scale_layout=layout, offs=offs)
            assert d.stride() == (k, 1)
        else:
            d, s = q2.quantize_32x1(x, arch=arch, scaling_mode=mode, scale_layout=layout, offs=offs)
            assert d.stride() == (1, m)
        _assert_case_bytes(d, want, by_col, f"{variant} data {layout}")
        plain_e8 = plain.view(torch.float8_e8m0fnu)
        if layout is None:
            _assert_case_bytes(s, plain, (lambda r, c: c) if axis_rows else (lambda r, c: r // BLOCK),
                               f"{variant} scales")
        elif layout == "tcgen05" and offs is not None and not axis_rows:
            _assert_case_bytes(s, layouts.tcgen05_blocked_col_groups(plain_e8, offs.long() // BLOCK), lambda *ix: 0,
                               f"{variant} scales {layout}")
        else:
            _assert_case_bytes(s, R._layout_scales_2d(plain_e8, layout, flat=not axis_rows), lambda *ix: 0,
                               f"{variant} scales {layout}")
