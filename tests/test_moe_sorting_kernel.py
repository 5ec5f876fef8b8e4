"""The moe_sorting FlyDSL kernel (kernels/moe_sorting.py), executed under flyquant.emu for gfx950
and gfx942: every output bit-identical to flyquant.reference.moe_sorting, under strict memory
with every tensor of the call (outputs included) tracked, so an access outside any of them fails
the test. Plus compile checks, the launcher's refusals, and fq.moe_sorting on the kernel path
(one launch, no device work but the output allocations, ids checked only with FLYQUANT_DEBUG=1).

Dropped pairs. The kernel drops a pair whose id is outside [0, E); the reference refuses such
input. The expected result is the reference on the same routing with those ids replaced by an
extra expert E that the mask leaves out: a masked-out expert's pairs are dropped, it is the last
expert (local ids of the others unchanged), and the E + 1 worst-case arrays only add padding rows
and -1 blocks at their end (rows in use <= P + E * (block_m - 1) <= the E-expert length, as
topk <= E), so the E-expert outputs are their prefixes.
"""

from __future__ import annotations

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

import flyquant as fq
import flyquant.emu as emu
from flyquant import api_moe, toolchain
from flyquant.kernels import moe_sorting as K
from flyquant.moe import moe_sorting as reference

ARCHS = ("gfx950", "gfx942")


