"""A real tritonserver serving SmolLM2 fp32 with the shipped EAGLE-3 head, driven over gRPC: streamed and single
responses equal plain greedy text, concurrent streams are batched correctly and counted, and acceptance is counted
per request kind."""

from __future__ import annotations

import time

import pytest
import yaml
from helpers.pipelines import write_pipeline
from helpers.repo import REPO
from helpers.served import MAX_TOKENS, PROMPTS, check_greedy_entry_point, run_concurrent_streams

from specdeploy.build.torch_engine import build
from specdeploy.package.repository import write_repository
from specdeploy.runtime.engine import Engine
from specdeploy.serve.client import generate
from specdeploy.serve.metrics_scrape import scrape, total
from specdeploy.serve.tritonserver import TritonServer
from specdeploy.spec.pipeline import load_pipeline

pytestmark = [pytest.mark.smollm2, pytest.mark.slow]


@pytest.fixture(scope="module")
def served(tmp_path_factory):
    root = tmp_path_factory.mktemp("triton-eagle")
    spec = yaml.safe_load((REPO / "pipelines" / "smollm2-eagle.yaml").read_text())
    spec["name"] = "smollm2-eagle-fp32"
    spec["target"]["dtype"] = "float32"
    spec["speculation"]["eagle"]["head"] = str(REPO / "pipelines" / spec["speculation"]["eagle"]["head"])
    spec["serving"] = {"request_kinds": ["code"]}
    engine_dir = build(load_pipeline(write_pipeline(root / "eagle.yaml", **spec)), root / "engines",
                       quiet=True).directory
    engine = Engine(engine_dir)
    with TritonServer(write_repository(engine_dir, root / "repository"),
                      log_file=root / "tritonserver.log") as server:
        yield server, engine


@pytest.mark.parametrize("model", ["speculative", "ensemble"])
def test_streaming_and_non_streaming_equal_plain_greedy(served, model):
    server, engine = served
    check_greedy_entry_point(server, engine, model)


def test_concurrent_streams_are_correct_and_counted(served):
    """Four streams at once: rows batched past the policy's full_up_to (trees cut to a smaller depth), each text
    still plain greedy's, some responses carrying several tokens."""
    server, engine = served
    run_concurrent_streams(server, engine, 4)


def test_acceptance_is_counted_per_request_kind(served):
    server, _ = served
    labels = {"model": "speculative", "method": "eagle", "request_kind": "code"}
    before = scrape(server.metrics_url)
    stats = list(generate(server.grpc_url, PROMPTS[1], MAX_TOKENS, request_kind="code"))[-1].statistics
    assert stats["total_accepted_draft_tokens"] > 0
    for name, key in (("specdeploy_drafted_tokens_total", "total_draft_tokens"),
                      ("specdeploy_accepted_tokens_total", "total_accepted_draft_tokens")):
        deadline = time.monotonic() + 10
        while total(scrape(server.metrics_url), name, **labels) - total(before, name, **labels) != stats[key]:
            assert time.monotonic() < deadline, name
            time.sleep(0.2)
