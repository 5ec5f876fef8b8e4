"""Property-based tests of the public API (issue 21; the MXFP4 quantize ops too): random shapes,
views, dtypes, modes and layouts, each call made on the kernel path (FlyDSL under flyquant.emu,
both arches, strict memory from conftest.py) and on the reference path. Both must agree: the same bytes as the
reference on a contiguous copy, or the same exception type and message on both paths. The GEMMs
(the MXFP8 grouped GEMMs, fq.fused_moe, stage 2) sum in another order than the reference: they
are held to their kernel tests' derived bounds against a float64 model instead.

Example counts are bounded (PROFILE) so the default run stays short; examples are derived
from the test's name (derandomized, so CI is repeatable) and a failure prints the falsifying
example and the blob that reproduces it (`@reproduce_failure`).
"""

from __future__ import annotations

import contextlib
import os
import re

import pytest
import torch

hypothesis = pytest.importorskip("hypothesis", reason="hypothesis is in the test extra")
from hypothesis import HealthCheck, given, settings  # noqa: E402
from hypothesis import strategies as st  # noqa: E402

import flyquant as fq  # noqa: E402
import flyquant.emu as emu  # noqa: E402

ARCHS = ("gfx950", "gfx942")
PROFILE = dict(max_examples=16, deadline=None, derandomize=True, database=None, print_blob=True,
               suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])
DTYPES = (torch.bfloat16, torch.float16, torch.float32)


@contextlib.contextmanager
def backend(name: str, arch: str | None = None):
    """FLYQUANT_BACKEND (and FLYQUANT_ARCH) for the block."""
    saved = {k: os.environ.get(k) for k in ("FLYQUANT_BACKEND", "FLYQUANT_ARCH")}
    os.environ["FLYQUANT_BACKEND"] = name
    if arch:
        os.environ["FLYQUANT_ARCH"] = arch
    try:
        yield
    finally:
        for k, v in saved.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v


def outcome(call):
    """('ok', outputs) or ('error', type, message)."""
    try:
        out = call()
    except (ValueError, TypeError, NotImplementedError) as exc:
        return ("error", type(exc), str(exc))
    flat = []
    for o in out if isinstance(out, tuple) else (out,):
        flat.extend(o if isinstance(o, tuple) else (o,))
    return ("ok", flat)


def strides(t):
    """The strides that place elements (dims of size 1 or empty tensors place none)."""
    return () if t.numel() == 0 else tuple(st for n, st in zip(t.shape, t.stride()) if n > 1)


def assert_same_outcome(kernel, ref, what):
    assert kernel[0] == ref[0], f"{what}: kernel path {kernel[0]} {kernel[1:] if kernel[0] == 'error' else ''}, " \
                                f"reference path {ref[0]} {ref[1:] if ref[0] == 'error' else ''}"
    if kernel[0] == "error":
        assert kernel[1:] == ref[1:], f"{what}: different errors"
        return
    assert len(kernel[1]) == len(ref[1])
    for i, (g, w) in enumerate(zip(kernel[1], ref[1])):
        assert g.dtype == w.dtype and tuple(g.shape) == tuple(w.shape), f"{what} output {i}"
        assert strides(g) == strides(w), f"{what} output {i} strides {g.stride()} != {w.stride()}"
        assert torch.equal(g.view(torch.uint8), w.view(torch.uint8)), f"{what} output {i} bytes differ"


def both_paths(arch, fn, x, **kwargs):
    """Run fn on the kernel path and on the reference path; compare; on success also compare
    with flyquant.reference on a contiguous copy of x."""
    with backend("flydsl", arch):
        kernel = outcome(lambda: fn(x, **kwargs))
    with backend("reference"):
        ref = outcome(lambda: fn(x, **kwargs))
    what = f"{fn.__name__}{tuple(x.shape)} strides {x.stride()} {x.dtype} {kwargs} on {arch}"
    assert_same_outcome(kernel, ref, what)
    if kernel[0] == "ok":
        oracle = outcome(lambda: getattr(fq.reference, fn.__name__)(x.contiguous(), **kwargs))
        assert_same_outcome(kernel, oracle, what + " vs reference on a contiguous copy")


# Sizes users hit: 0, 1, primes, tails and whole blocks (M, K along a block dim: multiples of
# 32 plus odd ones, which must be refused alike on both paths).
BLOCK_DIM = st.sampled_from([32, 64, 96, 160, 224, 256, 40, 33, 0])
FREE_DIM = st.sampled_from([0, 1, 2, 3, 5, 7, 31, 37, 64, 97, 130])


