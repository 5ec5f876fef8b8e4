"""gfx950's scaled MFMAs (v_mfma_scale_f32_{16x16x128,32x32x64}_f8f6f4) under flyquant.emu.

A FlyDSL kernel (tests/emu_kernels.py mfma_scale) issues one scaled MFMA on raw register words;
the expected D is computed here from the documented layout, independently of the emulator:
- A (M x K), M = 16 (K = 128) or 32 (K = 64): lane l holds 32 elements j of row l % M, g = l // M.
  fp4: k = 32 g + j, element j the nibble j % 2 (low first) of byte (j // 2) % 4 of register
  j // 8 (registers 4..7 unused). fp8/bf8: byte j % 4 of register j // 4 is
  k = (j // 16) K / 2 + 16 g + j % 16: registers 0-3 hold 16 k of the first half of K, 4-7 of
  the second (composable_kernel's test/mx_mfma_op register maps, run on MI355X). B likewise with
  column l % M.
- K block b (k = 32 b .. 32 b + 31) of row r is scaled by byte `opsel` of lane b M + r's scale
  word, an E8M0 code s: 2^(s - 127), s = 0xFF NaN (for fp8, not the lane holding the block's
  bytes). opsel is the intrinsic's opsel_a / opsel_b argument.
- D = (A scaled) (B scaled)^T + C; C/D register r of lane l is element
  (4 (l // 16) + r, l % 16) for 16x16 and (8 (r // 4) + 4 (l // 32) + r % 4, l % 32) for 32x32.
Element values come from torch's float8_e4m3fn / float8_e5m2 and the E2M1 table below.
"""

from __future__ import annotations

import emu_kernels as K
import numpy as np
import pytest
import torch

from flyquant import toolchain
from flyquant.emu import interp
from flyquant.emu.isa_base import EmuError, Wave

LANES = 64
BLOCK = 32  # K elements per scale
FP8, BF8, FP4 = 0, 1, 4  # cbsz / blgp format codes
E2M1_VALUES = [0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0]  # codes 0..7; bit 3 is the sign
F32_EPS = 2.0**-24


def _values(codes: np.ndarray, fmt: int) -> np.ndarray:
    if fmt == FP4:
        mag = np.array(E2M1_VALUES)[codes & 7]
        return np.where(codes & 8, -mag, mag)
    dtype = {FP8: torch.float8_e4m3fn, BF8: torch.float8_e5m2}[fmt]
    return torch.from_numpy(codes.astype(np.uint8)).view(dtype).double().numpy()


def _random_codes(rng, shape, fmt: int) -> np.ndarray:
    """Finite element codes of the format (no NaN/inf codes)."""
    if fmt == FP4:
        return rng.integers(0, 16, shape)
    codes = rng.integers(0, 256, shape)
    bad = (codes & 0x7F) == 0x7F if fmt == FP8 else (codes & 0x7C) == 0x7C
    return np.where(bad, codes & 0x3F, codes)


