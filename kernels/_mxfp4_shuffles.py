"""Where the rowwise MXFP4 kernel's units go in aiter's weight layouts (kernels/mxfp4_quantize.py,
shuffle "a4w4" and "a16w4"): the K alignments and step placements its variants take, the first
block of a 16-row x 4-block tile, the a16w4 scale offsets and gate_up's source rows, emitted into
FlyDSL kernels (flyquant.layouts holds the reference permutations)."""

from __future__ import annotations

import math

from flyquant.arch import arch_info

from . import _mx_common as mx
from ._mx_common import WAVE, add, band, lshr, mul, shl, sub

A16W4_NLANE = 16  # aiter's shuffle_weight_a16w4 default: 16 rows of N per tile
A16W4_KLANE = WAVE // A16W4_NLANE  # 4 blocks of K per tile row
PLACED_TILES_PER_WAVE = 8  # the shortest run of a row tile's tiles a wave takes (but for the row tile's last)
# Large launches: up to 32 tiles a wave, spreading the wave's setup over up to 4 times the steps,
# while at least 4 waves per CU remain (a step loads 8 KiB: 32 KiB in flight per CU, issue 4's
# target for large shapes).
LONG_TILES_PER_WAVE = 32
LONG_WAVES_PER_CU = 4


def a4w4_k_align(arch: str, dtype: str, k: int) -> int:
    """The a4w4 kernel's K alignment (mxfp4_quantize.build_rows' k_align; K % 64 == 0): 64 where
    a row tile's last step holds pairs of blocks past the row's end (ragged: not read, their stores
    dropped), else the alignment that rules that out: 256 where steps take two tiles (gfx950, 16-bit
    x: two_tile_steps), 128 where they take one."""
    full = 256 if two_tile_steps(arch, dtype, "a4w4") else 128
    return full if k % full == 0 else 64


def two_tile_steps(arch: str, dtype: str, shuffle) -> bool:
    """The shuffle variants whose steps take two tiles of one row tile (gfx950, 16-bit x: a4w4 at
    any K % 64 == 0, its row tiles padded to whole steps, and the a16w4 layouts, K % 256 == 0)."""
    return bool(shuffle) and arch == "gfx950" and dtype != "fp32"


