"""The trtllm build run end to end against a test double of TensorRT-LLM's tools (tests/trtllm_double/, which
checks our exports and flags against the upstream formats): exports, conversions and engine builds land where the
plan says, a failed step leaves nothing that looks complete, unchanged inputs skip the work."""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

import pytest
import yaml
from google.protobuf import json_format, text_format
from helpers.cli import run_cli
from helpers.pipelines import trtllm_pipeline
from helpers.repo import REPO
from helpers.tiny_models import save_tiny_checkpoint, save_tiny_eagle_head
from safetensors.torch import load_file
from transformers import MixtralForCausalLM
from tritonclient.grpc import model_config_pb2 as pb
from trtllm_double.llmapi_speculative import eagle_setup
from trtllm_double.trtllm_build import GPU_SM_VARIABLE

from specdeploy.build.trtllm import engine_build as trtllm
from specdeploy.build.trtllm.upstream import (
    LLMAPI_IMAGE_MODEL_CODE,
    LLMAPI_INPUTS,
    LLMAPI_INPUTS_NOT_DECLARED,
    LLMAPI_MODEL_CODE,
)
from specdeploy.errors import BuildError
from specdeploy.spec.pipeline import load_pipeline
from specdeploy.speculative.medusa import MedusaHeads

DOUBLE = REPO / "tests" / "trtllm_double"
MEDUSA_DOUBLE = DOUBLE / "medusa_convert_checkpoint.py"


@pytest.fixture
def double(tmp_path, monkeypatch):
    """TensorRT-LLM's tools replaced by the double: trtllm-build and python3 on PATH, the tensorrt_llm package on
    PYTHONPATH, and nothing reported missing (pipelines name the Medusa converter's double: MEDUSA_DOUBLE)."""
    bin_dir = tmp_path / "double-bin"
    bin_dir.mkdir()
    for name, target in (("trtllm-build", f"{sys.executable} {DOUBLE / 'trtllm_build.py'}"),
                         ("python3", sys.executable)):
        (bin_dir / name).write_text(f'#!/bin/sh\nexec {target} "$@"\n')
        (bin_dir / name).chmod(0o755)
    monkeypatch.setenv("PATH", f"{bin_dir}{os.pathsep}{os.environ['PATH']}")
    monkeypatch.setenv("PYTHONPATH", str(DOUBLE))
    monkeypatch.setattr(trtllm, "missing_requirements", lambda pipeline: [])


def test_draft_target_builds_both_engines_per_rank_and_skips_when_unchanged(double, tmp_path, tiny_checkpoints):
    path = trtllm_pipeline(tmp_path, tiny_checkpoints["target"], backend={"kind": "trtllm",
                                                                        "trtllm": {"tp_size": 2}})
    engines = tmp_path / "engines"
    result = run_cli("build", str(path), "--engines-dir", str(engines))
    assert result.returncode == 0, result.stderr
    root = engines / "t" / "trtllm"
    for component in ("target", "draft"):
        assert sorted(p.name for p in (root / "engines" / component).glob("*.engine")) == ["rank0.engine",
                                                                                          "rank1.engine"]
    target = json.loads((root / "engines" / "target" / "config.json").read_text())
    built = target["build_config"]
    assert built["speculative_decoding_mode"] == "draft_tokens_external"
    # trtllm-build adds max_draft_len to max_seq_len itself, so a request keeps its whole budget
    limits = load_pipeline(path).limits
    assert built["max_seq_len"] == limits.max_sequence_length + limits.max_draft_tokens
    assert target["pretrained_config"]["mapping"]["tp_size"] == 2
    draft = json.loads((root / "engines" / "draft" / "config.json").read_text())
    assert draft["pretrained_config"]["quantization"]["quant_algo"] == "W4A16"  # derive: int4
    assert (root / "logs").is_dir() and (engines / "t" / "build_manifest.json").is_file()
    # a Hugging Face checkpoint goes to the converter as it is: nothing exported, both conversions read it
    logs = "".join(log.read_text() for log in (root / "logs").glob("*.log"))
    assert not (root / "hf").exists() and logs.count(f"--model_dir {tiny_checkpoints['target']} ") == 2
    again = run_cli("build", str(path), "--engines-dir", str(engines))
    assert again.returncode == 0 and "up to date" in again.stdout


