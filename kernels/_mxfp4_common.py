"""Shared pieces of the MXFP4 quantize kernels (kernels/mxfp4_quantize.py rowwise,
kernels/mxfp4_quantize_cols.py columnwise, kernels/mxfp4_quantize_dual.py): the E8M0 code of a
block and the E2M1 conversion of its elements, by pieces of 8 (or 4 FP32) elements, one output
dword (2 bytes) each (convert_pieces: a whole block in one lane, or a block over lanes, each
with the block's piece_operand), emitted into FlyDSL kernels.

Math (flyquant.reference.mxfp4_quantize, bit-exact): per block of 32 elements, amax = max |x|
(FP32), the E8M0 code c of the floor / rceil / even rule on amax's FP32 bits
(_mx_common.f32_scale_code with E2M1's constants: 6 = 1.5 * 2^2), elements
e2m1(x * 2^(127 - c)), nearest even, saturating at +-6; a block holding NaN or Inf gets code
0xFF and every element E2M1_NAN_BLOCK_CODE (0x7), padding elements of a partial block 0.

rceil on bits: the contract's e8m0_rceil(amax * fl32(1/6)) equals max(eb - 2 + [j > 0x400000],
0) for every FP32 amax (eb, j: exponent and mantissa fields) except amax = 0x01400001, whose
subnormal descale rounds down to 2^-127 (code 0): checked exhaustively per binade in
tests/test_mxfp4_kernels.py. No FP32 arithmetic is involved, so the FP32 denormal mode does not
matter.

Elements. gfx950: v_cvt_scalef32_pk_fp4_{bf16,f16,f32} convert two elements to E2M1 as
x / 2^(s - 127), s the exponent field of the scale operand (CDNA4 ISA, "VOP3 instructions":
V_CVT_SCALEF32_PK_FP4_BF16 and siblings), writing one byte of the destination: 16 conversions
per block. They round to nearest even and saturate (overflow and Inf give +-6), the contract's
clamp; NaN input gives +-6, so the kernels patch NaN/Inf blocks (code 0xFF, nibbles 0x7) in a
rare branch taken when any lane of the wave holds one.
gfx942 has no FP4 conversion. BF16/FP16 (sw16_pieces, two elements per packed 16-bit
instruction): the code of |y| (y = x * 2^(127 - c)) is round-half-even of the piecewise-linear
v(y) = min(2y, y + 2, y/2 + 4) (E2M1's grid: step 0.5 below 2, 1 below 4, 2 above; every tie
of E2M1 sits at a half-integer of v and the even code is the even mantissa). Y = 2|y| * 2^-12 is
an FP16 value: BF16 re-biased by integer ops (sat(|x| - ((c - 4) << 7)) << 3: exact for Y >=
2^-14, and everything below is code 0), FP16 multiplied by 2^(116 - c). Then
min(fma(Y, 2^12, 1024), fma(Y, 2^11, 1026), fma(Y, 2^10, 1028)) (floor: and 1031, the
saturation at 6) rounds each term once to FP16's integer grid at 1024 (min of roundings = rounding
of the min), so its low byte is the code. v_perm_b32 gathers the code bytes and the signs (its
sign-replicating selectors read bits 15 and 31, the 16-bit inputs' sign bits: -0 -> 0x8) and
one shift-add packs eight nibbles. Exact for every input pattern where the scale fits (BF16: c >=
4; FP16: c <= 140, zero blocks taken as c = 101): checked exhaustively in
tests/test_mxfp4_kernels.py; other blocks (amax below 2^-122 or, FP16, above 49152) take the FP32
encoder in a rare wave-uniform branch.
FP32 (sw32_piece; also the fallback above): y = x * 2^(127 - c) in FP32 (exact: c <= 253 keeps the multiplier
normal, and a y that underflows is below 0.25 either way), then from a = |y| bits clamped to
6.0: for a < 2 the code is round(2a) by the FP32 adder (a + 2^22 has a 0.5 grid, nearest even:
0.25 -> 0, 0.75 -> 1.0, 1.75 -> 2.0 as E2M1's ties), for a >= 1 it is the FP32 bits rounded to
one mantissa bit, nearest even ((a + 0x1FFFFF + bit 22) >> 22) minus the exponent rebias (252).
The sign is bit 31 of x (-0 -> 0x8, as the reference).
"""

