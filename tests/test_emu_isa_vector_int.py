"""Per-instruction tests of the flyquant.emu interpreter, continued (test_emu_isa.py says how):
vector instructions the kernels execute that the other files do not name. Integer and bitwise
VALU (16-bit ops, 64-bit shifts and moves, VCC halves and float inline constants as sources),
u32/i32 compares and v_cndmask under partial EXEC, VOP2 DPP with an invalid source lane, LDS
writes and adds, buffer_atomic_pk_add_bf16, and MFMAs over every operand code (their scalar
operands: test_emu_isa_scalar.py). Expected values are the CDNA3/CDNA4 pseudocode
(tinygrad/runtime/autogen/amd/cdna/str_pcode.py) on Python integers, exact rationals (emu_xref)
for bf16 rounding, torch for decoding FP8/BF16 MFMA operands.
"""

from __future__ import annotations

import emu_xref as X
import numpy as np
import pytest
import torch
from tinygrad.renderer.amd.dsl import DPP, VCC, s, src, v
from tinygrad.runtime.autogen.amd.cdna import ins as I

from flyquant.emu.errors import EmuError
from flyquant.emu.memory import Memory

from test_emu_isa import ARCHS, FULL, run
from test_emu_isa_crosscheck_alu import rand_u32
from test_emu_isa_crosscheck_packed import _dpp_source

M32, M64 = 0xFFFFFFFF, (1 << 64) - 1
EXECS = [FULL, 0x5A5A_F0F0_0FF0_1234]  # all lanes; a mask with lanes off in both halves and every row
VCC_LO, VCC_HI = src[106], src[107]


def _s32(x: int) -> int:
    return x - (1 << 32) if x >> 31 else x


# --- integer and bitwise VALU ------------------------------------------------------------------------
@pytest.mark.parametrize("ex", EXECS, ids=["full", "partial"])
@pytest.mark.parametrize("arch", ARCHS)
def test_integer_bitwise_ops_and_their_operand_forms(arch, ex):
    rng = np.random.default_rng(1)
    a, b, lo, hi = (rand_u32(rng) for _ in range(4))
    a[:8] = [0, 1, 15, 16, 31, 32, 63, 64]  # shift amounts at and past 16/32/64 (they are masked)
    b[:4] = [0xFFFF, 0x8000FFFF, M32, 0x80000000]
    insts = [
        I.v_add_u16_e32(v[10], 5, v[1]),  # D.u16 = S0.u16 + S1.u16, wraps; GFX9 zeroes D[31:16]
        I.v_lshlrev_b16_e32(v[11], 5, v[1]),  # D.u16 = S1.u16 << S0[3:0]
        I.v_lshlrev_b16_e32(v[12], v[0], v[1]),
        I.v_lshlrev_b64(v[14:15], v[0], -1),  # D.u64 = S1.u64 << S0[5:0]; inline -1 is 64 bits of ones
        I.v_lshlrev_b64(v[16:17], v[0], v[2:3]),
        I.v_mov_b64_e32(v[20:21], s[0:1]),
        I.v_mov_b64_e32(v[22:23], v[2:3]),
        I.v_not_b32_e32(v[24], v[1]),
        I.v_xor_b32_e32(v[25], VCC_LO, v[1]),  # the VCC halves as ordinary scalar sources
        I.v_xor_b32_e32(v[26], VCC_HI, v[1]),
        I.v_min_u32_e32(v[27], 5, v[0]),
        I.v_subrev_u32_e32(v[28], 5, v[1]),  # "rev": D = S1 - S0
        I.v_subrev_u32_e32(v[29], s[2], v[1]),
        I.v_and_b32_e32(v[30], s[0], v[1]),
        I.v_and_or_b32(v[31], v[1], s[0], 0.5),  # a float inline constant in a u32 operand: 0x3F000000
    ]
    init = {r: 0xCAFEBABE for r in range(10, 32)}
    w, _ = run(arch, *insts, sgpr={0: 0x12345678, 1: 0x9ABCDEF0, 2: 37, 106: 0xDEADBEEF, 107: 0x0BADF00D},
               vgpr={**init, 0: a, 1: b, 2: lo, 3: hi}, exec_mask=ex)
    for lane in range(64):
        x, y, z = int(a[lane]), int(b[lane]), int(lo[lane]) | int(hi[lane]) << 32
        got = {r: int(w.v[r, lane]) for r in range(10, 32) if r not in (13, 18, 19)}
        if not ex >> lane & 1:  # EXEC off: nothing written
            assert set(got.values()) == {0xCAFEBABE}, lane
            continue
        ones = (M64 << (x & 63)) & M64
        zsh = (z << (x & 63)) & M64
        want = {10: (5 + y) & 0xFFFF, 11: (y << 5) & 0xFFFF, 12: (y << (x & 15)) & 0xFFFF,
                14: ones & M32, 15: ones >> 32, 16: zsh & M32, 17: zsh >> 32,
                20: 0x12345678, 21: 0x9ABCDEF0, 22: z & M32, 23: z >> 32,
                24: ~y & M32, 25: y ^ 0xDEADBEEF, 26: y ^ 0x0BADF00D, 27: min(5, x),
                28: (y - 5) & M32, 29: (y - 37) & M32, 30: y & 0x12345678, 31: (y & 0x12345678) | 0x3F000000}
        assert got == want, (lane, {r: (hex(got[r]), hex(want[r])) for r in want if got[r] != want[r]})


