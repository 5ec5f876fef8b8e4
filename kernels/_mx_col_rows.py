"""The column kernel's row-major outputs, converted from the registers kernels/_mx_col.py's
build_col loaded (a lane: 16 bytes of each of 16 rows), and the tile geometry both files share.

dual (1x32 along K besides the kernel's 32 x 1 blocks): the lanes also reduce each row's 8 (4)
columns with their 3 (7) neighbours in a 32-column block (DPP) and convert the 1x32 outputs row
by row. A tile holds 64 (32) bytes of each output row, so the wave collects a row's 128-byte line
from 2 (4) consecutive column tiles in LDS and then stores whole lines, 8 rows per instruction
(16 KiB of LDS per wave). Where that would cost occupancy (gfx942 FP16/FP32, see staged_tiles)
only the line's first half is staged (8 KiB) and the group's last tile stores whole lines from its
registers and the stage, 4 rows per 8-byte store: lanes of row groups 0-3 give 8 bytes of the
second half of rows 16g + r while lanes of groups 4-7 give the staged bytes of the same rows,
then the other way round. FP32's second half is two tiles: the third tile's rows are carried in
registers (16 VGPRs) to the fourth, and neighbouring column lanes trade them so each holds 8
consecutive bytes.

3d_t (32 x 32 blocks, data stored row-major: the 3D quantize of the transposed view): tiles of 64
(FP32: 32) rows x 128 columns, 16 (32) lanes per row, so each row's store is one whole 128-byte
output line; a block's 8 (16) lanes are one aligned group, reduced by DPP (rows_3d_t, _rows_32x32;
the lane mapping is _mx_col._lane_rc). Columns past K are masked off by lane (K % 32 == 0):
row-major, they would be the next row's.
"""

from __future__ import annotations

from flyquant.arch import arch_info

from . import _mx_common as mx
from ._mx_common import MX_BLOCK, OOB, WAVE, add, band, bor, const, lshr, mul, sub

# build_col's tiles: a lane's rows (16 loads of 16 bytes), the tile heights of the 32x1 / 3D
# kernel (3d_t: rows_3d_t)
ROWS_PER_LANE = 16
TILE_ROWS = (128, 64)  # 8 or 4 lane row groups; 64 for N = 64 (see mxfp8_quantize_3d.plan_col)
# dual: a wave's 1x32 output rows go through LDS, up to LINE_BYTES of a row (a line group of
# 128 / tile columns consecutive column tiles: 2, FP32 4) per row of a 128-row tile. Groups
# start at a wave's first tile: mxfp8_quantize_3d.TILES_PER_WAVE is a multiple of them (with
# fewer column tiles, one wave has the whole row).
LINE_BYTES = 128
FLUSH_ROWS = WAVE * mx.PIECE_BYTES // LINE_BYTES  # staged rows per flush instruction


