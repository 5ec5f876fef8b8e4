"""MXFP4 quantize, rowwise (blocks of 32 along the last dim): x (M, K) -> packed E2M1 data
(M, ceil(K/32) * 16) and E8M0 scales (M, ceil(K/32)). The scale rule and the element conversion
(gfx950 hardware, gfx942 software) are in _mxfp4_common; a trailing partial block (K % 32 != 0)
is the zero-padded block: its missing elements are masked to +0 after the load.

amax: the largest |x| pattern of the block (_mx_common.chain_amax: gfx950 takes 16-bit pairs
through the NaN-propagating v_pk_maximum3_f16, BF16 read as FP16 and redone with the exact
integer max in a rare branch when a block reaches 2^121; otherwise integer max of the patterns).

Work split (every variant, scale layouts allowed): a wave quantizes tiles of 64 units (blocks
of the (M, nkb) grid; shuffles: data units of the layout, in its order); lane (col, piece)
(mxfp8_quantize_2d's lane split: piece = the lane's bits at DISTS, lane distances 32, 16 (, 8)
on gfx950 for v_permlane32/16_swap, 2, 1 (8, 2, 1) on gfx942 for DPP) loads piece `piece` (16
bytes: 8 16-bit or 4 FP32 elements) of 4 (FP32: 8) units (plain: blocks t0 + C k + col, C = 16
or 8 blocks per KiB, each load instruction 1 KiB contiguous; 16-bit shuffles: lined_units, 8
rows x 128 bytes; FP32 shuffles: units t0 + 8 k + col as plain, each block one whole 128-byte
line of its row). The per-piece amax partials are reduce-scattered (the lane owns one block:
its code, its code byte store; plain scales (code_lines): two tiles' codes stored as one whole
line, 2 bytes per lane), the block's conversion operand (_mxfp4_common.piece_operand) is
gathered back and each lane converts its pieces into 4 (FP32: 2) bytes each, stored at 16 u + 4
piece (2 piece): 256 (128) contiguous bytes per instruction (shuffles: two whole 128-byte
lines). Blocks past the end read zeros and their stores are dropped (buffer range checks).
gfx950, 16-bit x, K % 32 == 0, every layout (pair_tiles): two tiles are one step of 8 loads per
lane, as mxfp8_quantize_2d's tile of 128 blocks (plain scales: code_lines' two tiles; layouts: a
wave's tiles in pairs, an odd last one alone): the lane's two blocks'
amaxes end the reduce-scatter packed in one dword (_mx_common.halves_pair), so the scale rule
(BF16: one v_pk_sub_u16, _mxfp4_common.scale_pair), the rare-path test and the gather of the
conversion scales (top halves, one dword) are done once for both, and the packed codes are the
code line's two bytes (plain scales: such steps run only where both tiles lie inside x, so the
second tile's 4 KiB is its loads' scalar offset, which the range check does not see). A wave
takes 8 tiles (512 blocks, as mxfp8_quantize_2d's 4 of 128), so its setup is spread as thinly.
K % 32 != 0 (tail): block g of the grid reads row g / nkb at (g % nkb) * 32 elements, so a load
instruction still reads 1 KiB of x, contiguous but for the pieces wholly past a row's end (not
read: offset out of range); a wave holding a partial piece masks its missing elements (a
wave-uniform branch), and for 16-bit x with an odd K the tensor's last element comes from a
2-byte load (_mxfp4_common.last_elements). Rows whose byte length is not a multiple of 16 are
loaded at 2- or 4-byte alignment (the unaligned buffer access ROCm enables; not verified on
hardware).

Layouts written in the same pass (each block's 16 bytes and code byte stored at their places):
scale_layout "mfma" puts the code at _mx_common.scale_offset (aiter's e8m0_shuffle, the MXFP8
kernels' helper; the launcher zero-fills the padded scale tensor, the kernel writes the M x nkb
real codes). shuffle "a4w4" (aiter's shuffle_weight(data, layout=(16, 16)), M % 16 == 0,
K % 64 == 0): a tile is 16 rows x 4 blocks of one row tile, 64 consecutive units of the layout,
so the data stores stay contiguous, and its codes' offsets are a wave-uniform part plus a
per-lane constant. Shuffles load a register's rows 8 on through the scalar offset. shuffle "a16w4" (3D expert
weights; N % 32 == 0, K % 256 == 0): its data units are a4w4's (gate_up: with the row tiles
permuted, _mxfp4_shuffles.a16w4_source_row), so the lined path takes them in that order too, a
wave tile being one 16-row x 4-block tile; the codes' offsets are a tile part (wave-uniform)
plus a lane part (_mxfp4_shuffles.a16w4_scale_offset). A wave's tiles lie in one row tile
(_mxfp4_shuffles.row_tiles), placed by one division (row_tile_first), and its steps' x, data and
code offsets are linear in their first unit ("mfma" codes of one-tile steps: placed per step);
steps take two tiles on gfx950 with 16-bit x (a16w4 and a4w4), one elsewhere (a4w4; a16w4 carries
its (row, kb) per tile). A row tile is padded to whole runs of a wave's tiles (the padded count
a launch argument, row_tiles); a wave runs only the row tile's real ones, and where K % 128 ==
64 (or, two tiles a step, K % 256 != 0: "ragged") a wave's last step drops the pairs past the row's end (loads and codes out of range, data stores past
the wave's data buffer, which ends with the row tile's); a two-tile last step whose second tile
holds none of the row's blocks runs its first tile alone (nkb % 8 of 1 to 4).
"""

from __future__ import annotations