def test_an_moe_target_exports_per_expert_and_its_dense_source_as_the_draft(double, tmp_path, tiny_checkpoints):
    path = trtllm_pipeline(tmp_path, tiny_checkpoints["target"], target={"moe": {
        "experts": 4, "experts_per_token": 2, "calibration_tokens": 256}},
        speculation={"draft": {"derive": "int4_dense"}},
        backend={"kind": "trtllm", "trtllm": {"tp_size": 2, "moe_ep_size": 2}})
    engines = tmp_path / "engines"
    assert run_cli("build", str(path), "--engines-dir", str(engines)).returncode == 0
    root = engines / "t" / "trtllm"
    assert MixtralForCausalLM.from_pretrained(root / "hf" / "target").config.num_local_experts == 4
    # the int4 draft is converted from the dense checkpoint itself
    assert not (root / "hf" / "dense_source").exists()
    logs = "".join(log.read_text() for log in (root / "logs").glob("*.log")).splitlines()
    convert_draft = next(line for line in logs if "trtllm.convert" in line and "/checkpoints/draft " in line)
    assert f"--model_dir {tiny_checkpoints['target']} " in convert_draft
    target = json.loads((root / "engines" / "target" / "config.json").read_text())["pretrained_config"]
    assert target["architecture"] == "MixtralForCausalLM"
    assert (target["mapping"]["moe_tp_size"], target["mapping"]["moe_ep_size"]) == (1, 2)


def medusa_pipeline(tmp_path: Path, target: Path) -> Path:
    """A trtllm Medusa pipeline of `target` with two freshly made heads, converted by the Medusa converter double."""
    heads_file = tmp_path / "heads.safetensors"
    MedusaHeads(64, 2).save(heads_file)
    return trtllm_pipeline(tmp_path, target, speculation={
        "method": "medusa", "num_draft_tokens": 2,
        "medusa": {"heads": str(heads_file), "num_heads": 2, "choices": [[0], [0, 0]]}},
        backend={"kind": "trtllm", "trtllm": {"medusa_converter": str(MEDUSA_DOUBLE)}})


def test_medusa_heads_are_written_as_the_medusa_converter_reads_them(double, tmp_path, tiny_checkpoints):
    path = medusa_pipeline(tmp_path, tiny_checkpoints["target"])
    engines = tmp_path / "engines"
    result = run_cli("build", str(path), "--engines-dir", str(engines))
    assert result.returncode == 0, result.stderr
    root = engines / "t" / "trtllm"
    assert json.loads((root / "hf" / "medusa" / "config.json").read_text()) == {"medusa_num_heads": 2,
                                                                                 "medusa_num_layers": 1}
    target = json.loads((root / "engines" / "target" / "config.json").read_text())
    assert target["build_config"]["speculative_decoding_mode"] == "medusa"
    assert target["pretrained_config"]["architecture"] == "MedusaForCausalLM"

    # Packaged: the same client-facing models, one tensorrtllm model decoding Medusa with the pipeline's tree, and
    # no draft model for the orchestration to call.
    repository = tmp_path / "repository"
    result = run_cli("package", str(path), "--engines-dir", str(engines), "--output", str(repository),
                     "--served-at", "/models/medusa")
    assert result.returncode == 0, result.stderr
    models = sorted(p.name for p in repository.iterdir() if p.is_dir())  # beside them: the package stamp
    assert models == ["drain_hold", "ensemble", "preprocessing", "speculative", "tensorrt_llm"]
    config = text_format.Parse((repository / "tensorrt_llm" / "config.pbtxt").read_text(), pb.ModelConfig())
    parameters = {key: value.string_value for key, value in config.parameters.items()}
    assert parameters["decoding_mode"] == "medusa" and parameters["medusa_choices"] == "{0}, {0, 0}"
    assert parameters["gpt_model_path"] == "/models/medusa/tensorrt_llm/1/engine"
    speculative = text_format.Parse((repository / "speculative" / "config.pbtxt").read_text(), pb.ModelConfig())
    assert speculative.parameters["tensorrt_llm_draft_model_name"].string_value == ""
    relative = run_cli("package", str(path), "--engines-dir", str(engines), "--output", str(repository),
                       "--served-at", "models")
    assert relative.returncode != 0 and "--served-at" in relative.stderr and "absolute" in relative.stderr