@st.composite
def tensors(draw, shape):
    """A tensor of `shape` made as users make them: contiguous, at a storage offset, a
    transposed or sliced view, or a stride-0 expand; values random with specials mixed in."""
    dtype = draw(st.sampled_from(DTYPES))
    # most examples reach the kernels; the views the kernels refuse come up often enough
    kind = draw(st.sampled_from(["contiguous", "contiguous", "offset", "offset", "transposed", "sliced", "expanded"]))
    seed = draw(st.integers(0, 2**16))
    g = torch.Generator().manual_seed(seed)
    n = 1
    for d in shape:
        n *= d

    def values(count):
        v = torch.randn(count, generator=g) * 2.0 ** draw(st.integers(-20, 20))
        if count and draw(st.booleans()):
            specials = torch.tensor([0.0, -0.0, float("nan"), float("inf"), -float("inf"), 1e30, 2.0**-130, 448.0])
            idx = torch.randint(0, count, (min(count, 4),), generator=g)
            v[idx] = specials[torch.randint(0, len(specials), (idx.numel(),), generator=g)]
        return v.to(dtype)

    if kind == "offset":
        return values(n + 3)[3:].view(shape)
    if kind == "transposed" and len(shape) >= 2:
        return values(n).view(*shape[:-2], shape[-1], shape[-2]).transpose(-1, -2)
    if kind == "sliced" and len(shape) >= 2:
        return values(n * 2).view(*shape[:-1], shape[-1] * 2)[..., : shape[-1]]
    if kind == "expanded" and len(shape) >= 2:
        return values(shape[-1]).expand(*shape)
    return values(n).view(shape)


@pytest.mark.parametrize("arch", ARCHS)
@settings(**PROFILE)
@given(data=st.data(), axis=st.sampled_from([-1, 0]), mode=st.sampled_from(["floor", "rceil"]),
       layout=st.sampled_from([None, "tcgen05", "mfma"]))
def test_mxfp8_quantize(arch, data, axis, mode, layout):
    shape = (data.draw(BLOCK_DIM), data.draw(BLOCK_DIM)) if axis == 0 else (data.draw(FREE_DIM), data.draw(BLOCK_DIM))
    x = data.draw(tensors(shape))
    both_paths(arch, fq.mxfp8_quantize, x, axis=axis, scaling_mode=mode, scale_layout=layout)


@pytest.mark.parametrize("arch", ARCHS)
@settings(**PROFILE)
@given(data=st.data(), mode=st.sampled_from(["floor", "rceil"]))
def test_mxfp8_quantize_dual(arch, data, mode):
    x = data.draw(tensors((data.draw(BLOCK_DIM), data.draw(BLOCK_DIM))))
    both_paths(arch, fq.mxfp8_quantize_dual, x, scaling_mode=mode)


@pytest.mark.parametrize("arch", ARCHS)
@settings(**PROFILE)
@given(data=st.data(), mode=st.sampled_from(["floor", "rceil"]), block_k=st.sampled_from([1, 32]),
       layout=st.sampled_from([None, "tcgen05", "mfma"]))
def test_mxfp8_quantize_3d(arch, data, mode, block_k, layout):
    shape = (data.draw(st.sampled_from([0, 1, 2, 3])), data.draw(BLOCK_DIM), data.draw(FREE_DIM))
    w = data.draw(tensors(shape))
    both_paths(arch, fq.mxfp8_quantize_3d, w, scaling_mode=mode, scale_block_k=block_k, scale_layout=layout)


@pytest.mark.parametrize("arch", ARCHS)
@settings(**PROFILE)
@given(data=st.data(), axis=st.sampled_from([-1, 0]), mode=st.sampled_from(["floor", "rceil", "even"]),
       layout=st.sampled_from([None, "mfma"]), shuffle=st.sampled_from([None, "a4w4"]))
def test_mxfp4_quantize(arch, data, axis, mode, layout, shuffle):
    # any M and K (tails are zero-padded blocks); a4w4 takes M % 16 == 0 and K % 64 == 0 (its tile
    # orders: K % 256 == 0 256, K % 128 == 0 128, K % 128 == 64 192 and 320), columnwise neither
    # layout: refused alike on both paths
    dims = st.sampled_from([0, 1, 3, 16, 33, 64, 128, 192, 256, 320])
    x = data.draw(tensors((data.draw(dims), data.draw(dims))))
    both_paths(arch, fq.mxfp4_quantize, x, axis=axis, scaling_mode=mode, scale_layout=layout, shuffle=shuffle)


