"""`specdeploy package`: a self-contained, relocatable Triton model repository for a pipeline's engine.

ensemble (tensorrtllm_backend's request/response names) = preprocessing → speculative (decoupled, Python backend,
owns draft + target, detokenises). Each model carries its files in its version directory, named by paths relative
to it (model_files.py): the engine in `speculative/1/engine/` (its weights hard-linked to the built engine's where
the file system allows, everything else copied), the tokenizer in `preprocessing/1/tokenizer/`. The repository
therefore serves from wherever it is copied or mounted. Every config.pbtxt is built as Triton's ModelConfig
protobuf message and written with protobuf's text format; the Python model files come from model_repo/ (thin
wrappers importing specdeploy).
"""

from __future__ import annotations

import os
import shutil
from pathlib import Path

from google.protobuf import text_format
from tritonclient.grpc import model_config_pb2 as pb

import specdeploy
from specdeploy.errors import SpecdeployError
from specdeploy.layout import engine_pipeline, staging_dir
from specdeploy.pipeline import PipelineSpec
from specdeploy.triton.model_files import ENGINE_PARAMETER, TOKENIZER_PARAMETER
from specdeploy.triton.requests import SCALAR_INPUTS, STATISTICS

MODEL_CODE = Path(specdeploy.__file__).resolve().parent.parent / "model_repo"
VERSION = "1"
ENGINE_FOLDER, TOKENIZER_FOLDER = "engine", "tokenizer"
WEIGHTS = "model.safetensors"
MODEL_FILES = {WEIGHTS, "config.json"}  # a component's files that are not its tokenizer's


def add_tensor(tensors, name: str, kind: str, dims: list[int], optional: bool = False) -> None:
    """Append a ModelInput or ModelOutput (`tensors` is the config's repeated field)."""
    tensor = tensors.add(name=name, data_type=pb.DataType.Value(kind), dims=dims)
    if optional:
        tensor.optional = True


def add_statistics(tensors) -> None:
    for name, kind, _ in STATISTICS:
        add_tensor(tensors, name, kind, [1])


def python_model(name: str, pipeline: PipelineSpec, **parameters: str) -> pb.ModelConfig:
    config = pb.ModelConfig(name=name, backend="python", max_batch_size=pipeline.limits.max_batch_size)
    config.instance_group.add(count=1, kind=pb.ModelInstanceGroup.KIND_CPU)
    for key, value in parameters.items():
        config.parameters[key].string_value = value
    return config


def add_request_inputs(inputs) -> None:
    """A client's inputs (tensorrtllm_backend's names), all optional to Triton: the model names a missing one."""
    add_tensor(inputs, "text_input", "TYPE_STRING", [1], optional=True)
    add_tensor(inputs, "stop_words", "TYPE_STRING", [-1], optional=True)
    for name, kind in SCALAR_INPUTS.items():
        add_tensor(inputs, name, kind, [1], optional=True)


def model_configs(pipeline: PipelineSpec) -> dict[str, pb.ModelConfig]:
    """The three models' configs."""
    # text_input is required, but declared optional so that its absence reaches preprocessing, which answers with an
    # error naming it (Triton 2.51's ensemble answers a missing required input with an empty, successful response).
    # Preprocessing also receives the scalar inputs, unused, so a request with any input reaches it at all (the
    # Python backend refuses a request with no inputs before the model sees it).
    preprocessing = python_model("preprocessing", pipeline, **{TOKENIZER_PARAMETER: TOKENIZER_FOLDER})
    add_request_inputs(preprocessing.input)
    add_tensor(preprocessing.output, "input_ids", "TYPE_INT32", [-1])
    add_tensor(preprocessing.output, "stop_words_ids", "TYPE_INT32", [-1])

    # The speculative model takes token ids (from the ensemble's preprocessing) or text (a client calling it
    # directly: the entry point whose cancellation reaches the scheduler, which Triton 2.51 does not pass into a
    # running ensemble step), and answers text, or token ids when a client asks for output_ids instead.
    # Detokenising here rather than in a postprocessing step means a stream makes no new request per response,
    # so it keeps running while Triton shuts down (a stopping server refuses new requests to every model).
    speculative = python_model("speculative", pipeline, **{ENGINE_PARAMETER: ENGINE_FOLDER})
    speculative.model_transaction_policy.decoupled = True
    add_tensor(speculative.input, "input_ids", "TYPE_INT32", [-1], optional=True)
    add_tensor(speculative.input, "stop_words_ids", "TYPE_INT32", [-1], optional=True)
    add_request_inputs(speculative.input)
    add_tensor(speculative.output, "text_output", "TYPE_STRING", [-1])
    add_tensor(speculative.output, "output_ids", "TYPE_INT32", [-1])
    add_statistics(speculative.output)

    ensemble = pb.ModelConfig(name="ensemble", platform="ensemble", max_batch_size=pipeline.limits.max_batch_size)
    add_request_inputs(ensemble.input)
    add_tensor(ensemble.output, "text_output", "TYPE_STRING", [-1])
    add_statistics(ensemble.output)
    outputs = {name: name for name in ("text_output", *(name for name, *_ in STATISTICS))}
    steps = ensemble.ensemble_scheduling.step
    steps.add(model_name="preprocessing", model_version=-1,
              input_map={"text_input": "text_input", "stop_words": "stop_words",
                         **{name: name for name in SCALAR_INPUTS}},
              output_map={"input_ids": "_input_ids", "stop_words_ids": "_stop_words_ids"})
    steps.add(model_name="speculative", model_version=-1,
              input_map={"input_ids": "_input_ids", "stop_words_ids": "_stop_words_ids",
                         **{name: name for name in SCALAR_INPUTS}},
              output_map=outputs)
    return {config.name: config for config in (preprocessing, speculative, ensemble)}


def link_or_copy(source: str, destination: str) -> None:
    """Weights as a hard link (no second copy on disk; a build never rewrites a file in place, it renames a new
    engine over the old one) where the file system allows it; every other file as a copy, so editing the
    repository's pipeline.json cannot change the engine's."""
    if Path(source).name == WEIGHTS:
        try:
            os.link(source, destination)
            return
        except OSError:
            pass
    shutil.copy2(source, destination)


def write_repository(engine_dir: Path, output: Path) -> Path:
    """Write the model repository at `output` for the engine at `engine_dir`, replacing one written before as a
    whole (no model of an older layout lingers). A directory there that is neither empty nor a model repository is
    refused, never removed. Returns `output`."""
    engine_dir, output = Path(engine_dir), Path(output)
    if output.exists() and any(output.iterdir()) and not (output / "ensemble" / "config.pbtxt").is_file():
        raise SpecdeployError(f"{output}: exists and is not a model repository (choose another --output)")
    configs = model_configs(engine_pipeline(engine_dir))
    with staging_dir(output) as staging:
        for name, config in configs.items():
            version = staging / name / VERSION
            version.mkdir(parents=True)
            (staging / name / "config.pbtxt").write_text(text_format.MessageToString(config))
            if name != "ensemble":
                shutil.copy2(MODEL_CODE / name / "model.py", version / "model.py")
            if TOKENIZER_PARAMETER in config.parameters:
                shutil.copytree(engine_dir / "target", version / TOKENIZER_FOLDER,
                                ignore=lambda _, names: [n for n in names if n in MODEL_FILES])
            if ENGINE_PARAMETER in config.parameters:
                shutil.copytree(engine_dir, version / ENGINE_FOLDER, copy_function=link_or_copy)
    return output
