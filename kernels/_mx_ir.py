"""The typed IR helpers the quantize kernels (and moe_sorting) are written with, emitted into
FlyDSL kernels: i32 arithmetic and compares on MLIR values, lanes and wave-uniform control
flow, raw-buffer and LDS access, and the cross-lane exchanges (DPP, gfx950's permlane swaps)
that combine a block split over lanes. kernels/_mx_common.py re-exports all of it, so kernels
reach it as mx.* beside the MX scale rules."""

from __future__ import annotations

import flydsl.expr as fx
from flydsl._mlir import ir
from flydsl._mlir.dialects import arith, llvm, scf, vector
from flydsl._mlir.dialects import fly as _fly
from flydsl._mlir.dialects import rocdl
from flydsl.expr.typing import as_ir_value

WAVE = 64
PIECE_BYTES = 16  # one buffer_load_dwordx4 per lane: the unit every kernel loads and converts
PIECE_DWORDS = PIECE_BYTES // 4
# Buffer resource flags word for CDNA raw buffers (DATA_FORMAT=32, NUM_FORMAT=float); the
# stride is 0, so hardware drops stores and zero-fills loads at byte offsets >= num_records.
CDNA_BUFFER_FLAGS = (7 << 12) | (4 << 15)
MAX_LAUNCH_BYTES = 1 << 31  # per buffer of one launch (offsets are non-negative i32)
OOB = MAX_LAUNCH_BYTES  # a buffer offset past every buffer's end: the access is dropped


# ------------------------------------------------------------------------------------------------
# IR helpers (i32 unless stated; Python ints become i32 constants)
# ------------------------------------------------------------------------------------------------


def i32_t():
    return ir.IntegerType.get_signless(32)


def i64_t():
    return ir.IntegerType.get_signless(64)


def v2i16_t():
    return ir.VectorType.get([2], ir.IntegerType.get_signless(16))


def v2f16_t():
    return ir.VectorType.get([2], ir.F16Type.get())


def v2bf16_t():
    return ir.VectorType.get([2], ir.BF16Type.get())


def vec_i32_t(n):
    return ir.VectorType.get([n], i32_t())


def f32_t():
    return ir.F32Type.get()


def const(v: int, ty=None):
    ty = ty or i32_t()
    width = ir.IntegerType(ty).width
    v = int(v) & ((1 << width) - 1)
    if v >= 1 << (width - 1):
        v -= 1 << width
    return arith.constant(ty, v)


def val(x):
    """An ir.Value from an ir.Value, a FlyDSL numeric or a Python int (i32)."""
    if isinstance(x, int):
        return const(x)
    if isinstance(x, float):
        return arith.constant(f32_t(), x)
    if not isinstance(x, ir.Value) and hasattr(x, "ir_value"):
        return x.ir_value()
    return x


def _operands(a, b):
    """Two ir.Values of one type: a Python int takes the type of the other operand."""
    if isinstance(a, int) and not isinstance(b, int):
        b = val(b)
        return const(a, b.type), b
    a = val(a)
    return a, const(b, a.type) if isinstance(b, int) else val(b)


def add(a, b):
    return arith.addi(*_operands(a, b))


def sub(a, b):
    return arith.subi(*_operands(a, b))


def mul(a, b):
    return arith.muli(*_operands(a, b))


def band(a, b):
    return arith.andi(*_operands(a, b))


def bor(a, b):
    return arith.ori(*_operands(a, b))


def shl(a, b):
    return arith.shli(*_operands(a, b))


def lshr(a, b):
    return arith.shrui(*_operands(a, b))


def umax(a, b):
    return arith.maxui(*_operands(a, b))


def umin(a, b):
    return arith.minui(*_operands(a, b))


def select(c, a, b):
    return arith.select(c, val(a), val(b))


def cmp_uge(a, b):
    return arith.cmpi(arith.CmpIPredicate.uge, val(a), val(b))


def cmp_ult(a, b):
    return arith.cmpi(arith.CmpIPredicate.ult, val(a), val(b))


