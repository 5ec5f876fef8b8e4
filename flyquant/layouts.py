"""Scale and weight layouts: tcgen05 blocked scales (torchao parity), the AMD MFMA scale
shuffle (aiter's ``e8m0_shuffle``), aiter's gemm_a4w4 weight shuffle and its A16W4 MoE
weight/scale pre-shuffles, the aiter ones with their inverses. Pure index permutations on bytes; every function works on any device.

Vocabulary: a scale matrix is (rows, cols) = (non-reduced dim, reduced dim / 32), one E8M0 byte
per block of 32 elements along the reduced dim.
"""

from __future__ import annotations

import torch

from . import validate

# tcgen05 (NVIDIA cuBLAS / torchao to_blocked): the scale matrix is cut into 128x4 tiles, stored
# tile after tile (row of tiles major); inside a tile, row r = 32 * r_hi + r_lo is stored at
# r_lo * 16 + r_hi * 4 + col, i.e. the four 32-row quarters are interleaved.
TCGEN05_TILE_ROWS = 128
TCGEN05_TILE_COLS = 4
TCGEN05_QUARTER = 32

# MFMA scale shuffle (aiter e8m0_shuffle): rows padded to 256, cols to 8. Each 32x8 tile of the
# padded matrix becomes 256 contiguous bytes that 64 lanes read as one dword each: lane
# (c_lo * 16 + r_lo) gets rows {r_lo, r_lo + 16} x cols {c_lo, c_lo + 4}, stored in the order
# (col half, row half), so one 32-bit load gives a lane its 4 scales.
MFMA_ROW_PAD = 256
MFMA_COL_PAD = 8
MFMA_TILE_ROWS = 32
MFMA_ROW_HALF = 16
MFMA_TILE_COLS = 8
MFMA_COL_HALF = 4

# aiter A16W4 MoE layouts (aiter/ops/shuffle.py): a wave of 64 lanes covers NLANE rows of N by
# KLANE = 64 / NLANE lanes along K, each lane holding KPACK = 16 packed bytes (32 FP4 values).
WAVE = 64
A16W4_KPACK = 16
# Scales: 32 rows (2 packs of 16 lanes) by 8 columns (2 packs of 4 lanes) per 256-byte tile.
A16W4_SCALE_NLANE = 16
A16W4_SCALE_NPACK = 2
A16W4_SCALE_KLANE = 4
A16W4_SCALE_KPACK = 2
A16W4_SCALE_ROWS = A16W4_SCALE_NLANE * A16W4_SCALE_NPACK  # 32: N per scale tile
A16W4_SCALE_COLS = A16W4_SCALE_KLANE * A16W4_SCALE_KPACK  # 8 scales = 256 elements of K


def _ceil_to(n: int, m: int) -> int:
    return (n + m - 1) // m * m


def _zero_pad_2d(s: torch.Tensor, rows: int, cols: int) -> torch.Tensor:
    if tuple(s.shape) == (rows, cols):
        return s
    out = s.new_zeros((rows, cols))
    out[: s.shape[0], : s.shape[1]] = s
    return out


def _inverse(perm: tuple) -> tuple:
    inv = [0] * len(perm)
    for dst, src in enumerate(perm):
        inv[src] = dst
    return tuple(inv)


def _bytes(t: torch.Tensor) -> torch.Tensor:
    """A uint8 view of a one-byte tensor (E8M0, FP8, packed FP4), so permutes are plain copies."""
    return t.view(torch.uint8)


def join_codes(parts, stack: bool = True) -> torch.Tensor:
    """torch.stack (or, stack=False, torch.cat) of one-byte tensors of one dtype (E8M0, FP8), as
    uint8 views: under torch.autocast both ops promote their inputs' dtype, which fails for these
    ("Unexpected floating ScalarType in at::autocast::prioritize")."""
    joined = (torch.stack if stack else torch.cat)([_bytes(t) for t in parts])
    return joined.view(parts[0].dtype)


