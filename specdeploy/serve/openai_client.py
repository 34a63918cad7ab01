"""A streaming client of an OpenAI-compatible server's /v1/chat/completions, on the standard library alone, that
answers in serve/client.py's Chunks: `bench --url http://HOST:PORT/v1` drives the same load over either protocol.

Each streamed chunk asks for the usage so far (stream_options.continuous_usage_stats, vLLM's extension, which our
front serves), so a chunk's token count and speculation statistics come from the server, not from tokenizing text
on the client; a server without the extension gives them at the end only (the final usage chunk), and each chunk
before it then counts as one token, as load tools that do not tokenize count them.
"""

from __future__ import annotations

import functools
import http.client
import json
from collections.abc import Iterator
from urllib.parse import urlsplit

from specdeploy.errors import RequestError
from specdeploy.serve.client import Chunk
from specdeploy.spec.request import NO_END_ID

USAGE_EXTENSION = "speculation"  # serve/openai_api/protocol.py: the speculation counts inside `usage`


def is_openai_url(url: str) -> bool:
    """http(s)://HOST:PORT[/v1] names an OpenAI-compatible server; HOST:PORT a Triton gRPC endpoint."""
    return url.startswith(("http://", "https://"))


def connection(url: str, timeout: float) -> tuple[http.client.HTTPConnection, str]:
    """A connection to the server, and the path prefix its /v1 routes hang under."""
    parts = urlsplit(url)
    kind = http.client.HTTPSConnection if parts.scheme == "https" else http.client.HTTPConnection
    prefix = parts.path.rstrip("/")
    return kind(parts.netloc, timeout=timeout), prefix if prefix.endswith("/v1") else prefix + "/v1"


@functools.lru_cache(maxsize=16)
def served_model(url: str, timeout: float = 30.0) -> str:
    """The first model GET /v1/models lists (asked once per URL: a load generator must not pay it per request)."""
    conn, prefix = connection(url, timeout)
    try:
        conn.request("GET", f"{prefix}/models")
        response = conn.getresponse()
        body = response.read()
        if response.status != 200:
            raise RequestError(f"{url}: GET /v1/models answered {response.status}: {body[:200]!r}")
        models = json.loads(body)["data"]
        if not models:
            raise RequestError(f"{url}: GET /v1/models lists no model")
        return models[0]["id"]
    finally:
        conn.close()


def request_body(model: str, prompt: str, max_tokens: int | None, stream: bool, fields: dict) -> dict:
    """The chat request for serve/client.py's generate fields (the prompt as one user message, as the gRPC path's
    text_input is rendered with the chat template)."""
    body: dict = {"model": model, "messages": [{"role": "user", "content": prompt}], "stream": stream}
    if stream:
        body["stream_options"] = {"include_usage": True, "continuous_usage_stats": True}
    if max_tokens is not None:
        body["max_tokens"] = max_tokens
    renamed = {"random_seed": "seed", "stop_words": "stop"}
    for name, value in fields.items():
        if value is None:
            continue
        if name == "end_id":
            if value != NO_END_ID:
                raise RequestError(f"end_id: an OpenAI request takes none but ignore_eos ({NO_END_ID}), got {value}")
            body["ignore_eos"] = True
        else:
            body[renamed.get(name, name)] = value
    return body


def statistics(usage: dict) -> dict[str, float]:
    """serve/requests.py STATISTICS names of an OpenAI usage object (with our speculation extension)."""
    speculation = usage.get(USAGE_EXTENSION) or {}
    return {"generated_tokens": usage.get("completion_tokens", 0),
            "total_draft_tokens": speculation.get("drafted_tokens", 0),
            "total_accepted_draft_tokens": speculation.get("accepted_tokens", 0),
            "acceptance_rate": speculation.get("acceptance_rate", 0.0)}


def error_message(status: int, body: bytes) -> str:
    try:
        return json.loads(body)["error"]["message"]
    except (ValueError, KeyError, TypeError):
        return f"HTTP {status}: {body[:200]!r}"


def generate(url: str, prompt: str, max_tokens: int | None, stream: bool = True, model: str | None = None,
             timeout: float = 600.0, **fields) -> Iterator[Chunk]:
    """Yield the text as the server streams it, as serve/client.py's generate does over gRPC. RequestError carries
    the server's message for a refused request. Closing the iterator early closes the connection, which cancels
    the request on a server that watches for disconnects."""
    conn, prefix = connection(url, timeout)
    try:
        body = request_body(model or served_model(url), prompt, max_tokens, stream, fields)
        conn.request("POST", f"{prefix}/chat/completions", json.dumps(body),
                     {"Content-Type": "application/json", "Accept": "text/event-stream"})
        response = conn.getresponse()
        if response.status != 200:
            raise RequestError(error_message(response.status, response.read()))
        if not stream:
            answer = json.loads(response.read())
            yield Chunk(answer["choices"][0]["message"]["content"], statistics(answer["usage"]), True)
            return
        counted = 0
        for line in response:
            if not line.startswith(b"data: "):
                continue
            payload = line[6:].strip()
            if payload == b"[DONE]":
                return
            event = json.loads(payload)
            if "error" in event:
                raise RequestError(event["error"].get("message", str(event["error"])))
            usage = event.get("usage")
            if not event.get("choices"):  # the closing usage chunk
                yield Chunk("", statistics(usage or {}), True)
                continue
            choice = event["choices"][0]
            counted += 1
            so_far = statistics(usage) if usage else {"generated_tokens": counted}
            yield Chunk(choice.get("delta", {}).get("content") or "", so_far, False)
    finally:
        conn.close()
