"""The A16W4 MoE stage-2 FlyDSL kernel (kernels/moe_gemm2_a16w4.py): executed under flyquant.emu
for gfx950 and gfx942 against the FP32 reference (flyquant.reference.moe_gemm2_a16w4) within a
tolerance derived below, plus compile checks at model shapes and the configuration choice.

Tolerance. The kernel's FP4 -> BF16 conversion is exact and BF16 x BF16 products are exact in
FP32, so for an output element (t, n) with contributions j (one per routing pair of token t and
k-split; the bias rides on k-split 0) the only errors are:
  1. FP32 accumulation of the K products (any order, MFMA or LDS partial sums), and the FP32
     bias add and weight multiply: |q_j - c_j| <= (K + 2) * 2^-24 * |w_j| * (A_j + |b|), with
     c_j the exact contribution and A_j = sum_i |a_i * W_i| over its K range;
  2. rounding q_j to the output dtype before the atomic add: <= u * |q_j|;
  3. each atomic add rounds the running sum: <= u * |out_0 + partial sum| <= u * (|out_0| + S),
     S = sum_j |q_j|;
with u = 2^-8 for bf16 (round to nearest, 8 significant bits) and 2^-24 for fp32 (and 2. absent).
With n contributions: |err| <= F + u * S + n * u * (|out_0| + S), F the sum of the 1.-terms,
S <= sum_j |c_j| + F. For k_batch = 1, c_j = w_j * (y_j + b) is computed here in float64; with
split K the partial sums are bounded by |w_j| * (A_j + |b|). A factor (1 + 2^-6) covers the
second-order terms (errors of errors). Shapes are tiny, so the bound is far from trivial: a
single wrong 32-element block of K moves an element by ~sqrt(32) * |a||W| while the bf16 bound is
~2^-8 * n * |y|.
"""

from __future__ import annotations

import re

import pytest
import torch

import flyquant.emu as emu
from flyquant import layouts, reference, toolchain
from flyquant.moe import moe_sorting
from flyquant.reference import quantize_mxfp4
from flyquant.kernels import moe_gemm2_a16w4 as K

import oracles

ARCHS = ("gfx950", "gfx942")
U_BF16 = 2.0**-8  # unit roundoff: 8 significant bits, round to nearest
U_F32 = 2.0**-24
SECOND_ORDER = 1 + 2.0**-6


