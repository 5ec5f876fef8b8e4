"""The column kernel's device code (build_col): MXFP8 quantize along the rows of row-major
(E, N, K) tiles, for the launchers of kernels/mxfp8_quantize_3d.py (3D along N, 2D 32x1 and the
fused dual kernel; the math and the outputs are described there). The dual kernel's 1x32 rows
and the 3d_t data, stored row-major, are kernels/_mx_col_rows.py's.

Work split. A wave quantizes tiles of 128 rows x 128 bytes of a row (64 BF16/FP16 or 32 FP32
columns): lane (g, c) loads 16 bytes of rows 16g .. 16g + 15 (16 loads, each instruction 8 full
128-byte row segments), so a lane holds 8 (4) columns x 16 rows and a block is the lane pair
g = 2b, 2b + 1: in-lane max over 16 rows, one DPP exchange. Both lanes of a pair compute the
scales, each converts and stores its 16 rows: 16 bytes per column, an instruction writing 128
consecutive rows of 8 columns (full lines when N % 128 == 0). BF16/FP16 row pairs of one column
are regrouped with v_perm_b32 first, as the packed conversion takes one scale. For N = 64 the
tiles are 64 rows x 128 columns (4 row groups, lanes past N would waste half the work) and
neighbouring column lanes swap half their columns (gfx950: v_permlane32_swap; gfx942: DPP
row_ror:8 moves, the lanes being 8 apart there) so that every store still writes whole
128-byte lines (two 64-byte columns). A tile with a huge, Inf or NaN value takes a rare
path (exact amax, then 0xFF / 0x7F over the non-finite blocks).

Workgroups of `waves` waves walk `tiles_per_wave` consecutive column tiles of one row tile and
expert (grid: column groups x row tiles x E). Tails: each tile's buffers end at the expert's
data, so loads past it read 0 and columns past K are dropped; lanes whose rows are past N
(N % 32 == 0: all 16 or none) are masked off. K is any size >= 1; for BF16/FP16 with K odd the
16-byte loads are only 2-byte aligned (unaligned buffer access, which ROCm enables), and the
last column tile loads 2-byte elements so no dword runs past the tensor's end.
"""

from __future__ import annotations

import functools
import sys

import flydsl.compiler as flyc
import flydsl.expr as fx

from flyquant import toolchain

from . import _mx_common as mx
from . import _mx_col_rows
from ._mx_col_rows import (LINE_BYTES, ROWS_PER_LANE, TILE_ROWS, _flush_rows, _row_blocks, _rows_32x32, rows_3d_t,
                           staged_tiles)
from ._mx_common import MX_BLOCK, OOB, WAVE, Spec, add, band, bor, const, lshr, mul, shl, sub, to_i64, val

MAX_WAVES = 4
# gfx950 32x1 / 3D: the occupancy the register allocator aims for (at most 128 VGPRs); even 2
# waves x 16 KiB of loads in flight per SIMD cover HBM latency.
WAVES_PER_SIMD = 4
KINDS = ("32x1", "3d", "dual", "3d_t")  # dual: 32x1 plus the 1x32 outputs from the same loads;
# 3d_t: 32 x 32 blocks, data row-major (see build_col)
SOURCE_TAG = mx.source_tag(sys.modules[__name__], _mx_col_rows)

# 64-row tiles: lane distance of neighbouring column lanes (c, c ^ 1, see _store_interleaved)
# per arch: gfx950 swaps at 32 in one instruction (v_permlane32_swap); gfx942 has only DPP,
# whose cheapest swap is at 8 (two bank-masked row_ror:8 moves, mx.exchange).
SWAP_DIST_64 = {"gfx950": 32, "gfx942": 8}


