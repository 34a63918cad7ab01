"""Sampling: the distribution a request's processors give (temperature, top-k, top-p, penalty), and greedy tokens."""

from __future__ import annotations

import torch

from specdeploy.decoding.sampling import greedy_tokens, sampling_distribution
from specdeploy.spec.sampling_params import SamplingParams


def test_greedy_is_a_point_mass_on_the_argmax():
    logits = torch.tensor([[0.1, 2.0, -1.0, 1.9]])
    assert sampling_distribution(logits, SamplingParams()).tolist() == [[0.0, 1.0, 0.0, 0.0]]


def test_temperature_top_k_top_p():
    logits = torch.log(torch.tensor([[0.5, 0.25, 0.15, 0.1]]))
    plain = sampling_distribution(logits, SamplingParams(temperature=1.0))
    torch.testing.assert_close(plain, torch.tensor([[0.5, 0.25, 0.15, 0.1]]))
    top_k = sampling_distribution(logits, SamplingParams(temperature=1.0, top_k=2))
    torch.testing.assert_close(top_k, torch.tensor([[2 / 3, 1 / 3, 0.0, 0.0]]))
    # top_p 0.7: 0.5 alone is below 0.7, so 0.25 joins; 0.15 is not needed.
    top_p = sampling_distribution(logits, SamplingParams(temperature=1.0, top_p=0.7))
    torch.testing.assert_close(top_p, torch.tensor([[2 / 3, 1 / 3, 0.0, 0.0]]))
    hot = sampling_distribution(logits, SamplingParams(temperature=2.0))
    assert hot[0, 0] < 0.5 and hot[0, 3] > 0.1  # flatter


def test_extreme_values_give_valid_distributions():
    """Allowed but extreme temperatures and penalties: probabilities stay finite and sum to one."""
    logits = torch.randn(3, 40) * 5
    seen = torch.rand(3, 40) < 0.5
    for params in (SamplingParams(temperature=1e-40), SamplingParams(temperature=1e4),
                   SamplingParams(temperature=1.0, repetition_penalty=1e-40),
                   SamplingParams(temperature=1e-40, repetition_penalty=1e30, top_k=3, top_p=0.5)):
        probs = sampling_distribution(logits, params, seen)
        assert torch.isfinite(probs).all() and torch.allclose(probs.sum(-1), torch.ones(3)), params


def test_greedy_tokens_are_where_the_greedy_distribution_sits():
    logits = torch.randn(6, 50, generator=torch.Generator().manual_seed(3))
    for params, seen in [(SamplingParams(), None),
                         (SamplingParams(repetition_penalty=3.0), torch.rand(6, 50) < 0.3)]:
        expected = sampling_distribution(logits, params, seen).argmax(-1)
        assert torch.equal(greedy_tokens(logits, params, seen), expected)