@pytest.mark.parametrize("arch", ARCHS)
@settings(**PROFILE)
@given(data=st.data(), mode=st.sampled_from(["floor", "rceil", "even"]))
def test_mxfp4_quantize_dual(arch, data, mode):
    x = data.draw(tensors((data.draw(FREE_DIM), data.draw(BLOCK_DIM))))
    both_paths(arch, fq.mxfp4_quantize_dual, x, scaling_mode=mode)


@pytest.mark.parametrize("arch", ARCHS)
@settings(**PROFILE)
@given(data=st.data(), mode=st.sampled_from(["floor", "rceil", "even"]), shuffle=st.sampled_from([None, "a16w4"]),
       gate_up=st.booleans())
def test_mxfp4_quantize_3d(arch, data, mode, shuffle, gate_up):
    # experts of any N (below 32 too) unshuffled; the a16w4 shuffle takes N % 32 == 0 and K % 256 == 0
    shape = (data.draw(st.sampled_from([0, 1, 2, 3])), data.draw(st.sampled_from([1, 2, 16, 32, 37, 64])),
             data.draw(st.sampled_from([0, 31, 64, 256, 300, 512])))
    w = data.draw(tensors(shape))
    both_paths(arch, fq.mxfp4_quantize_3d, w, scaling_mode=mode, shuffle=shuffle, gate_up=gate_up and shuffle is not None)


# ------------------------------------------------------------------------------------------------
# MoE sorting: routings with empty experts, repeated ids, out-of-range ids, masks, topk 1..8
# ------------------------------------------------------------------------------------------------


@st.composite
def routings(draw):
    """(topk_ids, topk_weights, experts, block_m, expert_mask) as routers and EP ranks give them,
    with the dtypes the kernel reads itself: int64 ids whose high word is set (out of range), FP16
    / BF16 weights with specials (subnormals, -0.0, NaN, Inf), integer masks whose nonzero values
    have a zero low byte. 300 tokens of top-4 or more: over 1023 pairs, the multi-wave sort."""
    tokens = draw(st.sampled_from([0, 1, 2, 3, 5, 17, 40, 300]))
    experts = draw(st.sampled_from([1, 2, 3, 8, 33]))
    topk = draw(st.integers(1, min(8, experts)))  # the contract: topk <= num_experts
    block_m = draw(st.sampled_from([1, 16, 32, 64]))
    g = torch.Generator().manual_seed(draw(st.integers(0, 2**16)))
    low, high = (-2, experts + 3) if draw(st.booleans()) else (0, experts)  # out-of-range ids sometimes
    ids = torch.randint(low, high, (tokens, topk), generator=g, dtype=draw(st.sampled_from([torch.int32, torch.int64])))
    if ids.dtype == torch.int64 and ids.numel() and draw(st.booleans()):  # low word in range, high word set
        ids.view(-1)[torch.randint(0, ids.numel(), (2,), generator=g)] += draw(st.sampled_from([1 << 32, -(1 << 40)]))
    weight_dtype = draw(st.sampled_from([torch.float32, torch.bfloat16, torch.float16]))
    weights = torch.rand(tokens, topk, generator=g).to(weight_dtype)
    if weights.numel() and draw(st.booleans()):
        tiny = torch.finfo(weight_dtype).tiny
        specials = torch.tensor([tiny / 4, -tiny / 8, -0.0, float("nan"), float("inf"), -float("inf")], dtype=weight_dtype)
        weights.view(-1)[torch.randint(0, weights.numel(), (4,), generator=g)] = specials[torch.randint(0, 6, (4,), generator=g)]
    if draw(st.booleans()) and tokens:  # a transposed view (column-major routing tensors)
        ids, weights = ids.t().contiguous().t(), weights.t().contiguous().t()
    mask = None
    if draw(st.booleans()):
        mask_dtype, one = draw(st.sampled_from([(torch.int32, 1), (torch.bool, True), (torch.uint8, 1),
                                                 (torch.int16, 0x100), (torch.int32, 0x10000), (torch.int64, 1 << 32)]))
        mask = torch.zeros(experts, dtype=mask_dtype)
        mask[torch.rand(experts, generator=g) < 0.6] = one
    return ids, weights, experts, block_m, mask