def row_tiles(arch: str, dtype: str, shuffle, nkb: int, row_tile_count: int) -> tuple[int, int]:
    """(16-row x 4-block tiles per row tile of nkb blocks, tiles per wave) of the shuffles, where
    mxfp4_quantize.build_rows places a wave's tiles once in one row tile: the row tile's tiles
    (two-tile steps: 2 ceil(nkb / 8), the last step's blocks past nkb phantoms; a4w4's one-tile
    steps: ceil(nkb / 4)) split among the fewest waves that leave a launch of row_tile_count row
    tiles LONG_WAVES_PER_CU waves per CU (and none longer than 32 tiles), in runs of one length,
    whole steps of at least 8 tiles (the last run shorter where they do not divide the row tile,
    which is padded to whole runs, padded_rows): a wave runs only the row tile's tiles. a16w4's
    one-tile steps (not placed, their (row, kb) carried): ceil(nkb / 4) and 8."""
    real = real_row_tiles(arch, dtype, shuffle, nkb)
    if real is None:
        return -(-nkb // 4), PLACED_TILES_PER_WAVE
    step = 2 if two_tile_steps(arch, dtype, shuffle) else 1
    waves_wanted = arch_info(arch).compute_units * LONG_WAVES_PER_CU
    wanted = max(math.ceil(waves_wanted / max(row_tile_count, 1)), -(-real // LONG_TILES_PER_WAVE))
    waves = wanted
    while True:  # runs rounded up to whole steps can leave fewer waves than wanted: split finer
        per = max(PLACED_TILES_PER_WAVE, -(-real // (waves * step)) * step)
        if per == PLACED_TILES_PER_WAVE or -(-real // per) >= wanted:
            return -(-real // per) * per, per
        waves += 1


def real_row_tiles(arch: str, dtype: str, shuffle, nkb: int) -> int | None:
    """The tiles of a row tile that row_tiles places (None: a16w4's carried one-tile steps)."""
    if two_tile_steps(arch, dtype, shuffle):
        return 2 * -(-nkb // 8)
    return -(-nkb // 4) if shuffle == "a4w4" else None


def padded_rows(arch: str, dtype: str, shuffle, nkb: int, row_tile_count: int) -> bool:
    """Whether row_tiles pads a row tile (its placed tiles not whole runs of a wave's)."""
    real = real_row_tiles(arch, dtype, shuffle, nkb)
    return real is not None and row_tiles(arch, dtype, shuffle, nkb, row_tile_count)[0] != real


def emit_real_row_tiles(nkb, two_tile: bool, ragged: bool):
    """real_row_tiles emitted: two-tile steps 2 ceil(nkb / 8), one-tile steps ceil(nkb / 4) (nkb / 4
    unless ragged)."""
    if ragged:
        return shl(lshr(add(nkb, 7), 3), 1) if two_tile else lshr(add(nkb, 3), 2)
    return lshr(nkb, 2)


def a16w4_scale_offset(tile, kb, nl, nkb):
    """The scale byte offset of block kb of row nl of the output's 16-row tile `tile` (plain: x's
    tile q; gate_up: (e * N1 + n0) * 2 + h, N1 = N / 32) in the layout of aiter's
    shuffle_scale_a16w4 (flyquant.layouts), (E, N1, K1, KL 4, LANE 16, KP 2, P 2) with n = n1 * 32
    + p * 16 + lane (gate_up: n = p * N / 2 + n1 * 16 + lane), kb = k1 * 8 + kp * 4 + kl, K1 =
    nkb / 8: the pair of tiles tile / 2 (the scale row n1, or e * N1 + n0), p = tile % 2. Linear
    in kb % 4 (64 bytes each) and nl (4 bytes each)."""
    kl, kp, k1 = band(kb, A16W4_KLANE - 1), band(lshr(kb, 2), 1), lshr(kb, 3)
    return add(mul(add(mul(lshr(tile, 1), lshr(nkb, 3)), k1), 4 * 16 * 2 * 2),
               add(add(shl(kl, 6), shl(nl, 2)), add(shl(kp, 1), band(tile, 1))))


def a16w4_source_row(row, n1_args):
    """gate_up: the row of x that row `row` of the plain a16w4 order holds. Without gate_up,
    aiter's shuffle_weight_a16w4 (NLANE 16, KPACK units of 16 bytes: (E, N0, K0, KLANE 4, NLANE 16))
    is shuffle_weight(layout=(16, 16)) when K % 128 == 0 (unit ((q K0 + kb / 4) 4 + kb % 4) 16 + nl
    = (q nkb + kb) 16 + nl), so its data units are a4w4's (row_tile_first); gate_up permutes the
    row tiles: tile (e N1 + n0) 2 + h holds x's tile (2 e + h) N1 + n0 = r + (e + h) N1 with r = e
    N1 + n0, e = r / N1."""
    n1, magic, shift = n1_args
    pair = lshr(row, 4)
    r = lshr(pair, 1)
    e = lshr(add(mx.umulhi(r, magic), r), shift)
    return add(shl(add(r, mul(add(e, band(pair, 1)), n1)), 4), band(row, A16W4_NLANE - 1))


def row_tile_first(t0, tpr, magic, shift):
    """(row, kb) of the first block of the shuffles' tile at unit t0 (t0 % 64 == 0): in aiter's
    shuffle_weight(data, layout=(16, 16)) (flyquant.layouts.shuffle_weight_a4w4) block (row, kb)
    is unit ((row / 16) nkb + kb) 16 + row % 16, so a tile of 16 rows x 4 blocks is 64 units in a
    row; tpr = ceil(nkb / 4) tiles per row tile (magic, shift: its division), the tile t0 / 64
    being tile t % tpr of row tile t / tpr."""
    t = lshr(t0, 6)
    q = lshr(add(mx.umulhi(t, magic), t), shift)
    return shl(q, 4), shl(sub(t, mul(q, tpr)), 2)
