"""A real tritonserver on free ports serving the SmolLM2 fp32 draft-target repository, driven over gRPC."""

from __future__ import annotations

import threading
import time
import urllib.request

import numpy as np
import pytest
from helpers.repo import REPO
from helpers.served import (
    LONG,
    MAX_TOKENS,
    PROMPTS,
    check_greedy_entry_point,
    first_stream_answer,
    infer_input,
    plain_text,
    read_config,
    run_concurrent_streams,
    wait_for_idle,
)

from specdeploy.errors import RequestError
from specdeploy.package.repository import model_configs, write_repository
from specdeploy.serve.client import generate
from specdeploy.serve.metrics_scrape import scrape, total
from specdeploy.serve.tritonserver import TritonServer

pytestmark = [pytest.mark.smollm2, pytest.mark.slow]


@pytest.fixture(scope="module")
def served(smollm2_fp32_engines, tmp_path_factory):
    engine = smollm2_fp32_engines["draft-target"]
    root = tmp_path_factory.mktemp("triton")
    repository = write_repository(engine.dir, root / "repository")
    with TritonServer(repository, log_file=root / "tritonserver.log") as server:
        yield server, engine


def test_generated_configs_parse_as_triton_model_configs(served):
    server, _ = served
    for name in ("preprocessing", "speculative", "ensemble"):
        assert read_config(server.model_repository / name / "config.pbtxt").name == name


@pytest.mark.parametrize("model", ["speculative", "ensemble"])
def test_streaming_and_non_streaming_equal_plain_greedy(served, model):
    """Both entry points: the speculative model called with text, and tensorrtllm_backend's ensemble."""
    server, engine = served
    check_greedy_entry_point(server, engine, model)


def test_sixteen_concurrent_streams_are_correct_and_independent(served):
    server, engine = served
    run_concurrent_streams(server, engine, 16)


@pytest.mark.parametrize("fields, message", [
    ({"prompt": " "}, "text_input: must not be empty"),
    ({"prompt": "word " * 1500}, "prompt: 1531 tokens is over limits.max_input_length (1024)"),
    ({"max_tokens": -3}, "max_tokens: must be ≥ 1, got -3"),
    ({"max_tokens": 10**6}, "max_tokens: prompt (35 tokens) + max_tokens (1000000) is over "
                            "limits.max_sequence_length (2048)"),
    ({"top_p": 1.5}, "top_p: must be in (0, 1], got 1.5"),
    ({"temperature": -1.0}, "temperature: must be ≥ 0 and finite, got -1.0"),
    ({"temperature": float("inf")}, "temperature: must be ≥ 0 and finite, got inf"),
    ({"top_k": -2}, "top_k: must be ≥ 0, got -2"),
    ({"repetition_penalty": 0.0}, "repetition_penalty: must be > 0 and finite, got 0.0"),
    ({"num_draft_tokens": 99}, "num_draft_tokens: must be in [0, 16] (limits.max_draft_tokens), got 99"),
    ({"num_draft_tokens": -1}, "num_draft_tokens: must be in [0, 16] (limits.max_draft_tokens), got -1"),
    ({"end_id": 10**6}, "end_id: must be a token id in [0, 49152) or -1 (none), got 1000000"),
    ({"end_id": -5}, "end_id: must be a token id in [0, 49152) or -1 (none), got -5"),
    ({"kind": "poetry"}, "request_kind: 'poetry' is not one of serving.request_kinds (allowed: chat, code, summary, "
                         "edit, extraction)"),
    ({"stop_strings": ("",)}, "stop_words: word 0 is empty (''); give text that ends the output, or leave it out"),
    ({"stop_strings": (" ", "x")}, "stop_words: word 0 is only whitespace (' '); give text that ends the output, "
                                   "or leave it out"),
    ({"kind": "Bad Kind"}, "request_kind: 'Bad Kind' is not a kind: a lowercase letter, then up to 31 lowercase "
                           "letters, digits or underscores"),
], ids=lambda value: value if isinstance(value, str) else None)
def test_bad_requests_get_one_outcome_in_process_and_over_grpc(served, fields, message):
    """The same bad request is refused with the same text in-process (the CLI's path) and over gRPC through both
    entry points (INVALID_ARGUMENT), and the server stays healthy."""
    from specdeploy.workflows import RequestOptions, generate_in_process

    server, engine = served
    fields = dict(fields)
    prompt = fields.pop("prompt", PROMPTS[1])
    fields.setdefault("max_tokens", 8)
    with pytest.raises(RequestError) as in_process:
        generate_in_process(engine, prompt, RequestOptions(**fields), False, lambda text: None)
    assert str(in_process.value) == message
    grpc_fields = RequestOptions(**fields).grpc_fields()
    max_tokens = grpc_fields.pop("max_tokens")
    for model in ("speculative", "ensemble"):
        with pytest.raises(RequestError) as over_grpc:
            list(generate(server.grpc_url, prompt, max_tokens, model=model, **grpc_fields))
        assert message in str(over_grpc.value)
    assert server.ready()
    assert "".join(c.text for c in generate(server.grpc_url, PROMPTS[1], 8)) == plain_text(engine, PROMPTS[1], 8)


