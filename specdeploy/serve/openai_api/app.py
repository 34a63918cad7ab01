"""The routes: POST /v1/chat/completions and /v1/completions (streamed as server-sent events ending in
`data: [DONE]`), GET /v1/models, and GET /health/live and /health/ready (ready only while the `speculative` model is
and the front is not draining, as Triton's /v2/health/ready). A draining front answers new work with 503 and
Retry-After, as vLLM and SGLang answer an overloaded engine; a request Triton refuses because the server is
shutting down gets the same. A full front (max_requests running) answers 429 and Retry-After, as TGI answers past
its --max-concurrent-requests. A client that disconnects mid-stream cancels its request (upstream.py)."""

from __future__ import annotations

import json
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass, field

import anyio
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import JSONResponse, Response, StreamingResponse
from starlette.routing import Route

from specdeploy.serve.client import ENTRY_MODEL
from specdeploy.serve.openai_api import upstream
from specdeploy.serve.openai_api.protocol import (
    Answer,
    ApiError,
    StopTail,
    chat_request,
    completion_request,
    usage,
)

RETRY_AFTER = "5"  # seconds a refused client is told to wait (another replica may take it at once)


@dataclass
class FrontState:
    """What the routes share: the Triton client (tritonclient.grpc.aio), the tokenizer, the served name, and
    whether the front drains (no new requests) with how many streams are still running."""

    client: object
    tokenizer: object
    model_name: str
    max_requests: int = 0  # running at once before new ones get 429 (0: no limit)
    draining: bool = False
    running: int = 0
    created: int = field(default_factory=lambda: int(time.time()))


def error_response(error: ApiError) -> JSONResponse:
    headers = {"Retry-After": RETRY_AFTER} if error.status in (429, 503) else None
    return JSONResponse(error.body(), status_code=error.status, headers=headers)


def create_app(state: FrontState) -> Starlette:
    async def generate(request: Request, chat: bool) -> Response:
        if state.draining:
            return error_response(ApiError(503, "the server is shutting down: send the request to another "
                                                "replica", kind="server_error", code="shutting_down"))
        if state.max_requests and state.running >= state.max_requests:
            return error_response(ApiError(429, f"the server is running its limit of {state.max_requests} requests "
                                                f"(--openai-max-requests): retry later or send it to another replica",
                                           kind="server_error", code="overloaded"))
        try:
            body = await request.json()
        except ValueError:
            return error_response(ApiError(400, "the request body is not valid JSON"))
        try:
            parse = chat_request if chat else completion_request
            generation = parse(body, state.tokenizer, state.model_name)
        except ApiError as error:
            return error_response(error)
        answer = Answer(generation)
        pieces = upstream.stream(state.client, generation)
        state.running += 1
        try:
            first = await anext(pieces)  # an error before any text is an HTTP error, not a broken stream
        except ApiError as error:
            state.running -= 1
            await closed(pieces)
            return error_response(error)
        except StopAsyncIteration:
            state.running -= 1
            return error_response(ApiError(500, "the model ended the request without a response",
                                           kind="server_error"))
        if generation.stream:
            return StreamingResponse(events(answer, first, pieces), media_type="text/event-stream",
                                     headers={"Cache-Control": "no-cache"})
        try:
            text, last = first.text, first
            async for piece in pieces:
                text, last = text + piece.text, piece
                if await request.is_disconnected():  # nobody to answer: cancel the request
                    return Response(status_code=499)
        except ApiError as error:
            return error_response(error)
        finally:
            state.running -= 1
            await closed(pieces)
        text = StopTail(generation.stop).add(text, final=True)
        return JSONResponse(answer.whole(text, last.finish_reason or "stop",
                                         usage(len(generation.prompt_ids), last.statistics)))

    async def events(answer: Answer, first, pieces: AsyncIterator) -> AsyncIterator[bytes]:
        """The stream's chunks; a usage chunk last when asked; an error after the first chunk as an error event."""
        tail = StopTail(answer.generation.stop)
        prompt_tokens = len(answer.generation.prompt_ids)

        def chunk(piece, first: bool = False) -> bytes:
            so_far = usage(prompt_tokens, piece.statistics) if answer.generation.continuous_usage else None
            return sse(answer.chunk(tail.add(piece.text, piece.finish_reason is not None), piece.finish_reason,
                                    first=first, usage_=so_far))

        try:
            last = first
            yield chunk(first, first=True)
            async for piece in pieces:
                last = piece
                yield chunk(piece)
            if answer.generation.include_usage:
                yield sse(answer.usage_chunk(usage(prompt_tokens, last.statistics)))
            yield b"data: [DONE]\n\n"
        except ApiError as error:
            yield sse(error.body())
        finally:
            state.running -= 1
            await closed(pieces)  # a disconnected client: the gRPC call is cancelled, and with it the request

    async def chat_completions(request: Request) -> Response:
        return await generate(request, chat=True)

    async def completions(request: Request) -> Response:
        return await generate(request, chat=False)

    async def models(request: Request) -> Response:
        return JSONResponse({"object": "list", "data": [{"id": state.model_name, "object": "model",
                                                         "created": state.created, "owned_by": "specdeploy"}]})

    async def live(request: Request) -> Response:
        return Response(status_code=200)

    async def ready(request: Request) -> Response:
        if state.draining:
            return JSONResponse({"ready": False, "reason": "draining"}, status_code=503)
        try:
            model_ready = await state.client.is_model_ready(ENTRY_MODEL)
        except Exception as exc:  # noqa: BLE001 - Triton unreachable: not ready, say why
            return JSONResponse({"ready": False, "reason": f"tritonserver: {exc}"}, status_code=503)
        if not model_ready:
            return JSONResponse({"ready": False, "reason": f"model {ENTRY_MODEL} is not ready"}, status_code=503)
        return JSONResponse({"ready": True})

    return Starlette(routes=[Route("/v1/chat/completions", chat_completions, methods=["POST"]),
                             Route("/v1/completions", completions, methods=["POST"]),
                             Route("/v1/models", models, methods=["GET"]),
                             Route("/health/live", live, methods=["GET"]),
                             Route("/health/ready", ready, methods=["GET"])])


async def closed(pieces: AsyncIterator) -> None:
    """Close a request's stream even inside a cancelled task (a client that went away): its gRPC call is cancelled
    unless the request had already ended."""
    with anyio.CancelScope(shield=True):
        await pieces.aclose()


def sse(payload: dict) -> bytes:
    return f"data: {json.dumps(payload, ensure_ascii=False)}\n\n".encode()