def test_a_tied_medusa_target_is_exported_untied_for_the_converter(double, tmp_path):
    """Upstream's Medusa converter looks lm_head.weight up among named_parameters(), where a tied head is missing
    (KeyError, as the double raises: SmolLM2, Llama-3.2-1B/3B tie), so a tied Hugging Face target is not read where
    it is: the build exports it untied, the same function, and converts that."""
    tied = save_tiny_checkpoint(tmp_path / "tied", seed=4, tie_word_embeddings=True)
    path = medusa_pipeline(tmp_path, tied)
    engines = tmp_path / "engines"
    result = run_cli("build", str(path), "--engines-dir", str(engines))
    assert result.returncode == 0, result.stderr
    exported = engines / "t" / "trtllm" / "hf" / "target"
    assert json.loads((exported / "config.json").read_text())["tie_word_embeddings"] is False
    weights = load_file(str(exported / "model.safetensors"))
    assert weights["lm_head.weight"].equal(weights["model.embed_tokens.weight"])


def test_a_lookahead_pipeline_builds_and_packages_an_engine_its_backend_loads(double, tmp_path, tiny_checkpoints):
    """The target alone, built with lookahead_decoding for exactly its (W, N, G)'s draft tokens; packaged with
    decoding_mode lookahead and the three sizes, no draft model; and that config over that engine is one the
    backend's double loads (running the configured sizes, with no warning)."""
    path = trtllm_pipeline(tmp_path, tiny_checkpoints["target"], speculation={
        "method": "lookahead", "lookahead": {"window": 2, "ngram": 3, "verification_set": 2}})
    engines = tmp_path / "engines"
    result = run_cli("build", str(path), "--engines-dir", str(engines))
    assert result.returncode == 0, result.stderr
    root = engines / "t" / "trtllm"
    assert sorted(p.name for p in (root / "engines").iterdir()) == ["target"]
    assert sorted(p.name for p in (root / "checkpoints").iterdir()) == ["target"]
    built = json.loads((root / "engines" / "target" / "config.json").read_text())["build_config"]
    assert built["speculative_decoding_mode"] == "lookahead_decoding" and built["max_draft_len"] == 7
    assert built["max_seq_len"] == load_pipeline(path).limits.max_sequence_length + 7  # trtllm-build adds it

    repository = tmp_path / "repository"
    result = run_cli("package", str(path), "--engines-dir", str(engines), "--output", str(repository))
    assert result.returncode == 0, result.stderr
    assert sorted(p.name for p in repository.iterdir() if p.is_dir()) == ["drain_hold", "ensemble", "preprocessing",
                                                                         "speculative", "tensorrt_llm"]
    config = text_format.Parse((repository / "tensorrt_llm" / "config.pbtxt").read_text(), pb.ModelConfig())
    parameters = {key: value.string_value for key, value in config.parameters.items()}
    assert parameters["decoding_mode"] == "lookahead"
    sys.path.insert(0, str(DOUBLE / "backend"))
    try:
        from tensorrtllm_double import LookaheadConfig, load_settings
    finally:
        sys.path.remove(str(DOUBLE / "backend"))
    settings = load_settings(parameters)
    assert settings.lookahead == LookaheadConfig(2, 3, 2) and settings.lookahead_configured
    assert not settings.warnings


def test_a_failed_step_names_its_log_and_leaves_nothing_complete(double, tmp_path, tiny_checkpoints, monkeypatch):
    monkeypatch.setenv("PYTHONPATH", str(tmp_path))  # the converter cannot import tensorrt_llm
    path = trtllm_pipeline(tmp_path, tiny_checkpoints["target"])
    engines = tmp_path / "engines"
    result = run_cli("build", str(path), "--engines-dir", str(engines))
    assert result.returncode == 2 and "convert the target failed (exit status 1)" in result.stderr
    assert "ModuleNotFoundError" in result.stderr and not (engines / "t").exists()