def test_acceptance_is_counted_per_request_kind(served):
    """Requests naming a kind from serving.request_kinds move that kind's acceptance counters by exactly their own
    drafted and accepted tokens; a request without one counts as "unspecified"."""
    server, _ = served
    labels = {"model": "speculative", "method": "draft_target"}
    before = scrape(server.metrics_url)
    sent = {"code": PROMPTS[1], "summary": PROMPTS[2], None: PROMPTS[0]}
    statistics = {kind: list(generate(server.grpc_url, prompt, MAX_TOKENS, request_kind=kind))[-1].statistics
                  for kind, prompt in sent.items()}
    for kind, stats in statistics.items():
        label = kind or "unspecified"
        for name, key in (("specdeploy_drafted_tokens_total", "total_draft_tokens"),
                          ("specdeploy_accepted_tokens_total", "total_accepted_draft_tokens")):
            deadline = time.monotonic() + 10
            while (total(scrape(server.metrics_url), name, request_kind=label, **labels)
                   - total(before, name, request_kind=label, **labels)) != stats[key]:
                assert time.monotonic() < deadline, (name, label)
                time.sleep(0.2)
    assert statistics["code"]["total_draft_tokens"] > 0


def test_wrong_dtype_and_unknown_input_are_rejected_by_name(served):
    from tritonclient.utils import InferenceServerException

    server, _ = served
    wrong = infer_input("max_tokens", "FP32", np.array([[3.0]], dtype=np.float32))
    text = infer_input("text_input", "BYTES", np.array([[b"hi"]], dtype=object))
    unknown = infer_input("beam_width_x", "INT32", np.array([[1]], dtype=np.int32))
    for inputs, name in (([text, wrong], "max_tokens"), ([text, unknown], "beam_width_x")):
        _, error = first_stream_answer(server, "ensemble", inputs)
        assert isinstance(error, InferenceServerException) and name in error.message()
    assert server.ready()


def test_a_cancelled_stream_frees_its_row_at_once(served):
    """Through the default entry point (the speculative model, with text), a client that stops reading cancels
    its stream, and the row and KV reservation are freed within a step, counted as cancelled. (Triton 2.51 passes
    an ensemble's cancellation only to steps it has not started yet, core PR #263, server issue #6739, which is
    why clients call the speculative model.)"""
    server, _ = served
    labels = {"model": "speculative", "method": "draft_target"}
    capacity = total(scrape(server.metrics_url), "specdeploy_free_kv_slots", **labels)
    assert capacity == 8 * 2048  # limits.max_batch_size rows at max_sequence_length, all free
    cancelled_before = total(scrape(server.metrics_url), "specdeploy_requests_total", outcome="cancelled")
    stream = generate(server.grpc_url, LONG, 1500, end_id=-1)
    for _ in range(3):
        next(stream)
    assert total(scrape(server.metrics_url), "specdeploy_free_kv_slots", **labels) < capacity
    stream.close()  # stops the stream, cancelling its request
    wait_for_idle(server, capacity, 5)
    assert total(scrape(server.metrics_url), "specdeploy_requests_total", outcome="cancelled") == cancelled_before + 1