def _scale_matrix(s, name: str) -> None:
    """A 2D (rows, cols) matrix of E8M0 scales (or their bytes): a wider dtype's bytes were permuted
    as if each were a scale (bf16 (256, 4) came back as bf16 garbage), and a 1D or 3D tensor failed
    unpacking its shape, naming nothing."""
    validate.tensor(s, name, (torch.float8_e8m0fnu, torch.uint8), ndim=2)


def _permuted(t: torch.Tensor, split: tuple, perm: tuple, inverse: bool = False) -> torch.Tensor:
    """t's bytes viewed as `split` and permuted by `perm`, same shape and dtype as t; inverse: t
    holds the permuted order and is put back."""
    b = _bytes(t.contiguous())
    if inverse:
        b = b.view(tuple(split[p] for p in perm)).permute(_inverse(perm))
    else:
        b = b.view(split).permute(perm)
    return b.contiguous().view(t.shape).view(t.dtype)


def tcgen05_blocked(scales: torch.Tensor) -> torch.Tensor:
    """(rows, cols) scales -> the flat tcgen05 blocked layout (torchao to_blocked), zero-padded to
    (ceil(rows/128)*128, ceil(cols/4)*4) first. Returns a 1D tensor of the padded size."""
    _scale_matrix(scales, "scales")
    rows, cols = scales.shape
    prows, pcols = _ceil_to(rows, TCGEN05_TILE_ROWS), _ceil_to(cols, TCGEN05_TILE_COLS)
    padded = _zero_pad_2d(_bytes(scales), prows, pcols)
    tiles = padded.view(
        prows // TCGEN05_TILE_ROWS, TCGEN05_TILE_ROWS // TCGEN05_QUARTER, TCGEN05_QUARTER,
        pcols // TCGEN05_TILE_COLS, TCGEN05_TILE_COLS,
    )  # (row tile, r_hi, r_lo, col tile, col)
    out = tiles.permute(0, 3, 2, 1, 4).contiguous().flatten()  # (row tile, col tile, r_lo, r_hi, col)
    return out.view(scales.dtype)


def tcgen05_blocked_col_groups(scales: torch.Tensor, col_ends: torch.Tensor) -> torch.Tensor:
    """Per-group tcgen05 layout for groups along the scale columns (torchao
    torch_to_blocked_2d_K_groups): each column group [start, end) is blocked on its own and the
    groups follow each other. Every group width must be a multiple of 4 columns (so there is no
    per-group padding, and the result has the size of the un-grouped layout)."""
    starts = [0] + col_ends.tolist()[:-1]
    parts = []
    for start, end in zip(starts, col_ends.tolist()):
        if (end - start) % TCGEN05_TILE_COLS:
            raise ValueError(f"scale column group [{start}, {end}) must be a multiple of {TCGEN05_TILE_COLS} wide")
        if end > start:
            parts.append(tcgen05_blocked(scales[:, start:end]))
    return join_codes(parts, stack=False)


# (row tile, r_hi, r_lo, col tile, c_hi, c_lo) -> (row tile, col tile, c_lo, r_lo, c_hi, r_hi)
_MFMA_PERM = (0, 3, 5, 2, 4, 1)


