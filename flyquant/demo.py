"""flyquant's demo: a small MoE layer (fq.fused_moe) and an MXFP8 training step, as a user would write them.

    python -m flyquant.demo [--arch gfx950|gfx942]

On an MI300X/MI355X it runs on the GPU. Elsewhere it enables flyquant.emu (gfx950 by default),
so the same FlyDSL kernels, compiled for that arch, execute on the CPU. It prints where each
call ran, whether the kernels matched the reference (bit-exact for quantize, within the derived
bound for the MoE layer and for the training step's grouped GEMMs against bf16 autograd) and what
the emulator executed.
"""

from __future__ import annotations

import argparse
import contextlib
import sys

import torch

import flyquant as fq
from flyquant import emu, reference, select, training
from flyquant.reference_grouped_mm import group_bounds

# MoE FFN: small, but with the shape constraints of the real thing (inter_dim % 256 for the
# scale shuffle) and uneven routing so some experts get several blocks and some none.
TOKENS, MODEL_DIM, INTER_DIM, EXPERTS, TOPK = 12, 256, 256, 8, 2
# MXFP8 step: two token groups of 128 (torchao's grouped-GEMM granularity), K and N of one tile.
GROUP_ROWS, HIDDEN, EXPERT_N = 128, 128, 64
# One MXFP8 element rounds with relative error <= 2^-4 (3 mantissa bits), so a product of two
# has relative error <= 2^-3 + 2^-8; a dot product's error is bounded by that times sum |x||w|.
MXFP8_PRODUCT_REL_ERR = 2.0**-3 + 2.0**-8
# The MoE layer's bound (tests/test_fused_moe.py derives it): FP32 sums (2^-24 per term), the
# activation's own error from the hardware exp2/rcp (2^-20 (|g| + 1)(|u| + 1)) and its slope
# (|d/dg| <= 1.2 (|u| + 1), |d/du| <= |g| + 1), a2's bf16 rounding, then each bf16 contribution
# and atomic add of stage 2 (2^-8 each).
BF16_REL, F32_REL, ACT_ERR, SLOPE_G = 2.0**-8, 2.0**-24, 2.0**-20, 1.2


def moe_layer(x, router, w1, w1_scale, w2, w2_scale):
    """A MoE FFN as a user writes it: GPT-OSS-style routing, then the whole layer through flyquant
    (sorting, gate/up GEMM with SiLU fused, down GEMM: three launches)."""
    topk_weights, topk_ids = fq.moe_routing(x.float() @ router.float().t(), TOPK, softmax_after_topk=True)
    out = fq.fused_moe(x, w1, w1_scale, w2, w2_scale, topk_weights, topk_ids, activation="silu")
    return out, topk_ids, topk_weights


def layer_bound(x, w1_deq, w2_deq, topk_ids, topk_weights):
    """(FP32 torch MoE of the dequantized weights, the per-element bound above)."""
    xf = x.float()
    wg, wu = w1_deq[topk_ids, :INTER_DIM], w1_deq[topk_ids, INTER_DIM:]  # (T, k, inter, model)
    g, u = torch.einsum("td,tkfd->tkf", xf, wg), torch.einsum("td,tkfd->tkf", xf, wu)
    dg = (MODEL_DIM + 1) * F32_REL * torch.einsum("td,tkfd->tkf", xf.abs(), wg.abs())
    du = (MODEL_DIM + 1) * F32_REL * torch.einsum("td,tkfd->tkf", xf.abs(), wu.abs())
    a = torch.nn.functional.silu(g) * u
    t1 = BF16_REL * a.abs() + (1 + BF16_REL) * (SLOPE_G * (u.abs() + 1) * dg + (g.abs() + 1) * du
                                                + ACT_ERR * (g.abs() + 1) * (u.abs() + 1))
    w2r, wts = w2_deq[topk_ids], topk_weights.unsqueeze(-1)  # (T, k, model, inter)
    expected = (torch.einsum("tki,tkoi->tko", a, w2r) * wts).sum(1)
    mag = (torch.einsum("tki,tkoi->tko", a.abs() + t1, w2r.abs()) * wts).sum(1)
    through = (torch.einsum("tki,tkoi->tko", t1, w2r.abs()) * wts).sum(1)
    bound = (INTER_DIM + 2) * F32_REL * mag + through + (TOPK + 1) * BF16_REL * mag
    return expected, (1 + 2.0**-6) * bound + 1e-30


