"""MXFP4 quantize, columnwise (cast-transpose, blocks of 32 along M): x (M, K) -> packed E2M1
data (K, ceil(M/32) * 16) holding x^T quantized along M, and E8M0 scales (K, ceil(M/32)). The
scale rule and the element conversion (gfx950 hardware, gfx942 software) are _mxfp4_common's;
rows past M are the zero padding of the last row block (they read 0: past x's end).

Work split: a wave tile is 8 row blocks (256 rows) x 8 column groups of 16 bytes (8 BF16/FP16 or
4 FP32 columns). Lane l takes row block l % 8 and column group l / 8: 32 16-byte loads, one per
row of its block (each load instruction reads 8 rows x 128 contiguous bytes: whole lines), the
amax of each of its columns over the 32 rows (_mx_common.chain_amax_interleaved, the columns'
chains interleaved), its columns' codes, and their 32 elements converted from (row 2i, row 2i+1)
pairs (16-bit: v_perm_b32 gathers a column's halves from two rows). It stores per column one
16-byte data block at (column, row block): the 8 lanes of a column group store 128 contiguous
bytes of each output row (whole lines), and the code bytes likewise 8 in a row. Tiles run over
row tiles (major) and column tiles; a wave takes `tiles_per_wave` consecutive ones. A tile wholly
inside x loads row 8j + i at the vector offset of row 8j plus a scalar offset of i rows (the
buffer's range check sees only the vector offset); an edge tile range-checks every row's offset
(rows past M read 0). Columns past K land past the outputs' end and row blocks past the last are
moved out of range: their stores are dropped.

16-bit types with odd K: the tensor's last element is the low half of a dword whose high half
lies past x's end, which the buffer range check reads as 0; a variant of the kernel moves such
loads 2 bytes back and realigns them (load_row). Rows whose byte length is not a multiple of 16 are loaded
at 2- or 4-byte alignment (the unaligned buffer access ROCm enables; not verified on hardware).
"""

from __future__ import annotations

import functools
import sys
from dataclasses import dataclass

import torch

import flydsl.compiler as flyc
import flydsl.expr as fx
from flydsl._mlir.dialects import arith

from flyquant import toolchain
from flyquant.arch import arch_info

from . import _mx_common as mx
from . import _mxfp4_common
from ._mx_common import MX_BLOCK, PIECE_BYTES, PIECE_DWORDS, WAVE, Spec, add, band, const, lshr, mul, sub, val
from ._mxfp4_common import (OUT_BLOCK_BYTES, TORCH_DTYPES, allocate, convert_pieces, hw_convert, nan_words, pieces,
                            scale_code, scale_pair, sw_convert)

SOURCE_TAG = mx.source_tag(sys.modules[__name__], _mxfp4_common)

TILE_ROW_BLOCKS = 8  # row blocks per wave tile (lane % 8)
TILE_GROUPS = WAVE // TILE_ROW_BLOCKS  # 16-byte column groups per wave tile (lane / 8)
ROW_STEPS = 8  # inner tiles' loads: a vector offset per 8 rows, a scalar one per row within them
HALF_SEL = (0x05040100, 0x07060302)  # v_perm_b32: the low / high halves of (hi, lo) dwords
MAX_WAVES = 4
TILES_PER_WAVE = 2


@dataclass(frozen=True)
class ColPlan:
    waves: int
    tiles_per_wave: int
    workgroups: int
    col_tiles: int  # tiles along K (the minor tile index)


