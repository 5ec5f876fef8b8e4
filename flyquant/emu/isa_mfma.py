"""Matrix instructions (MFMA) and the accumulation registers (AGPRs).

A single-block v_mfma_<out>_<M>x<N>x<K>_<in> computes D = A (M x K) * B (K x N) + C (M x N) for
the whole wave. Register layout (CDNA3/CDNA4 ISA guides, "Matrix fused-multiply-add"):
- A: lane l holds E = M*K/64 consecutive K elements of row l % M, starting at k = E * (l // M),
  packed little-endian in its source registers; B likewise with column l % N. Except gfx950's
  f8f6f4 MFMAs with 8-bit formats: each half of a lane's 8 registers holds 16 consecutive k of
  its row's half of K, k = (j // 16) K / 2 + 16 (l // M) + j % 16 for element j
  (composable_kernel's test/mx_mfma_op register maps, run on MI355X); FP4 keeps the rule above.
- C/D, 16x16 (4 registers): register r of lane l is element (4 * (l // 16) + r, l % 16);
  32x32 (16 registers): register r of lane l is element (8 * (r // 4) + 4 * (l // 32) + r % 4, l % 32).
MFMAs ignore EXEC. Products of the narrow inputs are exact in binary64; the K products and C are
summed in binary64 and rounded once to f32. The hardware's internal accumulation order and
precision are not documented, so floating-point results can differ from an MI300X/MI355X in the
last bits (integer MFMAs are exact).

gfx950's v_mfma_f32_{16x16x128,32x32x64}_f8f6f4 take the A/B formats from CBSZ/BLGP
(0 fp8, 1 bf8, 4 fp4; fp6 formats are not modelled). Block-broadcast modifiers (CBSZ/ABID/BLGP on
the other MFMAs) and the multi-block MFMAs are rejected.

gfx950's scaled forms v_mfma_scale_f32_{16x16x128,32x32x64}_f8f6f4 (AMD Instinct CDNA4 ISA
reference guide, chapter "Matrix Arithmetic Instructions": V_MFMA_LD_SCALE_B32 and the scaled MFMA
as one VOP3PX2 instruction) are the same product with every 32-element K block of every A row and
B column multiplied by 2^(s - 127), s an E8M0 code (0xFF: NaN). Block b of row or
column r (k = 32 b .. 32 b + 31) takes its scale byte from lane b M + r's scale VGPR (scale_src0
for A, scale_src1 for B), wherever its elements sit (FP4: that lane; FP8: lanes of two groups):
byte op_sel[0] + 2 op_sel_hi[0] of scale_src0 for A, op_sel[1] + 2 op_sel_hi[1] of scale_src1 for B,
the ld_scale word's modifiers (this is how LLVM encodes the intrinsic's opsel_a/opsel_b = byte
0..3: tests llvm.amdgcn.mfma.scale.*.ll, MC/AMDGPU/mai-gfx950.s). The scaled elements are exact in
binary64, so the product stays one exact sum rounded once. SGPR and constant scale operands are
refused: the hardware reads bits 30:23 of those instead of a byte (LLVM allows only VGPRs there
for that reason, llvm-project PR 158117).
"""

from __future__ import annotations

import re

import numpy as np

from . import decode as D
from . import table
from .isa_base import AGPR_BASE, F16, F32, F64, I32, LANES, U8, U16, U32, vsrc, vwriter
from .isa_cvt import E2M1, bf16_bits_to_f32, e8m0_pow2, fp8_formats

_MFMA_RE = re.compile(r"v_mfma_(?:scale_)?(f32|i32|f64)_(\d+)x(\d+)x(\d+)_(\w+)$")
SCALE_BLOCK = 32  # K elements per E8M0 scale of the scaled MFMAs
# element bits of the input types
_IN_BITS = {"bf16": 16, "f16": 16, "f32": 32, "i8": 8, "fp8_fp8": 8, "fp8_bf8": 8, "bf8_fp8": 8,
            "bf8_bf8": 8, "f8f6f4": None}
