"""flyquant.compat.torchao.install(): torchao 0.18's MXFP8 training importable beside flydsl 0.4.2,
its FlyDSL MXFP8 entry points served by flyquant (issue 19 item 4).

Each test runs in a fresh interpreter (install() patches process-wide state: sys.modules and
torchao's module attributes), with flyquant.emu enabled for gfx950 (no GPU) and FLYQUANT_BACKEND=flydsl,
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

# With a ROCm GPU present (only the gpu test runs there) the emulator stays off: no FLYQUANT_ARCH
# (the GPU's arch is the target) and record() records nothing.
PRELUDE = """
import contextlib, json, os, sys, warnings
warnings.filterwarnings("ignore")
import logging; logging.disable(logging.WARNING)
os.environ["FLYQUANT_BACKEND"] = "flydsl"
import torch
import flyquant as fq
if not fq.emu.rocm_device_present():
    os.environ["FLYQUANT_ARCH"] = "gfx950"
    fq.emu.enable("gfx950")
record = fq.emu.record if fq.emu.enabled() else (lambda: contextlib.nullcontext([]))
out = {}
"""


def run(body: str) -> dict:
    """Run PRELUDE + body in a fresh interpreter; body fills `out`, printed as JSON last."""
    code = PRELUDE + textwrap.dedent(body) + "\nprint('RESULT ' + json.dumps(out))\n"
    # flyquant's behaviour variables cleared; the cache stays where the run put it (a read-only or small HOME)
    env = {k: v for k, v in os.environ.items() if not k.startswith("FLYQUANT_") or k == "FLYQUANT_CACHE_DIR"}
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


def test_grouped_mm_entry_point_without_install_says_to_install():
    """Before install() the grouped-GEMM entry point failed in its import of torchao's module with
    flydsl's "cannot import name 'vector' from 'flydsl.expr'", which did not say what to do."""
    out = run("""
        from flyquant.compat import torchao as compat
        A, B_t = torch.randn(64, 32).to(torch.bfloat16), torch.randn(2, 32, 32).to(torch.bfloat16)
        try:
            compat.to_mxfp8_then_scaled_grouped_mm(A, B_t, torch.tensor([32, 64], dtype=torch.int32))
        except ImportError as exc:
            out["error"] = str(exc)
        out["first"] = compat.install() != []
        out["shape"] = list(compat.to_mxfp8_then_scaled_grouped_mm(A, B_t, torch.tensor([32, 64], dtype=torch.int32)).shape)
    """)
    assert "call flyquant.compat.torchao.install() first" in out["error"] and "vector" in out["error"]
    assert out["first"] and out["shape"] == [64, 32]


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
        with record() as launches:
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
                with record() as launches:
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


