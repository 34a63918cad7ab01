"""Checks on loaded engines and their models."""

from __future__ import annotations

import torch

from specdeploy.models.llama import LlamaModel
from specdeploy.runtime.engine import Engine
from specdeploy.spec.sampling_params import SamplingParams


def fresh_prefill(model: LlamaModel, tokens: list[int], max_length: int):
    cache = model.new_cache(1, max_length)
    model(torch.tensor([tokens]), torch.arange(len(tokens))[None], cache)
    return cache


def assert_greedy_speculation_equals_plain(engine: Engine, prompts: list[str], max_tokens: int = 32) -> None:
    """Each prompt's greedy answer with speculation at the engine's gamma is its plain decode's, token for token, and
    some drafts were accepted."""
    accepted = 0
    for prompt in prompts:
        ids = engine.encode_prompt(prompt)
        plain = engine.generate(ids, SamplingParams(), max_tokens, num_draft_tokens=0).run()
        generation = engine.generate(ids, SamplingParams(), max_tokens)
        assert generation.run() == plain, prompt
        accepted += generation.stats.accepted
    assert accepted > 0