def check_moe(device) -> bool:
    g = torch.Generator().manual_seed(0)
    x = torch.randn(TOKENS, MODEL_DIM, generator=g).to(device, torch.bfloat16)
    router = torch.randn(EXPERTS, MODEL_DIM, generator=g).to(device)
    router[0] += 3 * x[0].float()  # skew routing: expert 0 takes several tokens
    w_gate_up = (torch.randn(EXPERTS, 2 * INTER_DIM, MODEL_DIM, generator=g) / MODEL_DIM**0.5).to(device, torch.bfloat16)
    w_down = (torch.randn(EXPERTS, MODEL_DIM, INTER_DIM, generator=g) / INTER_DIM**0.5).to(device, torch.bfloat16)

    # weight preparation, once: MXFP4 (floor, as GPT-OSS's checkpoint), aiter's shuffled layouts
    p1, s1 = fq.quantize_mxfp4(w_gate_up)
    p2, s2 = fq.quantize_mxfp4(w_down)
    w1, w1_scale = fq.shuffle_weight_a16w4(p1, gate_up=True), fq.shuffle_scale_a16w4(s1, EXPERTS, gate_up=True)
    w2, w2_scale = fq.shuffle_weight_a16w4(p2), fq.shuffle_scale_a16w4(s2, EXPERTS)
    out, topk_ids, topk_weights = moe_layer(x, router, w1, w1_scale, w2, w2_scale)

    expected, bound = layer_bound(x, fq.dequantize_mxfp4(p1, s1), fq.dequantize_mxfp4(p2, s2), topk_ids.long(),
                                  topk_weights)
    err = (out.float() - expected).abs()
    ok = bool((err <= bound).all())
    print(f"MoE layer ({TOKENS} tokens, top-{TOPK} of {EXPERTS} experts, {MODEL_DIM}x{INTER_DIM} MXFP4 weights, "
          f"fused_moe): max |error| {err.max().item():.3g}, max error/bound {(err / bound).max().item():.3f} -> "
          f"{'within' if ok else 'OUTSIDE'} the derived bound")
    return ok


# GPT-OSS swap: a tiny random GPT-OSS (transformers' own model), its MoE blocks swapped to flyquant.
TINY_GPT_OSS = dict(vocab_size=128, hidden_size=64, intermediate_size=64, num_hidden_layers=1, num_attention_heads=2,
                    num_key_value_heads=1, head_dim=32, num_local_experts=8, num_experts_per_tok=2, sliding_window=4,
                    max_position_embeddings=64)
# No bound is derived through attention and norms: the swapped model's logits must move by at most
# this many times what rounding the experts' input to bf16 alone moves transformers' own logits (the
# kernels round x and a2 to bf16; tests/test_nn.py bounds each MoE block itself).
LOGIT_RATIO = 4.0