from __future__ import annotations

import functools

import numpy as np
import torch
import flydsl.expr as fx
from flydsl._mlir import ir
from flydsl._mlir.dialects import arith, llvm, rocdl, vector

from flyquant.formats import E2M1_MANT_BITS, E2M1_MAX_POW2, E2M1_NAN_BLOCK_CODE

from . import _mx_common as mx
from ._mx_common import MX_BLOCK, Spec, add, band, bor, const, lshr, shl, sub

TORCH_DTYPES = {torch.bfloat16: "bf16", torch.float16: "fp16", torch.float32: "fp32"}
OUT_BLOCK_BYTES = MX_BLOCK // 2  # 32 nibbles
E2M1_RCEIL_MANT = 0x400000  # mantissa field of 1.5: 6 = 1.5 * 2^2
E2M1_RCEIL_TIE = 0x01400001  # the FP32 amax whose rceil descale rounds down to 2^-127 (module doc)
E2M1_NAN_X8 = E2M1_NAN_BLOCK_CODE * 0x11111111  # eight NaN-block nibbles
# gfx942 software encoder constants (module docstring)
F32_SIX = 0x40C00000  # 6.0: saturation
F32_TWO = 0x40000000  # below 2.0 the adder path is exact
HALF_GRID = 4194304.0  # 2^22: FP32 values there are spaced 0.5
HALF_GRID_BITS = 0x4A800000
ROUND_BELOW_BIT22 = (1 << 21) - 1  # round to one mantissa bit: + 0x1FFFFF + bit 22, >> 22
E2M1_REBIAS = (127 - 1) << E2M1_MANT_BITS  # FP32 (exponent, 1 mantissa bit) -> E2M1 code
F32_MULT_FIELD = 254  # 2^(127 - c) has exponent field 254 - c
# gfx942 16-bit encoder (module docstring): Y = 2|y| * 2^-Y_SHIFT in FP16
Y_SHIFT = 12
F16_GRID = 0x6400  # 1024.0: FP16 values in [1024, 2048) are the integers
V_TERMS = ((1 << Y_SHIFT, 1024.0), (1 << (Y_SHIFT - 1), 1026.0), (1 << (Y_SHIFT - 2), 1028.0))  # 2y, y + 2, y/2 + 4
F16_SAT = 1031.0  # floor: code 7 (6.0) at most
BF16_MIN_CODE = 16 - Y_SHIFT  # BF16: the re-bias (c - 4) << 7 is a saturating subtraction from c >= 4
F16_MULT_POW = 128 - Y_SHIFT  # FP16: Y = |x| * 2^(116 - c)
F16_CODES = (101, 140)  # FP16: 2^(116 - c) is an FP16 number (2^15 .. 2^-24, subnormal from c = 131); nonzero FP16 blocks have c >= 101
BF16_TO_F16_MANT = 3  # 10 - 7 mantissa bits
BYTES_02 = 0x06040200  # v_perm_b32: bytes 0 and 2 of lo, then of hi
BYTES_13 = 0x07050301
SIGNS_4 = 0x0B0A0908  # v_perm_b32: bits 15, 31 of lo, 15, 31 of hi, each replicated to a byte
NIBBLE_SIGNS = 0x08080808

def scale_code(spec: Spec, amax):
    """E8M0 code of a block from its amax pattern (module docstring)."""
    tie = E2M1_RCEIL_TIE if spec.dtype == "fp32" else None
    return mx.f32_scale_code(mx.amax_f32_bits(spec, amax), spec.mode, E2M1_MAX_POW2, E2M1_RCEIL_MANT, tie,
                             E2M1_MANT_BITS)


