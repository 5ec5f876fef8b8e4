"""Randomized differential tests of flyquant.emu's number-format conversions against an
independent reference (tests/emu_xref.py: exact rational rounding from the format definitions)
and, where it applies, torch's own float8 casts.

Each test assembles one instruction with tinygrad's CDNA classes, runs it over several batches
of 64 lanes (random values spread over the target format's whole range, every rounding tie
between neighbouring codes and the codes just beside it, the special values), and compares
every lane bit for bit. A NaN result is checked to be a NaN of the format; its payload is not
(the ISA guides do not define it). What the references assume and what stays unverified
without hardware is said at each test.
"""

from __future__ import annotations

import zlib
from fractions import Fraction as Fr

import emu_xref as X
import numpy as np
import pytest
import torch
from test_emu_isa import run
from test_emu_isa_triton import SET_FP16_OVFL
from tinygrad.renderer.amd.dsl import SDWA, v
from tinygrad.runtime.autogen.amd.cdna import ins as I

ARCHS = ("gfx942", "gfx950")
SPECIAL_F32 = [0x00000000, 0x80000000, 0x7F800000, 0xFF800000, 0x7FC00000, 0xFFC00001, 0x7F800001, 0x00000001,
               0x807FFFFF, 0x00800000, 0x7F7FFFFF, 0xFF7FFFFF]


def _lanes(values) -> list[np.ndarray]:
    """uint32 values in batches of 64 lanes (the last one padded with zeros)."""
    a = np.asarray(values, np.uint64).astype(np.uint32)
    a = np.concatenate([a, np.zeros(-len(a) % 64, np.uint32)])
    return list(a.reshape(-1, 64))


def format_inputs(fmt: X.Narrow, seed: int, n: int = 384, scale_exp: int = 0) -> np.ndarray:
    """f32 bit patterns for a conversion to `fmt` (values times 2**scale_exp): random ones from
    below its smallest subnormal to past its largest value, each midpoint between neighbouring
    magnitudes (0 and max's virtual successor included) and the f32 values on either side of it."""
    rng = np.random.default_rng(seed)
    lo = 127 + fmt.emin - fmt.mbits - 3 + scale_exp
    hi = 127 + X.floor_log2(fmt.max) + 3 + scale_exp
    e = rng.integers(max(lo, 1), min(hi, 254), n)
    out = list(e.astype(np.uint32) << 23 | rng.integers(0, 1 << 23, n).astype(np.uint32)
               | rng.integers(0, 2, n).astype(np.uint32) << 31)
    mags = sorted(fmt.by_value)
    ulp_max = Fr(2) ** (X.floor_log2(fmt.max) - fmt.mbits)
    for a, b in zip(mags, mags[1:] + [fmt.max + ulp_max]):
        mid = (a + b) / 2 * Fr(2) ** scale_exp
        m = X.f32_bits(float(mid))  # exact: few significant bits
        for bits in (m, m - 1, m + 1):
            out += [bits, bits | 0x80000000]
    return np.array(out + SPECIAL_F32, np.uint64).astype(np.uint32)


def check_code(fmt: X.Narrow, got: int, want, what):
    if want == "nan":
        assert fmt.value_of[got] == "nan", (what, hex(got))
    else:
        assert got == want, (what, hex(got), hex(want))


# --- f32 -> FP8/BF8 (v_cvt_pk_fp8_f32 / v_cvt_pk_bf8_f32): OCP on gfx950, FNUZ on gfx942 --------------
@pytest.mark.parametrize("arch", ARCHS)
@pytest.mark.parametrize("bf8", [False, True])
@pytest.mark.parametrize("saturate", [False, True])
def test_cvt_pk_f8_f32_rounds_like_the_format_definition(arch, bf8, saturate):
    # RNE to the format; past the largest value: NaN (E4M3, both FNUZ) / Inf (OCP E5M2), or with
    # MODE.FP16_OVFL the largest value. Inf inputs under FP16_OVFL are left out: the emulator
    # keeps them Inf/NaN (its reading of "true infinities are kept"), the ISA guides say no more.
    fmt = X.FORMATS[arch][bf8]
    inst = (I.v_cvt_pk_bf8_f32 if bf8 else I.v_cvt_pk_fp8_f32)(v[2], v[0], v[1])
    vals = format_inputs(fmt, seed=1 + bf8)
    if saturate:
        vals = vals[(vals & 0x7FFFFFFF) != 0x7F800000]
    batches = _lanes(vals)
    for k, a in enumerate(batches):
        b = batches[(k + 1) % len(batches)]
        w, _ = run(arch, *((SET_FP16_OVFL,) if saturate else ()), inst, vgpr={0: a, 1: b, 2: 0xA5A50000})
        for lane in range(64):
            got = int(w.v[2, lane])
            assert got >> 16 == 0xA5A5
            for x, code in ((int(a[lane]), got & 0xFF), (int(b[lane]), got >> 8 & 0xFF)):
                check_code(fmt, code, fmt.encode(X.exact(x), saturate, neg=bool(x >> 31)), hex(x))