F8F6F4_FORMATS = {0: ("fp8", 8), 1: ("bf8", 8), 4: ("fp4", 4)}


_TABLES: dict = {}


def element_table(ctx, kind: str) -> np.ndarray:
    """Value (float64, or int64 for i8) of every code of an input element kind, indexed by the
    code's bits: the exact conversions of the ISA (bf16/f16/f32 widen exactly; fp8/bf8 per arch)."""
    key = (kind, ctx.arch if kind in ("fp8", "bf8") else None)
    table = _TABLES.get(key)
    if table is None:
        with np.errstate(invalid="ignore"):  # signalling NaN codes widen to NaN, as in execution
            table = _element_values(ctx, kind)
        table.flags.writeable = False
        _TABLES[key] = table
    return table


def _element_values(ctx, kind: str) -> np.ndarray:
    codes = np.arange(1 << 16 if kind in ("bf16", "f16") else 256, dtype=U32)
    if kind == "bf16":
        return bf16_bits_to_f32(codes).astype(F64)
    if kind == "f16":
        return codes.astype(U16).view(F16).astype(F64)
    if kind == "i8":
        return codes.astype(U8).view(np.int8).astype(np.int64)
    if kind in ("fp8", "bf8"):
        return fp8_formats(ctx.arch)[kind == "bf8"].table.astype(F64)
    if kind == "fp4":
        return E2M1.table.astype(F64)
    raise ValueError(kind)


def _operand_matrix(vals: np.ndarray, rows: int) -> np.ndarray:
    """(rows, K) matrix from per-lane elements (64, E): lane l = g*rows + i holds k = g*E + j."""
    groups = LANES // rows
    e = vals.shape[1]
    return vals.reshape(groups, rows, e).transpose(1, 0, 2).reshape(rows, groups * e)


def _acc_to_matrix(regs: np.ndarray, m: int) -> np.ndarray:
    """(m, m) accumulator matrix from its (nregs, 64) register rows."""
    if m == 16:
        return regs.reshape(4, 4, 16).transpose(1, 0, 2).reshape(16, 16)
    return regs.reshape(4, 4, 2, 32).transpose(0, 2, 1, 3).reshape(32, 32)


