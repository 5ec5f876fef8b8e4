"""The MXFP8 grouped GEMM FlyDSL kernel (kernels/mxfp8_grouped_mm.py): executed under flyquant.emu
for gfx950 and gfx942, both scale layouts, against tests/mx_fp64.py's float64 model of the MX
definition (each E4M3 element times 2^(scale - 127), decoded from the bits, then a per-group
matmul).

Tolerance. E4M3 x E4M3 products and their power-of-two scales are exact in FP32 (away from
underflow and overflow), so the kernel's only errors are the FP32 sums of the K products, in an
order and grouping no reference shares (MFMA internals, gfx942's per-block partial sums and
scaled adds), and the rounding to the output dtype: |out - ref| <= (K + 2) 2^-24 sum_k |a_k b_k|
+ u |ref| (u = 2^-8 for bf16, 0 for fp32), (K + 2) covering any order of K additions plus the
scaled add. The shapes are small, so one wrong 32-element block (~sqrt(32) |a||b|) is far
outside it.
"""

from __future__ import annotations

import pytest
import torch

import flyquant.emu as emu
from flyquant import layouts, select, select_grouped_mm, toolchain
from flyquant import reference as R
from flyquant.kernels import mxfp8_grouped_mm as G
from mx_fp64 import deq64, grouped64  # the FP64 model (E4M3 and E8M0 from their bit fields)

ARCHS = ("gfx950", "gfx942")
# the forward's operand paths: each wave's direct loads (both arches) and gfx950's LDS staging
PATHS = [("gfx950", False), ("gfx950", True), ("gfx942", False)]
PATH_IDS = ["gfx950", "gfx950-lds", "gfx942"]
LAYOUTS = (None, "mfma")
U_F32 = 2.0**-24
U_OUT = {torch.bfloat16: 2.0**-8, torch.float32: 0.0}


def expected(a, a_scale, b, b_scale, offs):
    """(reference, sum |a b| per element) in float64; rows past offs[-1] are 0."""
    return grouped64(deq64(a, a_scale, -1), deq64(b, b_scale, -1), offs)


def make_problem(m, n, k, sizes, seed=0):
    gen = torch.Generator().manual_seed(seed)
    a, a_scale = R.mxfp8_quantize(torch.randn(m, k, generator=gen) * 4, -1, "rceil")
    w = torch.randn(len(sizes) * n, k, generator=gen)
    b, b_scale = R.mxfp8_quantize(w, -1, "rceil")
    offs = torch.tensor(sizes, dtype=torch.int64).cumsum(0).to(torch.int32)
    return a, a_scale, b.view(len(sizes), n, k), b_scale.view(len(sizes), n, -1), offs


def run(arch, a, a_scale, b, b_scale, offs, scale_layout, out_dtype=torch.bfloat16, **kw):
    if scale_layout == "mfma":  # a's (M, K/32) and each expert's (N, K/32), stacked
        a_scale = layouts.mfma_shuffle_scales(a_scale)
        b_scale = torch.stack([layouts.mfma_shuffle_scales(s) for s in b_scale])
    with toolchain.target(arch):
        return G.grouped_mm(a, a_scale, b, b_scale, offs, arch=arch, out_dtype=out_dtype, scale_layout=scale_layout, **kw)


def check(out, ref, mag, k, out_dtype):
    ref32 = ref.to(torch.float32).to(torch.float64)  # overflow past FP32 is inf, as in the kernel
    got = out.to(torch.float64)
    assert torch.equal(torch.isnan(got), torch.isnan(ref32)), "NaN positions differ"
    assert torch.equal(torch.isinf(got), torch.isinf(ref32)) and torch.equal(got[torch.isinf(got)], ref32[torch.isinf(ref32)])
    finite = torch.isfinite(ref32)
    tol = (k + 2) * U_F32 * mag + U_OUT[out_dtype] * ref.abs()
    err = (got - ref).abs()
    assert bool((err[finite] <= tol[finite]).all()), f"max error {err[finite].max():.3g}, tolerance there {tol[finite][err[finite].argmax()]:.3g}"


# (M, N, K, group sizes, out dtype): tails of every kind, empty groups, rows past the last group,
# a group boundary inside a tile, E = 1, more than 64 groups (two ballots)
CASES = [
    (40, 32, 64, [17, 0, 23], torch.bfloat16),
    (70, 64, 160, [5, 30, 0, 20], torch.float32),  # K % 128 = 32; rows 55..69 past the last group
    (130, 48, 96, [130], torch.float32),  # E = 1, only a partial K step, N not a tile multiple
    (96, 32, 288, [0] * 40 + [33] + [0] * 29 + [40], torch.bfloat16),  # 71 groups; 23 rows past the last
    (200, 144, 640, [64, 66, 70], torch.bfloat16),  # two m-tiles, a boundary in each; N = 144: two n-tiles
]


@pytest.mark.parametrize("arch, lds_stage", PATHS, ids=PATH_IDS)
@pytest.mark.parametrize("scale_layout", LAYOUTS, ids=["plain", "mfma"])
@pytest.mark.parametrize("case", CASES, ids=[f"{c[0]}x{c[1]}x{c[2]}-E{len(c[3])}" for c in CASES])
def test_matches_the_mx_definition(arch, lds_stage, scale_layout, case):
    m, n, k, sizes, out_dtype = case
    a, a_scale, b, b_scale, offs = make_problem(m, n, k, sizes)
    out = run(arch, a, a_scale, b, b_scale, offs, scale_layout, out_dtype, lds_stage=lds_stage)
    ref, mag = expected(a, a_scale, b, b_scale, offs)
    check(out, ref, mag, k, out_dtype)
    assert bool((out[int(offs[-1]):] == 0).all())  # rows past the last group: written as 0


