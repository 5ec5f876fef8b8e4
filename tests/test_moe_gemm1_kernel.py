"""The A16W4 MoE stage-1 FlyDSL kernel (kernels/moe_gemm1_a16w4.py; the shared main loop with stage=1) under
flyquant.emu for gfx950 and gfx942, against float64 recomputation and the reference
(flyquant.reference.moe_gemm1_a16w4), plus compile checks at GPT-OSS-like shapes.

Tolerance (per element, derived; e = exact value of act(g, u) (* w) in float64 from the
dequantized weights). Both the kernel and the reference compute g and u in FP32 (K exact
products, FP32 sums in any order, one bias add): |dg| <= (K + 1) 2^-24 (|x| @ |Wg|^T + |bg|),
likewise du. The activation's partial derivatives are bounded (|d/dg| <= 1.2 (|u| + 1),
|d/du| <= |g| + 1; tests/test_reference_moe1.py), so the FP32 inputs move it by at most
P = 1.2 (|u| + 1) dg + (|g| + 1) du. The activation itself: torch's FP32 formula within
2^-20 (|g| + 1)(|u| + 1); the kernel's, built from v_exp_f32 / v_rcp_f32 (1 ulp each on hardware;
correctly rounded in the emulator), within (|z| + 8) 2^-24 |e| + 4 2^-24 |dz| |e| + 2^-126 |g u|
with z the sigmoid's argument (STAGE1_DOC), at most 2^-20 (|g| + 1)(|u| + 1) for the |z| < 100
these inputs give. Each side then rounds once to bf16 (2^-8 relative). So each side is within
    T = 2^-8 |e| + (1 + 2^-8) |w| (P + 2^-20 (|g| + 1)(|u| + 1))
of e, and the kernel within 2T of the reference. A swapped gate/up, a wrong expert, row or column,
a missing bias or routing weight moves elements by O(|e|), far outside T (asserted: T < 5% of max |e|).
"""

from __future__ import annotations

import functools
import re

import flydsl.compiler as flyc
import flydsl.expr as fx
import pytest
import torch

from flyquant import emu, layouts, reference, toolchain
from flyquant.moe import moe_sorting
from flyquant.reference import quantize_mxfp4
from flyquant.kernels import moe_gemm1_a16w4 as K1
from flyquant.kernels._a16w4_stage1_epilogue import _bf16_words_not_nan
from flyquant.kernels import moe_gemm2_a16w4 as K

from test_moe_gemm2_kernel import GFX950_ONLY, _routing
from test_moe_safety import WINDOW_TOKENS, window_sorting

ARCHS = ("gfx950", "gfx942")
U_BF16 = 2.0**-8
U_F32 = 2.0**-24
DERIV_G = 1.2
ACT_ERR = 2.0**-20
SENTINEL = 1234.0


def make_problem(tokens, topk, experts, model_dim, inter_dim, half, w_k, block_m, seed, bias_dtype=None,
                 skip_expert=1):
    """w1 (E, 2 * half, w_k) gate rows then up rows (half >= inter_dim, w_k >= model_dim: padding),
    quantized and shuffled with gate_up=True; x bf16 with NaN past model_dim (the kernel must not
    read it as data); routing skewed with `skip_expert` never chosen (an expert with no rows)."""
    gen = torch.Generator().manual_seed(seed)
    w = torch.randn(experts, 2 * half, w_k, generator=gen) * 0.1
    packed, scales = quantize_mxfp4(w)
    x = torch.randn(tokens, w_k, generator=gen).to(torch.bfloat16)
    x[:, model_dim:] = float("nan")
    ids, weights = _routing(tokens, topk, experts, seed, skip_expert, skew=True)
    bias = None if bias_dtype is None else torch.randn(experts, 2 * half, generator=gen).to(bias_dtype)
    return dict(x=x, packed=packed, scales=scales, ids=ids, weights=weights, bias=bias, topk=topk, block_m=block_m,
                model_dim=model_dim, inter_dim=inter_dim, half=half, experts=experts,
                w1=layouts.shuffle_weight_a16w4(packed, gate_up=True),
                w1_scale=layouts.shuffle_scale_a16w4(scales, experts, gate_up=True),
                sorting=moe_sorting(ids, weights, experts, block_m))


def pair_exact_and_tolerance(p, t, e, w, activation, alpha=1.702, limit=7.0):
    """(e, T) of the module docstring for token t routed to expert e with weight w: (inter_dim,) float64
    (swiglu_oai with alpha and limit)."""
    md, idim, half = p["model_dim"], p["inter_dim"], p["half"]
    weight = reference.dequantize_mxfp4(p["packed"][e], p["scales"][e]).double()
    x = p["x"][t, :md].double()
    wg, wu = weight[:idim, :md], weight[half:half + idim, :md]
    b = p["bias"][e].double() if p["bias"] is not None else torch.zeros(2 * half, dtype=torch.float64)
    bg, bu = b[:idim], b[half:half + idim]
    g, u = wg @ x + bg, wu @ x + bu
    dg = (md + 1) * U_F32 * (wg.abs() @ x.abs() + bg.abs())
    du = (md + 1) * U_F32 * (wu.abs() @ x.abs() + bu.abs())
    a = reference.moe_activation(g, u, activation, alpha, limit) * w
    prop = DERIV_G * (u.abs() + 1) * dg + (g.abs() + 1) * du + ACT_ERR * (g.abs() + 1) * (u.abs() + 1)
    return a, U_BF16 * a.abs() + (1 + U_BF16) * abs(w) * prop