def scale_pair(spec: Spec, pair, normal: bool = False):
    """gfx950, 16-bit x: (codes c1 << 16 | c0, top_halves of the two conversion scales) of two
    blocks whose amax patterns share a dword (BF16, and FP16 with `normal`, both patterns normal
    FP16 numbers: packed, _mx_common.packed_scale_pair)."""
    if spec.dtype == "bf16" or normal:
        return mx.packed_scale_pair(spec, pair, E2M1_MAX_POW2, E2M1_RCEIL_MANT, E2M1_MANT_BITS)
    lo, hi = (scale_code(spec, h) for h in (band(pair, 0xFFFF), lshr(pair, 16)))
    return mx.pack_pair(hi, lo), mx.top_halves(piece_operand(spec, hi), piece_operand(spec, lo))


def hw_pieces(spec: Spec, groups, scales):
    """gfx950: pieces of 8 elements (4 dwords of 16-bit pairs, or 8 FP32; or 16-byte pieces of 4
    FP32, 2 bytes), each with its scale (the code in an FP32 exponent field) -> a dword of
    nibbles each with the scaled FP4 conversions. 16-bit: emitted across the pieces step by step
    (no hazard wait between two writes of one destination); FP32 piece by piece (fewer
    instructions in the columnwise kernel, measured)."""
    per = len(groups[0]) // 2 if spec.wide else len(groups[0])
    count = range(len(groups))
    order = [(i, b) for i in count for b in range(per)] if spec.wide else [(i, b) for b in range(per) for i in count]
    accs = [mx.poison(mx.i32_t())] * len(groups)
    for i, b in order:
        words, scale = groups[i], scales[i]
        if spec.wide:
            a, c = words[2 * b], words[2 * b + 1]
            accs[i] = rocdl.cvt_scalef32_pk_fp4_f32(mx.i32_t(), accs[i], mx.as_f32(a), mx.as_f32(c), scale, b)
        else:
            op = rocdl.cvt_scalef32_pk_fp4_bf16 if spec.dtype == "bf16" else rocdl.cvt_scalef32_pk_fp4_f16
            src = mx.bitcast(mx.v2bf16_t() if spec.dtype == "bf16" else mx.v2f16_t(), words[b])
            accs[i] = op(mx.i32_t(), accs[i], src, scale, b)
    return accs


def pieces(spec: Spec, words):
    """A block's dwords split into its 4 pieces of 8 elements (one output dword each)."""
    n = len(words) // 4
    return [words[n * j:n * j + n] for j in range(4)]


def hw_convert(spec: Spec, words, code, amax=None):
    """gfx950: 32 elements -> 4 dwords of nibbles (amax unused: sw_convert's signature)."""
    return convert_pieces(spec, pieces(spec, words), [piece_operand(spec, code)] * 4)


def f32_elements(spec: Spec, words):
    """The 32 elements as FP32 bit patterns (16-bit types widened exactly)."""
    if spec.wide:
        return list(words)
    out = []
    for d in words:
        if spec.dtype == "bf16":
            out += [shl(d, 16), band(d, 0xFFFF0000)]
        else:
            halves = mx.bitcast(mx.v2f16_t(), d)
            out += [mx.as_i32(arith.extf(mx.f32_t(), mx.extract(halves, h))) for h in range(2)]
    return out


def sw_nibble(y, x):
    """gfx942 FP32: the E2M1 code of the scaled value y (FP32 bits) with the sign of x (bits)."""
    a = mx.umin(band(y, 0x7FFFFFFF), F32_SIX)
    grid = arith.addf(mx.as_f32(a), arith.constant(mx.f32_t(), HALF_GRID))
    small = sub(mx.as_i32(grid), HALF_GRID_BITS)
    big = sub(lshr(add(add(a, ROUND_BELOW_BIT22), band(lshr(a, 22), 1)), 22), E2M1_REBIAS)
    code = mx.select(mx.cmp_ult(a, F32_TWO), small, big)
    return bor(code, band(lshr(x, 28), 8))


