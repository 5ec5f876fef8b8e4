"""flyquant.compat.torchao.install(): torchao 0.18's MXFP8 training importable beside flydsl 0.4.2,
its FlyDSL MXFP8 entry points served by flyquant (issue 19 item 4).

Each test runs in a fresh interpreter (install() patches process-wide state: sys.modules and
torchao's module attributes), with flyquant.emu enabled for gfx950 and FLYQUANT_BACKEND=flydsl,
so the FlyDSL kernels do the casts on CPU tensors and the emulator's launch record shows it.

How far the MX linear goes on CPU. torchao 0.18 has no preference that pairs the FLYDSL dim1 cast
with its emulated matmul: KernelPreference.EMULATED makes _to_mxfp8_dim1_kernel_wrapper use to_mx
for every dim1 cast (so flyquant would do none), and its training config's linear
(MXFP8TrainingOpConfig -> _to_mxfp8_then_scaled_mm) fixes the dim1 choice to CUDA. With
KernelPreference.AUTO and the FLYDSL choice, which the linear's autograd function mx_mm takes,
every cast runs on CPU, but each of the three matmuls is torch._scaled_mm with E8M0 block
scales, which CPU torch rejects ("Invalid scaling configuration"). So the test runs torchao's mx_mm
forward and backward with AUTO + FLYDSL and stands in for torch._scaled_mm only: an FP32 matmul
of the dequantized operands (scales un-blocked with torchao's from_blocked), which records the
operands torchao hands it. Everything else, the casts and the MXTensor plumbing, is torchao's.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap

import pytest

pytest.importorskip("torchao", reason="torchao is not installed")

PRELUDE = """
import json, os, sys, warnings
warnings.filterwarnings("ignore")
import logging; logging.disable(logging.WARNING)
os.environ["FLYQUANT_BACKEND"] = "flydsl"
os.environ["FLYQUANT_ARCH"] = "gfx950"
import torch
import flyquant as fq
fq.emu.enable("gfx950")
out = {}
"""


def run(body: str) -> dict:
    """Run PRELUDE + body in a fresh interpreter; body fills `out`, printed as JSON last."""
    code = PRELUDE + textwrap.dedent(body) + "\nprint('RESULT ' + json.dumps(out))\n"
    env = {k: v for k, v in os.environ.items() if not k.startswith("FLYQUANT_")}
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, timeout=600)
    lines = [ln for ln in proc.stdout.splitlines() if ln.startswith("RESULT ")]
    assert proc.returncode == 0 and lines, proc.stdout[-3000:] + proc.stderr[-3000:]
    return json.loads(lines[-1][len("RESULT "):])


def test_without_install_torchao_moe_training_does_not_import_and_flyquant_patches_nothing():
    out = run("""
        import flyquant.compat.torchao  # importing the module must not patch anything
        try:
            import torchao.prototype.moe_training
            out["imported"] = True
        except ImportError as exc:
            out["imported"], out["error"] = False, str(exc)
        out["vector"] = "flydsl.expr.vector" in sys.modules
    """)
    assert out["imported"] is False and "vector" in out["error"]  # the bug install() exists for
    assert out["vector"] is False


def test_install_reports_patches_once_and_routes_torchaos_entry_points():
    out = run("""
        from flyquant.compat import torchao as compat
        out["first"] = compat.install()
        out["second"] = compat.install()
        import torchao.prototype.moe_training  # noqa: F401
        import torchao.prototype.moe_training.kernels.mxfp8 as pkg
        from torchao.prototype.moe_training.kernels.mxfp8 import quant
        out["routed"] = [getattr(m, n) is getattr(compat, n) for m in (pkg, quant) for n in compat.ENTRY_POINTS]
        from flyquant import reference as R
        g = torch.Generator().manual_seed(0)
        x = torch.randn(128, 96, generator=g).to(torch.bfloat16)
        w = torch.randn(2, 64, 96, generator=g).to(torch.bfloat16)
        with fq.emu.record() as launches:
            results = {
                "1x32": (quant.mxfp8_quantize_2d_1x32_flydsl(x, scaling_mode="floor"), R.mxfp8_quantize(x, -1, "floor")),
                "32x1": (quant.mxfp8_quantize_2d_32x1_flydsl(x), R.mxfp8_quantize(x, 0, "rceil")),
                "3d": (quant.mxfp8_quantize_3d_flydsl(w), R.mxfp8_quantize_3d(w, "rceil")),
                "3d_t": (quant.mxfp8_quantize_3d_flydsl(w.transpose(1, 2)),
                         R.mxfp8_quantize_3d(w.transpose(1, 2).contiguous(), "rceil")),
            }
        out["kernels"] = [r.kernel for r in launches]
        out["equal"] = {k: all(a.stride() == b.stride() and torch.equal(a.view(torch.uint8), b.view(torch.uint8))
                               for a, b in zip(got, want)) for k, (got, want) in results.items()}
    """)
    assert out["first"][0].startswith("flydsl.expr.vector: shim")
    assert len(out["first"]) == 1 + 6 + 2  # the shim, 3 entry points in 2 modules, the grouped GEMM in 2
    assert out["second"] == []  # idempotent
    assert all(out["routed"])
    assert len(out["kernels"]) == 4 and all("mxfp8" in k for k in out["kernels"]), out["kernels"]
    assert out["equal"] == {"1x32": True, "32x1": True, "3d": True, "3d_t": True}


def test_mx_linear_forward_backward_casts_on_flyquant_equal_torch_choice():
    """One forward and backward of a linear 64 -> 96 on 128 tokens through torchao's mx_mm, FLYDSL
    vs TORCH dim1 choice, floor and rceil: the FLYDSL run's three dim1 casts (weight, grad_output,
    input) are flyquant's 32x1 kernel (launch record; the TORCH run launches nothing), the
    operands of all three matmuls (FP8 data and blocked scales, bytes and strides) equal the
    TORCH run's, and so do the output and both gradients; the output is within 10% of the
    high-precision product (the stand-in matmul is not garbage)."""
    out = run("""
        from flyquant.compat import torchao as compat
        compat.install()
        from flyquant import reference as R
        from torchao.prototype.moe_training.mxfp8_linear import mx_mm
        from torchao.prototype.mx_formats.config import (MXFP8Dim0CastKernelChoice, MXFP8Dim1CastKernelChoice,
                                                         ScaleCalculationMode)
        from torchao.prototype.mx_formats.utils import from_blocked
        from torchao.quantization.quantize_.common.kernel_preference import KernelPreference

        def cpu_scaled_mm(a, b, scale_a, scale_b, bias=None, out_dtype=None):
            (m, k), n = a.shape, b.shape[1]
            seen.append([a, b, scale_a, scale_b])
            a_hp = R.mxfp8_dequantize(a, from_blocked(scale_a, m, k // 32))
            b_hp = R.mxfp8_dequantize(b.t(), from_blocked(scale_b, n, k // 32)).t()
            return (a_hp @ b_hp if bias is None else a_hp @ b_hp + bias).to(out_dtype)

        torch._scaled_mm = cpu_scaled_mm
        g = torch.Generator().manual_seed(1)
        x0, w0, g0 = (torch.randn(*s, generator=g).to(torch.bfloat16) for s in ((128, 64), (96, 64), (128, 96)))
        e4 = torch.float8_e4m3fn
        runs = {}
        for mode in (ScaleCalculationMode.FLOOR, ScaleCalculationMode.RCEIL):
            for choice in (MXFP8Dim1CastKernelChoice.FLYDSL, MXFP8Dim1CastKernelChoice.TORCH):
                seen = []
                x, w = x0.clone().requires_grad_(), w0.clone().requires_grad_()
                with fq.emu.record() as launches:
                    y = mx_mm.apply(x, w, e4, e4, e4, 32, KernelPreference.AUTO, MXFP8Dim0CastKernelChoice.TORCH,
                                    choice, mode, False)
                    y.backward(g0)
                runs[(mode.value, choice.value)] = ([r.kernel for r in launches], seen, [y, x.grad, w.grad])
        hp = x0.float() @ w0.float().t()
        out["kernels"], out["operands"], out["results"], out["error"] = {}, {}, {}, {}
        for mode in ("floor", "rceil"):
            ours, theirs = runs[(mode, "flydsl")], runs[(mode, "torch")]
            out["kernels"][mode] = [ours[0], theirs[0]]
            out["operands"][mode] = [len(ours[1]), len(theirs[1])] + [
                all(a.shape == b.shape and a.stride() == b.stride() and torch.equal(a.view(torch.uint8), b.view(torch.uint8))
                    for a, b in zip(o, t)) for o, t in zip(ours[1], theirs[1])]
            out["results"][mode] = [torch.equal(a, b) for a, b in zip(ours[2], theirs[2])]
            out["error"][mode] = ((ours[2][0].float() - hp).norm() / hp.norm()).item()
    """)
    for mode in ("floor", "rceil"):
        ours, theirs = out["kernels"][mode]
        assert len(ours) == 3 and all(k.startswith(f"mxfp8_32x1_{mode}_bf16_gfx950") for k in ours), ours
        assert theirs == []
        assert out["operands"][mode] == [3, 3, True, True, True], out["operands"]
        assert out["results"][mode] == [True, True, True]
        assert out["error"][mode] < 0.1, out["error"]