def exact_and_tolerance(p, activation, apply_weights, alpha=1.702, limit=7.0):
    """(e, T) of the module docstring, (T * topk, inter_dim) float64; rows without a pair: NaN, 0."""
    topk, tokens = p["topk"], p["x"].shape[0]
    exact = torch.full((tokens * topk, p["inter_dim"]), float("nan"), dtype=torch.float64)
    tol = torch.zeros_like(exact)
    for t in range(tokens):
        for s in range(topk):
            w = float(p["weights"][t, s]) if apply_weights else 1.0
            exact[t * topk + s], tol[t * topk + s] = pair_exact_and_tolerance(p, t, int(p["ids"][t, s]), w, activation,
                                                                              alpha, limit)
    return exact, tol


def run(arch, p, activation="silu", apply_weights=False, out=None, **kw):
    with toolchain.target(arch):
        return K1.moe_gemm1_a16w4(p["x"], p["w1"], p["w1_scale"], *p["sorting"], arch=arch, topk=p["topk"],
                                 block_m=p["block_m"], bias=p["bias"], activation=activation,
                                 apply_weights=apply_weights, out=out, model_dim=p["model_dim"],
                                 inter_dim=p["inter_dim"], **kw)


def check(arch, p, activation, apply_weights, **kw):
    """Kernel within T of exact and 2T of the reference on every routed row; a given out's other rows
    and its columns past inter_dim untouched."""
    rows = p["x"].shape[0] * p["topk"]
    out = torch.full((rows, p["inter_dim"] + 16), SENTINEL, dtype=torch.bfloat16)
    got = run(arch, p, activation, apply_weights, out=out, **kw)
    assert got is out
    ref = reference.moe_gemm1_a16w4(p["x"], p["w1"], p["w1_scale"], *p["sorting"], topk=p["topk"],
                                    block_m=p["block_m"], bias=p["bias"], activation=activation,
                                    apply_weights=apply_weights, out=torch.full_like(out, SENTINEL),
                                    model_dim=p["model_dim"], inter_dim=p["inter_dim"])
    exact, tol = exact_and_tolerance(p, activation, apply_weights)
    assert (tol < 0.05 * exact.abs().max()).all()  # the bound is tight enough to catch a wrong element
    idim = p["inter_dim"]
    g = got[:, :idim].double()
    err = (g - exact).abs()
    bad = ~(err <= tol)
    assert not bad.any(), f"{int(bad.sum())} outside the bound, worst excess {float((err - tol).max()):.3g}"
    assert ((g - ref[:, :idim].double()).abs() <= 2 * tol).all()
    assert (got[:, idim:] == SENTINEL).all()  # columns past inter_dim
    return got


# Each activation with and without bias (bf16 and fp32 bias), apply_weights on and off; 5 tokens x
# top-2 over 4 experts, skewed, expert 1 with no rows; inter_dim 48 of 64 (a partial wave pair),
# model_dim 224 of 256 (a masked K tail, NaN past it in x).
ACT_CASES = [("silu", None, False), ("silu", torch.bfloat16, True), ("gelu", None, True),
             ("gelu", torch.float32, False), ("swiglu_oai", None, False), ("swiglu_oai", torch.bfloat16, True)]


@pytest.mark.parametrize("arch", ARCHS)
@pytest.mark.parametrize("activation,bias_dtype,apply_weights", ACT_CASES,
                         ids=[f"{a}-{'nobias' if b is None else str(b)[6:]}-{'w' if w else 'now'}" for a, b, w in ACT_CASES])
def test_activations_match(arch, activation, bias_dtype, apply_weights):
    p = make_problem(5, 2, 4, 224, 48, 64, 256, 16, seed=7, bias_dtype=bias_dtype)
    check(arch, p, activation, apply_weights)


@pytest.mark.parametrize("arch", ARCHS)
def test_topk1_many_tokens_two_k_iterations_and_unrouted_rows(arch):
    """topk 1, 40 tokens over 3 experts (32-row tiles, the compact scan off), K 512 (two 256-wide
    iterations: the pipeline's loop path), tile_n 64 (two waves of one pair each); rows of a
    masked-off expert (expert parallelism) are left as they were."""
    p = make_problem(40, 1, 3, 512, 64, 64, 512, 32, seed=8, bias_dtype=torch.float32, skip_expert=None)
    check(arch, p, "swiglu_oai", True, tile_n=64)
    mask = torch.tensor([1, 0, 1])
    local = [0, 2]
    q = dict(p, w1=layouts.shuffle_weight_a16w4(p["packed"][local].contiguous(), gate_up=True),
             w1_scale=layouts.shuffle_scale_a16w4(p["scales"][local].contiguous(), 2, gate_up=True),
             bias=p["bias"][local], sorting=moe_sorting(p["ids"], p["weights"], 3, 32, expert_mask=mask))
    out = torch.full((40, 64), SENTINEL, dtype=torch.bfloat16)
    run(arch, q, "swiglu_oai", True, out=out)
    served = (p["ids"][:, 0] != 1)
    assert (out[~served] == SENTINEL).all() and not (out[served] == SENTINEL).any()
    assert 0 < int(served.sum()) < 40


@pytest.mark.parametrize("arch", ARCHS)
def test_dense_epilogue_with_an_n_tail(arch):
    """40 tokens in 32-row tiles (more than 8 live rows: the dense epilogue) with 2 * inter_dim = 96
    not a multiple of tile_n 128: the columns past inter_dim stay untouched (check's sentinels)."""
    p = make_problem(40, 1, 3, 224, 48, 64, 256, 32, seed=8, bias_dtype=torch.float32, skip_expert=None)
    check(arch, p, "silu", False, tile_n=128)


@pytest.mark.parametrize("arch", ARCHS)
@pytest.mark.parametrize("tile_m,model_dim", [(32, 96), (64, 224)])
def test_k_tail_on_tiles_of_several_row_blocks(arch, tile_m, model_dim):
    """model_dim 96 / 224 of w_k 256 (NaN in x past it) on 32- and 64-row tiles, whose x is loaded
    at use rather than through the 16-row tile's masked step loads."""
    p = make_problem(20, 2, 4, model_dim, 48, 64, 256, tile_m, seed=3)
    check(arch, p, "silu", False, tile_m=tile_m)