def cmp_ule(a, b):
    return arith.cmpi(arith.CmpIPredicate.ule, *_operands(a, b))


def cmp_ne(a, b):
    return arith.cmpi(arith.CmpIPredicate.ne, *_operands(a, b))


def cmp_eq(a, b):
    return arith.cmpi(arith.CmpIPredicate.eq, val(a), val(b))


def umulhi(a, b):
    """High 32 bits of the unsigned 64-bit product (v_mul_hi_u32)."""
    return arith.mului_extended(*_operands(a, b))[1]


def usub_sat(a, b):
    """max(a - b, 0) unsigned (v_sub_u32 with clamp)."""
    return llvm.intr_usub_sat(val(a), val(b))


def to_i64(x):
    return arith.extui(i64_t(), val(x))


def bitcast(ty, x):
    return llvm.bitcast(ty, val(x))


def as_f32(x):
    return arith.bitcast(f32_t(), val(x))


def as_i32(x):
    return arith.bitcast(i32_t(), val(x))


def pk(op, a, b):
    """A lane-wise op on two 16-bit halves (v_pk_* on a dword)."""
    return bitcast(i32_t(), op(bitcast(v2i16_t(), a), bitcast(v2i16_t(), b)))


def pk_umax(a, b):
    return pk(arith.maxui, a, b)


def splat16(v: int) -> int:
    return (v & 0xFFFF) * 0x10001


def perm(hi, lo, sel):
    """v_perm_b32: byte i of the result is byte sel[i] of (hi:lo) (0-3 from lo, 4-7 from hi)."""
    return llvm.call_intrinsic(i32_t(), "llvm.amdgcn.perm", [val(hi), val(lo), val(sel)], [], [])


def alignbit(hi, lo, shift):
    """v_alignbit_b32: the low 32 bits of (hi:lo) >> (shift & 31)."""
    return llvm.call_intrinsic(i32_t(), "llvm.fshr.i32", [val(hi), val(lo), val(shift)], [], [])


def extract(vec, i):
    return vector.extract(vec, static_position=[i], dynamic_position=[])


def from_elements(values):
    return vector.from_elements(vec_i32_t(len(values)), [val(v) for v in values])


def poison(ty):
    return llvm.mlir_poison(ty)


def lane_id():
    return band(val(fx.Int32(fx.thread_idx.x)), WAVE - 1)


def readfirstlane(x):
    """The value of the first active lane (makes a wave-uniform value visible as such)."""
    return rocdl.readfirstlane(i32_t(), val(x))


def opaque_sgpr(x, tag: str = ""):
    """x (i32 or i64), hidden from LLVM's optimizations by an empty inline asm (no instruction):
    keeps a per-iteration address computation inside the loop, where constant offsets fold into
    the buffer instructions' immediate field instead of becoming strength-reduced VALU adds. A
    `tag` (an asm comment) keeps equal values apart: LLVM merges identical asm of equal operands."""
    x = val(x)
    return llvm.inline_asm(x.type, [x], f"; {tag}" if tag else "", "=s,0")


def opaque_vgprs(values):
    """The i32 values, hidden from LLVM by empty side-effecting inline asm (no instruction; a value
    not used after it keeps its register): what follows cannot share computations with what came
    before (LLVM would keep such shared values alive in between), nor be scheduled before the
    side effects emitted so far."""
    return [llvm.inline_asm(i32_t(), [val(v)], "", "=v,0", has_side_effects=True) for v in values]


def lane_word(pred_bit):
    """A per-lane word of all ones where the i32 `pred_bit` (0 or 1) is 1, else 0 (bit_select's
    choice: it stays in a VGPR, where an i1 lane mask would take an SGPR pair)."""
    return sub(0, pred_bit)


def bit_select(word, a, b):
    """word ? a : b bitwise, one v_bfi_b32 (inline asm: LLVM would otherwise turn it back into a
    select on an SGPR-pair lane mask, or split it in two)."""
    return llvm.inline_asm(i32_t(), [val(word), val(a), val(b)], "v_bfi_b32 $0, $1, $2, $3", "=v,v,v,v")


