"""Wave state and operand access shared by the instruction-semantics modules (isa_*.py).

Register files of one wave (wave64):
- ``s``: Python list of 128 ints (SGPRs 0..101, FLAT_SCRATCH, XNACK_MASK, VCC 106/107, TTMPs,
  M0 124, EXEC 126/127), each a 32-bit unsigned value. ``scc`` is 0 or 1.
- ``v``: NumPy uint32 array (512, 64): rows 0..255 are the architectural VGPRs v0..v255,
  rows 256..511 the accumulation registers a0..a255 (AGPRs), one column per lane.
  ``vi``/``vf`` view the same memory as int32/float32; ``h16``/``hi16``/``hf16`` as 16-bit
  halves (row, lane, 0 = bits 15:0, 1 = bits 31:16); ``flat8``/``flat16``/``flat32`` as one
  flat uint8/uint16/uint32 array (element k of 8/16/32 bits of register row r, lane l is at
  ((r * 64 + l) * (4 / bytes) + k)), for gathers whose indices are computed when a closure is built.
- EXEC is kept in ``s[126]``/``s[127]`` and mirrored as a boolean lane mask ``exec_mask`` (plus
  ``exec_full``, all 64 lanes on): every write of EXEC goes through `set_exec`.

Instruction builders (in isa_salu, isa_valu, ...) turn a decoded `Inst` into a closure
``run(w) -> None | int``: None continues with the next instruction, an int >= 0 is the index of
the next instruction (branches), `END`/`BARRIER` stop the wave. Everything an instruction needs
from its encoding (register numbers, constants, modifiers, DPP lane maps) is resolved when the
closure is built, once per code object.
"""

from __future__ import annotations

import struct

import numpy as np

from . import decode as D
from .errors import EmuError

LANES = 64
FULL_MASK = (1 << LANES) - 1
U32_MASK = 0xFFFFFFFF
AGPR_BASE = 256  # row of a0 in Wave.v
END = -1
BARRIER = -2

U8, I8, U16, I16, F16 = np.uint8, np.int8, np.uint16, np.int16, np.float16
U32, I32, F32, U64, I64, F64 = np.uint32, np.int32, np.float32, np.uint64, np.int64, np.float64
LANE_IDS = np.arange(LANES)
LANE_IDS.flags.writeable = False


# --- lane masks <-> 64-bit integers ---------------------------------------------------------------
_MASK_CACHE: dict[int, np.ndarray] = {}
_MASK_CACHE_LIMIT = 4096


def int_to_mask(value: int) -> np.ndarray:
    """Read-only bool[64] of the bits of a 64-bit lane mask (cached: kernels use few distinct masks)."""
    m = _MASK_CACHE.get(value)
    if m is None:
        if len(_MASK_CACHE) >= _MASK_CACHE_LIMIT:
            _MASK_CACHE.clear()
        m = np.unpackbits(np.frombuffer(value.to_bytes(8, "little"), np.uint8), bitorder="little").view(bool)
        m.flags.writeable = False
        _MASK_CACHE[value] = m
    return m


def mask_to_int(mask: np.ndarray) -> int:
    """64-bit integer whose bit i is mask[i]."""
    return int.from_bytes(np.packbits(mask, bitorder="little").tobytes(), "little")


# --- scalar bit-pattern conversions ---------------------------------------------------------------
_PACK_I = struct.Struct("<I").pack
_PACK_Q = struct.Struct("<Q").pack
_PACK_H = struct.Struct("<H").pack


def bits_to_f32(x: int) -> np.float32:
    return np.frombuffer(_PACK_I(x & U32_MASK), F32)[0]


def bits_to_f64(x: int) -> np.float64:
    return np.frombuffer(_PACK_Q(x), F64)[0]


def bits_to_f16(x: int) -> np.float16:
    return np.frombuffer(_PACK_H(x & 0xFFFF), F16)[0]


def sext(x: int, bits: int) -> int:
    """Sign-extend the low `bits` bits of x."""
    x &= (1 << bits) - 1
    return x - (1 << bits) if x >> (bits - 1) else x