def test_torchao_moe_training_step_runs_through_flyquant_after_install():
    """Issue 22: a two-GEMM expert MLP converted by torchao's quantize_(model,
    MXFP8TrainingOpConfig()) (its default recipe, KernelPreference.AUTO: on CPU without install()
    torchao asserts that SM100 kernels are missing), one SGD step. After install() every
    torch._grouped_mm on the wrapped weights runs flyquant.training.mxfp8_grouped_mm: the
    quantize casts and the grouped GEMMs as emulated gfx950 kernels (the reference grouped GEMMs
    are counted: they never run). The same step with torchao's EMULATED
    recipe (to_mx, dequantize, bf16 torch._grouped_mm; install() passes it through) is the
    yardstick.

    Tolerance: both quantize the first GEMM's operands identically (flyquant's quantize equals
    torchao's to_mx on finite data) and sum the same exact products in FP32 in different orders
    before rounding to BF16, so its outputs differ by at most one BF16 rounding (2^-8 relative
    each side); through the second GEMM such a difference can move one E4M3 rounding (2^-4
    relative of one element). Loss (a mean of squares): 2^-6 relative; weights after the step
    and their gradients: 2^-4 relative (Frobenius). The same for torchao's other recipe options,
    each against EMULATED with the same options: wgrad_with_hp (its MXFP8_RCEIL_WGRAD_WITH_HP
    recipe; B_t's gradients unquantized, so token groups of any size) and
    pad_token_groups_for_grouped_mm, both on groups that are not multiples of 32."""
    out = run("""
        os.environ["FLYQUANT_BACKEND"] = "auto"  # the kernels where they take the shape, else the reference
        import copy
        from flyquant.compat import torchao as compat
        out["installed"] = compat.install()
        from torchao.prototype.moe_training.config import MXFP8TrainingOpConfig
        from torchao.quantization import quantize_
        from torchao.quantization.quantize_.common import KernelPreference
        import flyquant.reference_grouped_mm as ref_gmm

        calls = []
        for name in ("mxfp8_grouped_mm", "mxfp8_grouped_mm_wgrad"):
            real = getattr(ref_gmm, name)
            def counted(*args, _real=real, _name=name):
                calls.append(_name)
                return _real(*args)
            setattr(ref_gmm, name, counted)

        class Experts(torch.nn.Module):
            def __init__(self, e, d, h, g):
                super().__init__()
                self.w1 = torch.nn.Parameter((torch.randn(e, h, d, generator=g) / 8).to(torch.bfloat16))
                self.w2 = torch.nn.Parameter((torch.randn(e, d, h, generator=g) / 8).to(torch.bfloat16))

            def forward(self, x, offs):
                h = torch.nn.functional.silu(torch._grouped_mm(x, self.w1.transpose(-2, -1), offs=offs))
                return torch._grouped_mm(h, self.w2.transpose(-2, -1), offs=offs)

        g = torch.Generator().manual_seed(0)
        base = Experts(3, 64, 96, g)
        x = torch.randn(96, 64, generator=g).to(torch.bfloat16)
        target = torch.randn(96, 64, generator=g).to(torch.bfloat16)
        recipes = {"default": ({}, [32, 32, 96]),  # an empty expert
                   "wgrad_with_hp": ({"wgrad_with_hp": True}, [20, 20, 96]),
                   "padded": ({"pad_token_groups_for_grouped_mm": True}, [20, 20, 96])}
        rel = lambda a, b: ((a - b).norm() / b.norm()).item()
        for recipe, (options, ends) in recipes.items():
            offs = torch.tensor(ends, dtype=torch.int32)
            runs = {}
            for pref in ("AUTO", "EMULATED"):
                model = copy.deepcopy(base)
                config = MXFP8TrainingOpConfig(kernel_preference=getattr(KernelPreference, pref), **options)
                quantize_(model, config, filter_fn=lambda mod, fqn: isinstance(mod, Experts))
                opt = torch.optim.SGD(model.parameters(), lr=0.5)
                calls.clear()
                with record() as launches:
                    loss = (model(x, offs).float() - target.float()).square().mean()
                    loss.backward()
                plain = lambda t: getattr(t, "_data", t).detach().float().clone()  # torchao's weight wrapper -> its tensor
                grads = [plain(p.grad) for p in (model.w1, model.w2)]
                opt.step()
                runs[pref] = (loss.item(), grads, [plain(p) for p in (model.w1, model.w2)],
                              list(calls), [r.kernel for r in launches], type(model.w1).__name__)
            auto, emulated = runs["AUTO"], runs["EMULATED"]
            out[recipe] = {"wrapped": [auto[5], emulated[5]], "loss": [auto[0], emulated[0]],
                           "grad_rel": [rel(a, b) for a, b in zip(auto[1], emulated[1])],
                           "weight_rel": [rel(a, b) for a, b in zip(auto[2], emulated[2])],
                           "moved": [rel(a, b.float()) for a, b in zip(auto[2], (base.w1, base.w2))],
                           "calls": [auto[3], emulated[3]], "kernels": [auto[4], emulated[4]]}
        w1_t = base.w1.detach().transpose(-2, -1)
        offs = torch.tensor([32, 32, 96], dtype=torch.int32)
        bias = torch.randn(96, generator=g).to(torch.bfloat16)
        out["bias"] = torch.equal(compat.to_mxfp8_then_scaled_grouped_mm(x, w1_t, offs, bias=bias),
                                  compat.to_mxfp8_then_scaled_grouped_mm(x, w1_t, offs) + bias)
    """)
    assert any("_to_mxfp8_then_scaled_grouped_mm" in line for line in out["installed"])
    for recipe, wgrad_kernels in (("default", 2), ("wgrad_with_hp", 0), ("padded", 2)):
        run_ = out[recipe]
        assert run_["wrapped"] == ["MXFP8TrainingWeightWrapperTensor"] * 2
        auto_calls, emulated_calls = run_["calls"]
        # 2 forward GEMMs, 1 dgrad (x needs no gradient: the first GEMM's dgrad is skipped) and 2
        # wgrads (wgrad_with_hp: torch._grouped_mm), all the FlyDSL kernels, emulated: the reference never runs
        assert auto_calls == [] and emulated_calls == [], recipe
        auto_kernels, emulated_kernels = run_["kernels"]
        assert sum(k.startswith("mxfp8_grouped_mm_gfx950") for k in auto_kernels) == 3, (recipe, auto_kernels)
        assert sum(k.startswith("mxfp8_grouped_mm_wgrad_gfx950") for k in auto_kernels) == wgrad_kernels, recipe
        assert all(k.startswith("mxfp8_") for k in auto_kernels), auto_kernels  # and the casts, emulated
        assert emulated_kernels == []
        loss, loss_emulated = run_["loss"]
        assert abs(loss - loss_emulated) <= 2**-6 * loss_emulated, (recipe, run_["loss"])
        assert max(run_["grad_rel"]) <= 2**-4 and max(run_["weight_rel"]) <= 2**-4, (recipe, run_)
        assert min(run_["moved"]) > 1e-3, (recipe, run_["moved"])  # the step changed the weights
    assert out["bias"]


