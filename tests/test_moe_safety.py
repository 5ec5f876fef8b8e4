"""Memory safety and input hardening of the A16W4 MoE stage 2 (issue 21, findings 2-6, 8, 9, 11).

Every kernel launch here runs in the emulator's strict memory mode with exactly the bytes of the
call's tensors valid (`only_tensors`: each tensor's own elements, not its whole storage), so a
read or an atomic outside any of them fails the test that made it. Sizes past 2^31 elements or
4 GiB use tensors whose pages are never touched (torch.empty is lazily backed; overlapping
as_strided rows), with a handful of sorted rows, so only a few workgroups run.
"""

from __future__ import annotations

import contextlib

import pytest
import torch

import flyquant as fq
import flyquant.emu as emu
from flyquant import layouts, reference, toolchain, validate
from flyquant.kernels import moe_gemm2_a16w4 as K
from flyquant.reference import quantize_mxfp4

from test_moe_gemm2_kernel import check, make_problem

ARCHS = ("gfx950", "gfx942")
U_BF16 = 2.0**-8
U_F32 = 2.0**-24


@contextlib.contextmanager
def only_tensors(*tensors):
    """Strict memory in which only these tensors' elements (and the launch's own kernarg segment)
    are valid memory."""
    memory = emu.global_memory()
    keys = []
    try:
        for t in tensors:
            span = None if t is None else validate.byte_extent(t)
            if span is not None:
                keys.append(memory.register(span[0], span[1] - span[0]))
        with emu.strict_memory():
            yield
    finally:
        for key in keys:
            memory.unregister(key)


BIAS_ARG, BIAS_STRIDE_ARG, EXPERTS_ARG = 10, 11, 14  # positions in the launcher's arguments


@contextlib.contextmanager
def launched_bias_tracked(model_dim):
    """Also valid: the bias rows the launcher hands the kernel (E rows of model_dim elements at its
    bias stride), i.e. the copy it makes of a bias it cannot read in place (a stride-0 expand, a
    column stride), which the test never sees as a tensor."""
    real = K._cached_launcher

    def cached(cfg):
        launch = real(cfg)

        def call(*args, **kwargs):
            ptr, stride, experts = args[BIAS_ARG], args[BIAS_STRIDE_ARG], args[EXPERTS_ARG]
            if not ptr:
                return launch(*args, **kwargs)
            elem = 2 if cfg.bias_dtype == torch.bfloat16 else 4
            memory = emu.global_memory()
            key = memory.register(ptr, ((experts - 1) * stride + cfg.model_dim) * elem)
            try:
                return launch(*args, **kwargs)
            finally:
                memory.unregister(key)
        return call

    K._cached_launcher = cached
    try:
        yield
    finally:
        K._cached_launcher = real


