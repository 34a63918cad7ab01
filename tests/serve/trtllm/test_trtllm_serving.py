"""The trtllm flavour served for real: `specdeploy build` (through the TensorRT-LLM tools' double) and `package`
on a TensorRT-LLM draft-target pipeline, then a real tritonserver serving the repository with the `tensorrtllm`
models swapped for the Python double of that backend (tests/trtllm_double/backend/, SmolLM2 fp32 underneath), and
the orchestration model passing the torch flavour's checks: greedy text equal to in-process, streams, concurrency,
metrics, cancellation, bad requests, and an ensemble clients cannot tell from the torch flavour's."""

from __future__ import annotations

import os

import pytest
import yaml
from helpers.pipelines import write_pipeline
from helpers.repo import REPO
from helpers.served import (
    LONG,
    MAX_TOKENS,
    PROMPTS,
    check_greedy_entry_point,
    plain_text,
    read_config,
    run_concurrent_streams,
    wait_for_idle,
)
from helpers.trtllm_served import swap_in_the_double, tensorrtllm_double_bin

from specdeploy.build.trtllm import engine_build as trtllm
from specdeploy.build.trtllm.engine_build import build as trtllm_build
from specdeploy.build.trtllm.upstream import (
    TENSORRTLLM_INPUTS,
    TENSORRTLLM_PARAMETER_KEYS,
    TENSORRTLLM_REQUIRED_PARAMETERS,
)
from specdeploy.errors import RequestError
from specdeploy.package.repository import DRAFT_MODEL, TARGET_MODEL, model_configs, write_repository
from specdeploy.serve.client import generate
from specdeploy.serve.metrics_scrape import scrape, total
from specdeploy.serve.tritonserver import TritonServer
from specdeploy.spec.pipeline import load_pipeline

pytestmark = [pytest.mark.smollm2, pytest.mark.slow]
DOUBLE = REPO / "tests" / "trtllm_double"
LABELS = {"model": "speculative", "method": "draft_target"}


@pytest.fixture(scope="module")
def served(smollm2_fp32_engines, tmp_path_factory):
    engine = smollm2_fp32_engines["draft-target"]
    root = tmp_path_factory.mktemp("trtllm-served")
    spec = yaml.safe_load((REPO / "pipelines" / "smollm2-draft-target.yaml").read_text())
    spec.update(name="smollm2-trtllm", backend={"kind": "trtllm", "trtllm": {"dtype": "float16"}})
    spec["target"]["dtype"] = "float32"
    pipeline = load_pipeline(write_pipeline(root / "trtllm.yaml", **spec))
    with pytest.MonkeyPatch.context() as patch:
        patch.setenv("PATH", f"{tensorrtllm_double_bin(root / 'bin')}{os.pathsep}{os.environ['PATH']}")
        patch.setenv("PYTHONPATH", str(DOUBLE))
        patch.setattr(trtllm, "missing_requirements", lambda pipeline: [])
        engine_dir = trtllm_build(pipeline, root / "engines", quiet=True).directory
    repository = write_repository(engine_dir, root / "repository")  # the double loads the engine's config.json
    written = {name: read_config(repository / name / "config.pbtxt") for name in (TARGET_MODEL, DRAFT_MODEL)}
    swap_in_the_double(repository, {TARGET_MODEL: engine.dir / "target", DRAFT_MODEL: engine.dir / "draft"})
    with TritonServer(repository, log_file=root / "tritonserver.log") as server:
        yield server, engine, written


