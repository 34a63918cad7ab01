"""End-to-end exactness at T > 0: the target's exact marginals of the first emitted tokens, and the same tokens
sampled through an engine's speculative steps (compared with helpers/goodness_of_fit.py)."""

from __future__ import annotations

import torch

from helpers.goodness_of_fit import PositionCheck, goodness_of_fit
from specdeploy.decoding.sampling import sampling_distribution
from specdeploy.runtime.engine import Engine
from specdeploy.spec.request import NO_END_ID, GenerationRequest
from specdeploy.spec.sampling_params import SamplingParams


def exact_marginals(engine: Engine, prompt: list[int], params: SamplingParams, length: int) -> list[torch.Tensor]:
    """The target's distribution of each of the first `length` emitted tokens, summed over every prefix (top-k
    keeps the prefixes few), with the repetition penalty over prompt and prefix."""
    target = engine.target
    marginals = []
    prefixes = {(): 1.0}
    for _ in range(length):
        marginal = torch.zeros(engine.vocab_size, dtype=torch.float64)
        following = {}
        for prefix, weight in prefixes.items():
            sequence = prompt + list(prefix)
            cache = target.new_cache(1, len(sequence) + 1)
            hidden = target(torch.tensor([sequence]), torch.arange(len(sequence))[None], cache).hidden
            logits = target.logits(hidden)[0, -1:]
            seen = torch.zeros(1, engine.vocab_size, dtype=torch.bool)
            seen[0, sequence] = True
            p = sampling_distribution(logits, params, seen)[0].double()
            marginal += weight * p
            for token in p.nonzero().flatten().tolist():
                following[prefix + (token,)] = following.get(prefix + (token,), 0.0) + weight * float(p[token])
        marginals.append(marginal)
        prefixes = following
    return marginals


def sampled_positions(engine: Engine, prompt: list[int], params: SamplingParams, generations: int,
                      length: int) -> tuple[torch.Tensor, int]:
    """[generations, length]: the first tokens of generations seeded 0, 1, ... through the engine's speculative
    steps, and how many drafted tokens they accepted in all."""
    rows, accepted = [], 0
    for seed in range(generations):
        seeded = SamplingParams(temperature=params.temperature, top_k=params.top_k, top_p=params.top_p,
                                repetition_penalty=params.repetition_penalty, seed=seed)
        generation = engine.start(GenerationRequest(prompt, length, seeded, None, end_id=NO_END_ID))
        rows.append(generation.run())
        accepted += generation.stats.accepted
    return torch.tensor(rows), accepted


def sampled_checks(engine: Engine, prompt: list[int], params: SamplingParams, generations: int,
                   marginals: list[torch.Tensor]) -> tuple[list[PositionCheck], int]:
    """The first len(marginals) tokens of `generations` seeded generations checked against the exact marginals,
    one check per position, and the drafted tokens they accepted in all."""
    samples, accepted = sampled_positions(engine, prompt, params, generations, len(marginals))
    return [goodness_of_fit(samples[:, i], marginals[i], i) for i in range(len(marginals))], accepted