def staged_tiles(arch: str, dtype: str) -> int:
    """dual: how many column tiles of a line group put their 1x32 rows in LDS. All of them (the
    group's last tile then stores the lines from LDS: _flush_rows), those of the line's first
    half (8 KiB per wave: the group's last tile stores the lines from its registers, FP32 also
    from the previous tile's rows kept in registers, and the stage: _store_lines), or none (each
    tile stores its part of the lines). The most that costs no occupancy: the dual kernel's
    registers allow 2 waves per SIMD (8 per CU; gfx942 BF16: over 256 VGPRs, 4), and gfx942's
    64 KiB of LDS per CU hold 8 waves' half stages, not full ones."""
    waves_per_cu = 4 if (arch == "gfx942" and dtype == "bf16") else 8
    tile_bytes = _tile_cols(dtype, TILE_ROWS[0])  # one output byte per column
    group = LINE_BYTES // tile_bytes
    for staged in (group, group // 2):
        if arch_info(arch).lds_bytes_per_cu >= waves_per_cu * stage_bytes(dtype, staged):
            return staged
    return 0


def stage_bytes(dtype: str, staged: int) -> int:
    """dual: LDS bytes of one wave's stage for `staged` tiles of a line group."""
    return TILE_ROWS[0] * staged * _tile_cols(dtype, TILE_ROWS[0])


def _tile_cols(dtype: str, tile_rows: int) -> int:
    return WAVE // (tile_rows // ROWS_PER_LANE) * (mx.PIECE_BYTES // mx.ELEM_BYTES[dtype])


def _rows_buffer(ctx, first_col):
    """dual: the 1x32 data (M, K) row-major from row r0, column first_col to its end."""
    tile = add(mul(ctx["r0"], ctx["k"]), first_col)
    return mx.buffer(ctx["q1"], tile, sub(mul(ctx["n"], ctx["k"]), tile))


def _row_blocks(spec, words, nan_pass, ctx):
    """dual: the 1x32 quantization of the tile from the same registers. A lane's 16 rows x
    cols columns are parts of 1x32 blocks of MX_BLOCK / cols lanes (the lanes c that differ in
    their low bits: DPP all-reduce), converted per row (row-major (M, K) data: into the wave's
    LDS stage, by the group's last tile with a half-line stage into lines (_store_lines), or
    stored at once; non-finite blocks' rows 0x7F) and codes (M, K/32) stored by the first lane
    of each block. With a carried tile (FP32 half-line stage) returns the tile's row dwords."""
    wide, cols = spec.wide, mx.PIECE_BYTES // spec.elem_bytes
    lanes = MX_BLOCK // cols
    exact = ctx["exact"]
    amax = mx.chain_amax_interleaved(spec, [list(w) for w in words], exact)
    amax = [mx.amax_halves(spec, a) for a in amax]
    dist = 1
    while dist < lanes:
        amax = [mx.umax(a, mx.dpp_reduce_partner(a, dist)) for a in amax]
        dist *= 2
    convs = []
    if wide:
        for a in amax:
            code, conv = mx.block_scale(spec, a)
            convs.append((code, conv))
    else:
        for r in range(0, ROWS_PER_LANE, 2):
            codes, tops = mx.pair_scales(spec, mx.pack_pair(amax[r + 1], amax[r]))
            convs += [(codes, mx.scale_from_tops(spec, tops, 0)), (lshr(codes, 16), mx.scale_from_tops(spec, tops, 1))]
    c0, k = ctx["c0"], ctx["k"]
    if "stage_lane" in ctx:
        stage = add(ctx["stage_lane"], ctx["slot_cols"])  # the lane's 16 rows of this tile in LDS

        def put(data, r):
            mx.lds_store(data, add(stage, r * ctx["stage_row"]))
    else:
        rq = _rows_buffer(ctx, c0)

        def put(data, r):
            mx.store(data, rq, ctx["lane_q1"], ctx["row_k"][r])
    kb = lshr(k, 5)
    tile_s = add(mul(ctx["r0"], kb), lshr(c0, 5))
    rs = mx.buffer(ctx["s1"], tile_s, sub(mul(ctx["n"], kb), tile_s))
    lane_ok = mx.arith.andi(ctx["row_ok"], mx.cmp_ult(add(c0, ctx["lane_cols"]), k))
    lead = mx.arith.andi(lane_ok, mx.cmp_eq(band(ctx["c"], lanes - 1), 0))
    lane_s = add(mul(mul(ctx["g"], ROWS_PER_LANE), kb), lshr(ctx["lane_cols"], 5))

    nan_x4 = const(mx.E4M3_NAN_X4)

    def rows(put):
        for r in range(ROWS_PER_LANE):
            code, conv = convs[r]
            outs = mx.convert_piece(spec, list(words[r]), conv)
            data = outs[0] if len(outs) == 1 else mx.from_elements(outs)
            if nan_pass:  # 0x7F over a non-finite block's row (a bitwise select: 16 lane masks
                # would not fit in the SGPRs)
                bad = mx.lane_word(lshr(sub(mx.NONFINITE[spec.dtype] - 1, amax[r]), 31))  # amax < 2^31
                data = [mx.bit_select(bad, nan_x4, d) for d in ([data] if len(outs) == 1 else outs)]
                data = data[0] if len(data) == 1 else mx.from_elements(data)
            put(data, r)

    def codes():
        for r in range(ROWS_PER_LANE):
            mx.store_byte(convs[r][0], rs, lane_s, mul(r, kb) if r else 0)

    out = None
    if "carry" in ctx:  # FP32 half-line stage: the tile before the group's last one keeps its rows
        out = []
        rows(lambda data, r: out.append(data))
        mx.if_then(mx.arith.andi(lane_ok, mx.cmp_ult(ctx["slot"], ctx["staged"])),
                   lambda: [put(data, r) for r, data in enumerate(out)])

        def lines():
            # the pair exchange gives lane c even 8 bytes of the carried tile's row (its own 4 and
            # lane c + 1's), lane c odd 8 of this tile's (at a row's end the carried tile is this
            # one: the columns of the tiles after it are masked off)
            store = _store_lines(ctx)
            for r, data in enumerate(out):
                prev = mx.select(ctx["last"], ctx["carry"][r], data)
                odd = ctx["odd"]
                got = mx.dpp_xor(mx.bit_select(odd, prev, data), 1)  # the partner's prev (odd) / data (even)
                store(mx.from_elements([mx.bit_select(odd, got, prev), mx.bit_select(odd, data, got)]), r)

        mx.if_then(ctx["held"], lines)
    elif "held" in ctx:  # every lane takes part in the line stores (masked per row group there)
        mx.if_else(ctx["held"], lambda: rows(_store_lines(ctx)), lambda: mx.if_then(lane_ok, lambda: rows(put)))
    else:
        mx.if_then(lane_ok, lambda: rows(put))
    mx.if_then(lead, codes)
    if nan_pass:
        for r in range(ROWS_PER_LANE):
            bad = mx.arith.andi(lead, mx.cmp_uge(amax[r], mx.NONFINITE[spec.dtype]))
            mx.if_then(bad, lambda r=r: mx.store_byte(mx.E8M0_NAN, rs, lane_s, mul(r, kb) if r else 0))
    return out


def _store_lines(ctx):
    """dual, half-line stages (only the line's first 64 bytes in LDS): the put(data, r) of the
    group's last tile (or, at a row's end, of its last tile there), which stores whole lines.
    data is the lane's 8 bytes of the line's second half in row r of its 16 (16-bit: its own; FP32:
    after the pair exchange, see _row_blocks), which goes out in two 8-byte stores of 4 rows x
    128 bytes: the first writes the rows of row groups 0-3 (those lanes give their own bytes,
    the lanes of groups 4-7 the staged bytes, read from LDS, of the same rows), the second those
    of groups 4-7 (roles swapped). Rows past N and columns past K (at a row's end the line's
    later columns may lie past it) are masked off by lane and role."""
    k = ctx["k"]
    slot_cols = ctx["slot_cols"]
    line0 = sub(ctx["c0"], slot_cols)  # the group's first column
    rq = _rows_buffer(ctx, line0)
    if "own_cols" in ctx:  # FP32: fixed places in the line
        own_cols, staged_cols = ctx["own_cols"], ctx["piece"]
    else:  # 16-bit: this tile's place, the staged tile the other one (a group's only tile at a
        # row's end is its first: the second half, past K, is masked off)
        own_cols = add(slot_cols, ctx["piece"])
        staged_cols = add(sub(LINE_BYTES // 2, slot_cols), ctx["piece"])

    def inside(cols):
        return mx.cmp_ult(add(line0, cols), k)

    # (bases past N are OOB already, and stay past every buffer's end with the columns added)
    own = mx.select(inside(own_cols), add(ctx["own_base"], own_cols), OOB)
    other = mx.select(inside(staged_cols), add(ctx["partner_base"], staged_cols), OOB)
    lo = ctx["lo"]
    offsets = [mx.bit_select(lo, own, other), mx.bit_select(lo, other, own)]

    def put(data, r):
        if not r:  # the partner lanes' staged rows (stored at earlier tiles)
            mx.lds_exchange_fence()
        staged = mx.lds_load(mx.PIECE_DWORDS // 2, add(ctx["partner_lds"], r * ctx["stage_row"]))
        if r:  # the next row (rows go in order): offsets in VGPRs, SGPRs are scarce here
            offsets[:] = [add(o, k) for o in offsets]
        mine, theirs = mx.dwords_of(data, 2), mx.dwords_of(staged, 2)
        mx.store(mx.from_elements([mx.bit_select(lo, a, b) for a, b in zip(mine, theirs)]), rq, offsets[0])
        mx.store(mx.from_elements([mx.bit_select(lo, b, a) for a, b in zip(mine, theirs)]), rq, offsets[1])

    return put


def _flush_rows(ctx):
    """dual: store the staged 1x32 rows of the line group that ends with this tile, LINE_BYTES
    of each row from 8 lanes (16 bytes each), so an instruction writes FLUSH_ROWS whole row
    segments. Rows past N fall past the buffer's end; columns past K (the last group of a row
    may be partial) are masked off by lane."""
    k = ctx["k"]
    first_col = sub(ctx["c0"], ctx["slot_cols"])
    rq = _rows_buffer(ctx, first_col)

    def stores():
        mx.lds_exchange_fence()  # rows other lanes staged
        for j in range(0, TILE_ROWS[0], FLUSH_ROWS):
            data = mx.lds_load(mx.PIECE_DWORDS, add(ctx["flush_lds"], j * LINE_BYTES))
            mx.store(data, rq, add(ctx["flush_q1"], mul(j, k)) if j else ctx["flush_q1"])

    mx.if_then(mx.cmp_ult(add(first_col, ctx["flush_fc"]), k), stores)


def rows_3d_t(elem_bytes: int) -> int:
    """3d_t's tile rows: as many lanes per row as store one LINE_BYTES output line (16 for 16-bit
    types, 32 for FP32), so 4 (2) row groups: 64 (32) rows x 128 columns."""
    return ROWS_PER_LANE * WAVE * (mx.PIECE_BYTES // elem_bytes) // LINE_BYTES


def _rows_32x32(spec, words, sc, amax, nan_pass, ctx, scale_layout, lanes):
    """3d_t: convert and store the lane's 16 rows x cols columns of a 32 x 32 block row-major
    (the rows as loaded, one 8- or 4-byte store per row at the row's scalar offset), then the
    block's code: plain, (E, K/32, N/32), by the block's first lane; a layout of the (N, K/32)
    matrix per expert has the code in each of the block's 32 rows, the `lanes` lanes sharing a
    row group's 16 rows store 16 / lanes of them each. A non-finite block (nan_pass) gets code
    0xFF and 0x7F data in place. Rows past N and columns past K (whole lanes: K % 32 == 0) are
    masked off by lane: a row-major row's columns past K would be the next row's."""
    code, conv = sc
    conv = mx.as_f32(conv)
    ok = mx.arith.andi(ctx["row_ok"], mx.cmp_ult(add(ctx["c0"], ctx["lane_cols"]), ctx["k"]))
    bad = mx.cmp_uge(amax, mx.NONFINITE[spec.dtype]) if nan_pass else None
    if bad is not None:
        code = mx.select(bad, mx.E8M0_NAN, code)

    def rows():  # a row's lanes store one whole LINE_BYTES line (rows_3d_t)
        for r in range(ROWS_PER_LANE):
            outs = mx.convert_piece(spec, list(words[r]), conv)
            if bad is not None:
                outs = [mx.select(bad, mx.E4M3_NAN_X4, o) for o in outs]
            data = outs[0] if len(outs) == 1 else mx.from_elements(outs)
            mx.store(data, ctx["rq"], ctx["lane_rows"], ctx["row_k"][r] if r else 0)

    mx.if_then(ok, rows)
    kblock = lshr(add(ctx["c0"], ctx["lane_cols"]), 5)
    b = add(lshr(ctx["r0"], 5), lshr(ctx["g"], 1))  # block row
    j = band(ctx["c"], lanes - 1)  # the lane's place among the block's lanes of its row group
    if scale_layout is None:
        lead = mx.arith.andi(ok, mx.cmp_eq(bor(j, ctx["hpair"]), 0))
        off = add(mul(add(mul(ctx["e"], lshr(ctx["k"], 5)), kblock), ctx["nb"]), b)
        mx.if_then(lead, lambda: mx.store_byte(code, ctx["rs"], off))
        return
    per_lane = ROWS_PER_LANE // lanes
    row = add(add(ctx["r0"], mul(ctx["g"], ROWS_PER_LANE)), mul(j, per_lane))
    base = mul(ctx["e"], ctx["s_expert"])

    def codes():
        for i in range(per_lane):
            off = add(base, mx.scale_offset(scale_layout, add(row, i) if i else row, kblock, ctx["s_dims"]))
            mx.store_byte(code, ctx["rs"], off)

    mx.if_then(ok, codes)
