"""MXFP4 quantize kernels (kernels/mxfp4_quantize.py rowwise, kernels/mxfp4_quantize_cols.py
columnwise) against flyquant.reference, byte for byte,
executed under flyquant.emu for gfx950 (hardware scaled FP4 conversion) and gfx942 (software
conversion); `gpu`-marked tests repeat them on a real MI300X/MI355X. The layouts written in the
same pass (aiter's a16w4, mfma, a4w4) are tests/test_mxfp4_layout_kernels.py's.

A block worked by hand (floor, BF16): {6.0, -0.75, 1.25, 0.25, 0 ...}: amax 6 = 1.5 * 2^2 ->
code 2 - 2 + 127 = 127, elements unscaled: 6 -> 0x7, -0.75 -> -1.0 (tie to even) = 0xA,
1.25 -> 1.0 (tie to even) = 0x2, 0.25 -> 0 (tie to even) = 0x0: bytes 0xA7, 0x02, 0x00 ...
"""

from __future__ import annotations

import re

import pytest
import torch

import flyquant as fq
import flyquant.emu as emu
from flyquant import formats, reference, select, toolchain
from flyquant.kernels import _mxfp4_common as c4
from flyquant.kernels import mxfp4_quantize as k4
from flyquant.kernels import mxfp4_quantize_cols as kc
from flyquant.kernels import mxfp4_quantize_dual as kd

from test_reference_mxfp4 import fp4_blocks

ARCHS = ("gfx950", "gfx942")
WAVE_BLOCKS = 64  # blocks of a rowwise wave tile


def tile_copies(arch, dtype):
    """Tiles the plain rowwise kernel emits: with code lines, two in the pairs loop and one in
    the byte loop."""
    return 3 if k4.code_lines(arch, dtype, None, None) else 1
MODES = ("floor", "rceil", "even")
DTYPES = (torch.bfloat16, torch.float16, torch.float32)
U8 = torch.uint8
ALL = [(a, m, d) for a in ARCHS for m in MODES for d in DTYPES]
IDS = [f"{a}-{m}-{str(d).replace('torch.', '')}" for a, m, d in ALL]


def assert_same(got, want, what):
    for i, (g, w) in enumerate(zip(got, want)):
        assert g.dtype == w.dtype and tuple(g.shape) == tuple(w.shape) and g.stride() == w.stride(), (what, i)
        bad = (g.view(U8) != w.view(U8)).nonzero()
        assert bad.numel() == 0, f"{what} output {i}: {bad.shape[0]} bytes differ, first at {bad[:4].tolist()}"


def special_blocks(dtype) -> torch.Tensor:
    """(n, 32): the reference tests' crafted blocks (zeros, -0, subnormals, code-0 edges, dtype
    max, amax at 1.5 / 1.75 / 6 times powers of two, element ties, saturation) and non-finite
    ones (NaN, +-Inf among finite values, all NaN)."""
    blocks = list(fp4_blocks(dtype).values())
    ones = torch.ones(32, dtype=dtype)
    for i, v in ((3, float("nan")), (31, float("inf")), (0, -float("inf"))):
        b = ones.clone()
        b[i] = v
        blocks.append(b)
    blocks.append(torch.full((32,), float("nan"), dtype=dtype))
    worked = torch.zeros(32)
    worked[:4] = torch.tensor([6.0, -0.75, 1.25, 0.25])
    blocks.append(worked.to(dtype))
    return torch.stack(blocks)


def random_rows(m, k, dtype, seed):
    """Normal samples times 2^e, e per element in [-12, 12): scales vary within rows."""
    g = torch.Generator().manual_seed(seed)
    e = torch.randint(-12, 12, (m, k), generator=g).float()
    return (torch.randn(m, k, generator=g) * torch.exp2(e)).to(dtype)


NEG_NAN = {torch.float16: (torch.int16, -0x200), torch.bfloat16: (torch.int16, -0x40), torch.float32: (torch.int32, -0x400000)}


def put_neg_nan(x, i, j):
    """x[i, j] = -NaN (sign bit set; a float conversion may not keep a NaN's sign)."""
    view, bits = NEG_NAN[x.dtype]
    x.view(view)[i, j] = bits


def rows_tensor(dtype, k_blocks=3, extra_rows=40):
    """(rows, 32 * k_blocks): the special blocks first (block order is row-major), then random
    rows; 2+ waves' worth of blocks with a partial last tile."""
    special = special_blocks(dtype)
    pad = -special.shape[0] % k_blocks
    special = torch.cat([special, torch.zeros(pad, 32, dtype=dtype)]).reshape(-1, 32 * k_blocks)
    return torch.cat([special, random_rows(extra_rows, 32 * k_blocks, dtype, 1)]).contiguous()


@pytest.mark.parametrize("arch,mode,dtype", ALL, ids=IDS)
def test_rows(arch, mode, dtype):
    x = rows_tensor(dtype)
    assert_same(k4.quantize_rows(x, arch=arch, scaling_mode=mode), reference.mxfp4_quantize(x, -1, mode), "rows")


def test_worked_block():
    x = special_blocks(torch.bfloat16)[-1:]
    for arch in ARCHS:
        packed, scales = k4.quantize_rows(x, arch=arch, scaling_mode="floor")
        assert scales.view(U8).item() == 127
        assert packed[0, :3].tolist() == [0xA7, 0x02, 0x00] and (packed[0, 3:] == 0).all()


# Shapes with tails, each for a reason: one element; one partial block; a prime K (BF16 rows at
# 2-byte alignment, a partial last block per row); a prime M with K one block; K = 40 with a
# NaN in the partial block (padding nibbles stay 0); more rows than a tile; 35 blocks per row
# over 5 tiles (a block over lanes: the last block's third piece partial, with the odd K's last
# element, the fourth wholly past the row's end; rows at 2-byte alignment); K = 39 with a NaN in
# the partial block (7 elements: the last dword of BF16 codes holds 7 of its 8 nibbles); 60 blocks
# per row, 17 elements in the last (a 64-block tile whose only row end is in its last load).
TAIL_SHAPES = [(1, 1), (3, 17), (5, 67), (29, 32), (7, 40), (70, 33), (9, 1111), (4, 39), (3, 1905)]


