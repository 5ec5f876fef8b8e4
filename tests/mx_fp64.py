"""An independent FP64 model of the MX grouped GEMMs for the tests: E4M3 and E8M0 decoded from
their bit fields (not through torch's float8 types), FP64 matmuls per token group."""

from __future__ import annotations

import math

import torch

from flyquant.formats import MX_BLOCK


def _e4m3_table() -> torch.Tensor:
    values = []
    for byte in range(256):
        sign = -1.0 if byte & 0x80 else 1.0
        exp, man = (byte >> 3) & 0xF, byte & 0x7
        if exp == 0xF and man == 0x7:
            values.append(math.nan)
        elif exp == 0:
            values.append(sign * man / 8 * 2.0**-6)
        else:
            values.append(sign * (1 + man / 8) * 2.0 ** (exp - 7))
    return torch.tensor(values, dtype=torch.float64)


E4M3_VALUES = _e4m3_table()


def deq64(data: torch.Tensor, scales: torch.Tensor, along: int) -> torch.Tensor:
    """data (..., R, C) E4M3 and one E8M0 scale per 32 along dim `along` (-1: C, -2: R) -> FP64."""
    v = E4M3_VALUES[data.contiguous().view(torch.uint8).long()]
    c = scales.contiguous().view(torch.uint8).double()
    s = torch.where(c == 255, torch.nan, torch.exp2(c - 127))
    return v * s.repeat_interleave(MX_BLOCK, dim=along)


def groups(offs) -> list[tuple[int, int]]:
    ends = [int(e) for e in offs]
    return list(zip([0] + ends[:-1], ends))


def grouped64(a, b, offs):
    """FP64 out (M, N) and S = sum |a||b| (M, N): a (M, K), b (E, N, K)."""
    out = torch.zeros(a.shape[0], b.shape[1], dtype=torch.float64)
    s = torch.zeros_like(out)
    for g, (lo, hi) in enumerate(groups(offs)):
        out[lo:hi] = a[lo:hi] @ b[g].T
        s[lo:hi] = a[lo:hi].abs() @ b[g].T.abs()
    return out, s