def test_requests_beyond_the_batch_show_as_waiting(served):
    """specdeploy_waiting_requests (the autoscaler's queue signal for a decoupled model, whose requests Triton hands
    over at once) counts the requests queued behind a full batch, and returns to 0 when they have run."""
    server, _ = served
    labels = {"model": "speculative", "method": "draft_target"}
    capacity = total(scrape(server.metrics_url), "specdeploy_free_kv_slots", **labels)
    assert total(scrape(server.metrics_url), "specdeploy_waiting_requests", **labels) == 0
    rows, extra = 8, 3  # limits.max_batch_size, and requests beyond it
    seen, errors = [], []

    def client() -> None:
        try:
            for _ in generate(server.grpc_url, LONG, 64, end_id=-1):
                pass
        except Exception as error:  # noqa: BLE001 - reported below
            errors.append(error)

    threads = [threading.Thread(target=client) for _ in range(rows + extra)]
    for thread in threads:
        thread.start()
    while any(thread.is_alive() for thread in threads):
        seen.append(total(scrape(server.metrics_url), "specdeploy_waiting_requests", **labels))
        time.sleep(0.05)
    for thread in threads:
        thread.join()
    assert not errors
    # Requests arriving while a step runs wait for the next admission too, so more than `extra` may show at once
    assert 1 <= max(seen) < rows + extra
    wait_for_idle(server, capacity, 5)
    assert total(scrape(server.metrics_url), "specdeploy_waiting_requests", **labels) == 0


def test_a_disconnected_client_frees_its_row(served, tmp_path):
    """A client process killed mid-stream (no cancel sent, the connection just drops)."""
    import signal
    import subprocess
    import sys

    server, _ = served
    capacity = total(scrape(server.metrics_url), "specdeploy_free_kv_slots", model="speculative", method="draft_target")
    script = tmp_path / "client.py"
    script.write_text("import sys\nfrom specdeploy.serve.client import generate\n"
                      f"for chunk in generate({server.grpc_url!r}, {LONG!r}, 1500, end_id=-1):\n"
                      "    print('chunk', flush=True)\n")
    client = subprocess.Popen([sys.executable, str(script)], stdout=subprocess.PIPE, text=True, cwd=REPO)
    try:
        for _ in range(3):
            assert client.stdout.readline().startswith("chunk")
    finally:
        client.send_signal(signal.SIGKILL)
        client.wait()
    wait_for_idle(server, capacity, 10)


def test_missing_or_misshapen_inputs_are_errors_naming_them(served):
    """Each entry point refuses a request without its required input, a batch of prompts in one request, or
    an input of the wrong shape, with INVALID_ARGUMENT naming the input and no traceback."""
    from tritonclient.utils import InferenceServerException

    server, engine = served
    ids = np.array([engine.encode_prompt("Hi")], dtype=np.int32)
    cases = [
        ("ensemble", [infer_input("max_tokens", "INT32", np.array([[4]], dtype=np.int32))], "text_input: required"),
        ("speculative", [infer_input("max_tokens", "INT32", np.array([[4]], dtype=np.int32))],
         "text_input: required"),
        ("preprocessing", [infer_input("stop_words", "BYTES", np.array([[b"x"]], dtype=object))],
         "text_input: required"),
        ("speculative", [infer_input("input_ids", "INT32", np.concatenate([ids, ids]))],
         "input_ids: expected one row per request"),
        ("speculative", [infer_input("input_ids", "INT32", ids),
                         infer_input("text_input", "BYTES", np.array([[b"Hi"]], dtype=object))], "not both"),
        ("preprocessing", [infer_input("text_input", "BYTES", np.array([[b"a"], [b"b"]], dtype=object))],
         "text_input: expected one string per request"),
    ]
    for model, inputs, message in cases:
        result, error = first_stream_answer(server, model, inputs)
        assert isinstance(error, InferenceServerException), (model, message, result)
        assert message in error.message() and "Traceback" not in error.message(), (model, error.message())
    assert server.ready()


def test_model_configs_use_tensorrtllm_backend_names(served):
    from specdeploy.spec.pipeline import load_pipeline

    server, engine = served
    from google.protobuf import text_format

    configs = {name: text_format.MessageToString(config)
               for name, config in model_configs(load_pipeline(REPO / "pipelines" / "smollm2-ngram.yaml")).items()}
    ensemble = configs["ensemble"]
    for name in ("text_input", "max_tokens", "temperature", "top_k", "top_p", "random_seed", "stop_words", "end_id",
                 "stream", "num_draft_tokens", "text_output", "total_draft_tokens", "total_accepted_draft_tokens",
                 "acceptance_rate"):
        assert f'name: "{name}"' in ensemble
    assert "decoupled: true" in configs["speculative"]