def check_gpt_oss() -> bool:
    """patch_gpt_oss on a tiny transformers GPT-OSS whose expert weights are MXFP4 values (so both
    models hold the same weights): logits against transformers' own forward."""
    try:
        from transformers import GptOssConfig, GptOssForCausalLM
    except ImportError:
        print("GPT-OSS swap: skipped (transformers is not installed: pip install 'flyquant[models]', "
              "or -e '.[cpu,models]' in a checkout)")
        return True
    import copy

    from flyquant.nn import patch_gpt_oss

    torch.manual_seed(0)
    model = GptOssForCausalLM(GptOssConfig(**TINY_GPT_OSS, attn_implementation="eager",
                                           experts_implementation="eager")).eval()
    g = torch.Generator().manual_seed(2)
    with torch.no_grad():
        for layer in model.model.layers:
            ex = layer.mlp.experts
            for proj in ("gate_up_proj", "down_proj"):  # (E, in, out): MXFP4 blocks along `in`
                w = (torch.randn(getattr(ex, proj).shape, generator=g).transpose(1, 2) * 0.3).contiguous()
                getattr(ex, proj).copy_(fq.dequantize_mxfp4(*fq.quantize_mxfp4(w)).transpose(1, 2))
            ex.gate_up_proj_bias.copy_(torch.randn(ex.gate_up_proj_bias.shape, generator=g) * 0.5)
            ex.down_proj_bias.copy_(torch.randn(ex.down_proj_bias.shape, generator=g) * 0.5)
    tokens = torch.randint(0, TINY_GPT_OSS["vocab_size"], (1, 6), generator=g)
    bf16_input = copy.deepcopy(model)
    for layer in bf16_input.model.layers:
        layer.mlp.experts.register_forward_pre_hook(lambda m, args: (args[0].bfloat16().float(), *args[1:]))
    with torch.no_grad():
        theirs, rounded = model(tokens).logits, bf16_input(tokens).logits
        ours = patch_gpt_oss(model)(tokens).logits
    d_ours, d_bf16 = float((ours - theirs).abs().max()), float((rounded - theirs).abs().max())
    ok = d_ours <= LOGIT_RATIO * d_bf16
    print(f"GPT-OSS swap (transformers' GptOssForCausalLM, 1 layer, 8 experts, top-2): max |logit change| "
          f"{d_ours:.3g}, {d_ours / d_bf16:.2f}x what bf16 expert inputs alone cause -> "
          f"{'within' if ok else 'OUTSIDE'} {LOGIT_RATIO:g}x")
    return ok


def _same_bytes(a, b) -> bool:
    return a.shape == b.shape and a.stride() == b.stride() and torch.equal(a.view(torch.uint8), b.view(torch.uint8))


def check_mxfp8_step(device) -> bool:
    """Quantize activations (both orientations) and expert weights as MXFP8 training does, check
    bit-exactness against the reference, then a training step through the grouped GEMMs."""
    g = torch.Generator().manual_seed(1)
    groups = 2
    x = (torch.randn(groups * GROUP_ROWS, HIDDEN, generator=g) * 4).to(device, torch.bfloat16)
    w = torch.randn(groups, EXPERT_N, HIDDEN, generator=g).to(device, torch.bfloat16)
    offs = torch.arange(1, groups + 1, dtype=torch.int32, device=device) * GROUP_ROWS

    ok = True
    (xr, sr), (xc, sc) = fq.mxfp8_quantize_dual(x)
    (rr, rsr), (rc, rsc) = reference.mxfp8_quantize_dual(x)
    exact = _same_bytes(xr, rr) and _same_bytes(sr, rsr) and _same_bytes(xc, rc) and _same_bytes(sc, rsc)
    print(f"mxfp8_quantize_dual {tuple(x.shape)}: {'bit-exact' if exact else 'MISMATCH'} vs reference")
    ok &= exact
    d, s = fq.mxfp8_quantize(x, axis=0, scale_layout="tcgen05", offs=offs)
    rd, rs = reference.mxfp8_quantize(x, 0, "rceil", "tcgen05", offs)
    exact = _same_bytes(d, rd) and _same_bytes(s, rs)
    print(f"mxfp8_quantize 32x1 with token groups, tcgen05 scales: {'bit-exact' if exact else 'MISMATCH'}")
    ok &= exact
    # Weights for the forward pass are quantized along K (1x32 per expert row): the 3D op
    # quantizes along N, which the weight-gradient GEMM uses; check it too.
    wq, ws = fq.mxfp8_quantize_3d(w)
    rq, rs3 = reference.mxfp8_quantize_3d(w)
    exact = _same_bytes(wq, rq) and _same_bytes(ws, rs3)
    print(f"mxfp8_quantize_3d {tuple(w.shape)}: {'bit-exact' if exact else 'MISMATCH'}")
    ok &= exact

    return ok and check_mxfp8_training(x, w, offs)


