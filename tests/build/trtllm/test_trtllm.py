"""The trtllm backend without TensorRT-LLM: pipeline validation, the build plan against the upstream flag tables
(docs/tensorrt-llm.md), the converter against a test double of TensorRT-LLM's Python API, and a real build
that stops naming what is missing."""

from __future__ import annotations

import re
import subprocess
import sys
import types
from pathlib import Path

import pytest
import yaml
from google.protobuf import text_format
from helpers.cli import flags, run_cli
from helpers.pipelines import tiny_pipeline, trtllm_pipeline
from helpers.repo import REPO
from helpers.tiny_models import save_tiny_checkpoint, save_tiny_eagle_head
from tritonclient.grpc import model_config_pb2 as pb
from trtllm_double.llmapi_speculative import eagle_setup

from specdeploy.build.trtllm import convert as trtllm_convert
from specdeploy.build.trtllm.engine_build import missing_requirements, plan
from specdeploy.build.trtllm.plan import llm_api_config
from specdeploy.build.trtllm.upstream import (
    BATCH_SCHEDULER_POLICIES,
    BOOLEAN_VALUES,
    DECODING_MODES,
    GPT_MODEL_TYPES,
    LLAMA_CONVERT_FLAGS,
    LOOKAHEAD_PARAMETERS,
    LOOKAHEAD_REQUEST_INPUTS,
    MEDUSA_CONVERT_FLAGS,
    TENSORRTLLM_INPUTS,
    TENSORRTLLM_PARAMETER_KEYS,
    TENSORRTLLM_REQUIRED_PARAMETERS,
    TRTLLM_BUILD_FLAGS,
)
from specdeploy.errors import BuildError, PipelineError
from specdeploy.package.repository import model_configs
from specdeploy.package.trtllm_models import tensorrtllm_model
from specdeploy.spec.pipeline import load_pipeline
from specdeploy.speculative.eagle_head import default_feature_layers

GPU_EXAMPLES = sorted((REPO / "pipelines" / "gpu").glob("*.yaml"))
# the examples on TensorRT engines (the others serve through the LLM API, which builds none)
ENGINE_EXAMPLES = [p for p in GPU_EXAMPLES if load_pipeline(p).backend.settings.line == "engine"]


def check_against(table: dict, command: tuple[str, ...]) -> None:
    for flag, value in flags(command).items():
        assert flag in table, f"{flag} is not an upstream flag"
        allowed = table[flag]
        if allowed == "switch":
            assert value is None, f"{flag} takes no value"
        elif isinstance(allowed, tuple):
            assert value in allowed, f"{flag} {value}: upstream allows {allowed}"
        else:
            assert value is not None, f"{flag} needs a value"


def table_for(command: tuple[str, ...]) -> dict:
    if command[0] == "trtllm-build":
        return TRTLLM_BUILD_FLAGS
    return MEDUSA_CONVERT_FLAGS if command[1].endswith("medusa/convert_checkpoint.py") else LLAMA_CONVERT_FLAGS


LLAMA70B = next(p for p in GPU_EXAMPLES if p.stem == "llama70b-draft-target")


@pytest.mark.parametrize("path, derive", [(p, None) for p in ENGINE_EXAMPLES] + [(LLAMA70B, "int8")],
                         ids=[p.stem for p in ENGINE_EXAMPLES] + ["llama70b-draft-target-int8"])