def sw32_mult(code):
    return mx.as_f32(shl(sub(F32_MULT_FIELD, code), mx.F32_MANT_BITS))


def sw32_piece(spec: Spec, words, mult):
    """gfx942: 8 elements -> a dword of nibbles through FP32 (module docstring; any dtype);
    `mult`: sw32_mult(code)."""
    xs = f32_elements(spec, words)
    pair_t = ir.VectorType.get([2], mx.f32_t())
    acc = None
    for i in range(0, len(xs), 2):  # v_pk_mul_f32
        v = vector.from_elements(pair_t, [mx.as_f32(xs[i]), mx.as_f32(xs[i + 1])])
        p = arith.mulf(v, vector.broadcast(pair_t, mult))
        for h in range(2):
            nib = sw_nibble(mx.as_i32(mx.extract(p, h)), xs[i + h])
            acc = nib if acc is None else bor(acc, shl(nib, 4 * (i + h)))
    return acc


def _f16(x):
    return mx.bitcast(mx.v2f16_t(), x)


def _f16_const(v: float):
    return _f16(const(mx.splat16(int(np.float16(v).view(np.uint16)))))


def _code_pairs(spec: Spec, pairs, scales, floor: bool):
    """Dwords of two 16-bit elements -> dwords whose bytes 0 and 2 are the codes of |x| (module
    docstring); `scales`: per dword the re-bias (BF16) or the FP16 multiplier, both halves.
    Emitted step by step across the dwords, a scheduling barrier after each step: LLVM otherwise
    runs one dword's chain alone, an s_nop between its dependent packed ops (gfx942)."""
    steps = [lambda a, sc: band(a, 0x7FFF7FFF)]
    if spec.dtype == "bf16":
        steps += [lambda a, sc: mx.pk(llvm.intr_usub_sat, a, sc),
                  lambda a, sc: _f16(mx.pk(arith.shli, a, mx.splat16(BF16_TO_F16_MANT)))]
    else:
        steps += [lambda a, sc: arith.mulf(_f16(a), _f16(sc))]
    vals = list(pairs)
    for step in steps:
        vals = [step(a, sc) for a, sc in zip(vals, scales)]
        fx.rocdl.sched_barrier(0)
    ys, v = vals, [None] * len(vals)
    for k, c in V_TERMS:
        ts = [llvm.intr_fma(y, _f16_const(k), _f16_const(c)) for y in ys]
        v = [t if u is None else arith.minnumf(u, t) for u, t in zip(v, ts)]
        fx.rocdl.sched_barrier(0)
    if floor:
        v = [arith.minnumf(u, _f16_const(F16_SAT)) for u in v]
    return [mx.bitcast(mx.i32_t(), u) for u in v]


def sw16_scale(spec: Spec, code):
    """The per-block operand of the 16-bit encoder, both halves: BF16 the re-bias (c - 4) << 7,
    FP16 the multiplier 2^(116 - c) (module docstring)."""
    if spec.dtype == "bf16":
        half = shl(mx.usub_sat(code, BF16_MIN_CODE), 7)
    else:
        # 2^(116 - c) in FP32, converted exactly to FP16 (subnormal from c = 131 on)
        mult = mx.as_f32(shl(sub(127 + F16_MULT_POW, mx.umax(code, F16_CODES[0])), mx.F32_MANT_BITS))
        half = arith.extui(mx.i32_t(), arith.bitcast(ir.IntegerType.get_signless(16), arith.truncf(ir.F16Type.get(), mult)))
    return bor(shl(half, 16), half)