def and_or(a, b, c):
    """(a & b) | c, one v_and_or_b32 (inline asm: where c's known bits cover some of a's, LLVM
    rewrites it as a & (b | const), an OR with a literal and an AND). LLVM inserts no wait states
    around inline asm: tests/test_inline_asm_hazards.py checks the kernels using it."""
    return llvm.inline_asm(i32_t(), [val(a), val(b), val(c)], "v_and_or_b32 $0, $1, $2, $3", "=v,v,v,v")


def wave_any(pred):
    """True (i1, wave-uniform) when `pred` holds in any active lane."""
    return arith.cmpi(arith.CmpIPredicate.ne, rocdl.ballot(i64_t(), pred), arith.constant(i64_t(), 0))


def if_then(cond, body):
    """Emit `if cond: body()` (no results)."""
    op = scf.IfOp(cond, [], has_else=False)
    with ir.InsertionPoint(op.regions[0].blocks[0]):
        body()
        scf.YieldOp([])


def if_else(cond, then_body, else_body, types=()):
    """Emit `r = then_body() if cond else else_body()`: the bodies return lists of values of
    `types` (or nothing when types is empty)."""
    op = scf.IfOp(cond, list(types), has_else=True)
    if len(op.regions[1].blocks) == 0:
        op.regions[1].blocks.append()
    for region, body in zip(op.regions, (then_body, else_body)):
        with ir.InsertionPoint(region.blocks[0]):
            scf.YieldOp([val(v) for v in (body() or [])])
    return list(op.results)


# ------------------------------------------------------------------------------------------------
# Buffers (raw resources: range-checked, 32-bit offsets; launches keep each below 2 GiB)
# ------------------------------------------------------------------------------------------------


def buffer(tensor, byte_offset, nbytes):
    """A raw buffer resource over `tensor`'s bytes [byte_offset, byte_offset + nbytes):
    byte_offset i64 (or i32, unsigned), nbytes an unsigned i32 (launchers keep every buffer
    below 2 GiB, so byte offsets stay non-negative i32). Accesses at offsets >= nbytes are
    dropped (stores) or read 0 (loads); the scalar offset is added after that check."""
    base = _fly.extract_aligned_pointer_as_index(ir.Type.parse("!llvm.ptr"), as_ir_value(tensor))
    off = val(byte_offset)
    off = off if ir.IntegerType(off.type).width == 64 else to_i64(off)
    ptr = llvm.GEPOp(base.type, base, [off], [-(2**31)], ir.IntegerType.get_signless(8), None).result
    n = val(nbytes)
    n = n if ir.IntegerType(n.type).width == 64 else to_i64(n)
    return rocdl.MakeBufferRsrcOp(
        ir.Type.parse("!llvm.ptr<8>"), ptr, const(0, ir.IntegerType.get_signless(16)), n, const(CDNA_BUFFER_FLAGS)
    ).result


def wait_loads():
    """s_waitcnt vmcnt(0): one wait for all loads issued so far, instead of one per first use."""
    fx.rocdl.s_waitcnt(vmcnt=0)


def wait_lds():
    """s_waitcnt lgkmcnt(0): one wait for all LDS accesses issued so far, instead of one per first
    use of a load; a scheduling barrier keeps the uses after it."""
    fx.rocdl.s_waitcnt(lgkmcnt=0)
    fx.rocdl.sched_barrier(0)


def load(rsrc, offset, dwords=PIECE_DWORDS, soffset=0):
    ty = vec_i32_t(dwords) if dwords > 1 else i32_t()
    return rocdl.raw_ptr_buffer_load(ty, rsrc, val(offset), val(soffset))


def load_short(rsrc, offset, soffset=0):
    """A zero-extended 16-bit load (buffer_load_ushort) as an i32."""
    h = rocdl.raw_ptr_buffer_load(ir.IntegerType.get_signless(16), rsrc, val(offset), val(soffset))
    return arith.extui(i32_t(), h)