def test_gpu_examples_plan_with_upstream_flags_and_consistent_paths(path, derive, tmp_path):
    """derive: the example's draft derived as this instead (an int8 draft: TensorRT-LLM's W8A16)."""
    if derive is not None:
        spec = yaml.safe_load(path.read_text())
        spec["speculation"]["draft"] = {"derive": derive}
        path = tmp_path / path.name
        path.write_text(yaml.safe_dump(spec))
    pipeline = load_pipeline(path)
    steps, notes = plan(pipeline, tmp_path / "engines")
    assert any("not checked" in note for note in notes)  # the /models checkpoints are not on this machine
    # Hugging Face checkpoints are read where they are: TensorRT-LLM's converter reads the directory itself
    written = {pipeline.resolve(c.path) for c in (pipeline.target.checkpoint, getattr(pipeline.speculation.draft,
                                                                                       "checkpoint", None))
               if c is not None and c.source == "hf_dir"}
    assert not {step.action for step in steps} & {"export target", "export draft", "export dense source"}
    for step in steps:
        if step.command is not None:
            check_against(table_for(step.command), step.command)
            given = flags(step.command)
            for reads in ("--model_dir", "--medusa_model_dir", "--checkpoint_dir"):
                if reads in given:
                    assert Path(given[reads]) in written, f"{step.title} reads {given[reads]} before it is written"
            assert Path(given["--output_dir"]) == step.output
        written.add(step.output)
    builds = {step.output.name: flags(step.command) for step in steps
              if step.command and step.command[0] == "trtllm-build"}
    target = builds["target"]
    assert target["--max_batch_size"] == str(pipeline.limits.max_batch_size)
    assert target["--max_seq_len"] == str(pipeline.limits.max_sequence_length)
    # every call brings the whole sequence so far, so an engine's input may be as long as a sequence
    assert all(build["--max_input_len"] == str(pipeline.limits.max_sequence_length) for build in builds.values())
    assert target["--use_paged_context_fmha"] == "enable"
    settings = pipeline.backend.settings
    if pipeline.speculation.method == "lookahead":  # the engine's draft tokens are exactly the (W, N, G)'s
        assert target["--max_draft_len"] == str(pipeline.speculation.lookahead.nodes)
    else:
        assert target["--max_draft_len"] == str(pipeline.limits.max_draft_tokens)
    if pipeline.speculation.method == "lookahead":  # the target alone, guessing ahead by itself
        assert target["--speculative_decoding_mode"] == "lookahead_decoding" and set(builds) == {"target"}
        assert "--gather_generation_logits" not in target
        assert [s.title for s in steps] == ["convert the target", "build the target engine"]
    elif pipeline.speculation.method == "medusa":
        assert target["--speculative_decoding_mode"] == "medusa" and set(builds) == {"target"}
        convert = flags(next(s.command for s in steps if s.command and "--medusa_model_dir" in s.command))
        assert convert["--num_medusa_heads"] == str(pipeline.speculation.medusa.num_heads)
        assert convert["--max_medusa_token_len"] == str(pipeline.limits.max_draft_tokens)
    elif pipeline.speculation.method == "ngram":  # drafts from the text, verified by the one engine
        assert target["--speculative_decoding_mode"] == "draft_tokens_external" and set(builds) == {"target"}
        assert "--gather_generation_logits" not in target
    else:
        assert target["--speculative_decoding_mode"] == "draft_tokens_external"
        # exact acceptance at temperature > 0 needs both engines' generation logits
        assert "--gather_generation_logits" in target and "--gather_generation_logits" in builds["draft"]
        assert "--speculative_decoding_mode" not in builds["draft"]
    converts = [flags(s.command) for s in steps if s.command and s.command[0] == "python3"]
    for convert in converts:
        assert convert["--tp_size"] == str(settings.tp_size)
    if settings.moe_ep_size:
        assert all(c["--moe_ep_size"] == str(settings.moe_ep_size) for c in converts)
        assert all(int(c["--moe_tp_size"]) * int(c["--moe_ep_size"]) == settings.tp_size for c in converts)
    draft = pipeline.speculation.draft
    if draft is not None and draft.derive in ("int4", "int8"):  # TensorRT-LLM quantizes the target itself
        draft_convert = flags(next(s.command for s in steps if s.output.name == "draft" and s.command and
                                   s.command[0] == "python3"))
        assert draft_convert["--weight_only_precision"] == draft.derive and "--use_weight_only" in draft_convert
        assert Path(draft_convert["--model_dir"]) == pipeline.resolve(pipeline.target.checkpoint.path)


@pytest.mark.parametrize("path", [p for p in ENGINE_EXAMPLES if "mixtral" not in p.stem],
                         ids=[p.stem for p in ENGINE_EXAMPLES if "mixtral" not in p.stem])
@pytest.mark.parametrize("precision", ["int4", "int8"])
def test_a_weight_only_target_is_quantized_by_its_converter(path, precision, tmp_path):
    """target.weight_only reaches the converter that writes the target (ours, or examples/medusa/convert_checkpoint.py
    for a Medusa target: both take --use_weight_only --weight_only_precision), with upstream's flags and values; a
    separate draft keeps its own precision."""
    spec = yaml.safe_load(path.read_text())
    spec["target"]["weight_only"] = precision
    (tmp_path / path.name).write_text(yaml.safe_dump(spec))
    pipeline = load_pipeline(tmp_path / path.name)
    steps, _ = plan(pipeline, tmp_path / "engines")
    converts = {step.output.name: step.command for step in steps if step.command and step.command[0] == "python3"}
    check_against(table_for(converts["target"]), converts["target"])
    target = flags(converts["target"])
    assert "--use_weight_only" in target and target["--weight_only_precision"] == precision
    if "draft" in converts:
        assert "--use_weight_only" not in flags(converts["draft"])