import functools
import sys
from dataclasses import dataclass

import torch

import flydsl.compiler as flyc
import flydsl.expr as fx
from flydsl._mlir.dialects import arith

from flyquant import toolchain, validate
from flyquant.arch import arch_info

from . import _mx_common as mx
from . import _mxfp4_common
from . import _mxfp4_shuffles as sh
from ._mx_common import MX_BLOCK, PIECE_BYTES, WAVE, Spec, add, band, bor, const, lshr, mul, shl, sub, val
from ._mxfp4_common import OUT_BLOCK_BYTES, TORCH_DTYPES, allocate
from .mxfp8_quantize_2d import DISTS, LOAD_BYTES, _lane_split

SOURCE_TAG = mx.source_tag(sys.modules[__name__], _mxfp4_common, sh)

MAX_WAVES = 4
TILES_PER_WAVE = 8  # 512 blocks per wave, as mxfp8_quantize_2d (its setup then weighs as little)


def code_lines(arch: str, dtype: str, shuffle, scale_layout) -> bool:
    """The variants whose waves store the plain scales as whole lines, two tiles per step
    (build_rows' line_codes). Not gfx942 with 16-bit x: its encoder leaves no room for the
    second tile's values (97 VGPRs instead of 93: 4 workgroups per CU instead of 5)."""
    return not (shuffle or scale_layout) and (arch == "gfx950" or dtype == "fp32")


@dataclass(frozen=True)
class RowPlan:
    waves: int  # waves per workgroup
    tiles_per_wave: int  # runs of 64 blocks a wave quantizes
    workgroups: int