@pytest.mark.parametrize("arch", ARCHS)
@pytest.mark.parametrize("dtype", DTYPES)
def test_tails(arch, dtype):
    mode = MODES[DTYPES.index(dtype)]  # one per dtype: the modes differ only in the scale rule (test_rows)
    for i, (m, k) in enumerate(TAIL_SHAPES):
        x = random_rows(m, k, dtype, seed=i)
        if k == 40:
            x[1, 37], x[4, 2] = float("nan"), -float("inf")
        if k == 39:
            x[2, 36] = float("nan")
        got = k4.quantize_rows(x, arch=arch, scaling_mode=mode)
        assert_same(got, reference.mxfp4_quantize(x, -1, mode), f"{(m, k)} {mode}")


# (arch, dtype, (M, K)): 2103 blocks (odd) = 33 tiles: 8 waves of 4 tiles wholly inside (code lines),
# the last wave's partial tile by bytes; tail variants (K % 32 != 0) the same way; gfx942 16-bit:
# bytes only (code_lines)
CODE_LINE_CASES = [("gfx950", torch.bfloat16, (701, 96)), ("gfx942", torch.float32, (701, 96)),
                   ("gfx950", torch.float32, (701, 90)), ("gfx942", torch.float32, (701, 90)),
                   ("gfx942", torch.bfloat16, (701, 96))]


@pytest.mark.parametrize("arch,dtype,shape", CODE_LINE_CASES, ids=[f"{a}-{str(d)[6:]}-{s[1]}" for a, d, s in CODE_LINE_CASES])
def test_code_lines(arch, dtype, shape):
    """Plain scales (k4.code_lines): waves whose tiles are all inside store two tiles' codes as
    whole 128-byte lines (a 2-byte store per lane after one DPP move between the lanes of
    adjacent blocks), the rest one byte per block; every code at its place, NaN/Inf blocks (0xFF) among them at odd
    and even blocks of both tiles of a pair and in the byte-stored end."""
    mode = "rceil" if dtype == torch.float32 else "floor"
    x = emu.aligned(random_rows(*shape, dtype, seed=41))
    special = special_blocks(dtype)
    x.view(-1)[:special.numel()] = special.flatten()  # blocks 0 ..: across the first pair's tiles when K = 96
    for r, c in ((130, 5), (131, 40), (300, 70), (700, 3)):
        x[r, c] = float("nan") if c % 2 else float("inf")
    with emu.device_like_allocations(), emu.record() as launches:
        got = k4.quantize_rows(x, arch=arch, scaling_mode=mode)
    assert_same(got, reference.mxfp4_quantize(x, -1, mode), f"{shape} {mode}")
    scales = got[1]
    nb = scales.numel()
    (r,) = launches
    lines = r.stats.traffic_within(scales.data_ptr(), scales.data_ptr() + nb)
    inside = 8 * 4 * WAVE_BLOCKS if tile_copies(arch, c4.TORCH_DTYPES[dtype]) > 1 else 0  # the 8 waves of whole tiles
    assert lines.bytes == nb and lines.lanes == inside // 2 + (nb - inside)
    assert r.stats.memory["buffer_store_byte"].bytes == nb - inside


def pattern_blocks(dtype, code, mode):
    """(n, 32) blocks whose scale code is `code` in `mode`: element 0 the largest value with that
    code (floor: exponent field code + 2, mantissa all ones; rceil: 6 * 2^(code - 127), FP16 at
    most 65504), the others every finite pattern of dtype whose magnitude is at most it, both
    signs and -0, so the element encoder sees each input it can meet under that scale."""
    bits = torch.arange(1 << 16, dtype=torch.int32).to(torch.int16).view(dtype)
    if mode == "floor":
        below = (bits.float().abs() < 2.0 ** (code + 3 - 127)) & bits.isfinite()
        amax = bits[below].float().abs().max().to(dtype)
    else:
        amax = torch.tensor(min(6.0 * 2.0 ** (code - 127), torch.finfo(dtype).max), dtype=dtype)
    elems = bits[bits.isfinite() & (bits.float().abs() <= amax.float())]
    elems = torch.cat([elems, torch.zeros(-elems.numel() % 31, dtype=dtype)]).reshape(-1, 31)
    return torch.cat([amax.expand(elems.shape[0], 1), elems], dim=1).contiguous()


# (dtype, code, mode): gfx942's 16-bit encoder at the ends of its range (BF16 c >= 4; FP16 c in
# [101, 140], subnormal FP16 multipliers from c = 131) and in the middle, and the FP32 encoder's
# wave-uniform fallback beyond it (BF16 c < 4, FP16 c = 141, reached by rceil from amax > 49152)
ENCODER_CASES = [(torch.bfloat16, c, "floor") for c in (1, 3, 4, 5, 127, 252)] + [
    (torch.float16, c, "floor") for c in (104, 118, 130, 131, 140)] + [(torch.float16, 141, "rceil"), (torch.bfloat16, 126, "even")]


@pytest.mark.parametrize("dtype,code,mode", ENCODER_CASES, ids=[f"{str(d)[6:]}-{c}-{m}" for d, c, m in ENCODER_CASES])
def test_encoder_all_patterns(dtype, code, mode):
    """Every 16-bit input pattern an element can have under a scale code, through the gfx942
    kernel (its packed FP16 encoder, or the FP32 one in the rare branch), byte for byte against
    the reference."""
    x = pattern_blocks(dtype, code, mode)
    want = reference.mxfp4_quantize(x, -1, mode)
    assert (want[1].view(U8) == code).all()
    assert_same(k4.quantize_rows(x, arch="gfx942", scaling_mode=mode), want, f"code {code}")


