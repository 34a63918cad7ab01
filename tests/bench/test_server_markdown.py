"""`bench --url --report DIR`: report.md's level and latency tables and the plots, from levels made by hand."""

from __future__ import annotations

import dataclasses
import json

from helpers.repo import REPO
from PIL import Image

from specdeploy.bench.server_load import LevelResult, RequestResult
from specdeploy.bench.server_markdown import write_server_report
from specdeploy.bench.server_results import RequestLatencies, ServerBenchReport, ServerLevel
from specdeploy.serve.latency import RequestTiming
from specdeploy.spec.pipeline import load_pipeline


def latencies(concurrency: int, burst: int) -> RequestLatencies:
    """A level's latency summary from requests whose tokens arrive `burst` at a time every 50 ms x streams."""
    results = []
    for index in range(4):
        timing = RequestTiming(0.0)
        for step in range(12 // burst):
            timing.produced(burst if step else 1, 0.1 * concurrency + 0.05 * concurrency * step + 0.01 * index)
        results.append(RequestResult(index, generated_tokens=timing.tokens, finished=True, timing=timing))
    return LevelResult(concurrency, burst > 1, 1.0, results).latencies()


def test_the_server_report_plots_concurrency_and_the_policy(tmp_path):
    """bench --url --report: the levels' table and the throughput plot, with the served pipeline's policy."""
    rows = [ServerLevel(concurrency=c, requests=2 * c, speculative_tokens_per_s=s, plain_tokens_per_s=p,
                        speedup=s / p, acceptance_rate=a, failed=0, vs_single_stream=s / 30.0,
                        speculative_latency=latencies(c, 3), plain_latency=latencies(c, 1))
            for c, s, p, a in ((1, 30.0, 22.0, 0.9), (2, 50.0, 40.0, 0.9), (4, 70.0, 66.0, 0.85),
                               (8, 90.0, 90.0, 0.0))]
    server = ServerBenchReport(url="127.0.0.1:8001", max_tokens=64, price_per_hour=None, levels=rows)
    pipeline = load_pipeline(REPO / "pipelines/smollm2-draft-target.yaml")
    text = write_server_report(server, tmp_path, pipeline).read_text()
    assert "| 2 | 50.0 | 40.0 | 1.25× | 0.90 | 0 |" in text
    policy = pipeline.serving.policy
    assert f"up to a batch of {policy.full_up_to}, reduced up to {policy.off_above}" in text
    for name in ("concurrency.png", "latency.png", "itl_cdf.png"):
        with Image.open(tmp_path / name) as image:
            assert image.format == "PNG"
    assert ServerBenchReport.from_json(json.loads((tmp_path / "server.json").read_text())) == server
    # 1 stream: first tokens at 100..130 ms; plain, 12 tokens 50 ms apart: genai-perf's ITL 550 / 11 = 50 ms;
    # speculative, 1 token then 3 bursts of 3, 50 ms apart: ITL 150 / 9 = 17 ms, 2.5 tokens a response, gaps 50 ms
    assert "| 1 | plain | 115 | 127 | 130 | 50 | 50 | 50 | 665 | 680 |" in text
    assert "| 1 | speculative | 115 | 127 | 130 | 17 | 17 | 17 | 265 | 280 |" in text
    assert "| 2.50 | 50 | 50 |" in text and "| 1.00 | 50 | 50 |" in text
    # with --price-per-hour, each level's dollars per million tokens, speculative then plain
    for row in rows:
        row.speculative_usd_per_million_tokens = 1000 / row.speculative_tokens_per_s
        row.plain_usd_per_million_tokens = 1000 / row.plain_tokens_per_s
    priced = dataclasses.replace(server, price_per_hour=3.6)
    text = write_server_report(priced, tmp_path / "priced", pipeline).read_text()
    assert "(at $3.60/h)" in text and "| 2 | 50.0 | 40.0 | 1.25× | 0.90 | 0 | $20.00 | $25.00 |" in text
