"""The gamma cap a build measures (tune/gamma_cap.py) and bench --measure-gamma-cap measures again: the rule that
picks it from realized speedups."""

from __future__ import annotations

import pytest

from specdeploy.errors import SpecdeployError
from specdeploy.tune.gamma_cap import MARGIN, gamma_cap_record


def test_the_measured_gamma_cap_is_the_best_realized_gamma_beyond_noise_or_none_when_nothing_pays():
    def cap(full_speedup: float, sweep: dict[int, float]) -> int:
        return gamma_cap_record({**sweep, 4: full_speedup}, 4)["gamma_cap"]

    assert cap(1.40, {1: 1.2, 2: 1.50, 3: 1.45}) == 2  # a smaller gamma that pays more
    assert cap(1.40, {1: 1.2, 2: 1.42, 3: 1.41}) == 4  # within MARGIN of the pipeline's own: keep its gamma
    assert cap(0.90, {1: 0.95, 2: 0.93, 3: 0.91}) == 0  # nothing beats plain decode: draft nothing
    assert cap(1.40, {1: 1.2, 2: 1.40 * MARGIN + 0.01, 3: 1.3}) == 2


def test_a_gamma_cap_needs_every_swept_gamma_measured():
    with pytest.raises(SpecdeployError, match=r"gammas \[2, 4\]"):
        gamma_cap_record({1: 1.2, 3: 1.3}, 4)