def test_the_repository_has_the_torch_flavours_ensemble_and_upstream_engine_models(served):
    server, engine, written = served
    repository = server.model_repository
    torch_configs = model_configs(engine.pipeline)
    assert read_config(repository / "ensemble" / "config.pbtxt").input == torch_configs["ensemble"].input
    assert read_config(repository / "ensemble" / "config.pbtxt").output == torch_configs["ensemble"].output
    speculative = read_config(repository / "speculative" / "config.pbtxt")
    assert speculative.input == torch_configs["speculative"].input
    assert speculative.output == torch_configs["speculative"].output
    assert speculative.parameters["tensorrt_llm_model_name"].string_value == TARGET_MODEL
    assert speculative.parameters["tensorrt_llm_draft_model_name"].string_value == DRAFT_MODEL
    for name, config in written.items():
        assert config.backend == "tensorrtllm" and set(config.parameters) <= TENSORRTLLM_PARAMETER_KEYS
        assert set(TENSORRTLLM_REQUIRED_PARAMETERS) <= set(config.parameters)
        assert {tensor.name for tensor in config.input} == set(TENSORRTLLM_INPUTS)
        # The engine as the server sees it (the backend reads gpt_model_path as it is), and it is there.
        assert config.parameters["gpt_model_path"].string_value == str(repository.resolve() / name / "1" / "engine")
        assert sorted(p.name for p in (repository / name / "1" / "engine").iterdir()) == ["config.json",
                                                                                         "rank0.engine"]
    assert written[DRAFT_MODEL].parameters["decoding_mode"].string_value == "top_k_top_p"
    assert not (repository / "speculative" / "1" / "target" / "model.safetensors").exists()  # no weights needed


@pytest.mark.parametrize("model", ["speculative", "ensemble"])
def test_streaming_and_non_streaming_equal_plain_greedy(served, model):
    server, engine, _ = served
    stats = check_greedy_entry_point(server, engine, model)
    assert stats["generated_tokens"] == MAX_TOKENS
    assert stats["verification_steps"] < MAX_TOKENS - 1  # speculation committed more than one token a step


def test_eight_concurrent_streams_are_correct_and_counted(served):
    server, engine, _ = served
    run_concurrent_streams(server, engine, 8, bursts=False)  # the orchestrator streams a token per response


@pytest.mark.parametrize("fields, message", [
    ({"max_tokens": -3}, "max_tokens: must be ≥ 1, got -3"),
    ({"top_p": 1.5}, "top_p: must be in (0, 1], got 1.5"),
    ({"num_draft_tokens": 99}, "num_draft_tokens: must be in [0, 16] (limits.max_draft_tokens), got 99"),
    ({"end_id": 10**6}, "end_id: must be a token id in [0, 49152) or -1 (none), got 1000000"),
], ids=lambda value: value if isinstance(value, str) else None)
def test_bad_requests_are_refused_naming_the_field(served, fields, message):
    server, engine, _ = served
    max_tokens = fields.pop("max_tokens", 8)
    for model in ("speculative", "ensemble"):
        with pytest.raises(RequestError) as refused:
            list(generate(server.grpc_url, PROMPTS[1], max_tokens, model=model, **fields))
        assert message in str(refused.value)
    assert server.ready()
    assert "".join(c.text for c in generate(server.grpc_url, PROMPTS[1], 8)) == plain_text(engine, PROMPTS[1], 8)


def test_a_cancelled_stream_ends_its_request(served):
    server, _, _ = served
    capacity = total(scrape(server.metrics_url), "specdeploy_free_kv_slots", **LABELS)
    assert capacity == 8 * 2048
    cancelled_before = total(scrape(server.metrics_url), "specdeploy_requests_total", outcome="cancelled")
    stream = generate(server.grpc_url, LONG, 1500, end_id=-1)
    for _ in range(3):
        next(stream)
    assert total(scrape(server.metrics_url), "specdeploy_free_kv_slots", **LABELS) < capacity
    stream.close()
    wait_for_idle(server, capacity, 20)
    assert total(scrape(server.metrics_url), "specdeploy_requests_total", outcome="cancelled") == cancelled_before + 1


def test_sampled_requests_are_reproducible_with_a_seed_and_accept_drafts(served):
    """At temperature > 0 every engine call brings a seed derived from the request's: the same seed gives the same
    text, and drafts are accepted."""
    server, _, _ = served
    runs = [list(generate(server.grpc_url, PROMPTS[2], MAX_TOKENS, temperature=0.7, random_seed=11,
                          end_id=-1, stream=False)) for _ in range(2)]
    assert runs[0][0].text == runs[1][0].text and runs[0][0].statistics["generated_tokens"] == MAX_TOKENS
    assert runs[0][0].statistics["total_accepted_draft_tokens"] > 0