@pytest.mark.parametrize("lds_stage", [False, True], ids=["direct", "lds"])
@pytest.mark.parametrize("scale_layout", LAYOUTS, ids=["plain", "mfma"])
@pytest.mark.parametrize("tile_m, tile_n, n", [(128, 256, 288), (128, 320, 352), (128, 192, 288), (192, 256, 288)])
def test_wide_tiles_on_gfx950(scale_layout, tile_m, tile_n, n, lds_stage):
    """The 128x256, 128x320, 128x192 and 192x256 tiles (2 x 2 waves of 64 x 128 / 64 x 160 /
    64 x 96 / 96 x 128) the selector picks on gfx950, operands loaded by each wave or staged in
    LDS: two n-tiles, the second partial (32 / 32 / 96 / 32 columns); two m-tiles, the second
    partial (72 / 8 rows); group boundaries inside the m-tiles; K % 128 = 64."""
    a, a_scale, b, b_scale, offs = make_problem(200, n, 320, [64, 66, 0, 60])
    out = run("gfx950", a, a_scale, b, b_scale, offs, scale_layout, tile_m=tile_m, tile_n=tile_n, lds_stage=lds_stage)
    ref, mag = expected(a, a_scale, b, b_scale, offs)
    check(out, ref, mag, 320, torch.bfloat16)
    assert bool((out[190:] == 0).all())


@pytest.mark.parametrize("arch, lds_stage", PATHS, ids=PATH_IDS)
@pytest.mark.parametrize("scale_layout", LAYOUTS, ids=["plain", "mfma"])
def test_special_codes(arch, lds_stage, scale_layout):
    """-0 elements (FNUZ's NaN code on gfx942), NaN element codes under finite scales, NaN scales,
    the smallest and largest scales (2^-127 x 2^127 = 1), and products overflowing FP32."""
    m, n, k, sizes = 64, 32, 256, [12, 1, 27, 24]  # row 12 alone in group 1; rows 40.. group 3
    a, a_scale, b, b_scale, offs = make_problem(m, n, k, sizes, seed=3)
    a_codes, b_codes = a.view(torch.uint8), b.view(torch.uint8)
    sa, sb = a_scale.view(torch.uint8), b_scale.view(torch.uint8)
    a_codes[:, ::7] = 0x80  # -0 everywhere: must count as 0
    b_codes[:, :, 3::11] = 0x80
    a_codes[5, 40] = 0x7F  # NaN elements: row 5 is NaN for every column
    b_codes[3, 7, 200] = 0xFF  # ... column 7 is NaN for group 3's rows
    sa[9, 2] = 0xFF  # a NaN scale: row 9 is NaN
    sa[12, :] = 0  # 2^-127 ...
    sb[1, 3, :] = 254  # ... times 2^127: (12, 3) is exactly the unscaled products' sum
    # row 50 (group 3) x column 10: a block of 448 x 448 products under a 2^254 scale product, past
    # FP32 whatever the order of the sums (the block dominates each of row 50's elements)
    sa[50, 1] = 254
    sb[3, 10, 1] = 254
    a_codes[50, 32:64] = 0x7E
    b_codes[3, 10, 32:64] = 0x7E
    out = run(arch, a, a_scale, b, b_scale, offs, scale_layout, torch.float32, lds_stage=lds_stage)
    ref, mag = expected(a, a_scale, b, b_scale, offs)
    assert torch.isnan(ref[5]).all() and torch.isnan(ref[40:, 7]).all() and torch.isinf(ref[50, :7].float()).all()
    assert torch.isfinite(ref[12, 3]) and ref[12, 3] != 0
    check(out, ref, mag, k, torch.float32)


@pytest.mark.parametrize("arch, lds_stage", PATHS, ids=PATH_IDS)
@pytest.mark.parametrize("scale_layout", LAYOUTS, ids=["plain", "mfma"])
@pytest.mark.parametrize("k", [64, 96, 160])
def test_k_tail_reads_nothing_past_its_row(arch, lds_stage, scale_layout, k):
    """K % 128 = 64 / 96 / 32: the last step's bytes past K are the next row's first bytes, which
    hold NaN codes here (row 2 of a, expert row 2 of b); an over-read would show as NaN in rows 1
    and columns 1 (finite data past K would not show: its scales are masked to ~2^-254)."""
    a, a_scale, b, b_scale, offs = make_problem(4, 32, k, [4], seed=5)
    a.view(torch.uint8)[2, :16] = 0x7F
    b.view(torch.uint8)[0, 2, :16] = 0x7F
    out = run(arch, a, a_scale, b, b_scale, offs, scale_layout, torch.float32, lds_stage=lds_stage)
    ref, mag = expected(a, a_scale, b, b_scale, offs)
    assert torch.isnan(ref[2]).all() and torch.isnan(ref[:, 2]).all() and torch.isfinite(ref[1, 1])
    check(out, ref, mag, k, torch.float32)


