"""Decode gfx942 (CDNA3) / gfx950 (CDNA4) machine code into plain instruction records.

An instruction is 4 or 8 bytes (VOP3PX2, the scaled MFMA, is 16), plus a 4-byte literal
(SOP*/VOP1/VOP2/VOPC with a source operand 255, v_fmamk/fmaak/madmk/madak, s_setreg_imm32)
or a 4-byte DPP/SDWA word (VOP1/VOP2/VOPC with src0 250/249). The encoding is fixed by the
top bits of the first dword (CDNA3/CDNA4 ISA guides, "Microcode Formats"); the opcode numbers
and names come from the ISA tables in tinygrad's PyPI package (generated from AMD's XML),
which this module only reads.

`decode(read, addr)` returns an `Inst`: encoding, opcode, base mnemonic (``v_add_f32``, without
``_e32``/``_e64``), raw fields, literal, and for VALU encodings a normalised operand view
(`Inst.src`, `vdst`, `sdst` and the modifier bits) so that instruction semantics do not depend
on which encoding carried them. `Inst.text` renders LLVM-like assembly for messages.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from tinygrad.runtime.autogen.amd.cdna import enum as _cdna_enum

# --- Operand codes (9-bit VALU source / 8-bit SALU source, "Scalar/Vector operands" tables) ----
VCC_LO = 106
VCC_HI = 107
M0 = 124
EXEC_LO = 126
EXEC_HI = 127
INLINE_INT_ZERO = 128  # 128..192 -> 0..64, 193..208 -> -1..-16
INLINE_INT_MAX = 192
INLINE_NEG_MAX = 208
INLINE_FLOAT_FIRST = 240  # 240..248: 0.5, -0.5, 1.0, -1.0, 2.0, -2.0, 4.0, -4.0, 1/(2*pi)
INLINE_FLOAT_LAST = 248
SRC_SDWA = 249
SRC_DPP = 250
SRC_VCCZ = 251
SRC_EXECZ = 252
SRC_SCC = 253
SRC_LDS_DIRECT = 254
SRC_LITERAL = 255
VGPR_BASE = 256
GLOBAL_SADDR_OFF = 0x7F  # FLAT/GLOBAL saddr field value meaning "no SGPR base"

INLINE_FLOATS = (0.5, -0.5, 1.0, -1.0, 2.0, -2.0, 4.0, -4.0, 0.15915494309189535)

_SPECIAL_NAMES = {
    102: "flat_scratch_lo", 103: "flat_scratch_hi", 104: "xnack_mask_lo", 105: "xnack_mask_hi",
    VCC_LO: "vcc_lo", VCC_HI: "vcc_hi", M0: "m0", EXEC_LO: "exec_lo", EXEC_HI: "exec_hi",
    235: "src_shared_base", 236: "src_shared_limit", 237: "src_private_base", 238: "src_private_limit",
    239: "src_pops_exiting_wave_id", SRC_VCCZ: "src_vccz", SRC_EXECZ: "src_execz", SRC_SCC: "src_scc",
    SRC_LDS_DIRECT: "src_lds_direct",
}


class DecodeError(Exception):
    """The bytes at an address are not an instruction this decoder knows."""


# --- Field layouts: name -> (lowest bit, width) over the little-endian instruction word ---------
_F = {
    "SOP2": {"ssrc0": (0, 8), "ssrc1": (8, 8), "sdst": (16, 7), "op": (23, 7)},
    "SOPK": {"simm16": (0, 16), "sdst": (16, 7), "op": (23, 5)},
    "SOP1": {"ssrc0": (0, 8), "op": (8, 8), "sdst": (16, 7)},
    "SOPC": {"ssrc0": (0, 8), "ssrc1": (8, 8), "op": (16, 7)},
    "SOPP": {"simm16": (0, 16), "op": (16, 7)},
    "SMEM": {"sbase": (0, 6), "sdata": (6, 7), "soe": (14, 1), "nv": (15, 1), "glc": (16, 1),
             "imm": (17, 1), "op": (18, 8), "offset": (32, 21), "soffset": (57, 7)},
    "VOP2": {"src0": (0, 9), "vsrc1": (9, 8), "vdst": (17, 8), "op": (25, 6)},
    "VOP1": {"src0": (0, 9), "op": (9, 8), "vdst": (17, 8)},
    "VOPC": {"src0": (0, 9), "vsrc1": (9, 8), "op": (17, 8)},
    "VOP3": {"vdst": (0, 8), "abs": (8, 3), "opsel": (11, 4), "clamp": (15, 1), "op": (16, 10),
             "src0": (32, 9), "src1": (41, 9), "src2": (50, 9), "omod": (59, 2), "neg": (61, 3)},
    "VOP3SD": {"vdst": (0, 8), "sdst": (8, 7), "clamp": (15, 1), "op": (16, 10),
               "src0": (32, 9), "src1": (41, 9), "src2": (50, 9), "omod": (59, 2), "neg": (61, 3)},
    "VOP3P": {"vdst": (0, 8), "neg_hi": (8, 3), "opsel": (11, 3), "opsel_hi2": (14, 1), "clamp": (15, 1),
              "op": (16, 7), "src0": (32, 9), "src1": (41, 9), "src2": (50, 9), "opsel_hi": (59, 2),
              "neg": (61, 3)},
    "MAI": {"vdst": (0, 8), "cbsz": (8, 3), "abid": (11, 4), "acc_cd": (15, 1), "op": (16, 7),
            "src0": (32, 9), "src1": (41, 9), "src2": (50, 9), "acc": (59, 2), "blgp": (61, 3)},
    "DS": {"offset0": (0, 8), "offset1": (8, 8), "gds": (16, 1), "op": (17, 8), "acc": (25, 1),
           "addr": (32, 8), "data0": (40, 8), "data1": (48, 8), "vdst": (56, 8)},
    "FLAT": {"offset": (0, 13), "sve": (13, 1), "seg": (14, 2), "sc0": (16, 1), "nt": (17, 1), "op": (18, 7),
             "sc1": (25, 1), "addr": (32, 8), "data": (40, 8), "saddr": (48, 7), "acc": (55, 1), "vdst": (56, 8)},
    "MUBUF": {"offset": (0, 12), "offen": (12, 1), "idxen": (13, 1), "sc0": (14, 1), "sc1": (15, 1),
              "lds": (16, 1), "nt": (17, 1), "op": (18, 7), "vaddr": (32, 8), "vdata": (40, 8),
              "srsrc": (48, 5), "acc": (55, 1), "soffset": (56, 8)},
    "MTBUF": {"offset": (0, 12), "offen": (12, 1), "idxen": (13, 1), "sc0": (14, 1), "op": (15, 4),
              "dfmt": (19, 4), "nfmt": (23, 3), "vaddr": (32, 8), "vdata": (40, 8), "srsrc": (48, 5),
              "acc": (55, 1), "soffset": (56, 8)},
}
_DPP_F = {"vsrc0": (0, 8), "dpp_ctrl": (8, 9), "bound_ctrl": (19, 1), "src0_neg": (20, 1), "src0_abs": (21, 1),
          "src1_neg": (22, 1), "src1_abs": (23, 1), "bank_mask": (24, 4), "row_mask": (28, 4)}
_SDWA_F = {"vsrc0": (0, 8), "dst_sel": (8, 3), "dst_unused": (11, 2), "clamp": (13, 1), "omod": (14, 2),
           "src0_sel": (16, 3), "src0_sext": (19, 1), "src0_neg": (20, 1), "src0_abs": (21, 1), "s0": (23, 1),
           "src1_sel": (24, 3), "src1_sext": (27, 1), "src1_neg": (28, 1), "src1_abs": (29, 1), "s1": (31, 1)}
# VOPC in SDWA: bits 14:8 are the scalar destination, bit 15 says whether it is used (else VCC).
_SDWA_VOPC_F = {**{k: v for k, v in _SDWA_F.items() if k not in ("dst_sel", "dst_unused", "clamp", "omod")},
                "sdst": (8, 7), "sd": (15, 1)}

_ENUMS = {
    "SOP1": _cdna_enum.SOP1Op, "SOP2": _cdna_enum.SOP2Op, "SOPK": _cdna_enum.SOPKOp, "SOPC": _cdna_enum.SOPCOp,
    "SOPP": _cdna_enum.SOPPOp, "SMEM": _cdna_enum.SMEMOp, "VOP1": _cdna_enum.VOP1Op, "VOP2": _cdna_enum.VOP2Op,
    "VOPC": _cdna_enum.VOPCOp, "VOP3": _cdna_enum.VOP3Op, "VOP3SD": _cdna_enum.VOP3SDOp, "VOP3P": _cdna_enum.VOP3POp,
    "DS": _cdna_enum.DSOp, "FLAT": _cdna_enum.FLATOp, "GLOBAL": _cdna_enum.GLOBALOp,
    "SCRATCH": _cdna_enum.SCRATCHOp, "MUBUF": _cdna_enum.MUBUFOp, "MTBUF": _cdna_enum.MTBUFOp,
}


def _names(enum_cls) -> dict[int, str]:
    out = {}
    for member in enum_cls:
        name = member.name.lower()
        for suffix in ("_e32", "_e64"):
            if name.endswith(suffix):
                name = name[: -len(suffix)]
        out[member.value] = name
    return out


_OPNAMES = {enc: _names(cls) for enc, cls in _ENUMS.items()}
_VOP3SD_OPS = set(_OPNAMES["VOP3SD"])
# VOP2 opcodes that carry a 32-bit constant after the instruction word.
_VOP2_ALWAYS_LITERAL = {"v_fmamk_f32", "v_fmaak_f32", "v_madmk_f16", "v_madak_f16", "v_madmk_f32", "v_madak_f32"}
# VOP2 e32 opcodes whose carry-in/condition is VCC (src2) and/or whose carry-out is VCC.
_VOP2_VCC_IN = {"v_cndmask_b32", "v_addc_co_u32", "v_subb_co_u32", "v_subbrev_co_u32"}
_VOP2_VCC_OUT = {"v_add_co_u32", "v_sub_co_u32", "v_subrev_co_u32", "v_addc_co_u32", "v_subb_co_u32",
                 "v_subbrev_co_u32"}
# VOP2 opcodes that read their destination as the third source (accumulate forms).
_VOP2_ACC = {"v_fmac_f32", "v_fmac_f64", "v_mac_f32", "v_mac_f16", "v_pk_fmac_f16", "v_dot2c_f32_bf16",
             "v_dot2c_f32_f16", "v_dot2c_i32_i16", "v_dot4c_i32_i8", "v_dot8c_i32_i4"}

# Instructions that exist on gfx950 (CDNA4) but not on gfx942 (CDNA3), and the reverse. The
# tinygrad tables describe the union; executing one of these on the other arch is an error.
GFX950_ONLY_PREFIXES = ("v_cvt_scalef32_", "v_mfma_scale_", "v_mfma_ld_scale", "ds_read_b64_tr_", "ds_read_b96_tr_")
GFX950_ONLY = frozenset({
    "v_cvt_pk_bf16_f32", "v_cvt_pk_f16_f32", "v_cvt_sr_bf16_f32", "v_cvt_sr_f16_f32", "v_cvt_f32_bf16",
    "v_bitop3_b16", "v_bitop3_b32", "v_permlane16_swap_b32", "v_permlane32_swap_b32", "v_prng_b32",
    "v_ashr_pk_i8_i32", "v_ashr_pk_u8_i32", "v_minimum3_f32", "v_maximum3_f32", "v_pk_minimum3_f16",
    "v_pk_maximum3_f16", "v_dot2_f32_bf16", "v_dot2c_f32_bf16",
    "v_mfma_f32_16x16x32_bf16", "v_mfma_f32_32x32x16_bf16", "v_mfma_f32_16x16x32_f16", "v_mfma_f32_32x32x16_f16",
    "v_mfma_i32_16x16x64_i8", "v_mfma_i32_32x32x32_i8", "v_mfma_f32_16x16x128_f8f6f4",
    "v_mfma_f32_32x32x64_f8f6f4", "v_smfmac_f32_16x16x64_bf16", "v_smfmac_f32_32x32x32_bf16",
    "v_smfmac_f32_16x16x64_f16", "v_smfmac_f32_32x32x32_f16", "v_smfmac_i32_16x16x128_i8",
    "v_smfmac_i32_32x32x64_i8", "v_smfmac_f32_16x16x128_bf8_bf8", "v_smfmac_f32_16x16x128_bf8_fp8",
    "v_smfmac_f32_16x16x128_fp8_bf8", "v_smfmac_f32_16x16x128_fp8_fp8", "v_smfmac_f32_32x32x64_bf8_bf8",
    "v_smfmac_f32_32x32x64_bf8_fp8", "v_smfmac_f32_32x32x64_fp8_bf8", "v_smfmac_f32_32x32x64_fp8_fp8",
    "global_load_lds_dwordx3", "global_load_lds_dwordx4", "buffer_atomic_pk_add_bf16",
})
GFX942_ONLY = frozenset({"v_mfma_f32_16x16x8_xf32", "v_mfma_f32_32x32x4_xf32"})


def arch_of_instruction(name: str) -> str | None:
    """'gfx950' or 'gfx942' if the mnemonic exists on that arch only, else None."""
    if name in GFX950_ONLY or name.startswith(GFX950_ONLY_PREFIXES):
        return "gfx950"
    if name in GFX942_ONLY:
        return "gfx942"
    return None


def _fields(raw: int, layout: dict[str, tuple[int, int]]) -> dict[str, int]:
    return {k: (raw >> lo) & ((1 << width) - 1) for k, (lo, width) in layout.items()}


def _is_mai(name: str) -> bool:
    return name.startswith(("v_mfma", "v_smfmac", "v_accvgpr_read", "v_accvgpr_write"))


@dataclass(eq=False)
class Inst:
    """One decoded instruction.

    For VALU encodings (VOP1/VOP2/VOPC/VOP3/VOP3SD/VOP3P/MAI/VOP3PX2) the decoder fills the
    normalised view: `src` (operand codes, VGPRs as 256+n; None where absent), `vdst` (VGPR number),
    `sdst` (SGPR code of a scalar destination: VOPC/carry-out/readlane), and modifier bit masks.
    VOP3PX2 (the scaled MFMA) has five sources, A, B, C, scale A, scale B, and the modifiers
    (op_sel, op_sel_hi, ...) of its v_mfma_ld_scale_b32 word.
    """

    addr: int
    size: int
    enc: str
    op: int
    name: str
    f: dict[str, int]
    literal: int | None = None
    dpp: dict[str, int] | None = None
    sdwa: dict[str, int] | None = None
    src: list = field(default_factory=list)
    vdst: int | None = None
    sdst: int | None = None
    abs: int = 0
    neg: int = 0
    neg_hi: int = 0
    opsel: int = 0
    opsel_hi: int = 0b111
    clamp: int = 0
    omod: int = 0

    @property
    def text(self) -> str:
        return render(self)

    def __repr__(self) -> str:
        return f"<Inst {self.addr:#x} {self.text}>"


def _detect(w0: int) -> str:
    if w0 >> 31 == 0:
        top7 = w0 >> 25
        return "VOP1" if top7 == 0b0111111 else "VOPC" if top7 == 0b0111110 else "VOP2"
    if w0 >> 30 == 0b10:
        top9 = w0 >> 23
        if top9 == 0x17D:
            return "SOP1"
        if top9 == 0x17E:
            return "SOPC"
        if top9 == 0x17F:
            return "SOPP"
        return "SOPK" if w0 >> 28 == 0b1011 else "SOP2"
    top6 = w0 >> 26
    if top6 == 0b110100:
        return "VOP3P" if w0 >> 23 == 0b110100111 else "VOP3"
    encs = {0b110000: "SMEM", 0b110110: "DS", 0b110111: "FLAT", 0b111000: "MUBUF", 0b111010: "MTBUF"}
    if top6 in encs:
        return encs[top6]
    raise DecodeError(f"unknown encoding, first dword {w0:#010x}")


def decode(read, addr: int) -> Inst:
    """Decode the instruction at `addr`; `read(addr, n)` returns n bytes of the code object."""
    w0 = int.from_bytes(read(addr, 4), "little")
    enc = _detect(w0)
    size = 4 if enc in ("SOP1", "SOP2", "SOPK", "SOPC", "SOPP", "VOP1", "VOP2", "VOPC") else 8
    raw = int.from_bytes(read(addr, size), "little")
    if enc == "FLAT":
        seg = (raw >> 14) & 3
        enc = {0: "FLAT", 1: "SCRATCH", 2: "GLOBAL"}.get(seg)
        if enc is None:
            raise DecodeError(f"FLAT instruction with reserved segment 3 at {addr:#x}")
        f = _fields(raw, _F["FLAT"])
        if enc == "FLAT":
            f["offset"] &= 0xFFF  # FLAT: 12-bit unsigned offset; GLOBAL/SCRATCH: 13-bit signed
    elif enc == "VOP3":
        op = (raw >> 16) & 0x3FF
        enc = "VOP3SD" if op in _VOP3SD_OPS else "VOP3"
        f = _fields(raw, _F[enc])
    elif enc == "VOP3P":
        f = _fields(raw, _F["VOP3P"])
        vop3p_name = _OPNAMES["VOP3P"].get(f["op"], "")
        if _is_mai(vop3p_name) and vop3p_name != "v_mfma_ld_scale_b32":
            enc = "MAI"
            f = _fields(raw, _F["MAI"])
    else:
        f = _fields(raw, _F[enc])
    op = f["op"]
    name = _OPNAMES["VOP3P" if enc == "MAI" else enc].get(op)
    if name is None:
        raise DecodeError(f"unknown {enc} opcode {op} (first dword {w0:#010x}) at {addr:#x}")
    inst = Inst(addr=addr, size=size, enc=enc, op=op, name=name, f=f)
    if enc == "VOP3P" and name == "v_mfma_ld_scale_b32":
        # VOP3PX2: a v_mfma_ld_scale_b32 word pair followed by the scaled MFMA word pair.
        inst.size = 16
        nxt = int.from_bytes(read(addr + 8, 8), "little")
        inst.f = {"scale": f, "mfma": _fields(nxt, _F["MAI"])}
        mfma_op = inst.f["mfma"]["op"]
        scaled = {45: "v_mfma_scale_f32_16x16x128_f8f6f4", 46: "v_mfma_scale_f32_32x32x64_f8f6f4"}
        if mfma_op not in scaled:
            raise DecodeError(f"v_mfma_ld_scale_b32 followed by VOP3P opcode {mfma_op} at {addr:#x}")
        inst.name = scaled[mfma_op]
        inst.enc = "VOP3PX2"
        # the MFMA's operands, then the two scale operands; op_sel/op_sel_hi of the scale word
        mf = inst.f["mfma"]
        inst.src = [mf["src0"], mf["src1"], mf["src2"], f["src0"], f["src1"]]
        inst.vdst = mf["vdst"]
        inst.opsel, inst.opsel_hi = f["opsel"], f["opsel_hi"] | f["opsel_hi2"] << 2
        inst.neg, inst.neg_hi, inst.clamp = f["neg"], f["neg_hi"], f["clamp"]
        return inst
    _extend(inst, read, w0)
    return inst


def _extend(inst: Inst, read, w0: int) -> None:
    """Read literal / DPP / SDWA words and fill the normalised VALU operand view."""
    enc, f, name = inst.enc, inst.f, inst.name

    def take_word() -> int:
        word = int.from_bytes(read(inst.addr + inst.size, 4), "little")
        inst.size += 4
        return word

    if enc in ("SOP1", "SOP2", "SOPC"):
        if f.get("ssrc0") == SRC_LITERAL or f.get("ssrc1") == SRC_LITERAL:
            inst.literal = take_word()
    elif enc == "SOPK" and name == "s_setreg_imm32_b32":
        inst.literal = take_word()
    elif enc in ("VOP1", "VOP2", "VOPC"):
        src0 = f["src0"]
        if src0 == SRC_LITERAL or (enc == "VOP2" and name in _VOP2_ALWAYS_LITERAL):
            inst.literal = take_word()
        elif src0 == SRC_DPP:
            inst.dpp = _fields(take_word(), _DPP_F)
            src0 = VGPR_BASE + inst.dpp["vsrc0"]
            inst.abs = inst.dpp["src0_abs"] | inst.dpp["src1_abs"] << 1
            inst.neg = inst.dpp["src0_neg"] | inst.dpp["src1_neg"] << 1
        elif src0 == SRC_SDWA:
            inst.sdwa = _fields(take_word(), _SDWA_VOPC_F if enc == "VOPC" else _SDWA_F)
            s = inst.sdwa
            src0 = s["vsrc0"] + (0 if s["s0"] else VGPR_BASE)
            inst.abs = s["src0_abs"] | s["src1_abs"] << 1
            inst.neg = s["src0_neg"] | s["src1_neg"] << 1
            inst.clamp = s.get("clamp", 0)
            inst.omod = s.get("omod", 0)
        src1 = VGPR_BASE + f["vsrc1"] if enc != "VOP1" else None
        if enc != "VOP1" and inst.sdwa is not None and inst.sdwa["s1"]:
            src1 = f["vsrc1"]  # SDWA (VOP2/VOPC): vsrc1 may name an SGPR
        inst.src = [src0, src1, None]
        if enc == "VOPC":
            if inst.sdwa is not None and inst.sdwa["sd"]:
                inst.sdst = inst.sdwa["sdst"]
            else:
                inst.sdst = VCC_LO
        elif name == "v_readfirstlane_b32":
            inst.sdst = f["vdst"]
        else:
            inst.vdst = f["vdst"]
        if enc == "VOP2":
            if name in _VOP2_VCC_IN:
                inst.src[2] = VCC_LO
            if name in _VOP2_VCC_OUT:
                inst.sdst = VCC_LO
            if name in _VOP2_ACC:
                inst.src[2] = VGPR_BASE + f["vdst"]
    elif enc in ("VOP3", "VOP3SD"):
        inst.src = [f["src0"], f["src1"], f["src2"]]
        inst.neg, inst.omod, inst.clamp = f["neg"], f["omod"], f["clamp"]
        if enc == "VOP3SD":
            inst.vdst, inst.sdst = f["vdst"], f["sdst"]
        else:
            inst.abs, inst.opsel = f["abs"], f["opsel"]
            if inst.op < 256:  # VOPC opcodes in VOP3 encoding: the destination is an SGPR pair
                inst.sdst = f["vdst"]
            elif name in ("v_readlane_b32", "v_readfirstlane_b32"):
                inst.sdst = f["vdst"]
            else:
                inst.vdst = f["vdst"]
            if name in _VOP2_ACC and inst.op < 512:
                inst.src[2] = VGPR_BASE + f["vdst"]
    elif enc == "VOP3P":
        inst.src = [f["src0"], f["src1"], f["src2"]]
        inst.vdst, inst.neg, inst.neg_hi, inst.clamp = f["vdst"], f["neg"], f["neg_hi"], f["clamp"]
        inst.opsel = f["opsel"]
        inst.opsel_hi = f["opsel_hi"] | f["opsel_hi2"] << 2
    elif enc == "MAI":
        inst.src = [f["src0"], f["src1"], f["src2"]]
        inst.vdst = f["vdst"]


# --- Rendering (LLVM-like, for messages and counters) -------------------------------------------


def operand_text(code: int, nregs: int = 1, literal: int | None = None, agpr: bool = False) -> str:
    """Assembly text of a source-operand code."""
    if code >= VGPR_BASE:
        n, p = code - VGPR_BASE, "a" if agpr else "v"
        return f"{p}{n}" if nregs == 1 else f"{p}[{n}:{n + nregs - 1}]"
    if code <= 101:
        return f"s{code}" if nregs == 1 else f"s[{code}:{code + nregs - 1}]"
    if nregs == 2 and code in (VCC_LO, EXEC_LO):
        return "vcc" if code == VCC_LO else "exec"
    if 108 <= code <= 123:
        n = code - 108
        return f"ttmp{n}" if nregs == 1 else f"ttmp[{n}:{n + nregs - 1}]"
    if INLINE_INT_ZERO <= code <= INLINE_INT_MAX:
        return str(code - INLINE_INT_ZERO)
    if INLINE_INT_MAX < code <= INLINE_NEG_MAX:
        return str(INLINE_INT_MAX - code)
    if INLINE_FLOAT_FIRST <= code <= INLINE_FLOAT_LAST:
        value = INLINE_FLOATS[code - INLINE_FLOAT_FIRST]
        return "0.15915494" if code == INLINE_FLOAT_LAST else repr(value)
    if code == SRC_LITERAL:
        return f"{literal:#x}" if literal is not None else "lit"
    return _SPECIAL_NAMES.get(code, f"?{code}")


def _reg_counts(inst: Inst) -> dict[str, int]:
    """Registers per operand from the ISA tables (for rendering only)."""
    from tinygrad.runtime.autogen.amd.cdna.operands import OPERANDS  # large table: import lazily

    enum_name = "VOP3P" if inst.enc in ("MAI", "VOP3PX2") else inst.enc
    try:
        key = _ENUMS[enum_name](inst.op)
    except (KeyError, ValueError):
        return {}
    return {k: max(1, v[1] // 32) for k, v in OPERANDS.get(key, {}).items()}


_SDWA_SEL = ("BYTE_0", "BYTE_1", "BYTE_2", "BYTE_3", "WORD_0", "WORD_1", "DWORD", "?")
_SDWA_UNUSED = ("UNUSED_PAD", "UNUSED_SEXT", "UNUSED_PRESERVE", "?")


def _dpp_text(ctrl: int) -> str:
    if ctrl <= 0xFF:
        return "quad_perm:[" + ",".join(str((ctrl >> (2 * i)) & 3) for i in range(4)) + "]"
    kinds = {0x100: "row_shl", 0x110: "row_shr", 0x120: "row_ror"}
    if ctrl & 0x1F0 in kinds and ctrl & 0xF:
        return f"{kinds[ctrl & 0x1F0]}:{ctrl & 0xF}"
    return {0x130: "wave_shl:1", 0x134: "wave_rol:1", 0x138: "wave_shr:1", 0x13C: "wave_ror:1",
            0x140: "row_mirror", 0x141: "row_half_mirror", 0x142: "row_bcast:15", 0x143: "row_bcast:31"}.get(
        ctrl, f"dpp_ctrl:{ctrl:#x}")


def render(inst: Inst) -> str:
    """LLVM-like assembly text of `inst` (close enough to find it in a 22_final_isa.s dump)."""
    f, name, enc = inst.f, inst.name, inst.enc
    regs = _reg_counts(inst)
    ops: list[str] = []
    if enc in ("SOP1", "SOP2", "SOPC"):
        if enc != "SOPC" and "sdst" in regs:
            ops.append(operand_text(f["sdst"], regs.get("sdst", 1)))
        for k in ("ssrc0", "ssrc1"):
            if k in f and k in regs:
                ops.append(operand_text(f[k], regs[k], inst.literal))
    elif enc == "SOPK":
        ops = [operand_text(f["sdst"]), f"{f['simm16']:#x}"]
    elif enc == "SOPP":
        ops = [str(f["simm16"])] if name not in ("s_endpgm", "s_barrier") else []
    elif enc == "SMEM":
        off = f"{f['offset']:#x}" if f["imm"] else operand_text(f["offset"] & 0x7F)
        if f["imm"] and f["soe"]:
            off = f"{operand_text(f['soffset'])} offset:{f['offset']:#x}"
        ops = [operand_text(f["sdata"], regs.get("sdata", 1)), operand_text(f["sbase"] * 2, regs.get("sbase", 2)), off]
    elif enc in ("VOP1", "VOP2", "VOPC", "VOP3", "VOP3SD", "VOP3P", "MAI"):
        suffix = {"VOP1": "_e32", "VOP2": "_e32", "VOPC": "_e32"}.get(enc, "")
        if enc == "VOP3" and inst.op < 512:
            suffix = "_e64"
        if inst.dpp is not None:
            suffix = "_dpp"
        elif inst.sdwa is not None:
            suffix = "_sdwa"
        name = name + suffix
        acc = f.get("acc", 0) if enc == "MAI" else 0
        if inst.vdst is not None:
            agpr = (enc == "MAI" and (f["acc_cd"] or inst.name == "v_accvgpr_write"))
            ops.append(operand_text(VGPR_BASE + inst.vdst, regs.get("vdst", 1), agpr=agpr))
        if inst.sdst is not None:
            ops.append(operand_text(inst.sdst, 1 if name.startswith(("v_readlane", "v_readfirstlane")) else 2))
        for i, k in enumerate(("src0", "src1", "src2")):
            code = inst.src[i] if i < len(inst.src) else None
            key = k if k in regs else "v" + k
            if code is None or (regs and key not in regs and enc in ("VOP3", "VOP3SD", "VOP3P")):
                continue
            agpr = (enc == "MAI" and ((i < 2 and acc >> i & 1) or (i == 2 and f["acc_cd"])
                                      or inst.name == "v_accvgpr_read"))
            text = operand_text(code, regs.get(key, 1), inst.literal, agpr)
            if inst.abs >> i & 1:
                text = f"|{text}|"
            if inst.neg >> i & 1:
                text = "-" + text
            ops.append(text)
        if enc == "VOP3" and inst.opsel:
            ops.append(f"op_sel:{inst.opsel:#x}")
        if inst.clamp:
            ops.append("clamp")
        if inst.dpp is not None:
            ops.append(f"{_dpp_text(inst.dpp['dpp_ctrl'])} row_mask:{inst.dpp['row_mask']:#x} "
                       f"bank_mask:{inst.dpp['bank_mask']:#x}" + (" bound_ctrl:1" if inst.dpp["bound_ctrl"] else ""))
        if inst.sdwa is not None:
            sd = inst.sdwa
            sels = ([f"dst_sel:{_SDWA_SEL[sd['dst_sel']]} dst_unused:{_SDWA_UNUSED[sd['dst_unused']]}"]
                    if "dst_sel" in sd else [])
            sels += [f"src0_sel:{_SDWA_SEL[sd['src0_sel']]}"] + ([f"src1_sel:{_SDWA_SEL[sd['src1_sel']]}"]
                                                              if enc != "VOP1" else [])
            ops.append(" ".join(sels))
        if enc == "MAI" and (f["cbsz"] or f["abid"] or f["blgp"]):
            ops.append(f"cbsz:{f['cbsz']} abid:{f['abid']} blgp:{f['blgp']}")
    elif enc == "DS":
        ops = [f"v{f['vdst']}", f"v{f['addr']}", f"v{f['data0']}", f"v{f['data1']}",
               f"offset0:{f['offset0']} offset1:{f['offset1']}"]
    elif enc in ("GLOBAL", "FLAT", "SCRATCH"):
        saddr = "off" if f["saddr"] == GLOBAL_SADDR_OFF else operand_text(f["saddr"], 2)
        ops = [f"vdst:v{f['vdst']}", f"v{f['addr']}", f"data:v{f['data']}", saddr, f"offset:{f['offset']}"]
    elif enc in ("MUBUF", "MTBUF"):
        ops = [f"v{f['vdata']}", f"v{f['vaddr']}", operand_text(f["srsrc"] * 4, 4), operand_text(f["soffset"]),
               ("offen " if f["offen"] else "") + ("idxen " if f["idxen"] else "") + f"offset:{f['offset']}"]
    elif enc == "VOP3PX2":
        mf = f["mfma"]
        acc_regs = 4 if "16x16" in name else 16
        ops = [operand_text(VGPR_BASE + inst.vdst, acc_regs, agpr=bool(mf["acc_cd"])),
               operand_text(inst.src[0], 8, agpr=bool(mf["acc"] & 1)),
               operand_text(inst.src[1], 8, agpr=bool(mf["acc"] & 2)),
               operand_text(inst.src[2], acc_regs, agpr=bool(mf["acc_cd"])),
               operand_text(inst.src[3]), operand_text(inst.src[4]),
               f"op_sel:[{inst.opsel & 1},{inst.opsel >> 1 & 1},0] "
               f"op_sel_hi:[{inst.opsel_hi & 1},{inst.opsel_hi >> 1 & 1},0] cbsz:{mf['cbsz']} blgp:{mf['blgp']}"]
    return name + (" " + ", ".join(ops) if ops else "")