def routing(tokens, topk, experts, seed, skew=False, repeats=False, skip=None):
    """Distinct experts per token (as a top-k router gives). skew: half the tokens pick experts
    0..topk-1 (uneven counts, several blocks for one expert); repeats: some tokens route two
    slots to one expert (allowed by the contract: slot order then decides); skip: an expert no
    token picks (an expert with no tokens)."""
    gen = torch.Generator().manual_seed(seed)
    pool = torch.tensor([e for e in range(experts) if e != skip])
    ids = torch.stack([pool[torch.randperm(len(pool), generator=gen)[:topk]] for _ in range(tokens)])
    if skew:
        ids[: tokens // 2] = pool[:topk]
    if repeats and topk > 1:
        ids[::3, 1] = ids[::3, 0]
    weights = torch.rand(tokens, topk, generator=gen)
    return ids.to(torch.int32), weights


def run_kernel(arch, ids, weights, experts, block_m, mask=None, moe_buf=None, waves=None):
    """The kernel with every tensor tracked and strict memory on (outputs pre-filled with junk, so
    an element the kernel failed to write shows)."""
    rows, blocks = K.sorted_shapes(*ids.shape, experts, block_m)
    out = (torch.full((rows,), 0x5A5A5A5A, dtype=torch.int32), torch.full((rows,), float("nan")),
           torch.full((blocks,), 0x5A5A5A5A, dtype=torch.int32), torch.full((2,), -7, dtype=torch.int32))
    tensors = [t for t in (ids, weights, mask, moe_buf, *out) if t is not None]
    emu.track(*tensors)
    with emu.strict_memory(), emu.record() as launches:
        got = K.moe_sorting(ids, weights, experts, block_m, mask, arch=arch, moe_buf=moe_buf, out=out, waves=waves)
    assert len(launches) == 1 and all(g is o for g, o in zip(got, out))
    return got, launches[0]


def assert_identical(got, expected):
    """Every element equal, weights on their bits (-0.0, subnormals), except that a NaN weight need
    only be NaN: an FP16 NaN's FP32 payload is the converter's (torch's CPU conversion sets every
    mantissa bit, the hardware's v_cvt_f32_f16 keeps the payload); test_weights_keep_their_bits
    checks the bits the kernel moves unconverted."""
    names = ("sorted_ids", "sorted_weights", "sorted_expert_ids", "num_valid_ids")
    for name, g, e in zip(names, got, expected):
        assert g.dtype == e.dtype and g.shape == e.shape, (name, g.dtype, e.dtype, g.shape, e.shape)
        both_nan = torch.zeros(g.shape, dtype=torch.bool)
        if g.dtype == torch.float32:
            both_nan = g.isnan() & e.isnan()
            g, e = g.view(torch.int32), e.view(torch.int32)
        bad = ((g != e) & ~both_nan).nonzero().flatten()
        assert bad.numel() == 0, f"{name}: {bad.numel()} differ, first at {bad[:8].tolist()}: {g[bad[:8]].tolist()} vs {e[bad[:8]].tolist()}"


def expected_dropping(ids, weights, experts, block_m, mask=None):
    """The reference with out-of-range ids routed to an extra masked-out expert (module doc)."""
    ids_ext = ids.to(torch.int64).clone()
    ids_ext[(ids_ext < 0) | (ids_ext >= experts)] = experts
    served = torch.ones(experts, dtype=torch.bool) if mask is None else mask != 0
    full = reference(ids_ext, weights, experts + 1, block_m, torch.cat([served, torch.tensor([False])]))
    rows, blocks = K.sorted_shapes(*ids.shape, experts, block_m)
    return full[0][:rows], full[1][:rows], full[2][:blocks], full[3]


# (T, topk, E, block_m, waves): T 1 / 3 / 17 / 130 x topk 1 / 4 / 8 x E 1 / 8 / 128 x block_m 16 / 32 / 64;
# waves None = the launcher's choice (1 wave up to 1023 pairs), 4 and 8 split the pairs over waves
# in slices (130 x 8 = 1040 pairs: 4 waves of 260; 17 x 4 over 8 waves: most slices empty); one
# wave's 65 pairs (a last round of one pair); 254 x 1 over 2 experts in blocks of 2: 257 rows, one
# past the fill loop's whole chunks of 4 rows per lane (the last row padding only)
CASES = [
    (1, 1, 1, 16, None),  # one pair, one expert
    (1, 4, 128, 16, None),  # decode: 4 blocks in use of 128 + padding
    (3, 1, 8, 64, None),
    (3, 4, 8, 32, None),
    (17, 8, 8, 16, None),  # every expert, several blocks each
    (17, 4, 128, 64, 8),
    (130, 1, 1, 32, None),  # all pairs on one expert: 5 blocks
    (130, 4, 128, 32, None),
    (130, 8, 128, 16, 4),
    (130, 8, 8, 64, 8),
    (65, 1, 8, 16, 1),
    (254, 1, 2, 2, 1),
    (3, 1, 1, 1, None),  # topk == E, block_m 1: every row a pair's, the last pair on the last row
]


@pytest.mark.parametrize("arch", ARCHS)
@pytest.mark.parametrize("case", CASES, ids=[f"T{c[0]}-k{c[1]}-E{c[2]}-m{c[3]}-w{c[4]}" for c in CASES])
@pytest.mark.parametrize("masked", [False, True], ids=["all", "masked"])
def test_bit_identical_to_reference(arch, case, masked):
    tokens, topk, experts, block_m, waves = case
    ids, weights = routing(tokens, topk, experts, seed=tokens * 131 + experts, skew=tokens > 3,
                           repeats=tokens > 3, skip=1 if experts > topk else None)
    mask = None
    if masked:
        mask = torch.arange(experts) % 3 != 1  # serve two experts in three
        mask[0] = True
    got, _ = run_kernel(arch, ids, weights, experts, block_m, mask, waves=waves)
    assert_identical(got, reference(ids, weights, experts, block_m, mask))


# the kernel's largest expert count (11 key bits, 17 keys per lane with one wave) with a block
# size that is no power of two; 1000 experts and block_m 1 (every pair its own block) over 8 waves
WIDE_CASES = [(300, 8, 1024, 7, None), (200, 6, 1000, 1, 8)]


@pytest.mark.parametrize("arch", ARCHS)
@pytest.mark.parametrize("case", WIDE_CASES, ids=[f"T{c[0]}-k{c[1]}-E{c[2]}-m{c[3]}-w{c[4]}" for c in WIDE_CASES])
def test_many_experts_and_odd_block_sizes(arch, case):
    tokens, topk, experts, block_m, waves = case
    ids, weights = routing(tokens, topk, experts, seed=experts + block_m, skew=True)
    mask = torch.rand(experts, generator=torch.Generator().manual_seed(1)) > 0.3
    got, _ = run_kernel(arch, ids, weights, experts, block_m, mask, waves=waves)
    assert_identical(got, reference(ids, weights, experts, block_m, mask))


@pytest.mark.parametrize("arch", ARCHS)
def test_the_largest_expert_count_with_every_expert_served(arch):
    """E = 1024 with no mask (1024 served experts: a count needing all of the scan's served bits),
    the last expert routed."""
    ids, weights = routing(40, 8, 1024, seed=21)
    ids[0, 0] = ids[-1, -1] = 1023
    got, _ = run_kernel(arch, ids, weights, 1024, 16)
    want = reference(ids, weights, 1024, 16)
    assert 1023 in want[2].tolist()
    assert_identical(got, want)


@pytest.mark.parametrize("arch", ARCHS)
@pytest.mark.parametrize("waves", [1, 4])
def test_out_of_range_ids_are_dropped(arch, waves):
    """ids E, E + 1000, -1 and INT32_MIN (int32) / 2^32 + 1 and -2^40 (int64: a low dword in range)
    contribute nothing, and nothing outside the tensors is touched (strict memory)."""
    tokens, topk, experts, block_m = 17, 4, 8, 16
    ids, weights = routing(tokens, topk, experts, seed=3, skew=True)
    ids[0, 0], ids[2, 3], ids[5, 1], ids[16, 2] = experts, experts + 1000, -1, -(2**31)
    mask = torch.ones(experts, dtype=torch.int32)
    mask[5] = 0
    got, _ = run_kernel(arch, ids, weights, experts, block_m, mask, waves=waves)
    assert_identical(got, expected_dropping(ids, weights, experts, block_m, mask))
    ids64 = ids.to(torch.int64)
    ids64[3, 0], ids64[4, 2] = 2**32 + 1, -(2**40)
    got, _ = run_kernel(arch, ids64, weights, experts, block_m, waves=waves)
    assert_identical(got, expected_dropping(ids64, weights, experts, block_m))


@pytest.mark.parametrize("arch", ARCHS)
def test_every_id_out_of_range(arch):
    """No pair left: no rows in use, every row padding, every block -1."""
    ids = torch.full((3, 2), 9, dtype=torch.int32)
    weights = torch.rand(3, 2)
    got, _ = run_kernel(arch, ids, weights, 4, 16)
    assert got[3].tolist() == [0, 3]
    assert_identical(got, expected_dropping(ids, weights, 4, 16))


# id, weight and mask dtypes the kernel reads itself (no conversion on the host)
DTYPE_CASES = [
    (torch.int64, torch.bfloat16, torch.bool),
    (torch.int32, torch.float16, torch.uint8),
    (torch.int64, torch.float32, torch.int64),
    (torch.int32, torch.bfloat16, torch.int16),
]


@pytest.mark.parametrize("arch", ARCHS)
@pytest.mark.parametrize("id_dtype,weight_dtype,mask_dtype", DTYPE_CASES)
def test_input_dtypes(arch, id_dtype, weight_dtype, mask_dtype):
    ids, weights = routing(9, 4, 16, seed=11, skew=True)
    ids, weights = ids.to(id_dtype), weights.to(weight_dtype)
    weights[0, 0] = -0.0  # its bits must survive the f32 conversion
    tiny = torch.finfo(weight_dtype).tiny
    weights[1] = torch.tensor([tiny / 4, -tiny / 2, tiny / 8, tiny])  # subnormals: not flushed to zero
    mask = torch.zeros(16, dtype=mask_dtype)
    mask[::2] = 1
    mask[3] = 1
    assert (mask[ids[1].long()] != 0).sum() >= 2  # some of the subnormal weights are kept
    got, _ = run_kernel(arch, ids, weights, 16, 32, mask)
    assert_identical(got, reference(ids, weights, 16, 32, mask))


def weights_by_pair(got, tokens, topk):
    """The sorted weights put back at their (token, slot) places, as FP32 (the padding rows left out)."""
    rows = (got[0] & 0xFFFFFF) < tokens
    out = torch.full((tokens, topk), 7.0)
    out[(got[0][rows] & 0xFFFFFF).long(), (got[0][rows] >> 24).long()] = got[1][rows]
    return out


@pytest.mark.parametrize("arch", ARCHS)
def test_weights_keep_their_bits(arch):
    """FP32 weights are moved, BF16 ones widened by a shift: NaN payloads and signs, -0.0 and
    subnormals come out bit for bit; an FP16 NaN stays a NaN of its sign, the rest exact."""
    ids = torch.tensor([[0, 1], [1, 0], [0, 1]], dtype=torch.int32)
    f32_bits = torch.tensor([0x7FA00001, 0xFFC00123, 0x80000000, 0x00000001, 0x80400000, 0x3F800000]).to(torch.int32)
    bf16_bits = torch.tensor([0x7F81, 0xFFC3, 0x8000, 0x0001, 0x8040, 0x3F80]).to(torch.int16)
    for weights, bits in ((f32_bits.view(torch.float32), f32_bits), (bf16_bits.view(torch.bfloat16), bf16_bits.to(torch.int32) << 16)):
        got, _ = run_kernel(arch, ids, weights.view(3, 2), 2, 4)
        assert torch.equal(weights_by_pair(got, 3, 2).view(torch.int32).flatten(), bits)
    f16 = torch.tensor([float("nan"), -float("nan"), -0.0, 2.0**-24, -(2.0**-20), 1.0], dtype=torch.float16)
    got, _ = run_kernel(arch, ids, f16.view(3, 2), 2, 4)
    w, nan = weights_by_pair(got, 3, 2).flatten(), f16.isnan()
    assert torch.equal(w.isnan(), nan) and torch.equal(w.signbit(), f16.signbit())
    assert torch.equal(w[~nan].view(torch.int32), f16[~nan].float().view(torch.int32))


# a nonzero mask element whose low byte (and, for int64, low word) is zero still serves its expert
WIDE_MASK_VALUES = [(torch.int16, 0x100), (torch.int16, -(2**15)), (torch.int32, 0x10000), (torch.int32, 1 << 24),
                    (torch.int64, 1 << 32), (torch.int64, -(2**63))]


@pytest.mark.parametrize("arch", ARCHS)
@pytest.mark.parametrize("mask_dtype,value", WIDE_MASK_VALUES, ids=[f"{d}-{v:#x}" for d, v in WIDE_MASK_VALUES])
def test_mask_reads_whole_elements(arch, mask_dtype, value):
    ids, weights = routing(9, 4, 16, seed=12, skew=True)
    mask = torch.zeros(16, dtype=mask_dtype)
    mask[::2] = value
    mask[5] = 1
    got, _ = run_kernel(arch, ids, weights, 16, 32, mask)
    expected = reference(ids, weights, 16, 32, mask != 0)
    assert expected[3][0] > 32  # the wide-valued experts hold pairs: dropping them would show
    assert_identical(got, expected)


@pytest.mark.parametrize("arch", ARCHS)
@pytest.mark.parametrize("width", [2880, 2878])
def test_zeroes_moe_buf_in_the_same_launch(arch, width):
    """moe_buf (a bf16 (T, 2880) stage-2 output, 4 zeroing workgroups of 8 KiB with a partial last
    one; 2878 wide: 28780 bytes, so the last lane's 16-byte store holds 12 bytes of moe_buf) is
    zeroed up to its last byte and not one byte past it: it is the head of a larger tensor whose
    tail must keep its canary."""
    ids, weights = routing(5, 4, 8, seed=2)
    big = torch.full((5 * width + 64,), 3.0, dtype=torch.bfloat16)
    moe_buf = big[: 5 * width].view(5, width)
    got, launch = run_kernel(arch, ids, weights, 8, 16, moe_buf=moe_buf)
    assert launch.stats.workgroups_launched == 1 + 4  # 28800 (28780) bytes in 8 KiB per workgroup
    assert_identical(got, reference(ids, weights, 8, 16))
    assert (moe_buf == 0).all()
    assert (big[5 * width:] == 3.0).all()


@pytest.mark.parametrize("arch", ARCHS)
def test_largest_launch(arch):
    """MAX_PAIRS routed pairs would take long under the emulator; over 2^16 (the issue's 64k) in
    one launch of 8 waves, skewed so that one expert holds half the pairs; more than 2^16 tokens,
    so a token index that lost its high bits (a 16-bit field) would show."""
    ids, weights = routing(65600, 1, 128, seed=7, skew=True)
    got, launch = run_kernel(arch, ids, weights, 128, 32)
    assert launch.stats.waves_per_workgroup == 8
    assert_identical(got, reference(ids, weights, 128, 32))


def test_launcher_refusals():
    ids, weights = routing(4, 2, 8, seed=1)
    with pytest.raises(ValueError, match=r"num_experts must be an int in \[1, 1024\]"):
        K.moe_sorting(ids, weights, 2000, 16, arch="gfx950")
    with pytest.raises(ValueError, match=r"block_m must be an int in \[1, 1024\]"):
        K.moe_sorting(ids, weights, 8, 0, arch="gfx950")
    with pytest.raises(ValueError, match="routed pairs: one sorting launch takes at most"):
        many = torch.zeros(K.MAX_PAIRS // 2 + 1, 2, dtype=torch.int32)
        K.moe_sorting(many, torch.zeros(many.shape), 8, 16, arch="gfx950")
    with pytest.raises(TypeError, match="expert_mask must have dtype"):
        K.moe_sorting(ids, weights, 8, 16, torch.ones(8), arch="gfx950")
    with pytest.raises(ValueError, match="topk_ids must be contiguous"):
        K.moe_sorting(ids.t().contiguous().t(), weights, 8, 16, arch="gfx950")
    with pytest.raises(ValueError, match="moe_buf must span a multiple of 4 bytes"):
        K.moe_sorting(ids, weights, 8, 16, arch="gfx950", moe_buf=torch.zeros(3, dtype=torch.bfloat16))
    with pytest.raises(ValueError, match="sorted_ids must have shape"):
        K.moe_sorting(ids, weights, 8, 16, arch="gfx950", out=(torch.zeros(5, dtype=torch.int32),) * 4)


def test_wave_choice_fits_the_lds():
    assert K.choose_waves(4, 128, "gfx942") == 1
    assert K.choose_waves(2048, 128, "gfx942") == 4
    assert K.choose_waves(1 << 16, 128, "gfx942") == 8
    # 8 waves with 1024 experts need 55 KiB of LDS: above the budget, so 4
    assert K.SortSpec("gfx942", 1024, 8, 32, 4, "f32", 0, 8).lds_bytes > K.LDS_BUDGET
    assert K.choose_waves(1 << 16, 1024, "gfx942") == 4


# compile checks: the largest expert count with each wave count, int64 ids, bf16 weights, a mask
COMPILE_CASES = [(arch, waves) for arch in ARCHS for waves in K.WAVE_COUNTS]


@pytest.mark.parametrize("arch,waves", COMPILE_CASES)
def test_compiles_without_spills(arch, waves):
    experts = K.MAX_EXPERTS if waves < 8 else 256
    spec = K.SortSpec(arch, experts, 8, 32, 8, "bf16", 1, waves)
    z = lambda *shape, dtype=torch.int32: torch.zeros(*shape, dtype=dtype)  # noqa: E731  (shapes only)
    (rep,) = toolchain.compile_only(
        arch, K.build_moe_sorting(spec), z(4, 8, dtype=torch.int64), z(4, 8, dtype=torch.bfloat16),
        z(experts, dtype=torch.uint8), z(64), z(64, dtype=torch.float32), z(4), z(2), z(16, dtype=torch.uint8),
        4, 0, 1, stream=0,
    )
    assert rep.name == spec.name
    assert rep.spills == 0
    assert rep.lds_bytes == spec.lds_bytes <= K.LDS_BUDGET
    assert rep.vgprs <= 64  # room for 8 waves per SIMD: the sort is latency-bound, not register-bound
    assert rep.count("ds_add_u32") > 0 and rep.count("v_bcnt_u32_b32") > 0
    assert rep.count("buffer_store_dwordx4") > 0  # padding rows and moe_buf zeroing, 16 bytes per lane
    assert "ocml" not in rep.isa


# ------------------------------------------------------------------------------------------------
# fq.moe_sorting: the selector routes CPU tensors under the emulator to the kernel
# ------------------------------------------------------------------------------------------------


class AtenOps(TorchDispatchMode):
    """The aten ops a block runs (a custom op shows as itself: its body is traced by calling the
    op's Python function directly)."""

    def __init__(self):
        super().__init__()
        self.ops = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.ops.append(str(func))
        return func(*args, **(kwargs or {}))


@pytest.mark.parametrize("arch", ARCHS)
def test_api_runs_one_launch_and_no_device_work_besides_allocation(arch, monkeypatch):
    """fq.moe_sorting on the kernel path: one launch (the sort and moe_buf's zeroing), and the op's
    body runs no aten op but the four output allocations (no host synchronisation, no
    `_local_scalar_dense`); the reference's body reads the ids (a host sync), so the check can fail."""
    monkeypatch.setenv("FLYQUANT_ARCH", arch)
    ids, weights = routing(6, 4, 16, seed=5, skew=True)
    moe_buf = torch.ones(6, 256, dtype=torch.bfloat16)
    plan = fq.explain(fq.moe_sorting, ids, weights, 16, 32)
    assert plan.backend == "flydsl" and plan.arch == arch and plan.kernel.startswith("moe_sorting_e16_k4_m32")
    with emu.record() as launches, AtenOps() as seen:
        got = fq.moe_sorting(ids, weights, 16, 32, moe_buf=moe_buf)
    assert [str(op) for op in seen.ops] == ["flyquant.moe_sorting.default"]
    assert len(launches) == 1 and launches[0].kernel == plan.kernel
    assert_identical(got, reference(ids, weights, 16, 32))
    assert (moe_buf == 0).all()
    with AtenOps() as body:
        api_moe._moe_sorting_op._init_fn(ids, weights, 16, 32, None, None)
    assert body.ops == ["aten.empty.memory_format"] * 4
    monkeypatch.setenv("FLYQUANT_BACKEND", "reference")
    with AtenOps() as body:
        api_moe._moe_sorting_op._init_fn(ids, weights, 16, 32, None, None)
    assert "aten._local_scalar_dense.default" in body.ops


def test_api_drops_out_of_range_ids_unless_debugging(monkeypatch):
    ids, weights = routing(9, 2, 8, seed=4)
    ids[3, 1] = 8
    ids[7, 0] = -3
    mask = torch.ones(8, dtype=torch.float32)  # a float mask: compared with 0 on the host
    mask[2] = -0.0
    assert_identical(fq.moe_sorting(ids, weights, 8, 16, mask), expected_dropping(ids, weights, 8, 16, mask))
    monkeypatch.setenv("FLYQUANT_DEBUG", "1")
    with pytest.raises(ValueError, match=r"topk_ids must lie in \[0, num_experts = 8\), got \[-3, 8\]"):
        fq.moe_sorting(ids, weights, 8, 16, mask)


def test_api_takes_non_contiguous_inputs_and_refuses_an_overlapping_moe_buf():
    ids, weights = routing(7, 4, 8, seed=6)
    ids_t, weights_t = ids.t().contiguous().t(), weights.t().contiguous().t()
    assert_identical(fq.moe_sorting(ids_t, weights_t, 8, 16), reference(ids, weights, 8, 16))
    with pytest.raises(ValueError, match="moe_buf must not overlap the input topk_weights"):
        fq.moe_sorting(ids, weights, 8, 16, moe_buf=weights)


def test_api_falls_back_to_the_reference_above_the_kernel_limits():
    ids, weights = routing(3, 2, 8, seed=8)
    plan = fq.explain(fq.moe_sorting, ids, weights, 8, K.MAX_BLOCK_M + 1)
    assert plan.backend == "reference" and any("block_m" in r for r in plan.reasons)
    assert_identical(fq.moe_sorting(ids, weights, 8, 2048), reference(ids, weights, 8, 2048))


def test_moe_buf_limit_is_exclusive(monkeypatch):
    """moe_buf's byte offsets are non-negative i32: a buffer of exactly MAX_MOE_BUF_BYTES is refused."""
    monkeypatch.setattr(K, "MAX_MOE_BUF_BYTES", 64)
    ids = torch.zeros(4, 2, dtype=torch.int32)
    ids[:, 1] = 1
    with pytest.raises(ValueError, match="moe_buf must span a multiple of 4 bytes below 64"):
        K.moe_sorting(ids, torch.ones(4, 2), 8, 16, arch="gfx950", moe_buf=torch.zeros(32, dtype=torch.bfloat16))