@pytest.mark.parametrize("arch", ARCHS)
@pytest.mark.parametrize("scale_layout", LAYOUTS, ids=["plain", "mfma"])
def test_a_lone_nan_code_at_each_byte_of_a_dword(arch, scale_layout):
    """gfx942 looks for NaN codes once per wave and step (a probe per dword, a rare branch): each
    NaN here is the only one in its step, at byte k % 4 = 0, 1, 2, 3 of a's dwords (steps 0-3) and
    of b's (steps 4-7), so a probe that misses one byte position leaves a finite +-240 (FNUZ's
    reading of 0x7F / 0xFF) where the row or column must be NaN."""
    a, a_scale, b, b_scale, offs = make_problem(64, 32, 1024, [64], seed=11)
    for i in range(4):
        a.view(torch.uint8)[5 + i, 128 * i + 16 + i] = 0x7F if i % 2 else 0xFF  # rows 5-8 NaN
        b.view(torch.uint8)[0, 3 * i, 128 * (4 + i) + 44 + i] = 0xFF if i % 2 else 0x7F  # columns 0, 3, 6, 9
    out = run(arch, a, a_scale, b, b_scale, offs, scale_layout, torch.float32)
    ref, mag = expected(a, a_scale, b, b_scale, offs)
    assert torch.isnan(ref[5:9]).all() and torch.isnan(ref[:, 0:12:3]).all() and int(torch.isnan(ref).sum()) == 4 * 32 + 4 * 60
    check(out, ref, mag, 1024, torch.float32)