@pytest.mark.parametrize("arch", ARCHS)
def test_cvt_pk_f8_f32_agrees_with_torch_float8_in_range(arch):
    # A second opinion on the in-range rounding: torch's float8 casts (c10's own code), whose
    # E4M3FN cast saturates (so values past 464 are left out), the others do not.
    for bf8, dtype in enumerate({"gfx950": (torch.float8_e4m3fn, torch.float8_e5m2),
                                 "gfx942": (torch.float8_e4m3fnuz, torch.float8_e5m2fnuz)}[arch]):
        fmt = X.FORMATS[arch][bf8]
        vals = format_inputs(fmt, seed=11 + bf8)
        vals = vals[np.abs(vals.view(np.float32)) < np.float32(460)] if fmt is X.OCP_E4M3 else vals
        vals = vals[~np.isnan(vals.view(np.float32))]
        want = torch.from_numpy(vals.view(np.float32).copy()).to(dtype).view(torch.uint8).numpy()
        for a, ref in zip(_lanes(vals), _lanes(want)):
            w, _ = run(arch, (I.v_cvt_pk_bf8_f32 if bf8 else I.v_cvt_pk_fp8_f32)(v[2], v[0], v[0]), vgpr={0: a})
            assert np.array_equal(w.v[2] & 0xFF, ref), (arch, bf8)


# --- FP8/BF8 -> f32: every code ---------------------------------------------------------------------------
@pytest.mark.parametrize("arch", ARCHS)
@pytest.mark.parametrize("bf8", [False, True])
def test_every_f8_code_widens_to_its_value(arch, bf8):
    # v_cvt_pk_f32_{fp8,bf8} (word 0 via VOP1, word 1 via SDWA src0_sel WORD_1) and
    # v_cvt_f32_{fp8,bf8} with SDWA byte 3: all 256 codes, exact f32 values, NaN codes -> NaN
    fmt = X.FORMATS[arch][bf8]
    codes = np.arange(256, dtype=np.uint32)
    words = codes.reshape(64, 4)
    packed = (words[:, 0] | words[:, 1] << 8 | words[:, 2] << 16 | words[:, 3] << 24).astype(np.uint32)
    pk = I.VOP1Op.V_CVT_PK_F32_BF8_E32 if bf8 else I.VOP1Op.V_CVT_PK_F32_FP8_E32
    one = I.VOP1Op.V_CVT_F32_BF8_E32 if bf8 else I.VOP1Op.V_CVT_F32_FP8_E32
    insts = [(I.v_cvt_pk_f32_bf8_e32 if bf8 else I.v_cvt_pk_f32_fp8_e32)(v[2:3], v[0]),
             I.VOP1_SDWA(pk, vdst=v[4:5], src0=SDWA, vsrc0=v[0], dst_sel=6, dst_unused=0, src0_sel=5),
             I.VOP1_SDWA(one, vdst=v[6], src0=SDWA, vsrc0=v[0], dst_sel=6, dst_unused=0, src0_sel=3)]
    w, _ = run(arch, *insts, vgpr={0: packed})
    got = {0: w.v[2], 1: w.v[3], 2: w.v[4], 3: w.v[5]}
    for lane in range(64):
        for j in range(4):
            code = int(words[lane, j])
            want = fmt.value_of[code]
            bits = int(got[j][lane])
            if want == "nan":
                assert X.is_nan_bits(bits, 8, 23), (hex(code), hex(bits))
            else:  # a zero keeps the code's sign (OCP -0 is 0x80; FNUZ 0x80 is NaN)
                assert bits == X.to_ieee(want, 8, 23) | (code >> 7 << 31 if want == 0 else 0), (hex(code), hex(bits))
        assert int(w.v[6, lane]) == int(got[3][lane]) or X.is_nan_bits(int(w.v[6, lane]), 8, 23)


