"""MXFP8 quantize of 2D tensors: 1x32 (blocks along K) here; 32x1 (blocks along M) and the
fused dual kernel (both from one read) are the column kernel of mxfp8_quantize_3d.

Math (flyquant.reference.mxfp8_quantize, bit-exact): for each block of 32 elements, the E8M0
code and the multiplier of the floor/rceil rule from the block's amax, elements
fp8_e4m3fn(clamp(x * multiplier, -448, 448)); a block holding NaN or Inf gets code 0xFF and
elements 0x7F. The bitwise rules and the conversions are in _mx_common.

1x32, (M, K) row-major -> data (M, K) row-major, scales (M, K/32). K % 32 == 0 makes the tensor
a flat sequence of M*K/32 blocks whose codes, in order, are the plain scale matrix. A wave
quantizes tiles of 8 KiB of input (128 BF16/FP16 or 64 FP32 blocks) with 8 loads of 16 bytes per
lane; each load instruction covers 1 KiB contiguous, so a block's P = 4 (16-bit) or 8 (FP32)
pieces sit in P lanes at the lane distances DISTS (gfx950: 32, 16 (, 8), so v_permlane32/16_swap
exchange them; gfx942: DPP distances 1, 2 (, 8)). The per-lane partial amaxes are
reduce-scattered, leaving every lane 2 whole 16-bit blocks (their scales computed as packed
pairs) or 1 FP32 block: it stores their codes (each store 64 consecutive codes) and the
conversion scales are gathered back, so every lane converts its 8 pieces (8- or 4-byte stores,
512 / 256 contiguous bytes per instruction). A tile with a huge, Inf or NaN value takes a rare
path (exact amax, then 0xFF / 0x7F over the non-finite blocks).

Work split: workgroups of `waves` waves, each wave a run of `tiles_per_wave` consecutive tiles
(plan). Tail tiles read zeros past the end and their stores are dropped (buffer range checks).
Tensors of 2 GiB or more are quantized in row chunks, one launch each (32-bit buffer offsets).
"""

from __future__ import annotations

import functools
import sys
from dataclasses import dataclass

import torch

import flydsl.compiler as flyc
import flydsl.expr as fx

from flyquant import toolchain, validate
from flyquant.arch import arch_info

from . import _mx_common as mx
from ._mx_col import kernel_prefix as col_kernel_prefix
from .mxfp8_quantize_3d import launch_col, plan_col
from ._mx_common import (
    MX_BLOCK,
    PIECE_BYTES,
    WAVE,
    Spec,
    add,
    band,
    bor,
    cmp_uge,
    const,
    lshr,
    mul,
    shl,
    sub,
    to_i64,
    val,
)

LOAD_BYTES = WAVE * PIECE_BYTES  # one load instruction of a wave: 1 KiB contiguous
# Blocks each lane owns after the reduce-scatter (16-bit types: two, so the scale arithmetic runs
# on packed pairs and a tile is 8 loads per lane for every dtype).
BLOCKS_PER_LANE = {"bf16": 2, "fp16": 2, "fp32": 1}
SOURCE_TAG = mx.source_tag(sys.modules[__name__])
TORCH_DTYPES = {torch.bfloat16: "bf16", torch.float16: "fp16", torch.float32: "fp32"}

# Lane distances of a block's pieces (the exchange steps), by arch and element width.
DISTS = {
    ("gfx950", 2): (32, 16),
    ("gfx950", 4): (32, 16, 8),
    ("gfx942", 2): (2, 1),
    ("gfx942", 4): (8, 2, 1),
}


@dataclass(frozen=True)
class Plan1x32:
    waves: int  # waves per workgroup
    tiles_per_wave: int  # consecutive tiles (8 KiB of input each) a wave quantizes
    workgroups: int


MAX_WAVES = 4
# Tiles a wave quantizes in a row: a wave's setup (~50 instructions: arguments, buffers, lane
# offsets, constants) then adds about 1/4 of a tile's work; tensors too small to give every
# compute unit a wave that way are latency-bound whatever the split.
TILES_PER_WAVE = 4


