"""Configuration and input hardening (issue 21, findings 10-12): every FLYQUANT_* variable and
config file is checked when read, with an error naming the variable, the bad value and the
expected form; the kernel cache is private to its user; launching is thread-safe.
"""

from __future__ import annotations

import pytest
import torch

import flyquant as fq
from flyquant import reference, select

# --- offs ------------------------------------------------------------------------------------


@pytest.mark.parametrize("backend", ["reference", "flydsl"])
@pytest.mark.parametrize("axis, scale_layout", [(0, "tcgen05"), (0, None), (-1, None)])
def test_non_contiguous_offs_is_refused_on_both_backends(monkeypatch, backend, axis, scale_layout):
    """offs as a strided view ([128, 256] every other element) is refused by name on both
    backends (the 32x1 + tcgen05 kernel used to fail inside FlyDSL); its contiguous copy works."""
    monkeypatch.setenv("FLYQUANT_BACKEND", backend)
    x = torch.randn(256, 64, dtype=torch.bfloat16)
    offs = torch.tensor([128, 0, 256, 0], dtype=torch.int32)[::2]
    assert fq.explain(fq.mxfp8_quantize, x, axis=axis, scale_layout=scale_layout).backend == backend
    with pytest.raises(ValueError, match=r"offs must be contiguous \(stride 1\), got stride 2"):
        fq.mxfp8_quantize(x, axis=axis, scale_layout=scale_layout, offs=offs)
    data, scales = fq.mxfp8_quantize(x, axis=axis, scale_layout=scale_layout, offs=offs.contiguous())
    ref_data, ref_scales = reference.mxfp8_quantize(x, axis, "rceil", scale_layout, offs.contiguous())
    torch.testing.assert_close(data.view(torch.uint8), ref_data.view(torch.uint8), rtol=0, atol=0)
    torch.testing.assert_close(scales.view(torch.uint8), ref_scales.view(torch.uint8), rtol=0, atol=0)