# --- wave state -----------------------------------------------------------------------------------
class Wave:
    """Registers and position of one wave; `wg` is its workgroup (LDS), `launch` what the
    launch's waves share (memory, counters)."""

    __slots__ = ("s", "scc", "v", "vi", "vf", "h16", "hi16", "hf16", "flat8", "flat16", "flat32", "exec_mask",
                 "exec_full", "pc", "done", "at_barrier", "wg", "launch", "wave_id", "executed", "mode", "scratch")

    def __init__(self):
        self.v = np.zeros((2 * 256, LANES), dtype=U32)
        self.vi = self.v.view(I32)
        self.vf = self.v.view(F32)
        self.h16 = self.v.view(U16).reshape(512, LANES, 2)
        self.hi16 = self.v.view(I16).reshape(512, LANES, 2)
        self.hf16 = self.v.view(F16).reshape(512, LANES, 2)
        self.flat8 = self.v.view(U8).reshape(-1)
        self.flat16 = self.v.view(U16).reshape(-1)
        self.flat32 = self.v.reshape(-1)
        self.reset()

    def reset(self):
        self.s = [0] * 128
        self.scc = 0
        self.v.fill(0)
        self.exec_mask = int_to_mask(0)
        self.exec_full = False
        self.pc = 0
        self.done = False
        self.at_barrier = False
        self.executed = 0
        self.wave_id = 0
        self.mode = initial_mode(None)
        self.scratch = None  # the wave's private segment (isa_scratch), when the kernel has one

    def set_exec(self, value: int) -> None:
        value &= FULL_MASK
        self.s[D.EXEC_LO] = value & U32_MASK
        self.s[D.EXEC_HI] = value >> 32
        self.exec_mask = int_to_mask(value)
        self.exec_full = value == FULL_MASK

    def exec_value(self) -> int:
        return self.s[D.EXEC_LO] | self.s[D.EXEC_HI] << 32

    def sreg64(self, code: int) -> int:
        return self.s[code] | self.s[code + 1] << 32


# --- the MODE hardware register -------------------------------------------------------------------
# CDNA3/CDNA4 ISA guides, "MODE" (hardware register 1): FP_ROUND 3:0, FP_DENORM 7:4, DX10_CLAMP 8,
# IEEE 9, ..., FP16_OVFL 23. The dispatch loads it from the kernel descriptor's COMPUTE_PGM_RSRC1.
MODE_DX10_CLAMP, MODE_IEEE, MODE_FP16_OVFL = 8, 9, 23


def initial_mode(kd) -> int:
    """MODE at the first instruction of a wave: from the descriptor, or with kd None FlyDSL's
    (round to nearest even, no denormal flush, DX10 clamp and IEEE mode on)."""
    if kd is None:
        return 0xF << 4 | 1 << MODE_DX10_CLAMP | 1 << MODE_IEEE
    return (kd.float_round_mode_32 | kd.float_round_mode_16_64 << 2 | kd.float_denorm_mode_32 << 4
            | kd.float_denorm_mode_16_64 << 6 | kd.enable_dx10_clamp << MODE_DX10_CLAMP
            | kd.enable_ieee_mode << MODE_IEEE | kd.fp16_overflow << MODE_FP16_OVFL)


def fp16_ovfl(w) -> bool:
    """MODE.FP16_OVFL of wave `w`: FP16 overflow (and, for the FP8/BF8 conversions, overflow) saturates."""
    return bool(w.mode >> MODE_FP16_OVFL & 1)


# f16 results that are one of the (negated) operands: never an overflow, so MODE.FP16_OVFL, which
# clamps overflowed results and keeps true infinities (CDNA3/CDNA4 ISA, MODE register), leaves them
F16_SELECTING = frozenset({"v_max_f16", "v_min_f16", "v_max3_f16", "v_min3_f16", "v_med3_f16", "v_pk_max_f16",
                           "v_pk_min_f16", "v_pk_maximum3_f16", "v_pk_minimum3_f16"})


