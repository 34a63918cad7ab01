"""A real tritonserver serving SmolLM2 fp32 with each method that drafts inside the target's own engine (the shipped
EAGLE-3 head, lookahead decoding, and an early exit at a fixed layer), driven over gRPC: streamed and single
responses equal plain greedy text, concurrent streams are batched correctly, and acceptance is counted per request
kind under the method's label."""

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

# the shipped pipelines in fp32; the early exit at a layer whose drafts are accepted now and then (26 of 30), so no
# build sweep runs here
PIPELINES = {"eagle": ("smollm2-eagle.yaml", {}),
             "lookahead": ("smollm2-lookahead.yaml", {}),
             "early_exit": ("experimental/smollm2-early-exit.yaml", {"exit_layer": 26})}


@pytest.fixture(scope="module", params=list(PIPELINES))
def served(request, tmp_path_factory):
    method = request.param
    file, changes = PIPELINES[method]
    root = tmp_path_factory.mktemp(f"triton-{method}")
    spec = yaml.safe_load((REPO / "pipelines" / file).read_text())
    spec["name"] = f"{spec['name']}-fp32"
    spec["target"]["dtype"] = "float32"
    spec["target"].pop("weight_only", None)  # the int4 kernels take bf16 activations: fp32 is the plain target
    spec["speculation"][method] = {**spec["speculation"][method], **changes}
    if method == "eagle":
        spec["speculation"]["eagle"]["head"] = str(REPO / "pipelines" / spec["speculation"]["eagle"]["head"])
    spec["serving"] = {"request_kinds": ["code"]}
    engine_dir = build(load_pipeline(write_pipeline(root / f"{method}.yaml", **spec)), root / "engines",
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
    server, engine = served
    run_concurrent_streams(server, engine, 4)


def test_acceptance_is_counted_per_request_kind(served):
    server, engine = served
    labels = {"model": "speculative", "method": engine.method, "request_kind": "code"}
    before = scrape(server.metrics_url)
    stats = list(generate(server.grpc_url, PROMPTS[1], MAX_TOKENS, request_kind="code"))[-1].statistics
    assert stats["total_draft_tokens"] > 0
    for name, key in (("specdeploy_drafted_tokens_total", "total_draft_tokens"),
                      ("specdeploy_accepted_tokens_total", "total_accepted_draft_tokens")):
        deadline = time.monotonic() + 10
        while total(scrape(server.metrics_url), name, **labels) - total(before, name, **labels) != stats[key]:
            assert time.monotonic() < deadline, name
            time.sleep(0.2)
