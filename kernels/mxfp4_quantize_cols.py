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

Dual (kernels/mxfp4_quantize_dual.py's register kernel, K % 32 == 0): the same tile and loads
give the rowwise blocks as well. Lanes take (row block, column group) by _lane_split over the
rowwise kernel's DISTS (gfx950: the 4 (FP32 8) lanes of a rowwise block at distances 32, 16 (, 8)
for v_permlane32/16_swap; gfx942: 2, 1 (8, 2, 1) for DPP), which permutes the lanes of each load
and store instruction but not the bytes it accesses. The rows first (row_half): per row a partial
amax over the lane's 16 bytes, reduce-scattered over the block's lanes (each lane owns the scale
of 8 (FP32 4) rows: its code byte stored; gfx950 16-bit: two rows' codes by one packed scale
rule), the conversion operands gathered back, and each lane converts its 8 (4) elements of each
row to one data dword (FP32: 2 bytes), 8 rows at a time (gfx942 16-bit: 4, the software
encoder's live values), into the workgroup's LDS stage: 256 rows x 128 bytes, a workgroup being
the 4 (FP32: 8) waves of one row tile whose column tiles make one 128-byte rowwise line; a row's
16-byte blocks are XOR-swizzled by its row block (the lanes of a stage store in different banks).
NaN/Inf row blocks (code 0xFF) overwrite their staged data in a rare branch. Then the columns
(the code above) on opaque copies of the registers: LLVM would otherwise share values of both
halves (x & 0x7FFF7FFF, FP32 sign bits) and keep them alive across the rows, past 256 VGPRs. A
barrier, and each wave stores 8 (4) lines per lane, 16 bytes a lane: whole lines where K % 256
== 0. Tiles past K do nothing; rows past M and blocks past the last are dropped as above.

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
from flydsl.expr import gpu

from flyquant import toolchain
from flyquant.arch import arch_info

from . import _mx_common as mx
from . import _mxfp4_common
from ._mx_common import MX_BLOCK, PIECE_BYTES, PIECE_DWORDS, WAVE, Spec, add, band, bor, const, lshr, mul, shl, sub, val
from ._mxfp4_common import (E2M1_NAN_X8, OUT_BLOCK_BYTES, TORCH_DTYPES, allocate, convert_pieces, f32_elements,
                            hw_convert, nan_words, piece_operand, pieces, scale_code, scale_pair, sw16_pieces,
                            sw32_pieces, sw_convert, sw_outside16)
from .mxfp8_quantize_2d import DISTS, _lane_split

SOURCE_TAG = mx.source_tag(sys.modules[__name__], _mxfp4_common)

TILE_ROW_BLOCKS = 8  # row blocks per wave tile (lane % 8)
TILE_GROUPS = WAVE // TILE_ROW_BLOCKS  # 16-byte column groups per wave tile (lane / 8)
ROW_STEPS = 8  # inner tiles' loads: a vector offset per 8 rows, a scalar one per row within them
HALF_SEL = (0x05040100, 0x07060302)  # v_perm_b32: the low / high halves of (hi, lo) dwords
MAX_WAVES = 4
TILES_PER_WAVE = 2
LINE_BYTES = 128
STAGE_ROWS = MX_BLOCK * TILE_ROW_BLOCKS  # dual: a row tile's rowwise lines, staged in LDS


def dual_waves(elem_bytes: int) -> int:
    """Dual: the waves of a workgroup, whose column tiles' rowwise data make whole lines: 4 of 2
    blocks (16-bit), 8 of 1 (FP32)."""
    return LINE_BYTES // (TILE_GROUPS * PIECE_BYTES // elem_bytes // MX_BLOCK * OUT_BLOCK_BYTES)


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


def build_cols(arch: str, dtype: str, mode: str, odd: bool, waves: int = MAX_WAVES, dual: bool = False):
    """An uncached @flyc.jit launcher of the columnwise kernel for one specialization (odd: 16-bit
    input with an odd K, whose last element needs a realigned load); dual: the dual kernel
    (kernels/mxfp4_quantize_dual.py, K % 32 == 0; waves: dual_waves)."""
    spec = Spec(arch, dtype, mode)
    assert not (dual and (odd or waves != dual_waves(spec.elem_bytes)))
    cpl = spec.elems_per_piece  # columns per lane
    name = f"mxfp4_dual_{spec.tag}" if dual else f"mxfp4_cols_{spec.tag}" + ("_odd" if odd else "") + f"_w{waves}"
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

    def tile(place, bufs, dims, grid):
        """The lane's 32 rows (4 dwords each) of the tile at place = (row tile, column tile, the
        lane's row block, its column group)."""
        rx = bufs[0]
        m, k, x_bytes = dims
        nmb, row_bytes, row_steps, whole_rows, whole_cols = grid[1:]
        rt, ct, mb, cg = place
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
        return regs

    def column_half(regs, place, bufs, dims, grid):
        """The lane's columns quantized over its row block and stored."""
        rq, rs = bufs[1:3]
        m, nmb = dims[0], grid[1]
        mb, cg = place[2:]
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

    def setup(x, q, s, m, k, nmb, row_bytes):
        """(wave, lane, buffers of x and the columnwise outputs, dims, grid: the lane, nmb, row_bytes,
        0 .. 8 rows' distances (scalar, once per wave) and the tiles inside x (row tiles of 256 rows
        below M, column tiles of 128 bytes within a row))."""
        tid = val(fx.Int32(fx.thread_idx.x))
        wave = mx.readfirstlane(lshr(tid, 6))
        lane = band(tid, WAVE - 1)
        m, k, nmb, row_bytes = val(m), val(k), val(nmb), val(row_bytes)
        x_bytes = mul(m, row_bytes)
        zero = const(0, mx.i64_t())
        rx = mx.buffer(x, zero, mx.to_i64(x_bytes))
        rq = mx.buffer(q, zero, mx.to_i64(mul(mul(k, nmb), OUT_BLOCK_BYTES)))
        rs = mx.buffer(s, zero, mx.to_i64(mul(k, nmb)))
        row_steps = [const(0)] + [mul(row_bytes, r) for r in range(1, ROW_STEPS + 1)]
        whole_rows = lshr(m, (MX_BLOCK * TILE_ROW_BLOCKS).bit_length() - 1)
        whole_cols = lshr(row_bytes, (TILE_GROUPS * PIECE_BYTES).bit_length() - 1)
        return wave, lane, (rx, rq, rs), (m, k, x_bytes), (lane, nmb, row_bytes, row_steps, whole_rows, whole_cols)

    def body(x, q, s, m, k, nmb, row_bytes, tiles, tiles_per_wave, col_tiles, magic, shift):
        wave, lane, bufs, dims, grid = setup(x, q, s, m, k, nmb, row_bytes)
        first = add(mul(val(fx.Int32(fx.block_idx.x)), mul(tiles_per_wave, waves)), mul(wave, tiles_per_wave))

        def place(t):
            rt = lshr(add(mx.umulhi(t, val(magic)), t), val(shift))
            ct = sub(t, mul(rt, val(col_tiles)))
            return (rt, ct, add(mul(rt, TILE_ROW_BLOCKS), band(lane, TILE_ROW_BLOCKS - 1)),
                    add(mul(ct, TILE_GROUPS), lshr(lane, 3)))

        def step(i):
            t = mx.opaque_sgpr(add(first, i))

            def run():
                at = place(t)
                column_half(tile(at, bufs, dims, grid), at, bufs, dims, grid)

            mx.if_then(mx.cmp_ult(t, val(tiles)), run)

        mx.for_range(tiles_per_wave, step)

    # ---- dual: the rowwise blocks of the same registers ----------------------------------------
    dists = DISTS[(arch, spec.elem_bytes)]  # the lanes of a rowwise block (its pieces)
    n_own = MX_BLOCK >> len(dists)  # rows whose scale a lane computes (rows n_own * piece + j)
    packed = spec.scaled_cvt and not spec.wide  # gfx950 16-bit: two rows' scales in one dword
    # rows converted, patched and staged at a time (gfx942 16-bit: the encoder's values of 4 rows live at once)
    CHUNK = 4 if not (spec.scaled_cvt or spec.wide) else 8

    def row_amaxes(regs, exact):
        """The amax patterns of the lane's own rows (reduce-scattered over the block's lanes);
        packed: rows 2i, 2i + 1 in the halves of dword i."""
        # gfx942 16-bit: the encoder's |x| of the same dwords stay apart (not all kept from here)
        parts = mx.chain_amax_interleaved(spec, regs, exact, mask=mx.opaque_sgpr(const(mx.abs_mask(spec))))
        red = mx.reduce_scatter(arch, dists, parts, functools.partial(mx.amax_max, spec))
        if packed:
            return [mx.halves_pair(red[2 * i], red[2 * i + 1]) for i in range(n_own // 2)]
        return [mx.amax_halves(spec, a) for a in red]

    def gathered(values, per):
        """Per row (0 .. 31) the value its owner lane holds (values: the lane's, each covering
        `per` consecutive own rows): [(value, index within it)]."""
        out = [None] * MX_BLOCK
        for i, v in enumerate(values):
            for g, w in enumerate(mx.all_gather(arch, dists, v)):
                for h in range(per):
                    out[n_own * g + per * i + h] = (w, h)
        return out

    def row_half(regs, rs1, s_off, nkb, at):
        """The lane's rows quantized as its 8 (FP32: 4) columns of their rowwise blocks: the own
        rows' codes stored (own row j at s_off + j nkb in rs1), every row's data dword (16-bit: 4 bytes,
        FP32: 2) into the LDS stage (row r at `at` + r lines), CHUNK rows at a time."""
        amax = row_amaxes(regs, False)
        if spec.needs_exact_redo:  # BF16 read as FP16 (gfx950): a wave with a pattern from 2^121 up redoes it exactly
            peak = functools.reduce(mx.umax, [mx.pair_max(a) for a in amax])
            amax = mx.if_else(mx.wave_any(mx.cmp_uge(peak, spec.suspicious)), lambda: row_amaxes(regs, True),
                              lambda: amax, types=[mx.i32_t()] * len(amax))
        rare = all_codes = None
        if packed:  # codes c_hi << 16 | c_lo, NaN/Inf flags in bits 0 and 16
            pairs = [scale_pair(spec, a) for a in amax]
            operands = [mx.as_i32(mx.scale_from_tops(spec, t, h)) for t, h in gathered([t for _, t in pairs], 2)]
            bits = [mx.nonfinite_halves(spec, a) for a in amax]
            bad = functools.reduce(arith.ori, [mx.cmp_ne(b, 0) for b in bits])
            codes = [bor(c, mul(b, mx.E8M0_NAN)) for (c, _), b in zip(pairs, bits)]
        else:
            raw = [scale_code(spec, a) for a in amax]
            operands = [w for w, _ in gathered([piece_operand(spec, c) for c in raw], 1)]
            if not (spec.scaled_cvt or spec.wide):  # gfx942 16-bit: blocks outside the packed encoder's range
                rare = mx.wave_any(functools.reduce(arith.ori, [sw_outside16(spec, c, a) for c, a in zip(raw, amax)]))
                all_codes = lambda: [w for w, _ in gathered(raw, 1)]  # noqa: E731
            flags = [mx.cmp_uge(a, mx.NONFINITE[dtype]) for a in amax]
            bad = functools.reduce(arith.ori, flags)
            bits = [arith.extui(mx.i32_t(), f) for f in flags]
            codes = [mx.select(f, mx.E8M0_NAN, c) for f, c in zip(flags, raw)]
        for j in range(n_own):
            c = codes[j // 2] if packed else codes[j]
            mx.store_byte(lshr(c, 16) if packed and j % 2 else c, rs1, add(s_off, mul(nkb, j)) if j else s_off)
        store = mx.lds_store_short if spec.wide else mx.lds_store

        def staged(convert):  # every row's data dword into the stage, CHUNK rows at a time (live values)
            for i in range(0, MX_BLOCK, CHUNK):
                for r, d in enumerate(convert(slice(i, i + CHUNK)), i):
                    store(d, add(at, r * LINE_BYTES))

        if rare is None:
            staged(lambda c: convert_pieces(spec, regs[c], operands[c]))
        else:  # gfx942 16-bit, a row block outside the packed encoder's range: the wave's rows through FP32 (the
            # widened elements opaque: LLVM would fold FP16's into v_fma_mix_f32, which flyquant.emu lacks)
            wide = Spec(arch, "fp32", mode)
            as_f32 = lambda c: [mx.opaque_vgprs(f32_elements(spec, w)) for w in regs[c]]  # noqa: E731
            via_f32 = lambda cs: staged(lambda c: sw32_pieces(wide, as_f32(c), cs[c]))  # noqa: E731
            mx.if_else(rare, lambda: via_f32(all_codes()),
                       lambda: staged(lambda c: sw16_pieces(spec, regs[c], operands[c])))

        def nan_rows():  # a NaN/Inf row block's data: every nibble 0x7 (K % 32 == 0: no padding), over the stage's
            for r, (w, h) in enumerate(gathered(bits, 2 if packed else 1)):
                nan_row = lambda r=r: store(const(E2M1_NAN_X8), add(at, r * LINE_BYTES))  # noqa: E731
                mx.if_then(mx.cmp_ne(band(w, 1 << 16 * h), 0), nan_row)

        mx.if_then(mx.wave_any(bad), nan_rows)

    def dual_body(x, q, s, q1, s1, m, k, nmb, nkb, row_bytes):
        wave, lane, bufs, dims, grid = setup(x, q, s, m, k, nmb, row_bytes)
        m, nkb = dims[0], val(nkb)
        col, piece = _lane_split(lane, dists)
        rb = band(col, TILE_ROW_BLOCKS - 1)
        unit = add(mul(wave, TILE_GROUPS // spec.pieces_per_block), lshr(col, 3))  # the lane's block in the line
        rt, bx = (val(fx.Int32(v)) for v in (fx.block_idx.y, fx.block_idx.x))
        ct = add(mul(bx, waves), wave)
        mb = add(mul(rt, TILE_ROW_BLOCKS), rb)
        cg = add(mul(ct, TILE_GROUPS), add(shl(lshr(col, 3), len(dists)), piece))
        zero = const(0, mx.i64_t())
        rq1 = mx.buffer(q1, zero, mx.to_i64(mul(mul(m, nkb), OUT_BLOCK_BYTES)))
        rs1 = mx.buffer(s1, zero, mx.to_i64(mul(m, nkb)))
        alloc = fx.SharedAllocator().allocate(STAGE_ROWS * LINE_BYTES, alignment=PIECE_BYTES)
        stage = val(fx.Int32(fx.ptrtoint(alloc.peek().ptr)))
        kb0 = mul(bx, LINE_BYTES // OUT_BLOCK_BYTES)  # the workgroup's first block of a row

        def quantize():
            place = (rt, ct, mb, cg)
            regs = tile(place, bufs, dims, grid)
            fx.rocdl.sched_barrier(0)  # nothing above the loads' wait (one wait, not one per register)
            # codes: own row j is row 32 mb + n_own piece + j (rows past M land past the codes' end)
            kb = add(kb0, unit)
            row0 = add(mul(mb, MX_BLOCK), mul(piece, n_own))
            s_off = mx.select(mx.cmp_ult(kb, nkb), add(mul(row0, nkb), kb), mx.OOB)
            # data: row r of the row tile's stage is a line of 8 blocks, 16 bytes each, block b at
            # 16 (b ^ (r / 32 % 8)) (the 8 row blocks of a store in different banks)
            at = add(add(stage, mul(rb, MX_BLOCK * LINE_BYTES)),
                     add(shl(arith.xori(unit, rb), 4), mul(piece, spec.elems_per_piece // 2)))
            row_half(regs, rs1, s_off, nkb, at)
            # the columns from opaque copies of the registers: LLVM would otherwise share values of
            # the two halves (|x|, FP32 signs) and keep them alive across the row half
            column_half([mx.opaque_vgprs(r) for r in regs], place, bufs, dims, grid)

        mx.if_then(mx.cmp_ult(mul(ct, TILE_GROUPS * PIECE_BYTES), grid[2]), quantize)  # a tile past K: none
        gpu.barrier()
        # the stage's lines: 8 lanes a line, 8 lines per wave and read
        lines = STAGE_ROWS // (waves * WAVE // (LINE_BYTES // PIECE_BYTES))
        b = band(lane, LINE_BYTES // PIECE_BYTES - 1)
        ok = mx.cmp_ult(add(kb0, b), nkb)
        rows = [add(mul(add(i * waves, wave), WAVE // 8), lshr(lane, 3)) for i in range(lines)]
        swizzled = lambda r: shl(arith.xori(b, band(lshr(r, 5), TILE_ROW_BLOCKS - 1)), 4)  # noqa: E731
        data = [mx.lds_load(PIECE_DWORDS, add(stage, add(mul(r, LINE_BYTES), swizzled(r)))) for r in rows]
        mx.wait_lds()  # one wait for the reads
        for r, d in zip(rows, data):
            row = add(mul(rt, STAGE_ROWS), r)
            mx.store(d, rq1, mx.select(ok, shl(add(mul(row, nkb), add(kb0, b)), 4), mx.OOB))

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

    @flyc.kernel(name=name, known_block_size=[WAVE * waves, 1, 1])
    def dual_kernel(
        x: fx.Tensor,  # (M, K) BF16/FP16/FP32, row-major, K % 32 == 0
        q: fx.Tensor,  # (K, nmb * 16) uint8: columnwise packed E2M1
        s: fx.Tensor,  # (K, nmb) uint8: columnwise codes
        q1: fx.Tensor,  # (M, nkb * 16) uint8: rowwise packed E2M1
        s1: fx.Tensor,  # (M, nkb) uint8: rowwise codes
        m: fx.Int32,
        k: fx.Int32,
        nmb: fx.Int32,  # ceil(M / 32)
        nkb: fx.Int32,  # K / 32
        row_bytes: fx.Int32,  # K * element bytes
    ):
        dual_body(x, q, s, q1, s1, m, k, nmb, nkb, row_bytes)

    @flyc.jit
    def dual_launch(
        x: fx.Tensor,
        q: fx.Tensor,
        s: fx.Tensor,
        q1: fx.Tensor,
        s1: fx.Tensor,
        m: fx.Int32,
        k: fx.Int32,
        nmb: fx.Int32,
        nkb: fx.Int32,
        row_bytes: fx.Int32,
        col_groups: fx.Int32,
        row_tiles: fx.Int32,
        stream: fx.Stream = fx.Stream(None),
    ):
        assert source and name  # closure values, so FlyDSL's disk cache keys on them (sources, variant)
        dual_kernel(x, q, s, q1, s1, m, k, nmb, nkb, row_bytes).launch(
            grid=(col_groups, row_tiles, 1), block=(WAVE * waves, 1, 1), stream=stream
        )

    return dual_launch if dual else launch


_cached_cols = toolchain.launcher_cache(build_cols)


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
    with toolchain.target(arch, x.device):
        odd = x.element_size() == 2 and k % 2 == 1
        launch = _cached_cols(arch, TORCH_DTYPES[x.dtype], scaling_mode, odd, cfg.waves)
        launch(x, data, scales, m, k, nmb, k * x.element_size(), tiles, cfg.tiles_per_wave, cfg.col_tiles,
               mx.i32_bits(magic), shift,
               cfg.workgroups, stream=toolchain.stream(x))
    return data, scales.view(torch.float8_e8m0fnu)
