"""Lookahead decoding on the trtllm flavour, served for real: a tiny lookahead pipeline built through the
TensorRT-LLM tools' double and packaged, then a real tritonserver serving the repository with the tensorrtllm model
swapped for the Python double of that backend (tests/trtllm_double/backend/, which loads only a config whose
decoding mode and sizes match the engine, and decodes greedily whatever a request samples). Greedy text equals
in-process plain decoding; a sampled request and the per-request lookahead sizes are refused naming the field, at
the client-facing models and at the engine model itself, and the server stays up."""

from __future__ import annotations

import os
import queue

import numpy as np
import pytest
from helpers.pipelines import trtllm_pipeline
from helpers.served import read_config
from helpers.trtllm_served import DOUBLE, swap_in_the_double, tensorrtllm_double_bin

from specdeploy.build.trtllm import engine_build as trtllm
from specdeploy.build.trtllm.engine_build import build as trtllm_build
from specdeploy.build.trtllm.upstream import LOOKAHEAD_REQUEST_INPUTS
from specdeploy.errors import RequestError
from specdeploy.package.repository import TARGET_MODEL, write_repository
from specdeploy.serve.client import generate
from specdeploy.serve.tritonserver import TritonServer
from specdeploy.spec.pipeline import load_pipeline
from specdeploy.spec.sampling_params import SamplingParams

pytestmark = pytest.mark.slow
PROMPTS = ["abcabcabc", "Hello there, "]
MAX_TOKENS = 40


@pytest.fixture(scope="module")
def served(tiny_checkpoints, tiny_engines, tmp_path_factory):
    """The tiny target (the ngram engine's target: the same weights) as a lookahead pipeline, (W, N, G) = (2, 3, 2)."""
    root = tmp_path_factory.mktemp("trtllm-lookahead")
    path = trtllm_pipeline(root, tiny_checkpoints["target"], "lookahead", speculation={
        "method": "lookahead", "lookahead": {"window": 2, "ngram": 3, "verification_set": 2}},
        target={"dtype": "float32"})
    pipeline = load_pipeline(path)
    with pytest.MonkeyPatch.context() as patch:
        patch.setenv("PATH", f"{tensorrtllm_double_bin(root / 'bin')}{os.pathsep}{os.environ['PATH']}")
        patch.setenv("PYTHONPATH", str(DOUBLE))
        patch.setattr(trtllm, "missing_requirements", lambda pipeline: [])
        engine_dir = trtllm_build(pipeline, root / "engines", quiet=True).directory
    repository = write_repository(engine_dir, root / "repository")
    written = read_config(repository / TARGET_MODEL / "config.pbtxt")
    engine = tiny_engines["ngram"]
    swap_in_the_double(repository, {TARGET_MODEL: engine.dir / "target"})
    with TritonServer(repository, log_file=root / "tritonserver.log") as server:
        yield server, engine, written


def plain_text(engine, prompt: str) -> str:
    tokens = engine.generate(engine.encode_prompt(prompt), SamplingParams(), MAX_TOKENS, num_draft_tokens=0).run()
    return engine.decode(tokens)


def test_greedy_text_is_plain_decodings_and_the_engines_steps_are_counted(served):
    server, engine, written = served
    assert written.parameters["decoding_mode"].string_value == "lookahead"  # the double loaded it: sizes match
    for prompt in PROMPTS:
        for model in ("speculative", "ensemble"):
            chunks = list(generate(server.grpc_url, prompt, MAX_TOKENS, model=model, end_id=-1))
            assert "".join(chunk.text for chunk in chunks) == plain_text(engine, prompt), (prompt, model)
    statistics = list(generate(server.grpc_url, PROMPTS[0], MAX_TOKENS, stream=False, end_id=-1))[0].statistics
    assert statistics["generated_tokens"] == MAX_TOKENS
    # each engine step verifies up to (N - 2) + (W - 1 + G)(N - 1) = 7 draft tokens and accepted some of them
    assert statistics["total_draft_tokens"] == 7 * statistics["verification_steps"]
    assert statistics["total_accepted_draft_tokens"] > 0


