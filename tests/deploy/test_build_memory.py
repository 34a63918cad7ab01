"""The build Job must not be killed for memory (issue 25): a Hugging Face checkpoint goes to TensorRT-LLM's converter
as it is (no export, never loaded whole by us), a derived MoE is written layer by layer, and the Job's memory
(deploy/build_memory.py) bounds a build measured in a fresh process (scripts/measure_build_memory.py's worker)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
import yaml
from helpers.cli import flags
from helpers.pipelines import trtllm_pipeline
from helpers.repo import REPO, load_script

from specdeploy.build.checkpoints import load_checkpoint
from specdeploy.build.hf_export import export_model
from specdeploy.build.hf_tensors import INDEX_FILE, HFTensors
from specdeploy.build.moe_derive import derive_target, export_derived_target
from specdeploy.build.trtllm.plan import build_plan, llm_api_config
from specdeploy.deploy.build_memory import (
    MARGIN,
    WHOLE_K,
    WHOLE_RUNTIME_GIB,
    build_memory_gib,
    our_path,
    our_steps_gib,
)
from specdeploy.spec.pipeline import MoESpec, load_pipeline

measuring = load_script("measure_build_memory")


def converter_inputs(steps) -> dict[str, Path]:
    """Component → the --model_dir its conversion reads."""
    return {step.output.name: Path(flags(step.command)["--model_dir"]) for step in steps
            if step.command and "--model_dir" in step.command}


@pytest.mark.parametrize("case", ["int4", "int8", "none", "int4_dense", "llm_api", "gguf"])
def test_the_plan_reads_hugging_face_checkpoints_where_they_are_and_exports_only_the_rest(case, tmp_path,
                                                                                          tiny_checkpoints):
    target, draft = tiny_checkpoints["target"], tiny_checkpoints["draft"]
    changes: dict = {"speculation": {"draft": {"derive": case}}}
    if case in ("none", "llm_api"):
        changes["speculation"] = {"draft": {"derive": "none", "checkpoint": {"source": "hf_dir", "path": str(draft)}}}
    if case == "llm_api":
        changes["backend"] = {"kind": "trtllm", "trtllm": {"line": "llm_api"}}
    if case == "int4_dense":
        changes["target"] = {"moe": {"experts": 4, "experts_per_token": 2}}
    path = trtllm_pipeline(tmp_path, target, **(changes if case != "gguf" else {}))
    if case == "gguf":  # the shipped CPU pipeline's packaged GGUF on the trtllm backend
        shipped = yaml.safe_load((REPO / "pipelines" / "smollm2-draft-target.yaml").read_text())
        path.write_text(yaml.safe_dump({**shipped, "backend": {"kind": "trtllm", "trtllm": {}}}))
    pipeline = load_pipeline(path)
    root = tmp_path / "engines" / "trtllm"
    steps = build_plan(pipeline, tmp_path / "engines")
    exports = [step.action for step in steps if step.action and step.action.startswith("export")]
    reads = converter_inputs(steps)
    if case in ("int4", "int8"):  # TensorRT-LLM quantizes the target itself: both conversions read it in place
        assert exports == [] and reads == {"target": target, "draft": target}
    elif case == "none":
        assert exports == [] and reads == {"target": target, "draft": draft}
    elif case == "int4_dense":  # the derived MoE is ours to write; its dense source is read where it is
        assert exports == ["export target"] and reads == {"target": root / "hf" / "target", "draft": target}
        assert our_path(pipeline) == "streamed"
    elif case == "llm_api":
        assert [step.action for step in steps] == ["write llm_api.yaml"]
        config = llm_api_config(pipeline, root)
        assert Path(config["model"]) == target
        assert Path(config["speculative_config"]["speculative_model_dir"]) == draft
    else:  # transformers dequantizes a GGUF whole: it is exported, the old way
        assert exports == ["export target"] and reads == {"target": root / "hf" / "target",
                                                          "draft": root / "hf" / "target"}
        assert our_path(pipeline) == "whole"


@pytest.mark.parametrize("method", ["upcycle", "neuron_split"])
def test_the_streamed_moe_export_is_the_whole_model_derivations(tmp_path, tiny_checkpoints, method):
    """The layer-by-layer derivation and writer give the tensors and config the whole-model path gives. (All experts
    per token for the split: no refit, whose choice of experts a router's last bit could flip.)"""
    moe = MoESpec(method=method, experts=4, experts_per_token=4 if method == "neuron_split" else 2,
                  calibration_tokens=256, expert_noise=0.05 if method == "upcycle" else 0.0)
    streamed = export_derived_target(moe, tiny_checkpoints["target"], tmp_path / "streamed", torch.bfloat16)
    pipeline = load_pipeline(trtllm_pipeline(tmp_path, tiny_checkpoints["target"]))
    dense = load_checkpoint(pipeline.target.checkpoint, pipeline)
    loaded = export_derived_target(moe, dense, tmp_path / "loaded", torch.bfloat16)  # a GGUF's path: loaded whole
    derived = derive_target(moe, dense, "tiny")
    whole = export_model(derived.config, derived.state, derived.tokenizer, tmp_path / "whole", torch.bfloat16)
    ours = HFTensors(streamed)
    for other in (HFTensors(loaded), HFTensors(whole)):
        assert sorted(ours) == sorted(other) and "model.layers.1.block_sparse_moe.experts.3.w2.weight" in ours
        for name in ours:
            if name.endswith("block_sparse_moe.gate.weight"):  # least squares, not bitwise repeatable even run twice
                torch.testing.assert_close(ours[name], other[name], rtol=0.02, atol=1e-6)
            else:
                assert torch.equal(ours[name], other[name]), name
    shards = set(json.loads((streamed / INDEX_FILE).read_text())["weight_map"].values())
    assert len(shards) == derived.config.num_layers + 1  # one per layer, one for the embeddings and head

    def config(directory: Path, name: str) -> dict:
        return {key: value for key, value in json.loads((directory / name).read_text()).items()
                if key != "transformers_version"}

    for name in ("config.json", "generation_config.json"):
        assert config(streamed, name) == config(whole, name) == config(loaded, name)


@pytest.fixture(scope="module")
def synthetic(tmp_path_factory) -> Path:
    """A random 16-layer Llama of about 180 MB of bf16 weights, as a Hugging Face checkpoint."""
    return measuring.synthetic_checkpoint(tmp_path_factory.mktemp("synthetic") / "llama", hidden_size=640,
                                          intermediate_size=1920, num_attention_heads=10, num_key_value_heads=2)


def test_a_measured_trtllm_build_fits_its_job_and_the_old_whole_model_export_would_not(synthetic, tmp_path):
    pipeline_path = measuring.synthetic_pipeline(tmp_path / "p.yaml", synthetic, "trtllm")
    pipeline, weights = load_pipeline(pipeline_path), measuring.weights_gib(pipeline_path)
    env = measuring.double_env(tmp_path / "double-bin")
    built = measuring.measure("trtllm", pipeline_path, tmp_path / "engines", env)["peak_gib"]
    ours = our_steps_gib(pipeline, weights)  # flat: nothing of the model is held
    assert built <= ours * MARGIN and ours <= 2 * built, (built, ours)
    assert built <= build_memory_gib(pipeline, weights)
    # the same checkpoint exported whole, as before (fp32 load, a bf16 transformers copy, saved): well over the
    # line, and under the whole-export path's own
    whole = measuring.measure("export", pipeline_path, tmp_path / "whole")["peak_gib"]
    assert ours + 0.25 < whole <= WHOLE_RUNTIME_GIB + WHOLE_K * weights, (whole, ours)