def test_the_llm_api_line_writes_its_configuration_with_the_final_paths(double, tmp_path, tiny_checkpoints):
    draft = {"derive": "none", "checkpoint": {"source": "hf_dir", "path": str(tiny_checkpoints["draft"])}}
    path = trtllm_pipeline(tmp_path, tiny_checkpoints["target"], speculation={"draft": draft},
                           backend={"kind": "trtllm", "trtllm": {"line": "llm_api"}})
    engines = tmp_path / "engines"
    assert run_cli("build", str(path), "--engines-dir", str(engines)).returncode == 0
    root = engines / "t" / "trtllm"
    config = yaml.safe_load((root / "llm_api.yaml").read_text())
    # the LLM reads the checkpoints where they are: nothing exported
    assert Path(config["model"]) == tiny_checkpoints["target"] and not (root / "hf").exists()
    assert Path(config["speculative_config"]["speculative_model_dir"]) == tiny_checkpoints["draft"]
    assert not (root / "engines").exists()

    # Packaged: Triton's LLM-API model, its code from a TensorRT-LLM checkout, model.yaml naming the checkpoints
    # where the server will see them, and the upstream template's tensors.
    repository = tmp_path / "repository"
    refused = run_cli("package", str(path), "--engines-dir", str(engines), "--output", str(repository))
    assert refused.returncode != 0 and "--trtllm-source" in refused.stderr and not repository.exists()
    checkout = tmp_path / "TensorRT-LLM"
    code = checkout / LLMAPI_MODEL_CODE
    code.mkdir(parents=True)
    for name in ("model.py", "helpers.py"):
        (code / name).write_text(f"# upstream {name}\n")
    result = run_cli("package", str(path), "--engines-dir", str(engines), "--output", str(repository),
                     "--served-at", "/models/llm", "--trtllm-source", str(checkout))
    assert result.returncode == 0, result.stderr
    version = repository / "tensorrt_llm" / "1"
    assert (version / "model.py").read_text() == "# upstream model.py\n" and (version / "helpers.py").is_file()
    model_yaml = yaml.safe_load((version / "model.yaml").read_text())
    assert model_yaml["model"] == "/models/llm/tensorrt_llm/1/hf/target"
    assert model_yaml["speculative_config"] == {**config["speculative_config"],
                                                "speculative_model_dir": "/models/llm/tensorrt_llm/1/hf/draft"}
    assert model_yaml["triton_config"] == {"max_batch_size": 0, "decoupled": True}
    assert (version / "hf" / "draft" / "model.safetensors").is_file()
    triton_config = text_format.Parse((repository / "tensorrt_llm" / "config.pbtxt").read_text(), pb.ModelConfig())
    assert triton_config.backend == "python"
    # decoupled and unbatched in config.pbtxt itself: the Kubernetes overlays serve with --disable-auto-complete-config
    assert triton_config.model_transaction_policy.decoupled and triton_config.max_batch_size == 0
    check_upstream_auto_complete(triton_config, model_yaml["triton_config"])
    assert {t.name: (pb.DataType.Name(t.data_type), list(t.dims)) for t in triton_config.input} == {
        name: (kind, dims) for name, (kind, dims) in LLMAPI_INPUTS.items()}
    # upstream's inputs (NVIDIA/TensorRT-LLM@0a710573 triton_backend/all_models/llmapi/tensorrt_llm/config.pbtxt):
    # each declared here or listed as not declared (Triton refuses it naming it), and that list in the docs
    upstream = {"text_input", "image_url", "streaming", "sampling_param_best_of", "sampling_param_temperature",
                "sampling_param_top_k", "sampling_param_top_p", "sampling_param_frequency_penalty",
                "sampling_param_presence_penalty", "sampling_param_max_tokens", "sampling_param_stop",
                "sampling_param_seed", "sampling_param_exclude_input_from_output",
                "sampling_param_return_perf_metrics", "return_finish_reason", "return_stop_reason",
                "return_cumulative_logprob", "stop", "lora_id", "lora_name", "lora_path", "lora_ckpt_source"}
    declared = {t.name for t in triton_config.input}
    assert not declared & set(LLMAPI_INPUTS_NOT_DECLARED) and upstream - declared == set(LLMAPI_INPUTS_NOT_DECLARED)
    docs = " ".join((REPO / "docs" / "tensorrt-llm.md").read_text().split())
    assert [name for name in LLMAPI_INPUTS_NOT_DECLARED if f"`{name}`" not in docs] == []
    assert "unexpected inference input 'sampling_param_best_of' for model 'tensorrt_llm'" in docs