def test_a_weight_only_target_needs_the_engine_line_and_a_smaller_draft(tmp_path):
    """The LLM API line takes checkpoints as they are; and a draft derived at the target's own precision would cost
    what the target costs."""
    spec = yaml.safe_load(LLAMA70B.read_text())
    spec["target"]["weight_only"] = "int4"
    spec["backend"]["trtllm"]["line"] = "llm_api"
    spec["backend"]["trtllm"].pop("server", None)
    (tmp_path / "api.yaml").write_text(yaml.safe_dump(spec))
    with pytest.raises(PipelineError, match=r"target\.weight_only.*engine line"):
        load_pipeline(tmp_path / "api.yaml")
    mixtral = yaml.safe_load(next(p for p in GPU_EXAMPLES if "mixtral" in p.stem).read_text())
    mixtral["target"]["weight_only"] = "int4"
    (tmp_path / "mixtral.yaml").write_text(yaml.safe_dump(mixtral))
    with pytest.raises(PipelineError, match=r"speculation\.draft\.derive.*int4 from a target already stored as "
                                            r"int4 would be no cheaper"):
        load_pipeline(tmp_path / "mixtral.yaml")


def test_dry_run_prints_the_plan_and_a_torch_pipeline_refuses_it(tmp_path, tiny_checkpoints):
    example = next(p for p in GPU_EXAMPLES if "mixtral" in p.name)
    result = run_cli("build", str(example), "--engines-dir", str(tmp_path / "engines"), "--dry-run")
    assert result.returncode == 0, result.stderr
    assert "trtllm-build --checkpoint_dir" in result.stdout and "--moe_ep_size 4" in result.stdout
    assert "26.04-trtllm-python-py3" in result.stdout and "[4/4]" in result.stdout
    assert not (tmp_path / "engines").exists()
    torch_pipeline = tiny_pipeline(tmp_path, "tiny", tiny_checkpoints["target"])
    refused = run_cli("build", str(torch_pipeline), "--engines-dir", str(tmp_path / "engines"), "--dry-run")
    assert refused.returncode == 2 and "--dry-run" in refused.stderr


SMALL_LOOKAHEAD = {"window": 2, "ngram": 3, "verification_set": 2}  # 1 + (2 - 1 + 2) × 2 = 7 draft tokens


@pytest.mark.parametrize("changes, key", [
    ({"speculation": {"method": "medusa", "num_draft_tokens": 2,
                      "medusa": {"heads": "h.safetensors", "num_heads": 2, "choices": [[0], [0, 0]]}},
      "target": {"checkpoint": {"source": "hf_dir", "path": "x"}, "moe": {"experts": 4}}}, "speculation.method"),
    ({"speculation": {"method": "medusa", "num_draft_tokens": 2,
                      "medusa": {"heads": "h.safetensors", "num_heads": 2, "choices": [[0], [0, 0]]}},
      "backend": {"kind": "trtllm", "trtllm": {"line": "llm_api"}}}, "backend.trtllm.line"),
    ({"backend": {"kind": "trtllm", "trtllm": {"server": "trtllm_serve"}}}, "backend.trtllm.server"),
    ({"backend": {"kind": "trtllm", "trtllm": {"line": "llm_api"}}}, "speculation.draft.derive"),
    ({"backend": {"kind": "trtllm", "trtllm": {"tp_size": 4, "moe_tp_size": 2, "moe_ep_size": 4}}},
     "backend.trtllm.moe_ep_size"),
    ({"backend": {"kind": "trtllm", "trtllm": {"tp_size": 4, "moe_ep_size": 3}}}, "backend.trtllm.moe_ep_size"),
    ({"backend": {"kind": "torch", "trtllm": {"tp_size": 2}}}, "backend.trtllm"),
    ({"backend": {"kind": "trtllm", "trtllm": {"kv_cache_free_gpu_mem_fraction": 1.5}}},
     "backend.trtllm.kv_cache_free_gpu_mem_fraction"),
    # the executor's KvCacheConfig checks 0 < fraction < 1 (kvCacheConfig.cpp)
    ({"backend": {"kind": "trtllm", "trtllm": {"kv_cache_free_gpu_mem_fraction": 1.0}}},
     "backend.trtllm.kv_cache_free_gpu_mem_fraction"),
    # TrtGptModelInflightBatching: "KV cache block reuse must be enabled for speculative decoding target model"
    ({"backend": {"kind": "trtllm", "trtllm": {"enable_kv_cache_reuse": False}}},
     "backend.trtllm.enable_kv_cache_reuse"),
    ({"speculation": {"num_draft_tokens": 9}}, "speculation.num_draft_tokens"),  # above the engine's max_draft_len
    # the engine line's EAGLE reads EAGLE-1 drafts only (examples/eagle/convert_checkpoint.py)
    ({"speculation": {"method": "eagle", "eagle": {"head": "h", "top_k": 1}}}, "backend.trtllm.line"),
    # the LLM API's EAGLE-3 drafts one chain (its draft trees are flagged as under development in 1.2)
    ({"speculation": {"method": "eagle", "eagle": {"head": "h"}},
      "backend": {"kind": "trtllm", "trtllm": {"line": "llm_api"}}}, "speculation.eagle.top_k"),
    # llm_args.LookaheadDecodingConfig.supports_backend: "Speculation type Lookahead does not support backend pytorch"
    ({"speculation": {"method": "lookahead", "lookahead": SMALL_LOOKAHEAD},
      "backend": {"kind": "trtllm", "trtllm": {"line": "llm_api"}}}, "backend.trtllm.line"),
    ({"speculation": {"method": "lookahead", "lookahead": SMALL_LOOKAHEAD},
      "backend": {"kind": "trtllm", "trtllm": {"server": "trtllm_serve"}}}, "backend.trtllm.server"),
    # greedy only upstream: a sampled or penalised default would refuse every request that keeps it
    ({"speculation": {"method": "lookahead", "lookahead": SMALL_LOOKAHEAD}, "sampling": {"temperature": 0.7}},
     "sampling.temperature"),
    ({"speculation": {"method": "lookahead", "lookahead": SMALL_LOOKAHEAD}, "sampling": {"repetition_penalty": 1.1}},
     "sampling.repetition_penalty"),
    # (N - 2) + (W - 1 + G)(N - 1) = 15 draft tokens for the default (4, 3, 4), above limits.max_draft_tokens (8)
    ({"speculation": {"method": "lookahead"}}, "speculation.lookahead"),
    ({"speculation": {"method": "early_exit"}}, "speculation.method"),  # no TensorRT-LLM path upstream
], ids=["medusa-on-moe", "medusa-on-llm-api", "draft-target-via-llm-api-on-engines", "int4-draft-on-llm-api",
        "moe-product", "moe-ep-divides-tp", "trtllm-section-on-torch", "kv-fraction", "kv-fraction-1",
        "target-without-kv-reuse", "above-max-draft-len", "eagle3-on-engines", "eagle3-tree-on-llm-api",
        "lookahead-on-llm-api", "lookahead-via-trtllm-serve", "lookahead-sampled-default",
        "lookahead-penalised-default", "lookahead-above-max-draft-len", "early-exit"])
