"""Blockwise argmax/top-k return exactly what torch's do, ties included."""

from __future__ import annotations

import pytest
import torch

from specdeploy.models.reductions import BLOCK, argmax, topk_indices


@pytest.mark.parametrize("vocab", [BLOCK * 50, BLOCK * 50 + 7, 3])
@pytest.mark.parametrize("ties", [False, True])
def test_argmax_and_topk_match_torch(vocab, ties):
    generator = torch.Generator().manual_seed(vocab)
    logits = torch.randn(9, vocab, generator=generator)
    if ties:  # few distinct values: the maximum occurs several times, in several blocks
        logits = (logits * 2).round().clamp(max=3)
    assert torch.equal(argmax(logits), logits.argmax(-1))
    assert torch.equal(argmax(logits.bfloat16()), logits.bfloat16().argmax(-1))
    k = min(4, vocab)
    found = topk_indices(logits, k)
    assert found.shape == (9, k)
    # The same values as torch's top-k (which indices among equal values is not specified).
    expected = logits.topk(k, dim=-1).values
    torch.testing.assert_close(logits.gather(1, found).sort(-1, descending=True).values, expected)
    assert (found.sort(-1).values.diff(dim=-1) > 0).all()  # k distinct indices