def test_an_eagle3_pipeline_builds_and_packages_on_the_llm_api_line(double, tmp_path, tiny_checkpoints):
    """An EAGLE-3 head is read where it is at build and copied beside the target into the LLM-API model, whose
    model.yaml names it where the server sees it; the LLM API's double (tests/trtllm_double/llmapi_speculative.py)
    accepts that speculative_config over the packaged folder. The model code comes from the pinned image's /app as
    well as from a checkout."""
    head = save_tiny_eagle_head(tmp_path / "head", feature_layers=(1, 2, 3))
    path = trtllm_pipeline(tmp_path, tiny_checkpoints["target"], speculation={
        "method": "eagle", "num_draft_tokens": 3, "eagle": {"head": str(head), "top_k": 1, "max_nodes": 3}},
        backend={"kind": "trtllm", "trtllm": {"line": "llm_api"}})
    engines = tmp_path / "engines"
    result = run_cli("build", str(path), "--engines-dir", str(engines))
    assert result.returncode == 0, result.stderr
    root = engines / "t" / "trtllm"
    config = yaml.safe_load((root / "llm_api.yaml").read_text())
    assert Path(config["speculative_config"]["speculative_model_dir"]) == head and not (root / "hf").exists()
    again = run_cli("build", str(path), "--engines-dir", str(engines))
    assert again.returncode == 0 and "up to date" in again.stdout
    head_config = json.loads((head / "config.json").read_text())
    head_config["eagle_aux_hidden_state_layer_ids"] = [1, 2]  # what TensorRT-LLM cannot load
    (head / "config.json").write_text(json.dumps(head_config))
    changed = run_cli("build", str(path), "--engines-dir", str(engines))  # the head is an input of the build
    assert changed.returncode == 2 and "speculation.eagle.head" in changed.stderr
    head_config["eagle_aux_hidden_state_layer_ids"] = [1, 2, 3]
    (head / "config.json").write_text(json.dumps(head_config))
    assert "up to date" not in run_cli("build", str(path), "--engines-dir", str(engines)).stdout

    app = tmp_path / "app"  # the image's layout: /app/all_models is the checkout's triton_backend/all_models
    code = app / LLMAPI_IMAGE_MODEL_CODE
    code.mkdir(parents=True)
    for name in ("model.py", "helpers.py"):
        (code / name).write_text(f"# upstream {name}\n")
    repository = tmp_path / "repository"
    result = run_cli("package", str(path), "--engines-dir", str(engines), "--output", str(repository),
                     "--trtllm-source", str(app))
    assert result.returncode == 0, result.stderr
    version = repository / "tensorrt_llm" / "1"
    assert (version / "model.py").read_text() == "# upstream model.py\n"
    speculative = yaml.safe_load((version / "model.yaml").read_text())["speculative_config"]
    assert speculative["speculative_model_dir"] == str(version.resolve() / "hf" / "eagle")
    assert sorted(p.name for p in (version / "hf" / "eagle").iterdir()) == ["config.json", "model.safetensors"]
    assert speculative["eagle3_layers_to_capture"] == [0, 1, 2] and speculative["eagle3_one_model"] is False
    setup = eagle_setup(speculative, target_layers=2)
    assert setup.mode == "EAGLE3" and setup.samples_at_temperature and setup.max_draft_len == 3


def check_upstream_auto_complete(config: pb.ModelConfig, triton_config: dict) -> None:
    """What upstream's llmapi model.py does in auto_complete_config when the server auto-completes (apply
    model.yaml's triton_config through the Python backend's ModelConfig, which refuses a value that contradicts
    config.pbtxt) changes nothing in ours. The Python backend's utilities are the ones in the nvidia-pytriton
    wheel."""
    import pytriton

    utilities = Path(pytriton.__file__).parent / "tritonserver" / "backends" / "python"
    sys.path.insert(0, str(utilities))
    try:
        import triton_python_backend_utils as pb_utils
    finally:
        sys.path.remove(str(utilities))
    # Triton hands the model its whole configuration, defaults included
    completed = pb_utils.ModelConfig(json_format.MessageToJson(config, preserving_proto_field_name=True,
                                                               always_print_fields_with_no_presence=True))
    before = dict(completed.as_dict())
    completed.set_model_transaction_policy({"decoupled": bool(triton_config["decoupled"])})
    completed.set_max_batch_size(int(triton_config["max_batch_size"]))
    assert completed.as_dict() == before


