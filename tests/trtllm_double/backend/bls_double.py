"""The slice of triton_python_backend_utils that BlsCalls uses (Tensor, InferenceRequest.exec, responses), routed
in-process to TensorrtllmDouble models by name, so the orchestration runs without a server in the unit tests. The
served tests run the same calls through a real tritonserver."""

from __future__ import annotations

import functools
import importlib.util
import json
from pathlib import Path

import numpy as np
from tensorrtllm_double import DoubleError, TensorrtllmDouble, responses

from specdeploy.build.trtllm.plan import build_plan
from specdeploy.package.repository import DRAFT_MODEL, trtllm_engines
from specdeploy.package.trtllm_models import tensorrtllm_model
from specdeploy.spec.pipeline import PipelineSpec


@functools.cache
def build_double():
    """tests/trtllm_double/trtllm_build.py as a module (its directory also holds the tensorrt_llm double, which must
    not shadow the real package on this process's path)."""
    path = Path(__file__).resolve().parents[1] / "trtllm_build.py"
    spec = importlib.util.spec_from_file_location("trtllm_build_double", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def pipeline_doubles(pipeline: PipelineSpec, components: dict[str, Path], root: Path,
                     classes: dict[str, type] | None = None, **options) -> dict[str, TensorrtllmDouble]:
    """Doubles of a pipeline's tensorrtllm models as `package` configures them, over engines whose config.json is
    what the build double writes for the plan's own trtllm-build commands. components: model name → the torch
    component it runs; classes: a TensorrtllmDouble subclass for some models (LoadError: the backend would refuse
    the configuration); options: TensorrtllmDouble's (logits_dtype)."""
    build_config = build_double().build_config
    for step in build_plan(pipeline, root):
        if step.command and step.command[0] == "trtllm-build":
            step.output.mkdir(parents=True, exist_ok=True)
            (step.output / "config.json").write_text(json.dumps({"build_config": build_config(list(step.command[1:]))}))
    doubles = {}
    for name, component in trtllm_engines(pipeline).items():
        config = tensorrtllm_model(name, pipeline, str(root / "trtllm" / "engines" / component),
                                   draft=name == DRAFT_MODEL)
        parameters = {key: value.string_value for key, value in config.parameters.items()}
        doubles[name] = (classes or {}).get(name, TensorrtllmDouble).load(components[name], parameters, **options)
    return doubles


class Tensor:
    def __init__(self, name: str, array: np.ndarray) -> None:
        self._name, self._array = name, np.asarray(array)

    def name(self) -> str:
        return self._name

    def as_numpy(self) -> np.ndarray:
        return self._array


class Error:
    def __init__(self, message: str) -> None:
        self._message = message

    def message(self) -> str:
        return self._message


class Response:
    def __init__(self, outputs: list[Tensor], error: str | None = None) -> None:
        self.outputs, self._error = outputs, error

    def has_error(self) -> bool:
        return self._error is not None

    def error(self) -> Error:
        return Error(self._error)

    def output_tensors(self) -> list[Tensor]:
        return self.outputs


def get_output_tensor_by_name(response: Response, name: str) -> Tensor | None:
    return next((t for t in response.outputs if t.name() == name), None)


class BlsDouble:
    """A `pb_utils` stand-in whose InferenceRequest runs the named double. `requests` logs every call's inputs."""

    Tensor = Tensor

    def __init__(self, models: dict[str, TensorrtllmDouble]) -> None:
        self.models = models
        self.requests: list[tuple[str, dict[str, np.ndarray]]] = []
        double = self

        class InferenceRequest:
            def __init__(self, model_name: str, inputs: list[Tensor], requested_output_names: list[str]) -> None:
                self.model, self.inputs, self.outputs = model_name, inputs, requested_output_names

            def exec(self, decoupled: bool = False):
                assert decoupled, "the tensorrtllm models are decoupled"
                return double.run(self.model, {t.name(): t.as_numpy() for t in self.inputs}, self.outputs)

        self.InferenceRequest = InferenceRequest
        self.get_output_tensor_by_name = staticmethod(get_output_tensor_by_name)

    def run(self, model: str, inputs: dict[str, np.ndarray], wanted: list[str]):
        self.requests.append((model, inputs))
        streaming = bool(inputs.get("streaming", np.zeros(1)).reshape(-1)[0])
        try:
            steps = list(responses(self.models[model].run(inputs), streaming))
        except DoubleError as exc:
            yield Response([], str(exc))
            return
        for step in steps:
            outputs = [Tensor("output_ids", np.array([[step.tokens]], dtype=np.int32)),
                       Tensor("sequence_length", np.array([[len(step.tokens)]], dtype=np.int32))]
            if step.logits is not None and "generation_logits" in wanted:
                outputs.append(Tensor("generation_logits", step.logits[None, None]))
            yield Response(outputs)
        yield Response([])  # the final flag alone, as the backend sends it