def test_invalid_trtllm_combinations_fail_at_validation_naming_the_key(tmp_path, tiny_checkpoints, changes, key):
    path = trtllm_pipeline(tmp_path, tiny_checkpoints["target"], **changes)
    with pytest.raises(PipelineError, match=rf"{key.replace('.', chr(92) + '.')}: "):
        load_pipeline(path)


def test_a_lookahead_plan_builds_the_target_alone_for_its_own_sizes(tmp_path, tiny_checkpoints):
    """Lookahead on the engine line: the target converted and built with lookahead_decoding and --max_draft_len
    exactly (N - 2) + (W - 1 + G)(N - 1), not limits.max_draft_tokens (an engine built for more fails to load with
    the sizes it is served with: test_trtllm_double); no draft, no export, no logits gathered; its tensorrtllm model
    decodes lookahead with the three sizes, and declares none of the per-request lookahead inputs."""
    path = trtllm_pipeline(tmp_path, tiny_checkpoints["target"], speculation={
        "method": "lookahead", "lookahead": SMALL_LOOKAHEAD})
    pipeline = load_pipeline(path)
    steps, _ = plan(pipeline, tmp_path / "engines")
    assert [s.title for s in steps] == ["convert the target", "build the target engine"]
    for step in steps:
        check_against(table_for(step.command), step.command)
    build = flags(steps[1].command)
    assert build["--speculative_decoding_mode"] == "lookahead_decoding" and build["--max_draft_len"] == "7"
    assert pipeline.limits.max_draft_tokens == 8 and "--gather_generation_logits" not in build
    configs = model_configs(pipeline, served_at=Path("/models/la"))
    assert set(configs) == {"preprocessing", "speculative", "ensemble", "drain_hold", "tensorrt_llm"}
    values = {key: value.string_value for key, value in configs["tensorrt_llm"].parameters.items()}
    assert {key: values[key] for key in ("decoding_mode", *LOOKAHEAD_PARAMETERS)} == {
        "decoding_mode": "lookahead", "lookahead_window_size": "2", "lookahead_ngram_size": "3",
        "lookahead_verification_set_size": "2"}
    assert values["max_beam_width"] == "1"  # "Lookahead requires beam width = 1"
    for config in configs.values():  # Triton refuses a request that carries one
        assert not {t.name for t in config.input} & set(LOOKAHEAD_REQUEST_INPUTS), config.name


