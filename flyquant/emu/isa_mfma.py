"""Matrix instructions (MFMA) and the accumulation registers (AGPRs).

A single-block v_mfma_<out>_<M>x<N>x<K>_<in> computes D = A (M x K) * B (K x N) + C (M x N) for
the whole wave. Register layout (CDNA3/CDNA4 ISA guides, "Matrix fused-multiply-add"):
- A: lane l holds E = M*K/64 consecutive K elements of row l % M, starting at k = E * (l // M),
  packed little-endian in its source registers; B likewise with column l % N.
- C/D, 16x16 (4 registers): register r of lane l is element (4 * (l // 16) + r, l % 16);
  32x32 (16 registers): register r of lane l is element (8 * (r // 4) + 4 * (l // 32) + r % 4, l % 32).
MFMAs ignore EXEC. Products of the narrow inputs are exact in binary64; the K products and C are
summed in binary64 and rounded once to f32. The hardware's internal accumulation order and
precision are not documented, so floating-point results can differ from an MI300X/MI355X in the
last bits (integer MFMAs are exact).

gfx950's v_mfma_f32_{16x16x128,32x32x64}_f8f6f4 take the A/B formats from CBSZ/BLGP
(0 fp8, 1 bf8, 4 fp4; fp6 formats are not modelled). Block-broadcast modifiers (CBSZ/ABID/BLGP on
the other MFMAs) and the multi-block MFMAs are rejected.
"""

from __future__ import annotations

import re

import numpy as np

from . import decode as D
from .isa_base import AGPR_BASE, F16, F32, F64, I32, LANES, U8, U16, U32, vsrc, vwriter
from .isa_cvt import E2M1, bf16_bits_to_f32, fp8_formats

_MFMA_RE = re.compile(r"v_mfma_(f32|i32|f64)_(\d+)x(\d+)x(\d+)_(\w+)$")
# element bits of the input types
_IN_BITS = {"bf16": 16, "f16": 16, "f32": 32, "i8": 8, "fp8_fp8": 8, "fp8_bf8": 8, "bf8_fp8": 8,
            "bf8_bf8": 8, "f8f6f4": None}
F8F6F4_FORMATS = {0: ("fp8", 8), 1: ("bf8", 8), 4: ("fp4", 4)}


def _decode_elements(ctx, words: np.ndarray, kind: str, bits: int) -> np.ndarray:
    """(64, E) float64 (or int64) elements of `kind` from (nregs, 64) uint32 register rows."""
    raw = np.ascontiguousarray(words.T).view(U8)  # (64, nregs*4) bytes, little-endian
    if kind == "bf16":
        return bf16_bits_to_f32(raw.view(U16).astype(U32)).astype(F64)
    if kind == "f16":
        return raw.view(F16).astype(F64)
    if kind == "f32":
        return raw.view(F32).astype(F64)
    if kind == "i8":
        return raw.view(np.int8).astype(np.int64)
    if kind in ("fp8", "bf8"):
        fmt = fp8_formats(ctx.arch)[kind == "bf8"]
        return fmt.decode(raw).astype(F64)
    if kind == "fp4":
        nib = np.stack([raw & U8(0xF), raw >> U8(4)], axis=-1).reshape(LANES, -1)  # low nibble first
        return E2M1.decode(nib).astype(F64)
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


def _matrix_to_acc(mat: np.ndarray, m: int) -> np.ndarray:
    if m == 16:
        return mat.reshape(4, 4, 16).transpose(1, 0, 2).reshape(4, LANES)
    return mat.reshape(4, 2, 4, 32).transpose(0, 2, 1, 3).reshape(16, LANES)


def build_mfma(inst, ctx):
    m_ = _MFMA_RE.match(inst.name)
    if m_ is None:
        return None
    out, m, n, k, intype = m_.group(1), int(m_.group(2)), int(m_.group(3)), int(m_.group(4)), m_.group(5)
    if m != n or m not in (16, 32) or intype not in _IN_BITS or out == "f64":
        return None  # multi-block (_2b/_4b/_16b), f64 and xf32 MFMAs are not modelled
    f = inst.f
    if intype == "f8f6f4":
        if f["cbsz"] not in F8F6F4_FORMATS or f["blgp"] not in F8F6F4_FORMATS or f["abid"]:
            raise ctx.error(inst, f"f8f6f4 MFMA formats cbsz={f['cbsz']} blgp={f['blgp']} are not modelled")
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
    a_regs, b_regs = elems * a_bits // 32, elems * b_bits // 32
    acc_regs = m * n // LANES
    a_code, b_code = inst.src[0], inst.src[1]
    if a_code < D.VGPR_BASE or b_code < D.VGPR_BASE:
        raise ctx.error(inst, "MFMA A/B operands must be registers")
    a_row = a_code - D.VGPR_BASE + (AGPR_BASE if f["acc"] & 1 else 0)
    b_row = b_code - D.VGPR_BASE + (AGPR_BASE if f["acc"] & 2 else 0)
    acc_base = AGPR_BASE if f["acc_cd"] else 0
    d_row = inst.vdst + acc_base
    c_code = inst.src[2]
    integer = out == "i32"
    if c_code >= D.VGPR_BASE:
        c_row = c_code - D.VGPR_BASE + acc_base

        def c_matrix(w):
            regs = w.v[c_row:c_row + acc_regs]
            return _acc_to_matrix(regs.view(I32).astype(np.int64) if integer else regs.view(F32).astype(F64), m)
    else:  # an inline constant C (e.g. 0) is broadcast to every element
        c_const = vsrc(ctx, inst, 2, "i32" if integer else "f32")(None)
        c_matrix = (lambda w: np.full((m, n), c_const, np.int64 if integer else F64))  # noqa: E731

    def run(w):
        a = _operand_matrix(_decode_elements(ctx, w.v[a_row:a_row + a_regs], a_kind, a_bits), m)
        b = _operand_matrix(_decode_elements(ctx, w.v[b_row:b_row + b_regs], b_kind, b_bits), n)
        d = a @ b.T + c_matrix(w)
        if integer:
            w.v[d_row:d_row + acc_regs] = _matrix_to_acc(d, m).astype(np.int64).astype(I32).view(U32)
        else:
            w.v[d_row:d_row + acc_regs] = _matrix_to_acc(d, m).astype(F32).view(U32)
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


def mfma_builder(name: str):
    return build_mfma if name.startswith("v_mfma_") else None
