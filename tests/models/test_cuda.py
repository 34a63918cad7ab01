"""The torch backend on an NVIDIA GPU (`device: cuda`). Every test here skips cleanly on a machine without one;
`scripts/gpu-check.sh` runs them where a GPU exists (marker: cuda)."""

from __future__ import annotations

import warnings

import pytest
import torch

from specdeploy.runtime.engine import Engine
from specdeploy.spec.request import NO_END_ID, GenerationRequest
from specdeploy.spec.sampling_params import SamplingParams

pytestmark = [pytest.mark.cuda,
              pytest.mark.skipif(not torch.cuda.is_available(), reason="needs an NVIDIA GPU (torch sees none)")]

PROMPTS = [[5, 40, 41, 42, 43, 7, 9], [70, 71, 72, 70, 71, 72, 70, 71], [10, 11, 12, 13, 14, 15, 16, 17, 18, 19, 20]]


@pytest.fixture(scope="module")
def gpu_engines(tiny_engines) -> dict[str, Engine]:
    return {kind: Engine(tiny_engines[kind].dir, device="cuda", batch_size=4)
            for kind in ("draft_target", "int4", "int8", "ngram")}


@pytest.mark.parametrize("kind", ["draft_target", "int4", "int8", "ngram"])
def test_greedy_speculation_on_the_gpu_equals_plain_decode(gpu_engines, kind):
    engine = gpu_engines[kind]
    assert engine.target.embed.device.type == "cuda"
    for prompt in PROMPTS:
        plain = engine.start(GenerationRequest(prompt, 40, SamplingParams(), 0, end_id=NO_END_ID)).run()
        speculative = engine.start(GenerationRequest(prompt, 40, SamplingParams(), end_id=NO_END_ID)).run()
        assert speculative == plain


@pytest.mark.parametrize("kind", ["draft_target", "int4", "int8", "ngram"])
def test_one_host_sync_per_decode_step(gpu_engines, kind):
    """CUDA's sync debug mode warns on every host sync; a batched step of greedy, sampled and penalised rows has
    exactly one (the outcome's read), whatever the proposer."""
    engine = gpu_engines[kind]
    requests = [GenerationRequest(PROMPTS[0], 30, SamplingParams(), 3, end_id=NO_END_ID),
                GenerationRequest(PROMPTS[1], 30, SamplingParams(temperature=0.8, top_k=20, seed=1), 2,
                                  end_id=NO_END_ID),
                GenerationRequest(PROMPTS[2], 30, SamplingParams(repetition_penalty=1.3), 4, end_id=NO_END_ID)]
    sequences = [engine.new_sequence(request) for request in requests]
    for row, sequence in enumerate(sequences):
        engine.decoder.prefill(sequence, row)
    engine.decoder.step(sequences)  # warm-up: first calls allocate pinned blocks and load kernels
    torch.cuda.synchronize()
    previous = torch.cuda.get_sync_debug_mode()
    torch.cuda.set_sync_debug_mode("warn")
    try:
        for _ in range(3):
            with warnings.catch_warnings(record=True) as caught:
                warnings.simplefilter("always")
                engine.decoder.step(sequences)
            syncs = [str(w.message) for w in caught if "synchroniz" in str(w.message)]
            assert len(syncs) == 1, syncs
    finally:
        torch.cuda.set_sync_debug_mode(previous)


@pytest.fixture(scope="module")
def gpu_eagle(tiny_checkpoints, tiny_engines, tmp_path_factory) -> Engine:
    """The tiny target with a tiny trained EAGLE-3 head (tests/helpers/eagle_heads.py), on the GPU."""
    from helpers.eagle_heads import trained_tiny_head
    from helpers.pipelines import write_pipeline

    from specdeploy.build.torch_engine import build
    from specdeploy.spec.pipeline import load_pipeline

    root = tmp_path_factory.mktemp("gpu-eagle")
    trained_tiny_head(tiny_engines["ngram"], root / "head")
    path = write_pipeline(root / "eagle.yaml", name="tiny-eagle-gpu",
                          target={"checkpoint": {"source": "hf_dir", "path": str(tiny_checkpoints["target"])},
                                  "dtype": "float32"},
                          speculation={"method": "eagle", "num_draft_tokens": 3,
                                       "eagle": {"head": str(root / "head"), "top_k": 3, "max_nodes": 8}},
                          limits={"max_batch_size": 4, "max_input_length": 64, "max_sequence_length": 256,
                                  "max_draft_tokens": 12})
    return Engine(build(load_pipeline(path), root / "engines", quiet=True).directory, device="cuda", batch_size=4)


def test_greedy_eagle_on_the_gpu_equals_plain_decode(gpu_eagle):
    assert gpu_eagle.proposer.head.w("fc.weight").device.type == "cuda"
    accepted = 0
    for prompt in PROMPTS:
        plain = gpu_eagle.start(GenerationRequest(prompt, 40, SamplingParams(), 0, end_id=NO_END_ID)).run()
        generation = gpu_eagle.start(GenerationRequest(prompt, 40, SamplingParams(), end_id=NO_END_ID))
        assert generation.run() == plain
        accepted += generation.stats.accepted
    assert accepted > 0


