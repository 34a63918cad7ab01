"""One request to the `speculative` model over Triton's gRPC streaming API, as an async iterator of Pieces.

The model is decoupled: a request's responses arrive on a stream, each with the text it completes and the request's
statistics so far; the last one also carries `finish_reason`. The request stream stays open until that final response
arrives, and is then closed by the client, so Triton ends the call itself; a consumer that stops early (its HTTP
client disconnected) cancels the gRPC call instead, and Triton cancels the request down to the scheduler (the model
sees `is_cancelled`). Cancelling a call whose request has already ended is avoided: with Triton 2.51 it can leave the
model held at shutdown (serve/client.py says the same of the sync client).
"""

from __future__ import annotations

import asyncio
import uuid
from collections.abc import AsyncIterator
from dataclasses import dataclass

import numpy as np

from specdeploy.serve.client import ENTRY_MODEL
from specdeploy.serve.openai_api.protocol import ApiError, Generation
from specdeploy.serve.requests import SCALAR_INPUTS, STATISTICS

# gRPC status of a failed request → the HTTP status it answers with (the model's refusals are INVALID_ARG; a draining
# server UNAVAILABLE).
STATUS = {"StatusCode.INVALID_ARGUMENT": 400, "StatusCode.UNAVAILABLE": 503, "StatusCode.NOT_FOUND": 503,
          "StatusCode.RESOURCE_EXHAUSTED": 429}


@dataclass
class Piece:
    """A response: the text it adds, the request's statistics so far, and on the last one its finish reason."""

    text: str
    statistics: dict[str, float]
    finish_reason: str | None


def model_inputs(generation: Generation) -> list:
    """InferInputs for the `speculative` model: input_ids, the set scalars, stop_words, and stream (always: the
    front assembles a whole response itself, so it also sees tokens as they are made)."""
    import tritonclient.grpc as grpcclient
    from tritonclient.utils import triton_to_np_dtype

    def make(name: str, kind: str, array: np.ndarray):
        item = grpcclient.InferInput(name, list(array.shape), kind)
        item.set_data_from_numpy(array)
        return item

    inputs = [make("input_ids", "INT32", np.array([generation.prompt_ids], dtype=np.int32)),
              make("stream", "BOOL", np.array([[True]]))]
    if generation.stop:
        inputs.append(make("stop_words", "BYTES", np.array([[w.encode("utf-8") for w in generation.stop]],
                                                           dtype=object)))
    for name, value in generation.inputs.items():
        if value is None:
            continue
        kind = SCALAR_INPUTS[name].removeprefix("TYPE_")
        if kind == "STRING":
            inputs.append(make(name, "BYTES", np.array([[str(value).encode("utf-8")]], dtype=object)))
        else:
            inputs.append(make(name, kind, np.array([[value]], dtype=np.dtype(triton_to_np_dtype(kind)))))
    return inputs


def piece(result) -> Piece:
    text = result.as_numpy("text_output")
    reason = result.as_numpy("finish_reason")
    statistics = {name: result.as_numpy(name).reshape(-1)[0].item() for name, *_ in STATISTICS
                  if result.as_numpy(name) is not None}
    finish = None if reason is None else reason.reshape(-1)[0].decode("utf-8")
    return Piece(b"".join(text.reshape(-1)).decode("utf-8") if text is not None else "", statistics, finish or None)


def failure(error) -> ApiError:
    """A Triton error response as the HTTP error it answers with."""
    message = error.message() if hasattr(error, "message") else str(error)
    status = STATUS.get(str(getattr(error, "status", lambda: None)()), 500)
    if "shutting down" in message or "unknown model" in message.lower():
        status = 503  # a draining server: another replica can serve it
    kind = "invalid_request_error" if status == 400 else "server_error"
    return ApiError(status, message, kind=kind)


async def stream(client, generation: Generation) -> AsyncIterator[Piece]:
    """The model's responses to `generation` (client: a tritonclient.grpc.aio InferenceServerClient). ApiError for
    an error response."""
    done = asyncio.Event()

    async def requests():
        yield {"model_name": ENTRY_MODEL, "inputs": model_inputs(generation), "request_id": uuid.uuid4().hex}
        await done.wait()  # the stream stays open until the final response: then the client half-closes it

    responses = client.stream_infer(requests())
    finished = False
    try:
        async for result, error in responses:
            if error is not None:
                finished = True
                raise failure(error)
            answer = piece(result)
            finished = answer.finish_reason is not None
            yield answer
            if finished:
                break
    finally:
        done.set()
        if not finished:
            responses.cancel()
    async for _ in responses:  # the server closes the stream once the request stream is closed
        pass
