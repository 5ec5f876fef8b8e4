"""MoE routing helpers: moe_sorting with aiter's output contract (its undefined parts defined).

Vectorised PyTorch with static output shapes: no Python loop over tokens, and apart from the
input validation (which reads the ids to range-check them) no host synchronisation, so it runs
on any device.
"""

from __future__ import annotations

import torch

from . import validate

TOKEN_BITS = 24  # sorted id = (slot << 24) | token
TOKEN_MASK = (1 << TOKEN_BITS) - 1
MAX_TOPK = (1 << (31 - TOKEN_BITS)) - 1  # 127: slot << 24 (and topk << 24, the padding id) stays a positive int32
ID_DTYPES = (torch.int32, torch.int64)
# int32 rows addressed with 32-bit byte offsets by the stage-2 kernel (a buffer of < 2^32 bytes)
MAX_SORTED_ROWS = ((1 << 32) - 1) // 4


def check_moe_sorting(topk_ids, topk_weights, num_experts, block_m, expert_mask=None, *, check_ids=True):
    """moe_sorting's argument checks: a TypeError/ValueError naming the argument. check_ids: also
    the range of the ids' values, which reads them (a host synchronisation; the kernel path does
    it only with FLYQUANT_DEBUG=1 and drops out-of-range ids otherwise)."""
    validate.tensor(topk_ids, "topk_ids", ID_DTYPES, ndim=2)
    validate.tensor(topk_weights, "topk_weights", (torch.float32, torch.bfloat16, torch.float16), ndim=2)
    validate.shape(topk_weights, "topk_weights", tuple(topk_ids.shape))
    validate.same_device("topk_ids", topk_ids, "topk_weights", topk_weights)
    tokens, topk = topk_ids.shape
    if not validate.is_int(num_experts) or num_experts <= 0:
        raise ValueError(f"num_experts must be a positive int, got {num_experts!r}")
    if not validate.is_int(block_m) or block_m <= 0:
        raise ValueError(f"block_m must be a positive int, got {block_m!r}")
    if not 0 < topk <= min(num_experts, MAX_TOPK):
        raise ValueError(f"topk = topk_ids.shape[1] = {topk} must be in [1, min(num_experts, {MAX_TOPK})]")
    if tokens > TOKEN_MASK:
        raise ValueError(f"T = topk_ids.shape[0] = {tokens} must be below 2^{TOKEN_BITS} (ids pack the token in 24 bits)")
    # checked before anything is allocated: the outputs' length grows with num_experts * block_m
    if tokens * topk + num_experts * block_m - topk > MAX_SORTED_ROWS:
        raise ValueError(f"T * topk + num_experts * block_m - topk = {tokens} * {topk} + {num_experts} * {block_m} - "
                         f"{topk} sorted rows must be at most {MAX_SORTED_ROWS} (int32 rows, 32-bit byte offsets)")
    if expert_mask is not None:
        validate.tensor(expert_mask, "expert_mask", ndim=1)
        validate.shape(expert_mask, "expert_mask", (num_experts,))
        validate.same_device("topk_ids", topk_ids, "expert_mask", expert_mask)
    if check_ids and topk_ids.numel() and (topk_ids.min().item() < 0 or topk_ids.max().item() >= num_experts):
        raise ValueError(f"topk_ids must lie in [0, num_experts = {num_experts}), got [{topk_ids.min().item()}, {topk_ids.max().item()}]")