def test_weight_only_engines_are_refused_before_the_build_on_sm_100_as_trtllm_build_refuses_them(
        double, tmp_path, tiny_checkpoints, monkeypatch):
    """trtllm-build raises "INT8/INT4 quantization is not supported on SM>=100" for a weight-only checkpoint on a
    B200/GB200 (the double too, given that GPU), after the conversions have run; the pre-flight check names the GPU
    and the component first."""
    import torch

    path = trtllm_pipeline(tmp_path, tiny_checkpoints["target"])  # draft derive: int4
    monkeypatch.setenv(GPU_SM_VARIABLE, "100")
    failed = run_cli("build", str(path), "--engines-dir", str(tmp_path / "engines"))
    assert failed.returncode != 0 and "INT8/INT4 quantization is not supported on SM>=100" in failed.stdout + \
        failed.stderr
    pipeline = load_pipeline(path)
    (refusal,) = trtllm.weight_only_refusals(pipeline, (10, 0), "NVIDIA B200")
    assert "NVIDIA B200 is SM 100" in refusal and "the draft is int4 (speculation.draft.derive)" in refusal
    assert trtllm.weight_only_refusals(pipeline, (9, 0), "NVIDIA H100") == []
    assert trtllm.weight_only_refusals(pipeline, (12, 0), "NVIDIA RTX PRO 6000") == []  # SM 120 builds them
    monkeypatch.undo()  # the real missing_requirements, on a GPU that torch reports as a B200
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: (10, 0))
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda device=None: "NVIDIA B200")
    assert refusal in trtllm.missing_requirements(pipeline)


def test_medusa_on_a_target_with_rope_scaling_is_refused_and_draft_target_plans_it(tmp_path):
    """Llama-3.1's llama3 rope scaling: TensorRT-LLM's Medusa converter keeps only its type (b93e14ca), so a Medusa
    build would compute another RoPE; the plan refuses it naming the method and the factors. Other methods convert
    it with the general converter, and planning them is not stopped by what only the torch engine refuses."""
    llama3 = {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
              "original_max_position_embeddings": 64, "rope_theta": 500000.0}
    target = save_tiny_checkpoint(tmp_path / "llama31", seed=3, max_position_embeddings=512, rope_scaling=llama3)
    (tmp_path / "medusa").mkdir()
    (tmp_path / "dt").mkdir()
    medusa = load_pipeline(medusa_pipeline(tmp_path / "medusa", target))
    with pytest.raises(BuildError, match="medusa: the target's config.json has rope scaling 'llama3' \\(factor 8.0"):
        trtllm.plan(medusa, tmp_path / "engines")
    steps, notes = trtllm.plan(load_pipeline(trtllm_pipeline(tmp_path / "dt", target)), tmp_path / "engines")
    assert steps and any(note.startswith("target: llama") for note in notes)


def test_engines_are_keyed_on_the_installed_tensorrt_llm_and_gpu(double, tmp_path, tiny_checkpoints, monkeypatch):
    """An image rebuilt on another TensorRT-LLM (or TensorRT) must rebuild its engines, not reuse ones its runtime
    cannot deserialize (review N5): the build's fingerprint holds the installed versions and the GPU."""
    import torch

    path = trtllm_pipeline(tmp_path, tiny_checkpoints["target"])
    engines = tmp_path / "engines"
    assert run_cli("build", str(path), "--engines-dir", str(engines)).returncode == 0
    assert "up to date" in run_cli("build", str(path), "--engines-dir", str(engines)).stdout
    newer = tmp_path / "site" / "tensorrt_llm-9.9.9.dist-info"
    newer.mkdir(parents=True)
    (newer / "METADATA").write_text("Metadata-Version: 2.1\nName: tensorrt_llm\nVersion: 9.9.9\n")
    monkeypatch.syspath_prepend(str(newer.parent))  # run_cli runs the CLI in this process
    again = run_cli("build", str(path), "--engines-dir", str(engines))
    assert again.returncode == 0 and "up to date" not in again.stdout
    manifest = json.loads((engines / "t" / "build_manifest.json").read_text())
    assert json.dumps(manifest).count('"9.9.9"') >= 1
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: (9, 0))
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda device=None: "NVIDIA H100 80GB HBM3")
    assert trtllm.installed_toolchain()["gpu"] == "NVIDIA H100 80GB HBM3 (SM 90)"
