"""Logits → the distribution actually sampled from. Pure functions; randomness only through an explicit generator.

The processors run in this order: repetition penalty (repetition_penalty.py), temperature, top-k, top-p. Draft
and target both go through `sampling_distribution` with the same SamplingParams, so the q and p the acceptance rule
compares are the distributions each side really samples from. Temperature 0 gives a point mass on the (penalised)
argmax.
"""

from __future__ import annotations

import torch

from specdeploy.decoding.repetition_penalty import penalised
from specdeploy.models.reductions import argmax
from specdeploy.spec.sampling_params import SamplingParams


def request_generator(params: SamplingParams, device: torch.device | str = "cpu") -> torch.Generator | None:
    """The request's random stream; None when greedy (nothing random is drawn)."""
    if params.greedy:
        return None
    generator = torch.Generator(device=device)
    if params.seed is None:
        generator.seed()
    else:
        generator.manual_seed(params.seed)
    return generator


def sampling_distribution(logits: torch.Tensor, params: SamplingParams,
                          seen: torch.Tensor | None = None) -> torch.Tensor:
    """logits: [N, V]; seen: [N, V] bool, tokens already in the context (for the repetition penalty).
    Returns fp32 probabilities [N, V], each row summing to 1."""
    logits = penalised(logits, params, seen)
    if params.greedy:
        return torch.nn.functional.one_hot(argmax(logits), logits.shape[-1]).float()
    # Shifted so the largest is 0 first: a tiny temperature then gives 0 and -inf, never inf - inf (NaN).
    logits = (logits - logits.amax(-1, keepdim=True)) / params.temperature
    if 0 < params.top_k < logits.shape[-1]:
        kth = logits.topk(params.top_k, dim=-1).values[..., -1:]
        logits = logits.masked_fill(logits < kth, float("-inf"))
    probs = logits.softmax(-1)
    if params.top_p < 1.0:
        sorted_probs, order = probs.sort(dim=-1, descending=True)
        # Keep a token while the mass before it is below top_p: the smallest set reaching top_p, never empty.
        keep_sorted = (sorted_probs.cumsum(-1) - sorted_probs) < params.top_p
        keep = torch.zeros_like(keep_sorted).scatter(-1, order, keep_sorted)
        probs = probs * keep
        probs = probs / probs.sum(-1, keepdim=True)
    return probs


def greedy_tokens(logits: torch.Tensor, params: SamplingParams, seen: torch.Tensor | None = None) -> torch.Tensor:
    """The token a greedy `sampling_distribution` puts its point mass on, without building it: [N, V] → [N] long."""
    return argmax(penalised(logits, params, seen))


class RowStreams:
    """The random streams of a batch of requests: row r draws only from generators[r], and only what it uses
    itself (counts[r] uniforms for its drafted tokens, one noise row for its final token), so a seeded request's
    draws never depend on what else shares its batch."""

    def __init__(self, generators: list[torch.Generator], counts: list[int]) -> None:
        self.generators, self.counts = generators, counts


Randomness = torch.Generator | RowStreams | None


def uniform(shape: tuple[int, int], randomness: Randomness, device: torch.device | str) -> torch.Tensor:
    """[B, G] draws in (0, 1] (torch.rand can return exactly 0, which the acceptance rule must never see); None: all
    ones (point masses need no randomness). With RowStreams, entries past counts[r] are 1 and drawn from nothing."""
    if randomness is None:
        return torch.ones(shape, device=device)
    if isinstance(randomness, torch.Generator):
        return 1.0 - torch.rand(shape, generator=randomness, device=device)
    draws = torch.ones(shape, device=device)
    for row, (generator, count) in enumerate(zip(randomness.generators, randomness.counts)):
        draws[row, :count] = 1.0 - torch.rand(count, generator=generator, device=device)
    return draws


def sample(probs: torch.Tensor, randomness: Randomness) -> torch.Tensor:
    """One token per row of probs [N, V] → [N] long. No randomness: the argmax. The exponential race
    (argmax of p / Exp(1)) samples exactly from p without a host sync."""
    if randomness is None:
        return argmax(probs)
    noise = torch.empty_like(probs)
    if isinstance(randomness, torch.Generator):
        noise.exponential_(generator=randomness)
    else:
        for row, generator in enumerate(randomness.generators):
            noise[row].exponential_(generator=generator)
    return argmax(probs / noise)
