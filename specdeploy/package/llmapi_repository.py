"""`specdeploy package` on the llm_api line (backend.trtllm.line: llm_api): a repository holding Triton's LLM-API
model, `tensorrt_llm` (Python backend, TensorRT-LLM's PyTorch backend inside, speculation by its
speculative_config). Its config.pbtxt is built as a ModelConfig with the upstream template's tensors
(build/trtllm/upstream.py), its 1/model.yaml from the pipeline (build/trtllm/plan.py's llm_api_config) naming the
checkpoints copied into 1/hf/ where the server will see them, and its code (1/model.py, 1/helpers.py) is
upstream's, copied from a TensorRT-LLM checkout at the served release's tag or from the pinned image's /app (we
do not ship NVIDIA's code). An EAGLE-3 head is copied beside the target (1/hf/eagle) and named by
speculative_config.

Clients of this line use the LLM-API model's own request names (text_input, sampling_param_max_tokens, ...): the
specdeploy ensemble and its statistics are not on this line.
"""

from __future__ import annotations

import shutil
from pathlib import Path

import yaml
from google.protobuf import text_format
from tritonclient.grpc import model_config_pb2 as pb

from specdeploy.build.trtllm.plan import hf_dirs, llm_api_config
from specdeploy.build.trtllm.upstream import (
    LLMAPI_CODE_FILES,
    LLMAPI_IMAGE_MODEL_CODE,
    LLMAPI_INPUTS,
    LLMAPI_MODEL_CODE,
    LLMAPI_OUTPUTS,
)
from specdeploy.errors import SpecdeployError
from specdeploy.serve.model_files import hf_dir_files, link_or_copy
from specdeploy.spec.engine_paths import staging_dir
from specdeploy.spec.pipeline import PipelineSpec

MODEL, VERSION = "tensorrt_llm", "1"
MODEL_YAML = "model.yaml"
# Decoupled, so requests can stream; no Triton batching (the LLM batches in flight).
TRITON_CONFIG = {"max_batch_size": 0, "decoupled": True}


def llmapi_model_config() -> pb.ModelConfig:
    """The model's config.pbtxt, with TRITON_CONFIG's batching and decoupling. Upstream's config leaves them to
    model.yaml's triton_config, which its model.py applies only in auto_complete_config; that never runs under
    --disable-auto-complete-config (which upstream's launch script and our Kubernetes overlays pass), and the model
    would come up non-decoupled. With auto-completion on, the same values change nothing."""
    config = pb.ModelConfig(name=MODEL, backend="python", max_batch_size=TRITON_CONFIG["max_batch_size"])
    config.model_transaction_policy.decoupled = TRITON_CONFIG["decoupled"]
    config.instance_group.add(count=1, kind=pb.ModelInstanceGroup.KIND_CPU)
    for name, (kind, dims) in LLMAPI_INPUTS.items():
        config.input.add(name=name, data_type=pb.DataType.Value(kind), dims=dims, optional=name != "text_input")
    for name, (kind, dims) in LLMAPI_OUTPUTS.items():
        config.output.add(name=name, data_type=pb.DataType.Value(kind), dims=dims)
    return config


def model_yaml(pipeline: PipelineSpec, served_at: Path) -> dict:
    """model.yaml: the LLM options with the checkpoints where the server sees them (copied into 1/hf/<component>),
    and TRITON_CONFIG (what the model reads for itself)."""
    version = served_at / MODEL / VERSION
    models = {component: version / "hf" / component for component in hf_dirs(pipeline, version)}
    return {**llm_api_config(pipeline, version, models), "triton_config": dict(TRITON_CONFIG)}


def llmapi_code(source: Path) -> Path:
    """The LLM-API model's code folder in `source`: a TensorRT-LLM checkout, or the pinned image's /app."""
    image = source / LLMAPI_IMAGE_MODEL_CODE
    return image if not (source / LLMAPI_MODEL_CODE).is_dir() and image.is_dir() else source / LLMAPI_MODEL_CODE


def write_llmapi_repository(engine_dir: Path, pipeline: PipelineSpec, output: Path, served_at: Path,
                            trtllm_source: Path | None) -> Path:
    """Write the llm_api repository at `output` (replacing one written before); SpecdeployError names a missing
    TensorRT-LLM checkout. Returns `output`."""
    if trtllm_source is None:
        raise SpecdeployError(f"{pipeline.name}: the llm_api line serves Triton's LLM-API model, whose code comes "
                              f"from TensorRT-LLM: pass --trtllm-source, a checkout of NVIDIA/TensorRT-LLM at the "
                              f"served release's tag (it needs {LLMAPI_MODEL_CODE}/{{{','.join(LLMAPI_CODE_FILES)}}}) "
                              f"or, inside the pinned image, /app")
    code = llmapi_code(Path(trtllm_source))
    missing = [name for name in LLMAPI_CODE_FILES if not (code / name).is_file()]
    if missing:
        raise SpecdeployError(f"--trtllm-source {trtllm_source}: no {', '.join(missing)} in {LLMAPI_MODEL_CODE} "
                              f"(a checkout) or {LLMAPI_IMAGE_MODEL_CODE} (the image's /app)")
    with staging_dir(Path(output)) as staging:
        version = staging / MODEL / VERSION
        version.mkdir(parents=True)
        (staging / MODEL / "config.pbtxt").write_text(text_format.MessageToString(llmapi_model_config()))
        (version / MODEL_YAML).write_text(yaml.safe_dump(model_yaml(pipeline, served_at), sort_keys=False))
        for name in LLMAPI_CODE_FILES:
            shutil.copy2(code / name, version / name)
        # each checkpoint where the build found it: our export, or the checkpoint itself (the server does not mount
        # the build's checkpoint volume)
        for component, source in hf_dirs(pipeline, Path(engine_dir) / "trtllm").items():
            shutil.copytree(source, version / "hf" / component, ignore=hf_dir_files(True), copy_function=link_or_copy)
    return Path(output)