def without_fp16_ovfl(ctx, inst, op):
    """`op` (an instruction with f16 results), failing when MODE.FP16_OVFL is set: clamping an
    overflowed f16 result to +-MAX_FP16 (true infinities kept) is not modelled, except for the
    selecting instructions, whose results cannot overflow."""
    if inst.name in F16_SELECTING:
        return op
    err = ctx.error(inst, "an f16 result with MODE.FP16_OVFL set (clamped f16 overflow) is not modelled")

    def run(w):
        if fp16_ovfl(w):
            raise err
        return op(w)
    return run


# --- build context --------------------------------------------------------------------------------
class Ctx:
    """What a builder may know about the instruction's surroundings (fixed per code object)."""

    def __init__(self, arch: str, kernel: str, kd, index_of, entry: int = 0):
        self.arch = arch
        self.kernel = kernel
        self.kd = kd
        self.entry = entry
        self._index_of = index_of
        self.index = 0  # index of the instruction being built
        mode = kd.float_denorm_mode_32 if kd is not None else 3
        self.flush_f32_in = mode in (0, 2)
        self.flush_f32_out = mode in (0, 1)
        self.ieee = kd.enable_ieee_mode if kd is not None else True
        self.dx10_clamp = kd.enable_dx10_clamp if kd is not None else True

    def index_of(self, addr: int) -> int:
        return self._index_of(addr)

    def error(self, inst: D.Inst, msg: str) -> EmuError:
        return EmuError(f"{msg}: `{inst.text}` at offset {inst.addr - self.entry:#x} in kernel {self.kernel} "
                        f"({self.arch})")


# --- scalar operands (SALU and scalar sources of VALU) --------------------------------------------
def _inline_value(code: int, bits: int) -> int:
    """Bit pattern (width `bits`) of an inline constant code used as an integer/bit operand."""
    if D.INLINE_INT_ZERO <= code <= D.INLINE_INT_MAX:
        return code - D.INLINE_INT_ZERO
    if D.INLINE_INT_MAX < code <= D.INLINE_NEG_MAX:
        return (D.INLINE_INT_MAX - code) & ((1 << bits) - 1)
    value = D.INLINE_FLOATS[code - D.INLINE_FLOAT_FIRST]
    if code == D.INLINE_FLOAT_LAST:  # 1/(2*pi): the ISA's exact encodings
        return {16: 0x3118, 32: 0x3E22F983, 64: 0x3FC45F306DC9C882}[bits]
    fmt = {16: "<e", 32: "<f", 64: "<d"}[bits]
    return int.from_bytes(struct.pack(fmt, value), "little")


def is_inline(code: int) -> bool:
    return D.INLINE_INT_ZERO <= code <= D.INLINE_NEG_MAX or D.INLINE_FLOAT_FIRST <= code <= D.INLINE_FLOAT_LAST


def sreader(ctx: Ctx, inst: D.Inst, code: int, bits: int = 32, float_kind: bool = False):
    """Closure w -> int: a scalar source operand as an unsigned `bits`-wide integer (16/32/64).

    Integer inline constants are sign-extended to `bits`; float inline constants give the bit
    pattern of the constant in the operand's float width (float_kind), in 32 bits for a 32- or
    16-bit integer operand, and as a double for any 64-bit operand (LLVM materializes an FP32 pair
    (0.0, 2.0) as s_mov_b64 s[4:5], 2.0: the double 2.0's bits); a 32-bit literal is zero-extended
    to 64 bits, or for a float64 operand forms the high half."""
    if code == D.SRC_LITERAL:
        lit = inst.literal
        if lit is None:
            raise ctx.error(inst, "a literal operand in an encoding that has no literal (VOP3 on CDNA)")
        value = lit << 32 if (bits == 64 and float_kind) else lit
        return lambda w: value
    if is_inline(code):
        if code >= D.INLINE_FLOAT_FIRST and not float_kind and bits != 64:
            value = _inline_value(code, 32) if bits == 32 else _inline_value(code, 16)
        else:
            value = _inline_value(code, bits)
        return lambda w: value
    if code == D.SRC_SCC:
        return lambda w: w.scc
    if code == D.SRC_VCCZ:
        return lambda w: int(w.s[D.VCC_LO] == 0 and w.s[D.VCC_HI] == 0)
    if code == D.SRC_EXECZ:
        return lambda w: int(w.s[D.EXEC_LO] == 0 and w.s[D.EXEC_HI] == 0)
    if code <= D.EXEC_HI and code != 125:
        if bits == 64:
            return lambda w: w.s[code] | w.s[code + 1] << 32
        if bits == 16:
            return lambda w: w.s[code] & 0xFFFF
        return lambda w: w.s[code]
    raise ctx.error(inst, f"unsupported scalar operand {D.operand_text(code)}")