@pytest.mark.parametrize("arch", ARCHS)
@settings(**{**PROFILE, "max_examples": 40})  # one launch each, no compile per example
@given(routing=routings())
def test_moe_sorting(arch, routing):
    from test_moe_sorting_kernel import assert_identical, expected_dropping

    ids, weights, experts, block_m, mask = routing
    with backend("flydsl", arch):
        got = outcome(lambda: fq.moe_sorting(ids, weights, experts, block_m, expert_mask=mask))
    in_range = bool(((ids >= 0) & (ids < experts)).all())
    if not in_range:  # the kernel path drops those pairs; the reference (and FLYQUANT_DEBUG=1) refuse
        with backend("reference"):
            ref = outcome(lambda: fq.moe_sorting(ids, weights, experts, block_m, expert_mask=mask))
        assert ref[0] == "error" and ref[1] is ValueError and "expert" in ref[2], ref
        assert got[0] == "ok", got
        assert_identical(got[1], expected_dropping(ids, weights, experts, block_m, mask))
        return
    with backend("reference"):
        ref = outcome(lambda: fq.moe_sorting(ids, weights, experts, block_m, expert_mask=mask))
    assert got[0] == ref[0] and (got[0] == "ok" or got[1:] == ref[1:]), (got, ref)
    if got[0] == "ok":
        assert_identical(got[1], ref[1])


# ------------------------------------------------------------------------------------------------
# MoE stage 2: routings, padded dims, biases (incl. stride-0 expands), out given or not
# ------------------------------------------------------------------------------------------------


@st.composite
def moe_problems(draw):
    from test_moe_gemm2_kernel import make_problem

    experts = draw(st.sampled_from([1, 2, 3, 5]))
    topk = draw(st.integers(1, min(4, experts)))
    tokens = draw(st.sampled_from([1, 2, 3, 7, 33]))
    model_dim = draw(st.sampled_from([32, 64]))
    inter_dim = draw(st.sampled_from([256, 224]))  # 224: the weights' K padded to 256
    block_m = fq.moe_block_m(tokens, topk, experts, model_dim, 256)
    bias_dtype = draw(st.sampled_from([None, torch.bfloat16, torch.float32]))
    p = make_problem(tokens, topk, experts, model_dim, inter_dim, block_m, seed=draw(st.integers(0, 2**16)),
                     w_k=256, bias_dtype=bias_dtype, skip_expert=draw(st.sampled_from([None, 0])) if experts > topk else None, skew=draw(st.booleans()))
    if bias_dtype is not None and draw(st.booleans()):  # one bias shared by every expert (finding 5)
        p["bias"] = p["bias"][:1].expand(experts, -1)
    return p


@pytest.mark.parametrize("arch", ARCHS)
@settings(**{**PROFILE, "max_examples": 10})
@given(p=moe_problems(), out_dtype=st.sampled_from([torch.bfloat16, torch.float32]), apply_weights=st.booleans(),
       given_out=st.booleans())
def test_moe_gemm2_a16w4(arch, p, out_dtype, apply_weights, given_out):
    from test_moe_gemm2_kernel import check

    ids, sw, eids, nvalid = p["sorting"]
    tokens = p["a2"].shape[0] // p["topk"]
    out0 = torch.randn(tokens, p["model_dim"]).to(out_dtype) if given_out else torch.zeros(tokens, p["model_dim"],
                                                                                            dtype=out_dtype)

    def call():
        return fq.moe_gemm2_a16w4(p["a2"], p["w2"], p["w2_scale"], ids, sw, eids, nvalid, topk=p["topk"],
                                  block_m=p["block_m"], out=out0.clone() if given_out else None, bias=p["bias"],
                                  apply_weights=apply_weights, out_dtype=out_dtype, model_dim=p["model_dim"],
                                  inter_dim=p["inter_dim"])

    with backend("flydsl", arch), emu.record() as launches:
        got = call()
    (launch,) = [r for r in launches if "moe_gemm2" in r.kernel]
    k_batch = int(re.search(r"_kb(\d+)_", launch.kernel).group(1))  # the bound depends on the split
    check(p, got, out0, out_dtype, k_batch, apply_weights)


# ------------------------------------------------------------------------------------------------
# Pure-PyTorch ops (MXFP4 weights, shuffles, dequantize): any input is a result or a clear error
# ------------------------------------------------------------------------------------------------