def plan_cols(shape, dtype: torch.dtype, arch: str) -> ColPlan:
    """The tiling of a columnwise quantize of an (M, K) tensor (the same on both arches)."""
    arch_info(arch)
    m, k = shape
    cols = TILE_GROUPS * PIECE_BYTES // torch.empty((), dtype=dtype).element_size()
    row_tiles = -(-m // (MX_BLOCK * TILE_ROW_BLOCKS))
    col_tiles = -(-k // cols)
    return ColPlan(*mx.wave_split(row_tiles * col_tiles, MAX_WAVES, TILES_PER_WAVE), col_tiles)


def build_cols(arch: str, dtype: str, mode: str, odd: bool, waves: int = MAX_WAVES):
    """An uncached @flyc.jit launcher of the columnwise kernel for one specialization (odd: 16-bit
    input with an odd K, whose last element needs a realigned load)."""
    spec = Spec(arch, dtype, mode)
    cpl = spec.elems_per_piece  # columns per lane
    name = f"mxfp4_cols_{spec.tag}" + ("_odd" if odd else "") + f"_w{waves}"
    source = SOURCE_TAG
    convert = hw_convert if spec.scaled_cvt else sw_convert

    def load_row(rx, off, x_bytes, first):
        """One row's 16 bytes. odd (16-bit, odd K): the tensor's last element is the low half of a
        dword whose high half lies past x's end, which the buffer range check (whole dwords) reads
        as 0; a load that ends past x's end but starts inside it is moved 2 bytes back, where its
        dwords end at x's end, and realigned (v_alignbit_b32 by 16 bits). At offset 0 (x of under 8
        elements) the element comes from a 2-byte load instead (rare branch), when M * K is odd:
        else x's last dword is whole (M = 2, K = 1: both rows' elements, read as they are)."""
        if not odd:
            return mx.dwords_of(mx.load(rx, off))
        inside = arith.andi(mx.cmp_ult(off, x_bytes), mx.cmp_ult(x_bytes, add(off, PIECE_BYTES)))
        back = mx.select(arith.andi(inside, mx.cmp_ne(off, 0)), 2, 0)
        words = mx.dwords_of(mx.load(rx, sub(off, back)))
        bits = mul(back, 8)
        words = [mx.alignbit(words[j + 1] if j + 1 < PIECE_DWORDS else const(0), words[j], bits)
                 for j in range(PIECE_DWORDS)]
        if not first:  # only a block's first row can start at offset 0
            return words
        at0 = arith.andi(arith.andi(inside, mx.cmp_eq(off, 0)), mx.cmp_ne(band(x_bytes, 2), 0))
        last = lshr(sub(x_bytes, 2), 2)  # the dword holding the last element (low half)

        def patched():
            value = mx.load_short(rx, sub(x_bytes, 2))
            return [mx.select(arith.andi(at0, mx.cmp_eq(last, j)), value, w) for j, w in enumerate(words)]

        return mx.if_else(mx.wave_any(at0), patched, lambda: words, types=[mx.i32_t()] * PIECE_DWORDS)

    def column_amaxes(regs):
        """(the amax patterns of the lane's cpl columns over its 32 rows as split() reads them,
        wave-uniform i1: whether one of the wave's columns may hold a NaN or an Inf). The test is one
        compare of the lane's peak; BF16 read as FP16 (gfx950) makes it only in the exact redo,
        which every such column takes (NONFINITE is above `suspicious`)."""
        chains = [[row[j] for row in regs] for j in range(PIECE_DWORDS)]
        acc = mx.chain_amax_interleaved(spec, chains, pinned=True)
        nonfinite = mx.NONFINITE[dtype]

        def peak(acc):
            p = acc[0] if spec.wide else mx.pair_max(acc[0])
            for a in acc[1:]:
                p = mx.umax(p, a if spec.wide else mx.pair_max(a))
            return p

        if spec.needs_exact_redo:  # columns from 2^121 up redo it exactly
            def exact():
                e = mx.chain_amax_interleaved(spec, chains, exact=True)
                return e + [mx.select(mx.wave_any(mx.cmp_uge(peak(e), nonfinite)), 1, 0)]

            out = mx.if_else(mx.wave_any(mx.cmp_uge(peak(acc), spec.suspicious)), exact, lambda: acc + [const(0)],
                             types=[mx.i32_t()] * (PIECE_DWORDS + 1))
            acc, bad = out[:-1], mx.wave_any(mx.cmp_ne(out[-1], 0))
        else:
            bad = mx.wave_any(mx.cmp_uge(peak(acc), nonfinite))
        return acc, bad

    def split(acc):
        """Each column's amax pattern: FP32 as is, 16-bit the halves (column 2j low, 2j + 1 high)."""
        return list(acc) if spec.wide else [h for a in acc for h in (band(a, 0xFFFF), lshr(a, 16))]

    def codes_and_data(regs, acc):
        """Each column's code (in the low byte) and 4 data dwords. BF16 on gfx950 takes the scale
        rule two columns per packed instruction (_mxfp4_common.scale_pair, as the rowwise kernel)."""
        if not (spec.scaled_cvt and spec.dtype == "bf16"):
            amaxes = split(acc)
            codes = [scale_code(spec, a) for a in amaxes]
            return codes, [convert(spec, column_words(regs, c), codes[c], amaxes[c]) for c in range(cpl)]
        codes, operands = [], []
        for a in acc:
            pair, tops = scale_pair(spec, a)
            codes += [pair, lshr(pair, 16)]
            operands += [mx.as_i32(mx.scale_from_tops(spec, tops, j)) for j in range(2)]
        return codes, [convert_pieces(spec, pieces(spec, column_words(regs, c)), [operands[c]] * 4) for c in range(cpl)]

    def column_words(regs, c):
        """Column c's 32 elements as conversion input: FP32 in row order, or 16 dwords of (row 2i,
        row 2i + 1) halves."""
        if spec.wide:
            return [row[c] for row in regs]
        return [mx.perm(regs[2 * i + 1][c // 2], regs[2 * i][c // 2], HALF_SEL[c % 2]) for i in range(MX_BLOCK // 2)]

    def tile(t, bufs, dims, grid):
        rx, rq, rs = bufs
        m, k, x_bytes = dims
        lane, col_tiles, magic, shift, nmb, row_bytes, row_steps, whole_rows, whole_cols = grid
        rt = lshr(add(mx.umulhi(t, magic), t), shift)
        ct = sub(t, mul(rt, col_tiles))
        mb = add(mul(rt, TILE_ROW_BLOCKS), band(lane, TILE_ROW_BLOCKS - 1))
        cg = add(mul(ct, TILE_GROUPS), lshr(lane, 3))
        off = add(mul(mul(mb, MX_BLOCK), row_bytes), mul(cg, PIECE_BYTES))

        def checked():  # each row's offset range-checked: rows past M read 0, groups past K are not stored
            offs = [off]
            for _ in range(1, MX_BLOCK):
                offs.append(add(offs[-1], row_bytes))
            return [w for r, o in enumerate(offs) for w in load_row(rx, o, x_bytes, r == 0)]

        if odd:
            flat = checked()
        else:
            # a tile inside x: row 8j + i at the vector offset of row 8j plus the scalar offset of i
            # rows (the range check sees only the vector offset, which is why the edge tiles take
            # `checked`): 3 vector adds instead of 31
            inside = arith.andi(mx.cmp_ult(rt, whole_rows), mx.cmp_ult(ct, whole_cols))

            def fast():
                bases = [off]
                for _ in range(1, MX_BLOCK // ROW_STEPS):
                    bases.append(add(bases[-1], row_steps[-1]))
                return [w for b in bases for so in row_steps[:-1] for w in mx.dwords_of(mx.load(rx, b, soffset=so))]

            flat = mx.if_else(inside, fast, checked, types=[mx.i32_t()] * (MX_BLOCK * PIECE_DWORDS))
        regs = [flat[r * PIECE_DWORDS:(r + 1) * PIECE_DWORDS] for r in range(MX_BLOCK)]
        mx.wait_loads()  # one wait for the 32 rows, not one per row
        acc, any_bad = column_amaxes(regs)
        codes, data = codes_and_data(regs, acc)
        rows = sub(m, mul(mb, MX_BLOCK))  # rows of this block present (>= 32 for inner blocks)

        def patched():
            bads = [mx.cmp_uge(a, mx.NONFINITE[dtype]) for a in split(acc)]
            nan = nan_words(rows)
            out = []
            for c in range(cpl):
                out += [mx.select(bads[c], n, d) for n, d in zip(nan, data[c])] + [mx.select(bads[c], mx.E8M0_NAN, codes[c])]
            return out

        flat = mx.if_else(any_bad, patched, lambda: [v for c in range(cpl) for v in data[c] + [codes[c]]],
                          types=[mx.i32_t()] * (5 * cpl))
        # column c's offsets: the first column's plus c rows of the outputs; a column past K lands
        # past the outputs' end (dropped), a row block past the last is moved out of range
        block = add(mul(mul(cg, cpl), nmb), mb)  # (first column, row block)
        ok = mx.cmp_ult(mb, nmb)
        s_off, d_off = mx.select(ok, block, mx.OOB), mx.select(ok, mul(block, OUT_BLOCK_BYTES), mx.OOB)
        for c in range(cpl):
            mx.store_byte(flat[5 * c + 4], rs, add(s_off, mul(nmb, c)) if c else s_off)
            mx.store(mx.from_elements(flat[5 * c:5 * c + 4]), rq, add(d_off, mul(nmb, c * OUT_BLOCK_BYTES)) if c else d_off)

    def body(x, q, s, m, k, nmb, row_bytes, tiles, tiles_per_wave, col_tiles, magic, shift):
        tid = val(fx.Int32(fx.thread_idx.x))
        wave = mx.readfirstlane(lshr(tid, 6))
        lane = band(tid, WAVE - 1)
        m, k, nmb, row_bytes = val(m), val(k), val(nmb), val(row_bytes)
        x_bytes = mul(m, row_bytes)
        zero = const(0, mx.i64_t())
        rx = mx.buffer(x, zero, mx.to_i64(x_bytes))
        rq = mx.buffer(q, zero, mx.to_i64(mul(mul(k, nmb), OUT_BLOCK_BYTES)))
        rs = mx.buffer(s, zero, mx.to_i64(mul(k, nmb)))
        first = add(mul(val(fx.Int32(fx.block_idx.x)), mul(tiles_per_wave, waves)), mul(wave, tiles_per_wave))
        bufs, dims = (rx, rq, rs), (m, k, x_bytes)
        # 0 .. 8 rows' distances (scalar, once per wave) and the tiles inside x (row tiles of 256
        # rows below M, column tiles of 128 bytes within a row)
        row_steps = [const(0)] + [mul(row_bytes, r) for r in range(1, ROW_STEPS + 1)]
        whole_rows = lshr(m, (MX_BLOCK * TILE_ROW_BLOCKS).bit_length() - 1)
        whole_cols = lshr(row_bytes, (TILE_GROUPS * PIECE_BYTES).bit_length() - 1)
        grid = (lane, val(col_tiles), val(magic), val(shift), nmb, row_bytes, row_steps, whole_rows, whole_cols)

        def step(i):
            t = mx.opaque_sgpr(add(first, i))
            mx.if_then(mx.cmp_ult(t, val(tiles)), lambda: tile(t, bufs, dims, grid))

        mx.for_range(tiles_per_wave, step)

    @flyc.kernel(name=name, known_block_size=[WAVE * waves, 1, 1])
    def kernel(
        x: fx.Tensor,  # (M, K) BF16/FP16/FP32, row-major
        q: fx.Tensor,  # (K, nmb * 16) uint8: packed E2M1 of x^T, nmb = ceil(M / 32)
        s: fx.Tensor,  # (K, nmb) uint8: E8M0 codes
        m: fx.Int32,
        k: fx.Int32,
        nmb: fx.Int32,  # row blocks: ceil(M / 32)
        row_bytes: fx.Int32,  # K * element bytes
        tiles: fx.Int32,  # row tiles * column tiles
        tiles_per_wave: fx.Int32,
        col_tiles: fx.Int32,
        magic: fx.Int32,  # floor(t / col_tiles) = (umulhi(t, magic) + t) >> shift
        shift: fx.Int32,
    ):
        body(x, q, s, m, k, nmb, row_bytes, tiles, tiles_per_wave, col_tiles, magic, shift)

    @flyc.jit
    def launch(
        x: fx.Tensor,
        q: fx.Tensor,
        s: fx.Tensor,
        m: fx.Int32,
        k: fx.Int32,
        nmb: fx.Int32,
        row_bytes: fx.Int32,
        tiles: fx.Int32,
        tiles_per_wave: fx.Int32,
        col_tiles: fx.Int32,
        magic: fx.Int32,
        shift: fx.Int32,
        workgroups: fx.Int32,
        stream: fx.Stream = fx.Stream(None),
    ):
        assert source and name  # closure values, so FlyDSL's disk cache keys on them (sources, variant)
        kernel(x, q, s, m, k, nmb, row_bytes, tiles, tiles_per_wave, col_tiles, magic, shift).launch(
            grid=(workgroups, 1, 1), block=(WAVE * waves, 1, 1), stream=stream
        )

    return launch


_cached_cols = functools.lru_cache(maxsize=None)(build_cols)


def too_large(shape, dtype: torch.dtype) -> str | None:
    """Why one launch cannot take an (M, K) tensor (32-bit buffer offsets; the last row tile's
    offsets reach 256 rows past M), or None."""
    m, k = shape
    row_bytes = k * torch.empty((), dtype=dtype).element_size()
    x_bytes = (m + MX_BLOCK * TILE_ROW_BLOCKS) * row_bytes
    out_bytes = k * -(-m // MX_BLOCK) * OUT_BLOCK_BYTES
    if max(x_bytes, out_bytes) >= mx.MAX_LAUNCH_BYTES:
        return f"x plus 256 rows ({x_bytes} bytes) or its data ({out_bytes} bytes) reaches 2 GiB (32-bit buffer offsets)"
    return None


def quantize_cols(x: torch.Tensor, *, arch: str, scaling_mode: str = "floor"):
    """Columnwise MXFP4 quantize (cast-transpose) of a contiguous (M, K) BF16/FP16/FP32 tensor on
    `arch`, as flyquant.reference.mxfp4_quantize(x, 0, scaling_mode): (uint8 (K, ceil(M/32) * 16),
    float8_e8m0fnu (K, ceil(M/32))). Inputs are validated by the caller."""
    m, k = x.shape
    reason = too_large(x.shape, x.dtype)
    if reason:
        raise ValueError(reason)
    nmb = -(-m // MX_BLOCK)
    data, scales = allocate(k, nmb, x.device)
    if k * nmb == 0:
        return data, scales.view(torch.float8_e8m0fnu)
    cfg = plan_cols((m, k), x.dtype, arch)
    magic, shift = mx.divide_magic(cfg.col_tiles)
    tiles = -(-nmb // TILE_ROW_BLOCKS) * cfg.col_tiles
    with toolchain.target(arch):
        odd = x.element_size() == 2 and k % 2 == 1
        launch = _cached_cols(arch, TORCH_DTYPES[x.dtype], scaling_mode, odd, cfg.waves)
        launch(x, data, scales, m, k, nmb, k * x.element_size(), tiles, cfg.tiles_per_wave, cfg.col_tiles,
               mx.i32_bits(magic), shift,
               cfg.workgroups, stream=mx.torch_stream(x))
    return data, scales.view(torch.float8_e8m0fnu)