@pytest.mark.parametrize("arch", ARCHS)
def test_nan_inf_propagate(arch):
    """NaN / Inf in x and in the bias reach the outputs as in the reference's formulas (NaN through
    the GPT-OSS clamps too): the same NaN positions, the same infinities, finite elements within T."""
    p = make_problem(4, 2, 3, 256, 32, 32, 256, 16, seed=9, bias_dtype=torch.float32, skip_expert=None)
    p["x"][0, 3] = float("nan")
    p["x"][1, 5] = float("inf")
    p["bias"][:, 2] = float("nan")  # gate column 2 of every expert
    p["bias"][:, 32 + 4] = float("-inf")  # up column 4
    for activation in K1.ACTIVATIONS:
        got = run(arch, p, activation).double()
        ref = reference.moe_gemm1_a16w4(p["x"], p["w1"], p["w1_scale"], *p["sorting"], topk=2, block_m=16,
                                        bias=p["bias"], activation=activation).double()
        assert torch.equal(got.isnan(), ref.isnan()), activation
        assert got.isnan()[0:2].all() and got.isnan()[:, 2].all()
        fin = ref.isfinite()
        assert torch.equal(got[~fin & ~ref.isnan()], ref[~fin & ~ref.isnan()])
        assert torch.equal(fin, got.isfinite())
        exact, tol = exact_and_tolerance(p, activation, False)
        ok = fin & exact.isfinite()
        assert ((got - exact).abs()[ok] <= tol[ok]).all()


@pytest.mark.parametrize("arch", ARCHS)
@pytest.mark.parametrize("alpha,limit,gate", [(1.702, float("inf"), float("inf")), (-1.0, 7.0, float("-inf")),
                                              (-0.5, 7.0, float("-inf"))],
                         ids=["no-clamp-g-inf", "negative-alpha-g-minus-inf", "alpha-in-(-1,0)-g-minus-inf"])
def test_swiglu_oai_infinite_gate_term_as_the_reference(arch, alpha, limit, gate):
    """swiglu_oai's (u' + 1) t, t = g' sigmoid(alpha g'), with t infinite: g = +inf and limit = inf (no
    clamp, allowed), or g = -inf and alpha < 0 (sigmoid 1). Computed as fma(u', t, t) = u' t + t that is
    inf - inf = NaN for every u' < 0, where the reference's (u' + 1) t is an infinity (found by fuzz round
    9). Gate columns 0-15 of both experts take a bias of `gate`, their up columns u < -1 (0-7) or about
    -0.5 (8-15): the same infinities and NaN positions as the reference, in the dense form (expert 0's
    10-row tile) and the sparse one (expert 1's 2-row tile)."""
    p = _dense_and_sparse_tiles()
    p["bias"][:, :16] = gate
    p["bias"][:, 32:40] = -40.0
    p["bias"][:, 40:48] = -0.5
    got = run(arch, p, "swiglu_oai", alpha=alpha, limit=limit).double()
    ref = reference.moe_gemm1_a16w4(p["x"], p["w1"], p["w1_scale"], *p["sorting"], topk=1, block_m=16,
                                    bias=p["bias"], activation="swiglu_oai", alpha=alpha, limit=limit).double()
    assert ref[:, :8].isinf().all()  # (u' + 1) t with u' < -1: an infinity, never NaN
    assert torch.equal(got.isnan(), ref.isnan())
    inf = ref.isinf()
    assert torch.equal(got[inf], ref[inf])
    exact, tol = exact_and_tolerance(p, "swiglu_oai", False, alpha=alpha, limit=limit)
    ok = ref.isfinite()
    assert ((got - exact).abs()[ok] <= tol[ok]).all()


@pytest.mark.parametrize("arch", ARCHS)
@pytest.mark.parametrize("alpha,limit", [(1e30, 7.0), (1.702, 1e30), (-1.0, 3.4028234663852886e38)],
                         ids=["alpha-1e30", "limit-1e30", "limit-f32-max"])
def test_swiglu_oai_alpha_and_limit_with_an_exponent_compile(arch, alpha, limit):
    """swiglu_oai's alpha and limit are in the kernel's name (one compile per value), which the
    assembler takes as a symbol: a value whose repr has an exponent ("1e+30") put a '+' in it and
    the compile failed in ld.lld with an unrelated directive error (found by fuzz round 9b). Such
    values compile and give the reference's NaN positions and infinities, finite elements within T
    (the dense form for expert 0's 10-row tile, the sparse one for expert 1's 2-row tile)."""
    p = make_problem(12, 1, 2, 256, 32, 32, 256, 16, seed=16, bias_dtype=torch.float32, skip_expert=None)
    p = _routed(p, [0] * 10 + [1] * 2, block_m=16)
    p["bias"][:, :4] = float("inf")
    p["bias"][:, 32:36] = -40.0
    got = run(arch, p, "swiglu_oai", alpha=alpha, limit=limit).double()
    ref = reference.moe_gemm1_a16w4(p["x"], p["w1"], p["w1_scale"], *p["sorting"], topk=1, block_m=16,
                                    bias=p["bias"], activation="swiglu_oai", alpha=alpha, limit=limit).double()
    assert torch.equal(got.isnan(), ref.isnan())
    inf = ref.isinf()
    assert torch.equal(got[inf], ref[inf]) and torch.equal(inf, got.isinf())
    exact, tol = exact_and_tolerance(p, "swiglu_oai", False, alpha=alpha, limit=limit)
    ok = ref.isfinite() & exact.isfinite()
    assert ((got - exact).abs()[ok] <= tol[ok]).all()