def sw16_pieces(spec: Spec, groups, scales):
    """gfx942 BF16/FP16: pieces of 8 elements (4 dwords of pairs each, with their sw16_scale) ->
    a dword of nibbles each (module docstring). All codes first (every dword's step by step,
    _code_pairs), then the packing: interleaving independent chains keeps the dependent packed
    ops apart (no hazard s_nops)."""
    flat = _code_pairs(spec, [w for p in groups for w in p], [sc for p, sc in zip(groups, scales) for _ in p],
                       spec.mode == "floor")
    ms = [flat[4 * i:4 * i + 4] for i in range(len(groups))]
    out = []
    for p, m in zip(groups, ms):
        # elements 0-3 and 4-7 as code bytes with their signs
        q = [bor(band(mx.perm(p[i + 1], p[i], SIGNS_4), NIBBLE_SIGNS), mx.perm(m[i + 1], m[i], BYTES_02)) for i in (0, 2)]
        even, odd = mx.perm(q[1], q[0], BYTES_02), mx.perm(q[1], q[0], BYTES_13)
        out.append(add(shl(odd, 4), even))  # disjoint bits: one v_lshl_add_u32
    return out


def sw_outside16(spec: Spec, code, amax):
    """i1: a block the 16-bit encoder does not cover (module docstring: BF16 c < 4 and not a zero
    block; FP16 c > 140)."""
    if spec.dtype == "bf16":
        return arith.andi(mx.cmp_ult(code, BF16_MIN_CODE), mx.cmp_ne(amax, 0))
    return mx.cmp_ult(F16_CODES[1], code)


def piece_operand(spec: Spec, code):
    """What convert_pieces needs of a block's code: gfx950 the FP32 scale bits, gfx942 16-bit
    the encoder's sw16_scale, FP32 input the code (computed once per block, before lanes share it)."""
    if spec.scaled_cvt:
        return shl(code, mx.F32_MANT_BITS)
    return code if spec.wide else sw16_scale(spec, code)


def convert_pieces(spec: Spec, groups, operands, rare=None, codes=None):
    """Pieces of 8 elements (4 dwords of 16-bit pairs, or 8 FP32), each with its block's
    piece_operand -> a dword of nibbles each: gfx950's scaled conversions; gfx942's packed 16-bit
    encoder, or the FP32 one for FP32 input or when `rare` (wave-uniform i1: a block outside the
    16-bit range; `codes()` then gives the pieces' codes)."""
    if spec.scaled_cvt:
        return hw_pieces(spec, groups, [mx.as_f32(op) for op in operands])
    if spec.wide:
        return sw32_pieces(spec, groups, operands)
    return mx.if_else(rare, lambda: sw32_pieces(spec, groups, codes()), lambda: sw16_pieces(spec, groups, operands),
                      types=[mx.i32_t()] * len(groups))


def sw32_pieces(spec: Spec, groups, codes):
    """gfx942: pieces of 8 elements (or 4 FP32), each with its block's code -> a dword of nibbles
    each through FP32 (sw32_piece)."""
    return [sw32_piece(spec, w, sw32_mult(c)) for w, c in zip(groups, codes)]


def sw_convert(spec: Spec, words, code, amax):
    """gfx942: 32 elements -> 4 dwords of nibbles in software (convert_pieces)."""
    rare = None if spec.wide else mx.wave_any(sw_outside16(spec, code, amax))
    return convert_pieces(spec, pieces(spec, words), [piece_operand(spec, code)] * 4, rare, lambda: [code] * 4)


def nan_words(valid):
    """Data of a NaN/Inf block: nibble 0x7 for the elements present, 0 for the padding."""
    out = []
    for j in range(4):
        n = mx.umin(mx.usub_sat(valid, 8 * j), 8)  # elements present in this dword's 8
        part = sub(shl(1, shl(n, 2)), 1)  # 4n low bits (n < 8)
        out.append(band(E2M1_NAN_X8, mx.select(mx.cmp_uge(n, 8), -1, part)))
    return out


