"""ServerBenchReport's JSON: the keys `bench --url --json` has always written, read back into the same report."""

from __future__ import annotations

import json

import pytest

from specdeploy.bench.server_results import ServerBenchReport, milliseconds
from specdeploy.errors import SpecdeployError


def latency(first: float | None) -> dict:
    """One mode's latencies as bench --url wrote them (keys and nesting; the values are made up)."""
    return {"time_to_first_token": {"p50": first, "p90": first, "p99": first},
            "inter_token_latency": {"p50": 0.02, "p90": 0.03, "p99": 0.04},
            "request_latency": {"p50": 0.5, "p99": 0.6}, "tokens_per_s_per_request": {"p50": 40.0},
            "response_gap": {"p50": 0.05, "p90": 0.06, "p99": 0.07},
            "tokens_per_response": {"mean": 2.5, "p50": 3.0, "p99": 3.0},
            "inter_token_latencies": [0.02, 0.03], "response_gaps": [0.05, 0.06]}


def level(concurrency: int, priced: bool) -> dict:
    row = {"concurrency": concurrency, "requests": 4, "speculative_tokens_per_s": 30.0, "plain_tokens_per_s": 20.0,
           "speedup": 1.5, "acceptance_rate": 0.8, "failed": 0, "speculative_latency": latency(0.1),
           "plain_latency": latency(None)}
    if priced:
        row.update(plain_usd_per_million_tokens=50.0, speculative_usd_per_million_tokens=None)
    return row | {"vs_single_stream": None if concurrency != 1 else 1.0}


EARLIER = {"url": "127.0.0.1:8001", "max_tokens": 64, "price_per_hour": 3.6, "levels": [level(1, True), level(2, True)],
           "in_process_tokens_per_s": 40.0, "single_stream_vs_in_process": 0.75}
UNPRICED = {"url": "127.0.0.1:8001", "max_tokens": None, "price_per_hour": None, "levels": [level(2, False)]}


@pytest.mark.parametrize("written", [EARLIER, UNPRICED], ids=["priced, with the pipeline", "unpriced"])
def test_an_earlier_server_report_loads_and_writes_back_the_same_json(written):
    report = ServerBenchReport.from_json(json.loads(json.dumps(written)))
    assert json.dumps(report.to_json()) == json.dumps(written)  # the same keys in the same order
    assert report.levels[0].latency("plain").time_to_first_token["p50"] is None
    assert report.levels[0].usd_per_million_tokens("plain") == (50.0 if report.priced else None)


def test_milliseconds_of_no_sample_is_nan_which_plots_leave_out():
    assert milliseconds(0.0125) == 12.5 and milliseconds(None) != milliseconds(None)


def test_an_in_process_report_is_not_a_server_report():
    with pytest.raises(SpecdeployError, match="not a bench --url report"):
        ServerBenchReport.from_json({"baseline_tokens_per_s": 1.0})
