"""MXFP4 quantize kernels (kernels/mxfp4_quantize.py rowwise, kernels/mxfp4_quantize_cols.py
columnwise) against flyquant.reference, byte for byte,
executed under flyquant.emu for gfx950 (hardware scaled FP4 conversion) and gfx942 (software
conversion); `gpu`-marked tests repeat them on a real MI300X/MI355X.

A block worked by hand (floor, BF16): {6.0, -0.75, 1.25, 0.25, 0 ...}: amax 6 = 1.5 * 2^2 ->
code 2 - 2 + 127 = 127, elements unscaled: 6 -> 0x7, -0.75 -> -1.0 (tie to even) = 0xA,
1.25 -> 1.0 (tie to even) = 0x2, 0.25 -> 0 (tie to even) = 0x0: bytes 0xA7, 0x02, 0x00 ...
"""

from __future__ import annotations

import pytest
import torch

import flyquant as fq
import flyquant.emu as emu
from flyquant import formats, layouts, reference, toolchain
from flyquant.kernels import _mxfp4_common as c4
from flyquant.kernels import mxfp4_quantize as k4
from flyquant.kernels import mxfp4_quantize_cols as kc
from flyquant.kernels import mxfp4_quantize_dual as kd

import oracles
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
# element, the fourth wholly past the row's end; rows at 2-byte alignment).
TAIL_SHAPES = [(1, 1), (3, 17), (5, 67), (29, 32), (7, 40), (70, 33), (9, 1111)]


@pytest.mark.parametrize("arch", ARCHS)
@pytest.mark.parametrize("dtype", DTYPES)
def test_tails(arch, dtype):
    mode = MODES[DTYPES.index(dtype)]  # one per dtype: the modes differ only in the scale rule (test_rows)
    for i, (m, k) in enumerate(TAIL_SHAPES):
        x = random_rows(m, k, dtype, seed=i)
        if k == 40:
            x[1, 37], x[4, 2] = float("nan"), -float("inf")
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
# column of 3 rows (odd K = 1: the last row's load moved back); a prime M and K (rows at 2-byte
# alignment); M = 40 with a NaN in the partial row block; K = 4 (FP32: one column group). One
# mode per dtype (the modes differ only in the scale rule, which test_cols covers).
COL_TAIL_SHAPES = [(1, 1), (1, 7), (3, 1), (37, 67), (40, 9), (33, 4)]


@pytest.mark.parametrize("arch", ARCHS)
@pytest.mark.parametrize("dtype", DTYPES)
def test_cols_tails(arch, dtype):
    mode = MODES[DTYPES.index(dtype)]
    for i, (m, k) in enumerate(COL_TAIL_SHAPES):
        x = random_rows(m, k, dtype, seed=i)
        if (m, k) == (40, 9):
            x[37, 2], x[3, 8] = float("nan"), float("inf")
        got = kc.quantize_cols(x, arch=arch, scaling_mode=mode)
        assert_same(got, reference.mxfp4_quantize(x, 0, mode), f"cols {(m, k)} {mode}")