def plain_sgpr(code: int) -> bool:
    """A scalar register read and written as a plain entry of `Wave.s` (everything up to M0;
    EXEC needs `set_exec`, the other codes are constants or specials)."""
    return code <= D.M0


def const_operand(ctx: Ctx, inst: D.Inst, code: int, bits: int = 32):
    """The value of a constant/literal scalar operand, or None if `code` is not a constant."""
    if code == D.SRC_LITERAL or is_inline(code):
        return sreader(ctx, inst, code, bits)(None)
    return None


def swriter(ctx: Ctx, inst: D.Inst, code: int, bits: int = 32):
    """Closure (w, value) -> None writing a scalar destination (EXEC kept coherent)."""
    if code > D.EXEC_HI or code == 125:
        raise ctx.error(inst, f"unsupported scalar destination {D.operand_text(code)}")
    if bits == 64:
        if code == D.EXEC_LO:
            return lambda w, x: w.set_exec(x)

        def put64(w, x):
            w.s[code] = x & U32_MASK
            w.s[code + 1] = (x >> 32) & U32_MASK
        return put64
    if code in (D.EXEC_LO, D.EXEC_HI):
        shift = 0 if code == D.EXEC_LO else 32

        def put_exec_half(w, x):
            other = w.exec_value() & ~(U32_MASK << shift)
            w.set_exec(other | (x & U32_MASK) << shift)
        return put_exec_half

    def put32(w, x):
        w.s[code] = x & U32_MASK
    return put32


# --- vector operands ------------------------------------------------------------------------------
# kind -> (dtype, registers, float?)
KINDS = {
    "u32": (U32, 1, False), "i32": (I32, 1, False), "f32": (F32, 1, True), "b32": (U32, 1, False),
    "u16": (U16, 1, False), "i16": (I16, 1, False), "f16": (F16, 1, True), "b16": (U16, 1, False),
    "u64": (U64, 2, False), "i64": (I64, 2, False), "f64": (F64, 2, True), "b64": (U64, 2, False),
}
_BITS = {"u32": 32, "i32": 32, "f32": 32, "b32": 32, "u16": 16, "i16": 16, "f16": 16, "b16": 16,
         "u64": 64, "i64": 64, "f64": 64, "b64": 64}


def kind_bits(kind: str) -> int:
    return _BITS[kind]


def scalar_as(kind: str, value: int):
    """A NumPy scalar of `kind` from an unsigned bit pattern."""
    dtype = KINDS[kind][0]
    if kind == "f32":
        return bits_to_f32(value)
    if kind == "f64":
        return bits_to_f64(value)
    if kind == "f16":
        return bits_to_f16(value)
    bits = _BITS[kind]
    if dtype in (I32, I16, I64):
        return dtype(sext(value, bits))
    return dtype(value & ((1 << bits) - 1))


def pair_u64(v: np.ndarray, r: int) -> np.ndarray:
    """uint64[64] from registers r (low) and r+1 (high)."""
    return v[r].astype(U64) | (v[r + 1].astype(U64) << U64(32))


