"""moe_sorting against aiter's contract, written here as the plain per-expert loop of aiter's
native reference (op_tests/test_moe_sorting.py) with its undefined parts (padding rows' weights,
the unused tail) defined as DESIGN.md states."""

import pytest
import torch

from flyquant.moe import moe_sorting


def sorting_by_loop(topk_ids, topk_weights, num_experts, block_m, expert_mask=None):
    tokens, topk = topk_ids.shape
    rows = tokens * topk + num_experts * block_m - topk
    pad_id = (topk << 24) | tokens
    ids, weights = [pad_id] * rows, [0.0] * rows
    expert_ids = [-1] * ((rows + block_m - 1) // block_m)
    row = block = local = 0
    for e in range(num_experts):
        if expert_mask is not None and not expert_mask[e]:
            continue
        pairs = [(t, k) for t in range(tokens) for k in range(topk) if topk_ids[t, k] == e]
        for i, (t, k) in enumerate(pairs):
            ids[row + i] = (k << 24) | t
            weights[row + i] = topk_weights[t, k].item()
        n_blocks = (len(pairs) + block_m - 1) // block_m
        expert_ids[block:block + n_blocks] = [local] * n_blocks
        row, block, local = row + n_blocks * block_m, block + n_blocks, local + 1
    return ids, weights, expert_ids, [row, tokens]


def random_routing(tokens, topk, num_experts, seed, skew=False, repeats=False):
    """Distinct experts per token (as a top-k router gives); skew: most tokens pick experts 0..topk-1;
    repeats: every other token routes its last slot to its first slot's expert (slot order decides)."""
    gen = torch.Generator().manual_seed(seed)
    ids = torch.stack([torch.randperm(num_experts, generator=gen)[:topk] for _ in range(tokens)])
    if skew:
        ids[: tokens * 3 // 4] = torch.arange(topk)
    if repeats:
        ids[::2, -1] = ids[::2, 0]
    weights = torch.rand(tokens, topk, generator=gen)
    return ids.to(torch.int32), weights


# (T, topk, E, block_m): one pair; small blocks; most experts empty; many experts, some empty
CASES = [(1, 1, 1, 16), (7, 2, 8, 4), (33, 4, 16, 32), (64, 4, 128, 16)]


@pytest.mark.parametrize("tokens,topk,num_experts,block_m", CASES)
@pytest.mark.parametrize("skew", [False, True])
@pytest.mark.parametrize("masked", [False, True])
@pytest.mark.parametrize("repeats", [False, True])
def test_matches_loop_contract(tokens, topk, num_experts, block_m, skew, masked, repeats):
    topk_ids, topk_weights = random_routing(tokens, topk, num_experts, seed=tokens + num_experts, skew=skew,
                                            repeats=repeats)
    mask = None
    if masked:
        mask = torch.arange(num_experts) % 3 != 1  # serve two experts in three
        if num_experts == 1:
            mask[:] = True
    ids, weights, expert_ids, num_valid = moe_sorting(topk_ids, topk_weights, num_experts, block_m, mask)
    e_ids, e_weights, e_expert_ids, e_num_valid = sorting_by_loop(topk_ids, topk_weights, num_experts, block_m, mask)
    assert ids.dtype == torch.int32 and weights.dtype == torch.float32
    assert expert_ids.dtype == torch.int32 and num_valid.dtype == torch.int32
    assert ids.tolist() == e_ids
    assert weights.tolist() == e_weights
    assert expert_ids.tolist() == e_expert_ids
    assert num_valid.tolist() == e_num_valid


def test_properties_on_a_larger_routing():
    tokens, topk, num_experts, block_m = 300, 8, 64, 32
    topk_ids, topk_weights = random_routing(tokens, topk, num_experts, seed=5)
    ids, weights, expert_ids, num_valid = moe_sorting(topk_ids.long(), topk_weights.bfloat16(), num_experts, block_m)
    rows = tokens * topk + num_experts * block_m - topk
    assert ids.shape == (rows,) and expert_ids.shape == ((rows + block_m - 1) // block_m,)
    used = num_valid[0].item()
    assert used % block_m == 0 and num_valid[1].item() == tokens
    token, slot = ids & 0xFFFFFF, ids >> 24
    real = token < tokens
    assert not real[used:].any() and (weights[~real] == 0).all()
    # every (token, slot) pair exactly once, in its expert's block, with its weight
    block_expert = expert_ids[torch.arange(rows) // block_m]
    assert torch.equal(topk_ids.long()[token[real].long(), slot[real].long()], block_expert[real].long())
    assert torch.unique(token[real] * topk + slot[real]).numel() == tokens * topk == real.sum()
    assert torch.equal(weights[real], topk_weights.bfloat16().float()[token[real].long(), slot[real].long()])
    # experts ascending, -1 only past the last used block
    n_used = used // block_m
    assert (expert_ids[:n_used].diff() >= 0).all() and (expert_ids[n_used:] == -1).all()
    assert (ids[~real] == ((topk << 24) | tokens)).all()


def test_bad_input_raises():
    ids, w = random_routing(4, 2, 8, seed=1)
    with pytest.raises(ValueError, match=r"topk_ids must lie in \[0, num_experts = 8\)"):
        moe_sorting(ids.clone().fill_(8), w, 8, 16)
    with pytest.raises(ValueError, match=r"topk_ids must lie"):
        moe_sorting(ids.clone().fill_(-1), w, 8, 16)
    with pytest.raises(TypeError, match="topk_ids must have dtype"):
        moe_sorting(ids.float(), w, 8, 16)
    with pytest.raises(ValueError, match="topk_weights must have shape"):
        moe_sorting(ids, w[:, :1], 8, 16)
    with pytest.raises(ValueError, match="topk = topk_ids.shape\\[1\\] = 2 must be in"):
        moe_sorting(ids % 1, w, 1, 16)
    with pytest.raises(ValueError, match="block_m"):
        moe_sorting(ids, w, 8, 0)
    with pytest.raises(ValueError, match="expert_mask must have shape"):
        moe_sorting(ids, w, 8, 16, torch.ones(7, dtype=torch.bool))
    with pytest.raises(ValueError, match="2D"):
        moe_sorting(ids.flatten(), w.flatten(), 8, 16)