def check_mxfp8_training(x, w, offs) -> bool:
    """One expert GEMM of MXFP8 MoE training through flyquant.training.mxfp8_grouped_mm (torchao's
    contract; its forward, dgrad and wgrad GEMMs are the grouped-GEMM kernels), against the bf16
    autograd of the same grouped matmul: per element, the MX bound of each GEMM's two quantized
    operands (MXFP8_PRODUCT_REL_ERR sum |a||b|), its FP32 sums ((K + 2) 2^-24 sum |a||b|) and
    both sides' bf16 output rounding (2^-8 each)."""
    g = torch.Generator().manual_seed(3)
    grad_out = torch.randn(x.shape[0], w.shape[1], generator=g).to(x.device, torch.bfloat16)
    xa, wt = x.detach().clone().requires_grad_(), w.transpose(1, 2).detach().clone().requires_grad_()
    out = training.mxfp8_grouped_mm(xa, wt, offs)
    out.backward(grad_out)
    xr, wr = x.detach().clone().requires_grad_(), w.transpose(1, 2).detach().clone().requires_grad_()
    bounds = group_bounds(offs)
    ref = torch.cat([xr[lo:hi] @ wr[e] for e, (lo, hi) in enumerate(bounds)])
    ref.backward(grad_out)

    def worst(got, want, a, b):  # got, want ~ a @ b (float64 magnitudes)
        a, b = a.double(), b.double()
        mag, exact = a.abs() @ b.abs(), a @ b
        bound = (MXFP8_PRODUCT_REL_ERR + (a.shape[1] + 2) * F32_REL) * mag
        bound = bound + 2 * BF16_REL * (exact.abs() + bound)
        return float(((got.double() - want.double()).abs() / bound).max())

    ratio = 0.0
    for e, (lo, hi) in enumerate(bounds):
        xg, we, ge = x[lo:hi].cpu(), w[e].cpu(), grad_out[lo:hi].cpu()
        ratio = max(ratio, worst(out[lo:hi].detach().cpu(), ref[lo:hi].detach().cpu(), xg, we.t()),  # forward
                    worst(xa.grad[lo:hi].cpu(), xr.grad[lo:hi].cpu(), ge, we),  # dgrad
                    worst(wt.grad[e].cpu(), wr.grad[e].cpu(), xg.t(), ge))  # wgrad
    within = ratio <= 1.0
    print(f"MXFP8 training step (training.mxfp8_grouped_mm: forward, dgrad, wgrad) vs bf16 autograd: "
          f"max error / MX bound {ratio:.3f} -> {'within' if within else 'OUTSIDE'}")
    return within


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--arch", choices=["gfx950", "gfx942"], default=None,
                        help="emulated arch when there is no AMD GPU (default: FLYQUANT_ARCH, else gfx950)")
    args = parser.parse_args(argv)
    if select.forced_backend() == "reference":
        parser.error("FLYQUANT_BACKEND=reference: no kernel would run and the checks would compare the "
                     "reference with itself; unset it")

    if select.rocm_device_present():
        device = torch.device("cuda")
        print(f"ROCm device found: running on {torch.cuda.get_device_name()} ({select.resolve_target(device).arch})")
        recording = contextlib.nullcontext([])
    else:
        forced = select.forced_arch()  # the selector compiles for it over the emulator's arch
        arch = args.arch or forced or emu.arch() or "gfx950"
        if forced is not None and forced != arch:
            parser.error(f"FLYQUANT_ARCH={forced} would compile every kernel for {forced}, not --arch {arch}; "
                         "unset one of them")
        emu.enable(arch)
        device = torch.device("cpu")
        print(f"No AMD GPU: FlyDSL kernels compiled for {arch} run on the CPU under flyquant.emu")
        recording = emu.record()

    x = torch.zeros(256, 128, dtype=torch.bfloat16, device=device)
    print("\nThe selector's plans:")
    fq.explain(fq.mxfp8_quantize, x, axis=0)
    fq.explain(fq.mxfp8_quantize_dual, x)
    print()
    with recording as launches:
        ok = check_mxfp8_step(device)
        ok &= check_moe(device)
        if device.type == "cpu":  # the tiny model is built on the CPU
            ok &= check_gpt_oss()
    if launches:
        print(f"\nEmulator: {len(launches)} kernel launches")
        for rec in launches:
            st = rec.stats
            print(f"  {st.kernel} ({st.arch}): {st.workgroups_launched} workgroups, "
                  f"{st.wave_instructions} wave-instructions, {st.global_bytes} bytes of global memory traffic")
    print("\nAll checks passed" if ok else "\nSOME CHECKS FAILED")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
