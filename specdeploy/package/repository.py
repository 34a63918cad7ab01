"""`specdeploy package`: a self-contained, relocatable Triton model repository for a pipeline's engine.

ensemble (tensorrtllm_backend's request/response names) = preprocessing → speculative (decoupled, Python backend,
owns draft + target, detokenises), and drain_hold, which keeps the models loaded while `specdeploy serve` drains
(serve/drain_hold.py). Each model carries its files in its version directory, named by paths relative
to it (serve/model_files.py): the engine in `speculative/1/engine/` (its weights hard-linked to the built engine's
where the file system allows, everything else copied), the tokenizer in `preprocessing/1/tokenizer/`. The
repository therefore serves from wherever it is copied or mounted. Every config.pbtxt is built as Triton's
ModelConfig protobuf message and written with protobuf's text format; the Python model files come from
serve/model_repo/ (thin wrappers importing specdeploy): `speculative/1/model.py` is
serve/model_repo/speculative_torch/model.py or serve/model_repo/speculative_trtllm/model.py, by the pipeline's
backend.
"""

from __future__ import annotations

import shutil
from pathlib import Path

from google.protobuf import text_format
from tritonclient.grpc import model_config_pb2 as pb

from specdeploy.build.trtllm.plan import hf_dirs
from specdeploy.errors import SpecdeployError
from specdeploy.package.llmapi_repository import MODEL_YAML, write_llmapi_repository
from specdeploy.package.trtllm_models import tensorrtllm_model
from specdeploy.serve.drain_hold import HOLD_MODEL, SEQUENCE_IDLE_S
from specdeploy.serve.model_files import (
    DRAFT_MODEL_PARAMETER,
    ENGINE_PARAMETER,
    MODEL_CODE,
    PIPELINE_PARAMETER,
    TARGET_MODEL_PARAMETER,
    TOKENIZER_PARAMETER,
    WEIGHTS,
    hf_dir_files,
    link_or_copy,
)
from specdeploy.serve.requests import SCALAR_INPUTS, STATISTICS
from specdeploy.spec.engine_paths import PIPELINE_FILE, engine_pipeline, staging_dir
from specdeploy.spec.pipeline import PipelineSpec

# The model_repo/ folder of the `speculative` model's code, by backend kind: one per flavour, one model to clients.
SPECULATIVE_CODE = {"torch": "speculative_torch", "trtllm": "speculative_trtllm"}
VERSION = "1"
ENGINE_FOLDER, TOKENIZER_FOLDER = "engine", "tokenizer"
MODEL_FILES = {WEIGHTS, "config.json"}  # a component's files that are not its tokenizer's
# The trtllm flavour: the tensorrtllm models' names (upstream's), the orchestration's parameters and files.
TARGET_MODEL, DRAFT_MODEL = "tensorrt_llm", "tensorrt_llm_draft"
TARGET_FOLDER = "target"  # the target's tokenizer and config.json (vocabulary size, end-of-sequence ids)
MARKERS = ("ensemble/config.pbtxt", f"tensorrt_llm/1/{MODEL_YAML}")  # files that only a written repository has


def add_tensor(tensors, name: str, kind: str, dims: list[int], optional: bool = False) -> None:
    """Append a ModelInput or ModelOutput (`tensors` is the config's repeated field)."""
    tensor = tensors.add(name=name, data_type=pb.DataType.Value(kind), dims=dims)
    if optional:
        tensor.optional = True


def add_statistics(tensors) -> None:
    for name, kind, _ in STATISTICS:
        add_tensor(tensors, name, kind, [1])


def python_model(name: str, pipeline: PipelineSpec, on_gpu: bool = False, **parameters: str) -> pb.ModelConfig:
    """on_gpu: one instance on each GPU the server sees (KIND_GPU), else one CPU instance."""
    config = pb.ModelConfig(name=name, backend="python", max_batch_size=pipeline.limits.max_batch_size)
    kind = pb.ModelInstanceGroup.KIND_GPU if on_gpu else pb.ModelInstanceGroup.KIND_CPU
    config.instance_group.add(count=1, kind=kind)
    for key, value in parameters.items():
        config.parameters[key].string_value = value
    return config