@pytest.mark.parametrize("limit", [3.5e38, 1e300])
def test_swiglu_oai_limit_past_fp32_refused(limit):
    """A finite swiglu_oai limit above FLT_MAX is +inf in FP32: the kernel took it, clamped nothing,
    but chose its fma form of (u' + 1) t for a finite limit, so g = +inf with u' < -1 gave NaN where
    the no-clamp formula gives -inf, and the reference failed inside torch.clamp with "value cannot
    be converted to type float without overflow" (found by fuzz round 9b). Both refuse it, naming
    limit (inf itself is the way to say no clamp)."""
    p = make_problem(12, 1, 2, 256, 32, 32, 256, 16, seed=16, bias_dtype=torch.float32, skip_expert=None)
    with pytest.raises(ValueError, match="limit must be >= 0 for swiglu_oai"):
        run("gfx950", p, "swiglu_oai", limit=limit)
    with pytest.raises(ValueError, match="limit must be >= 0 for swiglu_oai"):
        reference.moe_gemm1_a16w4(p["x"], p["w1"], p["w1_scale"], *p["sorting"], topk=1, block_m=16,
                                  bias=p["bias"], activation="swiglu_oai", limit=limit)


@pytest.mark.parametrize("arch", ARCHS)
def test_gelu_tail_times_infinite_up_is_the_exact_infinity(arch):
    """gelu with g about -7.5 (y = sqrt(2/pi) (g + 0.044715 g^3) about -21) and u = +inf (an infinite up
    bias): the reference's 0.5 g (1 + tanh(y)) u is 0 * inf = NaN (FP32 tanh(y) rounds to -1 below y ~
    -9), the kernel's g sigmoid(2y) u is -inf, the sign of the exact gelu_tanh(g) * inf (STAGE1_DOC
    states the difference; found by fuzz round 9). Both epilogue forms (expert 0's 10-row tile dense,
    expert 1's 2-row tile sparse); every other element's NaN pattern and value as the reference's."""
    p = make_problem(12, 1, 2, 256, 32, 32, 256, 16, seed=15, bias_dtype=torch.float32, skip_expert=None)
    p = _routed(p, [0] * 10 + [1] * 2, block_m=16)
    p["x"][:, :256] *= 0.01  # g and u about their biases
    p["bias"][:, :8] = -7.5
    p["bias"][:, 32:40] = float("inf")
    got = run(arch, p, "gelu").double()
    ref = reference.moe_gemm1_a16w4(p["x"], p["w1"], p["w1_scale"], *p["sorting"], topk=1, block_m=16,
                                    bias=p["bias"], activation="gelu").double()
    assert ref[:, :8].isnan().all() and (got[:, :8] == float("-inf")).all()
    assert torch.equal(got[:, 8:].isnan(), ref[:, 8:].isnan()) and ref[:, 8:].isfinite().all()
    exact, tol = exact_and_tolerance(p, "gelu", False)
    assert ((got[:, 8:] - exact[:, 8:]).abs() <= tol[:, 8:]).all()


@functools.lru_cache(maxsize=None)
def _bf16_pairs_kernel(arch):
    """Y[i] = _a16w4_stage1_epilogue._bf16_words_not_nan of (X[2i], X[2i + 1]): the finite path's rounding alone."""
    @flyc.kernel
    def stage1_bf16_pairs(X: fx.Tensor, Y: fx.Tensor):
        i = fx.block_idx.x * 64 + fx.thread_idx.x
        (word,) = _bf16_words_not_nan([fx.memref_load(X, 2 * i), fx.memref_load(X, 2 * i + 1)])
        fx.memref_store(word, Y, i)

    @flyc.jit
    def launch(X: fx.Tensor, Y: fx.Tensor, blocks: fx.Constexpr[int], stream: fx.Stream = fx.Stream(None)):
        stage1_bf16_pairs(X, Y).launch(grid=(blocks, 1, 1), block=(64, 1, 1), stream=stream)

    return launch