# --- gfx950 scaled narrowing: x / 2**(s - 127), s the scale operand's exponent field --------------------
def _scale_operands(rng, n):
    """Scale operands: exponent field 100..154 and the extremes 0, 1, 254; random sign and
    mantissa (ignored: only the exponent field is the E8M0 scale)."""
    e = np.concatenate([rng.integers(100, 155, n - 3), [0, 1, 254]])
    return (e.astype(np.uint32) << 23 | rng.integers(0, 1 << 23, n).astype(np.uint32)
            | rng.integers(0, 2, n).astype(np.uint32) << 31).astype(np.uint32)


def _scaled_ref(fmt, x_bits, scale_bits, ebits=8, mbits=23):
    """Code of x / 2**(s - 127) for an IEEE-format input x (f32 default, f16, bf16)."""
    nb = 1 + ebits + mbits
    s = scale_bits >> 23 & 0xFF
    x = X.exact(x_bits, ebits, mbits)
    neg = bool(x_bits >> (nb - 1) & 1)
    if s == 0xFF:
        x = "nan"  # an E8M0 NaN scale
    elif isinstance(x, Fr):
        x = x / Fr(2) ** (s - 127)
    return fmt.encode(x, neg=neg)


def _check_fp4(got, want, x):
    # FP4 has no NaN: a NaN input or scale gives the largest magnitude (AMD's host model of
    # the gfx950 conversion); its sign is not checked
    if want == "nan":
        assert got & 7 == 7, (hex(x), hex(got))
    else:
        assert got == want, (hex(x), hex(got), hex(want))


@pytest.mark.parametrize("bf8", [False, True])
def test_scalef32_pk_f8_f32_divides_exactly(bf8):
    fmt = X.FORMATS["gfx950"][bf8]
    rng = np.random.default_rng(21 + bf8)
    inst = (I.v_cvt_scalef32_pk_bf8_f32 if bf8 else I.v_cvt_scalef32_pk_fp8_f32)(v[3], v[0], v[1], v[2], opsel=8)
    for k in range(6):
        sc = _scale_operands(rng, 64)
        sexp = int((sc[k] >> 23 & 0xFF)) - 127
        a, = _lanes(format_inputs(fmt, seed=30 + k, n=64, scale_exp=max(min(sexp, 100), -100))[:64])
        b = (a[::-1] ^ np.uint32(0x80000000)).astype(np.uint32)
        w, _ = run("gfx950", inst, vgpr={0: a, 1: b, 2: sc, 3: 0x5A5A})
        for lane in range(64):
            got = int(w.v[3, lane])
            assert got & 0xFFFF == 0x5A5A
            for x, code in ((int(a[lane]), got >> 16 & 0xFF), (int(b[lane]), got >> 24)):
                check_code(fmt, code, _scaled_ref(fmt, x, int(sc[lane])), (hex(x), hex(int(sc[lane]))))


def _halves_inputs(rng, ebits, mbits, n=64):
    """Random 16-bit float patterns (f16: 5/10, bf16: 8/7) over the whole range plus specials."""
    nb = 1 + ebits + mbits
    h = rng.integers(0, 1 << nb, n).astype(np.uint32)
    h[:6] = [0, 1 << (nb - 1), ((1 << ebits) - 1) << mbits, ((1 << ebits) - 1) << mbits | 1, 1, 0x3C00 if
             ebits == 5 else 0x3F80]
    return h