def _lane_rc(lane, groups_n, arch, block_lanes=0):
    """(row group, column lane) of a lane. 8 row groups (128-row tiles): lane = 8 g + c, so a
    block's two lanes are 8 apart (DPP row_ror:8) and a 32 x 32 block's are 1, 2 (4) apart.
    4 row groups (64-row tiles, 32 x 1 blocks only): the pair 1 apart, neighbouring column lanes
    SWAP_DIST_64 apart: gfx950 lane = 32 (c & 1) + 4 (c >> 1) + g, gfx942 lane = 16 (c >> 2) +
    8 (c & 1) + 4 ((c >> 1) & 1) + g.
    3d_t (block_lanes: the column lanes of a 32 x 32 block, L = 4 or 8): lane = c % L + L g +
    L groups_n (c // L), so each block's 2 L lanes (2 row groups) are an aligned group."""
    if block_lanes:
        lb, gb = block_lanes.bit_length() - 1, groups_n.bit_length() - 1
        return band(lshr(lane, lb), groups_n - 1), bor(band(lane, block_lanes - 1), shl(lshr(lane, lb + gb), lb))
    if groups_n == 8:
        return lshr(lane, 3), band(lane, 7)
    if arch == "gfx950":
        return band(lane, 3), add(shl(band(lshr(lane, 2), 7), 1), lshr(lane, 5))
    return band(lane, 3), bor(bor(shl(lshr(lane, 4), 2), band(lshr(lane, 1), 2)), band(lshr(lane, 3), 1))


def kernel_prefix(spec: Spec, kind: str, block_k: int = 1, scale_layout=None, grouped: bool = False) -> str:
    """The column kernel's name up to its tile suffixes (flyquant.select's plans name it too)."""
    return (f"mxfp8_{kind}" + (f"_k{block_k}" if block_k > 1 else "") + (f"_{scale_layout}" if scale_layout else "")
            + ("_offs" if grouped else "") + f"_{spec.tag}")