def fp16_amax_blocks():
    """(2^15, 32) FP16 blocks, block p's amax the FP16 pattern p (+0 .. NaN; the other elements
    random within it), and the normal ones alone with a lone 0, -0, subnormal, Inf and NaN block
    among them, and a lone -NaN past a block's first dword (gfx950's amax there is -NaN, whose
    sign the NaN flags mistook: scale 0xFF, elements not NaN): the packed FP16 scale rule
    (_mx_common.f16_scale_tops) on every amax, and a wave with one unusual block taking the exact
    rule."""
    amax = torch.arange(0x8000, dtype=torch.int16).view(torch.float16)
    g = torch.Generator().manual_seed(7)
    bound = amax.float().nan_to_num(0.0, posinf=0.0)
    rest = ((torch.rand(0x8000, 31, generator=g) * 2 - 1) * bound[:, None]).to(torch.float16)
    blocks = torch.cat([amax[:, None], rest], 1)
    lone = blocks[0x400:0x7C00].clone()
    for i, b in zip((3, 700, 1500, 2500, 4000), (0, 0x8000, 0x3FF, 0x7C00, 0x7E00)):
        lone[i] = torch.tensor(b, dtype=torch.int32).to(torch.int16).view(torch.float16)
    lone[5000, 11] = torch.tensor(0xFE00, dtype=torch.int32).to(torch.int16).view(torch.float16)
    return blocks, lone


@pytest.mark.parametrize("mode", MODES)
def test_fp16_every_amax_pattern(mode):
    """gfx950 FP16 rowwise: fp16_amax_blocks bit-exact against the reference, both scale rules run."""
    blocks, lone = fp16_amax_blocks()
    x = blocks.reshape(-1, 32 * 8).contiguous()
    with emu.record() as launches:
        got = k4.quantize_rows(x, arch="gfx950", scaling_mode=mode)
    assert [r.kernel for r in launches] == [f"mxfp4_rows_{mode}_fp16_gfx950_w4"]
    assert_same(got, reference.mxfp4_quantize(x, -1, mode), f"fp16 amax patterns, {mode}")
    # the exact rule widens each pair's two amaxes (v_cvt_f32_f16) in the 16 steps (of 128 blocks)
    # holding +0 and the 1024 subnormal and 1024 Inf/NaN patterns, only there
    steps = 0x8000 // (2 * WAVE_BLOCKS)
    assert 0 < launches[0].stats.by_opcode.get("v_cvt_f32_f16", 0) <= 2 * 17 < 2 * steps
    lone = lone.reshape(-1, 32 * 8).contiguous()
    assert_same(k4.quantize_rows(lone, arch="gfx950", scaling_mode=mode), reference.mxfp4_quantize(lone, -1, mode),
                f"lone unusual blocks, {mode}")


def cols_tensor(dtype, m=84, k=40):
    """(m, k) whose column blocks (32 rows of a column, column-major block order) start with the
    special blocks, then random values; m = 84: 3 row blocks (the last 20 rows), k = 40: 5
    (16-bit) or 10 (FP32) column groups, a partial column tile."""
    x = random_rows(m, k, dtype, seed=5)
    special = special_blocks(dtype)
    nb = m // 32
    for i in range(min(special.shape[0], nb * k)):
        col, blk = divmod(i, nb)
        x[32 * blk:32 * blk + 32, col] = special[i]
    return x.contiguous()


@pytest.mark.parametrize("arch,mode,dtype", ALL, ids=IDS)
def test_cols(arch, mode, dtype):
    x = cols_tensor(dtype)
    assert_same(kc.quantize_cols(x, arch=arch, scaling_mode=mode), reference.mxfp4_quantize(x, 0, mode), "cols")


# Columnwise tails: one element; 1 x 7 (16-bit: the last element at offset 0 of an odd row); a
# column of 3 rows (odd K = 1: the last row's load moved back); a column of 2 rows (16-bit: x's
# last dword whole, both rows' elements; row 0 was given row 1's); a prime M and K (rows at 2-byte
# alignment); M = 40 with a NaN in the partial row block; K = 4 (FP32: one column group); 544 x
# 136: tiles inside x (scalar row offsets) beside edge tiles in both directions, a NaN and an Inf
# inside; M = 39 with a NaN in the 7-row partial block. One mode per dtype (the modes differ only
# in the scale rule, which test_cols covers).
COL_TAIL_SHAPES = [(1, 1), (1, 7), (3, 1), (2, 1), (37, 67), (40, 9), (33, 4), (544, 136), (39, 5)]


@pytest.mark.parametrize("arch", ARCHS)
@pytest.mark.parametrize("dtype", DTYPES)
def test_cols_tails(arch, dtype):
    mode = MODES[DTYPES.index(dtype)]
    for i, (m, k) in enumerate(COL_TAIL_SHAPES):
        x = random_rows(m, k, dtype, seed=i)
        if (m, k) == (40, 9):
            x[37, 2], x[3, 8] = float("nan"), float("inf")
        if (m, k) == (544, 136):
            x[300, 20], x[40, 70], x[530, 130] = float("nan"), float("-inf"), float("inf")
        if (m, k) == (39, 5):
            x[35, 2] = float("nan")
        got = kc.quantize_cols(x, arch=arch, scaling_mode=mode)
        assert_same(got, reference.mxfp4_quantize(x, 0, mode), f"cols {(m, k)} {mode}")


DUAL = [(a, MODES[i % 3], d) for i, (a, d) in enumerate((a, d) for a in ARCHS for d in DTYPES)]