def store(data, rsrc, offset, soffset=0):
    rocdl.raw_ptr_buffer_store(val(data), rsrc, val(offset), val(soffset))


def store_short(data, rsrc, offset, soffset=0):
    """Store the low 16 bits of an i32."""
    rocdl.raw_ptr_buffer_store(arith.trunci(ir.IntegerType.get_signless(16), val(data)), rsrc, val(offset), val(soffset))


def store_byte(data, rsrc, offset, soffset=0):
    """Store the low byte of an i32."""
    rocdl.raw_ptr_buffer_store(arith.trunci(ir.IntegerType.get_signless(8), val(data)), rsrc, val(offset), val(soffset))


def lds_ptr(addr):
    return llvm.inttoptr(ir.Type.parse("!llvm.ptr<3>"), val(addr))


def lds_store(data, addr):
    """Store an i32 or a vector of them at LDS byte address `addr` (i32)."""
    data = val(data)
    dwords = data.type.shape[0] if isinstance(data.type, ir.VectorType) else 1
    llvm.StoreOp(data, lds_ptr(addr), alignment=4 * dwords)


def lds_store_short(data, addr):
    """Store the low 16 bits of an i32 at LDS byte address `addr` (i32)."""
    llvm.StoreOp(arith.trunci(ir.IntegerType.get_signless(16), val(data)), lds_ptr(addr), alignment=2)


def lds_load(dwords, addr):
    """`dwords` consecutive dwords (a vector for dwords > 1) from LDS byte address `addr` (i32)."""
    return llvm.load(vec_i32_t(dwords) if dwords > 1 else i32_t(), lds_ptr(addr), alignment=4 * dwords)


def lds_exchange_fence():
    """Between lanes' LDS stores and the wave's loads of what other lanes stored. LLVM sees each
    lane alone, so without a fence it may give a lane that stored nothing the value of its earlier
    load of the same address; a wavefront-scope fence emits no instruction (the wave's LDS
    accesses run in order)."""
    llvm.fence(llvm.AtomicOrdering.acq_rel, syncscope="wavefront")


def dwords_of(vec, n=PIECE_DWORDS):
    return [extract(vec, i) for i in range(n)]


# ------------------------------------------------------------------------------------------------
# Cross-lane exchange
# ------------------------------------------------------------------------------------------------

# DPP controls that move a value between lanes at XOR distance 1, 2 and 8.
DPP_XOR = {1: 0xB1, 2: 0x4E, 8: 0x128}  # quad_perm [1,0,3,2], quad_perm [2,3,0,1], row_ror:8
DPP_ALL = 0xF
# DPP bank masks (a bank: 4 lanes of a 16-lane row): lanes 8-15 / 0-7 of each row.
UPPER_BANKS, LOWER_BANKS = 0xC, 0x3


def dpp_xor(x, dist):
    # every lane has a source lane in these patterns, so the "old" value is never read: poison
    # spares the copy that a tied old operand would need
    return rocdl.update_dpp(i32_t(), poison(i32_t()), val(x), DPP_XOR[dist], DPP_ALL, DPP_ALL, False)


# XOR distance 4, which GFX9 DPP has no pattern for: two row rotations (by 12: lane i + 4; by 4:
# lane i - 4), each written to the lanes with bit 2 clear (banks 0, 2) or set (banks 1, 3).
DPP_ROR = {4: 0x124, 12: 0x12C}
BIT2_CLEAR_BANKS, BIT2_SET_BANKS = 0x5, 0xA


def lane_xor(x, dist):
    """x of lane (this lane) ^ dist, dist 1, 2, 4 or 8 (DPP)."""
    if dist != 4:
        return dpp_xor(x, dist)
    clear = rocdl.update_dpp(i32_t(), poison(i32_t()), val(x), DPP_ROR[12], DPP_ALL, BIT2_CLEAR_BANKS, False)
    return rocdl.update_dpp(i32_t(), clear, val(x), DPP_ROR[4], DPP_ALL, BIT2_SET_BANKS, False)


