"""fq.moe_routing: router logits -> (topk_weights, topk_ids) in the two conventions MoE models use,
against a per-token float64 loop written from the formulas (no torch.topk / softmax)."""

import math

import pytest
import torch

import flyquant as fq


def by_hand(logits, topk, renormalize, softmax_after_topk):
    weights, ids = [], []
    for row in logits.double().tolist():
        order = sorted(range(len(row)), key=lambda e: -row[e])[:topk]  # distinct logits: no ties
        if softmax_after_topk:  # GPT-OSS: softmax over the chosen logits
            z = sum(math.exp(row[e] - row[order[0]]) for e in order)
            w = [math.exp(row[e] - row[order[0]]) / z for e in order]
        else:  # softmax over all experts, then the chosen probabilities (renormalized or not)
            z = sum(math.exp(v - max(row)) for v in row)
            w = [math.exp(row[e] - max(row)) / z for e in order]
            if renormalize:
                w = [v / sum(w) for v in w]
        weights.append(w)
        ids.append(order)
    return torch.tensor(weights, dtype=torch.float64), torch.tensor(ids, dtype=torch.int32)


@pytest.mark.parametrize("softmax_after_topk, renormalize", [(False, True), (False, False), (True, True)])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_matches_the_formulas(softmax_after_topk, renormalize, dtype):
    g = torch.Generator().manual_seed(11)
    logits = (torch.randperm(7 * 32, generator=g).view(7, 32).float() / 17).to(dtype)  # distinct values
    for topk in (1, 4, 8):
        weights, ids = fq.moe_routing(logits, topk, renormalize=renormalize, softmax_after_topk=softmax_after_topk)
        want_w, want_ids = by_hand(logits, topk, renormalize, softmax_after_topk)
        assert weights.dtype == torch.float32 and ids.dtype == torch.int32 and ids.shape == (7, topk)
        assert torch.equal(ids, want_ids)
        torch.testing.assert_close(weights.double(), want_w, rtol=4 * 2**-24 * 32, atol=0)  # a 32-term fp32 sum


def test_the_two_conventions_agree_when_renormalized():
    # softmax -> topk -> renormalize is the softmax of the top-k logits (up to FP32 rounding)
    logits = torch.randn(9, 128, generator=torch.Generator().manual_seed(2))
    a = fq.moe_routing(logits, 4, renormalize=True)
    b = fq.moe_routing(logits, 4, softmax_after_topk=True)
    assert torch.equal(a[1], b[1])
    torch.testing.assert_close(a[0], b[0], rtol=2**-20, atol=0)


def test_bad_input():
    logits = torch.zeros(3, 8)
    with pytest.raises(ValueError, match=r"topk must be an int in \[1, min\(E = router_logits.shape\[1\] = 8"):
        fq.moe_routing(logits, 9)
    with pytest.raises(TypeError, match="router_logits must have dtype"):
        fq.moe_routing(logits.to(torch.int32), 2)
    with pytest.raises(ValueError, match="router_logits must be 2D"):
        fq.moe_routing(logits[0], 2)
    # truth tests chose the convention: softmax_after_topk="no" routed GPT-OSS-style, renormalize=0 did not
    # renormalize, with no error
    for name in ("renormalize", "softmax_after_topk"):
        for bad in ("no", 0, None):
            with pytest.raises(ValueError, match=f"{name} must be a bool, got {bad!r}"):
                fq.moe_routing(logits, 2, **{name: bad})