def test_transformers_moe_model_trains_through_flyquant_after_install():
    check_transformers_moe_training("cpu")


@pytest.mark.gpu
def test_gpu_transformers_moe_model_trains_through_flyquant_after_install():
    """The same on a real MI300X/MI355X (flyquant's kernels on the device; torchao's EMULATED
    recipe there too)."""
    check_transformers_moe_training("cuda")


def check_transformers_moe_training(device: str):
    """The user's path end to end: a tiny Qwen3-MoE from transformers (its experts on
    torch._grouped_mm: experts_implementation="grouped_mm"), converted by torchao's
    quantize_(model, MXFP8TrainingOpConfig(pad_token_groups_for_grouped_mm=True)) (the router's
    token groups are not multiples of 32), one forward and backward. After install() its grouped
    GEMMs and casts run on flyquant's kernels (emulated gfx950); the loss and the experts'
    gradients are those of torchao's EMULATED recipe with the same options (tolerances as the
    training-step test above: 2^-6 relative on the loss, 2^-4 on the gradients)."""
    out = run(f"""
        os.environ["FLYQUANT_BACKEND"] = "{'auto' if device == 'cpu' else 'flydsl'}"
        device = "{device}"
        import copy
        from flyquant.compat import torchao as compat
        compat.install()
        from transformers import Qwen3MoeConfig, Qwen3MoeForCausalLM
        from torchao.prototype.moe_training.config import MXFP8TrainingOpConfig
        from torchao.quantization import quantize_
        from torchao.quantization.quantize_.common import KernelPreference

        torch.manual_seed(0)
        config = Qwen3MoeConfig(vocab_size=128, hidden_size=64, intermediate_size=64, moe_intermediate_size=32,
                                num_hidden_layers=1, num_attention_heads=2, num_key_value_heads=1, head_dim=32,
                                num_experts=4, num_experts_per_tok=2, decoder_sparse_step=1, mlp_only_layers=[],
                                norm_topk_prob=True, max_position_embeddings=64, attn_implementation="eager",
                                experts_implementation="grouped_mm")
        base = Qwen3MoeForCausalLM(config).to(device, torch.bfloat16)
        ids = torch.randint(0, 128, (2, 24), generator=torch.Generator().manual_seed(1)).to(device)
        runs = {{}}
        for pref in ("AUTO", "EMULATED"):
            model = copy.deepcopy(base)
            config = MXFP8TrainingOpConfig(kernel_preference=getattr(KernelPreference, pref),
                                           pad_token_groups_for_grouped_mm=True)
            quantize_(model, config, filter_fn=lambda mod, fqn: type(mod).__name__ == "Qwen3MoeExperts")
            experts = model.model.layers[0].mlp.experts
            with record() as launches:
                loss = model(ids, labels=ids).loss
                loss.backward()
            plain = lambda t: getattr(t, "_data", t).detach().float().cpu()
            runs[pref] = (loss.item(), [plain(w.grad) for w in (experts.gate_up_proj, experts.down_proj)],
                          [r.kernel for r in launches], type(experts.gate_up_proj).__name__)
        auto, emulated = runs["AUTO"], runs["EMULATED"]
        out["loss"] = [auto[0], emulated[0]]
        out["grad_rel"] = [((a - b).norm() / b.norm()).item() for a, b in zip(auto[1], emulated[1])]
        out["kernels"] = [auto[2], emulated[2]]
        out["wrapped"] = [auto[3], emulated[3]]
    """)
    assert out["wrapped"] == ["MXFP8TrainingWeightWrapperTensor"] * 2
    auto_kernels, emulated_kernels = out["kernels"]
    if device == "cpu":  # 2 forward GEMMs, 2 dgrads, 2 wgrads (gate_up and down), all emulated gfx950 kernels
        assert sum(k.startswith("mxfp8_grouped_mm_gfx950") for k in auto_kernels) == 4, auto_kernels
        assert sum(k.startswith("mxfp8_grouped_mm_wgrad_gfx950") for k in auto_kernels) == 2, auto_kernels
        assert emulated_kernels == []
    loss, loss_emulated = out["loss"]
    assert abs(loss - loss_emulated) <= 2**-6 * loss_emulated, out["loss"]
    assert max(out["grad_rel"]) <= 2**-4, out["grad_rel"]