def add_request_inputs(inputs) -> None:
    """A client's inputs (tensorrtllm_backend's names), all optional to Triton: the model names a missing one."""
    add_tensor(inputs, "text_input", "TYPE_STRING", [1], optional=True)
    add_tensor(inputs, "stop_words", "TYPE_STRING", [-1], optional=True)
    for name, kind in SCALAR_INPUTS.items():
        add_tensor(inputs, name, kind, [1], optional=True)


def speculative_model(pipeline: PipelineSpec, on_gpu: bool = False, **parameters: str) -> pb.ModelConfig:
    """The `speculative` model (decoupled): token ids from the ensemble's preprocessing, or text from a client calling
    it directly (the entry point whose cancellation reaches the running request, which Triton 2.51 does not pass
    into a running ensemble step); it answers text, or token ids when a client asks for output_ids instead.
    Detokenising here rather than in a postprocessing step means a stream makes no new request per response, so it
    keeps running while Triton shuts down (a stopping server refuses new requests to every model)."""
    speculative = python_model("speculative", pipeline, on_gpu, **parameters)
    speculative.model_transaction_policy.decoupled = True
    add_tensor(speculative.input, "input_ids", "TYPE_INT32", [-1], optional=True)
    add_tensor(speculative.input, "stop_words_ids", "TYPE_INT32", [-1], optional=True)
    add_request_inputs(speculative.input)
    add_tensor(speculative.output, "text_output", "TYPE_STRING", [-1])
    add_tensor(speculative.output, "output_ids", "TYPE_INT32", [-1])
    add_statistics(speculative.output)
    # on the final response only: how the request ended (decoding/finish.py), as OpenAI's finish_reason reads it
    add_tensor(speculative.output, "finish_reason", "TYPE_STRING", [-1])
    return speculative


def drain_hold_model() -> pb.ModelConfig:
    """`drain_hold` (serve/drain_hold.py): a sequence the launcher holds open on it keeps Triton from unloading the
    models while `specdeploy serve` drains, so that new requests get UNAVAILABLE and not NOT_FOUND."""
    config = pb.ModelConfig(name=HOLD_MODEL, backend="python", max_batch_size=1)
    config.instance_group.add(count=1, kind=pb.ModelInstanceGroup.KIND_CPU)
    config.sequence_batching.max_sequence_idle_microseconds = SEQUENCE_IDLE_S * 1_000_000
    add_tensor(config.input, "hold", "TYPE_BOOL", [1])
    add_tensor(config.output, "held", "TYPE_BOOL", [1])
    return config


def model_configs(pipeline: PipelineSpec, served_at: Path | None = None) -> dict[str, pb.ModelConfig]:
    """Every model's config. The torch flavour: preprocessing → speculative (our engine inside). The trtllm flavour:
    the same two and the same ensemble, the speculative model orchestrating the `tensorrtllm` backend's
    `tensorrt_llm` (and, for draft-target, `tensorrt_llm_draft`) models, whose engines are named by absolute path
    (the backend reads gpt_model_path as it is): `served_at` is where the repository will be on the server."""
    # text_input is required, but declared optional so that its absence reaches preprocessing, which answers with an
    # error naming it (Triton 2.51's ensemble answers a missing required input with an empty, successful response).
    # Preprocessing also receives the scalar inputs, unused, so a request with any input reaches it at all (the
    # Python backend refuses a request with no inputs before the model sees it).
    preprocessing = python_model("preprocessing", pipeline, **{TOKENIZER_PARAMETER: TOKENIZER_FOLDER})
    add_request_inputs(preprocessing.input)
    add_tensor(preprocessing.output, "input_ids", "TYPE_INT32", [-1])

    ensemble = pb.ModelConfig(name="ensemble", platform="ensemble", max_batch_size=pipeline.limits.max_batch_size)
    add_request_inputs(ensemble.input)
    add_tensor(ensemble.output, "text_output", "TYPE_STRING", [-1])
    add_statistics(ensemble.output)
    outputs = {name: name for name in ("text_output", *(name for name, *_ in STATISTICS))}
    steps = ensemble.ensemble_scheduling.step
    steps.add(model_name="preprocessing", model_version=-1,
              input_map={"text_input": "text_input", "stop_words": "stop_words",
                         **{name: name for name in SCALAR_INPUTS}},
              output_map={"input_ids": "_input_ids"})
    steps.add(model_name="speculative", model_version=-1,
              input_map={"input_ids": "_input_ids", "stop_words": "stop_words",
                         **{name: name for name in SCALAR_INPUTS}},
              output_map=outputs)

    if pipeline.backend.kind == "torch":
        # a torch engine on cuda: the engine's model runs on the instance's GPU (the tokenizer stays on the CPU)
        on_gpu = pipeline.backend.device == "cuda"
        configs = [preprocessing, speculative_model(pipeline, on_gpu, **{ENGINE_PARAMETER: ENGINE_FOLDER}), ensemble,
                   drain_hold_model()]
    else:
        served_at = Path(served_at or ".")
        engines = {name: str(served_at / name / VERSION / ENGINE_FOLDER) for name in trtllm_engines(pipeline)}
        speculative = speculative_model(pipeline, **{TOKENIZER_PARAMETER: TARGET_FOLDER,
                                                     PIPELINE_PARAMETER: PIPELINE_FILE,
                                                     TARGET_MODEL_PARAMETER: TARGET_MODEL,
                                                     DRAFT_MODEL_PARAMETER: DRAFT_MODEL if DRAFT_MODEL in engines
                                                     else ""})
        configs = [preprocessing, speculative, ensemble, drain_hold_model(),
                   *(tensorrtllm_model(name, pipeline, path, draft=name == DRAFT_MODEL) for name, path in
                     engines.items())]
    return {config.name: config for config in configs}