@pytest.mark.parametrize("arch,mode,dtype", DUAL, ids=[f"{a}-{m}-{str(d).replace('torch.', '')}" for a, m, d in DUAL])
def test_dual(arch, mode, dtype):
    """kernels/mxfp4_quantize_dual.py: both orientations in one launch, each byte-identical to the
    reference's (so to the rowwise and columnwise kernels'): the special blocks (as rows, and
    their values across the columns; NaN/Inf, -0, subnormals, saturation), an odd row count
    with a K tail (odd K: the 16-bit last element), one row, one column; K % 32 == 0 (the register
    kernel, but for FP32 on gfx942: the whole-line loads): an odd row count with an odd block
    count (the tile's second block past the row's end), and whole tiles; 300 x 544 (workgroups of
    256 rows x 256 columns: the last row tile with 44 rows, the last column group with 1 of its 4
    (FP32: 8) column tiles, the other waves' tiles past K), NaN and Inf in the second row tile's
    rows, a -NaN in the first; and with a K tail over groups; 39 x 71 (7 elements in the last
    block of a row and of a column) with NaN in both partial blocks."""
    emu.enable(arch)
    grouped = random_rows(300, 544, dtype, 13)
    grouped[260, 300], grouped[1, 540] = float("nan"), float("-inf")
    put_neg_nan(grouped, 5, 7)  # gfx950 16-bit: the amax keeps a NaN's sign, which the NaN test must ignore
    partial = random_rows(39, 71, dtype, 15)
    partial[35, 3], partial[2, 66] = float("nan"), float("inf")
    for x in (rows_tensor(dtype), random_rows(37, 75, dtype, 6), random_rows(1, 3221, dtype, 7),
              random_rows(2333, 1, dtype, 8), random_rows(67, 96, dtype, 11), random_rows(64, 128, dtype, 12),
              grouped, random_rows(290, 301, dtype, 14), partial):
        with emu.record() as launches:
            got = kd.quantize_dual(x, arch=arch, scaling_mode=mode)
        assert len(launches) == 1 and launches[0].kernel.startswith(f"mxfp4_dual_{mode}_{c4.TORCH_DTYPES[dtype]}_{arch}")
        shape = tuple(x.shape)
        assert_same(got[0], reference.mxfp4_quantize(x, -1, mode), f"dual rows {shape}")
        assert_same(got[1], reference.mxfp4_quantize(x, 0, mode), f"dual cols {shape}")


def test_dual_api():
    """fq.mxfp4_quantize_dual: one kernel launch (the op's plan), leading dims flattened, the
    outputs of fq.mxfp4_quantize on both axes; explain; bad input and empty input."""
    emu.enable("gfx950")
    x = random_rows(6, 70, torch.float16, seed=10).reshape(2, 3, 70)
    with emu.record() as launches:
        got = fq.mxfp4_quantize_dual(x, "even")
    assert [r.kernel for r in launches] == ["mxfp4_dual_even_fp16_gfx950_tail"]
    assert_same(got[0], reference.mxfp4_quantize(x, -1, "even"), "dual api rows")
    assert_same(got[1], reference.mxfp4_quantize(x, 0, "even"), "dual api cols")
    plan = fq.explain(fq.mxfp4_quantize_dual, x, "rceil")
    assert plan.backend == "flydsl" and plan.kernel == "mxfp4_dual_rceil_fp16_gfx950_tail"
    assert any("transposed through LDS" in r for r in plan.reasons)
    # K % 32 == 0 takes the register kernel (in_registers), and explain says so
    lined = fq.explain(fq.mxfp4_quantize_dual, x[..., :64].contiguous(), "rceil")
    assert any("in registers" in r for r in lined.reasons) and not any("transposed" in r for r in lined.reasons)
    with pytest.raises(ValueError, match="scaling_mode"):
        fq.mxfp4_quantize_dual(x, "ceil")
    with pytest.raises(ValueError, match="x must be contiguous"):
        fq.mxfp4_quantize_dual(x.transpose(0, 1))
    (d1, s1), (d0, s0) = fq.mxfp4_quantize_dual(torch.zeros(0, 70))
    assert d1.shape == (0, 48) and s1.shape == (0, 3) and d0.shape == (70, 0) and s0.shape == (70, 0)


@pytest.mark.parametrize("arch", ARCHS)
@pytest.mark.parametrize("dtype", ["bf16", "fp32"])
@pytest.mark.parametrize("tail", [True, False], ids=["tail", "lined"])
def test_compile_dual(arch, dtype, tail):
    """Dual: no scratch; per row block of the workgroup (8, unrolled) the tile's 16-byte loads once
    (tail: the lane's block, plus the 2-byte load of the last element for 16-bit x; lined: whole
    lines into LDS and 16-byte stores there, then the block's 16-byte LDS loads), 32 transposed
    LDS stores, 16-byte LDS loads of the column, the rowwise block into the shared stage, a
    barrier, a 16-byte load of the stage and data store (whole rowwise lines) and two code bytes
    per lane; then the column lines: per pass 8 16-byte LDS stores per lane, and 8 LDS loads and
    data stores in all."""
    torch_dtype = {"bf16": torch.bfloat16, "fp32": torch.float32}[dtype]
    x = torch.zeros(64, 256, dtype=torch_dtype)
    q1, s1, q0, s0 = (torch.zeros(s, dtype=U8) for s in ((64, 128), (64, 8), (256, 32), (256, 2)))
    (r,) = toolchain.compile_only(arch, kd.build_dual(arch, dtype, "even", tail), x, q1, s1, q0, s0, 64, 256, 8, 2,
                                  256 * x.element_size(), x.numel() * x.element_size(), 1, 1, stream=0)
    print(f"{r.name}: {r.vgprs} VGPRs, {r.sgprs} SGPRs, spills {r.spills}, LDS {r.lds_bytes}, {r.workgroups_per_cu()} workgroups/CU")
    loads = 8 if dtype == "fp32" else 4
    eb = x.element_size()
    wave_lds = max(32 * (kd.TILE_COLS * eb + kd.LDS_PAD), kd.TILE_COLS * (32 * eb + kd.LDS_PAD))
    passes = 1 if dtype == "fp32" else 2  # 64 columns' 144-byte staged lines fit the FP32 tile, 32 the 16-bit one
    assert r.spills == 0 and r.lds_bytes == 4 * wave_lds + 2 * 32 * 144  # 4 waves' tiles, the double row stage
    blocks = 8
    assert r.count("buffer_load_dwordx4") == blocks * loads
    assert r.count("buffer_load_ushort") == (blocks if tail and dtype == "bf16" else 0)
    assert r.count("ds_write_b128") == blocks * (1 + (0 if tail else loads)) + passes * 8
    assert r.count("ds_read_b128") == blocks * ((loads if tail else 2 * loads) + 1) + 8
    writes = 2 * r.count("ds_write2_b32") if dtype == "fp32" else r.count("ds_write_b16") + r.count("ds_write_b16_d16_hi")
    assert writes == blocks * 32
    assert r.count("s_barrier") == blocks
    assert r.count("buffer_store_dwordx4") == blocks + 8 and r.count("buffer_store_byte") == 2 * blocks
    assert r.workgroups_per_cu() >= (1 if (arch, dtype) == ("gfx942", "fp32") else 2)