# --- compares and v_cndmask ------------------------------------------------------------------------
VOPC = {"eq_u32": lambda a, b: a == b, "ne_u32": lambda a, b: a != b, "lt_u32": lambda a, b: a < b,
        "le_u32": lambda a, b: a <= b, "gt_u32": lambda a, b: a > b, "lt_i32": lambda a, b: _s32(a) < _s32(b),
        "le_i32": lambda a, b: _s32(a) <= _s32(b), "gt_i32": lambda a, b: _s32(a) > _s32(b),
        "ge_i32": lambda a, b: _s32(a) >= _s32(b)}


@pytest.mark.parametrize("ex", EXECS, ids=["full", "partial"])
@pytest.mark.parametrize("arch", ARCHS)
def test_v_cmp_u32_i32_masks_with_scalar_src0(arch, ex):
    # D.u64[lane] = S0 <op> S1 for active lanes and 0 for the others (the destination pair starts
    # 0xAAAAAAAA so kept bits would show); src0 an SGPR, inline integers (-5 is 0xFFFFFFFB: signed
    # and unsigned disagree) or a float inline constant (0.5 compares as 0x3F000000); _e32 writes VCC
    rng = np.random.default_rng(2)
    b = rand_u32(rng)
    b[:10] = [0, 1, 5, M32, 0x80000000, 0x7FFFFFFF, 0x12345678, 0xFFFFFFFB, 4, 0x3F000000]
    for src0, value in ((s[0], 0x12345678), (s[0], 0x80000000), (5, 5), (-5, 0xFFFFFFFB), (0.5, 0x3F000000)):
        insts = [getattr(I, f"v_cmp_{name}_e64")(s[10 + 2 * k:11 + 2 * k], src0, v[1]) for k, name in enumerate(VOPC)]
        sgpr = {0: value, **{10 + i: 0xAAAAAAAA for i in range(2 * len(VOPC))}}
        w, _ = run(arch, *insts, I.v_cmp_lt_u32_e32(src0, v[1]), sgpr=sgpr, vgpr={1: b}, exec_mask=ex)
        for k, (name, pred) in enumerate(list(VOPC.items()) + [("vcc lt_u32", VOPC["lt_u32"])]):
            want = sum(1 << lane for lane in range(64) if ex >> lane & 1 and pred(value, int(b[lane])))
            reg = 10 + 2 * k if k < len(VOPC) else 106
            assert w.s[reg] | w.s[reg + 1] << 32 == want, (name, hex(value))


