"""The cost model (speculative/speedup.py) at values worked out by hand."""

from __future__ import annotations

import pytest

from specdeploy.speculative.speedup import (
    break_even_tokens_per_step,
    expected_tokens_per_step,
    predicted_speedup,
    predicted_speedups,
    speedup,
    step_cost,
    tokens_per_step_by_position,
)


def test_expected_tokens_per_step_is_the_geometric_sum():
    # alpha 0.5, gamma 2: 1 + 0.5 + 0.25 tokens
    assert expected_tokens_per_step(0.5, 2) == pytest.approx(1.75)
    assert expected_tokens_per_step(0.0, 5) == pytest.approx(1.0)  # every draft rejected: the correction token
    assert expected_tokens_per_step(1.0, 4) == 5  # every draft and the bonus token
    assert expected_tokens_per_step(0.8, 3) == pytest.approx(1 + 0.8 + 0.64 + 0.512)


def test_a_step_costs_gamma_c_plus_v():
    assert step_cost(4, 0.1, 1.1) == pytest.approx(1.5)
    assert step_cost(5, 0.0, 1.0) == 1.0  # a draft-free proposer: only the verify forward
    assert break_even_tokens_per_step(4, 0.1, 1.1) == pytest.approx(1.5)


def test_the_seed_formula():
    # (1 - 0.5^3) / ((1 - 0.5)(2 × 0.25 + 1)) = 1.75 / 1.5
    assert predicted_speedup(0.5, 2, 0.25, 1.0) == pytest.approx(1.75 / 1.5)
    assert predicted_speedup(0.0, 3, 0.1, 1.0) == pytest.approx(1 / 1.3)  # no acceptance: speculation costs time
    assert predicted_speedup(1.0, 4, 0.0, 1.0) == 5
    # at the break-even tokens per step the speedup is exactly 1
    cost = break_even_tokens_per_step(3, 0.2, 1.05)
    assert speedup(cost, step_cost(3, 0.2, 1.05)) == pytest.approx(1.0)


def test_the_prediction_by_position_uses_the_measured_acceptance_and_the_cost_by_width():
    assert tokens_per_step_by_position([0.9, 0.6, 0.3], 2) == pytest.approx(2.5)
    # one token accepted for sure, the second half the time; verifying 2 tokens costs 1.5 steps, 3 tokens 3 steps
    by_gamma = predicted_speedups([1.0, 0.5], draft_cost=0.25, verify_cost=[1.0, 1.5, 3.0])
    assert by_gamma == pytest.approx([2.0 / 1.75, 2.5 / 3.5])
    # no further than the positions measured, nor the widths measured
    assert len(predicted_speedups([0.9], 0.1, [1.0, 1.1, 1.2])) == 1
    assert len(predicted_speedups([0.9, 0.8, 0.7], 0.1, [1.0, 1.1])) == 1


def test_geometric_acceptance_by_position_gives_the_seed_formula():
    alpha, c, v = 0.7, 0.1, 1.05
    positions = [alpha ** i for i in range(1, 6)]
    for gamma, value in enumerate(predicted_speedups(positions, c, [v] * 6), start=1):
        assert value == pytest.approx(predicted_speedup(alpha, gamma, c, v))