@pytest.mark.parametrize("src", ["f16", "bf16"])
@pytest.mark.parametrize("out", ["fp8", "bf8", "fp4"])
def test_scalef32_pk_narrowing_of_16bit_halves(src, out):
    # v_cvt_scalef32_pk_{fp8,bf8}_{f16,bf16} into the op_sel[3] half; _pk_fp4_{f16,bf16} into
    # byte op_sel[3:2]; low half of S0 -> low code. Scale exponent fields 112..142 keep the
    # 16-bit inputs' range over the format's (f16 spans 2**-24 .. 65504).
    ebits, mbits = (5, 10) if src == "f16" else (8, 7)
    fmt = {"fp8": X.OCP_E4M3, "bf8": X.OCP_E5M2, "fp4": X.E2M1}[out]
    rng = np.random.default_rng(zlib.crc32(f"{src} {out}".encode()))
    name = f"v_cvt_scalef32_pk_{out}_{src}"
    for opsel in (0, 8, 4, 12):
        lo, hi = _halves_inputs(rng, ebits, mbits), _halves_inputs(rng, ebits, mbits)[::-1]
        sc = (rng.integers(112, 143, 64).astype(np.uint32) << 23 | rng.integers(0, 1 << 23, 64).astype(np.uint32))
        sc[:2] = [0x7F800000, 0x3F800000]  # scale exponent 255 (NaN) and 127 (1.0)
        w, _ = run("gfx950", getattr(I, name)(v[3], v[0], v[1], opsel=opsel),
                   vgpr={0: (lo | hi << 16).astype(np.uint32), 1: sc, 3: 0x12345678})
        for lane in range(64):
            got = int(w.v[3, lane])
            refs = [_scaled_ref(fmt, int(x), int(sc[lane]), ebits, mbits) for x in (lo[lane], hi[lane])]
            if out == "fp4":
                shift = 8 * (opsel >> 2)
                assert got & ~(0xFF << shift) & 0xFFFFFFFF == 0x12345678 & ~(0xFF << shift)
                for j, want in enumerate(refs):
                    _check_fp4(got >> (shift + 4 * j) & 0xF, want, int((lo, hi)[j][lane]))
            else:
                shift = 16 * (opsel >> 3)
                assert got & ~(0xFFFF << shift) & 0xFFFFFFFF == 0x12345678 & ~(0xFFFF << shift)
                for j, want in enumerate(refs):
                    check_code(fmt, got >> (shift + 8 * j) & 0xFF, want, (name, hex(int((lo, hi)[j][lane]))))


def test_scalef32_pk_fp4_f32_rounds_and_saturates():
    # E2M1: RNE (ties 0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5 go to the even code), values past 6
    # saturate (the format has no Inf/NaN); every byte position of op_sel[3:2]
    rng = np.random.default_rng(41)
    for k, opsel in enumerate((0, 4, 8, 12, 0, 4)):
        sc = _scale_operands(rng, 64)
        sexp = int(sc[k] >> 23 & 0xFF) - 127
        a, = _lanes(format_inputs(X.E2M1, seed=50 + k, n=64, scale_exp=max(min(sexp, 100), -100))[:64])
        b = np.roll(a, 7) ^ np.uint32(0x80000000)
        w, _ = run("gfx950", I.v_cvt_scalef32_pk_fp4_f32(v[3], v[0], v[1], v[2], opsel=opsel),
                   vgpr={0: a, 1: b, 2: sc, 3: 0xCAFEBABE})
        shift = 8 * (opsel >> 2)
        for lane in range(64):
            got = int(w.v[3, lane])
            assert got & ~(0xFF << shift) & 0xFFFFFFFF == 0xCAFEBABE & ~(0xFF << shift)
            for j, x in enumerate((int(a[lane]), int(b[lane]))):
                _check_fp4(got >> (shift + 4 * j) & 0xF, _scaled_ref(X.E2M1, x, int(sc[lane])), x)


# --- gfx950 scaled widening: code value * 2**(s - 127), rounded once to the output format ---------------
def _widen_ref(fmt, code, scale_bits, out):
    """Bits of fmt's code times 2**(s - 127) in `out`; a zero keeps the code's sign."""
    s = scale_bits >> 23 & 0xFF
    ebits, mbits = WIDE[out]
    value = fmt.value_of[code]
    if value == "nan" or s == 0xFF:
        return "nan"
    if value in ("inf", "-inf"):
        return X.to_ieee(value, ebits, mbits)
    bits = X.to_ieee(value * Fr(2) ** (s - 127), ebits, mbits)
    return bits | (1 << (ebits + mbits) if value == 0 and code >> (fmt.nbits - 1) else 0)


