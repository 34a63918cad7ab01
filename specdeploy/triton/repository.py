"""`specdeploy package`: a Triton model repository for a pipeline's engines.

ensemble (tensorrtllm_backend's request/response names) = preprocessing → speculative (decoupled, Python backend,
owns draft + target) → postprocessing. The Python model files come from model_repo/ (thin wrappers importing
specdeploy); every config.pbtxt is generated here from the pipeline and parsed with Triton's own ModelConfig
protobuf before it is written.
"""

from __future__ import annotations

import shutil
from pathlib import Path

import specdeploy
from specdeploy.errors import SpecdeployError
from specdeploy.pipeline import PipelineSpec
from specdeploy.triton.requests import SCALAR_INPUTS, STATISTICS

MODEL_CODE = Path(specdeploy.__file__).resolve().parent.parent / "model_repo"


def tensor(name: str, kind: str, dims: list[int], optional: bool = False) -> str:
    flag = " optional: true" if optional else ""
    return f'  {{ name: "{name}" data_type: {kind} dims: [ {", ".join(map(str, dims))} ]{flag} }}'


def block(key: str, tensors: list[str]) -> str:
    return f"{key} [\n" + ",\n".join(tensors) + "\n]\n"


def parameters(values: dict[str, object]) -> str:
    return "".join(f'parameters {{ key: "{k}" value: {{ string_value: "{v}" }} }}\n' for k, v in values.items())


def ensemble_inputs() -> list[str]:
    return [tensor("text_input", "TYPE_STRING", [1]), tensor("stop_words", "TYPE_STRING", [-1], optional=True),
            *(tensor(name, kind, [1], optional=name != "max_tokens") for name, kind in SCALAR_INPUTS.items())]


def statistic_outputs() -> list[str]:
    return [tensor(name, kind, [1]) for name, kind, _ in STATISTICS]


def model_configs(pipeline: PipelineSpec, engine_dir: Path) -> dict[str, str]:
    """config.pbtxt text per model name."""
    batch = pipeline.limits.max_batch_size
    tokenizer = parameters({"tokenizer_dir": engine_dir / "target"})
    python = f'backend: "python"\nmax_batch_size: {batch}\n'
    cpu = "instance_group [ { count: 1 kind: KIND_CPU } ]\n"
    preprocessing = (f'name: "preprocessing"\n{python}'
                     + block("input", [tensor("text_input", "TYPE_STRING", [1]),
                                       tensor("stop_words", "TYPE_STRING", [-1], optional=True)])
                     + block("output", [tensor("input_ids", "TYPE_INT32", [-1]),
                                        tensor("stop_words_ids", "TYPE_INT32", [-1])])
                     + cpu + tokenizer)
    sampling = pipeline.sampling
    speculative = (f'name: "speculative"\n{python}model_transaction_policy {{ decoupled: true }}\n'
                   + block("input", [tensor("input_ids", "TYPE_INT32", [-1]),
                                     tensor("stop_words_ids", "TYPE_INT32", [-1], optional=True),
                                     *(tensor(n, k, [1], optional=True) for n, k in SCALAR_INPUTS.items())])
                   + block("output", [tensor("output_ids", "TYPE_INT32", [-1]),
                                      tensor("previous_length", "TYPE_INT32", [1]), *statistic_outputs()])
                   + cpu
                   + parameters({"engine_dir": engine_dir, "max_active_sequences": batch,
                                 "default_max_tokens": sampling.max_tokens,
                                 "default_temperature": sampling.temperature, "default_top_k": sampling.top_k,
                                 "default_top_p": sampling.top_p,
                                 "default_repetition_penalty": sampling.repetition_penalty,
                                 "policy_full_up_to": pipeline.serving.policy.full_up_to,
                                 "policy_off_above": pipeline.serving.policy.off_above,
                                 "kv_capacity_tokens": pipeline.serving.kv_capacity_tokens or 0}))
    postprocessing = (f'name: "postprocessing"\n{python}'
                      + block("input", [tensor("output_ids", "TYPE_INT32", [-1]),
                                        tensor("previous_length", "TYPE_INT32", [1]), *statistic_outputs()])
                      + block("output", [tensor("text_output", "TYPE_STRING", [-1]), *statistic_outputs()])
                      + cpu + tokenizer)
    scalars = "".join(f'      input_map {{ key: "{n}" value: "{n}" }}\n' for n in SCALAR_INPUTS)
    statistics = "".join(f'      input_map {{ key: "{n}" value: "_{n}" }}\n' for n, *_ in STATISTICS)
    statistics_out = "".join(f'      output_map {{ key: "{n}" value: "_{n}" }}\n' for n, *_ in STATISTICS)
    statistics_final = "".join(f'      output_map {{ key: "{n}" value: "{n}" }}\n' for n, *_ in STATISTICS)
    ensemble = (f'name: "ensemble"\nplatform: "ensemble"\nmax_batch_size: {batch}\n'
                + block("input", ensemble_inputs())
                + block("output", [tensor("text_output", "TYPE_STRING", [-1]), *statistic_outputs()])
                + "ensemble_scheduling {\n  step [\n"
                + '    { model_name: "preprocessing" model_version: -1\n'
                  '      input_map { key: "text_input" value: "text_input" }\n'
                  '      input_map { key: "stop_words" value: "stop_words" }\n'
                  '      output_map { key: "input_ids" value: "_input_ids" }\n'
                  '      output_map { key: "stop_words_ids" value: "_stop_words_ids" } },\n'
                + '    { model_name: "speculative" model_version: -1\n'
                  '      input_map { key: "input_ids" value: "_input_ids" }\n'
                  '      input_map { key: "stop_words_ids" value: "_stop_words_ids" }\n'
                + scalars
                + '      output_map { key: "output_ids" value: "_output_ids" }\n'
                  '      output_map { key: "previous_length" value: "_previous_length" }\n'
                + statistics_out + "    },\n"
                + '    { model_name: "postprocessing" model_version: -1\n'
                  '      input_map { key: "output_ids" value: "_output_ids" }\n'
                  '      input_map { key: "previous_length" value: "_previous_length" }\n'
                + statistics
                + '      output_map { key: "text_output" value: "text_output" }\n'
                + statistics_final + "    }\n  ]\n}\n")
    return {"preprocessing": preprocessing, "speculative": speculative, "postprocessing": postprocessing,
            "ensemble": ensemble}


def validate_config(name: str, text: str) -> None:
    """Parse with Triton's ModelConfig protobuf: unknown fields, bad enums and syntax errors are caught here."""
    from google.protobuf import text_format
    from tritonclient.grpc import model_config_pb2

    try:
        text_format.Parse(text, model_config_pb2.ModelConfig())
    except text_format.ParseError as exc:
        raise SpecdeployError(f"generated {name}/config.pbtxt is not a valid Triton ModelConfig: {exc}") from None


def write_repository(pipeline: PipelineSpec, engine_dir: Path, output: Path) -> Path:
    """Write (or replace) the model repository at `output`. Returns it."""
    engine_dir = Path(engine_dir).resolve()
    configs = model_configs(pipeline, engine_dir)
    for name, text in configs.items():
        validate_config(name, text)
    output.mkdir(parents=True, exist_ok=True)
    for name, text in configs.items():
        model_dir = output / name
        if model_dir.exists():
            shutil.rmtree(model_dir)
        (model_dir / "1").mkdir(parents=True)
        (model_dir / "config.pbtxt").write_text(text)
        if name != "ensemble":
            shutil.copy2(MODEL_CODE / name / "model.py", model_dir / "1" / "model.py")
    return output