def test_generate_url_and_bench_url_commands(served, tmp_path):
    import json

    from helpers.cli import run_cli

    server, engine = served
    expected = plain_text(engine, PROMPTS[2], 16)
    for stream in ("--stream", "--no-stream"):
        result = run_cli("generate", "--url", server.grpc_url, PROMPTS[2], "--max-tokens", "16", stream, "--json")
        assert result.returncode == 0, result.stderr
        report = json.loads(result.stdout)
        assert report["text"] == expected and report["generated_tokens"] <= 16 and report["tokens_per_s"] > 0
    wrong = run_cli("generate", "--url", server.grpc_url, "pipeline.yaml", PROMPTS[2])
    assert wrong.returncode == 2 and "with --url give only the PROMPT" in wrong.stderr
    bad = run_cli("generate", "--url", server.grpc_url, PROMPTS[2], "--top-p", "2")
    assert bad.returncode == 2 and "top_p" in bad.stderr
    out = tmp_path / "server.json"
    result = run_cli("bench", "--url", server.grpc_url, "--concurrency", "1,2", "--requests", "2", "--max-tokens", "8",
                     "--json", str(out), "--price-per-hour", "3.6", "--report", str(tmp_path / "report"))
    assert result.returncode == 0, result.stderr
    levels = json.loads(out.read_text())["levels"]
    assert [level["concurrency"] for level in levels] == [1, 2]
    assert all(level["speculative_tokens_per_s"] > 0 and level["plain_tokens_per_s"] > 0 and level["failed"] == 0
               for level in levels)
    for level in levels:  # two requests of 8 tokens per mode: a first token, then 7 more
        for mode in ("speculative", "plain"):
            latency = level[f"{mode}_latency"]
            ttft, itl = latency["time_to_first_token"], latency["inter_token_latency"]
            assert 0 < ttft["p50"] <= ttft["p99"] and 0 < itl["p50"] <= itl["p99"]
            assert len(latency["inter_token_latencies"]) == 2
            assert latency["request_latency"]["p50"] > ttft["p50"]
        assert level["plain_latency"]["tokens_per_response"]["mean"] == 1.0  # plain decode: one token a step
        assert level["speculative_latency"]["tokens_per_response"]["mean"] > 1.0  # accepted drafts: bursts
    report_md = (tmp_path / "report" / "report.md").read_text()
    assert "genai-perf" in result.stdout and "TTFT p99" in report_md
    for level in levels:  # $3.60 an hour: a million tokens at r tokens/s cost 1000 / r dollars
        for mode in ("speculative", "plain"):
            assert level[f"{mode}_usd_per_million_tokens"] == pytest.approx(1000 / level[f"{mode}_tokens_per_s"])
            assert f" ${level[f'{mode}_usd_per_million_tokens']:.2f} |" in report_md  # report.md's level table
    assert run_cli("bench", "--url", server.grpc_url, "--concurrency", "1,x").returncode == 2


def test_random_cancellations_lose_and_corrupt_nothing(served):
    """Concurrent streams through the default entry point, a third dropped at random mid-stream: every other
    response arrives complete and equal to its prompt served alone (fp32, so batching changes no argmax), the
    server counts the dropped ones as cancelled (those it had not finished already), and it is idle at once."""
    from specdeploy.bench.server_runs import run_stress

    server, _ = served
    capacity = total(scrape(server.metrics_url), "specdeploy_free_kv_slots", model="speculative", method="draft_target")
    cancelled_before = total(scrape(server.metrics_url), "specdeploy_requests_total", outcome="cancelled")
    report = run_stress(server.grpc_url, PROMPTS, requests=32, concurrency=8, max_tokens=48, cancel_fraction=0.3,
                        metrics_url=server.metrics_url)
    assert report["cancelled"] > 0 and report["finished"] > 0
    assert report["finished"] + report["cancelled"] == 32
    assert report["failed"] == report["lost"] == report["corrupted"] == 0
    assert report["idle_after_s"] < 1
    wait_for_idle(server, capacity, 1)
    counted = total(scrape(server.metrics_url), "specdeploy_requests_total", outcome="cancelled") - cancelled_before
    assert 0 < counted == report["server_cancelled"] <= report["cancelled"]
    assert server.ready()