def test_parallelism_that_does_not_divide_the_model_fails_before_anything_runs(tmp_path, tiny_checkpoints):
    """The tiny target has 4 attention heads and 2 key/value heads."""
    for tp, words in ((3, "4 attention heads"), (4, "2 key/value heads")):
        path = trtllm_pipeline(tmp_path, tiny_checkpoints["target"], backend={
            "kind": "trtllm", "trtllm": {"tp_size": tp}})
        with pytest.raises(BuildError, match=f"backend.trtllm.tp_size: {tp} does not divide the target's {words}"):
            plan(load_pipeline(path), tmp_path / "engines")
    moe = trtllm_pipeline(tmp_path, tiny_checkpoints["target"], target={"moe": {"experts": 3}},
                          backend={"kind": "trtllm", "trtllm": {"tp_size": 2, "moe_ep_size": 2}})
    with pytest.raises(BuildError, match="backend.trtllm.moe_ep_size: 2 does not divide the target's 3 experts"):
        plan(load_pipeline(moe), tmp_path / "engines")
    fits = trtllm_pipeline(tmp_path, tiny_checkpoints["target"], backend={"kind": "trtllm", "trtllm": {"tp_size": 2}})
    steps, notes = plan(load_pipeline(fits), tmp_path / "engines")
    assert notes == ["target: llama, 4 attention heads, 2 key/value heads"] and len(steps) == 4  # no export


def test_a_real_build_here_stops_naming_what_is_missing_and_writes_nothing(tmp_path, tiny_checkpoints):
    path = trtllm_pipeline(tmp_path, tiny_checkpoints["target"])
    assert missing_requirements(load_pipeline(path))  # this machine has no TensorRT-LLM (and no GPU)
    result = run_cli("build", str(path), "--engines-dir", str(tmp_path / "engines"))
    assert result.returncode == 2
    assert "missing: the tensorrt_llm package (TensorRT-LLM 1.2.1" in result.stderr
    assert "Nothing was written" in result.stderr and not (tmp_path / "engines").exists()
    in_process = run_cli("generate", str(path), "hello", "--engines-dir", str(tmp_path / "engines"))
    assert in_process.returncode == 2 and "backend.kind is trtllm" in in_process.stderr


def test_a_medusa_build_checks_the_converter_before_running_anything(tmp_path, tiny_checkpoints):
    """The converter is a script of TensorRT-LLM's repository, not of its wheel: its path is a setting whose default
    is where the pinned image keeps it, and a build looks for it first."""
    medusa = {"method": "medusa", "num_draft_tokens": 2,
              "medusa": {"heads": "h.safetensors", "num_heads": 2, "choices": [[0], [0, 0]]}}
    default = load_pipeline(trtllm_pipeline(tmp_path, tiny_checkpoints["target"], speculation=medusa))
    assert default.backend.settings.medusa_converter == "/app/examples/medusa/convert_checkpoint.py"
    assert any("Medusa converter at /app/examples/medusa/convert_checkpoint.py" in line
               for line in missing_requirements(default))
    steps, _ = plan(default, tmp_path / "engines")
    assert steps[1].command[:2] == ("python3", "/app/examples/medusa/convert_checkpoint.py")  # after the heads
    converter = tmp_path / "convert_checkpoint.py"
    converter.write_text("")
    given = load_pipeline(trtllm_pipeline(tmp_path, tiny_checkpoints["target"], speculation=medusa, backend={
        "kind": "trtllm", "trtllm": {"medusa_converter": str(converter)}}))
    assert not any("Medusa converter" in line for line in missing_requirements(given))
    result = run_cli("build", str(trtllm_pipeline(tmp_path, tiny_checkpoints["target"], speculation=medusa)),
                     "--engines-dir", str(tmp_path / "engines"))
    assert result.returncode == 2 and "backend.trtllm.medusa_converter" in result.stderr
    assert not (tmp_path / "engines").exists()


def test_the_llm_api_line_writes_speculative_config(tmp_path, tiny_checkpoints):
    draft = {"derive": "none", "checkpoint": {"source": "hf_dir", "path": str(tiny_checkpoints["draft"])}}
    path = trtllm_pipeline(tmp_path, tiny_checkpoints["target"], speculation={"draft": draft},
                           backend={"kind": "trtllm", "trtllm": {"line": "llm_api", "tp_size": 2,
                                                                 "kv_cache_free_gpu_mem_fraction": 0.8}})
    pipeline = load_pipeline(path)
    config = llm_api_config(pipeline, tmp_path / "trtllm")
    assert config["speculative_config"] == {"decoding_type": "DraftTarget", "max_draft_len": 3,
                                            "speculative_model_dir": str(tiny_checkpoints["draft"])}
    assert config["backend"] == "pytorch" and config["tensor_parallel_size"] == 2
    assert config["kv_cache_config"] == {"free_gpu_memory_fraction": 0.8, "enable_block_reuse": True}
    steps, _ = plan(pipeline, tmp_path / "engines")
    assert [s.action for s in steps] == ["write llm_api.yaml"]  # the LLM reads both checkpoints where they are
    ngram = trtllm_pipeline(tmp_path, tiny_checkpoints["target"], "n", speculation={"method": "ngram"},
                            backend={"kind": "trtllm", "trtllm": {"line": "llm_api"}})
    assert llm_api_config(load_pipeline(ngram), tmp_path)["speculative_config"] == {
        "decoding_type": "NGram", "max_draft_len": 3, "max_matching_ngram_size": 4}  # ngram.max_n