def _routing(tokens, topk, experts, seed, skip_expert=None, skew=False):
    """Distinct experts per token; `skip_expert` never chosen (an expert with zero tokens);
    `skew`: most tokens pick the same experts (uneven counts)."""
    gen = torch.Generator().manual_seed(seed)
    pool = [e for e in range(experts) if e != skip_expert]
    ids = torch.stack([torch.tensor(pool)[torch.randperm(len(pool), generator=gen)[:topk]] for _ in range(tokens)])
    if skew:
        ids[: tokens * 2 // 3] = torch.tensor(pool[:topk])
    weights = torch.rand(tokens, topk, generator=gen) + 0.25
    return ids.to(torch.int32), weights


def make_problem(tokens, topk, experts, model_dim, inter_dim, block_m, seed=0, w_n=None, w_k=None,
                 bias_dtype=None, skip_expert=1, skew=True, expert_mask=None, scale_spread=0):
    """Random problem with weights of (w_n, w_k) >= the true sizes, quantized, shuffled, sorted.
    The padding is poisoned so that using it shows: weights there are nonzero and a2's columns
    past inter_dim are NaN (the kernel must neither read them as data nor multiply them by 0).
    scale_spread s: each 32-element block is multiplied by 2^u, u uniform in [-s, s], so the
    E8M0 codes spread over 127 +- s (the gfx942 unpack builds its tables per scale)."""
    w_n = w_n or model_dim
    w_k = w_k or inter_dim
    gen = torch.Generator().manual_seed(seed + 1)
    w = torch.randn(experts, w_n, w_k, generator=gen)
    if scale_spread:
        exps = torch.randint(-scale_spread, scale_spread + 1, (experts, w_n, w_k // 32, 1), generator=gen)
        w = (w.view(experts, w_n, w_k // 32, 32) * torch.exp2(exps.float())).view(experts, w_n, w_k)
    packed, scales = quantize_mxfp4(w)
    w2 = layouts.shuffle_weight_a16w4(packed)
    w2_scale = layouts.shuffle_scale_a16w4(scales.reshape(experts * w_n, -1), experts)
    a2 = torch.randn(tokens * topk, w_k, generator=gen).to(torch.bfloat16)
    a2[:, inter_dim:] = float("nan")
    ids, weights = _routing(tokens, topk, experts, seed, skip_expert, skew)
    sorting = moe_sorting(ids, weights, experts, block_m, expert_mask=expert_mask)
    # bias comparable to the dot products, so that adding it twice (or not at all) shows; as wide
    # as the padded weights, its columns past model_dim would show in out if they were written;
    # rows an odd number of elements apart (a column slice), so a bf16 row starts 2-byte aligned
    bias = None if bias_dtype is None else (8 * torch.randn(experts, w_n + 1, generator=gen)).to(bias_dtype)[:, :w_n]
    return dict(a2=a2, w2=w2, w2_scale=w2_scale, sorting=sorting, bias=bias, topk=topk, block_m=block_m,
                model_dim=model_dim, inter_dim=inter_dim, packed=packed, scales=scales)


def tolerance(p, out0, out_dtype, k_batch, apply_weights):
    """The per-element bound of the module docstring, from float64 recomputation."""
    ids, sw, eids, nvalid = p["sorting"]
    topk, block_m, md, kd = p["topk"], p["block_m"], p["model_dim"], p["inter_dim"]
    weight = reference.dequantize_mxfp4(p["packed"], p["scales"])[:, :md, :kd].double()
    a = p["a2"][:, :kd].double()
    tokens = a.shape[0] // topk
    rows = torch.arange(ids.numel())
    tok = ids & 0xFFFFFF
    valid = (rows < nvalid[0]) & (tok < tokens)
    c_abs = torch.zeros(tokens, md, dtype=torch.float64)
    acc_err = torch.zeros(tokens, md, dtype=torch.float64)
    count = torch.zeros(tokens, 1, dtype=torch.float64)
    for r in rows[valid].tolist():
        t, slot, e = int(tok[r]), int(ids[r]) >> 24, int(eids[r // block_m])
        row = a[t * topk + slot]
        w = float(sw[r]) if apply_weights else 1.0
        b = p["bias"][e, :md].double() if p["bias"] is not None else torch.zeros(md, dtype=torch.float64)
        abs_sum = row.abs() @ weight[e].abs().t() + b.abs()
        # k-splits cut K at multiples of K.KT: the splits' partial sums are bounded by the sum of
        # the |partial sums| over each KT-wide block (the whole K when k_batch is 1)
        block = kd if k_batch == 1 else K.KT
        parts = [row[k0:k0 + block] @ weight[e][:, k0:k0 + block].t() for k0 in range(0, kd, block)]
        c_abs[t] += abs(w) * (sum(p.abs() for p in parts) + b.abs())
        acc_err[t] += (kd + 2) * U_F32 * abs(w) * abs_sum
        count[t] += k_batch
    u = U_BF16 if out_dtype == torch.bfloat16 else U_F32
    own_rounding = u if out_dtype == torch.bfloat16 else 0.0
    s = c_abs + acc_err
    return SECOND_ORDER * (acc_err + own_rounding * s + count * u * (out0.double().abs() + s))


def run_case(arch, p, out_dtype=torch.bfloat16, k_batch=None, tile_n=None, tile_m=None, apply_weights=True, out=None,
             waves=None):
    ids, sw, eids, nvalid = p["sorting"]
    with toolchain.target(arch):
        return K.moe_gemm2_a16w4(
            p["a2"], p["w2"], p["w2_scale"], ids, sw, eids, nvalid, arch=arch, topk=p["topk"], block_m=p["block_m"],
            out=out, bias=p["bias"], apply_weights=apply_weights, out_dtype=out_dtype, model_dim=p["model_dim"],
            inter_dim=p["inter_dim"], tile_m=tile_m, tile_n=tile_n, k_batch=k_batch, waves=waves,
        )


def check(p, got, out0, out_dtype, k_batch, apply_weights):
    ids, sw, eids, nvalid = p["sorting"]
    ref = reference.moe_gemm2_a16w4(
        p["a2"], p["w2"], p["w2_scale"], ids, sw, eids, nvalid, p["topk"], p["block_m"],
        out=out0.to(torch.float32).clone(), bias=p["bias"], apply_weights=apply_weights,
        model_dim=p["model_dim"], inter_dim=p["inter_dim"],
    )
    tol = tolerance(p, out0, out_dtype, k_batch, apply_weights)
    err = (got.double() - ref.double()).abs()
    bad = ~(err <= tol)  # NaN or Inf anywhere fails too
    assert not bad.any(), (
        f"{int(bad.sum())} elements outside the derived bound; worst at {divmod(int((err - tol).argmax()), err.shape[1])}: "
        f"err {float(err.flatten()[(err - tol).argmax()]):.3g} tol {float(tol.flatten()[(err - tol).argmax()]):.3g}"
    )


# Small shapes (emulation is slow). Every case: 4 experts, one with no token, uneven counts
# (2/3 of the tokens share the same experts).
#   model 128 x inter 512: one 128-wide n-tile, two 256-wide K steps.
#   model 240 (w_n 256) x inter 480 (w_k 512): a ragged n-tile and a ragged last K step, i.e.
#   padded weights with true sizes (GPT-OSS's 2880 -> 3072 in miniature).
#   tile32x256 / tile64x128: the larger tiles (2 and 4 row blocks per wave, A loaded at use);
#   inter 768 gives the 64x128 tile's 2 waves along K unequal K ranges (3 steps of 256).
#   inter 1024: 4 K steps, so 4 waves can split K (an LDS reduction of 3 partial tiles).
#   Every K worker's iteration count: compile-time when they all have the same (1: no prefetch,
#   2: straight-line; two_iters, 3: a loop; loop_uniform), else read at run time (inter 1792 =
#   7 steps over 2 k-splits: 3 and 4; loop_uneven, and tile64x128's 1 and 2).
# The waves column picks the workgroup's split (wn along N x wk along K, see default_layout):
# 4: 2x2 / 4x1 / 1x4; 2: 1x2 / 2x1; 1: 1x1; padded_splitk's 4x1 gives one 16-column block per
# wave (a wave starting at the odd half of a 32-row scale group).
# fp32 outputs carry the checks that bf16 rounding would blur (bias once per k-split).
# tile32_k_tail / tile64_k_tail: a K tail (inter 352 / 480 of w_k 512, NaN in a2 past it) on the
# tiles of several row blocks, whose A is loaded at use (the 16-row tile's goes through the step's
# masked loads): the first / second step of the last iteration partly past inter_dim.
CASES = [
    # id,          tokens, topk, model, inter, w_n,  w_k, block_m, tile_m, tile_n, k_batch, waves, out_dtype,   weights, bias
    ("topk1",           6,    1,   128,   512, None, None,     16,     16,    128,      1,     4, torch.bfloat16, True, None),
    ("topk2_bias",      9,    2,   128,   512, None, None,     16,     16,    128,      1,     2, torch.bfloat16, True, torch.bfloat16),
    ("splitk_bias",     9,    2,   128,   512, None, None,     16,     16,    128,      2,     2, torch.bfloat16, True, torch.float32),
    ("f32_splitk_bias", 9,    2,   128,   512, None, None,     16,     16,    128,      2,     4, torch.float32, True, torch.bfloat16),
    ("f32_noweights",   9,    2,   128,   512, None, None,     32,     32,     64,      1,     1, torch.float32, False, None),
    ("padded_tails",    7,    2,   240,   480,  256,  512,     16,     16,    128,      1,     2, torch.bfloat16, True, torch.bfloat16),
    ("padded_splitk",   7,    2,   240,   480,  256,  512,     32,     16,     64,      2,     4, torch.float32, True, None),
    ("tile32x256",     20,    2,   256,   512, None, None,     32,     32,    256,      1,     2, torch.bfloat16, True, None),
    ("tile64x128",     24,    2,   128,   768, None, None,     64,     64,    128,      1,     4, torch.float32, True, torch.float32),
    ("wk4",             9,    2,   128,  1024, None, None,     16,     16,    128,      1,     4, torch.float32, True, torch.float32),
    ("two_iters",       9,    2,   128,  1024, None, None,     16,     16,    128,      1,     2, torch.bfloat16, True, None),
    ("loop_uniform",    5,    2,   128,  1536, None, None,     16,     16,    128,      1,     2, torch.float32, True, torch.bfloat16),
    ("loop_uneven",     5,    2,   128,  1792, None, None,     16,     16,     64,      2,     1, torch.float32, False, None),
    ("tile32_k_tail",  20,    2,   128,   352, None,  512,     32,     32,    128,      1,  None, torch.float32, True, None),
    ("tile64_k_tail",  20,    2,   128,   480, None,  512,     64,     64,    128,      1,  None, torch.bfloat16, True, None),
]
SCALE_SPREAD = {"topk1": 24}  # E8M0 codes 103..151 (the rest: codes around 125)


@pytest.mark.parametrize("arch", ARCHS)
@pytest.mark.parametrize("case", CASES, ids=[c[0] for c in CASES])
def test_matches_reference(arch, case):
    _, tokens, topk, md, kd, w_n, w_k, block_m, tile_m, tile_n, k_batch, waves, out_dtype, weights, bias = case
    p = make_problem(tokens, topk, 4, md, kd, block_m, seed=sum(map(ord, case[0])), w_n=w_n, w_k=w_k, bias_dtype=bias,
                     scale_spread=SCALE_SPREAD.get(case[0], 0))
    out0 = torch.zeros(p["a2"].shape[0] // topk, md, dtype=out_dtype)
    got = run_case(arch, p, out_dtype, k_batch=k_batch, tile_n=tile_n, tile_m=tile_m, apply_weights=weights, waves=waves)
    assert got.dtype == out_dtype and got.shape == out0.shape
    check(p, got, out0, out_dtype, k_batch, weights)


@pytest.mark.parametrize("arch", ARCHS)
def test_block_m_is_part_of_the_compiled_kernel(arch):
    """The same routing sorted in blocks of 16 and of 32 rows, run one after the other on the same
    16-row tiles: the expert of a tile is sorted_expert_ids[row / block_m], so the two need
    different binaries. FlyDSL's compile cache once handed the second the first's (block_m was
    read through the config object, which its cache key does not see): wrong experts, no error."""
    for block_m in (16, 32):
        p = make_problem(24, 2, 4, 128, 512, block_m, seed=5)
        out0 = torch.zeros(24, 128)
        check(p, run_case(arch, p, torch.float32, k_batch=1, tile_n=128, tile_m=16, waves=2), out0, torch.float32,
              1, True)


@pytest.mark.parametrize("arch", ARCHS)
def test_adds_into_out_and_leaves_unrouted_rows_untouched(arch):
    """out given: results are added into it. Tokens whose experts are all served elsewhere
    (expert_mask) and the guard rows after out keep their exact bits. Without routing weights
    and with a bias, a padding row (token id T) would add a nonzero bias to guard row T."""
    tokens, topk, experts, md, kd = 8, 2, 4, 128, 256
    mask = torch.tensor([1, 1, 0, 0], dtype=torch.int32)
    p = make_problem(tokens, topk, experts, md, kd, 16, seed=5, skip_expert=None, skew=False, expert_mask=mask,
                     bias_dtype=torch.bfloat16)
    # token 0 and 1 routed only to masked-out experts 2, 3
    ids, weights = _routing(tokens, topk, experts, 5, None, False)
    ids[0], ids[1] = torch.tensor([2, 3]), torch.tensor([3, 2])
    p["sorting"] = moe_sorting(ids, weights, experts, 16, expert_mask=mask)
    # masked experts' weights are not the local ones: keep only experts 0, 1 locally
    local = slice(0, 2)
    p["w2"], p["packed"], p["scales"] = p["w2"][local], p["packed"][local], p["scales"][local]
    p["w2_scale"] = p["w2_scale"][: 2 * md]
    p["bias"] = p["bias"][local]
    buf = torch.randn(tokens + 2, md).to(torch.bfloat16)
    out = buf[:tokens]
    before = buf.clone()
    got = run_case(arch, p, torch.bfloat16, out=out, apply_weights=False)
    assert got.data_ptr() == out.data_ptr()
    unrouted = [0, 1]
    assert torch.equal(buf[unrouted].view(torch.int16), before[unrouted].view(torch.int16))
    assert torch.equal(buf[tokens:].view(torch.int16), before[tokens:].view(torch.int16))
    check(p, got, before[:tokens], torch.bfloat16, 1, False)


@pytest.mark.parametrize("arch", ARCHS)
def test_one_row_a2_with_a_stride_past_one_buffer(arch):
    """One token, topk 1: a2's one row at a stride of 2^31 elements (the next row is never addressed) is
    computed; a stride past 32 bits cannot be a kernel constant (kernel_row_stride)."""
    p = make_problem(1, 1, 2, 128, 256, 16, seed=9, skip_expert=None)
    store = torch.full((300,), float("nan"), dtype=torch.bfloat16)
    store[:256] = p["a2"][0]
    p["a2"] = store.as_strided((1, 256), (1 << 31, 1))
    out0 = torch.zeros(1, 128, dtype=torch.bfloat16)
    check(p, run_case(arch, p, out=out0.clone()), out0, torch.bfloat16, 1, True)


@pytest.mark.parametrize("arch", ARCHS)
def test_aiter_shuffled_inputs_give_the_same_result(arch):
    """Weights and scales laid out by aiter's own shuffle functions give bit-identical output."""
    aiter = oracles.aiter_shuffle()
    p = make_problem(5, 2, 4, 128, 256, 16, seed=11)
    ours = run_case(arch, p, torch.float32)
    experts = p["w2"].shape[0]
    p["w2"] = aiter.shuffle_weight_a16w4(p["packed"], 16, False)
    p["w2_scale"] = aiter.shuffle_scale_a16w4(p["scales"].reshape(experts * 128, -1), experts, False)
    theirs = run_case(arch, p, torch.float32)
    assert torch.equal(ours.view(torch.int32), theirs.view(torch.int32))


# Every E8M0 code at the ends of the range, where gfx942's software unpack once borrowed or
# carried across its table bytes (NaN and inf for scale 0; 0 for 4.0 and 6.0 at 254): all
# weights of the problem take the code, so a wrong table value moves every output. Activations
# are powers of two that keep every product and sum in FP32's normal range: at codes 0 and 1 the
# BF16 weights are subnormal (0.5 * 2^-127 = 2^-128) and the products at least 2^-126; at codes
# 253 and 254 the FP4 magnitudes stay below 4.0 and 2.0 (larger ones overflow BF16, as the
# reference's FP32 does) and 256 products stay below 2^128.
#   (id, code, activation magnitudes, FP4 magnitude codes below)
SCALE_ENDS = [("code0", 0, (4.0, 8.0), 8), ("code1", 1, (2.0, 4.0), 8), ("code2", 2, (1.0, 2.0), 8),
              ("code252", 252, (2.0**-9, 2.0**-8), 8), ("code253", 253, (2.0**-10, 2.0**-9), 6),
              ("code254", 254, (2.0**-11, 2.0**-10), 4)]


def _one_scale_problem(code, magnitudes, fp4_below, seed):
    experts, md, kd = 4, 128, 256
    p = make_problem(5, 2, experts, md, kd, 16, seed=seed)
    gen = torch.Generator().manual_seed(seed)
    nibbles = torch.randint(0, fp4_below, (experts, md, kd), generator=gen) | torch.randint(0, 2, (experts, md, kd), generator=gen) << 3
    p["packed"] = (nibbles[..., 0::2] | nibbles[..., 1::2] << 4).to(torch.uint8)
    p["scales"] = torch.full((experts, md, kd // 32), code, dtype=torch.uint8).view(torch.float8_e8m0fnu)
    p["w2"] = layouts.shuffle_weight_a16w4(p["packed"])
    p["w2_scale"] = layouts.shuffle_scale_a16w4(p["scales"].reshape(experts * md, -1), experts)
    pick = torch.randint(0, 2, p["a2"].shape, generator=gen)
    sign = torch.randint(0, 2, p["a2"].shape, generator=gen) * 2 - 1
    p["a2"] = (sign * torch.tensor(magnitudes)[pick]).to(torch.bfloat16)
    return p


@pytest.mark.parametrize("arch", ARCHS)
@pytest.mark.parametrize("end", SCALE_ENDS, ids=[e[0] for e in SCALE_ENDS])
def test_scale_codes_at_the_ends_of_the_range(arch, end):
    _, code, magnitudes, fp4_below = end
    p = _one_scale_problem(code, magnitudes, fp4_below, seed=code)
    got = run_case(arch, p, torch.float32)
    check(p, got, torch.zeros_like(got), torch.float32, 1, True)


# A block whose values are not finite: E8M0 0xFF (NaN: every element, zeros included), and codes
# 253 and 254 with FP4 magnitudes past BF16's (and FP32's) range (inf), with positive activations
# so that the block's column sums to inf.  (id, block scale code, block FP4 magnitude code or None:
# random)
SPECIAL_SCALES = [("nan", 255, None), ("inf253_6", 253, 7), ("inf254_4", 254, 6), ("inf254_2", 254, 4)]


@pytest.mark.parametrize("arch", ARCHS)
@pytest.mark.parametrize("case", SPECIAL_SCALES, ids=[c[0] for c in SPECIAL_SCALES])
def test_non_finite_blocks_give_the_references_nan_and_inf(arch, case):
    _, code, magnitude = case
    p = _one_scale_problem(127, (1.0, 2.0), 8, seed=code)
    p["a2"] = p["a2"].abs()
    # the other outputs are those of the problem without the block (its derived bound applies)
    tol = tolerance(p, torch.zeros(p["a2"].shape[0] // p["topk"], p["model_dim"]), torch.float32, 1, True)
    p["scales"].view(torch.uint8)[:, 5, 3] = code  # one block of row 5 in every expert
    if magnitude is not None:
        p["packed"][:, 5, 48:64] = magnitude * 0x11
    p["w2"] = layouts.shuffle_weight_a16w4(p["packed"])
    p["w2_scale"] = layouts.shuffle_scale_a16w4(p["scales"].reshape(-1, p["scales"].shape[-1]), 4)
    got = run_case(arch, p, torch.float32)
    ids, sw, eids, nvalid = p["sorting"]
    ref = reference.moe_gemm2_a16w4(p["a2"], p["w2"], p["w2_scale"], ids, sw, eids, nvalid, p["topk"], p["block_m"],
                                    out=torch.zeros_like(got), model_dim=p["model_dim"], inter_dim=p["inter_dim"])
    special = ~ref.isfinite()
    assert special.any() and torch.equal(got.isnan(), ref.isnan()) and torch.equal(got[special & ~ref.isnan()],
                                                                                  ref[special & ~ref.isnan()])
    assert ((got.double() - ref.double()).abs()[~special] <= tol[~special]).all()


@pytest.mark.parametrize("arch", ARCHS)
def test_nan_scales_in_the_k_padding_are_not_applied(arch):
    """inter_dim 384 of w_k 512 with E8M0 NaN (255) as the padding's scale codes: the K steps past
    inter_dim mask their scales as well as a2 (0 x NaN-scaled weights would be NaN)."""
    p = make_problem(7, 2, 4, 128, 384, 16, seed=4, w_n=128, w_k=512)
    p["scales"].view(torch.uint8)[..., 384 // 32:] = 255
    p["w2_scale"] = layouts.shuffle_scale_a16w4(p["scales"].reshape(4 * 128, -1), 4)
    got = run_case(arch, p, torch.float32, k_batch=1, tile_n=128, tile_m=16)
    check(p, got, torch.zeros(7, 128), torch.float32, 1, True)


def ck_style_sorting(topk_ids, topk_weights, experts, block_m):
    """moe_sorting's contract as aiter's CK kernel fills it by default: an expert with no token
    still gets one block of padding rows (sorted_expert_ids names it), so blocks without any
    routing pair sit between the real ones."""
    tokens, topk = topk_ids.shape
    pad = (topk << 24) | tokens
    ids, weights, blocks = [], [], []
    for e in range(experts):
        pairs = [(t, k) for t in range(tokens) for k in range(topk) if topk_ids[t, k] == e]
        n_blocks = max(1, -(-len(pairs) // block_m))
        ids += [(k << 24) | t for t, k in pairs] + [pad] * (n_blocks * block_m - len(pairs))
        weights += [float(topk_weights[t, k]) for t, k in pairs] + [0.0] * (n_blocks * block_m - len(pairs))
        blocks += [e] * n_blocks
    used = len(ids)
    rows = tokens * topk + experts * block_m
    ids += [pad] * (rows - used)
    weights += [0.0] * (rows - used)
    blocks += [-1] * (-(-rows // block_m) - len(blocks))
    as_i32 = lambda v: torch.tensor(v, dtype=torch.int32)
    return as_i32(ids), torch.tensor(weights), as_i32(blocks), as_i32([used, tokens])


@pytest.mark.parametrize("arch", ARCHS)
@pytest.mark.parametrize("ck_style", (False, True), ids=("flyquant_sorting", "ck_empty_expert_blocks"))
def test_few_tokens_scan_for_the_tiles_with_work(arch, ck_style):
    """3 tokens x top-2 over 8 experts: at most 6 m-tiles can hold a pair, fewer than the sorted
    arrays' tiles, so the grid has 6 m-slots that scan the sorted ids for their tile (compact).
    Skewed routing leaves some slots without a tile (they exit); with CK-style sorting, blocks of
    pure padding for the empty experts lie between the tiles with work and must be skipped."""
    tokens, topk, experts, md, kd, block_m = 3, 2, 8, 128, 256, 16
    p = make_problem(tokens, topk, experts, md, kd, block_m, seed=21, skip_expert=None, skew=True)
    if ck_style:
        ids, weights = _routing(tokens, topk, experts, 21, None, True)
        p["sorting"] = ck_style_sorting(ids, weights, experts, block_m)
    rows = p["sorting"][0].numel()
    grid_m, compact = K.m_grid(tokens, topk, experts, rows, block_m)
    assert compact and grid_m == tokens * topk
    out0 = torch.zeros(tokens, md, dtype=torch.float32)
    with emu.record() as launches:
        got = run_case(arch, p, torch.float32, tile_m=block_m, k_batch=1)
    (launch,) = launches
    assert launch.grid[0] == grid_m
    check(p, got, out0, torch.float32, 1, True)


@pytest.mark.parametrize("arch", ARCHS)
def test_scan_past_the_first_64_tiles(arch):
    """120 tokens x top-1 over 256 experts: about 100 m-tiles in use, a compact grid of 120 slots.
    The scan covers the first 64 tiles straight-line and the rest in a loop: the slots whose
    tile lies past the first 64 must find it there, and the others must not find a second one."""
    tokens, topk, experts, md, kd, block_m = 120, 1, 256, 64, 256, 16
    p = make_problem(tokens, topk, experts, md, kd, block_m, seed=5, skip_expert=None, skew=False)
    ids, _, _, nvalid = p["sorting"]
    _, compact = K.m_grid(tokens, topk, experts, ids.numel(), block_m)
    assert compact and int(nvalid[0]) // block_m > K.WAVE
    out0 = torch.zeros(tokens, md, dtype=torch.float32)
    got = run_case(arch, p, torch.float32, tile_m=block_m, tile_n=64, k_batch=1, waves=1)
    check(p, got, out0, torch.float32, 1, True)


# ---- configuration and validation (no execution) ------------------------------------------------


@pytest.mark.parametrize("arch", ARCHS)
def test_one_token_streams_weights_on_enough_workgroups(arch):
    """GPT-OSS-like (E 128, topk 4, 2880 padded to 3072): at 1 token at least 256 workgroups
    have work (the m-grid holds only tiles that can have work)."""
    tile_m, tile_n, k_batch = K.choose_config(1, 4, 128, 2880, 2880, arch)
    grid_m, compact = K.m_grid(1, 4, 128, 4 + 128 * tile_m - 4, tile_m)
    assert compact and grid_m == 4
    working = 4 * -(-2880 // tile_n) * k_batch
    assert working >= 256


def test_config_choice_by_token_count():
    small = K.choose_config(1, 8, 256, 7168, 2048, "gfx950")
    large = K.choose_config(4096, 8, 256, 7168, 2048, "gfx950")
    assert small[0] == 16 and large[0] == 64
    assert small[2] >= 1 and large[2] == 1


def test_bad_inputs_are_named():
    p = make_problem(4, 2, 4, 128, 256, 16, seed=3)
    ids, sw, eids, nvalid = p["sorting"]
    args = (p["a2"], p["w2"], p["w2_scale"], ids, sw, eids, nvalid)
    with pytest.raises(TypeError, match="a2"):
        K.moe_gemm2_a16w4(p["a2"].float(), *args[1:], arch="gfx950", topk=2, block_m=16)
    with pytest.raises(ValueError, match="block_m"):
        K.moe_gemm2_a16w4(*args, arch="gfx950", topk=2, block_m=24)
    for block_m in (0, -16):  # -16 is a multiple of tile_m 16: it ran, reading block 0's expert for every tile
        with pytest.raises(ValueError, match="block_m must be a positive int"):
            K.moe_gemm2_a16w4(*args, arch="gfx950", topk=2, block_m=block_m)
    with pytest.raises(ValueError, match="inter_dim"):
        K.moe_gemm2_a16w4(*args, arch="gfx950", topk=2, block_m=16, inter_dim=250)
    with pytest.raises(ValueError, match="k_batch"):
        K.moe_gemm2_a16w4(*args, arch="gfx950", topk=2, block_m=16, k_batch=3)
    with pytest.raises(ValueError, match="arch"):
        K.moe_gemm2_a16w4(*args, arch="gfx90a", topk=2, block_m=16)
    with pytest.raises(ValueError, match="w2's K"):
        K.moe_gemm2_a16w4(p["a2"], p["w2"][:, :, :64].contiguous(), *args[2:], arch="gfx950", topk=2, block_m=16)
    # an expert of 1 GiB (torch.empty: address space only, no page is touched)
    w_n, w_k = 1 << 15, 1 << 16
    huge_w2, huge_scale = torch.empty(1, w_n, w_k // 2, dtype=torch.uint8), torch.empty(w_n, w_k // 32, dtype=torch.uint8)
    with pytest.raises(ValueError, match="one expert's weights"):
        K.moe_gemm2_a16w4(p["a2"], huge_w2, huge_scale, *args[3:], arch="gfx950", topk=2, block_m=16)


# ---- compile checks at model shapes -------------------------------------------------------------

GFX950_ONLY = re.compile(r"^\s+(v_cvt_scalef32\w*|v_mfma_f32_16x16x32_bf16|v_cvt_pk_bf16_f32|v_bitop3\w*|v_permlane(16|32)_swap\w*|v_prng\w*)\b", re.M)
MODEL_SHAPES = {
    # (model_dim, inter_dim, w_n, w_k, experts, topk)
    "gptoss": (2880, 2880, 3072, 3072, 128, 4),
    "deepseek": (7168, 2048, 7168, 2048, 256, 8),
}
# GPT-OSS-like (padded weights, ragged K and N tails): the 1-token tile with and without split K,
# tile_n 256 at 16 and 32 rows, and the large-token 64x256 (the only 4-wave split); DeepSeek-like
# at 1 token with tile_n 128 and 256.
COMPILE_CASES = [
    ("gptoss", 16, 128, 3), ("gptoss", 16, 256, 1), ("gptoss", 32, 256, 1), ("gptoss", 64, 256, 1),
    ("deepseek", 16, 128, 1), ("deepseek", 16, 256, 1),
]


@pytest.mark.parametrize("arch", ARCHS)
@pytest.mark.parametrize("case", COMPILE_CASES, ids=[f"{c[0]}-{c[1]}x{c[2]}-kb{c[3]}" for c in COMPILE_CASES])
def test_compiles_without_spills_at_two_workgroups_per_cu(arch, case):
    shape, tile_m, tile_n, k_batch = case
    md, kd, w_n, w_k, experts, topk = MODEL_SHAPES[shape]
    n_kt = K.k_iterations(kd)
    waves = K.default_waves(tile_m, tile_n, n_kt, k_batch)
    wn, wk = K.default_layout(tile_m, tile_n, n_kt, k_batch, waves)
    cfg = K.Gemm2Config(
        arch=arch, out_dtype=torch.bfloat16, tile_m=tile_m, tile_n=tile_n, k_batch=k_batch, wn=wn, wk=wk,
        model_dim=md, inter_dim=kd, w_n=w_n, w_k=w_k, a_stride=w_k, topk=topk, block_m=tile_m,
        apply_weights=True, bias_dtype=torch.bfloat16,
    )
    # pointers and a2's and out's sizes (11 zeros), bias stride, tokens, sorted rows, experts, m-slots, compact,
    # first token and all tokens (token windows)
    (rep,) = toolchain.compile_only(arch, K.build_moe_gemm2_a16w4(cfg), *([0] * 11), md, 1, 64, experts, 4, 1, 0, 1,
                                    stream=0)
    assert rep.spills == 0
    assert rep.workgroups_per_cu() >= 2, (rep.vgprs, rep.agprs, rep.lds_bytes)
    if arch == "gfx950":
        assert rep.count("v_mfma_f32_16x16x32_bf16") > 0 and rep.count("v_cvt_scalef32_pk_bf16_fp4") > 0
    else:
        assert rep.count("v_mfma_f32_16x16x16_bf16") > 0 and rep.count("v_perm_b32") > 0
        assert not GFX950_ONLY.search(rep.isa), GFX950_ONLY.search(rep.isa).group(0)
    # bf16 output atomics: through out's buffer where the arch has the buffer form (gfx950)
    atomic = "buffer_atomic_pk_add_bf16" if arch == "gfx950" else "global_atomic_pk_add_bf16"
    assert rep.count("buffer_load_dwordx4") > 0 and rep.count(atomic) > 0


# ---- memory access: weight loads coalesced -------------------------------------------------------

WEIGHT_COALESCING = 0.95  # the target: useful bytes per byte of the 128-byte lines touched
W_LOAD_BYTES = 16  # per lane: one 32-value FP4 pack (buffer_load_dwordx4)


def _tensor_traffic(stats, t):
    """{pc: counter} and summed counter of the instructions that read only inside tensor t (under
    the emulator a CPU tensor's data_ptr is the address the kernel sees)."""
    lo = t.data_ptr()
    return stats.memory_within(lo, lo + t.nbytes), stats.traffic_within(lo, lo + t.nbytes)


@pytest.mark.parametrize("arch", ARCHS)
def test_weight_loads_are_16_bytes_per_lane_and_coalesced(arch):
    """The padded_tails case (model 240 of w_n 256, inter 480 of w_k 512, tile 16x128, 2 waves
    splitting K): every instruction that reads w2 moves 16 bytes per lane that moves data, and
    together they reach the coalescing target. Derivation: a weight load of a wave reads the
    1 KiB (16 columns x 128 K) tile at lane * 16, and tiles start at multiples of 1 KiB in an
    expert whose weights start at a multiple of 4 KiB (w_n * w_k / 2), so from a 256-byte
    aligned w2 it covers 8 whole lines (coalescing 1). The last K step (k 384..511) is masked
    past inter_dim 480: lanes with kl = lane // 16 = 3 (k 480..511) get an offset past the
    buffer and move nothing, so its loads move 48 lanes x 16 bytes = the tile's first 6 lines,
    whole: the masked step is as coalesced as the full ones, and the figure is asserted over
    all the weight loads. Column block 15 (240..255, past model_dim) is never loaded. Hence
    w2 bytes = m-tiles with work x 15 column blocks x 15 K chunks of 32 x 256 bytes (16 rows x
    16 bytes). Scale and activation loads (no target) are printed (pytest -s)."""
    case = next(c for c in CASES if c[0] == "padded_tails")
    _, tokens, topk, md, kd, w_n, w_k, block_m, tile_m, tile_n, k_batch, waves, out_dtype, weights, bias = case
    p = make_problem(tokens, topk, 4, md, kd, block_m, seed=sum(map(ord, case[0])), w_n=w_n, w_k=w_k, bias_dtype=bias)
    for name in ("a2", "w2", "w2_scale"):
        p[name] = emu.aligned(p[name])  # where hipMalloc would put them
    with emu.record() as launches:
        run_case(arch, p, out_dtype, k_batch=k_batch, tile_n=tile_n, tile_m=tile_m, apply_weights=weights, waves=waves)
    (launch,) = launches
    stats = launch.stats

    ids, _, _, nvalid = p["sorting"]
    starts = range(0, int(nvalid[0]), tile_m)
    work_tiles = sum(1 for r in starts if int(ids[r]) & K.TOKEN_MASK < tokens)
    blocks, chunks = md // K.MFMA_MN, kd // K.K_CHUNK
    per_lane_group = K.MFMA_MN * W_LOAD_BYTES  # 16 lanes (rows) x 16 bytes per 32-wide K chunk

    w_pcs, w_total = _tensor_traffic(stats, p["w2"])
    assert w_pcs, "no instruction read inside w2's address range"
    for pc, c in w_pcs.items():
        assert c.bytes_per_lane == W_LOAD_BYTES, (hex(pc), c.text, c.bytes_per_lane)
    assert w_total.bytes == work_tiles * blocks * chunks * per_lane_group
    # loads that ran with lanes masked (the K tail, the column block past model_dim) are included
    masked = {pc: c for pc, c in w_pcs.items() if 0 < c.lanes < K.WAVE * c.executed}
    assert masked, "no weight load ran partly masked: the tails were not exercised"
    per_pc = {hex(pc): round(c.coalescing, 3) for pc, c in w_pcs.items()}
    assert w_total.coalescing >= WEIGHT_COALESCING, (w_total.coalescing, per_pc)

    print(f"\n{arch} {launch.kernel}: weight loads {len(w_pcs)} instructions ({len(masked)} partly masked), "
          f"{w_total.bytes} bytes, {w_total.bytes_per_lane:g} bytes/lane, coalescing {w_total.coalescing:.3f}")
    for name in ("w2_scale", "a2"):
        pcs, total = _tensor_traffic(stats, p[name])
        print(f"  {name}: {len(pcs)} instructions ({', '.join(sorted({c.name for c in pcs.values()}))}), "
              f"{total.bytes} bytes, {total.bytes_per_lane:g} bytes/lane, coalescing {total.coalescing:.3f}")