def plan_rows(shape, arch: str, shuffle, dtype: str) -> RowPlan:
    """Waves per workgroup and tiles per wave for a rowwise quantize of an (M, K) tensor (the same
    split on both arches; the shuffles: 16-row x 4-block tiles, a wave's in one row tile, padded
    as _mxfp4_shuffles.row_tiles says)."""
    arch_info(arch)
    m, k = shape
    nkb = -(-k // MX_BLOCK)
    if not shuffle:
        return RowPlan(*mx.wave_split(-(-(m * nkb) // WAVE), MAX_WAVES, TILES_PER_WAVE))
    per_row, per_wave = sh.row_tiles(arch, dtype, shuffle, nkb, m // 16)
    return RowPlan(*mx.wave_split(m // 16 * per_row, MAX_WAVES, per_wave))


def build_rows(arch: str, dtype: str, mode: str, tail: bool, shuffle=None, scale_layout=None,
               waves: int = MAX_WAVES, k_align: int = 0, padded: bool = False):
    """An uncached @flyc.jit launcher of the rowwise kernel for one specialization (tail: K % 32
    != 0, rows divided and partial blocks masked; shuffle: None, "a16w4" or "a16w4_gate_up", the
    outputs written in aiter's A16W4 layouts, K % 256 == 0, or "a4w4", the data in aiter's
    shuffle_weight(layout=(16, 16)) layout, M % 16 == 0, K % 64 == 0; scale_layout None or "mfma",
    the codes at their places in aiter's e8m0_shuffle (_mx_common.scale_offset; the padding is the
    caller's zeros)); k_align (a4w4_k_align, a4w4 only): 64, a row tile's last step holds pairs of
    blocks past the row's end (ragged: not read, stores dropped); 256 (two-tile steps) or 128
    (one-tile steps), none does; padded (sh.padded_rows): the row tiles' placed tiles are padded
    to whole runs of a wave's (a wave runs only its row tile's real tiles)."""
    spec = Spec(arch, dtype, mode)
    assert (k_align in (64, 128, 256)) == (shuffle == "a4w4")
    # code_lines' tile pairs in one lined_tiles step (the amaxes of 16-bit x packed in a dword)
    # (gfx950 16-bit, K % 32 == 0 (tail: 70 VGPRs); the shuffles: placed steps)
    pair_tiles = spec.f16_view and not tail
    # a wave's tiles placed once in one row tile (sh.row_tiles), in steps of two tiles
    # (sh.two_tile_steps) or one (a4w4); a16w4's one-tile steps carry their (row, kb)
    placed = bool(shuffle) and (pair_tiles or shuffle == "a4w4")
    ragged = k_align == 64
    in_block = MX_BLOCK * spec.elem_bytes
    loads = in_block // PIECE_BYTES
    name = (f"mxfp4_rows_{spec.tag}" + ("_tail" if tail else "") + (f"_{shuffle}" if shuffle else "")
            + (f"_k{k_align}" if k_align else "") + ("_padded" if padded else "") + (f"_{scale_layout}" if scale_layout else "")
            + f"_w{waves}")
    source = SOURCE_TAG

    dists = DISTS[(arch, spec.elem_bytes)]

    def lined_amax(words, exact):
        """The amax pattern of the block this lane owns after the reduce-scatter in each tile
        (words: per tile its registers; register k of a tile: its bits at dists); two tiles: the
        two patterns in the halves of one dword (the first tile's low)."""
        n = len(words)
        # register g of tile j is part j + n g (reduce_scatter's order); last load first: one wait
        parts = [mx.chain_amax(spec, words[j][g], exact) for g in reversed(range(loads)) for j in reversed(range(n))]
        red = mx.reduce_scatter(arch, dists, parts[::-1], functools.partial(mx.amax_max, spec))
        return mx.halves_pair(*red) if n == 2 else mx.amax_halves(spec, red[0])

    paired = shuffle and not spec.wide  # 16-bit x with a data shuffle: a register spans 2 blocks of a row

    def lined_units(k):
        """Unit (block, or the shuffle's data unit) offset of register k from the lane's: C k (C =
        16 or, FP32, 8 blocks per KiB; an FP32 block is a whole line, so also with a shuffle);
        16-bit shuffles (lane unit 16 (col / 8) + col % 8) 32 (k % 2) + 8 (k / 2): each register
        covers 8 rows x 2 adjacent blocks of one row tile (whole lines) and two runs of 8
        consecutive units."""
        return 32 * (k % 2) + 8 * (k // 2) if paired else k * (LOAD_BYTES // in_block)

    def tile_place(u):
        """Shuffles: unit u of a tile (its bits: pair u / 32, block u / 16 % 2 of the pair, row u %
        16) -> (pair, kb offset, row offset) from the pair's first unit (a4w4_tiles); u an int
        (a register's part) or a value (a lane's; the two parts' bits are disjoint)."""
        if isinstance(u, int):
            return u >> 5, (u >> 4) & 1, u & 15
        return lshr(u, 5), band(lshr(u, 4), 1), band(u, 15)

    def tile_first(t0, shape, first):
        """Shuffles: (output row, kb) of the tile's first block (wave-uniform): a tile is 16 rows x
        4 blocks of one row tile, its two pairs of 2 blocks; a16w4's one-tile steps: `first`,
        carried from step to step."""
        nkb, row_bytes, k, magic, shift, dims, tpr = shape
        return first if first is not None else sh.row_tile_first(t0, tpr, magic, shift)

    def kept(flag, x):
        """x, or out of range (the access dropped) where the wave-uniform flag is false (None: always x)."""
        return x if flag is None else mx.select(flag, x, mx.OOB)

    def lined_loads(t0, du, rx, lane, shape, first, n1_args, sizes, tile_in=None, extra=0, keep=None, within_x=False):
        """The registers' 16-byte pieces (4, FP32 8) of the tile at unit t0 + du (du an int: a
        constant offset from t0's addresses) as dwords (shuffles: lined_units; `lane[0]`
        the lane's byte offset in a tile (shuffles: in a row tile pair), first: tile_first's, the row of
        x by sh.a16w4_source_row for gate_up; placed: tile_in, extra, and keep, a ragged step's
        wave-uniform flags of the tile's two pairs (a pair past the row's end is not read)); with the
        elements present in each (tail, else None); within_x: the tile lies inside x (plain: du's bytes
        then go in the scalar offset, which the range check does not see, instead of a VALU add)."""
        nkb, row_bytes, k, magic, shift, dims, _ = shape
        if tail:  # per register its block g (row division) and the elements present from the piece's first
            col, piece = lane[1:3]
            gs = [add(add(t0, col), du + i * (LOAD_BYTES // in_block)) for i in range(loads)]
            rows = [lshr(add(mx.umulhi(g, magic), g), shift) for g in gs]
            kbs = [sub(g, mul(row, nkb)) for g, row in zip(gs, rows)]
            valids = [mx.usub_sat(sub(k, mul(kb, MX_BLOCK)), mul(piece, spec.elems_per_piece)) for kb in kbs]
            offs = [mx.select(mx.cmp_eq(v, 0), mx.OOB, add(add(mul(row, row_bytes), mul(kb, in_block)), shl(piece, 4)))
                    for row, kb, v in zip(rows, kbs, valids)]  # a piece wholly past the row's end: not read
            raw = [w for o in offs for w in mx.dwords_of(mx.load(rx, o))]
            per = len(raw) // loads
            partial = functools.reduce(arith.ori, [arith.andi(mx.cmp_ne(v, 0), mx.cmp_ult(v, spec.elems_per_piece))
                                                   for v in valids])

            def masked():  # a wave holding a row's last block (pieces wholly past the end read 0)
                return [band(w, m) for i, v in enumerate(valids) for w, m in zip(raw[per * i:per * i + per], _mxfp4_common.tail_masks(spec, v))]

            raw = mx.if_else(mx.wave_any(partial), masked, lambda: raw, types=[mx.i32_t()] * len(raw))
            groups = [raw[per * i:per * i + per] for i in range(loads)]
            if not spec.wide:
                groups = _mxfp4_common.last_elements(groups, gs, valids, rx, sizes)
            return groups, valids
        if not shuffle:
            v_in = add(lane[0], mul(t0, in_block))
            so = du * in_block if within_x else 0
            return [mx.dwords_of(mx.load(rx, add(v_in, du * in_block - so + i * LOAD_BYTES), soffset=so))
                    for i in range(loads)], None
        if tile_in is None:
            row, kb = first
            if shuffle == "a16w4_gate_up":
                row = sh.a16w4_source_row(row, n1_args)
            tile_in = add(mul(row, row_bytes), mul(kb, in_block))
        bases = [add(lane[0], tile_in)]
        if keep:  # a ragged step's tile: each pair read only if it is the row's
            bases = [add(lane[0], kept(kp, add(tile_in, extra + 2 * in_block * p))) for p, kp in enumerate(keep)]
            extra = 0
        else:  # the second pair 2 blocks on: an immediate offset
            bases.append(add(bases[0], 2 * in_block))
        # a register's rows 8 on (r) in the scalar offset: they exist when the row tile does
        # (M % 16 == 0), and a row tile past the end has its base out of range
        places = [tile_place(lined_units(i)) for i in range(loads)]
        return [mx.dwords_of(mx.load(rx, add(bases[p], d_kb * in_block + extra), soffset=mul(row_bytes, r) if r else 0))
                for p, d_kb, r in places], None

    def lined_tiles(t0, n, bufs, lane, shape, sizes, n1_args, first=None, store_code=True, placed=None, within_x=False):
        """Units t0 .. t0 + 64 n - 1 (t0 wave-uniform), as n tiles of 64 (two: 16-bit x on gfx950,
        pair_tiles): register k of lane (col, piece) is piece `piece` of unit t0 + lane unit +
        lined_units(k), so each load reads whole lines and each data store 256 (FP32: 128)
        contiguous bytes; the block amaxes are reduce-scattered (the lane owns register `piece`'s
        block of each tile), the conversion operands gathered back. Two tiles share the reduction's
        end, the scale rule (on the two amaxes packed in a dword), the rare-path test and the
        gather. Returns the owned blocks' code bytes (two tiles: in bytes 0 and 2), stored here if
        store_code. placed (the shuffles' placed steps, the caller's; lane[0] holds the wave's output
        offset from the grid's): the first tile's x byte offset, its code offset's tile part (out of
        range past the end) and, for a ragged step, per tile its two pairs' flags (kept: None, always; a pair past the row's end is
        neither read nor its code stored, its data stores fall past the caller's buffer), for (row,
        kb) and their arithmetic; the second tile 4 blocks on in the same row tile (constant offsets).
        within_x: every tile lies inside x (lined_loads)."""
        rx, rq, rs = bufs
        lane_out, own = lane[:2]
        nkb, row_bytes, k, magic, shift, dims, _ = shape
        t0s = [add(t0, WAVE * j) if j else t0 for j in range(n)]
        if placed:
            firsts, tile_ins, keeps = [None] * n, [placed[0]] * n, placed[2] or [None] * n
        else:
            firsts = [tile_first(t, shape, first) if shuffle else None for t in t0s]
            tile_ins = keeps = [None] * n
        nb = sizes[0]
        loaded = [lined_loads(t0, WAVE * j, rx, lane[2:], shape, f, n1_args, sizes, ti, 4 * in_block * j if placed else 0, kp,
                              within_x)
                  for j, (f, ti, kp) in enumerate(zip(firsts, tile_ins, keeps))]
        words = [w for w, _ in loaded]
        mx.wait_loads()
        amax = lined_amax(words, False)
        groups = [w for ws in words for w in ws]  # tile-major, as the data stores

        def finish(amax, special, normal=False):
            """The owned blocks' codes and the data dwords from the block amaxes; special: the wave
            may hold NaN/Inf blocks (code 0xFF, nibbles patched in a rare branch); normal (FP16,
            two tiles): every amax is a normal FP16 (_mxfp4_common.scale_pair's packed rule)."""
            if n == 2:
                codes, tops = _mxfp4_common.scale_pair(spec, amax, normal)
                gathered = mx.all_gather(arch, dists, tops)
                operands = [mx.as_i32(mx.scale_from_tops(spec, t, j)) for j in range(n) for t in gathered]
                rare = None
            else:
                codes = _mxfp4_common.scale_code(spec, amax)
                operands = mx.all_gather(arch, dists, _mxfp4_common.piece_operand(spec, codes))
                rare = None if spec.scaled_cvt else mx.wave_any(_mxfp4_common.sw_outside16(spec, codes, amax))
            data = _mxfp4_common.convert_pieces(spec, groups, operands, rare, lambda: mx.all_gather(arch, dists, codes))
            if not special:
                return [codes] + data
            if n == 2:  # the two blocks' flags in bits 0 and 16 (nonfinite_halves: no constant kept in a register)
                bits = mx.nonfinite_halves(spec, amax)
                bad, codes = mx.cmp_ne(bits, 0), bor(codes, mul(bits, mx.E8M0_NAN))
            else:
                bad = mx.cmp_uge(amax, mx.NONFINITE[dtype])
                bits, codes = arith.extui(mx.i32_t(), bad), mx.select(bad, mx.E8M0_NAN, codes)

            def nan_patched():  # NaN/Inf blocks: nibble 0x7 for the elements present, 0 for a partial block's padding
                flags = mx.all_gather(arch, dists, bits)
                hits = [mx.cmp_ne(band(f, 1 << 16 * j) if n == 2 else f, 0) for j in range(n) for f in flags]
                nans = ([_mxfp4_common.nan_words(v)[0] for _, vs in loaded for v in vs] if tail
                        else [_mxfp4_common.E2M1_NAN_X8] * len(groups))
                return [mx.select(h, nn, d) for h, nn, d in zip(hits, nans, data)]

            data = mx.if_else(mx.wave_any(bad), nan_patched, lambda: data, types=[mx.i32_t()] * len(data))
            return [codes] + data

        if spec.needs_exact_redo:
            # BF16 read as FP16 (gfx950): a wave with a pattern from 2^121 up (NaN and Inf among them)
            # redoes the amax exactly and handles NaN/Inf blocks; every other wave has none of them
            # (the common result first, the rare branch replacing it: the common path falls through, with no
            # else-block and jump back as an if/else lays it out)
            peak = mx.pair_max(amax) if n == 2 else amax
            out = finish(amax, False)
            out = mx.if_else(mx.wave_any(mx.cmp_uge(peak, spec.suspicious)), lambda: finish(lined_amax(words, True), True),
                             lambda: out, types=[mx.i32_t()] * (1 + len(groups)))
        elif n == 2 and spec.dtype == "fp16":
            # FP16 (gfx950): the packed scale rule, unless the wave holds a block whose amax is 0, an
            # FP16 subnormal, Inf or NaN (then the exact rule per block, NaN/Inf blocks patched)
            out = finish(amax, False, normal=True)
            out = mx.if_else(mx.wave_any(mx.f16_unusual(amax)), lambda: finish(amax, True), lambda: out,
                             types=[mx.i32_t()] * (1 + len(groups)))
        else:
            out = finish(amax, True)
        codes, data = out[0], out[1:]
        v_out = add(lane_out, mul(t0, OUT_BLOCK_BYTES))
        s_off = None  # shuffles: the code's offset (a two-tile step's second tile: the first's plus a constant)
        for j, t in enumerate(t0s):
            tile_data = data[loads * j:loads * j + loads]
            if shuffle:  # the tile's part (wave-uniform; tiles lie wholly inside or past the end: M % 16 == 0) plus the
                # lane's (lane[5]: the owned block's offset from the tile's first)
                step_s = 4 if shuffle == "a4w4" and not scale_layout else 2  # 4 blocks on: the same 8-block
                # column tile of "mfma" and a16w4's layouts
                if j and placed and not keeps[j]:
                    s_off = add(s_off, step_s)
                else:
                    if placed:
                        tile_s = add(placed[1], step_s) if j else placed[1]
                    else:  # a16w4's carried one-tile steps
                        row, kb = firsts[j]
                        tile_s = mx.select(mx.cmp_ult(t, nb), sh.a16w4_scale_offset(lshr(row, 4), kb, 0, nkb), mx.OOB)
                    lane_s = tile_s
                    if keeps[j]:  # the owned block's pair past the row's end: dropped
                        lane_s = mx.select(mx.cmp_uge(own, 32), kept(keeps[j][1], tile_s), kept(keeps[j][0], tile_s))
                    s_off = add(lane_s, lane[5])
            else:
                g = add(t, own)
                s_off = g
                if scale_layout:  # past the last block: out of range (the layout's offsets would wrap into them)
                    row = lshr(add(mx.umulhi(g, magic), g), shift)
                    kb = sub(g, mul(row, nkb))
                    s_off = mx.select(mx.cmp_ult(g, nb), mx.scale_offset(scale_layout, row, kb, dims), mx.OOB)
            if store_code:
                mx.store_byte(lshr(codes, 16 * j) if j else codes, rs, s_off)
            for i, d in enumerate(tile_data):  # FP32: a piece of 4 elements is 2 bytes
                off = add(v_out, (WAVE * j + lined_units(i)) * OUT_BLOCK_BYTES)
                (mx.store_short if spec.wide else mx.store)(d, rq, off)
        return codes


    # Plain scales (block g's code at byte g): the lane at distance code_dist (the lowest lane bit
    # outside dists, col's bit 0) owns the block after this lane's.
    code_dist = min(d for d in (1, 2, 4) if d not in dists)

    def line_codes(tile, tiles_per_wave, first, args, own, nb, rs):
        """Plain scales: while both tiles are inside, a wave takes its tiles in pairs (t0, t0 +
        64), whose 128 codes one 2-byte store per lane writes (a whole line when t0 % 128 ==
        0): of the two lanes of a code_dist pair, the one with `own` even stores its block's and
        the next one's code of the first tile, the other those of the block before its own and
        its own of the second (each lane's two codes in one dword, the partner's taken by DPP,
        the two bytes picked by a per-lane v_perm_b32 selector). The rest (a wave holding the
        launch's end, an odd last tile) store one byte per block."""
        odd = band(own, 1)  # own's bit 0 is col's, the lane's bit at code_dist
        # selector bytes of (hi = the partner's dword, lo = this lane's): first tile's codes in bytes
        # 0 / 4, second tile's in 2 / 6; 0x0C: zero
        sel = arith.xori(const(0x0C0C0400), mul(odd, 0x0400 ^ 0x0206))
        s_lane = add(own, mul(odd, WAVE - 1))

        def step(t):
            t0s = [mx.opaque_sgpr(t), mx.opaque_sgpr(add(t, WAVE))]
            if pair_tiles:
                both = lined_tiles(t0s[0], 2, *args, store_code=False, within_x=True)
            else:
                codes = [lined_tiles(t, 1, *args, store_code=False) for t in t0s]
                both = mx.perm(codes[1], codes[0], 0x0C040C00)  # the codes in bytes 0 and 2
            mx.store_short(mx.perm(mx.lane_xor(both, code_dist), both, sel), rs, s_lane, soffset=t0s[0])

        end = mul(add(first, tiles_per_wave), WAVE)
        pairs = mx.select(mx.cmp_ule(end, nb), lshr(tiles_per_wave, 1), 0)  # trip counts, not a branch
        t_first = mul(first, WAVE)  # the loop runs over the pair's first unit: one induction variable
        mx.for_range(add(t_first, mul(pairs, 2 * WAVE)), step, t_first, 2 * WAVE)
        mx.for_range(sub(tiles_per_wave, shl(pairs, 1)), lambda i: lined_tiles(tile(add(shl(pairs, 1), i)), 1, *args))

    def body(x, q, s, nblocks, tiles_per_wave, nkb, row_bytes, k, magic, shift, x_bytes, n1, magic_n1, shift_n1,
             s_bytes, dims, row_tiles):
        tid = val(fx.Int32(fx.thread_idx.x))
        wave = mx.readfirstlane(lshr(tid, 6))
        lane = band(tid, WAVE - 1)
        nb = val(nblocks)
        zero = const(0, mx.i64_t())
        rx = mx.buffer(x, zero, mx.to_i64(x_bytes))
        rq = mx.buffer(q, zero, mul(mx.to_i64(nb), OUT_BLOCK_BYTES))
        rs = mx.buffer(s, zero, mx.to_i64(val(s_bytes)))
        first = add(mul(val(fx.Int32(fx.block_idx.x)), mul(tiles_per_wave, waves)), mul(wave, tiles_per_wave))
        bufs, shape = (rx, rq, rs), (val(nkb), val(row_bytes), val(k), val(magic), val(shift), val(dims), val(row_tiles))
        sizes, n1_args = (nb, val(x_bytes)), (val(n1), val(magic_n1), val(shift_n1))
        col, piece = _lane_split(lane, dists)
        lane_unit = add(shl(lshr(col, 3), 4), band(col, 7)) if paired else col
        # the lane owns register `piece` after the reduce-scatter: lined_units(piece) as bit operations
        own_reg = add(shl(band(piece, 1), 5), shl(lshr(piece, 1), 3)) if paired else mul(piece, LOAD_BYTES // in_block)
        own = add(lane_unit, own_reg)
        if shuffle:  # the lane unit's row and block of a tile pair
            _, d_kb, d_row = tile_place(lane_unit)
            lane_in = add(add(mul(d_row, val(row_bytes)), mul(d_kb, in_block)), shl(piece, 4))
        else:
            lane_in = add(mul(col, in_block), shl(piece, 4))
        # the owned block's kb % 4 = own / 16 and row % 16 = own % 16 as an offset from its tile's first
        # block's code: a16w4 (sh.a16w4_scale_offset's linear part) and a4w4's "mfma" (scale_offset's) alike
        if shuffle == "a4w4" and not scale_layout:
            lane_scale = add(mul(band(own, 15), val(nkb)), lshr(own, 4))
        else:
            lane_scale = add(shl(lshr(own, 4), 6), shl(band(own, 15), 2))
        lanes = (add(mul(lane_unit, OUT_BLOCK_BYTES), mul(piece, spec.elems_per_piece // 2)), own, lane_in, col, piece,
                 lane_scale)
        tile = lambda i: mx.opaque_sgpr(mul(add(first, i), WAVE))  # noqa: E731
        if shuffle and not pair_tiles and shuffle != "a4w4":  # a16w4 (gfx942, FP32): a step of one tile, its (row, kb)
            # carried, wrapping to the next row tile

            def step(i, row, kb):
                lined_tiles(tile(i), 1, bufs, lanes, shape, sizes, n1_args, (row, kb))
                wrap = mx.cmp_eq(add(kb, sh.A16W4_KLANE), shape[0])
                return [mx.select(wrap, add(row, sh.A16W4_NLANE), row), mx.select(wrap, 0, add(kb, sh.A16W4_KLANE))]

            mx.for_range_carry(val(tiles_per_wave), tile_first(mul(first, WAVE), shape, None), step)
        elif placed:  # sh.row_tiles: the wave's tiles lie in one row tile, placed once: x's byte offset, the code
            # offset of the first (out of range for a wave past the end) and its output unit; then a step (two tiles:
            # 8 blocks, 8 * 64 bytes of 16-bit x, 256 code bytes in a16w4's and "mfma"'s layouts, 8 plain, 128 output
            # units; one tile: half) is linear in its first unit, but for one tile's "mfma" codes. Row tiles are padded
            # to whole waves (so the output unit is not the grid's) and a wave runs only the row tile's tiles; a ragged
            # wave's last step drops its pairs past the row's end
            nt = 2 if pair_tiles else 1  # tiles per step
            t_first = mul(first, WAVE)
            row, kb = tile_first(t_first, shape, None)
            regrid = ragged or padded  # the output unit is not the grid's
            inside = mx.cmp_ult(mul(row, shape[0]), nb) if regrid else mx.cmp_ult(t_first, nb)
            out0 = add(mul(row, shape[0]), shl(kb, 4))  # the output unit of the wave's first tile
            if shuffle != "a4w4":
                s0 = sh.a16w4_scale_offset(lshr(row, 4), kb, 0, shape[0])
                row = sh.a16w4_source_row(row, n1_args) if shuffle == "a16w4_gate_up" else row
            else:
                s0 = mx.scale_offset(scale_layout, row, kb, shape[5]) if scale_layout else add(mul(row, shape[0]), kb)
            s0 = mx.select(inside, s0, mx.OOB)
            x0 = add(mul(row, shape[1]), mul(kb, in_block))
            if regrid:  # the output unit is the grid's plus the wave's constant (once, in the lane's offset)
                lanes = (add(lanes[0], mul(sub(out0, t_first), OUT_BLOCK_BYTES)),) + lanes[1:]
            if ragged:  # a pair past the row's end stores past the row tile's data (block kb >= nkb of row tile
                # r is unit (r + 16) nkb or more): the wave's data buffer ends there
                ends = mx.umin(nb, mul(add(row, 16), shape[0]))
                bufs = (bufs[0], mx.buffer(q, zero, mul(mx.to_i64(ends), OUT_BLOCK_BYTES)), bufs[2])

            def step(t, rest=None, n=nt):
                t0 = mx.opaque_sgpr(t)  # addresses from it each step (LLVM's strength reduction gave more VALU)
                d = sub(t0, t_first)  # a multiple of 64 nt
                kb_d = lshr(d, 4)  # the step's first block, from the wave's
                if shuffle == "a4w4" and not scale_layout:
                    codes = add(s0, kb_d)
                elif nt == 2:
                    codes = add(s0, shl(d, 1))
                else:  # "mfma", one tile: the 8-block column tile changes every other step
                    codes = mx.select(inside, mx.scale_offset(scale_layout, row, add(kb, kb_d), shape[5]), mx.OOB)
                keeps = None
                if rest is not None:  # last step: blocks left to the row's end; pair q (2q, 2q + 1) kept below
                    keeps = [[mx.cmp_ult(2 * q, rest) if q else None for q in (2 * j, 2 * j + 1)] for j in range(n)]
                lined_tiles(t0, n, bufs, lanes, shape, sizes, n1_args,
                            placed=(add(x0, mul(d, in_block // 16)), codes, keeps))

            tiles = val(tiles_per_wave)
            if padded:  # the row tile's from the wave's first
                tiles = mx.umin(tiles, sub(sh.emit_real_row_tiles(shape[0], pair_tiles, ragged), lshr(kb, 2)))
            end = add(t_first, mul(tiles, WAVE))
            if ragged:  # only a wave's last step can hold the row tile's end
                t_last = sub(end, nt * WAVE)
                mx.for_range(t_last, step, t_first, nt * WAVE)
                rest = sub(shape[0], add(kb, lshr(sub(t_last, t_first), 4)))
                if nt == 2:  # a last step whose second tile holds none of the row's blocks runs its first alone
                    mx.if_else(mx.cmp_ult(4, rest), lambda: step(t_last, rest), lambda: step(t_last, rest, 1))
                else:
                    step(t_last, rest)
            else:
                mx.for_range(end, step, t_first, nt * WAVE)
        elif code_lines(arch, dtype, shuffle, scale_layout):
            line_codes(tile, val(tiles_per_wave), first, (bufs, lanes, shape, sizes, n1_args), own, nb, rs)
        elif pair_tiles:  # codes stored per block (range-checked each): pairs of tiles, then an odd last one
            args = (bufs, lanes, shape, sizes, n1_args)
            mx.for_range(lshr(val(tiles_per_wave), 1), lambda i: lined_tiles(tile(shl(i, 1)), 2, *args))
            mx.for_range(band(val(tiles_per_wave), 1), lambda i: lined_tiles(tile(sub(val(tiles_per_wave), 1)), 1, *args))
        else:
            mx.for_range(tiles_per_wave, lambda i: lined_tiles(tile(i), 1, bufs, lanes, shape, sizes, n1_args))

    @flyc.kernel(name=name, known_block_size=[WAVE * waves, 1, 1])
    def kernel(
        x: fx.Tensor,  # (M, K) BF16/FP16/FP32, row-major
        q: fx.Tensor,  # (M, nkb * 16) uint8: packed E2M1
        s: fx.Tensor,  # (M, nkb) uint8: E8M0 codes
        nblocks: fx.Int32,  # M * nkb, nkb = ceil(K / 32)
        tiles_per_wave: fx.Int32,
        nkb: fx.Int32,
        row_bytes: fx.Int32,  # K * element bytes
        k: fx.Int32,  # K
        magic: fx.Int32,  # floor(g / d) = (umulhi(g, magic) + g) >> shift: d = nkb, shuffles row_tiles
        shift: fx.Int32,
        x_bytes: fx.Int32,  # M * K * element bytes
        n1: fx.Int32,  # a16w4_gate_up: N / 32 (rows per expert / 32); 1 otherwise
        magic_n1: fx.Int32,  # floor(q / n1) = (umulhi(q, magic_n1) + q) >> shift_n1 (gate_up)
        shift_n1: fx.Int32,
        s_bytes: fx.Int32,  # s's size: M * nkb, or the padded mfma layout's
        dims: fx.Int32,  # mfma: padded scale columns / 8
        row_tiles: fx.Int32,  # shuffles: a row tile's tiles, padded (sh.row_tiles' first; magic's divisor); else 0
    ):
        body(x, q, s, nblocks, tiles_per_wave, nkb, row_bytes, k, magic, shift, x_bytes, n1, magic_n1, shift_n1,
             s_bytes, dims, row_tiles)

    @flyc.jit
    def launch(
        x: fx.Tensor,
        q: fx.Tensor,
        s: fx.Tensor,
        nblocks: fx.Int32,
        tiles_per_wave: fx.Int32,
        nkb: fx.Int32,
        row_bytes: fx.Int32,
        k: fx.Int32,
        magic: fx.Int32,
        shift: fx.Int32,
        x_bytes: fx.Int32,
        n1: fx.Int32,
        magic_n1: fx.Int32,
        shift_n1: fx.Int32,
        s_bytes: fx.Int32,
        dims: fx.Int32,
        row_tiles: fx.Int32,
        workgroups: fx.Int32,
        stream: fx.Stream = fx.Stream(None),
    ):
        assert source and name  # closure values, so FlyDSL's disk cache keys on them (sources, variant)
        kernel(x, q, s, nblocks, tiles_per_wave, nkb, row_bytes, k, magic, shift, x_bytes, n1, magic_n1,
               shift_n1, s_bytes, dims, row_tiles).launch(
            grid=(workgroups, 1, 1), block=(WAVE * waves, 1, 1), stream=stream
        )

    return launch


_cached_rows = toolchain.launcher_cache(build_rows)


def chunk_rows(shuffle, scale_layout, rows_per_expert) -> int:
    """Rows a launch's chunk of a larger tensor is a multiple of, so that each chunk's outputs are
    a contiguous part of the whole's: whole experts (a16w4), the "mfma" scales' 256-row padding,
    a4w4's 16-row tiles."""
    if shuffle in ("a16w4", "a16w4_gate_up"):
        return rows_per_expert
    return mx.MFMA_ROW_PAD if scale_layout else validate.A4W4_ROW_MULTIPLE if shuffle else 1


def _row_bytes(k: int, dtype: torch.dtype) -> int:
    """The largest of a row's buffers: x's, or its data's (a partial block is stored whole)."""
    return max(k * torch.empty((), dtype=dtype).element_size(), -(-k // MX_BLOCK) * OUT_BLOCK_BYTES, 1)


def rows_per_launch(shape, dtype: torch.dtype, align: int) -> int:
    """Rows of an (M, K) tensor one launch takes (a multiple of align, or all of them)."""
    return mx.rows_per_launch(shape[0], _row_bytes(shape[1], dtype), align)


def too_large(shape, dtype: torch.dtype, align: int = 1) -> str | None:
    """Why the kernel cannot take an (M, K) tensor: not even `align` rows (chunk_rows) fit one
    launch's 32-bit buffer offsets; None when it can (larger tensors go in row chunks)."""
    row_bytes = _row_bytes(shape[1], dtype)
    if align * row_bytes >= mx.MAX_LAUNCH_BYTES:
        return f"{align} row(s) of x or of its data ({row_bytes} bytes each) reach 2 GiB (32-bit buffer offsets)"
    return None


def quantize_rows(x: torch.Tensor, *, arch: str, scaling_mode: str = "floor", shuffle=None, rows_per_expert=None,
                  scale_layout=None):
    """Rowwise MXFP4 quantize of a contiguous (M, K) BF16/FP16/FP32 tensor on `arch`, as
    flyquant.reference.mxfp4_quantize(x, -1, scaling_mode): (uint8 (M, ceil(K/32) * 16), float8_e8m0fnu
    (M, ceil(K/32))). shuffle "a16w4" / "a16w4_gate_up": x is (E * N, K) expert weights (N =
    rows_per_expert), the outputs' bytes are those of aiter's shuffle_weight_a16w4(data, 16,
    gate_up) and shuffle_scale_a16w4(scales, E, gate_up) (N % 32 == 0, K % 256 == 0); "a4w4":
    the data's bytes are those of aiter's shuffle_weight(data, layout=(16, 16)) (M % 16 == 0, K %
    64 == 0). scale_layout "mfma": the scales are aiter's e8m0_shuffle of them, (ceil(M/256) *
    256, ceil(nkb/8) * 8) with zero padding. A tensor whose buffers reach 2 GiB is quantized in
    row chunks of chunk_rows' multiple, one launch each. Inputs are validated by the caller
    (flyquant.api / reference checks)."""
    m, k = x.shape
    align = chunk_rows(shuffle, scale_layout, rows_per_expert)
    reason = too_large(x.shape, x.dtype, align)
    if reason:
        raise ValueError(reason)
    nkb = -(-k // MX_BLOCK)
    data, scales = allocate(m, nkb, x.device)
    prows, pcols = mx.scale_layout_shape(m, nkb, scale_layout)
    if scale_layout:
        scales = mx.scale_tensor((prows, pcols), True, x.device)
    if m * nkb == 0:
        return data, scales.view(torch.float8_e8m0fnu)
    step = rows_per_launch(x.shape, x.dtype, align)
    for r0 in range(0, m, step):
        rows = min(step, m - r0)
        # each chunk's outputs are the whole's rows from r0 (layouts: whole 256-row tiles)
        s_rows = mx.scale_layout_shape(rows, nkb, scale_layout)[0]
        _launch_rows(x[r0:r0 + rows], data[r0:r0 + rows], scales[r0:r0 + s_rows], arch=arch, scaling_mode=scaling_mode,
                     shuffle=shuffle, rows_per_expert=rows_per_expert, scale_layout=scale_layout)
    return data, scales.view(torch.float8_e8m0fnu)


def _launch_rows(x, data, scales, *, arch, scaling_mode, shuffle, rows_per_expert, scale_layout):
    """One launch of the rowwise kernel on (M, K) x into its outputs (scales: (M, nkb), or the
    layout's padded (rows, cols), zero filled)."""
    m, k = x.shape
    nkb = -(-k // MX_BLOCK)
    prows, pcols = scales.shape
    tail = k % MX_BLOCK != 0
    row_tiles = sh.row_tiles(arch, TORCH_DTYPES[x.dtype], shuffle, nkb, m // 16)[0] if shuffle else 0
    magic, shift = mx.divide_magic(row_tiles or nkb)
    # gate_up's rows per expert in 32-row tiles (N % 32 == 0); unused by the other variants (any N)
    n1 = rows_per_expert // (sh.A16W4_NLANE * 2) if shuffle == "a16w4_gate_up" else 1
    magic_n1, shift_n1 = mx.divide_magic(n1)
    cfg = plan_rows((m, k), arch, shuffle, TORCH_DTYPES[x.dtype])
    with toolchain.target(arch, x.device):
        launch = _cached_rows(arch, TORCH_DTYPES[x.dtype], scaling_mode, tail, shuffle, scale_layout, cfg.waves,
                              sh.a4w4_k_align(arch, TORCH_DTYPES[x.dtype], k) if shuffle == "a4w4" else 0,
                              sh.padded_rows(arch, TORCH_DTYPES[x.dtype], shuffle, nkb, m // 16))
        launch(x, data, scales, m * nkb, cfg.tiles_per_wave, nkb, k * x.element_size(), k, mx.i32_bits(magic), shift,
               x.numel() * x.element_size(), n1, mx.i32_bits(magic_n1), shift_n1, prows * pcols,
               mx.layout_dims(scale_layout, pcols) if scale_layout else 0, row_tiles, cfg.workgroups,
               stream=toolchain.stream(x))