def eagle_pipeline(tmp_path: Path, target: Path, head: Path, **eagle) -> Path:
    """A tiny EAGLE-3 pipeline on the llm_api line: a chain of 3 drafted tokens."""
    return trtllm_pipeline(tmp_path, target, "e", speculation={
        "method": "eagle", "num_draft_tokens": 3, "eagle": {"head": str(head), "top_k": 1, "max_nodes": 3, **eagle}},
        backend={"kind": "trtllm", "trtllm": {"line": "llm_api"}})


def test_the_llm_api_line_writes_eagle3_as_upstream_reads_it(tmp_path):
    """speculative_config for an EAGLE-3 head, read by the double of the LLM API (tests/trtllm_double/
    llmapi_speculative.py): EAGLE-3 on the two-model path, which samples at any temperature; the chain the torch
    flavour drafts; the layers the head was trained on, as TensorRT-LLM numbers them."""
    target = save_tiny_checkpoint(tmp_path / "target", seed=0, num_hidden_layers=8)
    head = save_tiny_eagle_head(tmp_path / "head", feature_layers=(2, 3, 5))
    pipeline = load_pipeline(eagle_pipeline(tmp_path, target, head, max_nodes=2))
    config = llm_api_config(pipeline, tmp_path / "trtllm")
    assert config["model"] == str(target) and config["backend"] == "pytorch"
    speculative = config["speculative_config"]
    assert speculative == {"decoding_type": "Eagle", "max_draft_len": 2,  # the chain cut at max_nodes
                           "speculative_model_dir": str(head), "eagle3_one_model": False,
                           "eagle3_layers_to_capture": [1, 2, 4]}
    setup = eagle_setup(speculative, target_layers=8)
    assert setup.mode == "EAGLE3" and setup.samples_at_temperature and setup.draft_dir == head
    assert setup.max_draft_len == setup.max_total_draft_tokens == 2  # a chain
    # each captured output is the hidden state entering the next layer, which is what the head's ids name
    assert [layer + 1 for layer in setup.layers_to_capture] == [2, 3, 5]
    steps, _ = plan(pipeline, tmp_path / "engines")
    assert [s.action for s in steps] == ["write llm_api.yaml"]  # the LLM reads both folders where they are

    # A head that names no layers: both ecosystems' defaults, which agree (vLLM's ids are TensorRT-LLM's plus one)
    bare = save_tiny_eagle_head(tmp_path / "bare", feature_layers=None)
    speculative = llm_api_config(load_pipeline(eagle_pipeline(tmp_path, target, bare)), tmp_path)["speculative_config"]
    assert "eagle3_layers_to_capture" not in speculative and speculative["max_draft_len"] == 3
    assert [layer + 1 for layer in eagle_setup(speculative, target_layers=8).layers_to_capture] == list(
        default_feature_layers(8))


def test_eagle_heads_upstream_cannot_capture_are_refused_naming_the_key(tmp_path):
    target = save_tiny_checkpoint(tmp_path / "target", seed=0, num_hidden_layers=6)
    for layers, words in (((0, 2, 5), "captures the embedding"), ((2, 2, 5), "names a layer twice")):
        head = save_tiny_eagle_head(tmp_path / f"head{layers[0]}{layers[1]}", feature_layers=layers)
        with pytest.raises(BuildError, match=f"speculation.eagle.head: .*{words}"):
            llm_api_config(load_pipeline(eagle_pipeline(tmp_path, target, head)), tmp_path)
    with pytest.raises(BuildError, match="speculation.eagle.head: cannot read"):
        llm_api_config(load_pipeline(eagle_pipeline(tmp_path, target, tmp_path / "nothing")), tmp_path)
    example = load_pipeline(next(p for p in GPU_EXAMPLES if p.stem == "llama8b-eagle3"))
    assert example.backend.settings.line == "llm_api" and example.speculation.eagle.top_k == 1
    steps, notes = plan(example, tmp_path / "engines")  # planned anywhere; its folders are not on this machine
    assert [s.action for s in steps] == ["write llm_api.yaml"] and any("not checked" in n for n in notes)
    assert example.speculation.eagle.max_nodes >= example.speculation.num_draft_tokens  # an uncut chain


