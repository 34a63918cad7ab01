"""bench --url's plain baseline is plain: a server whose engine speculates on every request (TensorRT-LLM Medusa or
lookahead) refuses num_draft_tokens 0, and the bench then stops with an error naming --plain-url instead of printing
a speedup of the engine against itself; with --plain-url the plain requests go to that twin, as it serves by
default."""

from __future__ import annotations

import pytest

from specdeploy.bench import server_runs
from specdeploy.bench.options import BenchOptions, check_options
from specdeploy.bench.server_load import LevelResult, RequestResult
from specdeploy.bench.server_results import ServerBenchReport
from specdeploy.errors import SpecdeployError

REFUSAL = ("num_draft_tokens: this pipeline runs TensorRT-LLM's Medusa decoding inside its target engine, which "
           "speculates on every request")


def fake_servers(monkeypatch, refuses_plain: dict[str, bool]) -> list[tuple[str, int | None]]:
    """Stand-in servers by URL: each request finishes with 10 tokens, except num_draft_tokens 0 where the URL
    refuses it. Returns the (url, num_draft_tokens) of every level run."""
    sent: list[tuple[str, int | None]] = []

    def run_level(url, prompts, concurrency, requests, max_tokens, num_draft_tokens=None, **_):
        sent.append((url, num_draft_tokens))
        refused = num_draft_tokens == 0 and refuses_plain[url]
        results = [RequestResult(i, error=REFUSAL) if refused else
                   RequestResult(i, generated_tokens=10, drafted=4, accepted=2, finished=True)
                   for i in range(requests)]
        return LevelResult(concurrency=concurrency, speculative=num_draft_tokens != 0, seconds=1.0, results=results)

    monkeypatch.setattr(server_runs, "run_level", run_level)
    return sent


def test_a_server_that_refuses_plain_decoding_stops_the_bench_naming_plain_url(monkeypatch):
    fake_servers(monkeypatch, {"medusa:8001": True})
    with pytest.raises(SpecdeployError, match=r"cannot decode plainly on request \(num_draft_tokens: .*--plain-url"):
        server_runs.run_server_bench("medusa:8001", ["a", "b"], [1], 8)


def test_plain_url_measures_the_plain_twin_as_it_serves_by_default(monkeypatch):
    sent = fake_servers(monkeypatch, {"medusa:8001": True, "plain:8001": False})
    report = server_runs.run_server_bench("medusa:8001", ["a", "b"], [1, 4], 8, plain_url="plain:8001")
    assert sent == [("medusa:8001", None), ("plain:8001", None),  # the warm-ups
                    ("medusa:8001", None), ("plain:8001", None), ("medusa:8001", None), ("plain:8001", None)]
    assert report.plain_url == "plain:8001" and all(level.failed == 0 for level in report.levels)
    assert ServerBenchReport.from_json(report.to_json()).plain_url == "plain:8001"
    plain_server = fake_servers(monkeypatch, {"dt:8001": False})  # a server that can: num_draft_tokens 0 there
    server_runs.run_server_bench("dt:8001", ["a"], [1], 8)
    assert plain_server[-1] == ("dt:8001", 0)


def test_plain_url_goes_with_url_s_concurrency_levels_only():
    for options in (BenchOptions(pipeline_paths=("p.yaml",), plain_url="plain:8001"),
                    BenchOptions(url="medusa:8001", plain_url="plain:8001", stress=10)):
        with pytest.raises(SpecdeployError, match="--plain-url"):
            check_options(options)