@settings(**{**PROFILE, "max_examples": 40})
@given(data=st.data(), mode=st.sampled_from(["floor", "rceil"]), gate_up=st.booleans())
def test_mxfp4_weights_round_trip_or_refuse(data, mode, gate_up):
    # quantize_mxfp4 -> shuffles -> unshuffles -> dequantize: the shuffles are permutations (the
    # unshuffle restores every byte), dequantize is within 2 x the block scale of finite input
    # (E2M1's widest gap, 4 -> 6, is 2; floor's clamp of up to 8 -> 6 is 2), and a shape they
    # cannot take is a ValueError/TypeError naming it, never another exception.
    from flyquant import layouts

    shape = (data.draw(st.sampled_from([1, 2, 3])), data.draw(st.sampled_from([1, 32, 48, 64])),
             data.draw(st.sampled_from([0, 32, 64, 256, 96, 512])))
    w = data.draw(tensors(shape))
    try:
        packed, scales = fq.quantize_mxfp4(w, scaling_mode=mode)
    except (ValueError, TypeError) as exc:
        assert "w" in str(exc)
        return
    assert packed.shape == (*shape[:-1], shape[-1] // 2) and scales.shape == (*shape[:-1], shape[-1] // 32)
    back = fq.dequantize_mxfp4(packed, scales)
    finite = torch.isfinite(w.float()).view(*shape[:-1], -1, 32).all(-1, keepdim=True).expand(*shape[:-1], -1, 32)
    finite = finite.reshape(shape)
    step = fq.dequantize_mxfp4(torch.full_like(packed, 0x22), scales)  # 1.0 x the block scale per element
    err = (back - w.float()).abs()[finite]
    assert bool((err <= 2 * step[finite]).all())
    try:
        sw = layouts.shuffle_weight_a16w4(packed, gate_up=gate_up)
        ss = layouts.shuffle_scale_a16w4(scales, shape[0], gate_up=gate_up)
    except (ValueError, TypeError):
        return
    assert torch.equal(layouts.unshuffle_weight_a16w4(sw, gate_up=gate_up), packed)
    back_scales = layouts.unshuffle_scale_a16w4(ss, shape[0], gate_up=gate_up)
    assert torch.equal(back_scales.view(torch.uint8), scales.view(torch.uint8))


# ------------------------------------------------------------------------------------------------
# MXFP8 grouped GEMMs: random token groups (empty ones, rows past the last), values with specials,
# on the kernel path against tests/mx_fp64.py's float64 model within the kernel tests' bound
# ------------------------------------------------------------------------------------------------

GROUPED_N, GROUPED_K = 48, 96  # fixed: the kernels compile per (N, K, E); M and offs vary per example


def mx_operand(draw, gen, rows, cols, axis):
    """A random (rows, cols) BF16 tensor, magnitudes spread over 2^+-6 by row, sometimes with
    zeros, NaN, Inf and a huge value, MX-quantized along `axis` by flyquant.reference (rceil)."""
    x = torch.randn(rows, cols, generator=gen) * torch.exp2(torch.randint(-6, 7, (rows, 1), generator=gen).float())
    if x.numel() and draw(st.booleans()):
        specials = torch.tensor([0.0, -0.0, float("nan"), float("inf"), -float("inf"), 1e30])
        x.view(-1)[torch.randint(0, x.numel(), (3,), generator=gen)] = specials[torch.randint(0, 6, (3,), generator=gen)]
    return fq.reference.mxfp8_quantize(x.bfloat16(), axis, "rceil")


def token_groups(draw, experts, rows, step=1):
    """offs: E non-decreasing group ends, multiples of `step`, the last <= rows (rows past it sometimes)."""
    ends = sorted(draw(st.lists(st.integers(0, rows // step), min_size=experts, max_size=experts)))
    return torch.tensor([end * step for end in ends], dtype=torch.int32)


@pytest.mark.parametrize("arch", ARCHS)
@settings(**{**PROFILE, "max_examples": 12})
@given(data=st.data(), experts=st.sampled_from([1, 3]), out_dtype=st.sampled_from([torch.bfloat16, torch.float32]),
       scale_layout=st.sampled_from([None, "mfma"]))
def test_mxfp8_grouped_mm(arch, data, experts, out_dtype, scale_layout):
    from test_mxfp8_grouped_mm_kernel import check, expected

    from flyquant import layouts

    m = data.draw(st.sampled_from([1, 31, 64, 65, 130, 200]))
    offs = token_groups(data.draw, experts, m)
    gen = torch.Generator().manual_seed(data.draw(st.integers(0, 2**16)))
    a, a_scale = mx_operand(data.draw, gen, m, GROUPED_K, -1)
    b, b_scale = mx_operand(data.draw, gen, experts * GROUPED_N, GROUPED_K, -1)
    b, b_scale = b.view(experts, GROUPED_N, GROUPED_K), b_scale.view(experts, GROUPED_N, GROUPED_K // 32)
    scales = (a_scale, b_scale) if scale_layout is None else (
        layouts.mfma_shuffle_scales(a_scale), torch.stack([layouts.mfma_shuffle_scales(s) for s in b_scale]))
    with backend("flydsl", arch), emu.record() as launches:
        out = fq.mxfp8_grouped_mm(a, scales[0], b, scales[1], offs, out_dtype=out_dtype, scale_layout=scale_layout)
    assert len(launches) == 1 and launches[0].kernel.startswith("mxfp8_grouped_mm_")
    ref, mag = expected(a, a_scale, b, b_scale, offs)
    check(out, ref, mag, GROUPED_K, out_dtype)
    assert bool((out[int(offs[-1]):] == 0).all())


@pytest.mark.parametrize("arch", ARCHS)
@settings(**{**PROFILE, "max_examples": 12})
@given(data=st.data(), experts=st.sampled_from([1, 3]), out_dtype=st.sampled_from([torch.bfloat16, torch.float32]))
def test_mxfp8_grouped_mm_wgrad(arch, data, experts, out_dtype):
    from mx_fp64 import groups
    from test_mxfp8_grouped_mm_kernel import check, expected_wgrad

    m = data.draw(st.sampled_from([32, 96, 160, 288]))
    offs = token_groups(data.draw, experts, m, step=32)  # the wgrad contract: groups of whole 32-row blocks
    gen = torch.Generator().manual_seed(data.draw(st.integers(0, 2**16)))
    x, x_scale = mx_operand(data.draw, gen, m, GROUPED_K, 0)
    y, y_scale = mx_operand(data.draw, gen, m, GROUPED_N, 0)
    with backend("flydsl", arch), emu.record() as launches:
        out = fq.mxfp8_grouped_mm_wgrad(x, x_scale, y, y_scale, offs, out_dtype=out_dtype)
    assert len(launches) == 1 and launches[0].kernel.startswith("mxfp8_grouped_mm_wgrad_")
    ref, mag = expected_wgrad(x, x_scale, y, y_scale, offs)
    check(out, ref, mag, m, out_dtype)
    assert all(bool((out[g] == 0).all()) for g, (lo, hi) in enumerate(groups(offs)) if lo == hi)


# ------------------------------------------------------------------------------------------------
# fq.fused_moe: the whole A16W4 layer on random routings, masks, activations, biases
# ------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("arch", ARCHS)
@settings(**{**PROFILE, "max_examples": 6})  # up to three compiles per example
@given(data=st.data(), activation=st.sampled_from(["silu", "gelu", "swiglu_oai"]), biases=st.booleans(),
       at=st.sampled_from(["stage1", "stage2"]))
def test_fused_moe(arch, data, activation, biases, at):
    from test_fused_moe import exact_layer, layer, run

    experts = data.draw(st.sampled_from([1, 2, 3, 5, 8]))
    topk = data.draw(st.integers(1, min(4, experts)))
    tokens = data.draw(st.sampled_from([1, 2, 5, 33]))
    mask = None
    if experts > 1 and data.draw(st.booleans()):  # expert parallel: this rank serves some experts
        mask = data.draw(st.lists(st.integers(0, 1), min_size=experts, max_size=experts).filter(any))
    p = layer(tokens, topk, experts, mask, biases, seed=data.draw(st.integers(0, 2**16)), apply_weights_at=at)
    with backend("flydsl", arch), emu.record() as launches:
        got = run(p, activation, at)
    assert [r.kernel.split("_")[1] for r in launches] == ["sorting", "gemm1", "gemm2"]
    exact, bound = exact_layer(p, activation, at)
    assert (bound < 0.1 * exact.abs().max()).all()  # tight enough to see a wrong element
    err = (got.double() - exact).abs()
    assert bool((err <= bound).all()), float((err - bound).max())
