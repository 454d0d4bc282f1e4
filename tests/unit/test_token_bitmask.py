"""The sampler's grammar mask: packed bits -> -inf on forbidden tokens of constrained rows only."""

from __future__ import annotations

import torch

from llmserve.worker.sampler import apply_token_bitmask


def _pack(allowed: list[list[int]], vocab: int) -> torch.Tensor:
    words = torch.zeros(len(allowed), (vocab + 31) // 32, dtype=torch.int64)
    for r, ids in enumerate(allowed):
        for t in ids:
            words[r, t // 32] |= 1 << (t % 32)
    words[words >= 2**31] -= 2**32          # as the int32 bit pattern Core sends
    return words.to(torch.int32)


def test_mask_applies_to_listed_rows_only():
    vocab = 70                                # not a multiple of 32: the tail word is partial
    logits = torch.randn(3, vocab)
    before = logits.clone()
    bits = _pack([[0, 31, 63, 69], [5]], vocab)
    apply_token_bitmask(logits, torch.tensor([0, 2]), bits)
    assert torch.equal(logits[1], before[1])
    assert torch.isfinite(logits[0]).nonzero().flatten().tolist() == [0, 31, 63, 69]
    assert torch.isfinite(logits[2]).nonzero().flatten().tolist() == [5]
    assert logits[2, 5] == before[2, 5]


def test_logits_past_the_mask_width_are_forbidden():
    logits = torch.zeros(1, 40)               # model vocab padded past the tokenizer's 32
    apply_token_bitmask(logits, torch.tensor([0]), _pack([[1, 31]], 32))
    assert torch.isfinite(logits[0]).nonzero().flatten().tolist() == [1, 31]


def test_no_rows_is_a_no_op():
    logits = torch.randn(2, 8)
    before = logits.clone()
    apply_token_bitmask(logits, torch.zeros(0, dtype=torch.int64), torch.zeros((0, 1), dtype=torch.int32))
    assert torch.equal(logits, before)