def trtllm_engines(pipeline: PipelineSpec) -> dict[str, str]:
    """The tensorrtllm models of a trtllm pipeline → the component whose engine each serves."""
    if pipeline.speculation.draft is not None:
        return {TARGET_MODEL: "target", DRAFT_MODEL: "draft"}
    return {TARGET_MODEL: "target"}


def write_repository(engine_dir: Path, output: Path, served_at: Path | None = None,
                     trtllm_source: Path | None = None) -> Path:
    """Write the model repository at `output` for the engine at `engine_dir`, replacing one written before as a
    whole (no model of an older layout lingers). A directory there that is neither empty nor a model repository is
    refused, never removed. served_at: where a trtllm repository will be on the server (default: `output`).
    trtllm_source: a TensorRT-LLM checkout, for the llm_api line's model code. Returns `output`."""
    engine_dir, output = Path(engine_dir), Path(output)
    if output.exists() and any(output.iterdir()) and not any((output / marker).is_file() for marker in MARKERS):
        raise SpecdeployError(f"{output}: exists and is not a model repository (choose another --output)")
    pipeline = engine_pipeline(engine_dir)
    served_at = Path(served_at) if served_at else output.resolve()
    if pipeline.backend.kind == "trtllm" and pipeline.backend.settings.line == "llm_api":
        return write_llmapi_repository(engine_dir, pipeline, output, served_at, trtllm_source)
    configs = model_configs(pipeline, served_at)
    trtllm = pipeline.backend.kind == "trtllm"
    # The files a model reads: folder in its version directory → where they come from (the engine's components,
    # the tokenizer without the weights, the engines TensorRT-LLM built). A trtllm target's tokenizer and config are
    # in the Hugging Face directory its converter read: our export, or the checkpoint itself.
    hf_target = hf_dirs(pipeline, engine_dir / "trtllm")["target"] if trtllm else engine_dir / "target"
    tokenizer_only = hf_dir_files(False, *MODEL_FILES)
    with staging_dir(output) as staging:
        for name, config in configs.items():
            version = staging / name / VERSION
            version.mkdir(parents=True)
            (staging / name / "config.pbtxt").write_text(text_format.MessageToString(config))
            if config.backend == "python":
                code = SPECULATIVE_CODE[pipeline.backend.kind] if name == "speculative" else name
                shutil.copy2(MODEL_CODE / code / "model.py", version / "model.py")
            if name == "preprocessing":
                shutil.copytree(hf_target, version / TOKENIZER_FOLDER, ignore=tokenizer_only)
            elif name == "speculative" and trtllm:
                shutil.copytree(hf_target, version / TARGET_FOLDER, ignore=hf_dir_files(False))
                shutil.copy2(engine_dir / PIPELINE_FILE, version / PIPELINE_FILE)
            elif name == "speculative":
                shutil.copytree(engine_dir, version / ENGINE_FOLDER, copy_function=link_or_copy)
            elif config.backend == "tensorrtllm":
                component = trtllm_engines(pipeline)[name]
                shutil.copytree(engine_dir / "trtllm" / "engines" / component, version / ENGINE_FOLDER,
                                copy_function=link_or_copy)
    return output