@pytest.mark.parametrize("arch", ARCHS)
@pytest.mark.parametrize("dtype", ["bf16", "fp16", "fp32"])
def test_compile_dual_registers(arch, dtype):
    """The dual's register kernel (mxfp4_quantize_cols.build_cols(dual=True); K % 32 == 0): no
    scratch, no AGPRs; the lane's 32 row loads once per path (inner tile, edge tile); its rowwise
    data into the stage (16-bit: 32 dwords, mostly as ds_write2_b32, gfx942 once more for the rare
    FP32 conversion; FP32: 32 ds_write_b16), plus the rare path's NaN rows (32 more); one barrier, then 8 (FP32: 4) 16-byte stage reads and line
    stores; per column a data store and a code byte, per own row a code byte."""
    torch_dtype = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}[dtype]
    x = torch.zeros(256, 256, dtype=torch_dtype)
    eb = x.element_size()
    q1, s1, q0, s0 = (torch.zeros(s, dtype=U8) for s in ((256, 128), (256, 8), (256, 128), (256, 8)))
    launch = kc.build_cols(arch, dtype, "even", False, kc.dual_waves(eb), True)
    (r,) = toolchain.compile_only(arch, launch, x, q0, s0, q1, s1, 256, 256, 8, 8, 256 * eb, 1, 1, stream=0)
    print(f"{r.name}: {r.vgprs} VGPRs, {r.sgprs} SGPRs, spills {r.spills}, LDS {r.lds_bytes}, {r.workgroups_per_cu()} workgroups/CU")
    cols, own, lines = (4, 4, 4) if dtype == "fp32" else (8, 8, 8)
    assert r.spills == 0 and r.vgprs <= 256 and "accvgpr" not in r.isa and r.lds_bytes == 256 * 128
    assert r.count("buffer_load_dwordx4") == 2 * 32
    paths = 2 if arch == "gfx942" and dtype != "fp32" else 1  # gfx942 16-bit: the encoder's and the FP32 fallback's
    if dtype == "fp32":
        assert r.count("ds_write_b16") == 2 * 32
    else:  # (pairs of rows 128 bytes apart merged; LLVM may merge the two paths' last stores)
        assert 64 <= 2 * r.count("ds_write2_b32") + r.count("ds_write_b32") <= 32 * paths + 32
    assert r.count("s_barrier") == 1 and r.count("ds_read_b128") == lines
    assert r.count("buffer_store_dwordx4") == cols + lines and r.count("buffer_store_byte") == cols + own
    assert ("v_cvt_scalef32" in r.isa) == (arch == "gfx950")


@pytest.mark.parametrize("exp_field", [0, 1, 2, 3, 4, 127, 200, 254])
def test_rceil_is_an_amax_mantissa_threshold(exp_field):
    """The kernel's rceil rule on amax's FP32 bits, code = max(eb - 2 + [mantissa > 0x400000], 0)
    except code 0 for amax 0x01400001, equals the contract's e8m0_rceil(amax * fl32(1/6)) for every
    amax with this exponent field (all 2^23 mantissas). Normal descales scale exactly by powers of
    two, so the binades listed stand for all; eb <= 3 give subnormal descales (eb = 2 holds the
    exception)."""
    mant = torch.arange(1 << 23, dtype=torch.int32)
    bits = (exp_field << 23) | mant
    want = formats.e8m0_rceil(bits.view(torch.float32) * formats.f32_reciprocal(formats.E2M1_MAX)).to(torch.int32)
    rule = (exp_field - 2 + (mant > c4.E2M1_RCEIL_MANT).to(torch.int32)).clamp(min=0)
    rule = torch.where(bits == c4.E2M1_RCEIL_TIE, 0, rule)
    assert torch.equal(rule, want)


@pytest.mark.parametrize("arch", ARCHS)
def test_rceil_exception_reaches_the_kernels(arch):
    """FP32 blocks whose amax is 0x01400001 (rceil's one exception to its mantissa threshold: code
    0, not 1) or its neighbours, negative too, alone in their block: rowwise, columnwise and dual
    byte-identical to the reference, and the exception's scale code 0."""
    tie = c4.E2M1_RCEIL_TIE
    x = torch.zeros(64, 64)
    # each alone in its row block and its column block
    for row, col, bits, sign in ((0, 0, tie, 1), (33, 33, tie - 1, 1), (40, 10, tie + 1, 1), (63, 63, tie, -1)):
        x[row, col] = sign * torch.tensor(bits, dtype=torch.int32).view(torch.float32)
    rows, cols = reference.mxfp4_quantize(x, -1, "rceil"), reference.mxfp4_quantize(x, 0, "rceil")
    assert rows[1].view(U8)[0, 0] == 0 and cols[1].view(U8)[0, 0] == 0  # the exception's code
    assert_same(k4.quantize_rows(x, arch=arch, scaling_mode="rceil"), rows, "rows")
    assert_same(kc.quantize_cols(x, arch=arch, scaling_mode="rceil"), cols, "cols")
    dual = kd.quantize_dual(x, arch=arch, scaling_mode="rceil")
    assert_same(dual[0], rows, "dual rows")
    assert_same(dual[1], cols, "dual cols")


def test_launch_size_limits():
    """The kernels address x and their outputs with 32-bit offsets: the columnwise and dual
    launchers' too_large names the first (M, K) whose x, or whose packed data (16 bytes per block:
    8x a BF16 K = 1 row), reaches 2 GiB, and takes the one below it; the rowwise launcher takes
    larger tensors in row chunks, and refuses only where one chunk's multiple of rows (1, 256 for
    the "mfma" scales, N for a16w4's experts) reaches 2 GiB."""
    bf16 = torch.bfloat16
    assert kd.too_large((2**27 - 1, 1), bf16) is None
    assert "data (2147483648 bytes)" in kd.too_large((2**27, 1), bf16)
    assert kc.too_large((2**30 - 257, 1), bf16) is None  # x plus 256 rows: 2^31 - 2 bytes
    assert "x plus 256 rows (2147483648 bytes)" in kc.too_large((2**30 - 256, 1), bf16)
    assert k4.too_large((2**27, 1), bf16) is None and k4.too_large((2**15, 2**15), bf16) is None  # row chunks
    assert k4.rows_per_launch((2**27, 1), bf16, 1) == 2**27 - 1  # data rows of 16 bytes
    assert k4.too_large((1, 2**30 - 1), bf16) is None
    assert "1 row(s) of x or of its data (2147483648 bytes each)" in k4.too_large((1, 2**30), bf16)
    assert k4.too_large((512, 2**22 - 32), bf16, 256) is None
    assert "256 row(s)" in k4.too_large((512, 2**22), bf16, 256)