def vreg_reader(row: int, kind: str, hi: int = 0):
    """Closure w -> array[64] of `kind` read from register file row `row` (16-bit: half `hi`)."""
    if kind in ("u32", "b32"):
        return lambda w: w.v[row]
    if kind == "i32":
        return lambda w: w.vi[row]
    if kind == "f32":
        return lambda w: w.vf[row]
    if kind in ("u16", "b16"):
        return lambda w: w.h16[row, :, hi]
    if kind == "i16":
        return lambda w: w.hi16[row, :, hi]
    if kind == "f16":
        return lambda w: w.hf16[row, :, hi]
    if kind in ("u64", "b64"):
        return lambda w: pair_u64(w.v, row)
    if kind == "i64":
        return lambda w: pair_u64(w.v, row).view(I64)
    if kind == "f64":
        return lambda w: pair_u64(w.v, row).view(F64)
    raise ValueError(kind)


def vsrc(ctx: Ctx, inst: D.Inst, i: int, kind: str, hi: int = 0, agpr: bool = False):
    """Closure w -> array[64] or NumPy scalar of `kind` for VALU source i of `inst`.

    `hi` selects the high 16 bits for 16-bit kinds (op_sel). Scalar sources (SGPRs,
    constants, literals) give NumPy scalars of the exact dtype, so NumPy never promotes."""
    code = inst.src[i]
    if code is None:
        raise ctx.error(inst, f"missing source operand {i}")
    if code >= D.VGPR_BASE:
        return vreg_reader(code - D.VGPR_BASE + (AGPR_BASE if agpr else 0), kind, hi)
    bits = _BITS[kind]
    float_kind = KINDS[kind][2]
    if code == D.SRC_LITERAL or is_inline(code):
        if bits == 16 and hi and is_inline(code):
            # A 16-bit operand's inline constant is a half of a 32-bit value (LLVM's
            # getInlineEncodingV216 states the hardware's rule): integer codes sign-extended, float
            # codes in an F16 operand the half pattern over zero high bits. So op_sel = 1 reads 0
            # or 0xFFFF (not the constant again). Float codes in 16-bit integer operands (the
            # FP32 pattern, or for BF16 operands the BF16 one) are not modelled here.
            if code >= D.INLINE_FLOAT_FIRST and kind != "f16":
                raise ctx.error(inst, "the high half of a float inline constant in a 16-bit integer operand is not modelled")
            const = scalar_as(kind, _inline_value(code, 32) >> 16 if code < D.INLINE_FLOAT_FIRST else 0)
            return lambda w: const
        raw = sreader(ctx, inst, code, bits if bits != 16 else 16, float_kind)(None)
        if bits == 16 and hi and code == D.SRC_LITERAL:
            raw >>= 16
        const = scalar_as(kind, raw)
        return lambda w: const
    if code == D.SRC_LDS_DIRECT or code == D.SRC_SDWA or code == D.SRC_DPP:
        raise ctx.error(inst, f"unsupported vector source {D.operand_text(code)}")
    read = sreader(ctx, inst, code, 64 if bits == 64 else 32)
    shift = 16 if (bits == 16 and hi) else 0
    conv = {"f32": bits_to_f32, "f64": bits_to_f64}.get(kind)
    if conv is not None:
        return lambda w: conv(read(w))
    if kind == "f16":
        return lambda w: bits_to_f16(read(w) >> shift)
    dtype = KINDS[kind][0]
    if dtype in (I32, I16, I64):
        return lambda w: dtype(sext(read(w) >> shift, bits))
    mask = (1 << bits) - 1
    return lambda w: dtype((read(w) >> shift) & mask)


def _writer_u32(row):
    def put(w, x):
        if w.exec_full:
            w.v[row] = x
        else:
            np.copyto(w.v[row], x, where=w.exec_mask, casting="unsafe")
    return put


def _writer_i32(row):
    def put(w, x):
        if w.exec_full:
            w.vi[row] = x
        else:
            np.copyto(w.vi[row], x, where=w.exec_mask, casting="unsafe")
    return put


