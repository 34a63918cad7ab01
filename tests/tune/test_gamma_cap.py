"""The gamma cap bench measures (--measure-gamma-cap, and build): the rule that picks it from realized speedups."""

from __future__ import annotations

from helpers.made_reports import made_report

from specdeploy.bench.gamma_cap import MARGIN, measured_policy


def test_the_measured_gamma_cap_is_the_best_realized_gamma_beyond_noise_or_none_when_nothing_pays():
    def cap(full_speedup: float, sweep: dict[int, float]) -> int:
        report = made_report({"speedup": full_speedup}, {"num_draft_tokens": 4}, gamma_sweep=sweep)
        return measured_policy(report)["gamma_cap"]

    assert cap(1.40, {1: 1.2, 2: 1.50, 3: 1.45}) == 2  # a smaller gamma that pays more
    assert cap(1.40, {1: 1.2, 2: 1.42, 3: 1.41}) == 4  # within MARGIN of the pipeline's own: keep its gamma
    assert cap(0.90, {1: 0.95, 2: 0.93, 3: 0.91}) == 0  # nothing beats plain decode: draft nothing
    assert cap(1.40, {1: 1.2, 2: 1.40 * MARGIN + 0.01, 3: 1.3}) == 2