@pytest.mark.parametrize("arch", ARCHS)
def test_rows_in_chunks(arch, monkeypatch):
    """The rowwise kernel takes a tensor of 2 GiB or more in row chunks, one launch each on views
    of x and of the outputs (the "mfma" scales: chunks of whole 256-row tiles; a16w4: whole
    experts). A 40 KiB limit splits (600, 70) FP32 (a K tail; 280-byte rows) into 146-row chunks,
    (512, 64) BF16 with the "mfma" scales into 2 x 256 rows (with them a4w4's data too), a4w4 with
    plain scales into whole 16-row tiles (304 + 208 rows), and three
    (64, 256) BF16 experts with the a16w4 gate_up shuffle into one expert a launch; the bytes are
    the reference's."""
    monkeypatch.setattr(k4.mx, "MAX_LAUNCH_BYTES", 40 * 1024)
    emu.enable(arch)
    x = random_rows(600, 70, torch.float32, seed=41)
    x[300, :70] = float("nan")
    y = random_rows(512, 64, torch.bfloat16, seed=42)
    w = random_rows(3 * 64, 256, torch.bfloat16, seed=43).reshape(3, 64, 256)
    cases = [(lambda: fq.mxfp4_quantize(x, scaling_mode="rceil"), reference.mxfp4_quantize(x, -1, "rceil"), 5),
             (lambda: fq.mxfp4_quantize_3d(w, "floor", "a16w4", True),
              reference.mxfp4_quantize_3d(w, "floor", "a16w4", True), 3)]
    cases += [(lambda s=s: fq.mxfp4_quantize(y, scaling_mode="even", scale_layout="mfma", shuffle=s),
               reference.mxfp4_quantize(y, -1, "even", "mfma", s), 2) for s in (None, "a4w4")]
    cases.append((lambda: fq.mxfp4_quantize(y, scaling_mode="even", shuffle="a4w4"),
                  reference.mxfp4_quantize(y, -1, "even", None, "a4w4"), 2))
    for run, want, count in cases:
        with emu.record() as launches:
            assert_same(run(), want, f"{count} chunks")
        assert len(launches) == count
    plan = fq.explain(fq.mxfp4_quantize_3d, w, shuffle="a16w4", gate_up=True)
    assert plan.backend == "flydsl" and "3 launches of up to 64 rows (whole experts)" in " ".join(plan.reasons), plan


def test_a16w4_chunks_are_whole_experts(monkeypatch):
    """A launch limit of 1.5 experts (96 rows of 512 bytes): the a16w4 chunks are still whole
    experts (64 rows, 3 launches), not any multiple of the layout's 32-row tiles, whose output
    would start mid-expert."""
    monkeypatch.setattr(k4.mx, "MAX_LAUNCH_BYTES", 96 * 512 + 1)
    emu.enable("gfx950")
    w = random_rows(3 * 64, 256, torch.bfloat16, seed=43).reshape(3, 64, 256)
    with emu.record() as launches:
        got = fq.mxfp4_quantize_3d(w, "floor", "a16w4", True)
    assert_same(got, reference.mxfp4_quantize_3d(w, "floor", "a16w4", True), "a16w4 chunks")
    assert len(launches) == 3


def test_api_op_plan_and_errors():
    """fq.mxfp4_quantize runs the kernel under the emulator (the op's plan), leading dims
    flattened; quantize_mxfp4 keeps them; bad input is the reference's ValueError."""
    emu.enable("gfx950")
    x = random_rows(6, 64, torch.bfloat16, seed=9).reshape(2, 3, 64)
    with emu.record() as launches:
        got = fq.mxfp4_quantize(x, scaling_mode="even")
    assert [r.kernel for r in launches] == ["mxfp4_rows_even_bf16_gfx950_w1"]
    assert_same(got, reference.mxfp4_quantize(x, -1, "even"), "api")
    packed, scales = fq.quantize_mxfp4(x)
    assert packed.shape == (2, 3, 32) and scales.shape == (2, 3, 2)
    plan = fq.explain(fq.mxfp4_quantize, x)
    assert plan.backend == "flydsl" and plan.kernel == "mxfp4_rows_floor_bf16_gfx950"
    plan = fq.explain(fq.mxfp4_quantize, x, axis=0)
    assert plan.backend == "flydsl" and plan.kernel == "mxfp4_cols_floor_bf16_gfx950"
    with emu.record() as launches:
        got = fq.mxfp4_quantize(x, axis=0, scaling_mode="rceil")
    assert [r.kernel for r in launches] == ["mxfp4_cols_rceil_bf16_gfx950_w1"]
    assert_same(got, reference.mxfp4_quantize(x, 0, "rceil"), "api cols")
    for bad, match in (((x.transpose(0, 1),), "x must be contiguous"), ((x, -1, "ceil"), "scaling_mode"),
                       ((x.int(),), "x must have dtype")):
        with pytest.raises((ValueError, TypeError), match=match):
            fq.mxfp4_quantize(*bad)
    empty = fq.mxfp4_quantize(torch.zeros(0, 70))
    assert empty[0].shape == (0, 48) and empty[1].shape == (0, 3)


def _compile(arch, dtype, mode, tail):
    torch_dtype = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}[dtype]
    x = torch.zeros(64, 256, dtype=torch_dtype)
    q, s = torch.zeros(64, 128, dtype=U8), torch.zeros(64, 8, dtype=U8)
    (r,) = toolchain.compile_only(arch, k4.build_rows(arch, dtype, mode, tail), x, q, s, 512, 2, 8,
                                  256 * x.element_size(), 256, 0, 3, x.numel() * x.element_size(), 1, 0, 0, 512, 0, 0,
                                  1, stream=0)
    return r


