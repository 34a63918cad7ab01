"""The greedy check's near tie: a divergence at a top-two gap that the dtype's rounding at those logits can explain
is a near tie; a wider one is a mismatch; fp32 is held to fp32's spacing. Against a stub target whose logits are
written by hand."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from specdeploy.bench.greedy_check import compare_greedy, greedy_check, near_tie_tolerance, spacing
from specdeploy.bench.printing import divergences_text


class StubTarget:
    def __init__(self, logits: torch.Tensor) -> None:
        self._logits = logits

    def new_cache(self, rows: int, length: int) -> None:
        return None

    def __call__(self, tokens: torch.Tensor, positions: torch.Tensor, cache) -> SimpleNamespace:
        return SimpleNamespace(hidden=torch.zeros(1, tokens.shape[1], 4))

    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        return self._logits


def engine_with(dtype: str, first: float, second: float) -> SimpleNamespace:
    logits = torch.full((8,), -3.0)
    logits[5], logits[6] = first, second
    return SimpleNamespace(target=StubTarget(logits.to(getattr(torch, dtype))), device="cpu", dtype=dtype)


PLAIN, SPECULATIVE = [5, 5, 5], [5, 6, 5]  # parted at the second token


def test_a_bf16_gap_of_three_spacings_at_logits_near_20_is_a_near_tie():
    """The EAGLE divergence the fixed 0.25 called a mismatch: top two 20.0 and 19.625 in bf16 (spacing 0.125)."""
    assert spacing("bfloat16", 20.0) == 0.125
    verdict = compare_greedy(engine_with("bfloat16", 20.0, 19.625), [1, 2], PLAIN, SPECULATIVE)
    assert verdict == {"verdict": "near_tie", "token": 1, "gap": 0.375, "logit": 20.0, "tolerance": 0.5}


def test_a_gap_bf16_rounding_cannot_explain_is_a_mismatch():
    assert compare_greedy(engine_with("bfloat16", 20.0, 19.25), [1, 2], PLAIN, SPECULATIVE)["verdict"] == "mismatch"
    # near 1 the spacing is 1/128: even a gap of 0.25 (the old fixed tolerance) is far past rounding there
    assert compare_greedy(engine_with("bfloat16", 1.5, 1.25), [1, 2], PLAIN, SPECULATIVE)["verdict"] == "mismatch"


def test_fp32_keeps_a_tight_tolerance():
    assert near_tie_tolerance("float32", 20.0) == pytest.approx(4 * 2.0 ** -23 * 16)
    assert compare_greedy(engine_with("float32", 20.0, 19.999), [1, 2], PLAIN, SPECULATIVE)["verdict"] == "mismatch"
    assert compare_greedy(engine_with("float32", 20.0, 20.0), [1, 2], PLAIN, SPECULATIVE)["verdict"] == "near_tie"


def test_the_report_carries_each_divergences_gap():
    engine = engine_with("bfloat16", 20.0, 19.625)
    check = greedy_check(engine, [[1], [2], [3]], [PLAIN, PLAIN, [5, 5]], [PLAIN, SPECULATIVE, [5]])
    assert (check.greedy_match, check.greedy_exact_prompts, check.greedy_near_tie_prompts,
            check.greedy_mismatch_prompts) == (False, 1, 1, 1)
    assert [d["prompt"] for d in check.greedy_divergences] == [1, 2]
    assert check.greedy_divergences[0]["gap"] == 0.375
    assert divergences_text(check.greedy_divergences) == ("#1 at token 1: gap 0.375 ≤ 0.5 near_tie; "
                                                         "#2 at token 1: one stopped early")