def _mfma_split(prows: int, pcols: int) -> tuple:
    return (prows // MFMA_TILE_ROWS, MFMA_TILE_ROWS // MFMA_ROW_HALF, MFMA_ROW_HALF,
            pcols // MFMA_TILE_COLS, MFMA_TILE_COLS // MFMA_COL_HALF, MFMA_COL_HALF)


def mfma_scales_shape(rows: int, cols: int) -> tuple[int, int]:
    """The shape mfma_shuffle_scales gives (rows, cols) scales."""
    return _ceil_to(rows, MFMA_ROW_PAD), _ceil_to(cols, MFMA_COL_PAD)


def mfma_shuffle_scales(scales: torch.Tensor) -> torch.Tensor:
    """(rows, cols) scales -> aiter's e8m0_shuffle layout, shape (ceil(rows/256)*256,
    ceil(cols/8)*8); the padding is zero bytes (aiter leaves it uninitialised)."""
    _scale_matrix(scales, "scales")
    prows, pcols = mfma_scales_shape(*scales.shape)
    padded = _zero_pad_2d(_bytes(scales), prows, pcols)
    return _permuted(padded, _mfma_split(prows, pcols), _MFMA_PERM).view(scales.dtype)


def mfma_unshuffle_scales(shuffled: torch.Tensor) -> torch.Tensor:
    """Inverse of mfma_shuffle_scales, padding kept: e8m0_shuffle'd (rows, cols) scales (rows % 256
    == 0, cols % 8 == 0) -> the plain padded (rows, cols) matrix (slice it to the unpadded shape).
    Zero rows or columns (what mfma_shuffle_scales gives an empty matrix) give an empty matrix."""
    _scale_matrix(shuffled, "shuffled")
    prows, pcols = shuffled.shape
    validate.multiple_of(prows, MFMA_ROW_PAD, "shuffled.shape[0] (rows, padded for the MFMA scale layout)", zero=True)
    validate.multiple_of(pcols, MFMA_COL_PAD, "shuffled.shape[1] (cols, padded for the MFMA scale layout)", zero=True)
    return _permuted(shuffled, _mfma_split(prows, pcols), _MFMA_PERM, inverse=True)


# aiter's gemm_a4w4 B operand (shuffle_weight(x, layout=(16, 16)) on packed FP4 bytes): tiles of
# 16 rows x 32 bytes (64 FP4 values), each stored as (2 halves of 16 bytes along K, 16 rows, 16
# bytes): a 16-byte K unit of 16 consecutive rows is contiguous.
A4W4_ROWS = 16
A4W4_UNIT = 16  # bytes per lane: one MX block of 32 FP4 values
A4W4_UNITS = 2  # units per tile along K: 32 bytes = 64 elements


_A4W4_PERM = (0, 1, 3, 2, 4)  # (batch, M0, row, kb, byte) -> (batch, M0, kb, row, byte)


def _a4w4_split(x: torch.Tensor) -> tuple:
    validate.tensor(x, "x", (torch.uint8, torch.float4_e2m1fn_x2))
    if x.dim() < 2:
        raise ValueError(f"x must have at least 2 dimensions (M, K/2), got shape {tuple(x.shape)}")
    m, kp = x.shape[-2:]
    validate.multiple_of(m, A4W4_ROWS, "x.shape[-2] (M, for the a4w4 shuffle)")
    validate.multiple_of(kp, A4W4_UNIT * A4W4_UNITS, "x.shape[-1] (K/2 packed bytes, for the a4w4 shuffle)")
    return (-1, m // A4W4_ROWS, A4W4_ROWS, kp // A4W4_UNIT, A4W4_UNIT)


def shuffle_weight_a4w4(x: torch.Tensor) -> torch.Tensor:
    """aiter's shuffle_weight(x, layout=(16, 16)) on packed MXFP4 (..., M, K/2) uint8 or
    float4_e2m1fn_x2, byte for byte: same shape and dtype, the 16-byte unit (row r, kb) stored at
    unit ((r // 16) * (K/32) + kb) * 16 + r % 16 of its matrix (leading dims are separate
    matrices). Needs M % 16 == 0 and K % 64 == 0 (named in the error)."""
    return _permuted(x, _a4w4_split(x), _A4W4_PERM)


def unshuffle_weight_a4w4(x: torch.Tensor) -> torch.Tensor:
    """Inverse of shuffle_weight_a4w4 (same shape, dtype and constraints)."""
    return _permuted(x, _a4w4_split(x), _A4W4_PERM, inverse=True)


# ------------------------------------------------------------------------------------------------
# aiter A16W4 MoE weight and scale pre-shuffles
# ------------------------------------------------------------------------------------------------


def _a16w4_weight_dims(w: torch.Tensor, nlane: int, gate_up: bool, name: str):
    validate.tensor(w, name, (torch.uint8, torch.float4_e2m1fn_x2), ndim=3)
    nlane = validate.as_int(nlane)
    if not validate.is_int(nlane) or nlane <= 0 or WAVE % nlane:  # not 16.0 (view() fails) or True (1)
        raise ValueError(f"nlane must divide the wave size {WAVE} (an int), got {nlane!r}")
    validate.flag(gate_up, "gate_up")  # a truth test took "no" or 0.0 for a layout
    experts, n, k_packed = w.shape
    halves = 2 if gate_up else 1
    validate.multiple_of(n, halves * nlane, f"{name}.shape[1] (N{' = gate + up' if gate_up else ''}, rows per expert)")
    klane = WAVE // nlane
    validate.multiple_of(
        k_packed, klane * A16W4_KPACK,
        f"{name}.shape[2] (K/2 packed bytes; a wave reads {klane} lanes x {A16W4_KPACK} bytes along K)",
    )
    # (E, [gate/up,] N0, NLANE, K0, KLANE, KPACK)
    split = (experts,) + ((2,) if gate_up else ()) + (n // halves // nlane, nlane, k_packed // (klane * A16W4_KPACK), klane, A16W4_KPACK)
    return split


# Weight permutations: plain (E, N0, NLANE, K0, KLANE, KPACK) -> (E, N0, K0, KLANE, NLANE, KPACK);
# gate_up (E, 2, N0, NLANE, K0, KLANE, KPACK) -> (E, N0, 2, K0, KLANE, NLANE, KPACK).
_W_PERM = (0, 1, 3, 4, 2, 5)
_W_PERM_GATE_UP = (0, 2, 1, 4, 5, 3, 6)


def shuffle_weight_a16w4(w: torch.Tensor, nlane: int = 16, gate_up: bool = False) -> torch.Tensor:
    """aiter's shuffle_weight_a16w4, byte for byte: packed MXFP4 expert weights (E, N, K/2)
    (uint8 or float4_e2m1fn_x2) -> same shape and dtype, each NLANE x (64/NLANE * 16 bytes) tile
    stored lane-major so a wave reads it with one 16-byte load per lane. gate_up: N holds the gate
    then the up half; the two halves' tiles are interleaved per NLANE rows."""
    return _permuted(w, _a16w4_weight_dims(w, nlane, gate_up, "w"), _W_PERM_GATE_UP if gate_up else _W_PERM)


def unshuffle_weight_a16w4(w: torch.Tensor, nlane: int = 16, gate_up: bool = False) -> torch.Tensor:
    """Inverse of shuffle_weight_a16w4."""
    return _permuted(w, _a16w4_weight_dims(w, nlane, gate_up, "w"), _W_PERM_GATE_UP if gate_up else _W_PERM, inverse=True)


def _a16w4_scale_dims(s: torch.Tensor, experts: int, gate_up: bool):
    validate.tensor(s, "s", (torch.float8_e8m0fnu, torch.uint8), ndim=(2, 3))
    experts = validate.as_int(experts)
    if not validate.is_int(experts):  # 2.0 or True failed in view() naming no argument
        raise ValueError(f"experts must be an int, got {experts!r}")
    validate.flag(gate_up, "gate_up")
    if s.dim() == 3:
        if experts != s.shape[0]:
            raise ValueError(f"experts = {experts} must equal s.shape[0] = {s.shape[0]} for (E, N, K/32) scales")
        n, kb = s.shape[1], s.shape[2]
    else:
        if experts <= 0 or s.shape[0] % experts:
            raise ValueError(f"s.shape[0] (E*N) = {s.shape[0]} must be a multiple of experts = {experts}")
        n, kb = s.shape[0] // experts, s.shape[1]
    validate.multiple_of(n, A16W4_SCALE_ROWS, f"N (rows per expert{', gate + up' if gate_up else ''})")
    if kb <= 0 or kb % A16W4_SCALE_COLS:
        raise ValueError(
            f"K = 32 * s.shape[-1] = {32 * kb} must be a positive multiple of {32 * A16W4_SCALE_COLS} "
            f"(scales come in tiles of {A16W4_SCALE_COLS} per row)"
        )
    n1, k1 = n // A16W4_SCALE_ROWS, kb // A16W4_SCALE_COLS
    p, lane, kp, kl = A16W4_SCALE_NPACK, A16W4_SCALE_NLANE, A16W4_SCALE_KPACK, A16W4_SCALE_KLANE
    if gate_up:  # N = (gate/up half, N1, NLANE): the pack is the half
        return (experts, p, n1, lane, k1, kp, kl)
    return (experts, n1, p, lane, k1, kp, kl)


# Scale permutations to (E, N1, K1, KLANE, NLANE, KPACK, NPACK):
_S_PERM = (0, 1, 4, 6, 3, 5, 2)
_S_PERM_GATE_UP = (0, 2, 4, 6, 3, 5, 1)


def shuffle_scale_a16w4(s: torch.Tensor, experts: int, gate_up: bool = False) -> torch.Tensor:
    """aiter's shuffle_scale_a16w4, byte for byte: E8M0 scales (E*N, K/32) or (E, N, K/32) -> same
    shape and dtype; each 32 (N) x 8 (K/32) tile becomes 256 bytes, lane (k_lane * 16 + n_lane)
    holding rows {n_lane, n_lane + 16} x cols {k_lane, k_lane + 4} as one dword. Needs
    N % 32 == 0 and K % 256 == 0 (named in the error, unlike aiter's view failures)."""
    return _permuted(s, _a16w4_scale_dims(s, experts, gate_up), _S_PERM_GATE_UP if gate_up else _S_PERM)


def unshuffle_scale_a16w4(s: torch.Tensor, experts: int, gate_up: bool = False) -> torch.Tensor:
    """Inverse of shuffle_scale_a16w4."""
    return _permuted(s, _a16w4_scale_dims(s, experts, gate_up), _S_PERM_GATE_UP if gate_up else _S_PERM, inverse=True)


def gate_up_rows_from_interleaved(gate_up_proj: torch.Tensor, gate_up_bias: torch.Tensor | None = None,
                                  inter_pad: int | None = None):
    """GPT-OSS expert weights as transformers stores them -> the gate-then-up rows moe_gemm1_a16w4 takes.

    transformers' GptOssExperts keeps gate_up_proj as (E, hidden, 2 * inter) applied as
    x @ gate_up_proj, with the gate in the even output columns and the up projection in the odd
    ones (gate_up[..., ::2], gate_up[..., 1::2]); its bias (E, 2 * inter) interleaves the same way.
    Returns (w, bias): w (E, 2 * P, hidden) with rows [0, inter) the gate rows and [P, P + inter)
    the up rows (row j of each half = output column j), zero rows in between when P = inter_pad
    > inter (aiter's shuffles want P a multiple of 16 and the MXFP4 quantize K a multiple of 32);
    bias (E, 2 * P) in the same order, or None. Any float dtype; the result keeps it."""
    validate.tensor(gate_up_proj, "gate_up_proj", ndim=3)
    experts, hidden, two_inter = gate_up_proj.shape
    if two_inter % 2:
        raise ValueError(f"gate_up_proj.shape[2] = {two_inter} must be even (interleaved gate and up columns)")
    inter = two_inter // 2
    pad = inter if inter_pad is None else validate.as_int(inter_pad)
    if not validate.is_int(pad) or pad < inter:
        raise ValueError(f"inter_pad must be an int >= inter = {inter}, got {inter_pad!r}")
    w = gate_up_proj.new_zeros(experts, 2, pad, hidden)
    w[:, 0, :inter] = gate_up_proj[..., 0::2].transpose(1, 2)
    w[:, 1, :inter] = gate_up_proj[..., 1::2].transpose(1, 2)
    b = None
    if gate_up_bias is not None:
        validate.tensor(gate_up_bias, "gate_up_bias", ndim=2)
        if tuple(gate_up_bias.shape) != (experts, two_inter):
            raise ValueError(f"gate_up_bias must have shape (E, 2 * inter) = {(experts, two_inter)}, got {tuple(gate_up_bias.shape)}")
        b = gate_up_bias.new_zeros(experts, 2, pad)
        b[:, 0, :inter] = gate_up_bias[:, 0::2]
        b[:, 1, :inter] = gate_up_bias[:, 1::2]
        b = b.view(experts, 2 * pad)
    return w.view(experts, 2 * pad, hidden), b