def quantize_words(spec: Spec, words, valid):
    """One block of 32 elements held as dwords in row order (16 of 16-bit pairs, element 2i in the
    low half, or 32 FP32; missing elements already 0; `valid`: how many are present, >= 32 for a
    whole block) -> its 4 data dwords and its code (5 i32): amax by two interleaved chains, the
    exact redo for BF16 read as FP16, the code, the conversion, NaN/Inf blocks patched in a rare
    wave-uniform branch."""
    amax = mx.amax_halves(spec, mx.amax_max(spec, *mx.chain_amax_interleaved(spec, [words[0::2], words[1::2]])))
    if spec.needs_exact_redo:  # BF16 read as FP16 (gfx950): blocks from 2^121 up redo it exactly
        exact = lambda: [mx.amax_halves(spec, mx.chain_amax(spec, words, exact=True))]  # noqa: E731
        amax = mx.if_else(mx.wave_any(mx.cmp_uge(amax, spec.suspicious)), exact, lambda: [amax],
                          types=[mx.i32_t()])[0]
    code = scale_code(spec, amax)
    data = (hw_convert if spec.scaled_cvt else sw_convert)(spec, words, code, amax)
    bad = mx.cmp_uge(amax, mx.NONFINITE[spec.dtype])
    return mx.if_else(
        mx.wave_any(bad),
        lambda: [mx.select(bad, n, d) for n, d in zip(nan_words(valid), data)] + [mx.select(bad, mx.E8M0_NAN, code)],
        lambda: data + [code],
        types=[mx.i32_t()] * 5,
    )


def tail_masks(spec: Spec, valid):
    """Per input dword, the bits of the elements below `valid` (the elements present from the
    first dword's: a block's or a piece's)."""
    per = 4 // spec.elem_bytes
    masks = []
    for i in range(MX_BLOCK // per):
        if per == 1:
            masks.append(mx.select(mx.cmp_ult(i, valid), -1, 0))
        else:
            masks.append(mx.select(mx.cmp_ult(2 * i + 1, valid), -1, mx.select(mx.cmp_ult(2 * i, valid), 0xFFFF, 0)))
    return masks


def last_elements(groups, gs, valids, rx, sizes):
    """16-bit types, a last block with an odd element count: the tensor's last element is the low
    half of a loaded dword whose high half lies past the buffer's end, and the range check, which
    checks whole dwords, reads that dword as 0. The lane holding it takes the element from a
    2-byte load instead (a wave-uniform branch, taken by one wave of the launch). groups: lists
    of dwords (a block, or a piece), each of block gs[i] with valids[i] elements from its first."""
    nblocks, x_bytes = sizes
    hits = [arith.andi(mx.cmp_eq(band(v, 1), 1), mx.cmp_eq(g, sub(nblocks, 1))) for g, v in zip(gs, valids)]
    flat = [w for words in groups for w in words]

    def patched():
        value = mx.load_short(rx, sub(x_bytes, 2))
        out = []
        for words, hit, v in zip(groups, hits, valids):
            last = lshr(sub(v, 1), 1)  # the word holding it, in its low half
            out += [mx.select(arith.andi(hit, mx.cmp_eq(last, i)), value, w) for i, w in enumerate(words)]
        return out

    any_hit = functools.reduce(arith.ori, hits)
    flat = mx.if_else(mx.wave_any(any_hit), patched, lambda: flat, types=[mx.i32_t()] * len(flat))
    n = len(groups[0])
    return [flat[n * i:n * i + n] for i in range(len(groups))]


def last_element(words, g, valid, bufs, sizes):
    """last_elements for one block's dwords (a lane per block: the dual kernel)."""
    return last_elements([words], [g], [valid], bufs[0], sizes)[0]


def allocate(rows: int, blocks: int, device) -> tuple[torch.Tensor, torch.Tensor]:
    """Uninitialised (data (rows, blocks * 16), codes (rows, blocks)) uint8 outputs: the kernels
    write every byte."""
    return (torch.empty((rows, blocks * OUT_BLOCK_BYTES), dtype=torch.uint8, device=device),
            torch.empty((rows, blocks), dtype=torch.uint8, device=device))