@pytest.mark.parametrize("ex", EXECS, ids=["full", "partial"])
@pytest.mark.parametrize("arch", ARCHS)
def test_v_cndmask_with_constant_sgpr_and_vcc_selectors(arch, ex):
    # D = mask[lane] ? S1 : S0 with the mask an SGPR pair (VOP3) or VCC; the constants -1, -2, -3,
    # 4, 7 are sign-extended integers, 0.5 and 1.0 their f32 bit patterns; inactive lanes kept
    rng = np.random.default_rng(3)
    a = rand_u32(rng)
    m = int(rng.integers(0, 1 << 63)) | 1 << 63
    vcc = ~m & M64
    insts = [I.v_cndmask_b32_e64(v[2], -1, v[0], s[4:5]), I.v_cndmask_b32_e64(v[3], 0.5, 4, s[4:5]),
             I.v_cndmask_b32_e64(v[4], 1.0, 7, VCC), I.v_cndmask_b32_e64(v[5], v[0], -3, VCC),
             I.v_cndmask_b32_e32(v[6], -2, v[0]), I.v_cndmask_b32_e32(v[7], 0.5, v[0])]
    w, _ = run(arch, *insts, sgpr={4: m & M32, 5: m >> 32, 106: vcc & M32, 107: vcc >> 32},
               vgpr={0: a, **{r: 0x11111111 for r in range(2, 8)}}, exec_mask=ex)
    for lane in range(64):
        x, sm, vc = int(a[lane]), m >> lane & 1, vcc >> lane & 1
        want = [x if sm else M32, 4 if sm else 0x3F000000, 7 if vc else 0x3F800000, (-3 & M32) if vc else x,
                x if vc else (-2 & M32), x if vc else 0x3F000000]
        got = [int(w.v[r, lane]) for r in range(2, 8)]
        assert got == (want if ex >> lane & 1 else [0x11111111] * 6), lane