def _pack(codes: np.ndarray, fmt: int, rng) -> np.ndarray:
    """(M, K) element codes -> (8, 64) register words by the layout in the module doc."""
    m = codes.shape[0]
    k, j = codes.shape[1], np.arange(BLOCK)
    lane_elems = np.empty((LANES, BLOCK), np.int64)  # lane l: row l % m, group l // m
    for lane in range(LANES):
        g = lane // m
        ks = BLOCK * g + j if fmt == FP4 else (j // 16) * (k // 2) + 16 * g + j % 16
        lane_elems[lane] = codes[lane % m, ks]
    if fmt == FP4:
        data = (lane_elems[:, 0::2] | lane_elems[:, 1::2] << 4).astype(np.uint8)  # (64, 16) bytes
        garbage = rng.integers(0, 256, (LANES, 16), dtype=np.uint8)  # registers 4..7: not read
        data = np.concatenate([data, garbage], axis=1)
    else:
        data = lane_elems.astype(np.uint8)
    return np.ascontiguousarray(data).view(np.uint32).T.astype(np.int64)  # (8, 64) words


def _scale_words(rng, codes: np.ndarray, byte: int) -> np.ndarray:
    """Lane scale words holding codes[l] in byte `byte`, random bytes elsewhere."""
    words = rng.integers(0, 256, (LANES, 4))
    words[:, byte] = codes
    return (words[:, 0] | words[:, 1] << 8 | words[:, 2] << 16 | words[:, 3] << 24).astype(np.uint32)


def _block_factors(codes: np.ndarray, m: int) -> np.ndarray:
    """(m, K) factor of each element from the per-lane E8M0 codes: lane l -> row l % m, block l // m."""
    blocks = LANES // m
    factors = np.empty((m, blocks))
    for lane in range(LANES):
        code = int(codes[lane])
        factors[lane % m, lane // m] = np.nan if code == 0xFF else 2.0 ** (code - 127)
    return np.repeat(factors, BLOCK, axis=1)


def _acc_words(d: np.ndarray) -> np.ndarray:
    """(m, m) matrix -> (m * m / 64, 64) accumulator registers."""
    m = d.shape[0]
    regs = np.empty((m * m // LANES, LANES), np.float32)
    for r in range(regs.shape[0]):
        for lane in range(LANES):
            if m == 16:
                regs[r, lane] = d[4 * (lane // 16) + r, lane % 16]
            else:
                regs[r, lane] = d[8 * (r // 4) + 4 * (lane // 32) + r % 4, lane % 32]
    return regs


CASES = [  # (M, cbsz, blgp, opsel_a, opsel_b)
    (16, FP8, FP8, 1, 2),
    (16, FP4, FP4, 3, 0),
    (32, FP8, FP8, 2, 1),
    (32, FP4, BF8, 0, 3),
]


@pytest.mark.parametrize("m,cbsz,blgp,opsel_a,opsel_b", CASES)
def test_scaled_mfma_kernel_against_numpy(m, cbsz, blgp, opsel_a, opsel_b):
    k = {16: 128, 32: 64}[m]
    rng = np.random.default_rng(1000 * m + 10 * cbsz + blgp)
    ca, cb = _random_codes(rng, (m, k), cbsz), _random_codes(rng, (m, k), blgp)
    sa, sb = rng.integers(117, 138, LANES), rng.integers(117, 138, LANES)  # moderate scales
    sa[0] = 0xFF  # row 0, K block 0 of A: NaN -> all of D's row 0
    sb[m + 3] = 0  # column 3, K block 1 of B: 2^-127
    sb[2] = 0  # column 2, K block 0 of B: 2^-127
    sa[5::m] = 254  # row 5 of A scaled by 2^127 in every block ...
    sb[7::m] = 254  # ... and column 7 of B: D[5, 7] and most of row 5 overflow to +-inf
    c = rng.standard_normal((m, m)).astype(np.float32)

    a_words, b_words = _pack(ca, cbsz, rng), _pack(cb, blgp, rng)
    c_regs = torch.from_numpy(_acc_words(c).reshape(-1).copy())
    tensors = [torch.from_numpy(x.astype(np.uint32).view(np.int32).reshape(-1).copy())
               for x in (a_words, b_words, _scale_words(rng, sa, opsel_a), _scale_words(rng, sb, opsel_b))]
    with toolchain.target("gfx950"):
        K.mfma_scale(m, cbsz, blgp, opsel_a, opsel_b)(*tensors, c_regs, stream=0)

    a = _values(ca, cbsz) * _block_factors(sa, m)
    b = _values(cb, blgp) * _block_factors(sb, m)
    with np.errstate(invalid="ignore", over="ignore"):
        exact = a @ b.T + c  # float64: every scaled product is exact here, the sum nearly so
        expected = _acc_words(exact.astype(np.float32))
        # both sums are float64 (error far below f32's) rounded once to f32: at most 1 ulp apart
        bound = _acc_words((2 * F32_EPS * (np.abs(a) @ np.abs(b).T + np.abs(c))).astype(np.float32))
        unit = sb.copy()
        unit[[2, m + 3]] = 127  # what the 2^-127 blocks would give with a unit scale instead
        with_unit = _acc_words((a @ (_values(cb, blgp) * _block_factors(unit, m)).T + c).astype(np.float32))
    got = c_regs.numpy().reshape(expected.shape)
    finite = np.isfinite(expected)
    assert np.isnan(expected).sum() >= m and np.isinf(expected).sum() >= 1  # the special cases occur
    np.testing.assert_array_equal(got[~finite], expected[~finite])  # same NaNs, same signed infinities
    assert np.all(np.abs(got[finite] - expected[finite]) <= bound[finite])
    assert np.any(np.abs(with_unit[finite] - expected[finite]) > bound[finite])  # the 2^-127 blocks matter


# v_mfma_scale_f32_16x16x128_f8f6f4 v[0:3], v[4:11], v[12:19], v[20:23], v24, v25 as LLVM encodes
# it (llvm/test/MC/AMDGPU/mai-gfx950.s)
LLVM_SCALED_MFMA = bytes([0x00, 0x00, 0xAC, 0xD3, 0x18, 0x33, 0x02, 0x00,
                          0x00, 0x08, 0xAD, 0xD3, 0x04, 0x19, 0x52, 0x04])
S_ENDPGM = (0xBF810000).to_bytes(4, "little")


def test_scaled_mfma_is_gfx950_only():
    w = Wave()
    with pytest.raises(EmuError, match="v_mfma_scale_f32_16x16x128_f8f6f4 is a gfx950-only instruction"):
        interp.run_wave(interp.snippet(LLVM_SCALED_MFMA + S_ENDPGM, "gfx942"), w)
    # on gfx950 it decodes as LLVM wrote it and runs: zero A and B with unit scales give D = C
    prog = interp.snippet(LLVM_SCALED_MFMA + S_ENDPGM, "gfx950")
    assert prog.insts[0].text.startswith(
        "v_mfma_scale_f32_16x16x128_f8f6f4 v[0:3], v[4:11], v[12:19], v[20:23], v24, v25")
    w = Wave()
    w.v[24] = w.v[25] = 0x7F7F7F7F
    w.vf[20:24] = np.arange(4 * LANES, dtype=np.float32).reshape(4, LANES)
    interp.run_wave(prog, w)
    np.testing.assert_array_equal(w.vf[0:4], w.vf[20:24])