def _writer_f32(row):
    def put(w, x):
        if w.exec_full:
            w.vf[row] = x
        else:
            np.copyto(w.vf[row], x, where=w.exec_mask, casting="unsafe")
    return put


# the view written through decides how NumPy casts the value: f32 results into the float view, ...
_VWRITERS_32 = {"u32": _writer_u32, "b32": _writer_u32, "i32": _writer_i32, "f32": _writer_f32}


def vwriter(ctx: Ctx, inst: D.Inst, kind: str, row: int | None = None, hi: int = 0, zero_hi: bool = False,
            agpr: bool = False):
    """Closure (w, values) -> None writing `values` (array[64] or scalar of `kind`) to the
    destination VGPR of the active lanes.

    16-bit kinds write half `hi` and keep the other half, or with `zero_hi` write the low half
    and clear bits 31:16 (what gfx9 VOP1/VOP2 16-bit instructions do)."""
    if row is None:
        row = inst.vdst
    row += AGPR_BASE if agpr else 0
    if kind in ("u32", "b32", "i32", "f32"):
        return _VWRITERS_32[kind](row)
    if kind in ("u16", "b16", "i16", "f16"):
        dtype = KINDS[kind][0]
        if zero_hi:
            def put16z(w, x):
                word = np.asarray(x, dtype=dtype).view(U16).astype(U32)
                if w.exec_full:
                    w.v[row] = word
                else:
                    np.copyto(w.v[row], word, where=w.exec_mask)
            return put16z

        def put16(w, x):
            dst = w.h16[row, :, hi]
            half = np.asarray(x, dtype=dtype).view(U16)
            if w.exec_full:
                dst[...] = half
            else:
                np.copyto(dst, half, where=w.exec_mask)
        return put16
    if kind in ("u64", "b64", "i64", "f64"):
        dtype = KINDS[kind][0]

        def put64(w, x):
            x = np.asarray(x, dtype=dtype)
            bits = x.view(U64) if x.dtype != U64 else x
            lo = bits.astype(U32)
            hi_ = (bits >> U64(32)).astype(U32)
            if w.exec_full:
                w.v[row] = lo
                w.v[row + 1] = hi_
            else:
                np.copyto(w.v[row], lo, where=w.exec_mask)
                np.copyto(w.v[row + 1], hi_, where=w.exec_mask)
        return put64
    raise ValueError(kind)


def vwriter_masked(ctx: Ctx, inst: D.Inst, kind: str, row: int | None = None, agpr: bool = False):
    """Closure (w, values, lanes) -> None writing a 32-bit `kind` to the lanes where `lanes`
    (bool[64]) and EXEC are both set (`lanes` None: EXEC alone)."""
    if kind not in ("u32", "b32", "i32", "f32"):
        raise ctx.error(inst, f"lane-masked write of {kind} is not supported")
    row = (inst.vdst if row is None else row) + (AGPR_BASE if agpr else 0)
    view = {"u32": "v", "b32": "v", "i32": "vi", "f32": "vf"}[kind]

    def put(w, x, lanes):
        m = w.exec_mask if lanes is None else (lanes & w.exec_mask)
        np.copyto(getattr(w, view)[row], x, where=m, casting="unsafe")
    return put


def lane_mask_writer(ctx: Ctx, inst: D.Inst, code: int):
    """Closure (w, bool[64]) -> None storing a per-lane result as a 64-bit SGPR-pair mask;
    lanes with EXEC off get 0."""
    put = swriter(ctx, inst, code, 64)

    def write(w, bools):
        if not w.exec_full:
            bools = bools & w.exec_mask
        put(w, mask_to_int(bools))
    return write


def lane_mask_reader(ctx: Ctx, inst: D.Inst, code: int):
    """Closure w -> bool[64] of a 64-bit lane-mask operand (VCC, an SGPR pair, a constant)."""
    read = sreader(ctx, inst, code, 64)
    return lambda w: int_to_mask(read(w))