def test_mxtensor_activations_run_through_flyquant_after_install():
    """torchao's MXTensor A (pre-quantized activations, as its expert-parallel MXFP8 dispatch
    hands them on) through the installed entry point: flyquant.training with a_quantized =
    (qdata, scale), the same outputs and gradients as calling it so (padded groups too; on CPU
    torchao's EMULATED path cannot dequantize an MXTensor: Triton); without wgrad_with_hp,
    torchao's AssertionError in its words."""
    out = run("""
        from flyquant.compat import torchao as compat
        compat.install()
        import torchao.prototype.moe_training as mt
        from torchao.prototype.mx_formats.mx_tensor import MXTensor
        from torchao.prototype.mx_formats.config import ScaleCalculationMode
        from flyquant import training
        g = torch.Generator().manual_seed(0)
        A = torch.randn(96, 64, generator=g).to(torch.bfloat16)
        W = (torch.randn(3, 64, 64, generator=g) / 2).to(torch.bfloat16)
        G = torch.randn(96, 64, generator=g).to(torch.bfloat16)
        offs = torch.tensor([20, 20, 96], dtype=torch.int32)
        amx = MXTensor.to_mx(A, torch.float8_e4m3fn, 32, scaling_mode=ScaleCalculationMode.RCEIL)
        out["same"] = []
        for pad in (False, True):
            results = []
            for call in ("installed", "training"):
                handle = amx if call == "installed" else torch.zeros_like(A)
                handle.requires_grad_(True)
                b = W.transpose(1, 2).clone().requires_grad_()
                if call == "installed":
                    y = mt._to_mxfp8_then_scaled_grouped_mm(handle, b, offs, wgrad_with_hp=True,
                                                            pad_token_groups_for_grouped_mm=pad)
                else:
                    y = training.mxfp8_grouped_mm(handle, b, offs, wgrad_with_hp=True, pad_token_groups_for_grouped_mm=pad,
                                                  a_quantized=(amx.qdata, amx.scale))
                y.backward(G)
                results.append((y.detach(), handle.grad, b.grad))
                handle.grad = None
            out["same"].append([torch.equal(x, y) for x, y in zip(*results)])
        try:
            mt._to_mxfp8_then_scaled_grouped_mm(amx, W.transpose(1, 2), offs)
        except AssertionError as exc:
            out["error"] = str(exc)
    """)
    assert out["same"] == [[True, True, True]] * 2
    assert out["error"].startswith("only `wgrad_with_hp` recipe is supported for MXTensor inputs")