# For all-reductions over groups of 2, 4, 8 lanes (after the steps at 1 and 2): row_half_mirror
# (lane i <-> 7 - i in each 8) pairs every lane with one of the other quad, which is enough.
DPP_REDUCE = {1: DPP_XOR[1], 2: DPP_XOR[2], 4: 0x141, 8: DPP_XOR[8]}


def dpp_reduce_partner(x, dist):
    """x of a lane at distance `dist` in the reduction sense above."""
    return rocdl.update_dpp(i32_t(), poison(i32_t()), val(x), DPP_REDUCE[dist], DPP_ALL, DPP_ALL, False)


def lane_bit(dist):
    """i1: this lane is the upper one of its pair at distance `dist`."""
    return arith.cmpi(arith.CmpIPredicate.ne, band(lane_id(), dist), const(0))


def exchange(arch, a, b, dist):
    """Swap halves between lane pairs (i, i + dist): afterwards the lower lane holds
    (a_i, a_{i+dist}) and the upper lane (b_{i-dist}, b_i). A max of the two then reduces a
    over the pair in lower lanes and b in upper lanes (a reduce-scatter step)."""
    if arch == "gfx950" and dist in (16, 32):
        swap = rocdl.permlane32_swap if dist == 32 else rocdl.permlane16_swap
        pair = swap(llvm.StructType.get_literal([i32_t(), i32_t()]), val(a), val(b), False, False)
        return llvm.extractvalue(i32_t(), pair, [0]), llvm.extractvalue(i32_t(), pair, [1])
    if dist == 8:  # the pair is the two halves of a DPP row: bank masks pick who takes the move
        lo = rocdl.update_dpp(i32_t(), val(a), val(b), DPP_XOR[8], DPP_ALL, UPPER_BANKS, False)
        hi = rocdl.update_dpp(i32_t(), val(b), val(a), DPP_XOR[8], DPP_ALL, LOWER_BANKS, False)
        return lo, hi
    upper = lane_bit(dist)
    sent = dpp_xor(select(upper, a, b), dist)  # lower lanes receive the partner's a, upper its b
    return select(upper, sent, a), select(upper, b, sent)


def reduce_scatter(arch, dists, parts, combine):
    """Reduce n * 2^S registers over the lanes at `dists` (S distances): afterwards each lane
    holds n reductions, of the registers j + n * g (j < n) where g has, from the top bit down,
    the lane's bits at dists[0], dists[1], ...; returns those n values."""
    for d in dists:
        half = len(parts) // 2
        parts = [combine(*exchange(arch, parts[j], parts[j + half], d)) for j in range(half)]
    return parts


def all_gather(arch, dists, x):
    """Inverse of reduce_scatter's placement: register k of the result is `x` of the lane that
    reduce_scatter left holding register k (within this lane's group at `dists`)."""
    out = [x]
    for d in reversed(dists):
        lo_hi = [exchange(arch, v, v, d) for v in out]
        out = [lo for lo, _ in lo_hi] + [hi for _, hi in lo_hi]
    return out


def for_range_carry(count, init, body):
    """Emit a runtime loop carrying values: `values = body(i, *values)` count times; returns them."""
    loop = scf.ForOp(const(0), val(count), const(1), [val(v) for v in init])
    with ir.InsertionPoint(loop.body):
        out = body(loop.induction_variable, *loop.inner_iter_args)
        scf.YieldOp([val(v) for v in out])
    return list(loop.results)


def for_range(count, body, start=0, step=1):
    """Emit `for i in range(start, count, step): body(i)` as a runtime loop (i32 induction
    variable; a loop over the quantity the body uses spares a second one)."""
    loop = scf.ForOp(val(start), val(count), val(step))
    with ir.InsertionPoint(loop.body):
        body(loop.induction_variable)
        scf.YieldOp([])