@pytest.mark.parametrize("arch, lds_stage", PATHS, ids=PATH_IDS)
@pytest.mark.parametrize("scale_layout", LAYOUTS, ids=["plain", "mfma"])
def test_negative_codes_keep_their_sign(arch, lds_stage, scale_layout):
    """Every byte 0x81 (-2^-9, the least negative subnormal) in one operand, 1.0 (0x38) in the
    other, unit scales: each output is exactly -K 2^-9 (gfx942 rewrites only -0 (0x80), at any byte
    of a dword)."""
    m, n, k = 32, 16, 256
    unit = lambda shape: torch.full(shape, 127, dtype=torch.uint8).view(torch.float8_e8m0fnu)  # noqa: E731
    offs = torch.tensor([m], dtype=torch.int32)
    for a_code, b_code in ((0x81, 0x38), (0x38, 0x81)):
        a = torch.full((m, k), a_code, dtype=torch.uint8).view(torch.float8_e4m3fn)
        b = torch.full((1, n, k), b_code, dtype=torch.uint8).view(torch.float8_e4m3fn)
        out = run(arch, a, unit((m, k // 32)), b, unit((1, n, k // 32)), offs, scale_layout, torch.float32,
                  lds_stage=lds_stage)
        assert (out == -k * 2.0**-9).all(), (hex(a_code), float(out[0, 0]))


@pytest.mark.parametrize("arch", ARCHS)
def test_scale_products_at_the_edge_of_fp32(arch):
    """Scale codes whose exponents sum to 127 (254 x 127): exact on both arches. Past it (254 x
    130) the result 2^123 is finite; gfx950 gives it, gfx942's FP32 scale product is +inf and so
    is its sum (the module docstring's limit)."""
    m, n, k = 32, 16, 64
    a = torch.full((m, k), 0x08, dtype=torch.uint8).view(torch.float8_e4m3fn)  # 2^-6 each
    b = torch.full((1, n, k), 0x08, dtype=torch.uint8).view(torch.float8_e4m3fn)
    offs = torch.tensor([m], dtype=torch.int32)
    for ca, cb in ((254, 127), (1, 253), (254, 130)):
        a_scale = torch.full((m, k // 32), ca, dtype=torch.uint8).view(torch.float8_e8m0fnu)
        b_scale = torch.full((1, n, k // 32), cb, dtype=torch.uint8).view(torch.float8_e8m0fnu)
        out = run(arch, a, a_scale, b, b_scale, offs, None, torch.float32)
        exact = k * 2.0**-12 * 2.0 ** (ca + cb - 254)
        if arch == "gfx942" and ca + cb - 254 > 127:
            assert torch.isinf(out).all() and (out > 0).all()
        else:
            assert (out == exact).all(), (ca, cb, float(out[0, 0]), exact)


def _unsigned_zero_operands(m, n, k, sizes, seed):
    """A forward problem quantized with signed_zeros=False (the reference's: no -0 byte), with
    many elements that round to zero from below and a NaN block in each operand."""
    gen = torch.Generator().manual_seed(seed)
    x, w = torch.randn(m, k, generator=gen) * 4, torch.randn(len(sizes) * n, k, generator=gen)
    x[:, 5::9] = -1e-30
    w[:, 7::13] = -0.0
    x[3, 40], w[n + 6, 70] = float("nan"), float("nan")  # row 3 NaN; column 6 of group 1's rows NaN
    a, a_scale = R.mxfp8_quantize(x, -1, "rceil", signed_zeros=False)
    b, b_scale = R.mxfp8_quantize(w, -1, "rceil", signed_zeros=False)
    assert not (a.view(torch.uint8) == 0x80).any() and not (b.view(torch.uint8) == 0x80).any()
    assert (R.mxfp8_quantize(x, -1, "rceil")[0].view(torch.uint8) == 0x80).any()  # the signed ones have -0
    offs = torch.tensor(sizes, dtype=torch.int64).cumsum(0).to(torch.int32)
    return a, a_scale, b.view(len(sizes), n, k), b_scale.view(len(sizes), n, -1), offs


@pytest.mark.parametrize("arch", ARCHS)
@pytest.mark.parametrize("scale_layout", LAYOUTS, ids=["plain", "mfma"])
def test_unsigned_zero_operands(arch, scale_layout):
    """signed_zeros=False (operands without -0, NaN codes only in NaN-scale blocks): the same
    results, and on gfx942 (FNUZ) the operands used as loaded: at most 70% of the instructions."""
    m, n, k, sizes = 70, 32, 192, [20, 40, 10]
    a, a_scale, b, b_scale, offs = _unsigned_zero_operands(m, n, k, sizes, seed=12)
    ref, mag = expected(a, a_scale, b, b_scale, offs)
    assert torch.isnan(ref[3]).all() and torch.isnan(ref[20:60, 6]).all()
    counts = []
    for signed in (True, False):
        with emu.record() as launches:
            out = run(arch, a, a_scale, b, b_scale, offs, scale_layout, torch.float32, signed_zeros=signed)
        check(out, ref, mag, k, torch.float32)
        counts.append(launches[-1].stats.wave_instructions)
    if arch == "gfx942":
        assert counts[1] <= 0.7 * counts[0], counts
    else:  # OCP FP8 in hardware: one kernel for both
        assert counts[1] == counts[0]


@pytest.mark.parametrize("arch, lds_stage", PATHS, ids=PATH_IDS)
def test_untrusted_offsets_stay_inside_the_tensors(arch, lds_stage):
    """offs that are not non-decreasing, negative or past M: no access outside the tensors (the
    strict-memory fixture fails the launch otherwise), rows at or past offs[E - 1] written as 0;
    groups that are valid are still right."""
    m, n, k = 48, 32, 128
    a, a_scale, b, b_scale, _ = make_problem(m, n, k, [16, 16, 16])
    for bad in ([40, 10, 1000], [-5, 30, 20], [48, 2**31 - 1, -(2**31)]):
        out = run(arch, a, a_scale, b, b_scale, torch.tensor(bad, dtype=torch.int32), None, lds_stage=lds_stage)
        assert (out[max(bad[-1], 0):] == 0).all()  # rows at or past offs[E - 1]: still 0
    offs = torch.tensor([20, 20, 48], dtype=torch.int32)
    out = run(arch, a, a_scale, b, b_scale, offs, None, torch.float32, lds_stage=lds_stage)
    ref, mag = expected(a, a_scale, b, b_scale, offs)
    check(out, ref, mag, k, torch.float32)


@pytest.mark.loose_memory("one m-tile of a 2 GiB operand through the raw launcher, whose tensors are not tracked")
@pytest.mark.parametrize("lds_stage", [False, True], ids=["direct", "lds"])
def test_masked_k_tail_of_a_nearly_2_gib_operand_reads_zeros(lds_stage):
    """M K = 2^31 - 64 (the largest the selector sends to the kernel), K % 128 = 32: the K tail's
    masked chunks must read 0 whatever the last bytes of a hold (NaN codes here). Staged, a masked
    lane's offset plus its offset field once landed inside a (its buffer starts DMA_SHIFT before
    it), and rows of the first m-tile came out NaN. Only that m-tile is launched."""
    k, n = 160, 256
    m = ((1 << 31) - 64) // k
    a8 = torch.empty(m * k, dtype=torch.uint8)  # pages never written cost no memory
    a8[-4096:] = 0x7F
    top, top_scale = R.mxfp8_quantize(torch.randn(192, k, generator=torch.Generator().manual_seed(2)), -1, "rceil")
    a8[:192 * k] = top.view(torch.uint8).flatten()
    a_scale = torch.empty(m, k // 32, dtype=torch.uint8).view(torch.float8_e8m0fnu)
    a_scale[:192] = top_scale
    _, _, b, b_scale, _ = make_problem(1, n, k, [1], seed=3)
    offs, out = torch.tensor([m], dtype=torch.int32), torch.zeros(192, n, dtype=torch.float32)
    cfg = G.GroupedMMConfig("gfx950", torch.float32, n, k, 1, tile_m=192, tile_n=256, lds_stage=lds_stage)
    with toolchain.target("gfx950"):
        G.build_grouped_mm(cfg)(a8.data_ptr(), a_scale.data_ptr(), b.data_ptr(), b_scale.data_ptr(), offs.data_ptr(),
                                out.data_ptr(), m, b_scale[0].numel(), 1, stream=0)
    ref, mag = expected(top, top_scale, b, b_scale, torch.tensor([192], dtype=torch.int32))
    check(out, ref, mag, k, torch.float32)


@pytest.mark.parametrize("arch", ARCHS)
@pytest.mark.parametrize("scale_layout", LAYOUTS, ids=["plain", "mfma"])
def test_one_expert_scales_with_any_stride_along_e(arch, scale_layout):
    """E = 1: torch calls (1, N, K/32) scales contiguous whatever their stride along E (a size-1
    dim's); the launcher once took that stride as an expert's scale bytes, and every column but
    the first read scale code 0 (2^-127) from past the buffer it made."""
    m, n, k = 64, 32, 128
    a, a_scale, b, b_scale, offs = make_problem(m, n, k, [m])
    ref, mag = expected(a, a_scale, b, b_scale, offs)
    if scale_layout == "mfma":
        a_scale, b_scale = layouts.mfma_shuffle_scales(a_scale), layouts.mfma_shuffle_scales(b_scale[0])[None]
    odd = b_scale[0].unsqueeze(1).transpose(0, 1)  # the same bytes, stride along E = a row's
    assert odd.is_contiguous() and odd.stride(0) != odd[0].numel()
    with toolchain.target(arch):
        out = G.grouped_mm(a, a_scale, b, odd, offs, arch=arch, out_dtype=torch.float32, scale_layout=scale_layout)
    check(out, ref, mag, k, torch.float32)


@pytest.mark.parametrize("arch, scale_layout, tile, match", [
    ("gfx950", "mfma", (32, 128), "multiple of 32"),  # 16 rows per wave: an odd number of row blocks
    ("gfx950", "mfma", (64, 96), "multiple of 32"),  # 48 columns per wave
    ("gfx942", None, (96, 128), "multiples of 64"),  # scale staging: A's entries end inside a thread chunk
    ("gfx942", None, (64, 32), "multiples of 64"),
])
def test_tiles_the_kernel_cannot_take_are_refused(arch, scale_layout, tile, match):
    """Tiles the selector never picks, forced on the launcher: a clear error at build time (they
    once raised an IndexError while building, or raced in LDS at run time)."""
    cfg = G.GroupedMMConfig(arch=arch, out_dtype=torch.bfloat16, n=128, k=128, experts=1, tile_m=tile[0],
                            tile_n=tile[1], scale_layout=scale_layout)
    with pytest.raises(ValueError, match=match):
        G.build_grouped_mm(cfg)


def test_lds_staging_is_refused_where_the_kernel_has_none():
    """Staging in LDS exists on gfx950's forward only, and both stages must fit its LDS."""
    for arch, wgrad in (("gfx942", False), ("gfx950", True)):
        cfg = G.GroupedMMConfig(arch, torch.bfloat16, 128, 128, 1, wgrad=wgrad, lds_stage=True)
        with pytest.raises(ValueError, match="only gfx950's forward"):
            G.build_grouped_mm(cfg)
    cfg = G.GroupedMMConfig("gfx950", torch.bfloat16, 512, 128, 1, tile_m=320, tile_n=384, lds_stage=True)
    with pytest.raises(ValueError, match="fit"):
        G.build_grouped_mm(cfg)


def test_no_rows_is_an_empty_launch():
    a, a_scale, b, b_scale, _ = make_problem(32, 32, 64, [32])
    out = run("gfx950", a[:0], a_scale[:0], b, b_scale, torch.tensor([0], dtype=torch.int32), None)
    assert out.shape == (0, 32)


@pytest.mark.parametrize("arch", ARCHS)
@pytest.mark.parametrize("scale_layout", LAYOUTS, ids=["plain", "mfma"])
def test_compiles_without_spills(arch, scale_layout):
    """A model-sized forward (M 16640, N 2048, K 5120, 8 groups) on the selector's tile (gfx950:
    192x256, either scale layout, and staged in LDS with "mfma" scales) and on the launcher's
    default 64x128: no spills; gfx942 also with signed_zeros=False operands, and at GPT-OSS's K
    2880 (a partial last K step) in at most 256 VGPRs: two workgroups per CU."""
    tiles = {(64, 128), select_grouped_mm.grouped_mm_tiles(arch, 16640, 2048, 8)[0]}
    assert len(tiles) == 2
    variants = [(5120, True)] + ([(5120, False), (2880, False)] if arch == "gfx942" else [])
    stagings = lambda tile: {False, select_grouped_mm.grouped_mm_lds_stage(arch, tile, scale_layout)[0]}  # noqa: E731
    for (tile_m, tile_n), (k, signed), lds in ((t, v, s) for t in tiles for v in variants for s in stagings(t)):
        cfg = G.GroupedMMConfig(arch=arch, out_dtype=torch.bfloat16, n=2048, k=k, experts=8, tile_m=tile_m,
                                tile_n=tile_n, scale_layout=scale_layout, signed_zeros=signed, lds_stage=lds)
        (rep,) = toolchain.compile_only(arch, G.build_grouped_mm(cfg), *([0] * 6), 16640, 1, 1, stream=0)
        assert rep.spills == 0 and rep.vgprs <= 512
        if (arch, k) == ("gfx942", 2880):  # two workgroups per CU (the kernel's partial-step barrier)
            assert rep.vgprs <= 256
        mfma = "v_mfma_scale_f32_16x16x128_f8f6f4" if arch == "gfx950" else "v_mfma_f32_16x16x32_fp8_fp8"
        assert rep.count(mfma) > 0


@pytest.mark.parametrize("scale_layout, k, tile_m, tile_n, lds_stage", [
    ("mfma", 8192, 128, 128, False), ("mfma", 2048, 128, 256, False), (None, 2048, 128, 256, False),
    ("mfma", 2048, 128, 320, False), ("mfma", 2048, 192, 256, False), (None, 2048, 192, 256, False),
    ("mfma", 2048, 192, 256, True)])
def test_instructions_per_mfma_on_gfx950(scale_layout, k, tile_m, tile_n, lds_stage):
    """The issue's modelled targets, one tile's rows over N 256 (320 for the 128x320 tile;
    bench/grouped_mm.py prints the grid's figures): at most 3 wave-instructions per MFMA, with
    "mfma" scales on the 128x128 tile at K 8192, and on the selector's wide tiles at the grid's
    shortest K, 2048 (one group: 128x320 only with "mfma" scales, select_grouped_mm.grouped_mm_tiles);
    and with the operands staged in LDS (the 192x256 tile with "mfma" scales), every global load of
    a and b uses whole 128-byte lines (coalescing 1.0; each wave's own loads: 0.5)."""
    problem = make_problem(tile_m, max(tile_n, 256), k, [tile_m])
    a, a_scale, b, b_scale, offs = (emu.aligned(t) for t in problem)  # on 128-byte lines, as on a GPU
    with emu.record() as launches:
        run("gfx950", a, a_scale, b, b_scale, offs, scale_layout, tile_m=tile_m, tile_n=tile_n, lds_stage=lds_stage)
    stats = launches[-1].stats
    assert stats.wave_instructions / stats.by_class["mfma"] <= 3.0
    lines = [stats.traffic_within(t.data_ptr(), t.data_ptr() + t.nbytes).coalescing for t in (a, b)]
    assert lines == ([1.0, 1.0] if lds_stage else [0.5, 0.5])


# ---- the weight-gradient GEMM: out[g] = y[g rows]^T x[g rows], both quantized along M ---------------


def make_wgrad_problem(m, n, k, sizes, seed=0):
    gen = torch.Generator().manual_seed(seed)
    x, x_scale = R.mxfp8_quantize(torch.randn(m, k, generator=gen) * 4, 0, "rceil")  # (M, K) stride (1, M), (K, M/32)
    y, y_scale = R.mxfp8_quantize(torch.randn(m, n, generator=gen), 0, "rceil")
    offs = torch.tensor(sizes, dtype=torch.int64).cumsum(0).to(torch.int32)
    return x, x_scale, y, y_scale, offs


def expected_wgrad(x, x_scale, y, y_scale, offs):
    X, Y = deq64(x.t(), x_scale, -1).t(), deq64(y.t(), y_scale, -1).t()  # (M, K), (M, N)
    ref = torch.zeros(offs.shape[0], y.shape[1], x.shape[1], dtype=torch.float64)
    mag = torch.zeros_like(ref)
    start = 0
    for g, end in enumerate(offs.tolist()):
        ref[g] = Y[start:end].t() @ X[start:end]
        mag[g] = Y[start:end].t().abs() @ X[start:end].abs()
        start = end
    return ref, mag


def run_wgrad(arch, x, x_scale, y, y_scale, offs, out_dtype=torch.bfloat16, tile_n=128):
    with toolchain.target(arch):
        return G.grouped_mm_wgrad(x, x_scale, y, y_scale, offs, arch=arch, out_dtype=out_dtype, tile_n=tile_n)


# (M, N, K, group sizes, out dtype): groups ending inside a 128-row step (tails of 1-3 blocks),
# empty groups (a zero matrix), rows past the last group, two tiles along N and K, 70 groups; the
# gfx950 pipeline's cases: 1 step, 3 (odd), 2 + a 32-row tail, 4 (even), 5 + a 96-row tail
WGRAD_CASES = [
    (1344, 32, 48, [128, 384, 0, 288, 512], torch.float32),
    (736, 16, 32, [736], torch.bfloat16),
    (64, 32, 48, [32, 0, 32], torch.float32),
    (320, 48, 64, [96, 160, 32, 0], torch.bfloat16),
    (288, 144, 160, [288], torch.float32),
    (128, 16, 32, [0] * 40 + [32] + [0] * 28 + [64], torch.bfloat16),
]


@pytest.mark.parametrize("arch", ARCHS)
@pytest.mark.parametrize("case", WGRAD_CASES, ids=[f"{c[0]}x{c[1]}x{c[2]}-E{len(c[3])}" for c in WGRAD_CASES])
def test_wgrad_matches_the_mx_definition(arch, case):
    m, n, k, sizes, out_dtype = case
    x, x_scale, y, y_scale, offs = make_wgrad_problem(m, n, k, sizes)
    out = run_wgrad(arch, x, x_scale, y, y_scale, offs, out_dtype)
    ref, mag = expected_wgrad(x, x_scale, y, y_scale, offs)
    check(out, ref, mag, max(sizes), out_dtype)
    assert all(bool((out[g] == 0).all()) for g, size in enumerate(sizes) if size == 0)


# gfx950's wide tiles (select_grouped_mm.grouped_mm_wgrad_tiles): (M, N, K, group sizes, tile_n). K 320: a
# second n-tile of 64 (256) or 128 (192) columns, K 352 of 32 (320); N 144: a second m-tile of 16
# rows; N 128 and K 256: no masks compiled
WGRAD_WIDE_CASES = [
    (608, 144, 320, [96, 0, 160, 352], 256),
    (608, 144, 352, [96, 0, 160, 352], 320),
    (608, 144, 320, [96, 0, 160, 352], 192),
    (2080, 128, 256, [2080], 256),
]


@pytest.mark.parametrize("case", WGRAD_WIDE_CASES, ids=[f"{c[1]}x{c[2]}-E{len(c[3])}-n{c[4]}" for c in WGRAD_WIDE_CASES])
def test_wgrad_wide_tiles_on_gfx950(case):
    m, n, k, sizes, tile_n = case
    x, x_scale, y, y_scale, offs = make_wgrad_problem(m, n, k, sizes, seed=3)
    with emu.record() as launches:
        out = run_wgrad("gfx950", x, x_scale, y, y_scale, offs, torch.float32, tile_n=tile_n)
    ref, mag = expected_wgrad(x, x_scale, y, y_scale, offs)
    check(out, ref, mag, max(sizes), torch.float32)
    assert all(bool((out[g] == 0).all()) for g, size in enumerate(sizes) if size == 0)
    if len(sizes) == 1:  # the modelled target on torchao's smallest groups (2080 rows, 17 steps)
        stats = launches[-1].stats
        assert stats.wave_instructions / stats.by_class["mfma"] <= 3.0


@pytest.mark.parametrize("arch", ARCHS)
def test_wgrad_compiles_without_spills(arch):
    """A model-sized weight gradient (N 2048, K 5120, 8 groups) on the 128x128 tile and the
    selector's (gfx950: 128x320): no spills; 128x128 at most 256 VGPRs (two waves per SIMD; on
    gfx950 with the pipeline's two register sets), the wide tile at most 512 (one)."""
    tiles = {(128, 128), select_grouped_mm.grouped_mm_wgrad_tiles(arch, 2048, 5120, 8)[0]}
    assert len(tiles) == (2 if arch == "gfx950" else 1)
    for tile_m, tile_n in tiles:
        cfg = G.GroupedMMConfig(arch=arch, out_dtype=torch.bfloat16, n=2048, k=5120, experts=8, tile_m=tile_m,
                                tile_n=tile_n, wgrad=True)
        (rep,) = toolchain.compile_only(arch, G.build_grouped_mm(cfg), *([0] * 6), 16640, 0, 16, stream=0)
        assert rep.spills == 0 and rep.vgprs <= (256 if tile_n == 128 else 512)
        mfma = "v_mfma_scale_f32_16x16x128_f8f6f4" if arch == "gfx950" else "v_mfma_f32_16x16x32_fp8_fp8"
        assert rep.count(mfma) > 0


def test_gpt_oss_tiles_compile_without_spills():
    """GPT-OSS's shapes on gfx950 (N and K 2880, 8 experts) take the 128x320 tile, the widest:
    forward with either scale layout and the weight gradient compile without spills (at most 512
    VGPRs: one wave per SIMD)."""
    forward = [(G.GroupedMMConfig(arch="gfx950", out_dtype=torch.bfloat16, n=2880, k=2880, experts=8, tile_m=128,
                                  tile_n=select_grouped_mm.grouped_mm_tiles("gfx950", 16640, 2880, 8, layout)[0][1],
                                  scale_layout=layout), (16640, 1, 1)) for layout in LAYOUTS]
    wgrad = (G.GroupedMMConfig(arch="gfx950", out_dtype=torch.bfloat16, n=2880, k=2880, experts=8, tile_m=128,
                               tile_n=select_grouped_mm.grouped_mm_wgrad_tiles("gfx950", 2880, 2880, 8)[0][1],
                               wgrad=True), (16640, 0, 23))
    for cfg, args in forward + [wgrad]:
        assert cfg.tile_n == 320
        (rep,) = toolchain.compile_only("gfx950", G.build_grouped_mm(cfg), *([0] * 6), *args, stream=0)
        assert rep.spills == 0 and rep.vgprs <= 512 and rep.count("v_mfma_scale_f32_16x16x128_f8f6f4") > 0


@pytest.mark.parametrize("arch", ARCHS)
def test_wgrad_special_codes(arch):
    """-0 elements, a NaN element code under a finite scale, a NaN scale, 2^-127 x 2^127."""
    m, n, k, sizes = 128, 32, 48, [64, 64]
    x, x_scale, y, y_scale, offs = make_wgrad_problem(m, n, k, sizes, seed=7)
    xc, yc = x.view(torch.uint8), y.view(torch.uint8)  # (M, K) / (M, N) views of the column-major data
    xc[::5, :] = 0x80
    yc[3::7, :] = 0x80
    yc[10, 4] = 0x7F  # group 0, y column 4: out[0, 4, :] NaN
    x_scale.view(torch.uint8)[9, 3] = 0xFF  # x column 9, rows 96..127 (group 1): out[1, :, 9] NaN
    x_scale.view(torch.uint8)[20, 0] = 0  # 2^-127 ...
    y_scale.view(torch.uint8)[7, 0] = 254  # ... times 2^127: out[0, 7, 20] has an exactly unscaled block
    out = run_wgrad(arch, x, x_scale, y, y_scale, offs, torch.float32)
    ref, mag = expected_wgrad(x, x_scale, y, y_scale, offs)
    assert torch.isnan(ref[0, 4]).all() and torch.isnan(ref[1, :, 9]).all() and torch.isfinite(ref[0, 7, 20])
    check(out, ref, mag, 64, torch.float32)


@pytest.mark.parametrize("arch", ARCHS)
def test_wgrad_lone_nan_codes_and_negative_codes(arch):
    """The weight gradient's operands go through the same -0 and NaN handling on gfx942: one NaN
    code per 128-row step at byte m % 4 = 0, 1, 2, 3 of y's dwords (steps 0-3) and of x's (4-7);
    then every byte 0x81 (-2^-9) in y against 1.0 (0x38) in x, unit scales: exactly -M 2^-9."""
    m, n, k = 1024, 16, 32
    x, x_scale, y, y_scale, offs = make_wgrad_problem(m, n, k, [m], seed=17)
    for i in range(4):
        y.view(torch.uint8)[128 * i + 8 + i, 2 * i] = 0x7F if i % 2 else 0xFF  # out[0, 0:8:2, :] NaN
        x.view(torch.uint8)[128 * (4 + i) + 20 + i, 3 * i + 1] = 0xFF if i % 2 else 0x7F  # out[0, :, 1:12:3] NaN
    out = run_wgrad(arch, x, x_scale, y, y_scale, offs, torch.float32)
    ref, mag = expected_wgrad(x, x_scale, y, y_scale, offs)
    assert torch.isnan(ref[0, 0:8:2]).all() and torch.isnan(ref[0, :, 1:12:3]).all()
    assert int(torch.isnan(ref).sum()) == 4 * 32 + 4 * 12
    check(out, ref, mag, m, torch.float32)
    unit = lambda t: torch.full_like(t.view(torch.uint8), 127).view(torch.float8_e8m0fnu)  # noqa: E731
    x.view(torch.uint8).fill_(0x38)
    y.view(torch.uint8).fill_(0x81)
    out = run_wgrad(arch, x, unit(x_scale), y, unit(y_scale), offs, torch.float32)
    assert (out == -m * 2.0**-9).all(), float(out[0, 0, 0])


@pytest.mark.parametrize("arch", ARCHS)
def test_wgrad_masks_both_scales_of_a_block_past_its_group(arch):
    """Group 0 ends after one 32-row block, so its step's blocks 1-3 lie in group 1. Group 1's data
    is 0 and one operand's scales there are 2^123: if that operand's scale of such a block were not
    masked, group 0's sums would gain a block times 2^123 x 2^-127 (the other's masked scale), while
    group 1 stays 0 either way (its scale products 2^123 x 1 stay finite on gfx942)."""
    m, n, k, sizes = 128, 16, 32, [32, 96]
    for big in ("x", "y"):
        x, x_scale, y, y_scale, offs = make_wgrad_problem(m, n, k, sizes, seed=19)
        x.view(torch.uint8)[32:] = 0
        y.view(torch.uint8)[32:] = 0
        x_scale.view(torch.uint8)[:, 1:] = 250 if big == "x" else 127
        y_scale.view(torch.uint8)[:, 1:] = 250 if big == "y" else 127
        out = run_wgrad(arch, x, x_scale, y, y_scale, offs, torch.float32)
        ref, mag = expected_wgrad(x, x_scale, y, y_scale, offs)
        assert (ref[1] == 0).all() and (ref[0] != 0).any()
        check(out, ref, mag, m, torch.float32)


@pytest.mark.parametrize("arch", ARCHS)
def test_wgrad_unsigned_zero_operands(arch):
    """The weight gradient with signed_zeros=False operands: the same results; fewer instructions
    on gfx942. Group 0 ends mid-step: the step's other blocks (group 2's rows, one with a NaN
    scale) stay out of its sums."""
    m, n, k, sizes = 128, 32, 48, [64, 0, 64]
    gen = torch.Generator().manual_seed(13)
    xs, ys = torch.randn(m, k, generator=gen) * 4, torch.randn(m, n, generator=gen)
    xs[::3, :] = -0.0
    ys[5::7, :] = -1e-30
    ys[10, 4] = float("nan")  # group 0, y column 4: out[0, 4, :] NaN
    ys[100, 6] = float("nan")  # group 2, y column 6: out[2, 6, :] NaN, out[0, 6, :] not
    x, x_scale = R.mxfp8_quantize(xs, 0, "rceil", signed_zeros=False)
    y, y_scale = R.mxfp8_quantize(ys, 0, "rceil", signed_zeros=False)
    offs = torch.tensor(sizes, dtype=torch.int64).cumsum(0).to(torch.int32)
    ref, mag = expected_wgrad(x, x_scale, y, y_scale, offs)
    assert torch.isnan(ref[0, 4]).all() and torch.isnan(ref[2, 6]).all() and torch.isfinite(ref[0, 6]).all()
    counts = []
    for signed in (True, False):
        with emu.record() as launches, toolchain.target(arch):
            out = G.grouped_mm_wgrad(x, x_scale, y, y_scale, offs, arch=arch, out_dtype=torch.float32,
                                     signed_zeros=signed)
        check(out, ref, mag, 64, torch.float32)
        counts.append(launches[-1].stats.wave_instructions)
    assert counts[1] <= 0.75 * counts[0] if arch == "gfx942" else counts[1] == counts[0], counts


@pytest.mark.parametrize("arch", ARCHS)
def test_wgrad_untrusted_offsets_stay_inside_the_tensors(arch):
    """Unsorted, negative, past-M offs and group sizes that are not multiples of 32: no access
    outside the tensors (strict memory); a group past M is clamped to M."""
    x, x_scale, y, y_scale, _ = make_wgrad_problem(96, 16, 32, [96])
    for bad in ([40, 10, 1000], [-5, 30, 20], [96, 2**31 - 1, -(2**31)]):
        run_wgrad(arch, x, x_scale, y, y_scale, torch.tensor(bad, dtype=torch.int32))


# ---- the same checks on a real GPU ------------------------------------------------------------


def _device(*tensors):
    return [t.cuda() for t in tensors]


@pytest.mark.gpu
def test_gpu_matches_the_mx_definition():
    """On a real MI300X/MI355X: the forward on CASES (both scale layouts; on gfx950 also staged in
    LDS), the weight gradient on WGRAD_CASES and both with signed_zeros=False operands, for the
    device's arch, within the module docstring's bound of the same float64 model. flyquant.emu
    does not model wait states or timing, so this is the check of the compiled code's schedule."""
    arch = select._rocm_arch_of(0)
    for m, n, k, sizes, out_dtype in CASES:
        problem = make_problem(m, n, k, sizes)
        ref, mag = expected(*problem)
        for scale_layout, lds_stage in ((x, lds) for x in LAYOUTS for lds in {False, arch == "gfx950"}):
            out = run(arch, *_device(*problem), scale_layout, out_dtype, lds_stage=lds_stage).cpu()
            check(out, ref, mag, k, out_dtype)
    for m, n, k, sizes, out_dtype in WGRAD_CASES:
        problem = make_wgrad_problem(m, n, k, sizes)
        ref, mag = expected_wgrad(*problem)
        check(run_wgrad(arch, *_device(*problem), out_dtype).cpu(), ref, mag, max(sizes), out_dtype)
    m, n, k, sizes = 70, 32, 192, [20, 40, 10]
    a, a_scale, b, b_scale, offs = _unsigned_zero_operands(m, n, k, sizes, seed=12)
    ref, mag = expected(a, a_scale, b, b_scale, offs)
    out = run(arch, *_device(a, a_scale, b, b_scale, offs), None, torch.float32, signed_zeros=False).cpu()
    check(out, ref, mag, k, torch.float32)