def run_strict(arch, p, sorting=None, out=None, bias="problem", **kwargs):
    """The kernel on problem p (make_problem) with only p's tensors, out and bias valid memory."""
    ids, sw, eids, nvalid = sorting or p["sorting"]
    bias = p["bias"] if bias == "problem" else bias
    if out is None:
        out = torch.zeros(p["a2"].shape[0] // p["topk"], p["model_dim"], dtype=torch.float32)
    with (only_tensors(p["a2"], p["w2"], p["w2_scale"], ids, sw, eids, nvalid, out, bias), toolchain.target(arch),
          launched_bias_tracked(p["model_dim"])):
        return K.moe_gemm2_a16w4(p["a2"], p["w2"], p["w2_scale"], ids, sw, eids, nvalid, arch=arch, topk=p["topk"],
                                 block_m=p["block_m"], out=out, bias=bias, model_dim=p["model_dim"],
                                 inter_dim=p["inter_dim"], **kwargs)


@pytest.fixture
def kernel_backend(monkeypatch, request):
    """The public API on the FlyDSL kernel for the test's arch (under the emulator)."""
    monkeypatch.setenv("FLYQUANT_BACKEND", "flydsl")
    monkeypatch.setenv("FLYQUANT_ARCH", request.node.callspec.params["arch"])
    monkeypatch.delenv("FLYQUANT_DEBUG", raising=False)


def set_backend(monkeypatch, backend, arch="gfx950"):
    monkeypatch.setenv("FLYQUANT_BACKEND", backend)
    monkeypatch.setenv("FLYQUANT_ARCH", arch)


# ---- sizes past 32 bits ------------------------------------------------------------------------

BIG_MODEL_DIM = BIG_INTER_DIM = 256
BIG_TOKENS = (1 << 31) // BIG_MODEL_DIM + 32  # out has more than 2^31 elements


def _big_out_problem(seed=5):
    """Tokens whose output rows start at and past element 2^31: two 16-row blocks of two experts,
    the first holding the 16 highest tokens, the second token 3, the token at element exactly
    2^31 and the one after it, then padding. a2's rows overlap (row stride 1 element) so that
    every token has its own row in 16 MiB; out (4 GiB) is never touched except at those rows."""
    gen = torch.Generator().manual_seed(seed)
    experts, topk, block_m = 4, 1, 16
    w = torch.randn(experts, BIG_MODEL_DIM, BIG_INTER_DIM, generator=gen)
    packed, scales = quantize_mxfp4(w)
    w2 = layouts.shuffle_weight_a16w4(packed)
    w2_scale = layouts.shuffle_scale_a16w4(scales.reshape(experts * BIG_MODEL_DIM, -1), experts)
    base = torch.randn(BIG_TOKENS + BIG_INTER_DIM, generator=gen).to(torch.bfloat16)
    a2 = base.as_strided((BIG_TOKENS, BIG_INTER_DIM), (1, 1))
    edge = (1 << 31) // BIG_MODEL_DIM
    tokens = list(range(BIG_TOKENS - 16, BIG_TOKENS)) + [3, edge, edge + 1]
    pad = (topk << 24) | BIG_TOKENS
    ids = torch.tensor(tokens + [pad] * 13, dtype=torch.int32)
    weights = torch.rand(32, generator=gen) + 0.25
    weights[19:] = 0
    eids = torch.tensor([1, 3], dtype=torch.int32)
    nvalid = torch.tensor([32, BIG_TOKENS], dtype=torch.int32)
    dense = reference.dequantize_mxfp4(packed, scales).double()
    return dict(a2=a2, w2=w2, w2_scale=w2_scale, sorting=(ids, weights, eids, nvalid), topk=topk, block_m=block_m,
                model_dim=BIG_MODEL_DIM, inter_dim=BIG_INTER_DIM, dense=dense, tokens=tokens)


def _expected_rows(p, rows):
    """(exact float64 result, its FP32-accumulation bound) of sorted rows `rows`, one per token."""
    ids, sw, eids, _ = p["sorting"]
    exact, bound = [], []
    for r in rows:
        t, e = int(ids[r]) & 0xFFFFFF, int(eids[r // p["block_m"]])
        a = p["a2"][t * p["topk"] + (int(ids[r]) >> 24), : p["inter_dim"]].double()
        wt = float(sw[r])
        exact.append(wt * (a @ p["dense"][e].t()))
        bound.append((p["inter_dim"] + 2) * U_F32 * abs(wt) * (a.abs() @ p["dense"][e].abs().t()))
    return torch.stack(exact), torch.stack(bound)


@pytest.mark.parametrize("arch", ARCHS)
def test_output_rows_past_2_31_elements(arch):
    """Finding 2: out[t, n] at element t * model_dim + n >= 2^31 lands in its row (token windows:
    each launch's out rows in one buffer, based on the host in 64 bits; gfx942's bf16 atomics are
    global, at a 64-bit address), and nothing outside out is written. Each token has one contribution, added into zeros: the
    bf16 result is the FP32 sum rounded once."""
    p = _big_out_problem()
    out = torch.empty(BIG_TOKENS, BIG_MODEL_DIM, dtype=torch.bfloat16)  # 4 GiB of address space
    assert out.numel() > 1 << 31
    rows = list(range(19))
    tokens = torch.tensor(p["tokens"])
    out[tokens] = 0
    canary = torch.tensor([BIG_TOKENS - 17, 2, 4, tokens[17] - 1])
    out[canary] = 7
    run_strict(arch, p, out=out, bias=None)
    exact, bound = _expected_rows(p, rows)
    got = out[tokens].double()
    tol = U_BF16 * (exact.abs() + bound) + bound
    assert ((got - exact).abs() <= tol).all(), (got - exact).abs().max()
    assert (out[canary] == 7).all()


def _big_a2_problem(seed=3):
    """The issue's reproducer: a2 of 33000 rows of a 128 KiB stride (4.3 GB of address space, only
    the used rows touched), where the 32-bit row offset of token 32999 wraps to row 231's. Blocks of
    three experts: one with tokens on both sides of the first 4 GiB (the two launches' windows),
    one past it only, one below it only; then padding."""
    gen = torch.Generator().manual_seed(seed)
    experts, topk, block_m, model_dim, inter_dim, rows = 4, 1, 16, 64, 256, 33000
    w = torch.randn(experts, model_dim, inter_dim, generator=gen)
    packed, scales = quantize_mxfp4(w)
    w2 = layouts.shuffle_weight_a16w4(packed)
    w2_scale = layouts.shuffle_scale_a16w4(scales.reshape(experts * model_dim, -1), experts)
    a2 = torch.empty(rows, 65536, dtype=torch.bfloat16)[:, :inter_dim]
    sorting = window_sorting(a2, [(2, WINDOW_TOKENS[0]), (0, WINDOW_TOKENS[1]), (1, WINDOW_TOKENS[2])], block_m, gen)
    dense = reference.dequantize_mxfp4(packed, scales).double()
    used = [r for r in range(sorting[0].numel()) if int(sorting[0][r]) != (topk << 24) | rows]
    return dict(a2=a2, w2=w2, w2_scale=w2_scale, sorting=sorting, topk=topk, block_m=block_m,
                model_dim=model_dim, inter_dim=inter_dim, dense=dense, used=used)


# Token blocks whose rows straddle the 4 GiB a 32-bit offset of a 128 KiB row stride reaches at
# row 32768: one block on both sides, one past it only, one below it only.
WINDOW_TOKENS = ([5, 231, 32767, 32768, 32999], [32998], [0, 7])


def window_sorting(act, blocks, block_m, gen):
    """moe_sorting-shaped arrays (topk 1) of `blocks` [(expert, tokens)], one block_m block each,
    then a block of padding; act's rows of those tokens filled with random bf16 (the others are
    never read). Returns (sorted_ids, sorted_weights, sorted_expert_ids, num_valid_ids)."""
    rows = act.shape[0]
    pad = (1 << 24) | rows
    ids, eids = [], []
    for e, toks in blocks:
        ids += toks + [pad] * (block_m - len(toks))
        eids.append(e)
        act[toks] = torch.randn(len(toks), act.shape[1], generator=gen).to(torch.bfloat16)
    ids = torch.tensor(ids + [pad] * block_m, dtype=torch.int32)
    weights = torch.where(ids == pad, 0.0, torch.rand(ids.numel(), generator=gen) + 0.25)
    return (ids, weights, torch.tensor(eids + [-1], dtype=torch.int32),
            torch.tensor([len(blocks) * block_m, rows], dtype=torch.int32))


@pytest.mark.parametrize("arch", ARCHS)
def test_a2_rows_past_4_gib(arch):
    """Finding 3: a2 spanning more than one 32-bit buffer is computed in token windows, one launch
    each with a2's and out's base at the window (64-bit, on the host): every token gets its own
    row's product (token 32999 got row 231's), nothing outside the tensors is touched."""
    p = _big_a2_problem()
    assert validate.byte_extent(p["a2"])[1] - p["a2"].data_ptr() > 1 << 32
    assert len(K.token_windows(33000, (1, 2 * 256, 2 * 65536), (1, 64 * 4, 64 * 4))) == 3
    out = torch.zeros(33000, 64, dtype=torch.float32)
    run_strict(arch, p, out=out, bias=None)
    ids = p["sorting"][0]
    tokens = torch.tensor([int(ids[r]) & 0xFFFFFF for r in p["used"]])
    exact, bound = _expected_rows(p, p["used"])
    err = (out[tokens].double() - exact).abs()
    assert (err <= U_F32 * (exact.abs() + bound) + bound).all(), err.max()
    untouched = torch.ones(33000, dtype=torch.bool)
    untouched[tokens] = False
    assert (out[untouched] == 0).all()


@pytest.mark.parametrize("arch", ARCHS)
def test_a_32_row_block_whose_window_rows_start_at_row_16(arch):
    """Token windows with 32-row tiles: a block whose rows 0-15 are tokens of the first window and
    rows 16-18 the second window's only tokens in it; each window's launch must find the block
    (its scan looks at all 32 rows, not the first 16)."""
    gen = torch.Generator().manual_seed(21)
    experts, model_dim, inter_dim, rows = 4, 64, 256, 33000
    w = torch.randn(experts, model_dim, inter_dim, generator=gen)
    packed, scales = quantize_mxfp4(w)
    a2 = torch.empty(rows, 65536, dtype=torch.bfloat16)[:, :inter_dim]  # > 4 GiB of address space: windows
    toks = list(range(0, 160, 10)) + [32768, 32800, 32999]
    p = dict(a2=a2, w2=layouts.shuffle_weight_a16w4(packed), topk=1, block_m=32, model_dim=model_dim,
             w2_scale=layouts.shuffle_scale_a16w4(scales.reshape(experts * model_dim, -1), experts),
             inter_dim=inter_dim, sorting=window_sorting(a2, [(2, toks)], 32, gen),
             dense=reference.dequantize_mxfp4(packed, scales).double())
    out = torch.zeros(rows, model_dim, dtype=torch.float32)
    run_strict(arch, p, out=out, bias=None, tile_m=32)
    exact, bound = _expected_rows(p, list(range(len(toks))))
    err = (out[toks].double() - exact).abs()
    assert (err <= U_F32 * (exact.abs() + bound) + bound).all(), err.max(dim=1).values


@pytest.mark.parametrize("arch", ARCHS)
def test_masked_k_chunks_read_zero_in_an_a2_past_2_gib(arch):
    """An a2 of 2.2 GB (one 32-bit buffer would do): the lanes of the K tail past inter_dim load at
    the out-of-range offset OOB (2 GiB - 16), which lies inside a buffer that large, where a2 holds
    NaN here; NaN times the masked weight 0 is NaN. a2 buffers end below OOB (token windows), so
    those loads read 0 and every result is finite and right."""
    gen = torch.Generator().manual_seed(16)
    experts, model_dim, inter_dim, w_k, rows = 2, 64, 224, 256, 17000
    w = torch.randn(experts, model_dim, w_k, generator=gen)
    packed, scales = quantize_mxfp4(w)
    big = torch.empty(rows, 65536, dtype=torch.bfloat16)  # 2.2 GB of address space
    flat = big.view(-1)
    flat[K.OOB // 2 : K.OOB // 2 + 1024] = float("nan")  # what a lane reading at OOB would see
    a2 = big[:, :w_k]
    toks = [0, 5, rows - 1]
    a2[toks] = torch.randn(3, w_k, generator=gen).to(torch.bfloat16)
    a2[toks, inter_dim:] = float("nan")  # past inter_dim: never data
    pad = (1 << 24) | rows
    ids = torch.tensor(toks + [pad] * 13, dtype=torch.int32)
    weights = torch.tensor([0.5, 1.25, 2.0] + [0.0] * 13)
    p = dict(a2=a2, w2=layouts.shuffle_weight_a16w4(packed), topk=1, block_m=16, model_dim=model_dim,
             w2_scale=layouts.shuffle_scale_a16w4(scales.reshape(experts * model_dim, -1), experts),
             inter_dim=inter_dim, sorting=(ids, weights, torch.tensor([1], dtype=torch.int32),
                                           torch.tensor([16, rows], dtype=torch.int32)),
             dense=reference.dequantize_mxfp4(packed, scales).double()[:, :, :inter_dim])
    out = torch.zeros(rows, model_dim, dtype=torch.float32)
    run_strict(arch, p, out=out, bias=None)
    exact, bound = _expected_rows(p, [0, 1, 2])
    err = (out[toks].double() - exact).abs()
    assert (err <= U_F32 * (exact.abs() + bound) + bound).all(), err.max()


# ---- routing values out of range ---------------------------------------------------------------


def _dropped(p, rows):
    """p's sorting with `rows` turned into padding rows (id (topk << 24) | T, weight 0): what the
    device path computes when it drops them."""
    ids, sw, eids, nvalid = (t.clone() for t in p["sorting"])
    ids[rows] = (p["topk"] << 24) | (p["a2"].shape[0] // p["topk"])
    sw[rows] = 0
    return ids, sw, eids, nvalid


@pytest.mark.parametrize("arch", ARCHS)
def test_expert_ids_outside_the_weights_are_dropped(arch):
    """Finding 4: blocks whose expert id is E, negative or huge read nothing of w2 or its scales
    (strict memory) and contribute nothing: the result is the reference's with those blocks'
    rows made padding."""
    p = make_problem(9, 2, 4, 64, 256, 16, seed=4, bias_dtype=torch.float32)
    ids, sw, eids, nvalid = p["sorting"]
    used = int(nvalid[0]) // 16
    assert used >= 3
    bad = eids.clone()
    bad[0], bad[1], bad[2] = 4, -5, 1 << 30
    got = run_strict(arch, p, sorting=(ids, sw, bad, nvalid))
    kept = _dropped(p, list(range(48)))
    check(dict(p, sorting=kept), got, torch.zeros_like(got), torch.float32, 1, True)


@pytest.mark.parametrize("arch", ARCHS)
def test_slots_not_below_topk_are_dropped(arch):
    """Finding 9: a row in use whose slot is topk or more (or negative) reads no other token's a2
    row and contributes nothing on the device."""
    p = make_problem(6, 2, 4, 64, 256, 16, seed=6)
    ids, sw, eids, nvalid = p["sorting"]
    bad = ids.clone()
    bad[0] = (2 << 24) | (bad[0] & 0xFFFFFF)  # slot == topk
    bad[1] = (bad[1] & 0xFFFFFF) | (0x7F << 24)
    bad[2] = (bad[2] & 0xFFFFFF) | -(1 << 31)  # the slot's sign bit
    got = run_strict(arch, p, sorting=(bad, sw, eids, nvalid))
    check(dict(p, sorting=_dropped(p, [0, 1, 2])), got, torch.zeros_like(got), torch.float32, 1, True)


@pytest.mark.parametrize("arch", ARCHS)
def test_negative_valid_row_count_means_no_rows(arch):
    """Finding 9: num_valid_ids[0] < 0 is 0 rows on the device, as in the reference."""
    p = make_problem(5, 2, 4, 64, 256, 16, seed=7)
    ids, sw, eids, _ = p["sorting"]
    nvalid = torch.tensor([-16, 5], dtype=torch.int32)
    got = run_strict(arch, p, sorting=(ids, sw, eids, nvalid))
    assert (got == 0).all()
    ref = reference.moe_gemm2_a16w4(p["a2"], p["w2"], p["w2_scale"], ids, sw, eids, nvalid, 2, 16,
                                    out_dtype=torch.float32, bias=p["bias"])
    assert (ref == 0).all()


@pytest.mark.parametrize("arch", ARCHS)
def test_valid_row_count_past_the_sorted_rows_means_all_rows(arch):
    """num_valid_ids[0] past R (up to 2^31 - 1) is R on the device, nothing past R read."""
    p = make_problem(5, 2, 4, 64, 256, 16, seed=7)
    ids, sw, eids, _ = p["sorting"]
    whole = (ids, sw, eids, torch.tensor([ids.numel(), 5], dtype=torch.int32))
    for count in (ids.numel() + 16, 2**31 - 1):
        got = run_strict(arch, p, sorting=(ids, sw, eids, torch.tensor([count, 5], dtype=torch.int32)))
        check(dict(p, sorting=whole), got, torch.zeros_like(got), torch.float32, 1, True)


@pytest.mark.parametrize("arch", ARCHS)
def test_partial_block_count_drops_the_partial_tile(arch):
    """num_valid_ids[0] not a multiple of block_m (moe_sorting never gives one; the reference and
    FLYQUANT_DEBUG refuse it): the device counts whole tiles below it, so the result is that of the
    count rounded down to a multiple of tile_m (= block_m here), and nothing past is read."""
    p = make_problem(9, 2, 4, 64, 256, 16, seed=17)
    ids, sw, eids, nvalid = p["sorting"]
    assert int(nvalid[0]) >= 48
    got = run_strict(arch, p, sorting=(ids, sw, eids, torch.tensor([40, 9], dtype=torch.int32)), tile_m=16)
    whole = (ids, sw, eids, torch.tensor([32, 9], dtype=torch.int32))
    check(dict(p, sorting=whole), got, torch.zeros_like(got), torch.float32, 1, True)


def _repeat_first_pair(s):
    """The sorting with its last row in use holding row 0's (token, slot) pair (a hand-built
    sorting; moe_sorting never repeats a pair): the kernel's grid counts at most T * topk rows."""
    ids = s[0].clone()
    live = ((ids & 0xFFFFFF) < 9).nonzero().flatten()
    ids[live[live < int(s[3][0])][-1]] = ids[0]
    return (ids, *s[1:])


BAD_VALUES = [
    ("repeated pair", _repeat_first_pair, r"sorted_ids\[\d+\] = 0x[0-9a-f]+ repeats a \(token, slot\) pair"),
    ("expert E", lambda s: (s[0], s[1], torch.where(torch.arange(s[2].numel()) == 0, 4, s[2]).int(), s[3]),
     r"sorted_expert_ids\[0\] = 4 must be in \[0, E"),
    ("expert -1 in use", lambda s: (s[0], s[1], torch.where(torch.arange(s[2].numel()) == 1, -1, s[2]).int(), s[3]),
     r"sorted_expert_ids\[1\] = -1"),
    ("slot topk", lambda s: (torch.where(torch.arange(s[0].numel()) == 0, (2 << 24) | (s[0] & 0xFFFFFF), s[0]).int(),
                             *s[1:]), r"sorted_ids\[0\] .* slot 2"),
    ("partial block", lambda s: (*s[:3], s[3] - torch.tensor([1, 0], dtype=torch.int32)),
     r"num_valid_ids\[0\] = \d+ must be a multiple of block_m = 16"),
]


@pytest.mark.parametrize("case", BAD_VALUES, ids=[c[0] for c in BAD_VALUES])
def test_bad_routing_values_raise_in_the_reference_and_in_debug(case, monkeypatch):
    """Finding 4 and 9 (issue 16's rule): the reference always raises a ValueError naming the
    argument; the kernel path raises the same one under FLYQUANT_DEBUG=1 (a host sync)."""
    _, make, match = case
    p = make_problem(9, 2, 4, 64, 256, 16, seed=4)
    sorting = make(p["sorting"])
    args = (p["a2"], p["w2"], p["w2_scale"], *sorting)
    with pytest.raises(ValueError, match=match):
        reference.moe_gemm2_a16w4(*args, 2, 16)
    set_backend(monkeypatch, "flydsl")
    monkeypatch.setenv("FLYQUANT_DEBUG", "1")
    with pytest.raises(ValueError, match=match):
        fq.moe_gemm2_a16w4(*args, topk=2, block_m=16)


def test_unused_blocks_and_rows_are_not_checked(monkeypatch):
    """Expert id -1 past the blocks in use and padding rows (slot topk, token T) are moe_sorting's
    own output: no error in the reference nor under FLYQUANT_DEBUG=1."""
    p = make_problem(3, 2, 4, 64, 256, 16, seed=8)
    ids, sw, eids, nvalid = p["sorting"]
    assert (eids == -1).any() and (ids >> 24 == 2).any()
    reference.moe_gemm2_a16w4(p["a2"], p["w2"], p["w2_scale"], ids, sw, eids, nvalid, 2, 16)
    set_backend(monkeypatch, "reference")
    monkeypatch.setenv("FLYQUANT_DEBUG", "1")
    fq.moe_gemm2_a16w4(p["a2"], p["w2"], p["w2_scale"], ids, sw, eids, nvalid, topk=2, block_m=16)


# ---- bias layouts ------------------------------------------------------------------------------


@pytest.mark.parametrize("arch", ARCHS)
@pytest.mark.parametrize("layout", ["expand", "column_stride", "wide", "row_view"])
def test_bias_layouts(arch, layout):
    """Finding 5 and 9: a bias shared by the experts (expand, stride 0), with a column stride,
    wider than model_dim (weights padded past it), or a view whose rows lie far apart (the last
    row ends at the tensor's end): right result, no read past the bias."""
    p = make_problem(5, 2, 4, 48, 256, 16, seed=9, w_n=64)
    gen = torch.Generator().manual_seed(1)
    if layout == "expand":
        bias = (8 * torch.randn(1, 48, generator=gen)).to(torch.bfloat16).expand(4, 48)
    elif layout == "column_stride":
        bias = (8 * torch.randn(4, 96, generator=gen))[:, ::2]
    elif layout == "wide":
        bias = (8 * torch.randn(4, 80, generator=gen)).to(torch.bfloat16)
    else:
        bias = (8 * torch.randn(4, 300, generator=gen)).to(torch.bfloat16)[:, 200:248]
    got = run_strict(arch, p, bias=bias)
    check(dict(p, bias=bias), got, torch.zeros_like(got), torch.float32, 1, True)


# ---- outputs and inputs ------------------------------------------------------------------------

BACKENDS = ("reference", "flydsl")


@pytest.mark.parametrize("backend", BACKENDS)
def test_out_overlapping_an_input_is_refused(backend, monkeypatch):
    """Finding 6: out=a2 (topk 1, model_dim == inter_dim), out over the bias, out over part of a2:
    a clear error on both backends, and nothing written."""
    set_backend(monkeypatch, backend)
    p = make_problem(4, 1, 4, 256, 256, 16, seed=10)
    ids, sw, eids, nvalid = p["sorting"]
    a2 = p["a2"]
    before = a2.clone()
    args = (p["w2"], p["w2_scale"], ids, sw, eids, nvalid)
    with pytest.raises(ValueError, match="out must not overlap the input a2"):
        fq.moe_gemm2_a16w4(a2, *args, topk=1, block_m=16, out=a2)
    store = torch.zeros(2 * 4 * 256, dtype=torch.bfloat16)
    with pytest.raises(ValueError, match="out must not overlap the input bias"):
        fq.moe_gemm2_a16w4(a2, *args, topk=1, block_m=16, out=store[:1024].view(4, 256), bias=store[512:1536].view(4, 256))
    big = torch.zeros(8, 256, dtype=torch.bfloat16)
    big[2:6] = a2
    with pytest.raises(ValueError, match="out must not overlap the input a2"):
        fq.moe_gemm2_a16w4(big[2:6], *args, topk=1, block_m=16, out=big[4:8])
    assert torch.equal(a2, before)
    # adjacent, not overlapping: accepted
    with only_tensors(big, *args):
        fq.moe_gemm2_a16w4(big[:4], *args, topk=1, block_m=16, out=big[4:8])


@pytest.mark.parametrize("backend", BACKENDS)
def test_inputs_requiring_grad_are_refused(backend, monkeypatch):
    """Finding 8: no backward exists, so a2 (or sorted_weights, bias) requiring grad is a clear
    error on both backends instead of an output silently cut from the graph; under no_grad it runs."""
    set_backend(monkeypatch, backend)
    p = make_problem(3, 2, 4, 64, 256, 16, seed=11)
    ids, sw, eids, nvalid = p["sorting"]
    a2 = p["a2"].clone().requires_grad_()
    with pytest.raises(ValueError, match="moe_gemm2_a16w4 does not support autograd: a2 requires grad; detach a2"):
        fq.moe_gemm2_a16w4(a2, p["w2"], p["w2_scale"], ids, sw, eids, nvalid, topk=2, block_m=16)
    with pytest.raises(ValueError, match="sorted_weights requires grad"):
        fq.moe_gemm2_a16w4(p["a2"], p["w2"], p["w2_scale"], ids, sw.clone().requires_grad_(), eids, nvalid, topk=2,
                           block_m=16)
    topk_weights = torch.rand(3, 2, requires_grad=True)  # named as given (it was 'sorted_weights', moe_sorting's)
    with pytest.raises(ValueError, match="moe_stage2 does not support autograd: topk_weights requires grad"):
        fq.moe_stage2(p["a2"], torch.zeros(3, 2, dtype=torch.int32) + torch.tensor([0, 1], dtype=torch.int32),
                      topk_weights, p["w2"], p["w2_scale"])
    out = torch.zeros(3, 64, dtype=torch.bfloat16)
    with torch.no_grad(), only_tensors(a2, out, p["w2"], p["w2_scale"], *p["sorting"]):
        fq.moe_gemm2_a16w4(a2, p["w2"], p["w2_scale"], ids, sw, eids, nvalid, topk=2, block_m=16, out=out)
    assert not out.requires_grad and out.abs().sum() > 0


@pytest.mark.parametrize("backend", BACKENDS)
def test_bf16_out_at_an_odd_element_offset_is_refused(backend, monkeypatch):
    """Finding 9: the kernel adds bf16 column pairs with 4-byte atomics, so out must start 4-byte
    aligned; both backends refuse an odd element offset (fp32 outputs are always aligned)."""
    set_backend(monkeypatch, backend)
    p = make_problem(3, 2, 4, 64, 256, 16, seed=12)
    out = torch.zeros(3 * 64 + 1, dtype=torch.bfloat16)[1:].view(3, 64)
    with pytest.raises(ValueError, match="out must start at a 4-byte aligned address"):
        fq.moe_gemm2_a16w4(p["a2"], p["w2"], p["w2_scale"], *p["sorting"], topk=2, block_m=16, out=out)


@pytest.mark.parametrize("arch", ARCHS)
def test_empty_batch_gives_an_empty_output(arch, kernel_backend, monkeypatch):
    """Finding 11: an expert-parallel rank with no tokens gets a (0, model_dim) output from
    moe_stage2 and moe_gemm2_a16w4, on the kernel path and the reference path alike."""
    p = make_problem(2, 2, 4, 64, 256, 16, seed=13)
    a2 = p["a2"][:0]
    ids = torch.zeros(0, 2, dtype=torch.int32)
    for backend in BACKENDS:
        monkeypatch.setenv("FLYQUANT_BACKEND", backend)
        out = fq.moe_stage2(a2, ids, torch.zeros(0, 2), p["w2"], p["w2_scale"])
        assert out.shape == (0, 64) and out.dtype == torch.bfloat16
        sorting = fq.moe_sorting(ids, torch.zeros(0, 2), 4, 16)
        out = fq.moe_gemm2_a16w4(a2, p["w2"], p["w2_scale"], *sorting, topk=2, block_m=16, out_dtype=torch.float32)
        assert out.shape == (0, 64)


def test_zero_experts_and_huge_sorting_are_clear_errors():
    """Finding 11: experts=0 would divide by zero in the block-size choice; a sorting of 2^30 rows
    or more is refused before its outputs are allocated (16 GiB / 16 TiB before)."""
    with pytest.raises(ValueError, match="experts must be an int >= 1, got 0"):
        fq.moe_block_m(4, 2, 0, 64, 256)
    with pytest.raises(ValueError, match="experts must be an int >= 1, got 0"):
        fq.warmup(model_dim=64, inter_dim=256, experts=0, topk=1)
    ids, weights = torch.zeros(2, 2, dtype=torch.int32), torch.ones(2, 2)
    for experts, block_m in ((1 << 31, 16), (4, 1 << 40)):
        with pytest.raises(ValueError, match="sorted rows must be at most"):
            fq.moe_sorting(ids, weights, experts, block_m)


@pytest.mark.parametrize("arch", ARCHS)
def test_non_contiguous_inputs_and_out_work_on_the_kernel_path(arch, monkeypatch):
    """Finding 11 (backends agree): a2 with a column stride, non-contiguous weights, scales and
    sorted arrays, and an out with transposed strides give the kernel path the reference's result
    (the launcher copies them into its layout; out gets the sum back), as the reference takes them.
    The copies are the launcher's own tensors: the suite's launch tracking covers them."""
    set_backend(monkeypatch, "flydsl", arch)
    p = make_problem(5, 2, 4, 64, 256, 16, seed=14, bias_dtype=torch.float32)
    ids, sw, eids, nvalid = p["sorting"]

    def strided(t):
        """The same values in a view with a gap after every element of the last dim."""
        wide = torch.zeros(*t.shape[:-1], 2 * t.shape[-1], dtype=t.dtype)
        wide[..., ::2] = t
        return wide[..., ::2]

    args = [strided(t) for t in (p["a2"], p["w2"], p["w2_scale"], ids, sw, eids, nvalid)]
    assert not any(t.is_contiguous() for t in args)
    base = torch.randn(5, 64, generator=torch.Generator().manual_seed(2))
    out = base.t().contiguous().t()
    assert not out.is_contiguous()
    fq.moe_gemm2_a16w4(*args, topk=2, block_m=16, out=out, bias=p["bias"])
    check(p, out, base, torch.float32, 1, True)


def test_torch_compile_traces_the_checks_with_out_and_bias(monkeypatch):
    """The address checks (alignment, overlap) run inside the op on real tensors, so torch.compile
    still traces a call with out= and bias= without graph breaks, and an aliasing out is still
    refused in the compiled call."""
    set_backend(monkeypatch, "reference")
    p = make_problem(3, 2, 4, 64, 256, 16, seed=15)
    bias = torch.randn(4, 64, generator=torch.Generator().manual_seed(3))

    def step(a2, out):
        return fq.moe_gemm2_a16w4(a2, p["w2"], p["w2_scale"], *p["sorting"], topk=2, block_m=16, out=out, bias=bias)

    compiled = torch.compile(step, fullgraph=True, backend="eager")
    torch.testing.assert_close(compiled(p["a2"], torch.zeros(3, 64)), step(p["a2"], torch.zeros(3, 64)))
    with pytest.raises(ValueError, match="out must not overlap the input bias"):
        compiled(p["a2"], bias[1:])


@pytest.mark.parametrize("backend", BACKENDS)
def test_bool_sizes_are_refused(backend, monkeypatch):
    """A bool is an int to Python: topk=True, block_m=True, k_batch=True or waves=True passed as 1
    before; every entry point that takes them refuses it, on both backends."""
    set_backend(monkeypatch, backend)
    p = make_problem(3, 2, 4, 64, 256, 16, seed=14)
    ids, weights = torch.zeros(3, 2, dtype=torch.int32) + torch.tensor([0, 1], dtype=torch.int32), torch.ones(3, 2)
    gemm2 = lambda **kw: fq.moe_gemm2_a16w4(p["a2"], p["w2"], p["w2_scale"], *p["sorting"],  # noqa: E731
                                           **({"topk": 2, "block_m": 16} | kw))
    for call, name in ((lambda: gemm2(topk=True), "topk"), (lambda: gemm2(block_m=True), "block_m"),
                       (lambda: fq.moe_sorting(ids, weights, True, 16), "num_experts"),
                       (lambda: fq.moe_sorting(ids, weights, 4, True), "block_m"),
                       (lambda: fq.moe_routing(torch.randn(3, 4), True), "topk")):
        with pytest.raises(ValueError, match=f"{name} must be"):
            call()
    if backend == "flydsl":
        for kw, name in ((dict(k_batch=True), "k_batch"), (dict(waves=True), "waves")):
            with pytest.raises(ValueError, match=f"{name} must be"):
                K.moe_gemm2_a16w4(p["a2"], p["w2"], p["w2_scale"], *p["sorting"], arch="gfx950", topk=2,
                                  block_m=16, **kw)
