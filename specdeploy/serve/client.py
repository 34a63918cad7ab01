"""gRPC client for the served models, through tritonclient's streaming API (the speculative model is decoupled, so
even a non-streaming request travels on a stream and comes back as one response)."""

from __future__ import annotations

import queue
from collections.abc import Iterator
from dataclasses import dataclass

import numpy as np

from specdeploy.errors import RequestError
from specdeploy.serve.requests import SCALAR_INPUTS, STATISTICS, UPSTREAM_INPUTS_NOT_TAKEN

# The model clients call: `speculative` takes text directly, and a cancelled or dropped stream frees its row at once.
# The `ensemble` (tensorrtllm_backend's layout) answers the same inputs, but Triton 2.51 does not pass a client's
# cancellation into a running ensemble step, so such a request runs to its end.
ENTRY_MODEL = "speculative"


# Triton's messages for a request it refuses because it is stopping (a stopped model scheduler's, the model's own
# while draining). Triton 2.51 puts a refused stream request's status code only in its unary reply: on a stream the
# error carries just the message (the `triton_grpc_error` stream header adds codes only for errors a model sends,
# not for refusals, and later Triton versions fixed a use-after-free in that mode), so these name the code there.
STOPPING_MESSAGES = ("Server is stopping", "shutting down")
UNAVAILABLE = "StatusCode.UNAVAILABLE"


class ServerRefusal(RequestError):
    """The server ended a request with an error. `code` is its gRPC status code where known: UNAVAILABLE means the
    server is draining or stopping and another replica can serve the request (a stream's refusal carries no code,
    so it is read from Triton's message)."""

    def __init__(self, message: str, code: str | None) -> None:
        super().__init__(message)
        if code is None and any(text in message for text in STOPPING_MESSAGES):
            code = UNAVAILABLE
        self.code = code


class NoResponse(RequestError):
    """No response came within the client's timeout: the request hung (the client then cancels it)."""


@dataclass
class Chunk:
    text: str
    statistics: dict[str, float]  # cumulative for the request
    final: bool


def infer_input(name: str, kind: str, array: np.ndarray):
    """One InferInput of Triton data type `kind` ("BYTES", "INT32", ...) holding `array`."""
    import tritonclient.grpc as grpcclient

    item = grpcclient.InferInput(name, list(array.shape), kind)
    item.set_data_from_numpy(array)
    return item


def build_inputs(prompt: str, max_tokens: int | None, stream: bool, **fields) -> list:
    """InferInputs with tensorrtllm_backend names, typed as the ensemble declares them; None fields are not sent
    (the server's pipeline supplies them)."""
    from tritonclient.utils import triton_to_np_dtype

    inputs = [infer_input("text_input", "BYTES", np.array([[prompt.encode("utf-8")]], dtype=object))]
    if fields.get("stop_words") is not None:
        words = fields.pop("stop_words")
        inputs.append(infer_input("stop_words", "BYTES", np.array([[w.encode("utf-8") for w in words]], dtype=object)))
    for name, value in {**fields, "max_tokens": max_tokens, "stream": stream}.items():
        if value is None:
            continue
        if name not in SCALAR_INPUTS:
            allowed = ", ".join(["stop_words", *SCALAR_INPUTS])
            upstream = " (upstream's ensemble takes it; this server does not: docs/serving.md)" \
                if name in UPSTREAM_INPUTS_NOT_TAKEN else ""
            raise RequestError(f"{name}: not an input of the ensemble{upstream} (allowed: {allowed})")
        kind = SCALAR_INPUTS[name].removeprefix("TYPE_")
        if kind == "STRING":
            inputs.append(infer_input(name, "BYTES", np.array([[str(value).encode("utf-8")]], dtype=object)))
            continue
        dtype = np.dtype(triton_to_np_dtype(kind))
        if dtype.kind in "iu" and not np.iinfo(dtype).min <= value <= np.iinfo(dtype).max:
            # numpy would wrap it silently into another, valid-looking value
            raise RequestError(f"{name}: {value} does not fit the input's type {kind} "
                               f"([{np.iinfo(dtype).min}, {np.iinfo(dtype).max}])")
        inputs.append(infer_input(name, kind, np.array([[value]], dtype=dtype)))
    return inputs


def generate(url: str, prompt: str, max_tokens: int | None, stream: bool = True, model: str = ENTRY_MODEL,
             timeout: float = 600.0, **fields) -> Iterator[Chunk]:
    """Yield the text as the server sends it. ServerRefusal (a RequestError) carries the server's message and code
    for a request it ended with an error; NoResponse, when none came within `timeout` seconds."""
    yield from stream_inputs(url, build_inputs(prompt, max_tokens, stream, **fields), model, timeout)


def stream_inputs(url: str, inputs: list, model: str = ENTRY_MODEL, timeout: float = 600.0) -> Iterator[Chunk]:
    """generate() with the InferInputs given as they are: what a client that builds its own sends, malformed ones
    included (scripts/soak.py)."""
    import tritonclient.grpc as grpcclient
    from tritonclient.utils import InferenceServerException

    client = grpcclient.InferenceServerClient(url)
    responses: queue.Queue = queue.Queue()
    client.start_stream(callback=lambda result, error: responses.put((result, error)))
    finished = False
    try:
        client.async_stream_infer(model, inputs, enable_empty_final_response=True)
        while True:
            try:
                result, error = responses.get(timeout=timeout)
            except queue.Empty:
                raise NoResponse(f"no response from {model} within {timeout:g} s") from None
            if error is not None:
                finished = True  # the server ends a request with its error
                if isinstance(error, InferenceServerException):
                    raise ServerRefusal(error.message(), error.status())
                raise ServerRefusal(str(error), None)
            response = result.get_response()
            final = response.parameters["triton_final_response"].bool_param
            if response.outputs:
                text = b"".join(result.as_numpy("text_output").reshape(-1)).decode("utf-8")
                statistics = {name: result.as_numpy(name).reshape(-1)[0].item() for name, *_ in STATISTICS}
                yield Chunk(text, statistics, final)
            elif final:
                yield Chunk("", {}, True)
            if final:
                finished = True
                return
    finally:
        # Cancel only an unfinished request (the caller stopped reading): cancelling one the server has ended
        # (after its final response or its error) can leave Triton 2.51 holding the model, so it never unloads at
        # shutdown.
        client.stop_stream(cancel_requests=not finished)
        client.close()