def test_an_eagle_step_syncs_once_more_than_a_plain_step(gpu_eagle):
    """EAGLE reads its grown trees to the host once (their shapes decide the verify's mask): one host sync more than
    the same batch's plain step (counted against it, so the runtime's own syncs, which vary between torch releases,
    cancel), for greedy, sampled and penalised rows together."""
    from specdeploy.spec.pipeline import PolicySpec

    requests = [GenerationRequest(PROMPTS[0], 40, SamplingParams(), 3, end_id=NO_END_ID),
                GenerationRequest(PROMPTS[1], 40, SamplingParams(temperature=0.8, top_k=20, seed=1), 2,
                                  end_id=NO_END_ID),
                GenerationRequest(PROMPTS[2], 40, SamplingParams(repetition_penalty=1.3), 3, end_id=NO_END_ID)]
    sequences = [gpu_eagle.new_sequence(request) for request in requests]
    for row, sequence in enumerate(sequences):
        gpu_eagle.decoder.prefill(sequence, row)
    plain = PolicySpec(full_up_to=0, off_above=0)  # a batch of three drafts nothing
    for policy in (None, plain):
        gpu_eagle.decoder.step(sequences, policy)  # warm-up
    torch.cuda.synchronize()
    previous = torch.cuda.get_sync_debug_mode()
    torch.cuda.set_sync_debug_mode("warn")
    counts = {}
    try:
        for name, policy in (("eagle", None), ("plain", plain)):
            with warnings.catch_warnings(record=True) as caught:
                warnings.simplefilter("always")
                gpu_eagle.decoder.step(sequences, policy)
            counts[name] = sum("synchroniz" in str(w.message) for w in caught)
    finally:
        torch.cuda.set_sync_debug_mode(previous)
    assert counts["eagle"] == counts["plain"] + 1, counts


def test_the_gpu_int4_kernel_matches_the_dequantized_weights():
    from specdeploy.models.quantize import Int4Linear, dequantize_int4, quantize_int4

    torch.manual_seed(0)
    weight = torch.randn(256, 576)
    groups = {key: value.cuda() for key, value in quantize_int4(weight).items()}
    layer = Int4Linear(groups["codes"], groups["scales"], groups["minimums"])
    assert layer.dense is None  # the tinygemm kernel, not the dequantized fallback
    x = torch.randn(3, 576, device="cuda", dtype=torch.bfloat16)
    expected = x.float() @ dequantize_int4(**groups).T
    torch.testing.assert_close(layer(x).float(), expected, rtol=0.03, atol=0.3)


def test_the_gpu_int8_kernel_matches_the_dequantized_weights():
    from specdeploy.models.quantize import Int8Linear, quantize_int8

    torch.manual_seed(0)
    weight = torch.randn(256, 576)
    rows = {key: value.cuda() for key, value in quantize_int8(weight).items()}
    layer = Int8Linear(rows["int8"], rows["row_scales"])
    x = torch.randn(3, 576, device="cuda", dtype=torch.bfloat16)
    expected = x.float() @ (rows["int8"].float() * rows["row_scales"][:, None]).T
    torch.testing.assert_close(layer(x).float(), expected, rtol=0.03, atol=0.3)


def test_the_moe_runs_without_host_reads_on_the_gpu():
    from helpers.tiny_models import tiny_moe_layer

    cpu, gpu = tiny_moe_layer(), tiny_moe_layer("cuda")
    x = torch.randn(6, 32)
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        out = gpu(x.cuda())
    finally:
        torch.cuda.set_sync_debug_mode("default")
    torch.testing.assert_close(out.cpu(), cpu(x), rtol=1e-4, atol=1e-4)


@pytest.mark.smollm2
def test_smollm2_on_the_gpu_serves_through_triton(tmp_path):
    """The shipped draft-target pipeline packaged for cuda (KIND_GPU) answers over gRPC from a real tritonserver,
    with drafts accepted."""
    from helpers.repo import REPO

    from specdeploy.serve.tritonserver import TritonServer
    from specdeploy.workflows import RequestOptions, generate_over_grpc, package

    repository = package(REPO / "pipelines" / "smollm2-draft-target.yaml", tmp_path / "engines",
                         tmp_path / "repository", device="cuda").directory
    assert "KIND_GPU" in (repository / "speculative" / "config.pbtxt").read_text()
    with TritonServer(repository) as server:
        report = generate_over_grpc(server.grpc_url, "Write a haiku about the sea.", RequestOptions(max_tokens=32),
                                    False, False, lambda _: None)
    assert report.text.strip()
    assert report.details["total_accepted_draft_tokens"] > 0
