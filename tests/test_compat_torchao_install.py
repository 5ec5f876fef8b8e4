"""flyquant.compat.torchao.install(): torchao 0.18's MXFP8 training importable beside flydsl 0.4.2,
its FlyDSL MXFP8 entry points served by flyquant (issue 19 item 4).

Each test runs in a fresh interpreter (install() patches process-wide state: sys.modules and
torchao's module attributes), with flyquant.emu enabled for gfx950 and FLYQUANT_BACKEND=flydsl,
so the FlyDSL kernels do the casts on CPU tensors and the emulator's launch record shows it.

How far the MX training path goes on CPU: torchao 0.18's MX linear uses the FLYDSL dim1 cast only
with a non-emulated kernel preference (KernelPreference.EMULATED switches every cast to its
to_mx), and that preference's matmul is torch._scaled_mm on a CUDA device. So the test calls
the cast the linear's backward makes, torchao's own _to_mxfp8_dim1_kernel_wrapper with
MXFP8Dim1CastKernelChoice.FLYDSL, on the linear's input, weight and gradient shapes, and checks
the MXTensors it builds against the TORCH choice (torchao's to_mx of the transpose); the scaled
matmul itself cannot run here and is not attempted.
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
    assert len(out["first"]) == 1 + 6  # the shim, 3 entry points in 2 modules
    assert out["second"] == []  # idempotent
    assert all(out["routed"])
    assert len(out["kernels"]) == 4 and all("mxfp8" in k for k in out["kernels"]), out["kernels"]
    assert out["equal"] == {"1x32": True, "32x1": True, "3d": True, "3d_t": True}


def test_mx_training_dim1_casts_run_on_flyquant_and_equal_torch_choice():
    out = run("""
        from flyquant.compat import torchao as compat
        compat.install()
        from torchao.prototype.mx_formats.config import MXFP8Dim1CastKernelChoice, ScaleCalculationMode
        from torchao.prototype.mx_formats.mx_tensor import MXTensor
        from torchao.prototype.mx_formats.utils import _to_mxfp8_dim1_kernel_wrapper
        from torchao.quantization.quantize_.common.kernel_preference import KernelPreference
        g = torch.Generator().manual_seed(1)
        # a linear 64 -> 96 on 128 tokens: input (128, 64), weight (96, 64), grad_output (128, 96)
        tensors = {"input": torch.randn(128, 64, generator=g), "weight": torch.randn(96, 64, generator=g),
                   "grad_output": torch.randn(128, 96, generator=g)}
        out["equal"], out["kernels"] = {}, []
        for mode in (ScaleCalculationMode.FLOOR, ScaleCalculationMode.RCEIL):
            for name, t in tensors.items():
                t = t.to(torch.bfloat16)
                with fq.emu.record() as launches:
                    ours = _to_mxfp8_dim1_kernel_wrapper(t, 32, torch.float8_e4m3fn, torch.bfloat16,
                                                         KernelPreference.AUTO, MXFP8Dim1CastKernelChoice.FLYDSL, mode)
                out["kernels"] += [r.kernel for r in launches]
                torch_choice = MXTensor.to_mx(t.t().contiguous(), torch.float8_e4m3fn, 32, scaling_mode=mode,
                                              kernel_preference=KernelPreference.EMULATED)
                same = torch.equal(ours.qdata.contiguous().view(torch.uint8), torch_choice.qdata.contiguous().view(torch.uint8))
                same &= torch.equal(ours.scale.view(torch.uint8), torch_choice.scale.view(torch.uint8))
                out["equal"][f"{name} {mode.value}"] = bool(same)
    """)
    assert len(out["kernels"]) == 6 and all("32x1" in k for k in out["kernels"]), out["kernels"]
    assert all(out["equal"].values()), out["equal"]
