"""Serving SmolLM2 through a real tritonserver: the prompts and the checks the torch flavour's server tests and the
trtllm flavour's run alike."""

from __future__ import annotations

import threading
import time

import numpy as np
import pytest

from specdeploy.serve.client import generate
from specdeploy.serve.metrics_scrape import scrape, total
from specdeploy.spec.sampling_params import SamplingParams

PROMPTS = ["Write a haiku about the sea.", "List three prime numbers.", "What is the capital of France?",
           "Give me a short tip for learning to code."]
MAX_TOKENS = 24
LONG = "Write a very long story about a dragon and a knight."


def read_config(path):
    """A config.pbtxt parsed as Triton's ModelConfig (unknown fields and bad enums fail)."""
    from google.protobuf import text_format
    from tritonclient.grpc import model_config_pb2

    return text_format.Parse(path.read_text(), model_config_pb2.ModelConfig())


def infer_input(name: str, data_type: str, value: np.ndarray):
    """A tritonclient gRPC input holding `value` as Triton data type `data_type` ("INT32", "BYTES", ...)."""
    import tritonclient.grpc as grpcclient

    tensor = grpcclient.InferInput(name, list(value.shape), data_type)
    tensor.set_data_from_numpy(value)
    return tensor


def first_stream_answer(server, model: str, inputs: list) -> tuple[object, object]:
    """Sent to `model` on a stream of its own, as tritonclient's raw API sends it (no checks of ours on the way):
    the first (result, error) the server answers with."""
    import tritonclient.grpc as grpcclient

    client = grpcclient.InferenceServerClient(server.grpc_url)
    answers: list = []
    client.start_stream(callback=lambda result, error: answers.append((result, error)))
    try:
        client.async_stream_infer(model, inputs)
        deadline = time.monotonic() + 30
        while not answers:
            assert time.monotonic() < deadline, f"{model}: no answer"
            time.sleep(0.05)
    finally:
        client.stop_stream()
        client.close()
    return answers[0]


def plain_text(engine, prompt: str, max_tokens: int = MAX_TOKENS) -> str:
    tokens = engine.generate(engine.encode_prompt(prompt), SamplingParams(), max_tokens, num_draft_tokens=0).run()
    return engine.decode(tokens)


def check_greedy_entry_point(server, engine, model: str) -> dict:
    """Through `model`: streamed and single-response greedy text equal to plain decoding in-process, consistent
    statistics, and a stop word ending the text. Returns the single response's statistics."""
    expected = plain_text(engine, PROMPTS[0])
    chunks = list(generate(server.grpc_url, PROMPTS[0], MAX_TOKENS, stream=True, temperature=0.0, model=model))
    assert len(chunks) > 2 and chunks[-1].final
    assert "".join(c.text for c in chunks) == expected
    single = list(generate(server.grpc_url, PROMPTS[0], MAX_TOKENS, stream=False, model=model))
    assert len(single) == 1 and single[0].text == expected
    stats = single[0].statistics
    assert 0 < stats["total_accepted_draft_tokens"] <= stats["total_draft_tokens"]
    assert stats["acceptance_rate"] == pytest.approx(stats["total_accepted_draft_tokens"]
                                                     / stats["total_draft_tokens"], rel=1e-6)
    stopped = "".join(c.text for c in generate(server.grpc_url, PROMPTS[0], MAX_TOKENS, model=model,
                                               stop_words=["\n"]))
    assert stopped == expected[:expected.index("\n") + 1]
    return stats


def run_concurrent_streams(server, engine, count: int, bursts: bool = True) -> None:
    """`count` concurrent streaming clients over the prompts: each gets plain greedy text, the drafted and accepted
    counters move by exactly what the clients' statistics say, and each request is counted as finished."""
    expected = {p: plain_text(engine, p) for p in PROMPTS}
    before = scrape(server.metrics_url)
    results: dict[int, tuple[str, dict]] = {}
    errors = []

    def client(index: int) -> None:
        try:
            chunks = list(generate(server.grpc_url, PROMPTS[index % 4], MAX_TOKENS, stream=True))
            results[index] = ("".join(c.text for c in chunks), chunks[-1].statistics)
        except Exception as exc:  # collected, so a failure names the client
            errors.append((index, exc))

    threads = [threading.Thread(target=client, args=(i,)) for i in range(count)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(300)
    assert not errors
    assert {i: text for i, (text, _) in results.items()} == {i: expected[PROMPTS[i % 4]] for i in range(count)}
    labels = {"model": "speculative", "method": engine.method}
    for name, key in (("specdeploy_drafted_tokens_total", "total_draft_tokens"),
                      ("specdeploy_accepted_tokens_total", "total_accepted_draft_tokens")):
        seen = sum(stats[key] for _, stats in results.values())
        settled_metrics(server, lambda metrics, name=name: total(metrics, name, **labels)
                        - total(before, name, **labels), seen, name)
    after = settled_metrics(server, lambda metrics: sum(
        total(metrics, "specdeploy_requests_total", outcome=outcome)
        - total(before, "specdeploy_requests_total", outcome=outcome) for outcome in ("length", "stop")), count,
        "requests counted as finished")
    check_latency_histograms(before, after, labels, [stats for _, stats in results.values()], bursts)


def settled_metrics(server, moved, expected: float, what: str, seconds: float = 10) -> dict:
    """The server's metrics once `moved(metrics)` equals `expected`: a request's counters move just after its final
    response is sent, so a client can see its last token before they do."""
    deadline = time.monotonic() + seconds
    while (got := moved(metrics := scrape(server.metrics_url))) != expected:
        assert time.monotonic() < deadline, f"{what}: {got}, expected {expected}"
        time.sleep(0.2)
    return metrics


def check_latency_histograms(before: dict, after: dict, labels: dict, statistics: list[dict], bursts: bool) -> None:
    """The histograms moved by the finished streams (serve/latency.py): one time to first token and one inter-token
    latency each, every generated token in exactly one response; with `bursts`, some responses carrying several
    tokens (speculation's accepted drafts)."""

    def moved(name: str, **extra: str) -> float:
        return total(after, name, **labels, **extra) - total(before, name, **labels, **extra)

    requests, tokens = len(statistics), sum(stats["generated_tokens"] for stats in statistics)
    for name in ("specdeploy_time_to_first_token_seconds", "specdeploy_inter_token_latency_seconds"):
        assert moved(f"{name}_count") == requests, name
        assert moved(f"{name}_bucket", le="+Inf") == requests and moved(f"{name}_sum") > 0, name
    assert moved("specdeploy_tokens_per_response_sum") == tokens
    responses = moved("specdeploy_tokens_per_response_count")
    assert requests <= responses <= tokens
    if bursts:
        assert responses < tokens and moved("specdeploy_tokens_per_response_bucket", le="1") < responses
    # a request's ITL is at most its whole decode time over its tokens after the first
    itl = moved("specdeploy_inter_token_latency_seconds_sum") / requests
    assert 0 < itl < 10


def wait_for_idle(server, capacity: float, seconds: float) -> None:
    """Until the scheduler's KV slots are all free and its batch is empty (AssertionError after `seconds`)."""
    labels = {"model": "speculative", "method": "draft_target"}
    deadline = time.monotonic() + seconds
    while (total(scrape(server.metrics_url), "specdeploy_free_kv_slots", **labels) != capacity
           or total(scrape(server.metrics_url), "specdeploy_batch_size", **labels) != 0):
        assert time.monotonic() < deadline, "the request still holds its row"
        time.sleep(0.1)
