"""The torch backend's device choice, checked on any machine: the pipeline key and the CLI override, what the engine
records and the repository serves with, the clear error where no GPU exists, and the GPU kernels' data layouts
against their documented forms. The runs on a GPU are in test_cuda.py."""

from __future__ import annotations

import json

import pytest
import torch
from click.testing import CliRunner
from helpers.pipelines import tiny_pipeline
from helpers.repo import REPO
from helpers.tiny_models import tiny_moe_layer

from specdeploy.errors import PipelineError, SpecdeployError
from specdeploy.models.device_transfer import PhaseClock, from_host
from specdeploy.models.quantize import dequantize_int4, high_nibble_first, inner_k_tiles, quantize_int4, unpack_codes
from specdeploy.spec.engine_paths import PIPELINE_FILE
from specdeploy.spec.pipeline import load_pipeline, parse_pipeline

NO_GPU = not torch.cuda.is_available()
TARGET = {"checkpoint": {"source": "gguf", "path": "/models/m.gguf"}}


def test_the_device_key_parses_and_defaults_to_cpu():
    assert parse_pipeline({"name": "p", "target": TARGET}).backend.device == "cpu"
    spec = parse_pipeline({"name": "p", "target": TARGET, "backend": {"kind": "torch", "torch": {"device": "cuda"}}})
    assert spec.backend.device == "cuda"
    assert parse_pipeline(spec.to_dict()) == spec  # what an engine's pipeline.json holds reads back the same


@pytest.mark.parametrize("backend, message", [
    ({"torch": {"device": "gpu"}}, "backend.torch.device: 'gpu' is not allowed (allowed: 'cpu', 'cuda')"),
    ({"kind": "trtllm", "torch": {"device": "cuda"}}, "backend.torch: only with kind: torch"),
    ({"torch": {"devices": "cuda"}}, "backend.torch: unknown key 'devices' (allowed: device, steps)"),
])
def test_a_bad_device_section_is_refused_naming_the_key(backend, message):
    with pytest.raises(PipelineError, match=message.replace("(", r"\(").replace(")", r"\)")):
        parse_pipeline({"name": "p", "target": TARGET, "backend": backend})


def test_the_override_is_for_the_torch_backend_only(tmp_path):
    from specdeploy.workflows import load_spec

    path = tmp_path / "trt.yaml"
    path.write_text(json.dumps({"name": "p", "target": TARGET, "backend": {"kind": "trtllm"}}))
    with pytest.raises(PipelineError, match="--device is for the torch backend"):
        load_spec(path, "cuda")
    assert load_spec(path).backend.kind == "trtllm"


def test_a_device_change_rebuilds_nothing_and_the_engine_records_it(tiny_checkpoints, tmp_path):
    """The engine files are the same on a CPU and a GPU: the device is not in the build's fingerprint, while the
    engine's saved pipeline (which generate, bench and package read) follows the last build's device."""
    from specdeploy.build.torch_engine import build
    from specdeploy.workflows import load_spec

    path = tiny_pipeline(tmp_path, "tiny-device", tiny_checkpoints["target"], method="ngram")
    directory, built = build(load_spec(path), tmp_path / "engines", quiet=True)
    assert built
    again = build(load_spec(path, "cuda"), tmp_path / "engines", quiet=True)
    assert again == (directory, False)
    assert load_pipeline(directory / PIPELINE_FILE).backend.device == "cuda"
    build(load_spec(path), tmp_path / "engines", quiet=True)
    assert load_pipeline(directory / PIPELINE_FILE).backend.device == "cpu"


def test_a_cuda_pipeline_is_packaged_with_a_gpu_instance(tiny_checkpoints, tmp_path):
    """The engine's model gets KIND_GPU (Triton: one instance per visible GPU, each told its device id); the
    tokenizer's model stays on the CPU. The package stamp sees the device change and rewrites the repository."""
    from specdeploy.serve.torch.server import instance_device
    from specdeploy.workflows import package

    path = tiny_pipeline(tmp_path, "tiny-gpu-repo", tiny_checkpoints["target"], method="ngram")
    output = tmp_path / "repository"
    assert package(path, tmp_path / "engines", output).written
    assert "KIND_CPU" in (output / "speculative" / "config.pbtxt").read_text()
    assert package(path, tmp_path / "engines", output, device="cuda").written
    speculative = (output / "speculative" / "config.pbtxt").read_text()
    assert "kind: KIND_GPU" in speculative and "KIND_CPU" not in speculative
    assert "KIND_CPU" in (output / "preprocessing" / "config.pbtxt").read_text()
    assert not package(path, tmp_path / "engines", output, device="cuda").written
    assert instance_device({"model_instance_kind": "GPU", "model_instance_device_id": "3"}) == "cuda:3"
    assert instance_device({"model_instance_kind": "CPU", "model_instance_device_id": "0"}) == "cpu"


