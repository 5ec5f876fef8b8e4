"""MXFP4 quantize in both orientations from one read of x (M, K): the rowwise outputs (data (M,
ceil(K/32) * 16), scales (M, ceil(K/32))) and the columnwise ones (x^T quantized along M: data
(K, ceil(M/32) * 16), scales (K, ceil(M/32))) of kernels/mxfp4_quantize.py and
kernels/mxfp4_quantize_cols.py, bit-exact with both, in one kernel.

Work split: a wave tile is 32 rows (row block rb) x 64 columns (row blocks 2t and 2t + 1 of
each row); lane l quantizes block (rb * 32 + l % 32, 2t + l / 32) of the rowwise output and
column 64t + l over the row block of the columnwise one. K % 32 == 0: the tile is loaded by
whole lines (a tile row is one 128-byte line, FP32 two; load i of lane l is 16-byte piece l % P
of tile row i * 64 / P + l / P, P = 8 (FP32 16) pieces per tile row, so each load instruction
reads 64 / P whole tile rows; the second block past an odd nkb reads zeros: moved out of range)
into the wave's LDS tile, row-major (rows 16 bytes apart beyond the tile's width), and lane l
reads its block back with 16-byte LDS loads. K % 32 != 0: lane l loads its block itself (16-byte
loads; partial and missing blocks masked with the rowwise kernel's tail masks, its 2-byte load
for the last element of a 16-bit x with odd K). The lane quantizes its block as the rowwise
kernel does (_mxfp4_common.quantize_words) and stores its 16 data bytes and code byte. It then
writes its 32 elements into the wave's LDS tile transposed, over the row-major one
(column-major, 16-bit or 32-bit stores; a column's 32 rows contiguous, the columns 16 bytes
apart beyond that, so the reads stay 16-byte aligned); lane l reads column 64t + l's 32
elements back with 16-byte LDS loads (16-bit: as (row 2i, row 2i + 1) dwords, the rowwise
words' order) and quantizes and stores them the same way. A wave's LDS accesses run in program
order, so the wave needs no barrier (each wave has its own LDS tile; the transposed stores
follow the row-major loads, the next tile's stores this tile's loads). Rows past M read zeros
(past x's end), columns past K are masked; stores of rows past M, columns past K and blocks past
the last row block are moved out of range. Stores are 16 bytes (data) and 1 byte (codes) but
not coalesced: a tile's rows are 16 bytes of 32 different output rows.
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
from . import mxfp4_quantize as rows_kernel
from ._mx_common import MX_BLOCK, PIECE_BYTES, PIECE_DWORDS, WAVE, Spec, add, band, const, lshr, mul, shl, sub, val
from ._mxfp4_common import OUT_BLOCK_BYTES, TORCH_DTYPES, allocate, quantize_words

SOURCE_TAG = mx.source_tag(sys.modules[__name__], _mxfp4_common, rows_kernel)

MAX_WAVES = 4
MIN_WORKGROUPS_PER_CU = 2  # plan_dual takes fewer waves where the LDS tiles would allow only one
TILES_PER_WAVE = 2
TILE_COLS = 2 * MX_BLOCK  # 64 columns: the two row blocks of a tile's row
LDS_PAD = PIECE_BYTES  # between LDS rows (row-major) or columns (transposed)


@dataclass(frozen=True)
class DualPlan:
    waves: int
    tiles_per_wave: int
    workgroups: int
    col_tiles: int  # tiles along K (the minor tile index)


def wave_lds_bytes(elem_bytes: int) -> int:
    """LDS bytes of a wave's tile: the row-major tile of the whole-line loads or the transposed
    one, whichever is larger (they share the bytes)."""
    row_major = MX_BLOCK * (TILE_COLS * elem_bytes + LDS_PAD)
    transposed = TILE_COLS * (MX_BLOCK * elem_bytes + LDS_PAD)
    return max(row_major, transposed)


def plan_dual(shape, arch: str, dtype: torch.dtype = torch.bfloat16) -> DualPlan:
    """The tiling of a dual quantize of an (M, K) tensor: up to MAX_WAVES waves per workgroup, fewer
    where MIN_WORKGROUPS_PER_CU workgroups' LDS tiles would not fit in a CU (FP32 on gfx942)."""
    lds = arch_info(arch).lds_bytes_per_cu
    m, k = shape
    waves = min(MAX_WAVES, lds // (MIN_WORKGROUPS_PER_CU * wave_lds_bytes(torch.empty((), dtype=dtype).element_size())))
    col_tiles = -(-k // TILE_COLS)
    tiles = -(-m // MX_BLOCK) * col_tiles
    return DualPlan(*mx.wave_split(tiles, waves, TILES_PER_WAVE), col_tiles)


def build_dual(arch: str, dtype: str, mode: str, tail: bool, waves: int = MAX_WAVES):
    """An uncached @flyc.jit launcher of the dual kernel for one specialization (tail: K % 32 !=
    0, whose 16-bit last element needs the rowwise kernel's 2-byte load)."""
    spec = Spec(arch, dtype, mode)
    eb = spec.elem_bytes
    in_block = MX_BLOCK * eb
    loads = in_block // PIECE_BYTES
    tile_bytes = TILE_COLS * eb  # a tile row: one (FP32: two) 128-byte lines
    row_pieces = tile_bytes // PIECE_BYTES  # P
    rows_per_load = WAVE // row_pieces
    row_stride = tile_bytes + LDS_PAD  # the row-major tile (whole-line loads)
    col_stride = MX_BLOCK * eb + LDS_PAD  # the transposed tile
    wave_lds = wave_lds_bytes(eb)
    name = f"mxfp4_dual_{spec.tag}" + ("_tail" if tail else "") + f"_w{waves}"
    source = SOURCE_TAG

    def line_loads(rx, rb, t, nkb, row_bytes, lane):
        """K % 32 == 0: the tile's 32 rows x tile_bytes by whole lines: load i of lane l is piece l % P
        of row i * 64 / P + l / P (P pieces of 16 bytes per tile row), so one load instruction
        reads 64 / P rows' whole tile_bytes. A second block past an odd nkb is read as zeros
        (moved out of range). Returns each load's (registers, LDS offset in the tile)."""
        piece, row = band(lane, row_pieces - 1), lshr(lane, row_pieces.bit_length() - 1)
        kb = add(shl(t, 1), lshr(piece, (row_pieces // 2).bit_length() - 1))
        off = add(add(mul(add(shl(rb, 5), row), row_bytes), mul(t, tile_bytes)), mul(piece, PIECE_BYTES))
        off = mx.select(mx.cmp_ult(kb, nkb), off, mx.OOB)
        step = mul(row_bytes, rows_per_load)
        offs = [off]
        for _ in range(1, loads):
            offs.append(add(offs[-1], step))
        lds_off = add(mul(row, row_stride), mul(piece, PIECE_BYTES))
        return [(mx.load(rx, o), add(lds_off, i * rows_per_load * row_stride)) for i, o in enumerate(offs)]

    def tile(tt, bufs, dims, lds):
        rx, q1, s1, q0, s0 = bufs
        m, k, nkb, nmb, col_tiles, magic, shift, row_bytes, x_bytes = dims
        lane = band(val(fx.Int32(fx.thread_idx.x)), WAVE - 1)
        rb = lshr(add(mx.umulhi(tt, magic), tt), shift)
        t = sub(tt, mul(rb, col_tiles))
        r, h = band(lane, MX_BLOCK - 1), lshr(lane, 5)
        row, kb = add(shl(rb, 5), r), add(shl(t, 1), h)
        valid = mx.usub_sat(k, mul(kb, MX_BLOCK))  # elements present (>= 32: all)
        g = add(mul(row, nkb), kb)
        if tail:  # the lane's block straight from x, its missing elements masked
            off = add(mul(row, row_bytes), mul(kb, in_block))
            regs = [mx.load(rx, off if i == 0 else add(off, i * PIECE_BYTES)) for i in range(loads)]
            words = [w for reg in regs for w in mx.dwords_of(reg)]
            words = [band(w, msk) for w, msk in zip(words, rows_kernel._tail_masks(spec, valid))]
            if not spec.wide:
                words = rows_kernel._last_element(words, g, valid, (rx,), (mul(m, nkb), x_bytes))
        else:  # whole lines into LDS (row-major), then the lane's block back
            for reg, at in line_loads(rx, rb, t, nkb, row_bytes, lane):
                mx.lds_store(reg, add(lds, at))
            block_addr = add(lds, add(mul(r, row_stride), mul(h, in_block)))
            words = [w for i in range(loads) for w in mx.dwords_of(mx.lds_load(PIECE_DWORDS, add(block_addr, i * PIECE_BYTES)))]
        # rowwise: the lane's block (row rb * 32 + r, block 2t + h)
        out = quantize_words(spec, words, valid)
        inside = arith.andi(mx.cmp_ult(kb, nkb), mx.cmp_ult(row, m))
        mx.store_byte(out[4], s1, mx.select(inside, g, mx.OOB))
        mx.store(mx.from_elements(out[:4]), q1, mx.select(inside, mul(g, OUT_BLOCK_BYTES), mx.OOB))
        # the elements into LDS, transposed (over the row-major tile: the wave's LDS accesses run
        # in program order): element j of the lane's block is column h * 32 + j
        base = add(add(lds, mul(h, MX_BLOCK * col_stride)), mul(r, eb))
        for j in range(MX_BLOCK):
            addr = add(base, j * col_stride)
            if spec.wide:
                mx.lds_store(words[j], addr)
            else:
                mx.lds_store_short(words[j // 2] if j % 2 == 0 else lshr(words[j // 2], 16), addr)
        # columnwise: column 64 t + lane over the row block
        col_addr = add(lds, mul(lane, col_stride))
        cwords = [w for i in range(loads) for w in mx.dwords_of(mx.lds_load(PIECE_DWORDS, add(col_addr, i * PIECE_BYTES)))]
        cvalid = mx.usub_sat(m, shl(rb, 5))
        cout = quantize_words(spec, cwords, cvalid)
        col = add(mul(t, TILE_COLS), lane)
        cg = add(mul(col, nmb), rb)
        cinside = arith.andi(mx.cmp_ult(col, k), mx.cmp_ult(rb, nmb))
        mx.store_byte(cout[4], s0, mx.select(cinside, cg, mx.OOB))
        mx.store(mx.from_elements(cout[:4]), q0, mx.select(cinside, mul(cg, OUT_BLOCK_BYTES), mx.OOB))

    def body(x, q1, s1, q0, s0, m, k, nkb, nmb, col_tiles, magic, shift, row_bytes, x_bytes, tiles_per_wave):
        tid = val(fx.Int32(fx.thread_idx.x))
        wave = mx.readfirstlane(lshr(tid, 6))
        zero = const(0, mx.i64_t())
        mv, kv, nkbv, nmbv = val(m), val(k), val(nkb), val(nmb)
        rx = mx.buffer(x, zero, mx.to_i64(val(x_bytes)))
        bufs = (rx, mx.buffer(q1, zero, mx.to_i64(mul(mul(mv, nkbv), OUT_BLOCK_BYTES))),
                mx.buffer(s1, zero, mx.to_i64(mul(mv, nkbv))),
                mx.buffer(q0, zero, mx.to_i64(mul(mul(kv, nmbv), OUT_BLOCK_BYTES))),
                mx.buffer(s0, zero, mx.to_i64(mul(kv, nmbv))))
        dims = (mv, kv, nkbv, nmbv, val(col_tiles), val(magic), val(shift), val(row_bytes), val(x_bytes))
        stage = fx.SharedAllocator().allocate(waves * wave_lds, alignment=PIECE_BYTES)
        lds = add(val(fx.Int32(fx.ptrtoint(stage.peek().ptr))), mul(wave, wave_lds))
        first = mul(add(mul(val(fx.Int32(fx.block_idx.x)), waves), wave), tiles_per_wave)
        mx.for_range(tiles_per_wave, lambda i: tile(mx.opaque_sgpr(add(first, i)), bufs, dims, lds))

    @flyc.kernel(name=name, known_block_size=[WAVE * waves, 1, 1])
    def kernel(
        x: fx.Tensor,  # (M, K) BF16/FP16/FP32, row-major
        q1: fx.Tensor,  # (M, nkb * 16) uint8: rowwise packed E2M1
        s1: fx.Tensor,  # (M, nkb) uint8: rowwise codes
        q0: fx.Tensor,  # (K, nmb * 16) uint8: columnwise packed E2M1
        s0: fx.Tensor,  # (K, nmb) uint8: columnwise codes
        m: fx.Int32,
        k: fx.Int32,
        nkb: fx.Int32,  # ceil(K / 32)
        nmb: fx.Int32,  # ceil(M / 32)
        col_tiles: fx.Int32,  # ceil(K / 64)
        magic: fx.Int32,  # floor(t / col_tiles) = (umulhi(t, magic) + t) >> shift
        shift: fx.Int32,
        row_bytes: fx.Int32,  # K * element bytes
        x_bytes: fx.Int32,  # M * K * element bytes
        tiles_per_wave: fx.Int32,
    ):
        body(x, q1, s1, q0, s0, m, k, nkb, nmb, col_tiles, magic, shift, row_bytes, x_bytes, tiles_per_wave)

    @flyc.jit
    def launch(
        x: fx.Tensor,
        q1: fx.Tensor,
        s1: fx.Tensor,
        q0: fx.Tensor,
        s0: fx.Tensor,
        m: fx.Int32,
        k: fx.Int32,
        nkb: fx.Int32,
        nmb: fx.Int32,
        col_tiles: fx.Int32,
        magic: fx.Int32,
        shift: fx.Int32,
        row_bytes: fx.Int32,
        x_bytes: fx.Int32,
        tiles_per_wave: fx.Int32,
        workgroups: fx.Int32,
        stream: fx.Stream = fx.Stream(None),
    ):
        assert source and name  # closure values, so FlyDSL's disk cache keys on them (sources, variant)
        kernel(x, q1, s1, q0, s0, m, k, nkb, nmb, col_tiles, magic, shift, row_bytes, x_bytes, tiles_per_wave).launch(
            grid=(workgroups, 1, 1), block=(WAVE * waves, 1, 1), stream=stream
        )

    return launch


_cached_dual = functools.lru_cache(maxsize=None)(build_dual)


def too_large(shape, dtype: torch.dtype) -> str | None:
    """Why one launch cannot take an (M, K) tensor (32-bit buffer offsets; the last workgroup's
    tiles past the end reach MAX_WAVES * TILES_PER_WAVE row blocks past M), or None."""
    m, k = shape
    row_bytes = k * torch.empty((), dtype=dtype).element_size()
    x_bytes = (m + MX_BLOCK * MAX_WAVES * TILES_PER_WAVE) * row_bytes
    out_bytes = max(m * -(-k // MX_BLOCK), k * -(-m // MX_BLOCK)) * OUT_BLOCK_BYTES
    if max(x_bytes, out_bytes) >= mx.MAX_LAUNCH_BYTES:
        return f"x plus {MX_BLOCK * MAX_WAVES * TILES_PER_WAVE} rows ({x_bytes} bytes) or its data ({out_bytes} bytes) reaches 2 GiB (32-bit buffer offsets)"
    return None


def quantize_dual(x: torch.Tensor, *, arch: str, scaling_mode: str = "floor"):
    """Both MXFP4 quantizes of a contiguous (M, K) BF16/FP16/FP32 tensor on `arch` in one launch:
    ((rowwise data, scales), (columnwise data, scales)), as flyquant.reference.mxfp4_quantize(x,
    -1 / 0, scaling_mode). Inputs are validated by the caller."""
    m, k = x.shape
    reason = too_large(x.shape, x.dtype)
    if reason:
        raise ValueError(reason)
    nkb, nmb = -(-k // MX_BLOCK), -(-m // MX_BLOCK)
    d1, s1 = allocate(m, nkb, x.device)
    d0, s0 = allocate(k, nmb, x.device)
    e8 = torch.float8_e8m0fnu
    if m * k == 0:
        return (d1, s1.view(e8)), (d0, s0.view(e8))
    cfg = plan_dual((m, k), arch, x.dtype)
    magic, shift = mx.divide_magic(cfg.col_tiles)
    with toolchain.target(arch):
        launch = _cached_dual(arch, TORCH_DTYPES[x.dtype], scaling_mode, k % MX_BLOCK != 0, cfg.waves)
        launch(x, d1, s1, d0, s0, m, k, nkb, nmb, cfg.col_tiles, mx.i32_bits(magic), shift, k * x.element_size(),
               x.numel() * x.element_size(), cfg.tiles_per_wave, cfg.workgroups, stream=mx.torch_stream(x))
    return (d1, s1.view(e8)), (d0, s0.view(e8))
