"""At temperature 0 speculation must emit exactly plain decode's tokens. Reduced precision may reorder the sums of
a verify forward against a plain step's, which can flip a near tie of the target's top two logits: a divergence
there is reported apart from a real mismatch.

How near is near depends on the dtype and on the logits' size: a logit of about 20 in bf16 is held to a spacing of
0.125 (8 significant bits), so two computations of it that round differently part by a multiple of that, while in
fp32 the spacing there is 2e-6. The tolerance is NEAR_TIE_ULPS spacings of the dtype at the larger of the top two
logits (`near_tie_tolerance`); each divergence's gap, tolerance and verdict are in the report.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from specdeploy.bench.results import GreedyCheck
from specdeploy.decoding.prompt_lookup import common_prefix_length
from specdeploy.runtime.engine import Engine

# Spacings of the dtype at the logits' magnitude that a top-two gap may span and still be rounding: each of the two
# logits may be off by up to two spacings in opposite directions (its hidden state and its own product rounded
# differently by a tree verify and a plain step). An EAGLE divergence on the bf16 target parted at a gap of 0.375
# at logits near 20, three spacings; fp32 gave the same tokens there.
NEAR_TIE_ULPS = 4


@dataclass(frozen=True)
class TopTwo:
    """The target's two largest logits for one position."""

    first: float
    second: float

    @property
    def gap(self) -> float:
        return self.first - self.second

    @property
    def magnitude(self) -> float:
        return max(abs(self.first), abs(self.second))


def top_two(engine: Engine, tokens: list[int]) -> TopTwo:
    """The target's two largest logits for the token after `tokens` (fresh prefill)."""
    cache = engine.target.new_cache(1, len(tokens) + 1)
    hidden = engine.target(torch.tensor([tokens], device=engine.device),
                           torch.arange(len(tokens), device=engine.device)[None], cache).hidden
    first, second = engine.target.logits(hidden[0, -1]).topk(2).values.float().tolist()
    return TopTwo(first, second)


def spacing(dtype: str, magnitude: float) -> float:
    """The distance between adjacent values of `dtype` at `magnitude` (one ULP): eps · 2^floor(log2 |x|)."""
    eps = torch.finfo(getattr(torch, dtype)).eps
    if magnitude == 0:
        return torch.finfo(getattr(torch, dtype)).tiny
    return eps * 2.0 ** math.floor(math.log2(abs(magnitude)))


def near_tie_tolerance(dtype: str, magnitude: float) -> float:
    """Largest top-two logit gap that `dtype`'s rounding at logits of `magnitude` can flip."""
    return NEAR_TIE_ULPS * spacing(dtype, magnitude)


def divergence(top: TopTwo, dtype: str) -> dict:
    """A divergence's figures for the report: the gap, the tolerance at its logits and the verdict."""
    tolerance = near_tie_tolerance(dtype, top.magnitude)
    return {"gap": round(top.gap, 6), "logit": round(top.first, 4), "tolerance": tolerance,
            "verdict": "near_tie" if top.gap <= tolerance else "mismatch"}


def compare_greedy(engine: Engine, prompt_ids: list[int], plain: list[int], speculative: list[int]) -> dict:
    """{"verdict": "match" | "near_tie" | "mismatch", ...}: near_tie when the first divergence is at a near tie of
    the target's top two tokens, with its position, gap and tolerance (divergence)."""
    if plain == speculative:
        return {"verdict": "match"}
    common = common_prefix_length(plain, speculative)
    if common >= min(len(plain), len(speculative)):
        return {"verdict": "mismatch", "token": common, "why": "one stopped early"}  # never a tie
    return {"token": common, **divergence(top_two(engine, prompt_ids + plain[:common]), engine.dtype)}


def greedy_check(engine: Engine, encoded: list[list[int]], plain: list[list[int]],
                 speculative: list[list[int]]) -> GreedyCheck:
    """Every prompt's plain and speculative tokens compared (encoded: the prompts' ids, in the same order)."""
    compared = [compare_greedy(engine, ids, p, s) for ids, p, s in zip(encoded, plain, speculative)]
    verdicts = [entry["verdict"] for entry in compared]
    return GreedyCheck(greedy_match=all(v != "mismatch" for v in verdicts),
                       greedy_exact_prompts=verdicts.count("match"),
                       greedy_near_tie_prompts=verdicts.count("near_tie"),
                       greedy_mismatch_prompts=verdicts.count("mismatch"),
                       greedy_divergences=[{"prompt": index, **entry} for index, entry in enumerate(compared)
                                           if entry["verdict"] != "match"])
