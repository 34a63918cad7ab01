"""The repetition penalty, and the masks of the context it applies to."""

from __future__ import annotations

import torch

from specdeploy.decoding.repetition_penalty import seen_after_drafts, seen_mask
from specdeploy.decoding.sampling import sampling_distribution
from specdeploy.spec.sampling_params import SamplingParams


def test_repetition_penalty_follows_the_context():
    logits = torch.tensor([[2.0, 2.0, -1.0]])
    seen = seen_mask(torch.tensor([0, 2]), 3)
    probs = sampling_distribution(logits, SamplingParams(temperature=1.0, repetition_penalty=2.0), seen[None])
    expected = torch.tensor([[1.0, 2.0, -2.0]]).softmax(-1)  # positive divided, negative multiplied
    torch.testing.assert_close(probs, expected)
    steps = seen_after_drafts(seen_mask(torch.tensor([0]), 5), torch.tensor([3, 1]))
    assert steps.tolist() == [[True, False, False, False, False], [True, False, False, True, False],
                              [True, True, False, True, False]]