# --- DPP, LDS, buffer atomics ----------------------------------------------------------------------
@pytest.mark.parametrize("ctrl", [0x111, 0x142, 0x143], ids=["row_shr1", "row_bcast15", "row_bcast31"])
@pytest.mark.parametrize("arch", ARCHS)
def test_vop2_dpp_invalid_source_lane_with_and_without_bound_ctrl(arch, ctrl):
    # v_add_u32_dpp D = src0[source lane] + S1: a source lane that does not exist or has EXEC off
    # reads 0 with bound_ctrl (D = S1) and leaves D unwritten without it; row/bank masks disable lanes
    rng = np.random.default_rng(ctrl)
    a, b = rand_u32(rng), rand_u32(rng)
    for row_mask, bank_mask, bc in ((0xF, 0xF, 0), (0xF, 0xF, 1), (0xA, 0xF, 0), (0xF, 0x6, 1), (0x5, 0x9, 0)):
        for ex in (FULL, int(rng.integers(0, 1 << 63)) << 1 | 1):
            inst = I.VOP2_DPP16(I.VOP2Op.V_ADD_U32_E32, vdst=v[2], src0=DPP, vsrc0=v[0], vsrc1=v[1], dpp=ctrl,
                                row_mask=row_mask, bank_mask=bank_mask, bc=bc)
            w, _ = run(arch, inst, vgpr={0: a, 1: b, 2: 0x5EED}, exec_mask=ex)
            for lane in range(64):
                s_lane, exists = _dpp_source(ctrl, lane)
                enabled = row_mask >> (lane // 16) & 1 and bank_mask >> (lane % 16 // 4) & 1 and ex >> lane & 1
                if not enabled:
                    want = 0x5EED
                elif exists and ex >> s_lane & 1:
                    want = (int(a[s_lane]) + int(b[lane])) & M32
                else:
                    want = int(b[lane]) if bc else 0x5EED
                assert int(w.v[2, lane]) == want, (row_mask, bank_mask, bc, lane)


@pytest.mark.parametrize("arch", ARCHS)
def test_ds_write2_b32_write_b64_and_colliding_ds_add_u32(arch):
    # ds_write2_b32: MEM[ADDR + 4 OFFSET0] = DATA, MEM[ADDR + 4 OFFSET1] = DATA2; ds_write_b64 and
    # ds_add_u32 at ADDR + {OFFSET1, OFFSET0}. Adds to the same dword from several lanes all land
    # (no return value: order does not matter). Lanes with EXEC off do nothing.
    rng = np.random.default_rng(9)
    size = 4096
    for rep in range(4):
        ex = FULL if rep == 0 else int(rng.integers(0, 1 << 64, dtype=np.uint64)) | 1
        slots = rng.permutation(64).astype(np.uint32)  # distinct per lane within each instruction
        a2, a64 = slots * 4, 1536 + slots * 8
        aadd = 2560 + rng.integers(0, 8, 64).astype(np.uint32) * 4  # 64 lanes onto 8 dwords
        o0, o1 = int(rng.integers(0, 64)), int(rng.integers(128, 192))  # disjoint: [4 o0, 4 o0 + 256), ...
        off64, offadd = int(rng.integers(0, 256)) * 4, int(rng.integers(0, 64)) * 4
        d = [rand_u32(rng) for _ in range(5)]
        w, _ = run(arch, I.ds_write2_b32(addr=v[0], data0=v[10], data1=v[11], offset0=o0, offset1=o1),
                   I.ds_write_b64(addr=v[1], data0=v[12:13], offset0=off64 & 0xFF, offset1=off64 >> 8),
                   I.ds_add_u32(addr=v[2], data0=v[14], offset0=offadd & 0xFF, offset1=offadd >> 8),
                   vgpr={0: a2, 1: a64, 2: aadd, **{10 + k: d[k] for k in range(5)}}, exec_mask=ex, lds=size)
        lds = np.zeros(size, np.uint8)

        def put(addr, val, n):
            lds[addr:addr + n] = np.frombuffer(int(val).to_bytes(n, "little"), np.uint8)
        active = [lane for lane in range(64) if ex >> lane & 1]
        for lane in active:  # instruction by instruction: the b64 region overlaps the add targets
            put(int(a2[lane]) + 4 * o0, d[0][lane], 4)
            put(int(a2[lane]) + 4 * o1, d[1][lane], 4)
        for lane in active:
            put(int(a64[lane]) + off64, int(d[2][lane]) | int(d[3][lane]) << 32, 8)
        for lane in active:
            at = int(aadd[lane]) + offadd
            put(at, (int.from_bytes(lds[at:at + 4].tobytes(), "little") + int(d[4][lane])) & M32, 4)
        bad = np.flatnonzero(w.wg.lds != lds)
        assert bad.size == 0, (rep, bad[:8])


def _bf16_add(x, y):
    """bf16 + bf16 rounded once to nearest even (denormals kept), IEEE specials; 'nan' for a NaN
    (NaN payloads are not checked, and a NaN stays a NaN through later adds)."""
    if "nan" in (x, y):
        return "nan"
    vx, vy = X.exact(x, 8, 7), X.exact(y, 8, 7)
    if "nan" in (vx, vy) or {vx, vy} == {"inf", "-inf"}:
        return "nan"
    for inf in ("inf", "-inf"):
        if inf in (vx, vy):
            return X.to_ieee(inf, 8, 7)
    total = vx + vy
    if total == 0:  # x + (-x) = +0; -0 + -0 = -0
        return 0x8000 if x & y & 0x8000 else 0
    return X.to_ieee(total, 8, 7)


def test_buffer_atomic_pk_add_bf16_colliding_lanes_and_range_check():
    # MEM[ADDR] = {hi + DATA.hi, lo + DATA.lo} in bf16, lanes in order (several lanes hit the same
    # dword); a lane whose inst_offset + VGPR offset + 4 passes num_records does nothing; EXEC off
    # lanes do nothing; with an SGPR offset, a lane in range only without it stops the launch (the
    # two readings of the range check, flyquant.emu.isa_mem). gfx950 only: gfx942 has the global
    # form alone (test_moe_gemm2_kernel checks the kernels use it there)
    rng = np.random.default_rng(10)
    specials = [0x0000, 0x8000, 0x7F80, 0xFF80, 0x7FC0, 0x0001, 0x807F, 0x7F7F, 0xFF7F, 0x3F80, 0xBF80, 0x4380,
                0x3B80]
    n, inst_off, soffset, num_records = 80, 8, 0, 4 * 70
    for rep in range(4):
        h = rng.integers(0, 1 << 16, (n, 2))
        h[:len(specials), 0] = specials
        h[::3, 1] = rng.choice(specials, len(h[::3]))
        buf = (h[:, 0] | h[:, 1] << 16).astype(np.uint32)
        dh = rng.integers(0, 1 << 16, (64, 2))
        dh[::2, 0] = rng.choice(specials, 32)
        slots = rng.permutation(np.arange(2, n))[:64].astype(np.uint32)  # VGPR offsets 4 * slot - 8 >= 0
        if rep == 1:
            slots[:8] = slots[8:16]  # collisions
        ex = FULL if rep < 2 else int(rng.integers(0, 1 << 64, dtype=np.uint64))
        voff = (slots * 4 - inst_off - soffset).astype(np.uint32)
        want = [[int(lo), int(hi)] for lo, hi in h]  # per dword, per half: bits or "nan"
        base = buf.ctypes.data
        sgpr = {4: base & M32, 5: (base >> 32) & 0xFFFF, 6: num_records, 7: (7 << 12) | (4 << 15), 8: soffset}
        inst = I.buffer_atomic_pk_add_bf16(vdata=v[2], vaddr=v[0], srsrc=s[4:7], soffset=s[8], offen=1, offset=inst_off)
        run("gfx950", inst, sgpr=sgpr, vgpr={0: voff, 2: (dh[:, 0] | dh[:, 1] << 16).astype(np.uint32)}, exec_mask=ex,
            memory=Memory())
        for lane in range(64):
            if ex >> lane & 1 and int(voff[lane]) + inst_off + 4 <= num_records:
                i = int(slots[lane])
                want[i] = [_bf16_add(want[i][k], int(dh[lane, k])) for k in (0, 1)]
        for i in range(n):
            for k in (0, 1):
                got = int(buf[i]) >> (16 * k) & 0xFFFF
                assert X.is_nan_bits(got, 8, 7) if want[i][k] == "nan" else got == want[i][k], (rep, i, k, hex(got))
    voff[0] = 4 * 70 - inst_off - 4  # in range by VGPR + instruction offset, past the end with 4 more
    with pytest.raises(EmuError, match="in range by one reading"):
        run("gfx950", inst, sgpr={**sgpr, 8: 4}, vgpr={0: voff, 2: 0}, memory=Memory())


# --- MFMA over every operand code --------------------------------------------------------------------
def _mfma_registers(abits, bbits, per_lane, bits):
    """A (16 x K) and B (K x 16) codes in the layout of AMD's matrix instruction calculator (see
    test_gfx942_mfma_layout_of_amds_calculator): lane l holds row / column l % 16, k = per_lane *
    (l // 16) + e as element e (little-endian) of its registers; A in registers 0.., B after."""
    n = per_lane * bits // 32
    regs = {r: np.zeros(64, np.uint32) for r in range(2 * n)}
    for lane in range(64):
        row, grp = lane % 16, lane // 16
        for e in range(per_lane):
            kk = per_lane * grp + e
            regs[e * bits // 32][lane] |= np.uint32(int(abits[row, kk]) << (e * bits % 32))
            regs[n + e * bits // 32][lane] |= np.uint32(int(bbits[kk, row]) << (e * bits % 32))
    return regs, n


def _decode(codes, dtype):
    if dtype == torch.bfloat16:
        return torch.from_numpy(codes.astype(np.uint16).view(np.int16)).view(torch.bfloat16).double().numpy()
    return torch.from_numpy(codes.astype(np.uint8)).view(dtype).double().numpy()


@pytest.mark.parametrize("arch,name,dtype,k,per_lane", [
    ("gfx942", "v_mfma_f32_16x16x32_fp8_fp8", torch.float8_e4m3fnuz, 32, 8),
    ("gfx942", "v_mfma_f32_16x16x16_bf16", torch.bfloat16, 16, 4),
    ("gfx950", "v_mfma_f32_16x16x32_bf16", torch.bfloat16, 32, 8)])
def test_mfma_over_all_operand_codes_with_inline_zero_c(arch, name, dtype, k, per_lane):
    # D = A @ B + 0 (C the inline constant 0) with A, B random codes: FNUZ FP8 takes all 256 (0x80
    # is its NaN: reps 0, 1 avoid it and check values, 2, 3 check NaN rows/columns); BF16 moderate
    # exponents plus Inf, NaN, a denormal and -0. The guides do not fix the summation order or
    # internal precision: a finite result must be within 2^-22 relative of the exact value (torch
    # decodes the codes; float64 holds every product exactly and sums them far more precisely);
    # NaN and Inf results must be where the reference has them (only finite values are subtracted).
    rng = np.random.default_rng(1)
    bits = 16 if dtype == torch.bfloat16 else 8
    for rep in range(4):
        if bits == 8:
            a, b = rng.integers(0, 256, (16, k)), rng.integers(0, 256, (k, 16))
            if rep < 2:
                a[a == 0x80], b[b == 0x80] = 0x81, 0x01
        else:
            def codes(shape):
                sign, exponent = rng.integers(0, 2, shape), rng.integers(110, 140, shape)
                return sign << 15 | exponent << 7 | rng.integers(0, 128, shape)
            a, b = codes((16, k)), codes((k, 16))
            if rep >= 2:
                a[0, 0], a[1, 3], b[2, 5], b[4, 4] = 0x7F80, 0xFFC1, 0x0001, 0x8000
        regs, n = _mfma_registers(a, b, per_lane, bits)
        w, _ = run(arch, getattr(I, name)(v[8:11], v[0:n - 1], v[n:2 * n - 1], 0), vgpr=regs)
        got = np.zeros((16, 16), np.float64)
        for lane in range(64):
            for r in range(4):
                got[4 * (lane // 16) + r, lane % 16] = w.v[8 + r, lane].view(np.float32)
        want = _decode(a, dtype) @ _decode(b, dtype)  # NaN where a NaN code meets, +-Inf from the Inf code
        nan, inf = np.isnan(want), np.isinf(want)
        assert np.array_equal(np.isnan(got), nan), rep
        assert np.array_equal(got[inf], want[inf]), rep
        finite = ~nan & ~inf
        assert (np.abs(got[finite] - want[finite]) <= np.abs(want[finite]) * 2.0**-22).all(), rep


# --- carry edges (mutation testing found the random tests never reach them) -------------------------
def test_v_add_co_u32_carries_only_past_2_pow_32():
    # V_ADD_CO_U32: VCC[lane] = the 33rd bit of the sum: 0xFFFFFFFE + 1 = 0xFFFFFFFF does not carry,
    # 0xFFFFFFFF + 1 = 2^32 does (result 0)
    a = np.full(64, M32 - 1, np.uint32)
    a[1::2] = M32
    w, _ = run("gfx942", I.v_add_co_u32_e32(v[2], 1, v[0]), vgpr={0: a})
    assert (w.v[2, 0::2] == M32).all() and (w.v[2, 1::2] == 0).all()
    assert (w.s[106], w.s[107]) == (0xAAAAAAAA, 0xAAAAAAAA)  # VCC: the odd lanes


def test_v_mad_u64_u32_carry_edges():
    # {D1.u1, D0.u64} = 65'U(S0) * 65'U(S1) + 65'U(S2.u64): an addend of 0 never carries (the kernels'
    # address idiom); (2^32 - 1)^2 + (2^33 - 1) = 2^64 exactly: D0 = 0 with the carry
    x = np.full(64, M32, np.uint32)
    lo, hi = np.zeros(64, np.uint32), np.zeros(64, np.uint32)
    lo[1::2], hi[1::2] = M32, 1  # 2^33 - 1 on the odd lanes
    w, _ = run("gfx942", I.v_mad_u64_u32(v[2:3], s[0:1], v[0], v[0], v[4:5]), vgpr={0: x, 4: lo, 5: hi})
    assert (w.v[2, 1::2] == 0).all() and (w.v[3, 1::2] == 0).all()
    assert (w.v[2, 0::2] == 1).all() and (w.v[3, 0::2] == M32 - 1).all()  # (2^32 - 1)^2
    assert (w.s[0], w.s[1]) == (0xAAAAAAAA, 0xAAAAAAAA)  # the carry: odd lanes only