def moe_sorting(topk_ids, topk_weights, num_experts, block_m, expert_mask=None):
    """Group the (token, slot) routing pairs by expert into blocks of `block_m` rows.

    Inputs: topk_ids (T, topk) int32/int64 expert ids in [0, num_experts); topk_weights (T, topk)
    floating; expert_mask optional (num_experts,) bool/int, nonzero = expert served here.

    Returns (sorted_ids, sorted_weights, sorted_expert_ids, num_valid_ids), all on topk_ids' device:
    - sorted_ids int32 (R,), R = T*topk + num_experts*block_m - topk (aiter's worst case): for each
      expert in ascending order, its pairs with tokens ascending (slot ascending for a repeated
      expert), id = (slot << 24) | token, then padding up to a multiple of block_m. Padding and
      unused rows hold (topk << 24) | T. An expert with no pairs takes no rows.
    - sorted_weights float32 (R,): the pair's routing weight, 0 on padding and unused rows (FP32
      weights bit for bit, BF16/FP16 ones widened exactly; an FP16 NaN stays a NaN of its sign,
      its payload the converter's: torch's CPU conversion and the GPU's differ).
    - sorted_expert_ids int32 (ceil(R / block_m),): the expert of each block of block_m rows (the
      local id under expert_mask: masked-in experts renumbered 0, 1, ... in order), -1 past the
      last used block.
    - num_valid_ids int32 (2,): [rows in use (a multiple of block_m), T].
    With expert_mask, pairs routed to masked-out experts are dropped (another rank serves them).
    """
    num_experts, block_m = validate.as_int(num_experts), validate.as_int(block_m)
    check_moe_sorting(topk_ids, topk_weights, num_experts, block_m, expert_mask)
    tokens, topk = topk_ids.shape
    device = topk_ids.device
    served = torch.ones(num_experts, dtype=torch.bool, device=device) if expert_mask is None else expert_mask != 0

    rows = tokens * topk + num_experts * block_m - topk
    blocks = (rows + block_m - 1) // block_m
    pad_id = (topk << TOKEN_BITS) | tokens

    experts = topk_ids.reshape(-1).long()
    pair = torch.arange(experts.numel(), device=device)  # t * topk + slot: already token-major
    # Dropped pairs sort last under the sentinel expert id num_experts.
    key = torch.where(served[experts], experts, num_experts)
    key_sorted, order = torch.sort(key, stable=True)
    counts = torch.zeros(num_experts + 1, dtype=torch.long, device=device).scatter_add_(0, key, torch.ones_like(key))[:num_experts]
    padded = (counts + block_m - 1) // block_m * block_m
    row_start = torch.cumsum(padded, 0) - padded  # first row of each expert
    pair_start = torch.cumsum(counts, 0) - counts  # first sorted position of each expert
    kept = key_sorted < num_experts
    e_safe = key_sorted.clamp(max=num_experts - 1)
    # dropped pairs go to the spare row `rows`, cut off below
    dest = torch.where(kept, row_start[e_safe] + torch.arange(order.numel(), device=device) - pair_start[e_safe], rows)

    token, slot = pair[order] // topk, pair[order] % topk
    ids = torch.full((rows + 1,), pad_id, dtype=torch.int32, device=device)
    ids[dest] = ((slot << TOKEN_BITS) | token).to(torch.int32)
    weights = torch.zeros(rows + 1, dtype=torch.float32, device=device)
    weights[dest] = topk_weights.reshape(-1)[order].to(torch.float32)

    local_id = (torch.cumsum(served.to(torch.int32), 0) - 1).to(torch.int32)
    block_end = torch.cumsum(padded // block_m, 0)  # blocks used through each expert
    block = torch.arange(blocks, device=device)
    owner = torch.searchsorted(block_end, block, right=True).clamp(max=num_experts - 1)
    expert_ids = torch.where(block < block_end[-1], local_id[owner], -1).to(torch.int32)

    num_valid = torch.stack((padded.sum(), torch.tensor(tokens, device=device))).to(torch.int32)
    return ids[:rows], weights[:rows], expert_ids, num_valid


def moe_routing(router_logits, topk, renormalize=True, softmax_after_topk=False):
    """Router logits (T, E) -> (topk_weights (T, topk) float32, topk_ids (T, topk) int32), the
    two conventions MoE models use, in FP32 and on the logits' device:

    - softmax_after_topk=False (Mixtral, Qwen3-MoE, DeepSeek-V2 style): softmax over all E
      experts, the topk largest probabilities; renormalize=True divides them by their sum
      (Mixtral; Qwen3's norm_topk_prob), False keeps them as they are.
    - softmax_after_topk=True (GPT-OSS): the topk largest logits, then a softmax over those
      (already summing to 1: renormalize changes nothing).

    Ties keep torch.topk's order. A token whose logits hold a NaN or +inf, or are all -inf, gets
    NaN weights (the softmax's; its ids may then be any), so its layer output is NaN (only that
    token's). The pair (topk_weights, topk_ids) is what fused_moe / moe_sorting take:
    `fused_moe(x, ..., *moe_routing(logits, topk))`.
    """
    validate.tensor(router_logits, "router_logits", (torch.float32, torch.bfloat16, torch.float16), ndim=2)
    experts, topk = router_logits.shape[1], validate.as_int(topk)
    if not validate.is_int(topk) or not 0 < topk <= min(experts, MAX_TOPK):
        raise ValueError(f"topk must be an int in [1, min(E = router_logits.shape[1] = {experts}, {MAX_TOPK})], got {topk!r}")
    # a truth test picked the convention: softmax_after_topk="no" routed GPT-OSS-style, no error
    validate.flag(renormalize, "renormalize")
    logits = router_logits.float()
    if validate.flag(softmax_after_topk, "softmax_after_topk"):
        top, ids = logits.topk(topk, dim=-1)
        weights = top.softmax(dim=-1)
    else:
        weights, ids = logits.softmax(dim=-1).topk(topk, dim=-1)
        if renormalize:
            weights = weights / weights.sum(dim=-1, keepdim=True)
    return weights, ids.to(torch.int32)