@pytest.mark.parametrize("arch", ARCHS)
def test_finite_path_rounds_to_bf16_as_torch(arch):
    """gfx942's stage 1 rounds its finite swiglu_oai values to bf16 in integer ops: equal to torch's
    conversion on every non-NaN pattern class: ties to even and odd at several exponents, one ulp
    either side of them, the largest finite values (rounding up to Inf), +-Inf, +-0, subnormals
    (ties included), and random patterns."""
    ties = [0x3F808000, 0x3F818000, 0x00008000, 0x00018000, 0x80018000, 0x7F7F8000, 0xC1208000, 0x0080_8000]
    special = [0x7F7FFFFF, 0xFF7FFFFF, 0x7F7F7FFF, 0x7F800000, 0xFF800000, 0, 0x80000000, 1, 0x807FFFFF]
    near = [t + d for t in ties for d in (-1, 1)]
    rand = torch.randint(0, 2**32, (4096,), generator=torch.Generator().manual_seed(3), dtype=torch.int64)
    bits = torch.tensor(ties + special + near, dtype=torch.int64)
    bits = torch.cat([bits, rand]).to(torch.uint32).view(torch.int32)
    x = bits.view(torch.float32)
    x = x[~x.isnan()]
    x = torch.cat([x, torch.zeros((-x.numel()) % 128)])  # whole 64-lane blocks of pairs
    y = torch.zeros(x.numel() // 2, dtype=torch.int32)
    with toolchain.target(arch):
        _bf16_pairs_kernel(arch)(x, y, x.numel() // 128, stream=0)
    assert torch.equal(y.view(torch.int16), x.to(torch.bfloat16).view(torch.int16))


@pytest.mark.parametrize("arch", ARCHS)
def test_finite_and_nan_paths_give_the_same_bits(arch):
    """swiglu_oai's epilogue has a finite form and, for a wave meeting a NaN or Inf, the exact one
    (LLVM's bf16 conversion; the clamps' NaN put back). A NaN in one token's x sends the waves of
    its experts' tiles to the exact form: every other token's rows there must come out bit for bit
    as they do on the finite path (rows of an MFMA tile do not interact)."""
    p = make_problem(6, 2, 3, 256, 32, 32, 256, 16, seed=11, bias_dtype=torch.bfloat16, skip_expert=None)
    finite = run(arch, p, "swiglu_oai")
    p["x"][0, 7] = float("nan")
    mixed = run(arch, p, "swiglu_oai")
    others = torch.arange(6 * 2) // 2 != 0
    shared = torch.isin(p["ids"].flatten(), p["ids"][0]) & others  # rows in token 0's tiles
    assert int(shared.sum()) >= 4
    assert torch.equal(finite[others].view(torch.int16), mixed[others].view(torch.int16))
    assert mixed[~others].isnan().all()


def _dense_and_sparse_tiles():
    """12 tokens, top-1: 10 on expert 0 (the dense epilogue's tile), 2 on expert 1 (the sparse one)."""
    p = make_problem(12, 1, 2, 256, 32, 32, 256, 16, seed=14, bias_dtype=torch.float32, skip_expert=None)
    return _routed(p, [0] * 10 + [1] * 2, block_m=16)


@pytest.mark.parametrize("arch", ARCHS)
@pytest.mark.parametrize("col", [1, 2])
def test_a_lone_nan_gate_bias_reaches_its_column(arch, col):
    """The tile's only non-finite value, a NaN gate bias of expert 0 at column 1 or 2 (not the first
    of a lane's four columns): the NaN check must see every column of every lane's group."""
    p = _dense_and_sparse_tiles()
    p["bias"][0, col] = float("nan")
    got = run(arch, p, "swiglu_oai").double()
    ref = reference.moe_gemm1_a16w4(p["x"], p["w1"], p["w1_scale"], *p["sorting"], topk=1, block_m=16,
                                    bias=p["bias"], activation="swiglu_oai").double()
    assert ref[:10, col].isnan().all() and torch.equal(got.isnan(), ref.isnan())


def _with_weight_bits(p, row, bits):
    ids, weights, eids, nvalid = p["sorting"]
    weights = weights.clone()
    weights.view(torch.int32)[row] = bits
    return dict(p, sorting=(ids, weights, eids, nvalid)), int(ids[row]) & 0xFFFFFF


@pytest.mark.parametrize("arch", ARCHS)
@pytest.mark.parametrize("bits", [0x7FFFFFFF, -1], ids=["nan-payload", "negative-nan-payload"])
def test_a_nan_routing_weight_makes_its_row_nan(arch, bits):
    """apply_weights with a NaN routing weight whose payload fills the mantissa (the usual 0x7FC00000
    does not show a conversion that loses it): its a2 row is NaN, the others are not."""
    p, token = _with_weight_bits(_dense_and_sparse_tiles(), 3, bits)
    got = run(arch, p, "swiglu_oai", apply_weights=True).double()
    ref = reference.moe_gemm1_a16w4(p["x"], p["w1"], p["w1_scale"], *p["sorting"], topk=1, block_m=16,
                                    bias=p["bias"], activation="swiglu_oai", apply_weights=True).double()
    assert ref[token].isnan().all() and torch.equal(got.isnan(), ref.isnan())


@pytest.mark.parametrize("arch", ARCHS)
def test_a_negative_zero_routing_weight_keeps_the_zeros_signs(arch):
    """apply_weights with a routing weight of -0.0: the row is act * -0.0, zeros of the sign opposite
    to act's, bit for bit as the reference's (check() compares values, blind to a zero's sign)."""
    p, token = _with_weight_bits(_dense_and_sparse_tiles(), 3, -(1 << 31))
    for activation in ("silu", "swiglu_oai"):
        got = run(arch, p, activation, apply_weights=True)
        ref = reference.moe_gemm1_a16w4(p["x"], p["w1"], p["w1_scale"], *p["sorting"], topk=1, block_m=16,
                                        bias=p["bias"], activation=activation, apply_weights=True)
        assert (ref[token] == 0).all() and ref[token].signbit().any()
        assert torch.equal(got[token].view(torch.int16), ref[token].view(torch.int16)), activation


def _routed(p, experts_of_tokens, block_m=32):
    """p with top-1 routing to the given experts (weights as p's), sorted for block_m."""
    ids = torch.tensor(experts_of_tokens, dtype=torch.int32)[:, None]
    return dict(p, ids=ids, topk=1, block_m=block_m, sorting=moe_sorting(ids, p["weights"][:, :1], p["experts"], block_m))


def _lds_writes(arch, p, activation):
    """(a2, wave-instructions ds_write_b128 executed) of one stage-1 launch: the sparse epilogue's
    LDS writes (the dense form and the main loop at these tiles write no LDS)."""
    with emu.record() as rec:
        got = run(arch, p, activation, tile_m=32, tile_n=64)
    return got, rec[0].stats.by_opcode.get("ds_write_b128", 0)


@pytest.mark.parametrize("arch", ARCHS)
def test_dense_and_sparse_epilogues_give_the_same_bits(arch):
    """A tile with more than SPARSE_ROWS live rows takes the dense epilogue, one with fewer the
    sparse one (live rows compacted through LDS). The same (token, expert) rows computed by each
    come out bit for bit equal, each within T of exact. Routing A: tokens 0-19 to expert
    0 (20 rows: dense), 20-23 to expert 1 (sparse); routing B: tokens 0-5 to expert 0 (sparse),
    6-23 to expert 1 (dense). Token 0's x holds a NaN (the dense form's exact branch); with
    every token on one expert no tile is sparse and no LDS is written."""
    base = make_problem(24, 1, 2, 256, 32, 32, 256, 32, seed=12, bias_dtype=torch.float32, skip_expert=None)
    base["x"][0, 3] = float("nan")
    for activation in K1.ACTIVATIONS:
        outs = []
        for experts in ([0] * 20 + [1] * 4, [0] * 6 + [1] * 18):
            p = _routed(base, experts)
            got, writes = _lds_writes(arch, p, activation)
            assert writes > 0, activation  # one tile took the sparse form
            ok = torch.ones(24, dtype=torch.bool)
            ok[0] = False
            exact, tol = exact_and_tolerance(p, activation, False)
            assert ((got.double() - exact).abs()[ok] <= tol[ok]).all(), activation
            outs.append(got)
        a, b = outs
        assert a[0].isnan().all() and b[0].isnan().all()
        same = torch.tensor([1, 2, 3, 4, 5, 20, 21, 22, 23])  # the same expert in A and B
        assert torch.equal(a[same].view(torch.int16), b[same].view(torch.int16)), activation
        _, writes = _lds_writes(arch, _routed(base, [1] * 24), activation)
        assert writes == 0, activation


@pytest.mark.parametrize("arch", ARCHS)
def test_sparse_epilogue_ranks_rows_across_row_blocks(arch):
    """A 32-row tile (two 16-row blocks) whose live rows are not the first ones: rows 0 and 16-18
    live, the others padding (sorted arrays are the kernel's input; moe_sorting packs rows first,
    token windows do not). The sparse form's slots follow the rows in order across the blocks:
    every routed row lands at its own a2 row, within T of exact, and nothing else is written."""
    p = make_problem(24, 1, 2, 256, 32, 32, 256, 32, seed=13, bias_dtype=torch.bfloat16, skip_expert=None)
    p = _routed(p, [0] * 20 + [1] * 4)
    sorted_ids, sorted_weights, sorted_expert_ids, num_valid_ids = p["sorting"]
    assert int(sorted_expert_ids[1]) == 1 and int(sorted_ids[36] & 0xFFFFFF) == 24  # tile 1: rows 32-35 live
    order = torch.arange(sorted_ids.numel())
    order[32:64] = torch.tensor([32] + list(range(36, 51)) + [33, 34, 35] + list(range(51, 64)))
    p["sorting"] = (sorted_ids[order], sorted_weights[order], sorted_expert_ids, num_valid_ids)
    for apply_weights in (False, True):
        with emu.record() as rec:
            check(arch, p, "swiglu_oai", apply_weights, tile_m=32, tile_n=64)
        assert rec[0].stats.by_opcode.get("ds_write_b128", 0) > 0


@pytest.mark.parametrize("arch", ARCHS)
@pytest.mark.parametrize("tokens", [5, 40], ids=["sparse", "dense"])
def test_untrusted_routing_values_are_dropped(arch, tokens):
    """As stage 2 (tests/test_moe_safety.py), on both epilogues: rows in use whose slot is not below
    topk and blocks whose expert id is outside [0, E) write nothing (their a2 rows keep the
    sentinel) and read nothing outside the tensors (strict memory); num_valid_ids[0] negative is no
    rows, past R is R."""
    p = make_problem(tokens, 2, 4, 256, 32, 32, 256, 16, seed=3)
    ids, sw, eids, nvalid = p["sorting"]

    def launch(sorting):
        return run(arch, dict(p, sorting=sorting), out=torch.full((tokens * 2, 32), SENTINEL, dtype=torch.bfloat16))

    def without(good, rows):  # the a2 rows of these sorted rows left as the sentinel
        out = good.clone()
        for r in rows:
            token, slot = int(ids[r]) & 0xFFFFFF, int(ids[r]) >> 24
            if token < tokens:
                out[token * 2 + slot] = SENTINEL
        return out

    good = launch(p["sorting"])
    bad = ids.clone()
    bad[0] = (2 << 24) | (bad[0] & 0xFFFFFF)  # slot == topk
    bad[1] = (bad[1] & 0xFFFFFF) | (0x7F << 24)
    bad[2] = (bad[2] & 0xFFFFFF) | -(1 << 31)  # the slot's sign bit
    assert torch.equal(launch((bad, sw, eids, nvalid)), without(good, [0, 1, 2]))
    bad = eids.clone()
    bad[0], bad[1] = 4, -3  # blocks 0 and 1: rows 0..31
    assert torch.equal(launch((ids, sw, bad, nvalid)), without(good, range(32)))
    assert (launch((ids, sw, eids, torch.tensor([-16, tokens], dtype=torch.int32))) == SENTINEL).all()
    assert torch.equal(launch((ids, sw, eids, torch.tensor([2**31 - 1, tokens], dtype=torch.int32))), good)


@pytest.mark.parametrize("arch", ARCHS)
def test_x_and_a2_rows_at_odd_element_offsets(arch):
    """x and a2 at an odd row stride and an odd element offset (rows starting at any even byte,
    STAGE1_DOC): the same bits as contiguous ones, nothing written between the rows."""
    tokens, md = 5, 256
    p = make_problem(tokens, 2, 4, md, 32, 32, 256, 16, seed=5)
    want = run(arch, p, out=torch.full((tokens * 2, 32), SENTINEL, dtype=torch.bfloat16))
    x = torch.full((tokens * (md + 1) + 1,), float("nan"), dtype=torch.bfloat16)[1:].as_strided((tokens, md), (md + 1, 1))
    x.copy_(p["x"][:, :md])
    a2 = torch.full((tokens * 2 * 33 + 1,), SENTINEL, dtype=torch.bfloat16)
    out = a2[1:].as_strided((tokens * 2, 32), (33, 1))
    got = run(arch, dict(p, x=x), out=out)
    assert got is out and torch.equal(got, want)
    assert a2[0] == SENTINEL and (a2[1:][32::33] == SENTINEL).all()


@pytest.mark.parametrize("arch", ARCHS)
def test_x_and_a2_past_4_gib_run_in_token_windows(arch):
    """x and a2 of 33000 rows at a 128 KiB row stride (4.3 GB of address space each, only the routed
    rows touched): one launch per window of tokens, each with x's and a2's base at the window
    (64-bit, on the host); every routed row gets its own token's activation (in one buffer token
    32999's 32-bit row offset would wrap to row 231's) and no other row of a2 is written. Blocks of
    three experts: one with tokens on both sides of the first 4 GiB, one past it only, one below it."""
    rows, stride, topk, block_m = 33000, 65536, 1, 16
    p = make_problem(1, topk, 4, 256, 32, 32, 256, block_m, seed=12, bias_dtype=torch.float32)
    p["x"] = torch.empty(rows, stride, dtype=torch.bfloat16)[:, :256]
    assert len(K.token_windows(rows, (1, 2 * 256, 2 * stride), (topk, 2 * 32, 2 * stride))) == 3
    blocks = [(2, WINDOW_TOKENS[0]), (0, WINDOW_TOKENS[1]), (3, WINDOW_TOKENS[2])]
    p["sorting"] = window_sorting(p["x"], blocks, block_m, torch.Generator().manual_seed(12))
    out = torch.empty(rows, stride, dtype=torch.bfloat16)[:, :32]
    routed = [t for _, toks in blocks for t in toks]
    neighbours = [4, 6, 230, 232, 32766, 32997]  # rows no token maps to, beside routed ones
    out[routed + neighbours] = SENTINEL
    run(arch, p, "swiglu_oai", out=out)
    for e, toks in blocks:
        for t in toks:
            exact, tol = pair_exact_and_tolerance(p, t, e, 1.0, "swiglu_oai")
            assert ((out[t].double() - exact).abs() <= tol).all(), (t, e)
    assert (out[neighbours] == SENTINEL).all()


@pytest.mark.parametrize("arch", ARCHS)
def test_one_row_x_and_out_with_a_stride_past_one_buffer(arch):
    """A one-token x and a one-row out whose row stride is 2^31 elements (a valid view: the next row is
    never addressed) are computed: the launcher took out's bytes per token as topk * stride and refused
    them as past one buffer (red-team finding), and a stride past 32 bits cannot be a kernel constant."""
    p = make_problem(1, 1, 2, 256, 32, 32, 256, 16, seed=3)
    x_store = torch.full((300,), float("nan"), dtype=torch.bfloat16)
    x_store[:256] = p["x"][0]
    p["x"] = x_store.as_strided((1, 256), (1 << 31, 1))
    out_store = torch.full((40,), SENTINEL, dtype=torch.bfloat16)
    out = out_store.as_strided((1, 32), (1 << 31, 1))
    assert run(arch, p, "swiglu_oai", out=out) is out
    exact, tol = pair_exact_and_tolerance(p, 0, int(p["ids"][0, 0]), 1.0, "swiglu_oai")
    assert ((out[0].double() - exact).abs() <= tol).all()
    assert (out_store[32:] == SENTINEL).all()


@pytest.mark.parametrize("kw", [dict(alpha="1.702"), dict(limit="7"), dict(alpha=True), dict(alpha=torch.tensor(1.702)),
                                dict(limit=None)], ids=["alpha-str", "limit-str", "alpha-bool", "alpha-tensor", "limit-none"])
def test_alpha_and_limit_must_be_real_numbers(kw):
    """alpha and limit are real numbers (numpy's too), as the reference checks (check_moe_gemm1_call):
    the launcher took float() of them, so "7", True and a tensor were accepted where the reference
    refuses them, and None failed in float() naming no argument (found by fuzz round 9b)."""
    p = make_problem(5, 2, 4, 224, 48, 64, 256, 16, seed=7)
    name = next(iter(kw))
    with pytest.raises(TypeError, match=f"{name} must be a real number"):
        run("gfx950", p, "swiglu_oai", **kw)


def test_out_sharing_memory_with_itself_refused():
    """An out whose rows share memory (expand()ed, row stride 0) was taken: every routed row stored
    into the one row, which kept whichever came last (found by fuzz round 9b). The reference and
    fused_moe refuse it; so does the launcher, naming out (stage 2's launcher does not check it)."""
    p = make_problem(5, 2, 4, 224, 48, 64, 256, 16, seed=7)
    for out in (torch.zeros(1, 48, dtype=torch.bfloat16).expand(10, 48),
                torch.zeros(10 * 24 + 24, dtype=torch.bfloat16).as_strided((10, 48), (24, 1))):
        with pytest.raises(ValueError, match="out must not have elements sharing memory"):
            run("gfx950", p, out=out)


def test_config_choice_and_bad_inputs():
    # GPT-OSS-120B at 1 token: 4 m-tiles; tile_n 64 over N = 2 * 2880 gives 4 x 90 = 360 >= 256
    # workgroups streaming weights (stage 2's N is half of that)
    assert K1.choose_config1(1, 4, 128, 2880, 2880, "gfx950") == (16, 64)
    assert K1.choose_config1(64, 4, 128, 2880, 2880, "gfx950")[1] == 256
    p = make_problem(2, 1, 2, 256, 32, 32, 256, 16, seed=10, skip_expert=None)
    with pytest.raises(ValueError, match="activation must be one of"):
        run("gfx950", p, "relu")
    with pytest.raises(ValueError, match="inter_dim = 40 must be a multiple of 16"):
        run("gfx950", dict(p, inter_dim=40))
    with pytest.raises(ValueError, match="bias must have shape"):
        run("gfx950", dict(p, bias=torch.zeros(2, 32)))
    for block_m in (0, -16):  # 0: a ZeroDivisionError; -16 (a multiple of tile_m 16) ran
        with pytest.raises(ValueError, match="block_m must be a positive int"):
            run("gfx950", dict(p, block_m=block_m))


# ---- compile checks at GPT-OSS-like shapes ------------------------------------------------------

# (shape, tile_m, tile_n): GPT-OSS-120B's 1-token tile, 16x128, 32x256, the large-token 64x256;
# DeepSeek-R1-like per rank (hidden 7168, inter 256, silu, no bias) and Qwen3-30B-A3B-like (hidden
# 2048, inter 768, gelu) at their 1-token tiles
STAGE1_SHAPES = {
    # (model_dim, inter_dim, half (padded inter), w_k, experts, topk, activation, bias)
    "gptoss": (2880, 2880, 3072, 3072, 128, 4, "swiglu_oai", torch.bfloat16),
    "deepseek": (7168, 256, 256, 7168, 256, 8, "silu", None),
    "qwen3": (2048, 768, 768, 2048, 128, 8, "gelu", None),
}
COMPILE_CASES = [("gptoss", 16, 64), ("gptoss", 16, 128), ("gptoss", 32, 256), ("gptoss", 64, 256),
                 ("deepseek", 16, 64), ("qwen3", 16, 128)]


def compile_stage1(arch: str, shape: str, tile_m: int, tile_n: int):
    """The compile report of stage 1 on a model shape (STAGE1_SHAPES) at tile_m x tile_n, the
    default waves."""
    md, idim, half, w_k, experts, topk, activation, bias_dtype = STAGE1_SHAPES[shape]
    n_kt = K.k_iterations(md)
    waves = K.default_waves(tile_m, tile_n, n_kt, 1, pair=True)
    wn, wk = K.default_layout(tile_m, tile_n, n_kt, 1, waves, pair=True)
    cfg = K.Gemm2Config(arch=arch, out_dtype=torch.bfloat16, tile_m=tile_m, tile_n=tile_n, k_batch=1, wn=wn, wk=wk,
                        model_dim=2 * idim, inter_dim=md, w_n=2 * half, w_k=w_k, a_stride=w_k, topk=topk,
                        block_m=tile_m, apply_weights=False, bias_dtype=bias_dtype, stage=1,
                        activation=activation, out_stride=idim)
    (rep,) = toolchain.compile_only(arch, K.build_moe_gemm2_a16w4(cfg), *([0] * 11), 2 * half, 1, 64, experts, 4, 1,
                                    0, 1, stream=0)
    return rep


@pytest.mark.parametrize("arch", ARCHS)
@pytest.mark.parametrize("shape,tile_m,tile_n", COMPILE_CASES)
def test_compiles_without_spills(arch, shape, tile_m, tile_n):
    """Model shapes (STAGE1_SHAPES; GPT-OSS with hidden 2880 padded to K 3072 and inter 2880 to
    2 x 3072 rows, swiglu_oai and a bf16 bias; routing weights at stage 2)."""
    activation = STAGE1_SHAPES[shape][6]
    rep = compile_stage1(arch, shape, tile_m, tile_n)
    assert rep.spills == 0
    assert rep.workgroups_per_cu() >= 2, (rep.vgprs, rep.agprs, rep.lds_bytes)
    assert re.search(r"^\s+v_exp_f32_e(32|64)\b", rep.isa, re.M) and re.search(r"^\s+v_rcp_f32_e(32|64)\b", rep.isa, re.M)
    if activation == "swiglu_oai":
        # the GPT-OSS clamps (v_min / v_med3 drop a NaN operand) keep NaN through one unordered compare
        assert re.search(r"^\s+v_cmp_[ou]_f32", rep.isa, re.M) and re.search(r"^\s+v_med3_f32", rep.isa, re.M)
    assert "__ocml" not in rep.isa  # no device-library math
    assert rep.count("buffer_load_dwordx4") > 0 and rep.count("buffer_store_dwordx2") > 0
    assert "atomic" not in rep.isa
    if arch == "gfx950":
        assert rep.count("v_mfma_f32_16x16x32_bf16") > 0 and rep.count("v_cvt_scalef32_pk_bf16_fp4") > 0
    else:
        assert rep.count("v_mfma_f32_16x16x16_bf16") > 0 and rep.count("v_perm_b32") > 0
        assert not GFX950_ONLY.search(rep.isa), GFX950_ONLY.search(rep.isa).group(0)



def test_weight_loads_are_16_bytes_per_lane_and_coalesced():
    """Stage 1 streams w1 as stage 2 streams w2 (tests/test_moe_gemm2_kernel.py derives why): every
    instruction that reads w1 moves 16 bytes per lane, and together they reach the issue's 0.95
    coalescing, with a masked K tail (model_dim 224 of 256) and inter_dim 48 of 64 (the pair past it
    never loaded): w1 bytes = tiles with work x 3 pairs x 2 blocks x 7 K chunks x 256 bytes."""
    import flyquant.emu as emu

    from test_moe_gemm2_kernel import W_LOAD_BYTES, WEIGHT_COALESCING, _tensor_traffic

    arch = "gfx950"
    p = make_problem(5, 2, 4, 224, 48, 64, 256, 16, seed=12)
    for name in ("x", "w1", "w1_scale"):
        p[name] = emu.aligned(p[name])
    with emu.record() as launches:
        run(arch, p, "silu", tile_n=64)
    (launch,) = launches
    pcs, total = _tensor_traffic(launch.stats, p["w1"])
    assert pcs and all(c.bytes_per_lane == W_LOAD_BYTES for c in pcs.values())
    ids, _, _, nvalid = p["sorting"]
    work_tiles = sum(1 for r in range(0, int(nvalid[0]), 16) if int(ids[r]) & 0xFFFFFF < 5)
    assert total.bytes == work_tiles * (48 // 16) * 2 * (224 // 32) * 16 * W_LOAD_BYTES
    assert total.coalescing >= WEIGHT_COALESCING, total.coalescing