@pytest.mark.parametrize("arch", ARCHS)
@pytest.mark.parametrize("gate_up", [False, True])
def test_3d_a16w4_shuffle_is_aiters(arch, gate_up):
    """fq.mxfp4_quantize_3d(w, shuffle="a16w4") writes in one launch the bytes of aiter's own
    shuffle_weight_a16w4 / shuffle_scale_a16w4 (aiter/ops/shuffle.py, loaded by path) applied to
    the plain quantize (E = 3, N = 64: two 32-row scale tiles, two gate/up halves of 32; K = 512:
    two 256-wide scale tiles, a NaN block among them); without the shuffle it is quantize_mxfp4."""
    aiter = oracles.aiter_shuffle()
    emu.enable(arch)
    w = random_rows(3 * 64, 512, torch.bfloat16, seed=11).reshape(3, 64, 512)
    w[1, 40, 300] = float("nan")
    packed, scales = reference.quantize_mxfp4(w, "even")
    want = (aiter.shuffle_weight_a16w4(packed, 16, gate_up).reshape(packed.shape),
            aiter.shuffle_scale_a16w4(scales.view(3 * 64, 16), 3, gate_up).view(3, 64, 16))  # aiter: (E*N, K/32)
    with emu.record() as launches:
        got = fq.mxfp4_quantize_3d(w, "even", shuffle="a16w4", gate_up=gate_up)
    (launch,) = launches
    assert launch.kernel.startswith(f"mxfp4_rows_even_bf16_{arch}_a16w4{'_gate_up' if gate_up else ''}_w")
    assert_same(got, want, "a16w4")
    assert_same(reference.mxfp4_quantize_3d(w, "even", "a16w4", gate_up), want, "reference a16w4")
    if not gate_up:
        assert_same(fq.mxfp4_quantize_3d(w[:, :, :500].contiguous(), "rceil"),
                    reference.quantize_mxfp4(w[:, :, :500].contiguous(), "rceil"), "3d plain")
    for kwargs, match in ((dict(shuffle="a16w4x"), "shuffle must be one of"), (dict(gate_up=True), "gate_up=True"),
                          (dict(shuffle="a16w4", gate_up=1), "gate_up must be a bool")):
        with pytest.raises(ValueError, match=match):
            fq.mxfp4_quantize_3d(w, **kwargs)
    with pytest.raises(ValueError, match=r"w.shape\[2\] \(K, for the a16w4 shuffle\) = 480"):
        fq.mxfp4_quantize_3d(w[:, :, :480].contiguous(), shuffle="a16w4")
    with pytest.raises(ValueError, match=r"w.shape\[1\] \(N"):
        fq.mxfp4_quantize_3d(w[:, :48].contiguous(), shuffle="a16w4")


A16W4_CASES = [(a, d, MODES[i % 3]) for i, (a, d) in enumerate((a, d) for a in ARCHS for d in DTYPES)]


@pytest.mark.parametrize("arch,dtype,mode", A16W4_CASES, ids=[f"{a}-{str(d)[6:]}-{m}" for a, d, m in A16W4_CASES])
def test_3d_a16w4_lined(arch, dtype, mode):
    """The a16w4 shuffle with a block over lanes (each wave quantizes one 16-row x 4-block tile of
    the output order, gate_up's row tiles permuted; 16-bit: a register spans 2 blocks of 8 rows,
    FP32: 8 blocks of 8 rows),
    against the reference shuffles (checked against aiter's above): odd E = 3 and N = 96 (odd N1 =
    3 scale row tiles, gate/up halves of 48 rows: a 16-row tile pair straddles them), K = 768 (K0
    = 6 tiles per row tile, odd K1 = 3), the special blocks in expert 1 (NaN/Inf, subnormals,
    saturation, -0), tiles past the end dropped (36 tiles over whole waves)."""
    emu.enable(arch)
    w = random_rows(3 * 96, 768, dtype, seed=31).reshape(3, 96, 768)
    special = special_blocks(dtype)
    w[1].view(-1, 32)[5:5 + special.shape[0]] = special
    for gate_up in (False, True):
        with emu.record() as launches:
            got = fq.mxfp4_quantize_3d(w, mode, shuffle="a16w4", gate_up=gate_up)
        (launch,) = launches
        assert launch.kernel.startswith(f"mxfp4_rows_{mode}_{c4.TORCH_DTYPES[dtype]}_{arch}_a16w4{'_gate_up' if gate_up else ''}_w")
        assert_same(got, reference.mxfp4_quantize_3d(w, mode, "a16w4", gate_up), f"a16w4 gate_up={gate_up}")