@pytest.mark.parametrize("arch", ARCHS)
@pytest.mark.parametrize("dtype", ["bf16", "fp16", "fp32"])
def test_compile(arch, dtype):
    """The tail variant (K % 32 != 0; a block over lanes as test_compile_lined, plus the row
    division and masks per piece): no scratch; per tile (tile_copies of it) 16-byte loads
    (16-bit: and the 2-byte load of the last element), a 4-byte (FP32: 2-byte) data store per
    piece; one code byte store (code lines: and one 2-byte store); the scaled FP4 conversion on
    gfx950 and none on gfx942 (which has no such instruction)."""
    cvt = "v_cvt_scalef32_pk_fp4_" + {"bf16": "bf16", "fp16": "f16", "fp32": "f32"}[dtype]
    for mode, tail in (("even", True),):
        r = _compile(arch, dtype, mode, tail)
        print(f"{r.name}: {r.vgprs} VGPRs, {r.sgprs} SGPRs, spills {r.spills}")
        assert r.spills == 0 and r.lds_bytes == 0, r.name
        loads = 8 if dtype == "fp32" else 4  # pieces of 16 bytes
        copies, lines = tile_copies(arch, dtype), int(k4.code_lines(arch, dtype, None, None))
        assert r.count("buffer_load_dwordx4") == copies * loads, r.name
        assert sum(r.count(f"buffer_load_{w}") for w in ("dword", "dwordx2", "dwordx3", "ubyte")) == 0, r.name
        assert r.count("buffer_load_ushort") == (copies if tail and dtype != "fp32" else 0), r.name  # the last element
        if dtype == "fp32":
            assert r.count("buffer_store_short") == copies * loads + lines, r.name
        else:
            assert r.count("buffer_store_dword") == copies * loads and r.count("buffer_store_short") == lines, r.name
        assert r.count("buffer_store_dwordx4") == 0 and r.count("buffer_store_byte") == 1, r.name
        redo = 2 if (arch, dtype) == ("gfx950", "bf16") else 1  # BF16 read as FP16: the exact-amax path converts too
        assert r.count(cvt) == (redo * copies * 16 if arch == "gfx950" else 0), r.name  # two elements each
        assert ("v_cvt_scalef32" in r.isa) == (arch == "gfx950"), r.name
        if arch == "gfx942" and dtype != "fp32":  # the packed FP16 encoder: three terms per pair
            assert r.count("v_pk_fma_f16") == copies * 3 * 16 and r.count("v_pk_min_f16") == copies * 2 * 16, r.name
            assert ".amdhsa_float_denorm_mode_16_64 3" in r.isa  # FP16 subnormal multipliers kept


@pytest.mark.parametrize("arch", ARCHS)
@pytest.mark.parametrize("dtype", ["bf16", "fp32"])
def test_compile_lined(arch, dtype):
    """The rowwise kernel with a block over lanes (K % 32 == 0): no scratch; per lane and tile
    (tile_copies of it) one 16-byte load per piece (4 or 8), a 4-byte (FP32: 2-byte) data store
    per piece; the codes one byte each or two tiles' in one 2-byte store (test_code_lines); the
    block's amax and operand exchanged with gfx950's permlane swaps or gfx942's DPP; gfx950 16-bit:
    the two-tile steps run only where both tiles lie inside x, so the second tile's 4 KiB is the
    scalar offset of its loads (no VALU add for their address)."""
    r = _compile(arch, dtype, "floor", False)
    print(f"{r.name}: {r.vgprs} VGPRs, {r.sgprs} SGPRs, spills {r.spills}")
    n = tile_copies(arch, dtype) * (8 if dtype == "fp32" else 4)
    assert r.spills == 0 and r.lds_bytes == 0
    assert r.count("buffer_load_dwordx4") == n and r.count("buffer_store_byte") == 1
    assert r.count("buffer_store_short") == (n if dtype == "fp32" else 0) + k4.code_lines(arch, dtype, None, None)
    assert dtype == "fp32" or r.count("buffer_store_dword") == n
    assert r.count("buffer_store_dwordx4") == 0
    assert (r.count("v_permlane32_swap_b32_e32") > 0) == (arch == "gfx950")
    assert (r.isa.count("quad_perm") == 1) == (arch == "gfx950")  # gfx950: DPP only for the code lines (distance 1)
    pair_steps = arch == "gfx950" and dtype != "fp32"
    assert len(re.findall(r"buffer_load_dwordx4 .*, s\d+ offen", r.isa)) == (4 if pair_steps else 0)


@pytest.mark.parametrize("arch", ARCHS)
@pytest.mark.parametrize("dtype", ["bf16", "fp16", "fp32"])
def test_compile_cols(arch, dtype):
    """Columnwise: no scratch; 32 16-byte row loads (odd: plus the 2-byte load of the last
    element; the plain variant has them twice: tiles inside x with 28 of them at a scalar row
    offset, edge tiles with every row's offset range-checked), one 16-byte data store and one
    code byte per column; the scaled FP4 conversion on gfx950 only."""
    torch_dtype = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}[dtype]
    cvt = "v_cvt_scalef32_pk_fp4_" + {"bf16": "bf16", "fp16": "f16", "fp32": "f32"}[dtype]
    x = torch.zeros(256, 256, dtype=torch_dtype)
    q, s = torch.zeros(256, 128, dtype=U8), torch.zeros(256, 8, dtype=U8)
    cols = 16 // x.element_size()
    for odd in (False, True) if dtype != "fp32" else (False,):  # 16-bit odd K: the realigned loads
        (r,) = toolchain.compile_only(arch, kc.build_cols(arch, dtype, "floor", odd), x, q, s, 256, 256, 8, 256 * x.element_size(),
                                      8, 2, 4, 0, 2, 1,
                                      stream=0)
        print(f"{r.name}: {r.vgprs} VGPRs, {r.sgprs} SGPRs, spills {r.spills}, {r.workgroups_per_cu()} workgroups/CU")
        assert r.spills == 0 and r.lds_bytes == 0, r.name
        assert r.count("buffer_load_dwordx4") == (32 if odd else 64) and r.count("buffer_load_ushort") == int(odd), r.name
        assert len(re.findall(r"buffer_load_dwordx4 .*, s\d+ offen", r.isa)) == (0 if odd else 28), r.name
        assert r.count("buffer_store_dwordx4") == cols and r.count("buffer_store_byte") == cols, r.name
        assert r.count(cvt) == (16 * cols if arch == "gfx950" else 0), r.name
        assert ("v_cvt_scalef32" in r.isa) == (arch == "gfx950"), r.name


