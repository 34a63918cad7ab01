"""Which counter a refused request moves (docs/serving.md#metrics), with a real tritonserver serving a tiny engine.

Triton refuses some requests before any model runs (a wrong data type, an input the model does not declare, a shape
or a batch its config does not allow): Triton 2.51 counts them nowhere, and no model of ours sees them to count. The
`preprocessing` model's refusals (the ensemble's first step) move Triton's nv_inference_request_failure of the
ensemble only; the `speculative` model's own refusals move specdeploy_requests_total{outcome="invalid"}, and through
the ensemble Triton's failure counter too.
"""

from __future__ import annotations

import json
import time
import urllib.request

import numpy as np
import pytest
from helpers.served import first_stream_answer, infer_input

from specdeploy.package.repository import write_repository
from specdeploy.serve.metrics_scrape import scrape
from specdeploy.serve.tritonserver import TritonServer

pytestmark = pytest.mark.slow
# the counters that say how a request ended: ours, and Triton's per model
COUNTERS = ("specdeploy_requests_total", "nv_inference_request_success", "nv_inference_request_failure")
TEXT = np.array([[b"Hi"]], dtype=object)


def series(name: str, **labels: str) -> str:
    """One series as the metrics endpoint names it (labels in alphabetical order)."""
    return name + "{" + ",".join(f'{label}="{value}"' for label, value in sorted(labels.items())) + "}"


def invalid(method: str) -> str:
    return series("specdeploy_requests_total", method=method, model="speculative", outcome="invalid")


def succeeded(model: str) -> str:
    return series("nv_inference_request_success", model=model, version="1")


def ensemble_failed() -> str:
    return series("nv_inference_request_failure", model="ensemble", reason="OTHER", version="1")


def counters(server) -> dict[str, float]:
    values = scrape(server.metrics_url) | scrape(server.metrics_url, prefix="nv_")
    return {key: value for key, value in values.items() if key.startswith(COUNTERS)}


def statistics_failures(server, model: str) -> int:
    """The failed requests Triton's statistics extension reports for `model`."""
    url = f"http://{server.address}:{server.http_port}/v2/models/{model}/stats"
    with urllib.request.urlopen(url, timeout=10) as reply:
        return json.load(reply)["model_stats"][0]["inference_stats"]["fail"]["count"]


def moved_counters(server, before: dict[str, float], expected: dict[str, float]) -> dict[str, float]:
    """The counters that moved since `before`, by how much, once they equal `expected` (a request's counters may move
    just after its answer arrives), or as they are after 10 s."""
    deadline = time.monotonic() + 10
    while True:
        after = counters(server)
        moved = {key: after[key] - before.get(key, 0) for key in after if after[key] != before.get(key, 0)}
        if moved == expected or time.monotonic() > deadline:
            return moved
        time.sleep(0.2)


@pytest.fixture(scope="module")
def served(tiny_engines, tmp_path_factory):
    engine = tiny_engines["ngram"]
    root = tmp_path_factory.mktemp("refusal-metrics")
    with TritonServer(write_repository(engine.dir, root / "repository"),
                      log_file=root / "tritonserver.log") as server:
        yield server, engine


def tritons_own_refusals(max_batch_size: int) -> dict[str, tuple[list, str]]:
    """Requests Triton refuses before any model runs: what each sends, and a part of Triton's message."""
    return {
        "wrong data type": ([infer_input("text_input", "BYTES", TEXT),
                             infer_input("max_tokens", "FP32", np.array([[3.0]], dtype=np.float32))],
                            "data-type is 'FP32', but model"),
        "unknown input": ([infer_input("text_input", "BYTES", TEXT),
                           infer_input("beam_width_x", "INT32", np.array([[1]], dtype=np.int32))],
                          "unexpected inference input 'beam_width_x'"),
        "two prompts in a row": ([infer_input("text_input", "BYTES", np.array([[b"a", b"b"]], dtype=object))],
                                 "unexpected shape for input 'text_input'"),
        "batch above max_batch_size": ([infer_input("text_input", "BYTES",
                                                    np.array([[b"a"]] * (max_batch_size + 1), dtype=object))],
                                       f"batch-size must be <= {max_batch_size}"),
    }


def models_refusal() -> list:
    """A request the speculative model itself refuses (a value out of range), counted as invalid."""
    return [infer_input("text_input", "BYTES", TEXT), infer_input("max_tokens", "INT32", np.array([[-5]], np.int32))]


def refused(server, model: str, inputs: list, message: str) -> None:
    result, error = first_stream_answer(server, model, inputs)
    assert error is not None and message in error.message(), (model, message, result, error)


@pytest.mark.parametrize("model", ["speculative", "ensemble"])
def test_tritons_own_refusals_move_no_counter(served, model):
    """Each refusal reaches the client naming the input, and no counter moves for it, nor the failures of Triton's
    statistics extension: only the model refusal sent after them (so that a late count would show) moves ours and
    Triton's success counter."""
    server, engine = served
    before = counters(server)
    failed_before = statistics_failures(server, model)
    for inputs, message in tritons_own_refusals(engine.pipeline.limits.max_batch_size).values():
        refused(server, model, inputs, message)
    refused(server, "speculative", models_refusal(), "max_tokens: must be ≥ 1, got -5")
    expected = {invalid(engine.method): 1, succeeded("speculative"): 1}
    assert moved_counters(server, before, expected) == expected
    assert statistics_failures(server, model) == failed_before
    assert server.ready()


def test_the_preprocessing_models_refusals_count_only_as_ensemble_failures(served):
    """A batch of two prompts through the ensemble is refused by its first step, the preprocessing model, which the
    specdeploy metrics do not cover; Triton 2.51 counts the ensemble's failure twice, and the step as a success."""
    server, engine = served
    before = counters(server)
    refused(server, "ensemble", [infer_input("text_input", "BYTES", np.array([[b"a"], [b"b"]], dtype=object))],
            "text_input: expected one string per request")
    expected = {ensemble_failed(): 2, succeeded("preprocessing"): 1}
    assert moved_counters(server, before, expected) == expected


@pytest.mark.parametrize("model", ["speculative", "ensemble"])
def test_the_speculative_models_refusals_count_as_invalid(served, model):
    """The model's own refusal is counted as invalid through either entry point. Triton counts the decoupled model's
    request a success (its refusal is a response), and through the ensemble a failure of the ensemble (twice)."""
    server, engine = served
    before = counters(server)
    refused(server, model, models_refusal(), "max_tokens: must be ≥ 1, got -5")
    expected = {invalid(engine.method): 1, succeeded("speculative"): 1}
    if model == "ensemble":
        expected |= {ensemble_failed(): 2, succeeded("preprocessing"): 1}
    assert moved_counters(server, before, expected) == expected
