"""The MXFP8 grouped GEMMs of MoE training (issue 22): the reference against an independent FP64
computation and torchao's EMULATED path, input errors, fakes, the selector's plan, and the op
under the emulator on both arches (the training op: tests/test_training.py).

Tolerances, derived (u32 = 2^-24, u16 = 2^-8 the unit roundoffs of FP32 and BF16):
- The dequantized operands are exact in FP32 and BF16 (an E4M3 value times a power of two, in
  range here), so every product of the grouped GEMM is exact in FP32. Summing K of them in FP32,
  in any order, errs by at most gamma_K * S, gamma_K = K u32 / (1 - K u32), S = sum |a_i b_i|;
  rounding to BF16 adds u16 * |result|. So |got - exact| <= gamma_K S + u16 (|exact| + gamma_K S)
  (`fp32_bound`), for the reference and for any kernel that accumulates in FP32.
"""

from __future__ import annotations

from typing import Optional

import oracles
import pytest
import torch

import flyquant as fq
import flyquant.emu as emu
from flyquant import layouts, reference, select, select_grouped_mm, training
from mx_fp64 import deq64, grouped64, groups  # the independent FP64 model
from flyquant.formats import MX_BLOCK

U32, U16 = 2.0**-24, 2.0**-8
E4M3, E8M0 = torch.float8_e4m3fn, torch.float8_e8m0fnu


def fp32_bound(exact, s, k, out_dtype, sides=1):
    gamma = k * U32 / (1 - k * U32)
    rounding = U16 if out_dtype == torch.bfloat16 else 0.0
    return sides * (gamma * s + rounding * (exact.abs() + gamma * s))


def assert_within(got, exact, bound, what=""):
    g = got.double()
    assert torch.equal(g.isnan(), exact.isnan()), f"{what}: NaN positions differ"
    ok = ~exact.isnan()
    err = (g[ok] - exact[ok]).abs()
    assert (err <= bound[ok]).all(), f"{what}: max error {err.max():.3g}, excess {(err - bound[ok]).max():.3g}"


# ------------------------------------------------------------------------------------------------
# Inputs: quantized by flyquant's reference quantize (the GEMM contract's layouts)
# ------------------------------------------------------------------------------------------------