@pytest.mark.parametrize("arch", ARCHS)
def test_instructions_and_coalescing(arch):
    """Executed wave-instructions per element (printed); loads of whole lines and all data stores
    fully coalesced (rowwise, also with the a4w4 and a16w4 (gate_up) shuffles: 4-byte stores of
    a piece each, FP32 2-byte ones; columnwise and dual: 16-byte stores); the codes of the plain rowwise
    kernel on gfx950 in whole lines (test_code_lines), the others one byte each."""
    x = emu.aligned(random_rows(128, 4096, torch.bfloat16, seed=3))
    xc = emu.aligned(random_rows(2048, 256, torch.bfloat16, seed=4))  # 8 row blocks: whole wave tiles
    x32 = emu.aligned(random_rows(64, 1024, torch.float32, seed=5))
    with emu.device_like_allocations(), emu.record() as launches:
        outs = [k4.quantize_rows(x, arch=arch, scaling_mode="rceil"),
                kc.quantize_cols(xc, arch=arch, scaling_mode="rceil"),
                k4.quantize_rows(x, arch=arch, scaling_mode="rceil", shuffle="a4w4", scale_layout="mfma"),  # lanes in unit order
                k4.quantize_rows(x, arch=arch, scaling_mode="rceil", shuffle="a16w4_gate_up", rows_per_expert=64),  # E = 2
                k4.quantize_rows(x32, arch=arch, scaling_mode="rceil", shuffle="a4w4", scale_layout="mfma"),
                k4.quantize_rows(x32, arch=arch, scaling_mode="rceil", shuffle="a16w4_gate_up", rows_per_expert=32)]  # E = 2
    for i, (r, t, (data, scales)) in enumerate(zip(launches, (x, xc, x, x, x32, x32), outs)):
        mem = r.stats.memory
        d, sc = (r.stats.traffic_within(o.data_ptr(), o.data_ptr() + o.numel()) for o in (data, scales))
        print(f"{r.kernel} {tuple(t.shape)}: {r.stats.wave_instructions} wave-instructions, "
              f"{r.stats.wave_instructions / t.numel():.4f} per element; coalescing "
              + ", ".join(f"{n} {c.coalescing:.3f}" for n, c in mem.items()) + f"; codes {sc.coalescing:.3f}")
        assert d.bytes == t.numel() // 2 and d.coalescing == 1.0
        assert sc.bytes == t.numel() // 32 and (sc.coalescing == 1.0) == (i == 0 and arch == "gfx950")
        assert mem["buffer_load_dwordx4"].bytes == t.numel() * t.element_size()
        assert mem["buffer_load_dwordx4"].coalescing == 1.0  # whole lines (rowwise: a block over 4 lanes)
    # dual: both orientations' data in whole lines (M and K multiples of 256: every row's and
    # column's data starts on a line), the codes a byte each
    xd = emu.aligned(random_rows(512, 512, torch.bfloat16, seed=6))
    with emu.device_like_allocations(), emu.record() as launches:
        dual = kd.quantize_dual(xd, arch=arch, scaling_mode="rceil")
    (r,) = launches
    print(f"{r.kernel} {tuple(xd.shape)}: {r.stats.wave_instructions / xd.numel():.4f} wave-instructions per element")
    for data, scales in dual:
        d = r.stats.traffic_within(data.data_ptr(), data.data_ptr() + data.numel())
        assert d.bytes == xd.numel() // 2 and d.coalescing == 1.0 and d.partial_store_lines == 0
    assert r.stats.memory["buffer_load_dwordx4"].coalescing == 1.0


@pytest.mark.gpu
@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("dtype", DTYPES)
def test_gpu(mode, dtype):
    arch = select._rocm_arch_of(0)
    for x in (rows_tensor(dtype), random_rows(5, 67, dtype, 0)):
        got = k4.quantize_rows(x.cuda(), arch=arch, scaling_mode=mode)
        assert_same([t.cpu() for t in got], reference.mxfp4_quantize(x, -1, mode), f"gpu {arch}")
    for x in (cols_tensor(dtype), random_rows(37, 67, dtype, 0), random_rows(1, 7, dtype, 0)):
        got = kc.quantize_cols(x.cuda(), arch=arch, scaling_mode=mode)
        assert_same([t.cpu() for t in got], reference.mxfp4_quantize(x, 0, mode), f"gpu cols {arch}")
    for x in (rows_tensor(dtype), random_rows(37, 75, dtype, 6)):
        got = kd.quantize_dual(x.cuda(), arch=arch, scaling_mode=mode)
        for axis, pair in zip((-1, 0), got):
            assert_same([t.cpu() for t in pair], reference.mxfp4_quantize(x, axis, mode), f"gpu dual {axis} {arch}")
    x = random_rows(48, 320, dtype, 2)
    got = fq.mxfp4_quantize(x.cuda(), scaling_mode=mode, scale_layout="mfma", shuffle="a4w4")
    assert_same([t.cpu() for t in got], reference.mxfp4_quantize(x, -1, mode, "mfma", "a4w4"), f"gpu a4w4 {arch}")
    w = random_rows(2 * 64, 256, dtype, 1).reshape(2, 64, 256)
    for gate_up in (False, True):
        got = fq.mxfp4_quantize_3d(w.cuda(), mode, shuffle="a16w4", gate_up=gate_up)
        assert_same([t.cpu() for t in got], reference.mxfp4_quantize_3d(w, mode, "a16w4", gate_up), f"gpu 3d {arch}")