def operand_indices(first_row: int, elems: int, bits: int, rows: int, halves: bool = False) -> np.ndarray:
    """(rows, K) positions of the A (or B) matrix elements in the register file viewed as one
    flat array of `bits`-wide elements (bits 4: nibble positions, low nibble first): lane l
    holds its `elems` elements packed little-endian in registers first_row, first_row + 1, ...
    `halves` (the f8f6f4 MFMAs' 8-bit formats): each half of a lane's registers holds 16
    consecutive k of its row's half of K: element j of lane group g is k = (j // 16) K / 2 +
    16 g + j % 16 (FP4 stays one run of 32)."""
    per_reg = 32 // bits
    j = np.arange(elems)
    lane = np.arange(LANES)[:, None]
    pos = _operand_matrix(((first_row + j // per_reg) * LANES + lane) * per_reg + j % per_reg, rows)
    if not halves:
        return pos
    groups = LANES // rows
    g, j = np.divmod(np.arange(groups * elems), elems)
    out = np.empty_like(pos)
    out[:, (j // 16) * (groups * elems // 2) + 16 * g + j % 16] = pos
    return out


def accumulator_indices(first_row: int, m: int) -> np.ndarray:
    """(m, m) positions of the C/D matrix elements in the flat 32-bit register file."""
    regs = m * m // LANES
    return _acc_to_matrix(np.arange(first_row * LANES, (first_row + regs) * LANES).reshape(regs, LANES), m)


def _operand_reader(ctx, kind: str, bits: int, first_row: int, elems: int, rows: int, halves: bool = False):
    """Closure w -> (rows, K) float64 (int64 for i8) operand matrix: one gather of the element
    codes from the register file, one table lookup of their values (halves: operand_indices')."""
    idx = operand_indices(first_row, elems, bits, rows, halves)
    if kind == "f32":
        return lambda w: w.vf.reshape(-1)[idx].astype(F64)
    table = element_table(ctx, kind)
    if bits == 16:
        return lambda w: table[w.flat16[idx]]
    if bits == 8:
        return lambda w: table[w.flat8[idx]]
    byte, shift = idx >> 1, ((idx & 1) * 4).astype(U8)  # fp4: nibble `shift` of byte `byte`

    return lambda w: table[(w.flat8[byte] >> shift) & U8(0xF)]


def _block_scales(ctx, inst, which: int, rows: int):
    """Closure w -> (rows, K) float64 factors 2^(s - 127) of operand `which` (0 A, 1 B) of a
    scaled MFMA: lane l's selected scale byte s covers row l % rows, K block l // rows (in k,
    wherever operand_indices puts its elements)."""
    code = inst.src[3 + which]
    if code < D.VGPR_BASE:
        raise ctx.error(inst, "scaled MFMA scale operands other than VGPRs (the hardware reads their "
                              "bits 30:23) are not modelled")
    row = code - D.VGPR_BASE
    shift = U32(8 * ((inst.opsel >> which & 1) | (inst.opsel_hi >> which & 1) << 1))

    def read(w):
        factor = e8m0_pow2((w.v[row] >> shift) & U32(0xFF))
        return np.repeat(_operand_matrix(factor[:, None], rows), SCALE_BLOCK, axis=1)
    return read


def _scaled(get, scales):
    return lambda w: get(w) * scales(w)


def build_mfma(inst, ctx):
    """D = A B^T + C with A (M x K) and B (N x K) gathered from the registers as exact float64
    (int64) values, the K products and C summed in float64 and rounded once (module doc); for the
    scaled MFMAs A and B first multiplied by their block scales."""
    m_ = _MFMA_RE.match(inst.name)
    if m_ is None:
        return None
    out, m, n, k, intype = m_.group(1), int(m_.group(2)), int(m_.group(3)), int(m_.group(4)), m_.group(5)
    if m != n or m not in (16, 32) or intype not in _IN_BITS or out == "f64":
        return None  # multi-block (_2b/_4b/_16b), f64 and xf32 MFMAs are not modelled
    scaled = inst.enc == "VOP3PX2"
    f = inst.f["mfma"] if scaled else inst.f
    if intype == "f8f6f4":
        # LLVM sets bit 75 (the ABID field's bit 0) in every scaled MFMA word; ABID is unused otherwise
        if f["cbsz"] not in F8F6F4_FORMATS or f["blgp"] not in F8F6F4_FORMATS or f["abid"] != int(scaled):
            raise ctx.error(inst, f"f8f6f4 MFMA with cbsz={f['cbsz']} abid={f['abid']} blgp={f['blgp']} "
                                  "is not modelled")
        (a_kind, a_bits), (b_kind, b_bits) = F8F6F4_FORMATS[f["cbsz"]], F8F6F4_FORMATS[f["blgp"]]
    else:
        if f["cbsz"] or f["abid"] or f["blgp"]:
            raise ctx.error(inst, "MFMA block broadcast (CBSZ/ABID/BLGP) is not supported")
        if "_" in intype and intype != "f8f6f4":
            a_kind, b_kind = intype.split("_")
        else:
            a_kind = b_kind = intype
        a_bits = b_bits = _IN_BITS[intype]
    elems = m * k // LANES
    a_code, b_code = inst.src[0], inst.src[1]
    if a_code < D.VGPR_BASE or b_code < D.VGPR_BASE:
        raise ctx.error(inst, "MFMA A/B operands must be registers")
    a_row = a_code - D.VGPR_BASE + (AGPR_BASE if f["acc"] & 1 else 0)
    b_row = b_code - D.VGPR_BASE + (AGPR_BASE if f["acc"] & 2 else 0)
    acc_base = AGPR_BASE if f["acc_cd"] else 0
    f8 = intype == "f8f6f4"
    get_a = _operand_reader(ctx, a_kind, a_bits, a_row, elems, m, f8 and a_bits == 8)
    get_b = _operand_reader(ctx, b_kind, b_bits, b_row, elems, n, f8 and b_bits == 8)
    if scaled:
        if inst.neg or inst.neg_hi or inst.clamp:
            raise ctx.error(inst, "modifiers on v_mfma_ld_scale_b32 are not supported")
        get_a = _scaled(get_a, _block_scales(ctx, inst, 0, m))
        get_b = _scaled(get_b, _block_scales(ctx, inst, 1, n))
    d_idx = accumulator_indices(inst.vdst + acc_base, m)
    c_code = inst.src[2]
    integer = out == "i32"
    if c_code >= D.VGPR_BASE:
        c_idx = accumulator_indices(c_code - D.VGPR_BASE + acc_base, m)
        if integer:
            c_matrix = lambda w: w.vi.reshape(-1)[c_idx].astype(np.int64)  # noqa: E731
        else:
            c_matrix = lambda w: w.vf.reshape(-1)[c_idx].astype(F64)  # noqa: E731
    else:  # an inline constant C (e.g. 0) is broadcast to every element
        c_const = np.full((m, n), vsrc(ctx, inst, 2, "i32" if integer else "f32")(None), np.int64 if integer else F64)
        c_matrix = lambda w: c_const  # noqa: E731

    def run(w):  # MFMAs ignore EXEC
        with np.errstate(invalid="ignore", over="ignore"):  # NaN scales, sums beyond f32: as computed
            d = get_a(w) @ get_b(w).T + c_matrix(w)
            if integer:
                w.vi.reshape(-1)[d_idx] = d.astype(I32)
            else:
                w.vf.reshape(-1)[d_idx] = d.astype(F32)
    return run


def build_accvgpr(inst, ctx):
    """v_accvgpr_read_b32 (AGPR -> VGPR), v_accvgpr_write_b32 (VGPR/constant -> AGPR),
    v_accvgpr_mov_b32 (AGPR -> AGPR), EXEC-masked."""
    name = inst.name
    if name == "v_accvgpr_read":
        code = inst.src[0]
        get = vsrc(ctx, inst, 0, "u32", agpr=code >= D.VGPR_BASE)
        put = vwriter(ctx, inst, "u32")
    elif name == "v_accvgpr_write":
        get = vsrc(ctx, inst, 0, "u32")
        put = vwriter(ctx, inst, "u32", agpr=True)
    else:
        if inst.src[0] < D.VGPR_BASE or inst.dpp is not None or inst.sdwa is not None:
            raise ctx.error(inst, "v_accvgpr_mov_b32 needs an AGPR source")
        get = vsrc(ctx, inst, 0, "u32", agpr=True)
        put = vwriter(ctx, inst, "u32", agpr=True)
    if inst.neg or inst.abs or inst.clamp:
        raise ctx.error(inst, "modifiers on AGPR moves are not supported")
    return lambda w: put(w, get(w))


BUILDERS = {"v_accvgpr_read": build_accvgpr, "v_accvgpr_write": build_accvgpr, "v_accvgpr_mov_b32": build_accvgpr}


def _build_mai(inst, ctx):
    """The MAI and VOP3PX2 encodings' matrix instructions (v_mfma_*); any other opcode is unsupported."""
    return build_mfma(inst, ctx) if inst.name.startswith("v_mfma_") else None


table.register(BUILDERS)
table.register_encoding({"MAI": _build_mai, "VOP3PX2": _build_mai})
