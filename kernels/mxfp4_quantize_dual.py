"""MXFP4 quantize in both orientations from one read of x (M, K): the rowwise outputs (data (M,
ceil(K/32) * 16), scales (M, ceil(K/32))) and the columnwise ones (x^T quantized along M: data
(K, ceil(M/32) * 16), scales (K, ceil(M/32))) of kernels/mxfp4_quantize.py and
kernels/mxfp4_quantize_cols.py, bit-exact with both, in one kernel.

Two kernels (in_registers picks): K % 32 == 0, but for FP32 on gfx942, the register kernel,
kernels/mxfp4_quantize_cols.py's dual variant (its docstring: the columnwise kernel's lanes, each
holding 32 rows x 16 bytes, quantize their columns as that kernel does and, from the same
registers, the rows' blocks split over 4 (FP32: 8) lanes, whose data goes through an LDS stage
out as whole lines). The others (K % 32 != 0, and FP32 on gfx942, where the software conversion
of whole blocks in one lane executes fewer instructions) take this module's kernel:

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
order, so the wave needs no barrier for its own tile (the transposed stores follow the
row-major loads, the next tile's stores this tile's loads). Rows past M read zeros (past x's
end), columns past K are masked; stores of rows past M, columns past K and (in the column lines)
row blocks past the last are moved out of range.

Whole output lines. A 128-byte line of rowwise data is 8 blocks of a row (256 columns), one of
columnwise data 8 row blocks of a column (256 rows), so a workgroup of WAVES = 4 waves owns 256
rows x 256 columns: wave w the column tile 4 bx + w of row blocks 8 by .. 8 by + 7, walked in
order (unrolled; the row blocks past the last are skipped, the same for every wave). Rowwise: per
row block the waves put their 16-byte blocks into a shared LDS stage of 32 rows x 128 bytes
(double-buffered, one barrier per row block), and each wave stores 8 of its rows as whole
lines. Columnwise: a lane keeps its column's 16 bytes of each row block in registers (32
VGPRs); after the last row block the wave writes them to its LDS tile, 128 bytes per column
(FP32: all 64 columns at once; 16-bit: 32 per pass, the tile's size), and stores 8 columns'
lines per instruction. Data stores are 16 bytes and write whole lines where K and M are
multiples of 256 (each row's and each column's data start on a line); code bytes are stored per
block."""

from __future__ import annotations

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
from . import mxfp4_quantize_cols as cols_kernel
from ._mx_common import MX_BLOCK, PIECE_BYTES, PIECE_DWORDS, WAVE, Spec, add, band, const, lshr, mul, shl, sub, val
from ._mxfp4_common import OUT_BLOCK_BYTES, TORCH_DTYPES, allocate, quantize_words

SOURCE_TAG = mx.source_tag(sys.modules[__name__], _mxfp4_common)

WAVES = 4  # a workgroup's column tiles: 4 x 2 blocks of 16 bytes = a rowwise output line
ROW_BLOCKS = 8  # a workgroup's row blocks: 8 x 16 bytes = a columnwise output line
TILE_COLS = 2 * MX_BLOCK  # 64 columns: the two row blocks of a tile's row
LDS_PAD = PIECE_BYTES  # between LDS rows (row-major) or columns (transposed)
LINE_BYTES = ROW_BLOCKS * OUT_BLOCK_BYTES  # one output line, staged in LDS
LINE_STRIDE = LINE_BYTES + LDS_PAD
LINE_PIECES = LINE_BYTES // PIECE_BYTES  # 8 lanes store a line
ROW_STAGE_BYTES = MX_BLOCK * LINE_STRIDE  # a row block's rowwise lines (two, double-buffered)
assert WAVES * 2 * OUT_BLOCK_BYTES == LINE_BYTES


@dataclass(frozen=True)
class DualPlan:
    col_groups: int  # grid x: 256-column groups (WAVES column tiles)
    row_groups: int  # grid y: 256-row groups (ROW_BLOCKS row blocks)
    lds_bytes: int  # per workgroup


def wave_lds_bytes(elem_bytes: int) -> int:
    """LDS bytes of a wave's tile: the row-major tile of the whole-line loads or the transposed
    one, whichever is larger (they share the bytes, and then stage the column lines)."""
    row_major = MX_BLOCK * (TILE_COLS * elem_bytes + LDS_PAD)
    transposed = TILE_COLS * (MX_BLOCK * elem_bytes + LDS_PAD)
    return max(row_major, transposed)