def test_emulated_grouped_mm_passes_torchaos_scale_mode_enum_through():
    """kernel_preference=EMULATED hands the call to torchao's own function, whose to_mx compares
    the scale mode against its ScaleCalculationMode enum only: the string default "rceil" (and
    "floor" as flyquant's path takes it) failed there with torchao's "unsupported scaling
    calculation mode", where torchao's function with the same arguments runs."""
    out = run("""
        from flyquant.compat import torchao as compat
        compat.install()
        import torchao.prototype.moe_training as mt
        from torchao.prototype.mx_formats.config import ScaleCalculationMode
        from torchao.quantization.quantize_.common import KernelPreference
        g = torch.Generator().manual_seed(0)
        A = torch.randn(64, 32, generator=g).to(torch.bfloat16)
        B_t = torch.randn(2, 32, 32, generator=g).to(torch.bfloat16).transpose(1, 2)
        offs = torch.tensor([32, 64], dtype=torch.int32)
        theirs = compat._TORCHAO_GROUPED_MM["original"]
        emulated = KernelPreference.EMULATED
        out["default"] = torch.equal(mt._to_mxfp8_then_scaled_grouped_mm(A, B_t, offs, kernel_preference=emulated),
                                     theirs(A, B_t, offs, kernel_preference=emulated))
        out["floor"] = torch.equal(
            compat.to_mxfp8_then_scaled_grouped_mm(A, B_t, offs, kernel_preference=emulated,
                                                   scale_calculation_mode="floor"),
            theirs(A, B_t, offs, kernel_preference=emulated, scale_calculation_mode=ScaleCalculationMode.FLOOR))
    """)
    assert out == {"default": True, "floor": True}


def test_grouped_mm_bad_input_is_torchaos_assertion_error():
    """torchao's _to_mxfp8_then_scaled_grouped_mm asserts on bad input (AssertionError: input_act
    must be 2D, out_dtype must be bfloat16 or float32, ...); after install() the same calls raised
    flyquant's plain ValueError / TypeError, which callers catching AssertionError missed. A recipe
    flag that is not a bool is refused the same way."""
    out = run("""
        from flyquant.compat import torchao as compat
        compat.install()
        import torchao.prototype.moe_training as mt
        A = torch.randn(64, 32).to(torch.bfloat16)
        B_t = torch.randn(2, 32, 32).to(torch.bfloat16).transpose(1, 2)
        offs = torch.tensor([32, 64], dtype=torch.int32)
        out["errors"] = []
        for args, kw in (((A.view(2, 32, 32), B_t, offs), {}), ((A, B_t[0], offs), {}), ((A, B_t[:, :16], offs), {}),
                         ((A, B_t, offs), {"out_dtype": torch.float16}), ((A.int(), B_t, offs), {}),
                         ((A, B_t, offs.long()), {}), ((A, B_t, offs), {"wgrad_with_hp": "no"}),
                         ((A, B_t, offs), {"pad_token_groups_for_grouped_mm": 1})):
            try:
                mt._to_mxfp8_then_scaled_grouped_mm(*args, **kw)
            except AssertionError as exc:
                out["errors"].append([isinstance(exc, ValueError), isinstance(exc, TypeError)])
    """)
    assert out["errors"] == [[True, False]] * 3 + [[True, True]] * 3 + [[True, False]] * 2