def fwd_inputs(m, n, k, e, seed=0):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(m, k, generator=g) * torch.exp2(torch.randint(-3, 4, (m, 1), generator=g).float())
    w = torch.randn(e, n, k, generator=g)
    a, a_scale = reference.mxfp8_quantize(x.to(torch.bfloat16), -1)
    b, b_scale = reference.mxfp8_quantize(w.reshape(e * n, k).to(torch.bfloat16), -1)
    return a, a_scale, b.view(e, n, k), b_scale.view(e, n, k // MX_BLOCK)


def wgrad_inputs(m, n, k, seed=0):
    g = torch.Generator().manual_seed(seed)
    x, x_scale = reference.mxfp8_quantize(torch.randn(m, k, generator=g).to(torch.bfloat16), 0)
    y, y_scale = reference.mxfp8_quantize(torch.randn(m, n, generator=g).to(torch.bfloat16), 0)
    return x, x_scale, y, y_scale


def offs(*ends):
    return torch.tensor(ends, dtype=torch.int32)


# (M, N, K, offs): unequal groups, empty groups (first, middle, last), E = 1, rows past offs[-1]
FWD_CASES = [
    (96, 48, 64, offs(40, 40, 96)),
    (80, 32, 96, offs(0, 17, 17, 70)),  # 10 rows past offs[-1]
    (64, 16, 32, offs(64)),  # E = 1
    (50, 24, 64, offs(0)),  # one empty group: all rows past the end
    (72, 40, 32, offs(5, 6, 72, 72)),
]
WGRAD_CASES = [
    (96, 48, 64, offs(32, 32, 96)),
    (128, 16, 96, offs(0, 64, 96, 96)),  # 32 rows past offs[-1]
    (64, 32, 32, offs(64)),  # E = 1
    (32, 24, 64, offs(0, 0)),
]


# ------------------------------------------------------------------------------------------------
# Reference vs FP64 and vs torchao's EMULATED path
# ------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("out_dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("m,n,k,ends", FWD_CASES)
def test_reference_forward_vs_fp64(m, n, k, ends, out_dtype):
    a, a_scale, b, b_scale = fwd_inputs(m, n, k, ends.shape[0])
    got = reference.mxfp8_grouped_mm(a, a_scale, b, b_scale, ends, out_dtype)
    assert got.shape == (m, n) and got.dtype == out_dtype
    exact, s = grouped64(deq64(a, a_scale, -1), deq64(b, b_scale, -1), ends)
    assert_within(got, exact, fp32_bound(exact, s, k, out_dtype))
    assert (got[int(ends[-1]):] == 0).all()


@pytest.mark.parametrize("out_dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("m,n,k,ends", WGRAD_CASES)
def test_reference_wgrad_vs_fp64(m, n, k, ends, out_dtype):
    x, x_scale, y, y_scale = wgrad_inputs(m, n, k)
    got = reference.mxfp8_grouped_mm_wgrad(x, x_scale, y, y_scale, ends, out_dtype)
    assert got.shape == (ends.shape[0], n, k) and got.dtype == out_dtype
    # x (M, K) with scales (K, M/32): deq64 of its (K, M) transpose along M
    x64, y64 = deq64(x.t(), x_scale, -1).t(), deq64(y.t(), y_scale, -1).t()
    for g, (lo, hi) in enumerate(groups(ends)):
        exact, s = y64[lo:hi].T @ x64[lo:hi], y64[lo:hi].T.abs() @ x64[lo:hi].abs()
        assert_within(got[g], exact, fp32_bound(exact, s, hi - lo, out_dtype), f"group {g}")


def test_reference_special_values():
    """A NaN scale (0xFF) or a NaN element makes its rows NaN; max-magnitude elements and scales
    around 2^0 stay exact (checked against the FP64 model)."""
    a, a_scale, b, b_scale = fwd_inputs(64, 32, 64, 2)
    a.view(torch.uint8)[3, 5] = 0x7F  # NaN element
    a_scale.view(torch.uint8)[10, 1] = 0xFF  # NaN scale
    a.view(torch.uint8)[20] = 0x7E  # 448 everywhere in row 20
    b_scale.view(torch.uint8)[1, 7, 0] = 0xFF  # expert 1, output column 7
    ends = offs(30, 64)
    got = reference.mxfp8_grouped_mm(a, a_scale, b, b_scale, ends, torch.float32)
    exact, s = grouped64(deq64(a, a_scale, -1), deq64(b, b_scale, -1), ends)
    assert got[3].isnan().all() and got[10].isnan().all() and got[30:, 7].isnan().all() and not got[:30, 7].isnan()[:3].any()
    assert_within(got, exact, fp32_bound(exact, s, 64, torch.float32))


@pytest.fixture(scope="module")
def torchao_emulated():
    """torchao 0.18's two emulated MXFP8 grouped GEMMs, loaded by source (its moe_training package
    does not import beside flydsl 0.4.2 without install(), which would patch this process)."""
    pytest.importorskip("torchao", reason="torchao is not installed")
    path = oracles._package_dir("torchao") / "prototype" / "moe_training" / "mxfp8_grouped_mm.py"
    names = ["_emulated_mxfp8_scaled_grouped_mm_2d_3d", "_emulated_mxfp8_scaled_grouped_mm_2d_2d"]
    return oracles.load_functions(path, names, {"torch": torch, "Optional": Optional})


@pytest.mark.parametrize("m,n,k,ends", [c for c in FWD_CASES if c[1] % 8 == 0 and c[2] % 8 == 0])
def test_reference_forward_vs_torchao_emulated(torchao_emulated, m, n, k, ends):
    """torchao dequantizes to BF16 (exact here) and runs torch._grouped_mm: both sides within
    fp32_bound of the exact result, so within twice it of each other. Rows past offs[-1] are
    unspecified in torch._grouped_mm's output: compared up to offs[-1]."""
    a, a_scale, b, b_scale = fwd_inputs(m, n, k, ends.shape[0])
    ours = reference.mxfp8_grouped_mm(a, a_scale, b, b_scale, ends)
    theirs = torchao_emulated._emulated_mxfp8_scaled_grouped_mm_2d_3d(
        a, a_scale, b.transpose(1, 2), b_scale.transpose(1, 2), offs=ends, out_dtype=torch.bfloat16)
    exact, s = grouped64(deq64(a, a_scale, -1), deq64(b, b_scale, -1), ends)
    end = int(ends[-1])
    diff = (ours[:end].double() - theirs[:end].double()).abs()
    assert (diff <= fp32_bound(exact, s, k, torch.bfloat16, sides=2)[:end]).all()


@pytest.mark.parametrize("m,n,k,ends", [c for c in WGRAD_CASES if int(c[3][-1]) == c[0] and c[1] % 8 == 0])
def test_reference_wgrad_vs_torchao_emulated(torchao_emulated, m, n, k, ends):
    """torchao's wgrad GEMM on the transposed operands (its _compute_wgrad_emulated): (E, N, K)."""
    x, x_scale, y, y_scale = wgrad_inputs(m, n, k)
    ours = reference.mxfp8_grouped_mm_wgrad(x, x_scale, y, y_scale, ends)
    theirs = torchao_emulated._emulated_mxfp8_scaled_grouped_mm_2d_2d(
        y.t(), y_scale, x.t(), x_scale, offs=ends, out_dtype=torch.bfloat16)
    x64, y64 = deq64(x.t(), x_scale, -1).t(), deq64(y.t(), y_scale, -1).t()
    for g, (lo, hi) in enumerate(groups(ends)):
        exact, s = y64[lo:hi].T @ x64[lo:hi], y64[lo:hi].T.abs() @ x64[lo:hi].abs()
        diff = (ours[g].double() - theirs[g].double()).abs()
        assert (diff <= fp32_bound(exact, s, hi - lo, torch.bfloat16, sides=2)).all(), f"group {g}"


# ------------------------------------------------------------------------------------------------
# Input errors
# ------------------------------------------------------------------------------------------------


def test_bad_inputs(reference_backend):
    a, a_scale, b, b_scale = fwd_inputs(64, 32, 64, 2)
    ok = offs(30, 64)
    cases = [
        ((a.float(), a_scale, b, b_scale, ok), TypeError, "a must have dtype"),
        ((a, a_scale.view(torch.uint8), b, b_scale, ok), TypeError, "a_scale must have dtype"),
        ((a, a_scale, b[:, :, :32].contiguous(), b_scale[:, :, :1].contiguous(), ok), ValueError, "must equal a.shape"),
        ((a[:, :48], a_scale[:, :1], b, b_scale, ok), ValueError, "quantized in blocks of 32"),
        ((a, a_scale[:, :1], b, b_scale, ok), ValueError, "a_scale must have shape"),
        ((a, a_scale, b.transpose(1, 2).contiguous().transpose(1, 2), b_scale, ok), ValueError,
         r"b must be contiguous .* along N: quantize w.transpose\(1, 2\)"),
        # quantized along M (axis=0): the orientation is named, not the scales' shape that follows from it
        ((*reference.mxfp8_quantize(torch.randn(96, 64, dtype=torch.bfloat16), 0), b, b_scale, ok), ValueError,
         r"a must be contiguous \(row-major, quantized along K"),
        ((a, a_scale, b, b_scale, ok.long()), TypeError, "offs must have dtype"),
        ((a, a_scale, b, b_scale, offs(64)), ValueError, r"offs must have shape \(2,\)"),
        ((a, a_scale, b, b_scale, offs(30, 64, 64, 64)[::2]), ValueError, "offs must be contiguous"),
        ((a, a_scale, b, b_scale, offs(40, 30)), ValueError, "non-decreasing"),
        ((a, a_scale, b, b_scale, offs(-1, 30)), ValueError, "non-decreasing"),
        ((a, a_scale, b, b_scale, offs(30, 65)), ValueError, "at most M = 64"),
    ]
    for args, exc, words in cases:
        with pytest.raises(exc, match=words):
            fq.mxfp8_grouped_mm(*args)
    with pytest.raises(TypeError, match="out_dtype"):
        fq.mxfp8_grouped_mm(a, a_scale, b, b_scale, ok, torch.float16)
    if torch.cuda.is_available():
        with pytest.raises(ValueError, match="device"):
            fq.mxfp8_grouped_mm(a, a_scale, b, b_scale, ok.cuda())

    x, x_scale, y, y_scale = wgrad_inputs(96, 32, 64)
    good = offs(32, 96)
    y64, y64_scale = wgrad_inputs(64, 32, 64)[2:]
    wcases = [
        ((x, x_scale, y, y_scale, offs(40, 96)), "multiple of 32"),
        ((x, x_scale, y, y_scale, offs(32, 128)), "at most M = 96"),
        ((x.contiguous(), x_scale, y, y_scale, good), "column-major"),
        ((x, x_scale, y64, y64_scale, good), "must equal x.shape"),
        ((x, x_scale.t().contiguous(), y, y_scale, good), "x_scale must have shape"),
        ((*reference.mxfp8_quantize(torch.randn(96, 64, dtype=torch.bfloat16), -1), y, y_scale, good),
         r"x must be column-major .* quantized along M"),
    ]
    for args, words in wcases:
        with pytest.raises(ValueError, match=words):
            fq.mxfp8_grouped_mm_wgrad(*args)


# ------------------------------------------------------------------------------------------------
# Fakes, plans, explain
# ------------------------------------------------------------------------------------------------


def test_fakes_and_opcheck(reference_backend):
    from torch._subclasses.fake_tensor import FakeTensorMode

    a, a_scale, b, b_scale = fwd_inputs(64, 32, 64, 2)
    x, x_scale, y, y_scale = wgrad_inputs(64, 48, 32)
    with FakeTensorMode(allow_non_fake_inputs=True) as mode:
        fa, fs, fb, fbs, fo = (mode.from_tensor(t) for t in (a, a_scale, b, b_scale, offs(30, 64)))
        out = fq.mxfp8_grouped_mm(fa, fs, fb, fbs, fo, torch.float32)
        assert out.shape == (64, 32) and out.dtype == torch.float32
        fx, fxs, fy, fys = (mode.from_tensor(t) for t in (x, x_scale, y, y_scale))
        w = fq.mxfp8_grouped_mm_wgrad(fx, fxs, fy, fys, fo)
        assert w.shape == (2, 48, 32) and w.dtype == torch.bfloat16
    from flyquant import grouped_mm

    # opcheck's test_schema multiplies the inputs, which CPU torch does not do for float8_e4m3fn
    utils = ("test_autograd_registration", "test_faketensor", "test_aot_dispatch_dynamic")
    torch.library.opcheck(grouped_mm._grouped_mm_op, (a, a_scale, b, b_scale, offs(30, 64), torch.bfloat16),
                          test_utils=utils)
    torch.library.opcheck(grouped_mm._grouped_mm_wgrad_op, (x, x_scale, y, y_scale, offs(32, 64), torch.float32),
                          test_utils=utils)


def test_plans_and_explain(capsys):
    """Under the emulator both GEMMs plan their FlyDSL kernel (the forward's tile_m by the average
    group); explain prints the plan."""
    a, a_scale, b, b_scale = fwd_inputs(64, 32, 64, 2)
    x, x_scale, y, y_scale = wgrad_inputs(64, 32, 64)
    plan = fq.explain(fq.mxfp8_grouped_mm, a, a_scale, b, b_scale, offs(30, 64))
    assert plan.backend == "flydsl" and plan.config["tile_m"] == 64 and "64 rows over 2 groups" in plan.reasons[-1]
    plan = fq.explain(fq.mxfp8_grouped_mm_wgrad, x, x_scale, y, y_scale, offs(32, 64))
    assert plan.backend == "flydsl" and plan.kernel == "mxfp8_grouped_mm_wgrad_gfx950_bf16_n32_k64_e2_128x128_w2x2"
    out = capsys.readouterr().out
    assert "mxfp8_grouped_mm: flydsl" in out and "mxfp8_grouped_mm_wgrad: flydsl" in out


@pytest.mark.parametrize("arch, m, n, experts, tiles", [
    ("gfx950", 16640, 2048, 8, (192, 256)),  # torchao's grid: 87 x 8 workgroups (either scale layout)
    ("gfx950", 16640, 2048, 100, (128, 256)),  # groups of 166 rows on average: tile_m 128
    ("gfx942", 16640, 2048, 8, (128, 128)),
    ("gfx950", 16640, 2880, 8, (128, 320)),  # GPT-OSS: 256 would mask 192 columns
    ("gfx950", 16640, 2880, 1, (128, 192)),  # one expert, row-major scales: not 320 (the selector's docstring)
    ("gfx950", 16640, 2880, 2, (128, 320)),
    ("gfx950", 16640, 5120, 100, (128, 320)),  # 320 before 256 where both divide N
    ("gfx950", 16640, 5120, 1, (192, 256)),
    ("gfx950", 4096, 2048, 8, (128, 256)),  # 22 x 8 tiles of 192x256: fewer than the 256 CUs; 32 x 8 of 128x256
    ("gfx950", 16640, 2080, 8, (128, 128)),  # none of 256, 320 and 192 divides N
    ("gfx950", 2048, 2048, 8, (128, 128)),  # 16 x 8 tiles of 256: fewer than the 256 CUs
    ("gfx950", 16640, 2048, 256, (64, 128)),  # 65 rows per group
])
def test_forward_tiles(arch, m, n, experts, tiles):
    assert select_grouped_mm.grouped_mm_tiles(arch, m, n, experts)[0] == tiles


def test_one_expert_takes_320_with_mfma_scales():
    tiles, why = select_grouped_mm.grouped_mm_tiles("gfx950", 16640, 2880, 1, "mfma")
    assert tiles == (128, 320) and not any("not 320" in w for w in why)
    assert any("not 320" in w for w in select_grouped_mm.grouped_mm_tiles("gfx950", 16640, 2880, 1)[1])


@pytest.mark.parametrize("arch, n, k, experts, tiles", [
    ("gfx950", 2048, 2048, 8, (128, 256)),  # torchao's grid: 16 x 8 x 8 workgroups
    ("gfx950", 2048, 2048, 1, (128, 128)),  # 16 x 8 tiles of 256: fewer than the 256 CUs
    ("gfx950", 2880, 2880, 32, (128, 320)),  # GPT-OSS: 256 does not divide K
    ("gfx950", 2880, 2880, 1, (128, 192)),  # 23 x 9 tiles of 320: fewer than the 256 CUs
    ("gfx950", 2048, 5120, 8, (128, 320)),
    ("gfx950", 2048, 2080, 8, (128, 128)),  # none of 256, 320 and 192 divides K
    ("gfx942", 2048, 2048, 8, (128, 128)),
])
def test_wgrad_tiles(arch, n, k, experts, tiles):
    assert select_grouped_mm.grouped_mm_wgrad_tiles(arch, n, k, experts)[0] == tiles


def test_explain_names_the_wide_tile():
    a, a_scale, b, b_scale = fwd_inputs(32768, 256, 64, 1)
    ends = offs(32768)
    plan = fq.explain(fq.mxfp8_grouped_mm, a, layouts.mfma_shuffle_scales(a_scale), b,
                      torch.stack([layouts.mfma_shuffle_scales(s) for s in b_scale]), ends, scale_layout="mfma")
    assert plan.config["tile_n"] == 256 and "tile_n 256" in plan.reasons[-1]


def test_lds_staging_on_the_tall_tile_with_mfma_scales():
    """gfx950's 192x256 forward tile with "mfma" scales stages its operands in LDS (the plan's
    kernel and reasons say so); row-major scales, the other tiles and gfx942 load them per wave."""
    assert select_grouped_mm.grouped_mm_lds_stage("gfx950", (192, 256), "mfma")[0]
    for arch, tiles, layout in (("gfx950", (192, 256), None), ("gfx950", (128, 320), "mfma"),
                                ("gfx950", (64, 128), "mfma"), ("gfx942", (192, 256), "mfma")):
        assert select_grouped_mm.grouped_mm_lds_stage(arch, tiles, layout) == (False, ())
    a, a_scale, b, b_scale = fwd_inputs(16640, 768, 64, 1)
    plan = fq.explain(fq.mxfp8_grouped_mm, a, layouts.mfma_shuffle_scales(a_scale), b,
                      torch.stack([layouts.mfma_shuffle_scales(s) for s in b_scale]), offs(16640), scale_layout="mfma")
    assert (plan.config["tile_m"], plan.config["tile_n"], plan.config["lds_stage"]) == (192, 256, True)
    assert plan.kernel.endswith("_lds") and "staged in LDS" in plan.reasons[-1]


@pytest.mark.parametrize("op", ["forward", "wgrad"])
def test_shapes_the_kernels_do_not_take_go_to_the_reference(op, monkeypatch):
    """Output columns not a multiple of 16: the reference, with the reason (an error when the
    kernel is forced)."""
    if op == "forward":
        a, a_scale, b, b_scale = fwd_inputs(64, 40, 64, 2)
        fn, args, k = fq.mxfp8_grouped_mm, (a, a_scale, b, b_scale, offs(30, 64)), 64
        exact, s = grouped64(deq64(a, a_scale, -1), deq64(b, b_scale, -1), offs(30, 64))
    else:
        x, x_scale, y, y_scale = wgrad_inputs(64, 32, 40)
        fn, args, k = fq.mxfp8_grouped_mm_wgrad, (x, x_scale, y, y_scale, offs(32, 64)), 32
    plan = fq.explain(fn, *args)
    assert plan.backend == "reference" and "not a multiple of 16" in plan.reasons[-1]
    got = fn(*args, torch.float32)
    if op == "forward":
        assert_within(got, exact, fp32_bound(exact, s, k, torch.float32))
    else:
        assert torch.equal(got, reference.mxfp8_grouped_mm_wgrad(*args, torch.float32))
    monkeypatch.setenv("FLYQUANT_BACKEND", "flydsl")
    with pytest.raises(select.BackendError, match="not a multiple of 16"):
        fn(*args)


# ------------------------------------------------------------------------------------------------
# Whatever the selector runs under the emulator, per arch, against the FP64 model
# ------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("arch", ["gfx942", "gfx950"])
def test_selected_backend_under_emulator(arch, monkeypatch):
    """Both GEMMs' kernels, emulated for each arch under strict memory, against the
    FP32-accumulation bound."""
    monkeypatch.setenv("FLYQUANT_ARCH", arch)
    m, n, k, ends = 80, 32, 96, offs(0, 17, 17, 70)
    a, a_scale, b, b_scale = fwd_inputs(m, n, k, 4)
    plan = select_grouped_mm.plan_mxfp8_grouped_mm(a, b, ends, torch.bfloat16)
    assert plan.where == "emulator" and plan.backend == "flydsl" and plan.arch == arch, plan
    got = fq.mxfp8_grouped_mm(a, a_scale, b, b_scale, ends)
    exact, s = grouped64(deq64(a, a_scale, -1), deq64(b, b_scale, -1), ends)
    assert_within(got, exact, fp32_bound(exact, s, k, torch.bfloat16))
    assert (got[70:] == 0).all()

    x, x_scale, y, y_scale = wgrad_inputs(128, 16, 96)
    ends = offs(0, 64, 96, 96)
    plan = select_grouped_mm.plan_mxfp8_grouped_mm_wgrad(x, y, ends, torch.float32)
    assert plan.where == "emulator" and plan.backend == "flydsl" and plan.arch == arch, plan
    got = fq.mxfp8_grouped_mm_wgrad(x, x_scale, y, y_scale, ends, torch.float32)
    x64, y64 = deq64(x.t(), x_scale, -1).t(), deq64(y.t(), y_scale, -1).t()
    for g, (lo, hi) in enumerate(groups(ends)):
        exact, s = y64[lo:hi].T @ x64[lo:hi], y64[lo:hi].T.abs() @ x64[lo:hi].abs()
        assert_within(got[g], exact, fp32_bound(exact, s, max(hi - lo, 1), torch.float32), f"group {g}")


@pytest.mark.parametrize("arch", ["gfx942", "gfx950"])
def test_plans_name_the_launched_kernel_and_refuse_what_the_call_refuses(arch, monkeypatch):
    """explain()'s plans are the launched kernels' names (they were '<op>_<dtype>_<arch>', a prefix of
    none: the launched ones are '<op>_<arch>_<dtype>_n<N>_k<K>_e<E>_<tiles>_w2x2[_smfma][_pz]'), and offs
    the host holds are checked by explain as by the call (explain planned a wgrad whose group of 7
    rows the call refuses)."""
    monkeypatch.setenv("FLYQUANT_ARCH", arch)
    a, a_scale, b, b_scale = fwd_inputs(80, 48, 64, 2)
    x, x_scale, y, y_scale = wgrad_inputs(64, 48, 32)
    mfma = (layouts.mfma_shuffle_scales(a_scale), torch.stack([layouts.mfma_shuffle_scales(s) for s in b_scale]))
    calls = [(fq.mxfp8_grouped_mm, (a, a_scale, b, b_scale, offs(30, 80)), {}),
             (fq.mxfp8_grouped_mm, (a, mfma[0], b, mfma[1], offs(0, 70)), dict(scale_layout="mfma", out_dtype=torch.float32)),
             (fq.mxfp8_grouped_mm, (a, a_scale, b, b_scale, offs(30, 80)), dict(signed_zeros=False)),
             (fq.mxfp8_grouped_mm_wgrad, (x, x_scale, y, y_scale, offs(32, 64)), dict(out_dtype=torch.float32))]
    for fn, args, kw in calls:
        plan = fq.explain(fn, *args, **kw)
        with emu.record() as launches:
            fn(*args, **kw)
        assert [r.kernel for r in launches] == [plan.kernel], kw
    for fn, args in ((fq.mxfp8_grouped_mm, (a, a_scale, b, b_scale, offs(70, 30))),
                     (fq.mxfp8_grouped_mm_wgrad, (x, x_scale, y, y_scale, offs(7, 64)))):
        for call in (fn, lambda *args: fq.explain(fn, *args)):
            with pytest.raises(ValueError, match="offs"):
                call(*args)


# ------------------------------------------------------------------------------------------------
# The training op
# ------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("arch", ["gfx942", "gfx950"])
def test_explain_names_the_operands_promise(arch, monkeypatch):
    """signed_zeros=False shows in the plans: the quantize kernel's +0 variant, and on gfx942 (FNUZ)
    the GEMM reading its operands as loaded; gfx950 runs one GEMM either way. A non-bool is refused."""
    monkeypatch.setenv("FLYQUANT_ARCH", arch)
    a, a_scale, b, b_scale = fwd_inputs(64, 32, 64, 2)
    x = torch.randn(64, 64).to(torch.bfloat16)
    assert fq.explain(fq.mxfp8_quantize, x, signed_zeros=False).kernel.endswith("_pz")
    assert not fq.explain(fq.mxfp8_quantize, x).kernel.endswith("_pz")
    assert fq.explain(fq.mxfp8_quantize_3d, torch.randn(2, 32, 64), signed_zeros=False).kernel.endswith("_pz")
    plan = fq.explain(fq.mxfp8_grouped_mm, a, a_scale, b, b_scale, offs(30, 64), signed_zeros=False)
    assert plan.kernel.endswith("_pz") == (arch == "gfx942")
    assert any("as loaded" in r for r in plan.reasons) == (arch == "gfx942")
    x_, x_scale, y, y_scale = wgrad_inputs(64, 48, 32)
    assert fq.explain(fq.mxfp8_grouped_mm_wgrad, x_, x_scale, y, y_scale, offs(32, 64),
                      signed_zeros=False).kernel.endswith("_pz") == (arch == "gfx942")
    for call in (lambda: fq.mxfp8_grouped_mm(a, a_scale, b, b_scale, offs(30, 64), signed_zeros="no"),
                 lambda: fq.mxfp8_quantize(x, signed_zeros=0), lambda: fq.explain(fq.mxfp8_quantize, x, signed_zeros=1)):
        with pytest.raises(ValueError, match="signed_zeros must be a bool"):
            call()


def test_kernel_hook(monkeypatch):
    """A launcher registered in select_grouped_mm.GROUPED_MM_KERNELS takes the op's inputs, an out of the
    result's shape and dtype to write every element of, the arch, the operands' signed_zeros, the
    op's options and the plan's config; CPU offs are checked first. A stand-in launcher (the reference's values) takes the
    kernels' place, so this also covers the weight-gradient hook before its kernel exists."""
    seen = []

    def launch(*inputs, out, arch, **options):
        seen.append((arch, out.shape, out.dtype, sorted(options)))
        if out.dim() == 2:
            out.copy_(reference.mxfp8_grouped_mm(*inputs, out.dtype, options.get("scale_layout")))
        else:
            out.copy_(reference.mxfp8_grouped_mm_wgrad(*inputs, out.dtype))

    monkeypatch.setitem(select_grouped_mm.GROUPED_MM_KERNELS, "mxfp8_grouped_mm", "stand_in:launch")
    monkeypatch.setitem(select_grouped_mm.GROUPED_MM_KERNELS, "mxfp8_grouped_mm_wgrad", "stand_in:launch_wgrad")
    monkeypatch.setattr(select_grouped_mm, "grouped_mm_launcher", lambda plan: launch)
    monkeypatch.setenv("FLYQUANT_ARCH", "gfx942")
    a, a_scale, b, b_scale = fwd_inputs(64, 32, 64, 2)
    plan = fq.explain(fq.mxfp8_grouped_mm, a, a_scale, b, b_scale, offs(30, 64))
    assert (plan.backend, plan.kernel, plan.arch) == ("flydsl", "mxfp8_grouped_mm_gfx942_bf16_n32_k64_e2_64x128_w2x2",
                                                      "gfx942")
    got = fq.mxfp8_grouped_mm(a, a_scale, b, b_scale, offs(30, 64))
    assert torch.equal(got, reference.mxfp8_grouped_mm(a, a_scale, b, b_scale, offs(30, 64)))
    x, x_scale, y, y_scale = wgrad_inputs(64, 48, 32)
    got = fq.mxfp8_grouped_mm_wgrad(x, x_scale, y, y_scale, offs(32, 64), torch.float32)
    assert torch.equal(got, reference.mxfp8_grouped_mm_wgrad(x, x_scale, y, y_scale, offs(32, 64), torch.float32))
    assert seen == [("gfx942", (64, 32), torch.bfloat16, ["lds_stage", "scale_layout", "signed_zeros", "tile_m", "tile_n"]),
                    ("gfx942", (2, 48, 32), torch.float32, ["signed_zeros", "tile_m", "tile_n"])]
    with pytest.raises(ValueError, match="multiple of 32"):  # CPU offs checked before the launch
        fq.mxfp8_grouped_mm_wgrad(x, x_scale, y, y_scale, offs(40, 64))
    assert len(seen) == 2


def test_launcher_lookup():
    from flyquant.kernels import mxfp8_quantize_2d

    plan = select.Plan("mxfp8_grouped_mm", "flydsl", "emulator", "gfx950", "k",
                       {"launcher": "mxfp8_quantize_2d:quantize_1x32"})
    assert select_grouped_mm.grouped_mm_launcher(plan) is mxfp8_quantize_2d.quantize_1x32


@pytest.mark.parametrize("arch", ["gfx942", "gfx950"])
def test_mfma_scale_layout(arch, monkeypatch):
    """scale_layout="mfma" (the quantize ops' aiter layout, what the training op passes): the
    reference un-shuffles to exactly the plain result, the kernel (emulated) meets the bound, and
    the layout's inverse undoes it, padding dropped."""
    monkeypatch.setenv("FLYQUANT_ARCH", arch)
    m, n, k, ends = 72, 48, 160, offs(30, 30, 72)
    a, a_scale, b, b_scale = fwd_inputs(m, n, k, 3, seed=5)
    a_m = layouts.mfma_shuffle_scales(a_scale)
    b_m = torch.stack([layouts.mfma_shuffle_scales(s) for s in b_scale])
    assert torch.equal(layouts.mfma_unshuffle_scales(a_m)[:m, :k // MX_BLOCK].view(torch.uint8), a_scale.view(torch.uint8))
    plain = reference.mxfp8_grouped_mm(a, a_scale, b, b_scale, ends, torch.float32)
    assert torch.equal(reference.mxfp8_grouped_mm(a, a_m, b, b_m, ends, torch.float32, "mfma"), plain)
    assert fq.explain(fq.mxfp8_grouped_mm, a, a_m, b, b_m, ends, scale_layout="mfma").backend == "flydsl"
    got = fq.mxfp8_grouped_mm(a, a_m, b, b_m, ends, torch.float32, "mfma")
    exact, s = grouped64(deq64(a, a_scale, -1), deq64(b, b_scale, -1), ends)
    assert_within(got, exact, fp32_bound(exact, s, k, torch.float32))
    with pytest.raises(ValueError, match="a_scale"):  # plain scales announced as shuffled
        fq.mxfp8_grouped_mm(a, a_scale, b, b_scale, ends, torch.float32, "mfma")


@pytest.mark.parametrize("where", ["reference", "gfx942", "gfx950"])
def test_training_op_with_no_tokens(where, monkeypatch):
    """M = 0 (an expert-parallel rank that received no tokens): a (0, N) output, an empty grad_A and
    a zero grad_B_t on every backend. The reference GEMM used to refuse the "mfma" scales of zero
    rows (mfma_unshuffle_scales wanted a positive row count) and the backward quantized no 32x1
    block (M = 0 is not a positive multiple of 32)."""
    if where == "reference":
        monkeypatch.setenv("FLYQUANT_BACKEND", "reference")
    else:
        monkeypatch.setenv("FLYQUANT_ARCH", where)
    A = torch.randn(0, 64, dtype=torch.bfloat16, requires_grad=True)
    B_t = torch.randn(2, 32, 64, dtype=torch.bfloat16).transpose(1, 2).requires_grad_()  # (E, K, N) torchao's view
    out = training.mxfp8_grouped_mm(A, B_t, offs(0, 0))
    assert out.shape == (0, 32) and out.dtype == torch.bfloat16
    out.backward(torch.zeros_like(out))
    assert A.grad.shape == (0, 64) and B_t.grad.shape == (2, 64, 32) and B_t.grad.dtype == torch.bfloat16
    assert (B_t.grad == 0).all()
    assert layouts.mfma_unshuffle_scales(layouts.mfma_shuffle_scales(torch.zeros(0, 3, dtype=E8M0))).shape == (0, 8)
    if where != "reference":  # an empty output's plan says nothing is launched (it named a kernel: helper-75)
        a, a_scale = reference.mxfp8_quantize(torch.zeros(0, 64, dtype=torch.bfloat16), -1)
        b, b_scale = reference.mxfp8_quantize(torch.zeros(64, 64, dtype=torch.bfloat16), -1)
        args = (a, a_scale, b.view(2, 32, 64), b_scale.view(2, 32, 2), offs(0, 0))
        with emu.record() as launches:
            fq.mxfp8_grouped_mm(*args)
        assert launches == [] and "an empty output: nothing is launched" in fq.explain(fq.mxfp8_grouped_mm, *args).reasons


def test_training_op_names_b_t_layout(reference_backend):
    """A B_t in neither accepted layout is refused up front naming B_t and both layouts (the 3D
    quantize's error named its own argument w and an (E, N, K) shape)."""
    A = torch.randn(64, 64, dtype=torch.bfloat16)
    base = torch.randn(2, 64, 64, dtype=torch.bfloat16)
    for bad in (base[:, :, ::2], base[:1, :, :32].expand(2, 64, 32), torch.randn(32, 2, 64).permute(1, 2, 0)):
        with pytest.raises(ValueError, match=r"B_t must be contiguous \(E, K, N\) or the transpose .* \(2048, 32, 1\) "
                                             r"or \(2048, 1, 64\)"):
            training.mxfp8_grouped_mm(A, bad.to(torch.bfloat16), offs(32, 64))