def column_pass(elem_bytes: int) -> int:
    """Columns whose lines a wave stages at once in its tile: 64 (FP32), 32 (16-bit)."""
    fit = wave_lds_bytes(elem_bytes) // LINE_STRIDE
    return min(WAVE, 1 << (fit.bit_length() - 1))


def in_registers(k: int, arch: str, dtype: torch.dtype) -> bool:
    """Whether the register kernel (kernels/mxfp4_quantize_cols.py's dual variant) takes a dual
    quantize: K % 32 == 0, but for FP32 on gfx942, where this module's kernel executes fewer
    instructions (its software conversion of 8 elements per output dword, against 4)."""
    return k % MX_BLOCK == 0 and not (arch == "gfx942" and dtype == torch.float32)


def plan_dual(shape, arch: str, dtype: torch.dtype = torch.bfloat16) -> DualPlan:
    """The grid of a dual quantize of an (M, K) tensor: the register kernel (in_registers) a
    workgroup per 256 rows x dual_waves column tiles of 128 bytes (256 columns); this module's a
    workgroup per 256 x 256 elements."""
    m, k = shape
    if in_registers(k, arch, dtype):
        eb = torch.empty((), dtype=dtype).element_size()
        waves = cols_kernel.dual_waves(eb)
        return DualPlan(-(-k * eb // (waves * cols_kernel.LINE_BYTES)), -(-m // cols_kernel.STAGE_ROWS),
                        cols_kernel.STAGE_ROWS * cols_kernel.LINE_BYTES)
    lds = WAVES * wave_lds_bytes(torch.empty((), dtype=dtype).element_size()) + 2 * ROW_STAGE_BYTES
    assert lds <= arch_info(arch).lds_bytes_per_cu
    return DualPlan(-(-k // (WAVES * TILE_COLS)), -(-m // (ROW_BLOCKS * MX_BLOCK)), lds)


def build_dual(arch: str, dtype: str, mode: str, tail: bool):
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
    per_pass = column_pass(eb)
    name = f"mxfp4_dual_{spec.tag}" + ("_tail" if tail else "")
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

    def tile(rb, t, bufs, dims, lds, stage):
        """Row block rb of column tile t: the rowwise blocks into the LDS stage (row r's line at r *
        LINE_STRIDE, this wave's two blocks at 32 w) and their codes stored; returns the lane's
        column data (4 dwords), its code stored."""
        rx, q1, s1, q0, s0 = bufs
        m, k, nkb, nmb, row_bytes, x_bytes, wave, lane = dims
        r, h = band(lane, MX_BLOCK - 1), lshr(lane, 5)
        row, kb = add(shl(rb, 5), r), add(shl(t, 1), h)
        valid = mx.usub_sat(k, mul(kb, MX_BLOCK))  # elements present (>= 32: all)
        g = add(mul(row, nkb), kb)
        if tail:  # the lane's block straight from x, its missing elements masked
            off = add(mul(row, row_bytes), mul(kb, in_block))
            regs = [mx.load(rx, off if i == 0 else add(off, i * PIECE_BYTES)) for i in range(loads)]
            words = [w for reg in regs for w in mx.dwords_of(reg)]
            words = [band(w, msk) for w, msk in zip(words, _mxfp4_common.tail_masks(spec, valid))]
            if not spec.wide:
                words = _mxfp4_common.last_element(words, g, valid, (rx,), (mul(m, nkb), x_bytes))
        else:  # whole lines into LDS (row-major), then the lane's block back
            regs = line_loads(rx, rb, t, nkb, row_bytes, lane)
            mx.wait_loads()  # one wait for the tile's loads, one for its LDS reads (not one per use)
            for reg, at in regs:
                mx.lds_store(reg, add(lds, at))
            mx.lds_exchange_fence()
            block_addr = add(lds, add(mul(r, row_stride), mul(h, in_block)))
            words = [w for i in range(loads) for w in mx.dwords_of(mx.lds_load(PIECE_DWORDS, add(block_addr, i * PIECE_BYTES)))]
            mx.wait_lds()
        # rowwise: the lane's block (row rb * 32 + r, block 2t + h)
        out = quantize_words(spec, words, valid)
        mx.store_byte(out[4], s1, mx.select(arith.andi(mx.cmp_ult(kb, nkb), mx.cmp_ult(row, m)), g, mx.OOB))
        mx.lds_store(mx.from_elements(out[:4]), add(stage, add(mul(r, LINE_STRIDE), add(shl(wave, 5), shl(h, 4)))))
        # the elements into LDS, transposed (over the row-major tile: the wave's LDS accesses run
        # in program order): element j of the lane's block is column h * 32 + j
        base = add(add(lds, mul(h, MX_BLOCK * col_stride)), mul(r, eb))
        for j in range(MX_BLOCK):
            addr = add(base, j * col_stride)
            if spec.wide:
                mx.lds_store(words[j], addr)
            else:
                mx.lds_store_short(words[j // 2] if j % 2 == 0 else lshr(words[j // 2], 16), addr)
        mx.lds_exchange_fence()
        # columnwise: column 64 t + lane over the row block
        col_addr = add(lds, mul(lane, col_stride))
        cwords = [w for i in range(loads) for w in mx.dwords_of(mx.lds_load(PIECE_DWORDS, add(col_addr, i * PIECE_BYTES)))]
        mx.wait_lds()
        cout = quantize_words(spec, cwords, mx.usub_sat(m, shl(rb, 5)))
        col = add(mul(t, TILE_COLS), lane)
        # (rb is below nmb: the row blocks past the last are skipped)
        mx.store_byte(cout[4], s0, mx.select(mx.cmp_ult(col, k), add(mul(col, nmb), rb), mx.OOB))
        return cout[:4]

    def row_lines(rb, bx, bufs, dims, stage):
        """After the barrier: wave w stores rows 8w .. 8w + 7 of the stage, a line per 8 lanes."""
        q1 = bufs[1]
        m, nkb, wave, lane = dims[0], dims[2], dims[6], dims[7]
        r, piece = add(shl(wave, 3), lshr(lane, 3)), band(lane, LINE_PIECES - 1)
        data = mx.lds_load(PIECE_DWORDS, add(stage, add(mul(r, LINE_STRIDE), shl(piece, 4))))
        row, kb = add(shl(rb, 5), r), add(shl(bx, 3), piece)
        inside = arith.andi(mx.cmp_ult(row, m), mx.cmp_ult(kb, nkb))
        mx.store(data, q1, mx.select(inside, shl(add(mul(row, nkb), kb), 4), mx.OOB))

    def column_lines(cols, t, rb0, bufs, dims, lds):
        """The lane's column data of the row blocks (cols[i]: row block rb0 + i) as whole lines:
        through the wave's tile, per_pass columns at a time, a line per 8 lanes."""
        q0 = bufs[3]
        k, nmb, lane = dims[1], dims[3], dims[7]
        piece = band(lane, LINE_PIECES - 1)
        rb = add(rb0, piece)
        for p in range(WAVE // per_pass):
            at = add(lds, mul(sub(lane, p * per_pass), LINE_STRIDE))
            put = lambda: [mx.lds_store(mx.from_elements(c), add(at, i * PIECE_BYTES)) for i, c in enumerate(cols)]  # noqa: E731
            if per_pass == WAVE:
                put()
            else:
                mx.if_then(mx.cmp_ult(sub(lane, p * per_pass), per_pass), put)
            mx.lds_exchange_fence()
            for q in range(per_pass // LINE_PIECES):
                c = add(q * LINE_PIECES, lshr(lane, 3))
                data = mx.lds_load(PIECE_DWORDS, add(lds, add(mul(c, LINE_STRIDE), shl(piece, 4))))
                col = add(add(mul(t, TILE_COLS), p * per_pass), c)
                inside = arith.andi(mx.cmp_ult(col, k), mx.cmp_ult(rb, nmb))
                mx.store(data, q0, mx.select(inside, shl(add(mul(col, nmb), rb), 4), mx.OOB))

    def body(x, q1, s1, q0, s0, m, k, nkb, nmb, row_bytes, x_bytes):
        tid = val(fx.Int32(fx.thread_idx.x))
        wave = mx.readfirstlane(lshr(tid, 6))
        lane = band(tid, WAVE - 1)
        zero = const(0, mx.i64_t())
        mv, kv, nkbv, nmbv = val(m), val(k), val(nkb), val(nmb)
        rx = mx.buffer(x, zero, mx.to_i64(val(x_bytes)))
        bufs = (rx, mx.buffer(q1, zero, mx.to_i64(mul(mul(mv, nkbv), OUT_BLOCK_BYTES))),
                mx.buffer(s1, zero, mx.to_i64(mul(mv, nkbv))),
                mx.buffer(q0, zero, mx.to_i64(mul(mul(kv, nmbv), OUT_BLOCK_BYTES))),
                mx.buffer(s0, zero, mx.to_i64(mul(kv, nmbv))))
        dims = (mv, kv, nkbv, nmbv, val(row_bytes), val(x_bytes), wave, lane)
        alloc = fx.SharedAllocator().allocate(WAVES * wave_lds + 2 * ROW_STAGE_BYTES, alignment=PIECE_BYTES)
        lds0 = val(fx.Int32(fx.ptrtoint(alloc.peek().ptr)))
        lds = add(lds0, mul(wave, wave_lds))
        bx, by = (val(fx.Int32(v)) for v in (fx.block_idx.x, fx.block_idx.y))
        t, rb0 = add(shl(bx, 2), wave), shl(by, 3)
        present = mx.umin(sub(nmbv, rb0), ROW_BLOCKS)  # row blocks of this workgroup (>= 1)

        def row_block(i):
            stage = add(lds0, WAVES * wave_lds + (i % 2) * ROW_STAGE_BYTES)
            rb = add(rb0, i)
            col = tile(rb, t, bufs, dims, lds, stage)
            gpu.barrier()  # every wave's rowwise blocks are in the stage
            row_lines(rb, bx, bufs, dims, stage)
            return col

        cols = [row_block(0)]
        for i in range(1, ROW_BLOCKS):  # the same branch for the whole workgroup (barriers inside)
            cols.append(mx.if_else(mx.cmp_ult(i, present), lambda i=i: row_block(i),
                                   lambda: [const(0)] * PIECE_DWORDS, types=[mx.i32_t()] * PIECE_DWORDS))
        column_lines(cols, t, rb0, bufs, dims, lds)

    @flyc.kernel(name=name, known_block_size=[WAVE * WAVES, 1, 1])
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
        row_bytes: fx.Int32,  # K * element bytes
        x_bytes: fx.Int32,  # M * K * element bytes
    ):
        body(x, q1, s1, q0, s0, m, k, nkb, nmb, row_bytes, x_bytes)

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
        row_bytes: fx.Int32,
        x_bytes: fx.Int32,
        col_groups: fx.Int32,
        row_groups: fx.Int32,
        stream: fx.Stream = fx.Stream(None),
    ):
        assert source and name  # closure values, so FlyDSL's disk cache keys on them (sources, variant)
        kernel(x, q1, s1, q0, s0, m, k, nkb, nmb, row_bytes, x_bytes).launch(
            grid=(col_groups, row_groups, 1), block=(WAVE * WAVES, 1, 1), stream=stream
        )

    return launch


_cached_dual = toolchain.launcher_cache(build_dual)


def too_large(shape, dtype: torch.dtype) -> str | None:
    """Why one launch cannot take an (M, K) tensor (32-bit buffer offsets; the last row tile's
    rows past M are read, as zeros: 32 of them here, 256 in the register kernel), or None."""
    m, k = shape
    row_bytes = k * torch.empty((), dtype=dtype).element_size()
    x_bytes = (m + cols_kernel.STAGE_ROWS) * row_bytes
    out_bytes = max(m * -(-k // MX_BLOCK), k * -(-m // MX_BLOCK)) * OUT_BLOCK_BYTES
    if max(x_bytes, out_bytes) >= mx.MAX_LAUNCH_BYTES:
        return (f"x plus {cols_kernel.STAGE_ROWS} rows ({x_bytes} bytes) or its data ({out_bytes} bytes) reaches 2 GiB "
                "(32-bit buffer offsets)")
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
    if in_registers(k, arch, x.dtype):
        with toolchain.target(arch, x.device):
            dt = TORCH_DTYPES[x.dtype]
            launch = cols_kernel._cached_cols(arch, dt, scaling_mode, False, cols_kernel.dual_waves(x.element_size()), True)
            launch(x, d0, s0, d1, s1, m, k, nmb, nkb, k * x.element_size(), cfg.col_groups, cfg.row_groups,
                   stream=toolchain.stream(x))
        return (d1, s1.view(e8)), (d0, s0.view(e8))
    with toolchain.target(arch, x.device):
        launch = _cached_dual(arch, TORCH_DTYPES[x.dtype], scaling_mode, k % MX_BLOCK != 0)
        launch(x, d1, s1, d0, s0, m, k, nkb, nmb, k * x.element_size(), x.numel() * x.element_size(),
               cfg.col_groups, cfg.row_groups, stream=toolchain.stream(x))
    return (d1, s1.view(e8)), (d0, s0.view(e8))