def test_the_llm_api_double_refuses_as_upstream(tmp_path):
    """What TensorRT-LLM's EagleDecodingConfig refuses, and the one-model default that would decode a sampled
    request greedily (the reason the plan writes eagle3_one_model false)."""
    head = save_tiny_eagle_head(tmp_path / "head")
    good = {"decoding_type": "Eagle", "max_draft_len": 3, "speculative_model_dir": str(head)}
    assert eagle_setup(good, 6).mode == "EAGLE3_ONE_MODEL" and not eagle_setup(good, 6).samples_at_temperature
    assert eagle_setup({**good, "allow_advanced_sampling": True}, 6).samples_at_temperature
    # the subclass's tag, and the field under its own name rather than its alias
    assert eagle_setup({"decoding_type": "Eagle3", "max_draft_len": 3, "speculative_model": str(head)}, 6).draft_dir \
        == head
    for changes, message in (
            ({"max_draft_len": 0}, "max_draft_len must be > 0 for Eagle"),
            ({"top_k": 4}, "top_k: Extra inputs are not permitted"),
            ({"speculative_model_dir": None}, "Draft model must be provided for EAGLE"),
            ({"eagle_choices": [[0], [0, 0]], "use_dynamic_tree": True}, "use_dynamic_tree should be False"),
            ({"use_dynamic_tree": True}, "dynamic_tree_max_topK should be provided"),
            ({"decoding_type": "Medusa"}, "not an EAGLE tag"),
            ({"speculative_model_dir": str(tmp_path)}, "loaded from its config.json and weights")):
        config = {key: value for key, value in {**good, **changes}.items() if value is not None}
        with pytest.raises(ValueError, match=message):
            eagle_setup(config, 6)
    with pytest.raises(ValueError, match="'Eagle3' is only supported on the PyTorch backend"):
        eagle_setup({**good, "decoding_type": "Eagle3"}, 6, backend="tensorrt")
    tree = eagle_setup({**good, "use_dynamic_tree": True, "dynamic_tree_max_topK": 4, "max_total_draft_tokens": 10}, 6)
    assert tree.max_total_draft_tokens == 10


def fake_tensorrt_llm(calls: list) -> dict[str, types.ModuleType]:
    """A test double of the TensorRT-LLM Python API the converter calls, with upstream's signatures
    (tensorrt_llm/mapping.py: Mapping's parallel sizes are keyword-only; models/llama/model.py: from_hugging_face;
    models/modeling_utils.py: QuantConfig, save_checkpoint)."""

    class Mapping:
        def __init__(self, world_size=1, rank=0, gpus_per_node=8, *, tp_size=1, pp_size=1, moe_tp_size=-1,
                     moe_ep_size=-1, **rest):
            assert tp_size * pp_size == world_size and moe_tp_size * moe_ep_size == tp_size
            self.rank, self.sizes = rank, (tp_size, pp_size, moe_tp_size, moe_ep_size)

    class LLaMAForCausalLM:
        @classmethod
        def from_hugging_face(cls, hf_model_or_dir, dtype="auto", mapping=None, quant_config=None, **kwargs):
            model = cls()
            model.loaded = (hf_model_or_dir, dtype, mapping.rank, mapping.sizes, quant_config.quant_algo)
            return model

        def save_checkpoint(self, output_dir, save_config=True):
            calls.append((*self.loaded, output_dir, save_config))

    class QuantConfig:
        def __init__(self, quant_algo=None, **rest):
            self.quant_algo = quant_algo

    modules = {name: types.ModuleType(name) for name in (
        "tensorrt_llm", "tensorrt_llm.mapping", "tensorrt_llm.models", "tensorrt_llm.models.modeling_utils",
        "tensorrt_llm.quantization")}
    modules["tensorrt_llm.mapping"].Mapping = Mapping
    modules["tensorrt_llm.models"].LLaMAForCausalLM = LLaMAForCausalLM
    modules["tensorrt_llm.models.modeling_utils"].QuantConfig = QuantConfig
    modules["tensorrt_llm.quantization"].QuantAlgo = types.SimpleNamespace(W4A16="W4A16", W8A16="W8A16")
    return modules


@pytest.mark.parametrize("precision, algorithm", [("int4", "W4A16"), ("int8", "W8A16")])
def test_the_converter_saves_one_rank_per_gpu_through_the_python_api(monkeypatch, tmp_path, precision, algorithm):
    calls: list = []
    for name, module in fake_tensorrt_llm(calls).items():
        monkeypatch.setitem(sys.modules, name, module)
    args = trtllm_convert.parse(["--model_dir", "hf", "--output_dir", "out", "--dtype", "bfloat16", "--tp_size", "4",
                                 "--moe_tp_size", "1", "--moe_ep_size", "4", "--use_weight_only",
                                 "--weight_only_precision", precision])
    check_against(LLAMA_CONVERT_FLAGS, ("python", "-m", "x", "--model_dir", "hf", "--output_dir", "out", "--dtype",
                                        "bfloat16", "--use_weight_only", "--weight_only_precision", precision))
    trtllm_convert.convert(args)
    assert calls == [("hf", "bfloat16", rank, (4, 1, 1, 4), algorithm, "out", rank == 0) for rank in range(4)]