WIDE = {"f32": (8, 23), "f16": (5, 10), "bf16": (8, 7)}


def _check_widened(got, want, out, what):
    if want == "nan":
        assert X.is_nan_bits(got, *WIDE[out]), (what, hex(got))
    else:
        assert got == want, (what, hex(got), hex(want))


@pytest.mark.parametrize("src", ["fp8", "bf8", "fp4"])
@pytest.mark.parametrize("out", ["f32", "f16", "bf16"])
def test_scalef32_widening_every_code(src, out):
    # v_cvt_scalef32_pk_<out>_<src>: word op_sel[0] (fp8/bf8) or byte op_sel[1:0] (fp4) of S0;
    # scale exponent fields over the whole E8M0 range (f16 results overflow to Inf / go subnormal)
    fmt = {"fp8": X.OCP_E4M3, "bf8": X.OCP_E5M2, "fp4": X.E2M1}[src]
    rng = np.random.default_rng(zlib.crc32(f"widen {src} {out}".encode()))
    name = f"v_cvt_scalef32_pk_{out}_{src}"
    per = 2  # codes per result pair
    selects = (0, 1) if src != "fp4" else (0, 1, 2, 3)
    for opsel in selects:
        for rep in range(2):
            word = rng.integers(0, 1 << 32, 64, dtype=np.uint64).astype(np.uint32)
            if rep == 0 and src != "fp4":  # every code in the selected word at least once
                c = np.arange(128, dtype=np.uint32) * 2
                word = np.where(opsel, (c[::2] | (c[::2] + 1) << 8) << 16, c[::2] | (c[::2] + 1) << 8).astype(np.uint32)
                word ^= rng.integers(0, 1 << 16, 64).astype(np.uint32) << (16 * (1 - opsel))
            sc = np.concatenate([rng.integers(0, 256, 62), [127, 255]]).astype(np.uint32) << 23
            vd = v[4:5] if out == "f32" else v[4]
            w, _ = run("gfx950", getattr(I, name)(vd, v[0], v[1], opsel=opsel), vgpr={0: word, 1: sc})
            for lane in range(64):
                unit = (int(word[lane]) >> (16 * opsel if src != "fp4" else 8 * opsel))
                codes = [unit & 0xFF, unit >> 8 & 0xFF] if src != "fp4" else [unit & 0xF, unit >> 4 & 0xF]
                if out == "f32":
                    got = [int(w.v[4, lane]), int(w.v[5, lane])]
                else:
                    got = [int(w.v[4, lane]) & 0xFFFF, int(w.v[4, lane]) >> 16]
                for j in range(per):
                    _check_widened(got[j], _widen_ref(fmt, codes[j], int(sc[lane]), out), out,
                                   (name, opsel, hex(codes[j]), hex(int(sc[lane]))))


@pytest.mark.parametrize("bf8", [False, True])
def test_scalef32_f32_f8_byte_select(bf8):
    # v_cvt_scalef32_f32_{fp8,bf8}: byte op_sel[1:0] of S0 -> one f32
    fmt = X.FORMATS["gfx950"][bf8]
    rng = np.random.default_rng(61 + bf8)
    name = f"v_cvt_scalef32_f32_{'bf8' if bf8 else 'fp8'}"
    for opsel in range(4):
        word = rng.integers(0, 1 << 32, 64, dtype=np.uint64).astype(np.uint32)
        sc = (rng.integers(0, 256, 64).astype(np.uint32) << 23) | rng.integers(0, 1 << 23, 64).astype(np.uint32)
        w, _ = run("gfx950", getattr(I, name)(v[4], v[0], v[1], opsel=opsel), vgpr={0: word, 1: sc})
        for lane in range(64):
            code = int(word[lane]) >> (8 * opsel) & 0xFF
            _check_widened(int(w.v[4, lane]), _widen_ref(fmt, code, int(sc[lane]), "f32"), "f32",
                           (name, hex(code)))
