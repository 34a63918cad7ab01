"""What the latency histograms observe for one request (serve/latency.py): genai-perf's definitions over bursts."""

from __future__ import annotations

import pytest

from specdeploy.serve.latency import ITL_BUCKETS, TOKENS_PER_RESPONSE_BUCKETS, TTFT_BUCKETS, RequestTiming


def test_a_burst_counts_as_several_tokens_in_the_inter_token_latency():
    timing = RequestTiming(arrived=10.0)
    for count, now in ((1, 11.0), (3, 11.2), (0, 11.3), (2, 11.5)):  # prefill, then bursts of 3 and 2
        timing.produced(count, now)
    assert timing.tokens == 6 and [count for _, count in timing.bursts] == [1, 3, 2]
    assert timing.time_to_first_token == pytest.approx(1.0) and timing.latency == pytest.approx(1.5)
    # genai-perf: (request latency - TTFT) / (tokens - 1) = (1.5 - 1.0) / 5, not the mean gap between responses
    assert timing.inter_token_latency == pytest.approx(0.1)
    assert timing.gaps == pytest.approx([0.2, 0.3])


def test_no_inter_token_latency_under_two_tokens_and_no_first_token_without_one():
    timing = RequestTiming(arrived=0.0)
    assert timing.time_to_first_token is None and timing.inter_token_latency is None
    timing.produced(1, 0.25)
    assert timing.time_to_first_token == 0.25 and timing.inter_token_latency is None


@pytest.mark.parametrize("buckets", [TTFT_BUCKETS, ITL_BUCKETS, TOKENS_PER_RESPONSE_BUCKETS])
def test_buckets_increase_strictly_as_triton_requires(buckets):
    assert all(a < b for a, b in zip(buckets, buckets[1:]))


def test_the_buckets_resolve_a_cpu_and_a_gpu_step():
    """A GPU decode step of ~8 ms and a 2-core CPU step of ~60 ms fall in different buckets, each with a bucket
    below it; a gamma of up to 12 resolves burst by burst."""
    assert any(b < 0.008 for b in ITL_BUCKETS) and any(0.008 < b < 0.06 for b in ITL_BUCKETS)
    assert any(b > 0.2 for b in ITL_BUCKETS)
    assert set(range(1, 7)) <= set(TOKENS_PER_RESPONSE_BUCKETS) and max(TOKENS_PER_RESPONSE_BUCKETS) > 13