@pytest.mark.parametrize("fields, message", [
    ({"temperature": 0.7, "random_seed": 3}, "temperature: this pipeline runs TensorRT-LLM's lookahead decoding"),
    ({"repetition_penalty": 1.3}, "repetition_penalty: this pipeline runs TensorRT-LLM's lookahead decoding"),
], ids=["sampled", "penalised"])
def test_requests_the_engine_would_decode_greedily_are_refused_naming_the_field(served, fields, message):
    server, engine, _ = served
    for model in ("speculative", "ensemble"):
        with pytest.raises(RequestError, match=message):
            list(generate(server.grpc_url, PROMPTS[1], 8, model=model, **fields))
    assert server.ready()
    assert "".join(c.text for c in generate(server.grpc_url, PROMPTS[1], MAX_TOKENS, end_id=-1)) == \
        plain_text(engine, PROMPTS[1])


def stream_error(url: str, model: str, inputs: list) -> str:
    """The error message of one streamed request (the models are decoupled), '' if it succeeded."""
    import tritonclient.grpc as grpcclient

    client = grpcclient.InferenceServerClient(url)
    answers: queue.Queue = queue.Queue()
    client.start_stream(callback=lambda result, error: answers.put(error))
    try:
        client.async_stream_infer(model, inputs)
        error = answers.get(timeout=60)
        return "" if error is None else error.message()
    finally:
        client.stop_stream()
        client.close()


def test_per_request_lookahead_sizes_are_refused_by_name_even_at_the_engine_model(served):
    """The client knows no such input; the speculative model and the tensorrt_llm model declare none, so Triton
    refuses a request that carries one before the backend could enqueue it (upstream would not check it against the
    model's sizes before the step ran)."""
    import tritonclient.grpc as grpcclient

    server, engine, _ = served
    with pytest.raises(RequestError, match="lookahead_window_size: not an input of the ensemble"):
        list(generate(server.grpc_url, PROMPTS[0], 8, lookahead_window_size=5))

    def tensor(name: str, array: np.ndarray):
        item = grpcclient.InferInput(name, list(array.shape), "INT32")
        item.set_data_from_numpy(array)
        return item

    prompt = engine.encode_prompt(PROMPTS[0])
    engine_inputs = [tensor("input_ids", np.array([prompt], dtype=np.int32)),
                     tensor("input_lengths", np.array([[len(prompt)]], dtype=np.int32)),
                     tensor("request_output_len", np.array([[4]], dtype=np.int32))]
    assert stream_error(server.grpc_url, TARGET_MODEL, engine_inputs) == ""  # the engine model answers requests
    text = grpcclient.InferInput("text_input", [1, 1], "BYTES")
    text.set_data_from_numpy(np.array([[PROMPTS[0].encode()]], dtype=object))
    for name in LOOKAHEAD_REQUEST_INPUTS:
        size = tensor(name, np.array([[9]], dtype=np.int32))
        for model, inputs in ((TARGET_MODEL, engine_inputs), ("speculative", [text])):
            message = stream_error(server.grpc_url, model, [*inputs, size])
            assert f"unexpected inference input '{name}'" in message, (model, message)
    assert server.ready()


def test_upstream_ensemble_inputs_we_do_not_take_are_refused_naming_them(served):
    """A client written for upstream's ensemble that sends an input we do not take (UPSTREAM_INPUTS_NOT_TAKEN,
    docs/serving.md) learns its name at once: neither `ensemble` nor `speculative` declares it, so Triton refuses the
    request before any model sees it; our client refuses it before sending, saying upstream takes it."""
    import tritonclient.grpc as grpcclient

    from specdeploy.serve.requests import UPSTREAM_INPUTS_NOT_TAKEN

    server, _, _ = served
    with pytest.raises(RequestError, match=r"^seed: not an input of the ensemble \(upstream's ensemble takes it"):
        list(generate(server.grpc_url, PROMPTS[0], 8, seed=1))
    text = grpcclient.InferInput("text_input", [1, 1], "BYTES")
    text.set_data_from_numpy(np.array([[PROMPTS[0].encode()]], dtype=object))
    for name in UPSTREAM_INPUTS_NOT_TAKEN:
        extra = grpcclient.InferInput(name, [1, 1], "INT32")
        extra.set_data_from_numpy(np.array([[1]], dtype=np.int32))
        for model in ("ensemble", "speculative"):
            message = stream_error(server.grpc_url, model, [text, extra])
            assert f"unexpected inference input '{name}' for model '{model}'" in message, (model, message)
    assert server.ready()