def build_col(arch: str, dtype: str, mode: str, kind: str, scale_layout=None, block_k: int = 1,
              grouped: bool = False, waves: int = MAX_WAVES, tile_rows: int = 128, signed_zeros: bool = True):
    """An uncached @flyc.jit launcher of the column kernel for one specialization: kind "32x1"
    (scales (K, N/32)) or "3d" (scales (E, N/32, K / block_k)); scale_layout None, "tcgen05" or
    "mfma" (of the (K, N/32) matrix per expert); grouped: tcgen05 per token group (32x1, offs).
    Kind "3d_t" (block_k 32, K % 32 == 0): 32 x 32 blocks with the data stored row-major (as
    read) and the block codes transposed, (E, K/32, N/32), or a layout of the (N, K/32) matrix
    per expert: the 3D quantize of the transposed view w = x.transpose(1, 2) (_rows_32x32)."""
    if kind not in KINDS:
        raise ValueError(f"kind must be one of {KINDS}, got {kind!r}")
    spec = Spec(arch, dtype, mode, signed_zeros)
    wide = spec.wide
    groups_n = tile_rows // ROWS_PER_LANE
    rows_out = kind == "3d_t"
    if rows_out and (block_k != MX_BLOCK or tile_rows != rows_3d_t(spec.elem_bytes)):
        raise ValueError(f"3d_t takes scale_block_k {MX_BLOCK} and {rows_3d_t(spec.elem_bytes)}-row tiles for "
                         f"{dtype}, got {block_k} and {tile_rows}")
    if not rows_out and (groups_n not in (4, 8) or (groups_n == 4 and block_k > 1)):
        raise ValueError(f"unsupported column tile: {tile_rows} rows, scale_block_k {block_k}")
    pair_dist = 8 if groups_n == 8 else 1
    # 64-row tiles hold N = 64 experts: a 128-byte output line is two 64-byte columns, which
    # neighbouring column lanes trade halves of for full-line stores
    interleave = groups_n == 4 and not rows_out
    cols = mx.PIECE_BYTES // spec.elem_bytes  # per lane
    tile_cols = WAVE // groups_n * cols
    group_tiles = LINE_BYTES // tile_cols  # dual: column tiles of a line group
    staged = staged_tiles(arch, dtype) if kind == "dual" else 0
    stage_rows = staged > 0
    held = stage_rows and staged < group_tiles  # the group's last tile stores from its registers
    # FP32: the tile before the last keeps its rows in registers (carried to the next tile)
    carried = group_tiles - 1 - staged if held else 0
    if held and (staged * tile_cols != LINE_BYTES // 2 or carried > 1 or groups_n != 8):
        raise ValueError(f"register-held line stores need half-line stages of 128-row tiles, got {staged}/{group_tiles}")
    stage_row = staged * tile_cols  # LDS bytes of a staged row
    dws = mx.PIECE_DWORDS  # dword columns per lane (column pairs for 16-bit)
    half = cols // 2  # columns whose codes each lane of a pair stores
    lanes_per_kblock = MX_BLOCK // cols  # block_k = 32: lanes sharing a 32-column block
    source = SOURCE_TAG
    name = f"{kernel_prefix(spec, kind, block_k, scale_layout, grouped)}_r{tile_rows}_w{waves}"

    def column_amaxes(words, exact):
        """Per dword column: the block amax (both lanes of the pair hold it); 32 x 32 blocks: one
        (every lane of the block holds it)."""
        parts = mx.chain_amax_interleaved(spec, [[w[d] for w in words] for d in range(dws)], exact)
        # 3d_t: the block's lanes are one aligned group (_lane_rc), the pair among them
        out = parts if rows_out else [mx.amax_max(spec, p, mx.dpp_xor(p, pair_dist)) for p in parts]
        if block_k == 1:
            return out
        # 32 x 32 blocks: also over the lane's columns and its lanes_per_kblock neighbours (and
        # for 3d_t the pair)
        acc = functools.reduce(lambda a, b: mx.amax_max(spec, a, b), out)
        acc = mx.amax_halves(spec, acc)
        dist = 1
        while dist < lanes_per_kblock * (2 if rows_out else 1):
            acc = mx.umax(acc, mx.dpp_reduce_partner(acc, dist))
            dist *= 2
        return acc

    def scales(amax):
        """Per dword column (code, conversion-scale word): 16-bit types: packed pairs (codes,
        top_halves); FP32: (code, scale bits)."""
        if block_k > 1:  # one block for every column of the lane
            code, conv = mx.block_scale(spec, amax)
            return [(code, mx.as_i32(conv))] * dws
        out = []
        for a in amax:
            if wide:
                code, conv = mx.block_scale(spec, a)
                out.append((code, mx.as_i32(conv)))
            else:
                out.append(mx.pair_scales(spec, a))
        return out

    def column_code(sc, j):
        """E8M0 code of lane column j (i32, low byte)."""
        code = sc[j // 2][0] if not wide else sc[j][0]
        if block_k > 1 or wide:
            return code
        return lshr(code, 16) if j % 2 else code

    def convert(words, sc, d):
        """The output dwords of dword column d's lane columns (1 or 2), 4 each (rows 0-3, 4-7,
        8-11, 12-15)."""
        _, conv = sc[d]
        xs = [w[d] for w in words]
        if wide:
            c = mx.as_f32(conv)
            return [[mx.convert4_32(spec, xs[4 * q : 4 * q + 4], c) for q in range(4)]]
        outs = []
        for j in range(2):
            c = mx.as_f32(conv) if block_k > 1 else mx.scale_from_tops(spec, conv, j)
            sel = 0x07060302 if j else 0x05040100  # rows (r, r+1) of column 2d + j
            col = []
            for q in range(4):
                p01 = mx.perm(xs[4 * q + 1], xs[4 * q], sel)
                p23 = mx.perm(xs[4 * q + 3], xs[4 * q + 2], sel)
                col.append(mx.convert4_16(spec, p01, p23, c))
            outs.append(col)
        return outs

    def body(x, q, s, q1, s1, offs, n, k, row_bytes, tiles_per_wave, col_tiles, nb, s_dims, s_expert, s_bytes, groups, steps):
        # Addressing: each tile gets its own buffers (scalar arithmetic) starting at the tile and
        # ending at the expert's data; lanes use tile-independent VGPR offsets. Loads take the
        # row step as the scalar offset (one VGPR for 16 loads); only the last column tile, where
        # a lane's 16 bytes may run past the tensor's end, uses range-checked per-row offsets.
        # Columns past K are dropped by the range checks; rows past N (last row tile) are
        # masked off by lane (a lane's 16 rows are all inside or all outside, N % 32 == 0).
        mx.saturate_conversions(spec)
        tid = val(fx.Int32(fx.thread_idx.x))
        wave = mx.readfirstlane(lshr(tid, 6))
        lane = band(tid, WAVE - 1)
        g, c = _lane_rc(lane, groups_n, arch, lanes_per_kblock if rows_out else 0)
        hpair = band(g, 1)
        bx, rt, e = (val(fx.Int32(v)) for v in (fx.block_idx.x, fx.block_idx.y, fx.block_idx.z))
        n, k, row_bytes, nb = val(n), val(k), val(row_bytes), val(nb)
        r0 = mul(rt, tile_rows)
        row_ok = mx.cmp_ult(add(r0, mul(g, ROWS_PER_LANE)), n)
        expert = mul(n, k)  # elements of one expert (< 2^31 bytes: checked by the launcher)
        in_base = mul(mul(to_i64(e), to_i64(expert)), spec.elem_bytes)
        out_base = mul(to_i64(e), to_i64(expert))
        rs = mx.buffer(s, const(0, mx.i64_t()), s_bytes)
        lane_cols = mul(c, cols)  # the lane's first column within a tile
        lane_in = add(mul(mul(g, ROWS_PER_LANE), row_bytes), shl(c, 4))
        lane_out = None if interleave else [
            add(mul(add(lane_cols, j), n), mul(g, ROWS_PER_LANE)) for j in range(cols)]
        lane_out_il = []
        if interleave:  # after the swap the odd column lane holds columns cols - 1 to the left, + 1
            shift = mul(band(c, 1), cols - 1)

            def il(j):
                return add(mul(add(sub(lane_cols, shift), j), n), mul(g, ROWS_PER_LANE))
            lane_out_il = [(il(2 * i), il(2 * i + cols)) for i in range(cols // 2)]  # per column pair
        row_step = [mul(r, row_bytes) for r in range(ROWS_PER_LANE)]
        group = _group_of(offs, r0, groups, steps) if grouped else None
        first = mul(add(mul(bx, waves), wave), tiles_per_wave)
        count = mx.umin(tiles_per_wave, mx.usub_sat(col_tiles, first))
        if stage_rows:
            wave_stage = TILE_ROWS[0] * stage_row
            stage = fx.SharedAllocator().allocate(waves * wave_stage, alignment=mx.PIECE_BYTES)
            lds_wave = add(val(fx.Int32(fx.ptrtoint(stage.peek().ptr))), mul(wave, wave_stage))
            dual_ctx = dict(q1=q1, s1=s1, stage_row=stage_row,
                            stage_lane=add(lds_wave, add(mul(g, ROWS_PER_LANE * stage_row), lane_cols)))
            if held:  # _store_lines: the lane also moves 8 staged bytes of row group g ^ 4's rows
                partner = bor(band(g, 3), sub(4, band(g, 4)))  # g ^ 4
                piece = shl(c, 3)  # the lane's 8 bytes of a half line
                dual_ctx.update(
                    own_base=mx.select(row_ok, mul(mul(g, ROWS_PER_LANE), k), OOB),
                    lo=mx.lane_word(sub(1, lshr(lane, 5))),  # row groups 0-3
                    partner_base=mx.select(mx.cmp_ult(add(r0, mul(partner, ROWS_PER_LANE)), n),
                                           mul(mul(partner, ROWS_PER_LANE), k), OOB),
                    partner_lds=add(lds_wave, add(mul(partner, ROWS_PER_LANE * stage_row), piece)),
                    piece=piece, staged=staged)
                if carried:
                    # after the pair exchange, lane c even holds the carried tile's bytes 8 (c / 2)
                    # of the second half line, lane c odd the last tile's: 64 + 4c (+ 28)
                    dual_ctx["own_cols"] = add(add(LINE_BYTES // 2, shl(c, 2)), mul(band(c, 1), 28))
                    dual_ctx["odd"] = mx.lane_word(band(c, 1))
            else:
                # flush: lane (fr, fc) moves 16 bytes of staged row fr (+ FLUSH_ROWS per instruction)
                fr, fc = lshr(lane, 3), shl(band(lane, LINE_BYTES // mx.PIECE_BYTES - 1), 4)
                dual_ctx.update(flush_lds=add(lds_wave, add(mul(fr, LINE_BYTES), fc)), flush_fc=fc,
                                flush_q1=add(mul(fr, k), fc))
        elif kind == "dual":
            dual_ctx = dict(q1=q1, s1=s1, row_k=[mul(r, k) for r in range(ROWS_PER_LANE)],
                            lane_q1=add(mul(mul(g, ROWS_PER_LANE), k), lane_cols))
        elif rows_out:  # _rows_32x32: the lane's 16 rows, row-major from the tile's corner
            dual_ctx = dict(row_k=[mul(r, k) for r in range(ROWS_PER_LANE)],
                            lane_rows=add(mul(mul(g, ROWS_PER_LANE), k), lane_cols))
        else:
            dual_ctx = {}
        wave_ctx = dict(dual_ctx, e=e, r0=r0, row_ok=row_ok, rs=rs, s=s, hpair=hpair, g=g, c=c, lane_cols=lane_cols,
                        n=n, k=k, nb=nb, s_dims=s_dims, s_expert=s_expert, group=group, lane_out=lane_out,
                        lane_out_il=lane_out_il)

        def one_tile(i, *carry):
            c0 = mul(mx.opaque_sgpr(add(first, i)), tile_cols)
            tile_in = add(mul(r0, row_bytes), mul(c0, spec.elem_bytes))
            rx = mx.buffer(x, add(in_base, to_i64(tile_in)), sub(mul(expert, spec.elem_bytes), tile_in))
            tile_out = add(mul(r0, k), c0) if rows_out else add(mul(c0, n), r0)
            rq = mx.buffer(q, add(out_base, to_i64(tile_out)), sub(expert, tile_out))
            col_full = mx.cmp_ule(add(c0, tile_cols), k)

            def load_fast():
                return [mx.load(rx, lane_in, soffset=row_step[r]) for r in range(ROWS_PER_LANE)]

            def load_checked():
                # buffer from the expert's start, the tile in the VGPR offset: per-row offsets
                # that depend on the tile (computed here, not hoisted out of the loop)
                rx_e = mx.buffer(x, in_base, mul(expert, spec.elem_bytes))
                v = add(lane_in, tile_in)
                offs = [add(v, row_step[r]) for r in range(ROWS_PER_LANE)]
                if wide:
                    return [mx.load(rx_e, o) for o in offs]

                def halfwords():
                    # 16-bit data with K odd: rows start 2-byte aligned, and a dword holding the
                    # tensor's last element would run 2 bytes past the end (range-checked, so
                    # read as 0): load 2-byte elements instead (last column tiles only)
                    return [mx.from_elements([
                        bor(mx.load_short(rx_e, add(o, 4 * i)), shl(mx.load_short(rx_e, add(o, 4 * i + 2)), 16))
                        for i in range(mx.PIECE_DWORDS)]) for o in offs]

                aligned = mx.cmp_eq(band(k, 1), 0)
                return mx.if_else(aligned, lambda: [mx.load(rx_e, o) for o in offs], halfwords, [vec] * ROWS_PER_LANE)

            vec = mx.vec_i32_t(mx.PIECE_DWORDS)
            words = [mx.dwords_of(v) for v in mx.if_else(col_full, load_fast, load_checked, [vec] * ROWS_PER_LANE)]
            mx.wait_loads()
            amax = column_amaxes(words, False)
            peak = amax if block_k > 1 else functools.reduce(lambda a, b: mx.amax_max(spec, a, b), amax)
            peak = mx.amax_halves(spec, peak) if (block_k == 1 and not wide) else peak
            rare = mx.wave_any(mx.cmp_uge(peak, spec.suspicious))
            ctx = dict(wave_ctx, c0=c0, rq=rq, col_full=col_full)
            exact = (lambda: column_amaxes(words, True)) if spec.needs_exact_redo else (lambda: amax)
            if stage_rows:  # this tile's place in its line group (first is a multiple of the group)
                slot = band(i, group_tiles - 1)
                ctx["slot_cols"] = mul(slot, tile_cols)
                # the group's last tile (or the wave's: the row's end) stores the lines
                group_done = mx.arith.ori(mx.cmp_eq(slot, group_tiles - 1), mx.cmp_eq(i, sub(count, 1)))
                if held:
                    ctx["held"] = group_done
                if carried:
                    ctx.update(carry=carry, slot=slot, last=mx.cmp_eq(slot, group_tiles - 1))
            rows = mx.if_else(
                rare,
                lambda: finish(words, exact(), dict(ctx, exact=True), True),
                lambda: finish(words, amax, dict(ctx, exact=False), False),
                [mx.i32_t()] * len(carry),
            )
            if stage_rows and not held:
                mx.if_then(group_done, lambda: _flush_rows(ctx))
            return rows  # carried: this tile's 1x32 row dwords, for the next tile

        def finish(words, amax, ctx, nan_pass):
            sc = scales(amax)
            if rows_out:
                return _rows_32x32(spec, words, sc[0], amax, nan_pass, ctx, scale_layout, lanes_per_kblock)

            def convert_store():
                # dword columns converted and stored a few at a time (keeps few values live):
                # one, or the interleaved stores' column pair (16-bit: one, FP32: two)
                step = 2 * dws // cols if interleave else 1
                for p in range(dws // step):
                    outs = [o for d in range(p * step, (p + 1) * step) for o in convert(words, sc, d)]
                    if interleave:
                        _store_interleaved(arch, SWAP_DIST_64[arch], outs, ctx["lane_out_il"][p], ctx["rq"])
                    else:
                        for jj, out in enumerate(outs):
                            store_column(p * (cols // dws) + jj, out, ctx, None)
                store_codes(sc, ctx, None)

            mx.if_then(ctx["row_ok"], convert_store)  # lanes of rows past N (last row tile) store nothing
            rows = _row_blocks(spec, words, nan_pass, ctx) if kind == "dual" else None
            if nan_pass:
                nan_fixup(amax, ctx)
            return rows

        def nan_fixup(amax, ctx):
            # Non-finite blocks: code 0xFF and every element 0x7F, over what was just stored.
            if block_k > 1:
                bad = [mx.cmp_uge(amax, mx.NONFINITE[dtype])] * cols
            elif wide:
                bad = [mx.cmp_uge(a, mx.NONFINITE[dtype]) for a in amax]
            else:
                bad = [mx.cmp_uge(band(amax[j // 2], 0xFFFF) if j % 2 == 0 else lshr(amax[j // 2], 16),
                                  mx.NONFINITE[dtype]) for j in range(cols)]
            bad = [mx.arith.andi(b, ctx["row_ok"]) for b in bad]
            for j in range(cols):
                store_column(j, [const(mx.E4M3_NAN_X4)] * 4, ctx, bad[j])
            store_codes(None, ctx, bad)

        def store_column(j, out, ctx, only):
            """Store lane column j's 16 bytes (`only`: an i1, store just where it holds)."""
            data = mx.from_elements(out)
            if ctx["lane_out"] is None:  # interleaved layout: only the NaN pass gets here
                ctx["lane_out"] = [add(mul(add(ctx["lane_cols"], jj), ctx["n"]), mul(ctx["g"], ROWS_PER_LANE))
                                   for jj in range(cols)]
            if only is None:
                mx.store(data, ctx["rq"], ctx["lane_out"][j])
            else:
                mx.if_then(only, lambda: mx.store(data, ctx["rq"], ctx["lane_out"][j]))

        def store_codes(sc, ctx, only):
            _store_codes(spec, kind, scale_layout, block_k, cols, half, lanes_per_kblock, sc, ctx, only, column_code)

        if carried:
            mx.for_range_carry(count, [const(0)] * ROWS_PER_LANE, one_tile)
        else:
            mx.for_range(count, one_tile)

    @flyc.kernel(name=name, known_block_size=[WAVE * waves, 1, 1])
    def kernel(
        x: fx.Tensor,  # (E, N, K) or (M, K) BF16/FP16/FP32, row-major
        q: fx.Tensor,  # E4M3 data as uint8, column-major per expert
        s: fx.Tensor,  # scales (uint8), plain or padded layout
        q1: fx.Tensor,  # dual: the 1x32 E4M3 data as uint8, row-major (else unused)
        s1: fx.Tensor,  # dual: the 1x32 scales (M, K/32) (else unused)
        offs: fx.Tensor,  # int32 token-group ends along N (grouped tcgen05 only; else unused)
        n: fx.Int32,  # rows quantized (N or M), a multiple of 32
        k: fx.Int32,  # columns
        row_bytes: fx.Int32,  # K * element size
        tiles_per_wave: fx.Int32,
        col_tiles: fx.Int32,  # ceil(K / tile columns)
        nb: fx.Int32,  # N / 32
        s_dims: fx.Int32,  # layouts: padded scale columns / 4 (tcgen05) or / 8 (mfma); else 0
        s_expert: fx.Int32,  # 3D layouts: bytes of one expert's scales; grouped: padded K rows
        s_bytes: fx.Int32,  # size of the scale tensor
        groups: fx.Int32,  # grouped: number of token groups
        steps: fx.Int32,  # grouped: binary search steps, bit_length(groups)
    ):
        body(x, q, s, q1, s1, offs, n, k, row_bytes, tiles_per_wave, col_tiles, nb, s_dims, s_expert, s_bytes, groups, steps)

    @flyc.jit
    def launch(
        x: fx.Tensor, q: fx.Tensor, s: fx.Tensor, q1: fx.Tensor, s1: fx.Tensor, offs: fx.Tensor, n: fx.Int32, k: fx.Int32,
        row_bytes: fx.Int32, tiles_per_wave: fx.Int32, col_tiles: fx.Int32, nb: fx.Int32,
        s_dims: fx.Int32, s_expert: fx.Int32, s_bytes: fx.Int32, groups: fx.Int32, steps: fx.Int32,
        gx: fx.Int32, gy: fx.Int32, gz: fx.Int32, stream: fx.Stream = fx.Stream(None),
    ):
        assert source and name  # closure values, so FlyDSL's disk cache keys on them (sources, variant)
        kernel(x, q, s, q1, s1, offs, n, k, row_bytes, tiles_per_wave, col_tiles, nb, s_dims, s_expert, s_bytes, groups, steps).launch(
            grid=(gx, gy, gz), block=(WAVE * waves, 1, 1), stream=stream
        )

    if spec.scaled_cvt and kind != "dual":
        # (gfx942's FNUZ conversion and dual keep more values live than 128 VGPRs hold: no
        # budget, the allocator's own choice)
        launch.compile_hints = {"waves_per_eu": WAVES_PER_SIMD}
    return launch


_cached_col = toolchain.launcher_cache(build_col)


def _group_of(offs, r0, groups, steps):
    """(first block, blocks) of the token group holding row r0 (wave-uniform), by binary search
    for the first group end > r0 in the non-decreasing int32 ends `offs`."""
    ro = mx.buffer(offs, const(0, mx.i64_t()), mul(to_i64(groups), 4))

    def end_at(i):
        return mx.readfirstlane(mx.load(ro, shl(i, 2), dwords=1))

    def step(lo, hi):
        mid = lshr(add(lo, hi), 1)
        above = mx.cmp_ult(r0, end_at(mid))
        return mx.select(above, lo, add(mid, 1)), mx.select(above, mid, hi)

    lo, _ = mx.for_range_carry(steps, [const(0), val(groups)], lambda i, lo, hi: step(lo, hi))
    end = end_at(lo)
    start = mx.select(mx.cmp_eq(lo, 0), 0, end_at(mx.usub_sat(lo, 1)))
    return lshr(start, 5), lshr(sub(end, start), 5)


def _store_codes(spec, kind, scale_layout, block_k, cols, half, lanes_per_kblock, sc, ctx, only, column_code):
    """Store this lane's E8M0 codes (sc None: 0xFF where `only`): each lane of a row pair stores
    `half` of its columns' codes; a plain 32 x 32 layout one code per block (one lane)."""
    if sc is not None and scale_layout is None and block_k == 1:
        return _store_codes_fast(kind, half, sc, ctx, column_code)
    rs = ctx["rs"]
    b = add(lshr(ctx["r0"], 5), lshr(ctx["g"], 1))  # block row
    hp = mx.cmp_ne(ctx["hpair"], 0)
    per_block = block_k > 1 and scale_layout is None
    first_col = add(add(ctx["c0"], ctx["lane_cols"]), mx.select(hp, half, 0))
    if per_block:
        lead = mx.cmp_eq(band(ctx["c"], lanes_per_kblock - 1), 0)
        stores = [(0, mx.arith.andi(lead, mx.cmp_eq(ctx["hpair"], 0)))]
    else:
        stores = [(jj, None) for jj in range(half)]
    for jj, who in stores:
        col = add(first_col, jj)
        ok = mx.arith.andi(ctx["row_ok"], mx.cmp_ult(col, ctx["k"]))
        ok = ok if who is None else mx.arith.andi(ok, who)
        if scale_layout is None:
            if kind != "3d":  # 32x1, dual: (K, N/32)
                off = add(mul(col, ctx["nb"]), b)
            elif block_k == 1:
                off = add(mul(add(mul(ctx["e"], ctx["nb"]), b), ctx["k"]), col)
            else:
                kb = lshr(add(ctx["k"], MX_BLOCK - 1), 5)
                off = add(mul(add(mul(ctx["e"], ctx["nb"]), b), kb), lshr(col, 5))
        elif ctx["group"] is not None:
            first, width = ctx["group"]
            off = add(mul(first, ctx["s_expert"]), mx.scale_offset(scale_layout, col, sub(b, first), lshr(width, 2)))
        else:
            off = add(mul(ctx["e"], ctx["s_expert"]), mx.scale_offset(scale_layout, col, b, ctx["s_dims"]))
        off = mx.select(ok, off, OOB)
        if sc is None:
            flag = mx.select(hp, only[half + jj], only[jj]) if block_k == 1 else only[0]
            mx.if_then(flag, lambda off=off: mx.store_byte(mx.E8M0_NAN, rs, off))
        else:
            code = mx.select(hp, column_code(sc, half + jj), column_code(sc, jj)) if block_k == 1 else column_code(sc, 0)
            mx.store_byte(code, rs, off)


def _store_interleaved(arch, dist, outs, offsets, rq):
    """Store lane columns 2i, 2i + 1 (`outs`, 4 dwords each) of the 64-row layout so that each
    instruction writes two adjacent 64-byte columns (one 128-byte line) from lanes c and c ^ 1
    (`dist` apart): lane c even (columns 8c .. 8c + 7; FP32: 4c .. 4c + 3) gives its column
    2i + 1 for column 2i of lane c + 1 (8c + 8 ..): the first instruction writes columns 8c + 2i
    (even lane) and 8c + 2i + 1 (odd lane), the second the pair 8 (4) on (`offsets`: the lane's
    two)."""
    halves = [mx.exchange(arch, e, o, dist) for e, o in zip(*outs)]
    mx.store(mx.from_elements([lo for lo, _ in halves]), rq, offsets[0])
    mx.store(mx.from_elements([hi for _, hi in halves]), rq, offsets[1])


def _store_codes_fast(kind, half, sc, ctx, column_code):
    """Plain layouts, 32 x 1 blocks (rows past N are masked off by the caller). 32x1: the codes
    of column c are at c * N/32: a buffer from the tile's first code to the end of the scales
    drops columns past K, and a lane's next column is N/32 bytes on (in the VGPR offset: the
    range check does not cover the scalar offset, and the last column tile's columns past K
    must be dropped). 3D: a lane's codes are consecutive bytes of a row of K codes; columns
    past K are skipped."""
    hp = mx.cmp_ne(ctx["hpair"], 0)
    b = add(lshr(ctx["r0"], 5), lshr(ctx["g"], 1))
    first = add(ctx["lane_cols"], mx.select(hp, half, 0))  # within the tile
    codes = [mx.select(hp, column_code(sc, half + jj), column_code(sc, jj)) for jj in range(half)]
    if kind != "3d":  # 32x1, dual: (K, N/32)
        tile = add(mul(ctx["c0"], ctx["nb"]), lshr(ctx["r0"], 5))
        rs = mx.buffer(ctx["s"], tile, sub(mul(ctx["k"], ctx["nb"]), tile))
        base = add(mul(first, ctx["nb"]), lshr(ctx["g"], 1))
        for jj in range(half):
            mx.store_byte(codes[jj], rs, add(base, mul(jj, ctx["nb"])) if jj else base)
        return
    col = add(ctx["c0"], first)
    base = add(mul(add(mul(ctx["e"], ctx["nb"]), b), ctx["k"]), col)

    def whole():  # full column tile: the lane's codes in one store
        if half == 4:  # 16-bit: codes[0] and [2] hold codes 1 and 3 in their bits 16-23
            mx.store(mx.perm(codes[2], codes[0], 0x06040200), ctx["rs"], base)
        else:
            mx.store_short(bor(codes[0], shl(codes[1], 8)), ctx["rs"], base)

    def some():
        for jj in range(half):
            off = mx.select(mx.cmp_ult(add(col, jj), ctx["k"]), add(base, jj), OOB)
            mx.store_byte(codes[jj], ctx["rs"], off)

    mx.if_else(ctx["col_full"], whole, some)
