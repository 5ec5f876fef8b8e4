"""MXFP4 rowwise kernels writing aiter's layouts (kernels/mxfp4_quantize.py: the a16w4 expert
weight shuffles, the mfma scale layout, gemm_a4w4's a4w4 data shuffle) against aiter's own
layout functions and flyquant.reference, byte for byte, under flyquant.emu for gfx950 and
gfx942; and the round trip of gemm_a4w4's operands through aiter's torch reference GEMM."""

from __future__ import annotations

import pytest
import torch

import flyquant as fq
import flyquant.emu as emu
from flyquant import layouts, reference
from flyquant.kernels import _mxfp4_common as c4
from flyquant.kernels import _mxfp4_shuffles as sh
from flyquant.kernels import mxfp4_quantize as k4

import oracles
from test_mxfp4_kernels import ARCHS, DTYPES, MODES, U8, assert_same, random_rows, special_blocks

@pytest.mark.parametrize("arch", ARCHS)
@pytest.mark.parametrize("gate_up", [False, True])
def test_3d_a16w4_shuffle_is_aiters(arch, gate_up):
    """fq.mxfp4_quantize_3d(w, shuffle="a16w4") writes in one launch the bytes of aiter's own
    shuffle_weight_a16w4 / shuffle_scale_a16w4 (aiter/ops/shuffle.py, loaded by path) applied to
    the plain quantize (E = 3, N = 64: two 32-row scale tiles, two gate/up halves of 32; K = 512:
    two 256-wide scale tiles, a NaN block among them); without the shuffle it is quantize_mxfp4,
    also for N < 32."""
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
    # gfx950: two-tile steps, K 512's 4 tiles a row tile padded to a wave's 8
    padded = "_padded" if arch == "gfx950" else ""
    assert launch.kernel.startswith(f"mxfp4_rows_even_bf16_{arch}_a16w4{'_gate_up' if gate_up else ''}{padded}_w")
    assert_same(got, want, "a16w4")
    assert_same(reference.mxfp4_quantize_3d(w, "even", "a16w4", gate_up), want, "reference a16w4")
    if not gate_up:
        assert_same(fq.mxfp4_quantize_3d(w[:, :, :500].contiguous(), "rceil"),
                    reference.quantize_mxfp4(w[:, :, :500].contiguous(), "rceil"), "3d plain")
        # experts of fewer than 32 rows, unshuffled (a gate_up division by N / 32 once crashed here)
        assert_same(fq.mxfp4_quantize_3d(w[:, :2, :300].contiguous(), "floor"),
                    reference.quantize_mxfp4(w[:, :2, :300].contiguous(), "floor"), "3d plain, N 2")
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
    the output order per step, gfx950 16-bit two of a row tile, gate_up's row tiles permuted;
    16-bit: a register spans 2 blocks of 8 rows, FP32: 8 blocks of 8 rows),
    against the reference shuffles (checked against aiter's above): odd E = 3 and N = 96 (odd N1 =
    3 scale row tiles, gate/up halves of 48 rows: a 16-row tile pair straddles them), K = 768 (K0
    = 6 tiles per row tile, odd K1 = 3), the special blocks in expert 1 (NaN/Inf, subnormals,
    saturation, -0), waves past the end dropped (18 row tiles, one wave each, over whole
    workgroups); gfx950 16-bit places a wave's tiles once in their row tile
    (kernels/_mxfp4_shuffles.row_tiles): 6 of a run of 8 there (3 steps), and 8 with E = 2, N =
    64, K = 1024."""
    emu.enable(arch)
    w = random_rows(3 * 96, 768, dtype, seed=31).reshape(3, 96, 768)
    special = special_blocks(dtype)
    w[1].view(-1, 32)[5:5 + special.shape[0]] = special
    for w in (w, random_rows(2 * 64, 1024, dtype, seed=32).reshape(2, 64, 1024)):
        for gate_up in (False, True):
            with emu.record() as launches:
                got = fq.mxfp4_quantize_3d(w, mode, shuffle="a16w4", gate_up=gate_up)
            (launch,) = launches
            # gfx950 16-bit: K 768's 6 tiles a row tile padded to a wave's 8
            padded = "_padded" if arch == "gfx950" and dtype != torch.float32 and w.shape[2] == 768 else ""
            assert launch.kernel.startswith(
                f"mxfp4_rows_{mode}_{c4.TORCH_DTYPES[dtype]}_{arch}_a16w4{'_gate_up' if gate_up else ''}{padded}_w")
            assert_same(got, reference.mxfp4_quantize_3d(w, mode, "a16w4", gate_up), f"a16w4 {tuple(w.shape)} gate_up={gate_up}")


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
    ("gfx942", torch.bfloat16, "floor", (263, 160)),
    # gfx950 16-bit: tiles taken in pairs; 3 tiles: a pair (the NaN in its second) and an odd last one
    ("gfx950", torch.bfloat16, "rceil", (24, 256))]


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
        # one-tile steps (gfx950 FP32, gfx942): nkb 10's 3 tiles a row tile padded to a wave's 8
        assert launch.kernel.startswith(f"mxfp4_rows_rceil_{c4.TORCH_DTYPES[dtype]}_{arch}_a4w4_k64_padded{'_mfma' if layout else ''}_w")
        assert_same(got, want, f"a4w4 {layout}")
        assert_same(reference.mxfp4_quantize(x, -1, "rceil", layout, "a4w4"), want, f"reference a4w4 {layout}")
    plan = fq.explain(fq.mxfp4_quantize, x, scale_layout="mfma", shuffle="a4w4")
    assert plan.kernel.endswith(f"_{arch}_a4w4_k64_padded_mfma") and any("e8m0_shuffle" in r for r in plan.reasons)
    for bad, match in (((x[:, :20].contiguous(),), "M \\(rows, leading dims flattened\\) = 40 a multiple of 16"),
                       ((x[..., :288].contiguous(),), "K = 288 a multiple of 64"),
                       ((x, 0), "^shuffle='a4w4': rowwise only")):
        with pytest.raises(ValueError, match=match):
            fq.mxfp4_quantize(*bad, shuffle="a4w4")
    with pytest.raises(ValueError, match="shuffle must be one of"):
        fq.mxfp4_quantize(x, shuffle="a16w4")
    with pytest.raises(ValueError, match="scale_layout must be one of"):
        fq.mxfp4_quantize(x, scale_layout="tcgen05")


# The a4w4 tile orders (kernels/_mxfp4_shuffles.row_tiles): a wave's tiles in one row tile, placed
# once, in runs of 8 at these small launches (a wave runs only its row tile's); gfx950 16-bit two
# tiles a step (the row tile's tiles rounded up to whole steps), elsewhere one; "k64": the last step drops pairs past the
# row's end. (80, 512) 4 tiles a row tile, 5 waves, the last workgroup's other 3 past the end,
# (48, 256) 2 and an odd row tile count, (32, 1024) 8; (32, 384) nkb 12, (32, 2880) GPT-OSS's K,
# nkb 90 (24 tiles on gfx950, 23 on gfx942: 3 waves a row tile), (48, 320) nkb 10 and (16, 448)
# nkb 14: the last step keeps 2 (nkb % 8 == 4), 1 or 3 of its 4 pairs (one-tile steps: 1 of 2
# where nkb % 4 == 2)
A4W4_ORDERS = [(a, d, MODES[i % 3]) for i, (a, d) in enumerate((a, d) for a in ARCHS for d in DTYPES)]


@pytest.mark.parametrize("arch,dtype,mode", A4W4_ORDERS, ids=[f"{a}-{str(d)[6:]}-{m}" for a, d, m in A4W4_ORDERS])
def test_a4w4_tile_orders(arch, dtype, mode):
    """The a4w4 kernel's tile orders (16-row x 4-block tiles, two-tile steps in one row tile where K
    % 256 == 0 on gfx950 16-bit, a phantom pair at each row's end where K % 128 == 64), with plain
    and "mfma" scales, against the reference layouts (checked against aiter's above): the special
    blocks (NaN, Inf, zeros, subnormals, saturation) spread over row tiles and both tiles of a
    step."""
    emu.enable(arch)
    specials = special_blocks(dtype)
    for m, k in ((80, 512), (48, 256), (32, 1024), (32, 384), (32, 2880), (48, 320), (16, 448)):
        x = random_rows(m, k, dtype, seed=m + k)
        blocks = x.view(-1, 32)
        picks = torch.arange(specials.shape[0]) * 37 % blocks.shape[0]
        blocks[picks] = specials
        two = arch == "gfx950" and dtype != torch.float32  # two-tile steps
        align = (256 if k % 256 == 0 else 64) if two else 128 if k % 128 == 0 else 64
        nkb = k // 32  # a row tile's tiles: whole steps; padded unless whole waves of 8
        padded = "_padded" if (2 * -(-nkb // 8) if two else -(-nkb // 4)) % 8 else ""
        for layout in (None, "mfma"):
            with emu.record() as launches:
                got = fq.mxfp4_quantize(x, scaling_mode=mode, scale_layout=layout, shuffle="a4w4")
            (launch,) = launches
            assert f"_a4w4_k{align}{padded}{'_mfma' if layout else ''}_w" in launch.kernel
            assert_same(got, reference.mxfp4_quantize(x, -1, mode, layout, "a4w4"), f"a4w4 {m}x{k} {layout}")
            # every data byte and real code stored once (a phantom pair's stores dropped, not overwritten later)
            for t, n in ((got[0], got[0].numel()), (got[1], m * k // 32)):
                assert launch.stats.traffic_within(t.data_ptr(), t.data_ptr() + t.numel()).bytes == n
            plan = fq.explain(fq.mxfp4_quantize, x, scaling_mode=mode, scale_layout=layout, shuffle="a4w4")
            assert launch.kernel.startswith(plan.kernel + "_w")
            assert plan.config["tiles_per_wave"] == 8


def test_a4w4_last_step_runs_only_real_tiles():
    """gfx950 16-bit a4w4: a row tile's last two-tile step whose second tile holds none of the
    row's blocks (nkb % 8 of 1 to 4) runs its first tile alone, so the conversions executed are
    those of the real tiles, ceil(nkb / 4) a row tile (16 wave-instructions each), not of
    2 ceil(nkb / 8). nkb 90 and 12: one tile fewer a row tile; nkb 14: the last step's second tile
    holds 2 blocks and runs. 64 rows: the launch's waves are the row tiles' (3 a row tile at nkb 90,
    in 3 workgroups of 4; 1 at nkb 12 and 14), none past the end."""
    emu.enable("gfx950")
    for m, k in ((64, 2880), (64, 384), (64, 448)):
        x = random_rows(m, k, torch.bfloat16, seed=k)
        with emu.record() as launches:
            got = fq.mxfp4_quantize(x, shuffle="a4w4")
        assert_same(got, reference.mxfp4_quantize(x, -1, "floor", None, "a4w4"), f"a4w4 {m}x{k}")
        tiles = m // 16 * -(-k // 32 // 4)
        assert launches[0].stats.by_opcode["v_cvt_scalef32_pk_fp4_bf16"] == 16 * tiles, (m, k)


def test_long_waves_only_where_the_launch_stays_wide():
    """_mxfp4_shuffles.row_tiles splits a row tile among the fewest waves (of up to 32 tiles) that
    keep 4 waves per CU in the launch (gfx950: 256 CUs, 1024 waves), in runs of one length, whole
    steps of at least 8 tiles (split finer where rounding up to whole steps would leave fewer waves);
    a row tile that is no whole number of runs is padded to them (the padded waves run only its real
    tiles)."""
    one = ("gfx942", "bf16", "a4w4")  # one-tile steps: ceil(nkb / 4) tiles a row tile
    two = ("gfx950", "bf16", "a4w4")  # two-tile steps: 2 ceil(nkb / 8)
    assert sh.row_tiles(*two, 224, 512) == (56, 28)  # 8192 x 7168: 1024 waves of 28
    assert sh.row_tiles(*two, 224, 256) == (56, 14)  # 4096 x 7168: 28 would leave 512 waves
    assert sh.row_tiles(*two, 224, 16) == (56, 8)  # 256 rows: too few waves for any longer run
    assert sh.row_tiles(*two, 90, 16) == (24, 8)  # K 2880, short: 3 waves a row tile
    assert sh.row_tiles(*two, 90, 512) == (24, 12)  # 8192 x 2880: 1024 waves of 12
    assert sh.row_tiles(*two, 90, 1024) == (24, 24)
    assert sh.row_tiles(*two, 44, 4096) == (12, 12)  # 12 tiles: one wave
    assert sh.row_tiles(*two, 36, 4096) == (10, 10)
    assert sh.row_tiles(*two, 28, 4096) == (8, 8)  # 8 tiles: one wave a row tile, no padding
    assert sh.row_tiles(*two, 20, 4096) == (8, 8) and sh.padded_rows(*two, 20, 4096)  # 6 tiles
    # 8192 x 2816: 22 tiles in 2 waves of 12 and 10 (in runs of 8: 3 waves, 3 setups for 11 steps)
    assert sh.row_tiles(*two, 88, 512) == (24, 12) and sh.padded_rows(*two, 88, 512)
    assert sh.row_tiles(*two, 200, 512) == (52, 26)  # 50 tiles: 2 waves (the largest divisor, 10: 5)
    assert sh.row_tiles(*two, 200, 171) == (56, 8)  # 6 waves wanted: runs of 10 would leave 5 (helper-78)
    assert sh.row_tiles(*one, 88, 1024) == (22, 11) and not sh.padded_rows(*one, 88, 1024)  # gfx942: 304 CUs
    assert sh.row_tiles(*one, 90, 4096) == (23, 23)  # prime: one-tile steps take any run
    assert sh.row_tiles(*one, 90, 16) == (24, 8) and sh.padded_rows(*one, 90, 16)
    assert not sh.padded_rows(*one, 90, 4096)
    assert sh.row_tiles("gfx950", "bf16", "a16w4", 160, 2560) == (40, 20)  # 8 x 5120 x 5120 weights


LONG_WAVE_CASES = [(a, d) for a in ARCHS for d in (torch.bfloat16, torch.float32)]


@pytest.mark.parametrize("arch,dtype", LONG_WAVE_CASES, ids=[f"{a}-{str(d)[6:]}" for a, d in LONG_WAVE_CASES])
def test_long_waves_are_exact(arch, dtype, monkeypatch):
    """Waves longer than 8 tiles (row_tiles' large-launch runs, made to apply to small shapes here):
    a4w4 K 4224 (34 tiles a row tile in 2 waves of 18, the row tile padded to 36, the last step
    ragged; one-tile steps: 33 tiles, 2 waves of 17, padded to 34: runs that are no power of two),
    K 7168 (56 tiles in 2 waves of 28), K 2880 (the ragged last step: 24 tiles, one-tile 23) with
    plain and "mfma" scales, and a16w4 with gate_up (E 2, N 64, K 1536), byte for byte against the
    reference."""
    monkeypatch.setattr(sh, "LONG_WAVES_PER_CU", 0)
    emu.enable(arch)
    two = arch == "gfx950" and dtype != torch.float32
    for m, k, padded in ((32, 4224, True), (16, 7168, False), (48, 2880, False)):
        x = random_rows(m, k, dtype, seed=m + k)
        specials = special_blocks(dtype)
        x.view(-1, 32)[torch.arange(specials.shape[0]) * 37 % (x.numel() // 32)] = specials
        for layout in (None, "mfma"):
            plan = fq.explain(fq.mxfp4_quantize, x, scaling_mode="floor", scale_layout=layout, shuffle="a4w4")
            if k == 4224:
                assert plan.config["tiles_per_wave"] == (18 if two else 17)
            assert plan.config["tiles_per_wave"] > 8 and ("_padded" in plan.kernel) == padded
            with emu.record() as launches:
                got = fq.mxfp4_quantize(x, scaling_mode="floor", scale_layout=layout, shuffle="a4w4")
            assert launches[0].grid[0] == plan.config["workgroups"]
            assert_same(got, reference.mxfp4_quantize(x, -1, "floor", layout, "a4w4"), f"a4w4 {m}x{k} {layout}")
    w = random_rows(2 * 64, 1536, dtype, seed=5).reshape(2, 64, 1536)
    assert_same(fq.mxfp4_quantize_3d(w, "even", shuffle="a16w4", gate_up=True),
                reference.mxfp4_quantize_3d(w, "even", "a16w4", True), "a16w4 gate_up")


@pytest.mark.parametrize("arch", ARCHS)
def test_plan_rows_is_the_launchers_row_tiles(arch):
    """The plan (waves, tiles per wave, workgroups) and the launch (row_tiles' padded count, the
    divisor of the row-tile placement) each ask row_tiles, with the same row-tile count: the
    plan's waves run the launch's runs, and its grid covers every row tile's padded tiles."""
    for m, k in ((64, 4224), (4096, 7168), (8192, 6400), (1024, 4224), (2048, 2880)):
        per_row, per_wave = sh.row_tiles(arch, "bf16", "a4w4", -(-k // 32), m // 16)
        cfg = k4.plan_rows((m, k), arch, "a4w4", "bf16")
        assert cfg.tiles_per_wave == per_wave and cfg.waves * cfg.tiles_per_wave * cfg.workgroups >= m // 16 * per_row


def test_long_waves_split_by_the_row_tile_count(monkeypatch):
    """Waves as long as a launch of 4 row tiles wants them (8 waves on gfx950's 256 CUs: a row tile
    of 34 tiles in 2 waves of 18, padded to 36): byte for byte the reference's."""
    monkeypatch.setattr(sh, "LONG_WAVES_PER_CU", 1 / 32)
    emu.enable("gfx950")
    x = random_rows(64, 4224, torch.bfloat16, seed=7)
    assert fq.explain(fq.mxfp4_quantize, x, scaling_mode="floor", shuffle="a4w4").config["tiles_per_wave"] == 18
    got = fq.mxfp4_quantize(x, scaling_mode="floor", shuffle="a4w4")
    assert_same(got, reference.mxfp4_quantize(x, -1, "floor", None, "a4w4"), "a4w4 64x4224")


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
GEMM_CASES = [("gfx950", torch.bfloat16, "even", 37, 48, 320), ("gfx942", torch.float32, "rceil", 5, 16, 64),
              ("gfx950", torch.bfloat16, "rceil", 24, 16, 384)]  # 5 and 3 tiles: tile pairs and an odd last tile


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