def _aiter_e8m0_shuffle(aiter, scales):
    """aiter's e8m0_shuffle of (rows, cols) scales, its padding zeroed (aiter leaves it
    uninitialised: the input is zero-padded to its padded shape first, which it keeps)."""
    rows, cols = scales.shape
    padded = torch.zeros(-(-rows // 256) * 256, -(-cols // 8) * 8, dtype=U8)
    padded[:rows, :cols] = scales.view(U8)
    return aiter.e8m0_shuffle(padded.view(torch.float8_e8m0fnu))


# (arch, dtype, mode, (M, K)): odd M and K tails; 263 rows: two 256-row tiles, the second mostly
# padding; nkb 6 and 101: columns padded to 8 and 104; then K % 32 == 0 (nkb 5 and 3)
MFMA_CASES = [("gfx950", torch.bfloat16, "even", (263, 165)), ("gfx942", torch.float16, "floor", (263, 165)),
              ("gfx950", torch.float32, "rceil", (1, 3221)), ("gfx942", torch.bfloat16, "rceil", (37, 75))] + [
    # K % 32 == 0: the block split over lanes (a partial last tile of 64 blocks; FP32: 8 lanes per block)
    ("gfx950", torch.float32, "floor", (263, 160)), ("gfx942", torch.float32, "even", (37, 96)),
    ("gfx942", torch.bfloat16, "floor", (263, 160))]


@pytest.mark.parametrize("arch,dtype,mode,shape", MFMA_CASES, ids=[f"{c[0]}-{c[2]}-{c[3][0]}x{c[3][1]}" for c in MFMA_CASES])
def test_mfma_scales_are_aiters(arch, dtype, mode, shape):
    """fq.mxfp4_quantize(x, scale_layout="mfma"): one launch of the rowwise kernel writing the codes
    at their places in aiter's e8m0_shuffle (aiter/utility/fp4_utils.py, loaded by path) of the
    plain scales, padding 0; the data is the plain quantize's. A NaN block included."""
    aiter = oracles.aiter_fp4_utils()
    emu.enable(arch)
    x = random_rows(*shape, dtype, seed=21)
    x[shape[0] // 2, shape[1] - 1] = float("nan")
    packed, scales = reference.mxfp4_quantize(x, -1, mode)
    want = (packed, _aiter_e8m0_shuffle(aiter, scales))
    with emu.record() as launches:
        got = fq.mxfp4_quantize(x, scaling_mode=mode, scale_layout="mfma")
    (launch,) = launches
    tail = "_tail" if shape[1] % 32 else ""
    assert launch.kernel.startswith(f"mxfp4_rows_{mode}_{c4.TORCH_DTYPES[dtype]}_{arch}{tail}_mfma_w")
    assert_same(got, want, "mfma")
    assert_same(reference.mxfp4_quantize(x, -1, mode, "mfma"), want, "reference mfma")


@pytest.mark.parametrize("arch", ARCHS)
def test_a4w4_shuffle_is_aiters(arch):
    """fq.mxfp4_quantize(x, shuffle="a4w4"[, scale_layout="mfma"]): the data bytes of aiter's own
    shuffle_weight(data, layout=(16, 16)) (aiter/ops/shuffle.py by path) of the plain quantize, in
    one launch (M = 48: three 16-row tiles; K = 320: five 64-wide tiles, nkb 10 padded to 16 in
    the mfma scales); the constraints named up front."""
    shuffle, fp4 = oracles.aiter_shuffle(), oracles.aiter_fp4_utils()
    emu.enable(arch)
    dtype = torch.float32 if arch == "gfx950" else torch.bfloat16
    x = random_rows(48, 320, dtype, seed=22).reshape(2, 24, 320)  # leading dims flattened: M = 48
    x[1, 5, 100] = float("inf")
    packed, scales = reference.mxfp4_quantize(x, -1, "rceil")
    data = shuffle.shuffle_weight(packed, layout=(16, 16))
    for layout, want in ((None, (data, scales)), ("mfma", (data, _aiter_e8m0_shuffle(fp4, scales)))):
        with emu.record() as launches:
            got = fq.mxfp4_quantize(x, scaling_mode="rceil", scale_layout=layout, shuffle="a4w4")
        (launch,) = launches
        assert launch.kernel.startswith(f"mxfp4_rows_rceil_{c4.TORCH_DTYPES[dtype]}_{arch}_a4w4{'_mfma' if layout else ''}_w")
        assert_same(got, want, f"a4w4 {layout}")
        assert_same(reference.mxfp4_quantize(x, -1, "rceil", layout, "a4w4"), want, f"reference a4w4 {layout}")
    plan = fq.explain(fq.mxfp4_quantize, x, scale_layout="mfma", shuffle="a4w4")
    assert plan.kernel.endswith(f"_{arch}_a4w4_mfma") and any("e8m0_shuffle" in r for r in plan.reasons)
    for bad, match in (((x[:, :20].contiguous(),), "M \\(rows, leading dims flattened\\) = 40 a multiple of 16"),
                       ((x[..., :288].contiguous(),), "K = 288 a multiple of 64"),
                       ((x, 0), "rowwise only")):
        with pytest.raises(ValueError, match=match):
            fq.mxfp4_quantize(*bad, shuffle="a4w4")
    with pytest.raises(ValueError, match="shuffle must be one of"):
        fq.mxfp4_quantize(x, shuffle="a16w4")
    with pytest.raises(ValueError, match="scale_layout must be one of"):
        fq.mxfp4_quantize(x, scale_layout="tcgen05")


def _zero_padded(t, shape):
    out = torch.zeros(shape, dtype=U8)
    out[:t.shape[0], :t.shape[1]] = t.view(U8)
    return out


def _gemm_a4w4_reference(run_torch, a, a_scales, b, b_scales):
    """aiter's gemm_a4w4 inputs (A plain, B in shuffle_weight(layout=(16, 16)), both scales
    e8m0_shuffle'd and padded) -> FP32 (padded M, padded N) through aiter's torch reference, which
    takes plain layouts: the shuffles undone by flyquant.layouts' inverses (aiter has none), the
    data zero-padded to the scales' padded rows and K."""
    a_s, b_s = layouts.mfma_unshuffle_scales(a_scales), layouts.mfma_unshuffle_scales(b_scales)
    kp = a_s.shape[1] * 16
    a = _zero_padded(a, (a_s.shape[0], kp))
    b = _zero_padded(layouts.unshuffle_weight_a4w4(b), (b_s.shape[0], kp))
    return run_torch(a, b, a_s.view(U8), b_s.view(U8), torch.float32)


# (arch, dtype, mode, M, N, K): M tails (activation scale rows padded to 256); nkb 10 and 2 (scale
# columns padded to 16 and 8, so K is padded too)
GEMM_CASES = [("gfx950", torch.bfloat16, "even", 37, 48, 320), ("gfx942", torch.float32, "rceil", 5, 16, 64)]


@pytest.mark.parametrize("arch,dtype,mode,m,n,k", GEMM_CASES, ids=[f"{c[0]}-{c[3]}x{c[4]}x{c[5]}" for c in GEMM_CASES])
def test_gemm_a4w4_round_trip(arch, dtype, mode, m, n, k):
    """The kernels' gemm_a4w4 operands through gemm_a4w4's reference equal dequantize-then-matmul
    of the kernels' plain outputs, bit for bit: activations (M, K) with scale_layout="mfma" (A is
    read plain: aiter shuffles only B), weights (N, K) with scale_layout="mfma", shuffle="a4w4".
    The padded rows, columns and K contribute exactly zero (a padding scale of 0xFF, E8M0's NaN,
    would make every output NaN). Inputs are normal samples times a power of two per row, so all
    block scales of a row lie within a few binades and the products' sums are exact in FP32 in
    any order (the float64 matmul it is compared with would show any rounding)."""
    run_torch = oracles.aiter_gemm_a4w4_reference()
    emu.enable(arch)
    g = torch.Generator().manual_seed(23)
    x = (torch.randn(m, k, generator=g) * torch.exp2(torch.arange(m) % 7 - 3.0)[:, None]).to(dtype)
    w = (torch.randn(n, k, generator=g) * torch.exp2(torch.arange(n) % 5 - 2.0)[:, None]).to(dtype)
    a, a_scales = fq.mxfp4_quantize(x, scaling_mode=mode, scale_layout="mfma")
    b, b_scales = fq.mxfp4_quantize(w, scaling_mode=mode, scale_layout="mfma", shuffle="a4w4")
    got = _gemm_a4w4_reference(run_torch, a, a_scales, b, b_scales)

    plain_x, plain_w = fq.mxfp4_quantize(x, scaling_mode=mode), fq.mxfp4_quantize(w, scaling_mode=mode)
    want = reference.dequantize_mxfp4(*plain_x).double() @ reference.dequantize_mxfp4(*plain_w).double().T
    assert got.shape == (256, 256) and not got.isnan().any()
    assert torch.equal(got[:m, :n].double(), want), (got[:m, :n].double() - want).abs().max()
    assert not got[m:].any() and not got[:, n:].any()
    assert want.abs().min() > 0  # every output counts


DUAL = [(a, MODES[i % 3], d) for i, (a, d) in enumerate((a, d) for a in ARCHS for d in DTYPES)]


@pytest.mark.parametrize("arch,mode,dtype", DUAL, ids=[f"{a}-{m}-{str(d).replace('torch.', '')}" for a, m, d in DUAL])
def test_dual(arch, mode, dtype):
    """kernels/mxfp4_quantize_dual.py: both orientations in one launch, each byte-identical to the
    reference's (so to the rowwise and columnwise kernels'): the special blocks (as rows, and
    their values across the columns; NaN/Inf, -0, subnormals, saturation), an odd row count
    with a K tail (odd K: the 16-bit last element), one row, one column; K % 32 == 0 (the
    whole-line loads): an odd row count with an odd block count (the tile's second block past the
    row's end), and whole tiles."""
    emu.enable(arch)
    for x in (rows_tensor(dtype), random_rows(37, 75, dtype, 6), random_rows(1, 3221, dtype, 7),
              random_rows(2333, 1, dtype, 8), random_rows(67, 96, dtype, 11), random_rows(64, 128, dtype, 12)):
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
    assert [r.kernel[: r.kernel.rindex("_w")] for r in launches] == ["mxfp4_dual_even_fp16_gfx950_tail"]
    assert_same(got[0], reference.mxfp4_quantize(x, -1, "even"), "dual api rows")
    assert_same(got[1], reference.mxfp4_quantize(x, 0, "even"), "dual api cols")
    plan = fq.explain(fq.mxfp4_quantize_dual, x, "rceil")
    assert plan.backend == "flydsl" and plan.kernel == "mxfp4_dual_rceil_fp16_gfx950_tail"
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
    """Dual: no scratch; the tile's 16-byte loads once (tail: the lane's block, plus the 2-byte
    load of the last element for 16-bit x; lined: whole lines into LDS and 16-byte stores there,
    then the block's 16-byte LDS loads); 32 transposed LDS stores, 16-byte LDS loads of the
    column; two 16-byte data stores and two code bytes per lane."""
    torch_dtype = {"bf16": torch.bfloat16, "fp32": torch.float32}[dtype]
    x = torch.zeros(64, 256, dtype=torch_dtype)
    q1, s1, q0, s0 = (torch.zeros(s, dtype=U8) for s in ((64, 128), (64, 8), (256, 32), (256, 2)))
    waves = kd.plan_dual((8192, 8192), arch, torch_dtype).waves  # a large tensor: the most waves
    (r,) = toolchain.compile_only(arch, kd.build_dual(arch, dtype, "even", tail, waves), x, q1, s1, q0, s0, 64, 256, 8,
                                  2, 4, 0, 2, 256 * x.element_size(), x.numel() * x.element_size(), 2, 1, stream=0)
    print(f"{r.name}: {r.vgprs} VGPRs, {r.sgprs} SGPRs, spills {r.spills}, LDS {r.lds_bytes}")
    loads = 8 if dtype == "fp32" else 4
    eb = x.element_size()
    wave_lds = max(32 * (kd.TILE_COLS * eb + kd.LDS_PAD), kd.TILE_COLS * (32 * eb + kd.LDS_PAD))
    assert r.spills == 0 and r.lds_bytes == waves * wave_lds
    assert waves == (3 if (arch, dtype) == ("gfx942", "fp32") else kd.MAX_WAVES)
    assert r.count("buffer_load_dwordx4") == loads
    assert r.count("buffer_load_ushort") == (1 if tail and dtype == "bf16" else 0)
    assert r.count("ds_write_b128") == (0 if tail else loads)
    assert r.count("ds_read_b128") == (loads if tail else 2 * loads)
    writes = 2 * r.count("ds_write2_b32") if dtype == "fp32" else r.count("ds_write_b16") + r.count("ds_write_b16_d16_hi")
    assert writes == 32
    assert r.count("buffer_store_dwordx4") == 2 and r.count("buffer_store_byte") == 2
    assert r.workgroups_per_cu(waves) >= kd.MIN_WORKGROUPS_PER_CU  # FP32 on gfx942: 3 waves' 9 KiB LDS tiles


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
                                  256 * x.element_size(), 256, 0, 3, x.numel() * x.element_size(), 1, 0, 0, 512, 0, 1,
                                  stream=0)
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
        assert r.count(cvt) == (copies * 16 if arch == "gfx950" else 0), r.name  # two elements each
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
    block's amax and operand exchanged with gfx950's permlane swaps or gfx942's DPP."""
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


@pytest.mark.parametrize("arch", ARCHS)
@pytest.mark.parametrize("dtype", ["bf16", "fp16", "fp32"])
def test_compile_cols(arch, dtype):
    """Columnwise: no scratch; 32 16-byte row loads (odd: plus the 2-byte load of the last
    element), one 16-byte data store and one code byte per column; the scaled FP4 conversion on
    gfx950 only."""
    torch_dtype = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}[dtype]
    cvt = "v_cvt_scalef32_pk_fp4_" + {"bf16": "bf16", "fp16": "f16", "fp32": "f32"}[dtype]
    x = torch.zeros(256, 256, dtype=torch_dtype)
    q, s = torch.zeros(256, 128, dtype=U8), torch.zeros(256, 8, dtype=U8)
    cols = 16 // x.element_size()
    for odd in (dtype != "fp32",):  # 16-bit: the odd-K variant (the plain one's code plus the realigned loads)
        (r,) = toolchain.compile_only(arch, kc.build_cols(arch, dtype, "floor", odd), x, q, s, 256, 256, 8, 256 * x.element_size(),
                                      8, 2, 4, 0, 2, 1,
                                      stream=0)
        print(f"{r.name}: {r.vgprs} VGPRs, {r.sgprs} SGPRs, spills {r.spills}, {r.workgroups_per_cu()} workgroups/CU")
        assert r.spills == 0 and r.lds_bytes == 0, r.name
        assert r.count("buffer_load_dwordx4") == 32 and r.count("buffer_load_ushort") == int(odd), r.name
        assert r.count("buffer_store_dwordx4") == cols and r.count("buffer_store_byte") == cols, r.name
        assert r.count(cvt) == (16 * cols if arch == "gfx950" else 0), r.name
        assert ("v_cvt_scalef32" in r.isa) == (arch == "gfx950"), r.name


@pytest.mark.parametrize("arch", ARCHS)
def test_instructions_and_coalescing(arch):
    """Executed wave-instructions per element (printed); loads of whole lines and all data stores
    fully coalesced (rowwise, also with the a4w4 and a16w4 (gate_up) shuffles: 4-byte stores of
    a piece each, FP32 2-byte ones; columnwise: 16-byte stores); the codes of the plain rowwise
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


@pytest.mark.gpu
@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("dtype", DTYPES)
def test_gpu(mode, dtype):
    arch = torch.cuda.get_device_properties(0).gcnArchName.split(":")[0]
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
