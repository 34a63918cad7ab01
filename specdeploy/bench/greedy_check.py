"""At temperature 0 speculation must emit exactly plain decode's tokens. Reduced precision may reorder the sums of
a verify forward against a plain step's, which can flip a near tie of the target's top two logits: a divergence
there is reported apart from a real mismatch."""

from __future__ import annotations

import torch

from specdeploy.bench.results import GreedyCheck
from specdeploy.decoding.prompt_lookup import common_prefix_length
from specdeploy.runtime.engine import Engine


def top_two_gap(engine: Engine, tokens: list[int]) -> float:
    """Gap between the target's two largest logits for the token after `tokens` (fresh prefill)."""
    cache = engine.target.new_cache(1, len(tokens) + 1)
    hidden = engine.target(torch.tensor([tokens], device=engine.device),
                           torch.arange(len(tokens), device=engine.device)[None], cache).hidden
    top = engine.target.logits(hidden[0, -1]).topk(2).values
    return float(top[0] - top[1])


def near_tie_tolerance(dtype: str) -> float:
    """Largest top-two logit gap that reduced-precision reordering of the same sums can flip."""
    return 0.0 if dtype == "float32" else 0.25


def compare_greedy(engine: Engine, prompt_ids: list[int], plain: list[int], speculative: list[int]) -> str:
    """'match', 'near_tie' (first divergence at a near-tie of the target's top two tokens) or 'mismatch'."""
    if plain == speculative:
        return "match"
    common = common_prefix_length(plain, speculative)
    if common >= min(len(plain), len(speculative)):
        return "mismatch"  # one stopped early: a length difference is never a tie
    gap = top_two_gap(engine, prompt_ids + plain[:common])
    return "near_tie" if gap <= near_tie_tolerance(engine.dtype) else "mismatch"


def greedy_check(engine: Engine, encoded: list[list[int]], plain: list[list[int]],
                 speculative: list[list[int]]) -> GreedyCheck:
    """Every prompt's plain and speculative tokens compared (encoded: the prompts' ids, in the same order)."""
    verdicts = [compare_greedy(engine, ids, p, s) for ids, p, s in zip(encoded, plain, speculative)]
    return GreedyCheck(greedy_match=all(v != "mismatch" for v in verdicts),
                       greedy_exact_prompts=verdicts.count("match"),
                       greedy_near_tie_prompts=verdicts.count("near_tie"),
                       greedy_mismatch_prompts=verdicts.count("mismatch"))
