"""The slice of triton_python_backend_utils that BlsCalls uses (Tensor, InferenceRequest.exec, responses), routed
in-process to TensorrtllmDouble models by name, so the orchestration runs without a server in the unit tests. The
served tests run the same calls through a real tritonserver."""

from __future__ import annotations

import numpy as np
from tensorrtllm_double import DoubleError, TensorrtllmDouble, responses


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
