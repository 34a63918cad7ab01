"""A request's statistics: per-position acceptance and the mean accepted length."""

from __future__ import annotations

import pytest

from specdeploy.decoding.stats import RequestStats


def test_stats_per_position_and_mean_accepted_length():
    stats = RequestStats(generated_tokens=1)
    stats.record_step(drafted=3, accepted=3)
    stats.record_step(drafted=3, accepted=1)
    stats.record_step(drafted=0, accepted=0)
    stats.generated_tokens += 4 + 2 + 1
    assert stats.drafted_per_position == [2, 2, 2] and stats.accepted_per_position == [2, 1, 1]
    assert stats.acceptance_rate == pytest.approx(4 / 6)
    assert stats.mean_accepted_length == pytest.approx(7 / 3)
    assert stats.per_position_acceptance == [1.0, 0.5, 0.5]