def test_the_torch_path_never_imports_tensorrt_llm():
    code = ("import sys, specdeploy.cli, specdeploy.workflows, specdeploy.build.torch_engine, "
            "specdeploy.build.trtllm.engine_build, specdeploy.build.trtllm.plan; "
            "assert 'tensorrt_llm' not in sys.modules, 'imported'")
    assert subprocess.run([sys.executable, "-c", code], capture_output=True).returncode == 0


def parse_choices(text: str) -> list[list[int]]:
    """The backend's reading of medusa_choices (utils::csvStrToVecVecInt): brace groups of comma-separated ints."""
    return [[int(v) for v in group.split(",") if v.strip()] for group in re.findall(r"\{([^}]*)\}", text)]


@pytest.mark.parametrize("path", ENGINE_EXAMPLES, ids=[p.stem for p in ENGINE_EXAMPLES])
def test_tensorrtllm_model_configs_use_the_upstream_template_keys(path):
    pipeline = load_pipeline(path)
    target = tensorrtllm_model("tensorrt_llm", pipeline, "/engines/target")
    draft = tensorrtllm_model("tensorrt_llm_draft", pipeline, "/engines/draft", draft=True)
    for config in (target, draft):
        parsed = text_format.Parse(text_format.MessageToString(config), pb.ModelConfig())
        assert parsed == config and parsed.backend == "tensorrtllm" and parsed.model_transaction_policy.decoupled
        assert set(parsed.parameters) <= TENSORRTLLM_PARAMETER_KEYS
        values = {key: value.string_value for key, value in parsed.parameters.items()}
        # every parameter the model instance reads without a fallback, or it does not load
        assert set(TENSORRTLLM_REQUIRED_PARAMETERS) <= set(values)
        assert values["guided_decoding_backend"] == values["xgrammar_tokenizer_info_path"] == ""  # guided: off
        # a misspelled boolean is silently replaced by its default upstream, so only upstream's spellings
        for key in ("enable_kv_cache_reuse", "exclude_input_in_output", "enable_chunked_context"):
            assert values[key] in BOOLEAN_VALUES
        assert values["gpt_model_type"] in GPT_MODEL_TYPES and values["gpt_model_type"] == "inflight_fused_batching"
        assert values["batch_scheduler_policy"] in BATCH_SCHEDULER_POLICIES
        assert 0 < float(values["kv_cache_free_gpu_mem_fraction"]) < 1
        assert values["decoding_mode"] in DECODING_MODES
        assert values["enable_chunked_context"] == "true"  # a long sequence is prefilled in chunks
        assert {t.name for t in parsed.input} <= set(TENSORRTLLM_INPUTS)
        assert {t.name for t in parsed.input if not t.optional} == {"input_lengths", "request_output_len"}
        assert parsed.max_batch_size == pipeline.limits.max_batch_size
    values = {key: value.string_value for key, value in target.parameters.items()}
    assert values["gpt_model_path"] == "/engines/target"
    served = model_configs(pipeline, served_at=Path("/models/x"))  # where the repository will be on the server
    assert served["tensorrt_llm"].parameters["gpt_model_path"].string_value == "/models/x/tensorrt_llm/1/engine"
    lookahead = pipeline.speculation.lookahead
    if pipeline.speculation.method == "medusa":
        assert values["decoding_mode"] == "medusa"
        assert parse_choices(values["medusa_choices"]) == [list(p) for p in pipeline.speculation.medusa.choices]
    elif pipeline.speculation.method == "lookahead":
        # both the mode and the sizes: upstream reads the sizes only under decoding_mode lookahead
        assert values["decoding_mode"] == "lookahead" and "medusa_choices" not in values
        assert [int(values[key]) for key in LOOKAHEAD_PARAMETERS] == [lookahead.window, lookahead.ngram,
                                                                       lookahead.verification_set]
    else:
        assert "medusa_choices" not in values and values["decoding_mode"] == "top_k_top_p"
    if not pipeline.speculation.method == "lookahead":
        assert not set(values) & set(LOOKAHEAD_PARAMETERS)
    assert not set(draft.parameters) & set(LOOKAHEAD_PARAMETERS)
    # The draft's KV cache: capped at what it can hold, so it never takes the target's share of the GPU.
    draft_values = {key: value.string_value for key, value in draft.parameters.items()}
    limits = pipeline.limits
    assert int(draft_values["max_tokens_in_paged_kv_cache"]) == limits.max_batch_size * limits.max_sequence_length
    assert "max_tokens_in_paged_kv_cache" not in values