def kernel_prefix(spec: Spec, kind: str, scale_layout=None, block_k: int = 1, grouped: bool = False) -> str:
    """The name of the MXFP8 quantize kernel of `kind` (1x32, or the column kernel's 32x1, dual,
    3d, 3d_t) up to its tile suffixes: what flyquant.select's plans call it."""
    if kind == "1x32":
        return f"mxfp8_1x32_{spec.tag}" + (f"_{scale_layout}" if scale_layout else "")
    return col_kernel_prefix(spec, kind, block_k, scale_layout, grouped)


def plan_1x32(shape, dtype: torch.dtype, arch: str) -> Plan1x32:
    """Waves per workgroup and tiles per wave for an (M, K) 1x32 quantize (arch: the same split
    on gfx942 and gfx950)."""
    arch_info(arch)
    m, k = shape
    tiles = -(-(m * k // MX_BLOCK) // (WAVE * BLOCKS_PER_LANE[TORCH_DTYPES[dtype]]))
    return Plan1x32(*mx.wave_split(tiles, MAX_WAVES, TILES_PER_WAVE))


def plan(kind: str, shape, dtype: torch.dtype, arch: str, scale_block_k: int = 1):
    """The kernel configuration the launchers use for `kind` ("1x32", "32x1", "dual", "3d",
    "3d_t") on a tensor of `shape` and `dtype`: Plan1x32 or mxfp8_quantize_3d.ColPlan (3d: shape
    (E, N, K); 3d_t: the contiguous (E, K, N) tensor it reads, scale_block_k 32; 32x1 and dual:
    (M, K))."""
    if kind == "1x32":
        return plan_1x32(shape, dtype, arch)
    if kind in ("32x1", "dual"):
        return plan_col((1, *shape), dtype, arch, 1, kind)
    if kind in ("3d", "3d_t"):
        return plan_col(tuple(shape), dtype, arch, scale_block_k, kind)
    raise ValueError(f"kind must be one of 1x32, 32x1, dual, 3d, 3d_t; got {kind!r}")


def _lane_split(lane, dists):
    """(column, piece) of a lane: piece = its bits at `dists` (first distance = top bit),
    column = its other bits, compressed."""
    piece = const(0)
    for d in dists:
        piece = bor(shl(piece, 1), lshr(band(lane, d), d.bit_length() - 1))
    col, pos = const(0), 0
    for bit in range(6):
        if (1 << bit) in dists:
            continue
        col = bor(col, shl(lshr(band(lane, 1 << bit), bit), pos))
        pos += 1
    return col, piece


def build_1x32(arch: str, dtype: str, mode: str, scale_layout=None, waves: int = MAX_WAVES, signed_zeros: bool = True):
    """An uncached @flyc.jit launcher of the 1x32 kernel for one specialization."""
    spec = Spec(arch, dtype, mode, signed_zeros)
    dists = DISTS[(arch, spec.elem_bytes)]
    pieces = spec.pieces_per_block  # lanes per block
    per_lane = BLOCKS_PER_LANE[dtype]
    regs_n = pieces * per_lane  # loads per lane and tile
    in_block = MX_BLOCK * spec.elem_bytes
    cols = LOAD_BYTES // in_block  # blocks per load instruction
    tile_blocks = WAVE * per_lane
    out_piece = spec.elems_per_piece  # output bytes per piece
    name = f"{kernel_prefix(spec, '1x32', scale_layout)}_w{waves}"
    source = SOURCE_TAG
    combine = functools.partial(mx.amax_max, spec)

    def group(k):
        """The 1 KiB group of the tile register k loads. A lane owns registers j + per_lane * g
        after the reduce-scatter; this order puts owned register j of g = 0..3 on groups
        4j..4j+3, so each code store covers 64 consecutive blocks."""
        return (k % per_lane) * (regs_n // per_lane) + k // per_lane

    def lane_amax(words, exact):
        """The per_lane block amaxes this lane owns after the reduce-scatter: one pattern, or two
        16-bit patterns packed (register j = 1 high)."""
        # last-loaded first: its wait covers the earlier loads (one s_waitcnt instead of 8)
        parts = [mx.chain_amax(spec, w, exact) for w in reversed(words)][::-1]
        red = mx.reduce_scatter(arch, dists, parts, combine)
        if per_lane == 2:
            return mx.halves_pair(red[0], red[1])
        return mx.amax_halves(spec, red[0])

    # FP16 on gfx950, two blocks per lane: the packed scale rule where every amax is a normal FP16
    # number, the exact one (and the NaN pass) in a wave holding a 0, subnormal, Inf or NaN amax
    packed_f16 = per_lane == 2 and spec.dtype == "fp16" and spec.scaled_cvt

    def scales(amax, normal):
        """(codes, conversion scales) of the owned blocks: per_lane 1: (code, FP32 scale);
        per_lane 2: (codes packed in halves, top_halves of the scales)."""
        if per_lane == 1:
            code, conv = mx.block_scale(spec, amax)
            return code, mx.as_i32(conv)
        return mx.pair_scales(spec, amax, normal)

    def finish(words, amax, t0, bufs, lane, layout_args, nan_pass):
        """Scales, codes and data of a tile whose owned-block amaxes are known."""
        rx, rq, rs = bufs
        lane_out, own = lane
        nblocks, blk_base, nkb, magic, shift, dims = layout_args
        codes, convs = scales(amax, packed_f16 and not nan_pass)
        s_offs = []
        for j in range(per_lane):
            if scale_layout is None:
                off, soff = add(own[j], t0), 0
            else:  # past the last block: an offset the range check drops
                g = add(t0, own[j])
                gg = add(g, blk_base)
                row = lshr(add(mx.umulhi(gg, magic), gg), shift)
                off = mx.scale_offset(scale_layout, row, sub(gg, mul(row, nkb)), dims)
                off, soff = mx.select(mx.cmp_ult(g, nblocks), off, mx.OOB), 0
            s_offs.append((off, soff))
            mx.store_byte(lshr(codes, 16 * j) if j else codes, rs, off, soff)
        gathered = mx.all_gather(arch, dists, convs)
        v_out = add(lane_out, mul(t0, MX_BLOCK))
        for k in range(regs_n):
            g, j = divmod(k, per_lane)
            conv = mx.as_f32(gathered[g]) if per_lane == 1 else mx.scale_from_tops(spec, gathered[g], j)
            outs = mx.convert_piece(spec, words[k], conv)
            data = outs[0] if len(outs) == 1 else mx.from_elements(outs)
            mx.store(data, rq, add(v_out, group(k) * cols * MX_BLOCK))
        if not nan_pass:
            return
        # Non-finite blocks: code 0xFF and every element 0x7F, over what was just stored.
        amaxes = [band(amax, 0xFFFF), lshr(amax, 16)] if per_lane == 2 else [amax]
        flags = const(0)
        for j, a in enumerate(amaxes):
            bad = cmp_uge(a, mx.NONFINITE[dtype])
            flags = bor(flags, mx.select(bad, 1 << j, 0))
            mx.if_then(bad, lambda off=s_offs[j]: mx.store_byte(mx.E8M0_NAN, rs, *off))
        gathered_flags = mx.all_gather(arch, dists, flags)
        nan = [const(mx.E4M3_NAN_X4)] * (out_piece // 4)
        for k in range(regs_n):
            g, j = divmod(k, per_lane)
            hit = mx.cmp_ne(band(gathered_flags[g], 1 << j), 0)
            data = nan[0] if len(nan) == 1 else mx.from_elements(nan)
            mx.if_then(hit, lambda data=data, k=k: mx.store(data, rq, add(v_out, group(k) * cols * MX_BLOCK)))

    def tile(t0, bufs, lane, layout_args):
        """One tile of tile_blocks blocks starting at block t0 (wave-uniform)."""
        rx = bufs[0]
        # Offsets: lane + tile in the VGPR, the load's 1 KiB step as the 12-bit immediate (it
        # reaches 4 KiB: loads 4.. start from a second VGPR 4 KiB on; not the scalar offset,
        # which the range check does not cover, so a tail tile would read past the input).
        v_in = add(lane[2], mul(t0, in_block))
        v_in4 = add(v_in, 4 * LOAD_BYTES)
        regs = [
            mx.load(rx, add(v_in if group(k) < 4 else v_in4, (group(k) % 4) * LOAD_BYTES))
            for k in range(regs_n)
        ]
        words = [mx.dwords_of(r) for r in regs]
        mx.wait_loads()
        amax = lane_amax(words, False)
        peak = mx.pair_max(amax) if per_lane == 2 else amax
        rare = mx.wave_any(mx.f16_unusual(amax) if packed_f16 else cmp_uge(peak, spec.suspicious))
        exact = (lambda: lane_amax(words, True)) if spec.needs_exact_redo else (lambda: amax)
        mx.if_else(
            rare,
            lambda: finish(words, exact(), t0, bufs, lane[:2], layout_args, True),
            lambda: finish(words, amax, t0, bufs, lane[:2], layout_args, False),
        )

    def body(x, q, s, nblocks, tiles_per_wave, blk_base, nkb, magic, shift, dims, scale_bytes):
        # (outside the @flyc.kernel function: plain Python, not rewritten into scf)
        mx.saturate_conversions(spec)
        tid = val(fx.Int32(fx.thread_idx.x))
        wave = mx.readfirstlane(lshr(tid, 6))
        lane = band(tid, WAVE - 1)
        col, piece = _lane_split(lane, dists)
        lane_in = add(mul(col, in_block), shl(piece, 4))
        lane_out = add(shl(col, 5), mul(piece, out_piece))
        # owned register j + per_lane * piece: group j * 4 + piece
        own = [add(mul(add(piece, j * (regs_n // per_lane)), cols), col) for j in range(per_lane)]
        nb = val(nblocks)
        rx = mx.buffer(x, const(0, mx.i64_t()), mul(to_i64(nb), in_block))
        rq = mx.buffer(q, const(0, mx.i64_t()), mul(to_i64(nb), MX_BLOCK))
        if scale_layout is None:
            rs = mx.buffer(s, const(0, mx.i64_t()), to_i64(nb))
        else:
            rs = mx.buffer(s, const(0, mx.i64_t()), to_i64(scale_bytes))
        wg_first = mul(val(fx.Int32(fx.block_idx.x)), mul(tiles_per_wave, waves))
        first = add(wg_first, mul(wave, tiles_per_wave))
        bufs, lane = (rx, rq, rs), (lane_out, own, lane_in)
        layout_args = (nb, blk_base, nkb, magic, shift, dims)
        mx.for_range(
            tiles_per_wave, lambda i: tile(mx.opaque_sgpr(mul(add(first, i), tile_blocks)), bufs, lane, layout_args)
        )

    @flyc.kernel(name=name, known_block_size=[WAVE * waves, 1, 1])
    def kernel(
        x: fx.Tensor,  # (M, K) BF16/FP16/FP32, row-major
        q: fx.Tensor,  # (M, K) uint8 view of the E4M3 data
        s: fx.Tensor,  # scales (uint8): (M, K/32) or the padded layout
        nblocks: fx.Int32,  # M * K / 32
        tiles_per_wave: fx.Int32,
        blk_base: fx.Int32,  # layouts: blocks before this launch's first (row chunks)
        nkb: fx.Int32,  # K / 32 (layouts only)
        magic: fx.Int32,  # floor(g / nkb) = (umulhi(g, magic) + g) >> shift
        shift: fx.Int32,
        dims: fx.Int32,  # layout: padded scale columns / 4 (tcgen05) or / 8 (mfma)
        scale_bytes: fx.Int32,  # layout: size of the scale tensor
    ):
        body(x, q, s, nblocks, tiles_per_wave, blk_base, nkb, magic, shift, dims, scale_bytes)

    @flyc.jit
    def launch(
        x: fx.Tensor,
        q: fx.Tensor,
        s: fx.Tensor,
        nblocks: fx.Int32,
        tiles_per_wave: fx.Int32,
        blk_base: fx.Int32,
        nkb: fx.Int32,
        magic: fx.Int32,
        shift: fx.Int32,
        dims: fx.Int32,
        scale_bytes: fx.Int32,
        workgroups: fx.Int32,
        stream: fx.Stream = fx.Stream(None),
    ):
        assert source and name  # closure values, so FlyDSL's disk cache keys on them (sources, variant)
        kernel(x, q, s, nblocks, tiles_per_wave, blk_base, nkb, magic, shift, dims, scale_bytes).launch(
            grid=(workgroups, 1, 1), block=(WAVE * waves, 1, 1), stream=stream
        )

    return launch


_cached_1x32 = toolchain.launcher_cache(build_1x32)


# ------------------------------------------------------------------------------------------------
# Torch-facing launchers
# ------------------------------------------------------------------------------------------------

# One launch addresses its tensors with 32-bit byte offsets (mx.MAX_LAUNCH_BYTES): larger
# tensors are quantized in row chunks, each launch on views (the layouts' tiles stay whole).
LAYOUT_ROW_ALIGN = 256  # rows per chunk boundary: a multiple of both layouts' row tiles


def _check_input(x: torch.Tensor, name: str, ndim: int, scaling_mode, scale_layout=None) -> None:
    validate.high_precision(x, name, ndim=ndim)
    validate.scaling_mode(scaling_mode)
    validate.scale_layout(scale_layout)
    validate.contiguous(x, name)


def quantize_1x32(x: torch.Tensor, *, arch: str, scaling_mode: str = "rceil", scale_layout=None, offs=None,
                  signed_zeros: bool = True):
    """MXFP8 1x32 quantize of a contiguous (M, K) BF16/FP16/FP32 tensor on `arch`.

    Returns (data (M, K) float8_e4m3fn row-major, scales float8_e8m0fnu: (M, K/32), or the
    padded "tcgen05"/"mfma" layout with zero padding), as flyquant.reference.mxfp8_quantize(x,
    -1, ...). `offs` (token-group ends along M, torchao's contract) is validated; with groups of
    multiples of 128 rows it changes nothing in this orientation. signed_zeros=False: zeros +0
    (validate.SIGNED_ZEROS_DOC)."""
    _check_input(x, "x", 2, scaling_mode, scale_layout)
    validate.block_dim(x, 1, "x", "K")
    m, k = x.shape
    if offs is not None:
        validate.offs(offs, x, m)
    nkb = k // MX_BLOCK
    data = torch.empty((m, k), dtype=torch.float8_e4m3fn, device=x.device)
    prows, pcols = mx.scale_layout_shape(m, nkb, scale_layout)
    scales = mx.scale_tensor((prows, pcols), (prows, pcols) != (m, nkb), x.device)
    dtype = TORCH_DTYPES[x.dtype]
    q, s = data.view(torch.uint8), scales
    rows_per_launch = mx.rows_per_launch(m, k * x.element_size(), LAYOUT_ROW_ALIGN if scale_layout else 1)
    magic, shift = mx.divide_magic(nkb)
    magic = mx.i32_bits(magic)
    dims = mx.layout_dims(scale_layout, pcols) if scale_layout else 0
    if m * nkb >= mx.MAX_LAUNCH_BYTES:
        raise ValueError(f"x has {m * nkb} blocks of 32; at most {mx.MAX_LAUNCH_BYTES - 1} are supported")
    if m == 0:  # an empty batch: empty data, the layout's (all padding) scales
        return data, scales.view(torch.float8_e8m0fnu)
    with toolchain.target(arch, x.device):
        for r0 in range(0, m, rows_per_launch):
            rows = min(rows_per_launch, m - r0)
            cfg = plan_1x32((rows, k), x.dtype, arch)
            launch = _cached_1x32(arch, dtype, scaling_mode, scale_layout, cfg.waves, signed_zeros)
            # plain scales: this chunk's rows; layouts: the whole tensor, rows counted from r0
            s_arg, blk_base = (s[r0 : r0 + rows], 0) if scale_layout is None else (s, r0 * nkb)
            launch(
                x[r0 : r0 + rows], q[r0 : r0 + rows], s_arg, rows * nkb, cfg.tiles_per_wave,
                blk_base, nkb, magic, shift, dims, s.numel(), cfg.workgroups, stream=toolchain.stream(x),
            )
    return data, scales.view(torch.float8_e8m0fnu)


def quantize_32x1(x: torch.Tensor, *, arch: str, scaling_mode: str = "rceil", scale_layout=None, offs=None,
                  signed_zeros: bool = True):
    """MXFP8 32x1 quantize of a contiguous (M, K) tensor (blocks of 32 along M) on `arch`, as
    flyquant.reference.mxfp8_quantize(x, 0, ...): data (M, K) float8_e4m3fn with stride (1, M);
    scales float8_e8m0fnu (K, M/32), or the "tcgen05" (flat) / "mfma" layout of that matrix,
    zero padded. `offs` (token-group ends along M): validated; with "tcgen05" the scales are
    blocked per group as torchao's grouped GEMM expects (torch_to_blocked_2d_K_groups).
    signed_zeros=False: zeros +0 (validate.SIGNED_ZEROS_DOC)."""
    _check_input(x, "x", 2, scaling_mode, scale_layout)
    validate.block_dim(x, 0, "x", "M")
    m, k = x.shape
    if offs is not None:
        validate.offs(offs, x, m)
    data = torch.empty_strided((m, k), (1, m), dtype=torch.float8_e4m3fn, device=x.device)
    nb = m // MX_BLOCK
    grouped = offs if (offs is not None and scale_layout == "tcgen05") else None
    if scale_layout is None:
        scales = torch.empty((k, nb), dtype=torch.uint8, device=x.device)
        dims = stride = 0
    else:
        prows, pcols = mx.scale_layout_shape(k, nb, scale_layout)
        shape = (prows * pcols,) if scale_layout == "tcgen05" else (prows, pcols)
        scales = mx.scale_tensor(shape, (prows, pcols) != (k, nb), x.device)
        dims, stride = mx.layout_dims(scale_layout, pcols), (prows if grouped is not None else 0)
    launch_col(x, data, scales, arch=arch, scaling_mode=scaling_mode, kind="32x1", scale_layout=scale_layout,
               offs=grouped, dims=dims, expert_bytes=stride, signed_zeros=signed_zeros)
    return data, scales.view(torch.float8_e8m0fnu)


def quantize_dual(x: torch.Tensor, *, arch: str, scaling_mode: str = "rceil"):
    """Both MXFP8 orientations of a contiguous (M, K) tensor from one read, on `arch`, as
    flyquant.reference.mxfp8_quantize_dual: ((data (M, K) row-major, scales (M, K/32)),
    (data (M, K) stride (1, M), scales (K, M/32))), plain scale layouts; M and K multiples of 32."""
    _check_input(x, "x", 2, scaling_mode)
    validate.block_dim(x, 1, "x", "K")
    validate.block_dim(x, 0, "x", "M")
    m, k = x.shape
    rows_data = torch.empty((m, k), dtype=torch.float8_e4m3fn, device=x.device)
    rows_scales = torch.empty((m, k // MX_BLOCK), dtype=torch.uint8, device=x.device)
    cols_data = torch.empty_strided((m, k), (1, m), dtype=torch.float8_e4m3fn, device=x.device)
    cols_scales = torch.empty((k, m // MX_BLOCK), dtype=torch.uint8, device=x.device)
    launch_col(x, cols_data, cols_scales, arch=arch, scaling_mode=scaling_mode, kind="dual", scale_layout=None,
               rows_out=(rows_data.view(torch.uint8), rows_scales))
    e8m0 = torch.float8_e8m0fnu
    return (rows_data, rows_scales.view(e8m0)), (cols_data, cols_scales.view(e8m0))
