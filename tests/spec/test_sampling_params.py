"""A request's sampling parameters: bad values name their field."""

from __future__ import annotations

import pytest

from specdeploy.errors import RequestError
from specdeploy.spec.sampling_params import SamplingParams


@pytest.mark.parametrize("kwargs, field", [({"temperature": -1}, "temperature"), ({"top_k": -2}, "top_k"),
                                           ({"top_p": 0.0}, "top_p"), ({"repetition_penalty": 0}, "repetition")])
def test_bad_sampling_params_name_the_field(kwargs, field):
    with pytest.raises(RequestError, match=field):
        SamplingParams(**kwargs)


def test_seed_must_fit_the_request_field():
    assert SamplingParams(seed=2**64 - 1).seed == 2**64 - 1
    for seed in (-1, 2**64):
        with pytest.raises(RequestError, match=r"random_seed: must be in \[0, 2\*\*64\)"):
            SamplingParams(seed=seed)