@pytest.mark.skipif(not NO_GPU, reason="this machine has a GPU: test_cuda.py runs there")
def test_cuda_without_a_gpu_is_a_clear_error(tiny_engines, tiny_checkpoints, tmp_path):
    from specdeploy.cli import cli
    from specdeploy.runtime.engine import Engine

    with pytest.raises(SpecdeployError, match=r"device 'cuda' \(backend.torch.device or --device\) needs an NVIDIA "
                                              r"GPU, and torch sees none"):
        Engine(tiny_engines["ngram"].dir, device="cuda")
    path = tiny_pipeline(tmp_path, "tiny-cli-cuda", tiny_checkpoints["target"], method="ngram")
    result = CliRunner().invoke(cli, ["generate", str(path), "hello", "--device", "cuda", "--max-tokens", "4",
                                      "--engines-dir", str(tmp_path / "engines")])
    assert result.exit_code == 2 and "needs an NVIDIA GPU" in result.output


def test_gpu_int4_packing_follows_the_kernels_documented_order():
    """tinygemm's `_convert_weight_to_int4pack` takes uint8 [N, K/2] holding code 2i in the high nibble and code
    2i + 1 in the low one (how PyTorch's and torchao's callers pack it); ours packs code 2i low."""
    codes = torch.randint(0, 16, (24, 64), dtype=torch.int32)
    ours = (codes[:, 0::2] | (codes[:, 1::2] << 4)).to(torch.uint8)
    assert torch.equal(unpack_codes(ours), codes)
    documented = (codes[:, ::2] << 4 | codes[:, 1::2]).to(torch.uint8)
    assert torch.equal(high_nibble_first(ours), documented)
    assert [inner_k_tiles(k) for k in (576, 1536, 256, 96, 40)] == [4, 8, 8, 2, None]


def test_int4_groups_round_trip():
    weight = torch.randn(16, 64)
    groups = quantize_int4(weight)
    step = (weight.reshape(16, 2, 32).amax(-1) - weight.reshape(16, 2, 32).amin(-1)) / 15
    error = (dequantize_int4(**groups) - weight).abs().reshape(16, 2, 32)
    assert (error <= step[..., None] / 2 + 1e-6).all()


def test_the_gpu_moe_path_equals_the_sparse_one():
    """On a GPU every expert runs over every token, weighted by its routing weight (no host read of which experts
    are idle); on any device it must compute what the sparse path does."""
    from specdeploy.models.moe import route

    moe = tiny_moe_layer()
    x = torch.randn(5, 32)
    weights, experts = route(moe.router.forward(x), 2)
    torch.testing.assert_close(moe.every_expert(x, weights, experts), moe(x), rtol=1e-5, atol=1e-5)


def test_host_data_and_the_phase_clock_on_the_cpu():
    assert torch.equal(from_host([[1, 2], [3, 4]], "cpu"), torch.tensor([[1, 2], [3, 4]]))
    assert from_host([True, False], "cpu", torch.long).dtype == torch.long
    clock = PhaseClock("cpu")
    clock.start()
    sum(range(10000))
    clock.drafted()
    sum(range(10000))
    draft, verify = clock.verified()
    assert draft > 0 and verify > 0


@pytest.mark.skipif(not NO_GPU, reason="this machine has a GPU: the script would run in full")
def test_gpu_check_refuses_at_once_where_torch_sees_no_gpu(tmp_path):
    """scripts/gpu-check.sh stops before any work, naming the torch build and how to point it at a CUDA one."""
    import subprocess
    import sys

    script = REPO / "scripts" / "gpu-check.sh"
    result = subprocess.run(["bash", str(script), str(tmp_path / "out")], env={"PYTHON": sys.executable,
                            "PATH": "/usr/bin:/bin"}, capture_output=True, text=True, timeout=120)
    assert result.returncode != 0
    assert f"torch {torch.__version__} sees no GPU" in result.stderr and "PYTHON" in result.stderr
    assert not (tmp_path / "out").exists()  # nothing was started