def test_a_moved_repository_serves(served, tmp_path):
    """The repository carries its engine and tokenizers and names them by relative paths: packaged in one place,
    moved to another, it serves the same text."""
    import shutil

    _, engine = served
    written = write_repository(engine.dir, tmp_path / "written")
    for name in ("preprocessing", "speculative", "ensemble"):
        config = (written / name / "config.pbtxt").read_text()
        assert str(tmp_path) not in config and str(engine.dir) not in config
    moved = tmp_path / "elsewhere" / "repository"
    moved.parent.mkdir()
    shutil.move(written, moved)
    assert not written.exists()
    with TritonServer(moved, log_file=tmp_path / "moved.log") as server:
        text = "".join(c.text for c in generate(server.grpc_url, PROMPTS[2], 12))
    assert text == plain_text(engine, PROMPTS[2], 12)


def test_long_stream_report(served):
    """bench --url --long-stream: the same greedy generation streamed and in-process, exactly N tokens each
    (end_id -1), with the speed figures docs/benchmarks.md reports."""
    from specdeploy.bench.server_runs import run_long_stream

    server, engine = served
    report = run_long_stream(server.grpc_url, engine, PROMPTS[0], 40, repeats=1)
    for mode in ("speculative", "plain"):
        for where in ("in_process", "grpc_stream"):
            figures = report[mode][where]
            assert figures["tokens"] == 40
            assert figures["tokens_per_s"] > 0 and figures["first_quarter_tokens_per_s"] > 0
            assert figures["last_fifth_tokens_per_s"] > 0
        assert report[mode]["grpc_vs_in_process"] > 0


def test_admin_endpoints_need_the_key_and_the_data_plane_does_not(served):
    """Logging, shared memory, model repository and trace need the server's admin key (HTTP header, gRPC
    metadata); inference, health, metadata and model config stay open, and the config names no absolute path."""
    import json

    import tritonclient.grpc as grpcclient
    from tritonclient.utils import InferenceServerException

    server, engine = served
    base = f"http://{server.address}:{server.http_port}"

    def http(path: str, key: str | None = None, body: dict | None = None) -> tuple[int, str]:
        request = urllib.request.Request(base + path, data=None if body is None else json.dumps(body).encode(),
                                         headers={} if key is None else {"specdeploy-admin-key": key})
        try:
            with urllib.request.urlopen(request, timeout=30) as reply:
                return reply.status, reply.read().decode()
        except urllib.error.HTTPError as error:
            return error.code, error.read().decode()

    for path, body in (("/v2/logging", {"log_verbose_level": 1}), ("/v2/systemsharedmemory/status", None),
                       ("/v2/repository/index", {}), ("/v2/trace/setting", None)):
        status, text = http(path, body=body)
        assert status == 403 and "specdeploy-admin-key" in text, (path, status, text)
        assert http(path, "wrong", body)[0] == 403
    assert http("/v2/logging", server.admin_key)[0] == 200
    assert http("/v2/health/ready")[0] == 200
    status, config = http("/v2/models/speculative/config")
    assert status == 200 and '"engine"' in config and str(engine.dir) not in config
    client = grpcclient.InferenceServerClient(server.grpc_url)
    with pytest.raises(InferenceServerException, match="UNAVAILABLE|restricted"):
        client.get_log_settings()
    metadata = {"triton-grpc-protocol-specdeploy-admin-key": server.admin_key}
    assert "log_verbose_level" in client.get_log_settings(headers=metadata, as_json=True)["settings"]
    assert client.is_server_ready()


@pytest.mark.parametrize("model", ["speculative", "ensemble"])
def test_stop_words_stop_where_their_text_appears(served, model):
    """Over gRPC: " Paris" and "Paris" (different token ids alone) both end the answer with the stop string,
    which stays in the text; a stop string ending inside a token cuts the rest of that token's text."""
    server, engine = served
    prompt = "What is the capital of France?"
    full = plain_text(engine, prompt, 32)
    assert " Paris" in full
    for stop in (" Paris", "Paris", "Pari"):
        text = "".join(c.text for c in generate(server.grpc_url, prompt, 32, model=model, stop_words=[stop]))
        assert text == full[:full.index(stop) + len(stop)]
