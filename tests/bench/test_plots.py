"""The lines of speedup.png (plots.gamma_curves): predictions from acceptance by position and from the seed's formula,
over the verify cost by width; and axes that tick whole numbers."""

from __future__ import annotations

import pytest
from helpers.made_reports import made_report

from specdeploy.bench.plots import gamma_curves, pyplot, whole_number_ticks
from specdeploy.speculative.speedup import predicted_speedup


def test_the_two_predictions_agree_when_acceptance_is_geometric():
    """The line from acceptance by position and the seed's formula are the same curve when position i is accepted
    with probability alpha^i (independent acceptance): the plot's two lines then coincide."""
    alpha, c, v = 0.7, 0.1, 1.05
    report = made_report(summary={"draft_cost_ratio": c, "verify_cost_ratio": v, "acceptance_rate": alpha,
                                  "per_position_acceptance": [alpha ** i for i in range(1, 6)]},
                         setup={"num_draft_tokens": 5})
    curves = gamma_curves(report)
    assert list(curves["by_position"]) == [1, 2, 3, 4, 5] and len(curves["formula"]) == 10
    for gamma, value in curves["by_position"].items():
        assert value == pytest.approx(curves["formula"][gamma]) == pytest.approx(predicted_speedup(alpha, gamma, c, v))


def test_the_predicted_lines_follow_the_verify_cost_by_width():
    """Where verifying n tokens costs nearly n plain steps (bf16 without oneDNN), one v for every gamma predicts a
    small gamma far too low: the lines take the measured cost by width, scaled through the v of the served gamma."""
    alpha, c = 0.9, 0.3
    costs = [1.0 + 0.5 * n for n in range(7)]  # a forward over n + 1 positions, in plain steps
    report = made_report(summary={"draft_cost_ratio": c, "verify_cost_ratio": 2.2, "acceptance_rate": alpha,
                                  "per_position_acceptance": [alpha ** i for i in range(1, 4)]},
                         setup={"num_draft_tokens": 3}, verify_costs=costs)
    curves = gamma_curves(report)
    assert list(curves["formula"]) == [1, 2, 3, 4, 5, 6] and list(curves["by_position"]) == [1, 2, 3]
    scale = 2.2 / costs[3]
    for gamma in (1, 3, 6):
        assert curves["formula"][gamma] == pytest.approx(predicted_speedup(alpha, gamma, c, scale * costs[gamma]))
    assert curves["by_position"][3] == pytest.approx(predicted_speedup(alpha, 3, c, 2.2))
    assert curves["formula"][1] > predicted_speedup(alpha, 1, c, 2.2)


def test_a_dip_in_the_measured_verify_cost_does_not_bend_the_lines_down():
    """Timing noise can make a wider forward look cheaper (1.07 then 0.99): the lines take the running maximum."""
    alpha, c = 0.5, 0.1
    noisy = [1.0, 1.07, 1.09, 0.99, 1.02, 1.06]
    report = made_report(summary={"draft_cost_ratio": c, "verify_cost_ratio": 1.09, "acceptance_rate": alpha,
                                  "per_position_acceptance": [alpha, alpha ** 2]},
                         setup={"num_draft_tokens": 2}, verify_costs=noisy)
    formula = gamma_curves(report)["formula"]
    for gamma, cost in zip(range(1, 6), [1.07, 1.09, 1.09, 1.09, 1.09]):
        assert formula[gamma] == pytest.approx(predicted_speedup(alpha, gamma, c, cost))


def test_gamma_and_position_axes_tick_whole_numbers_only():
    """Two draft positions must not read 0.75, 1.25, ...: the axes of gammas, positions and lengths tick integers."""
    plt = pyplot()
    figure, axes = plt.subplots()
    axes.bar([1, 2], [0.5, 0.1])
    assert any(tick % 1 for tick in axes.get_xticks())  # matplotlib's own choice puts ticks between them
    whole_number_ticks(axes.xaxis)
    assert all(tick % 1 == 0 for tick in axes.get_xticks())
    plt.close(figure)
