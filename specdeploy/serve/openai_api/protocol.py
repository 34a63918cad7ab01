"""OpenAI's request and response shapes, mapped onto the `speculative` model's inputs and outputs.

A request is checked field by field, and a field this server cannot honour is refused with a 400 in OpenAI's error
shape naming it, never ignored. Unset fields take the served pipeline's defaults (its `sampling` section: greedy for
the shipped pipelines), which differ from OpenAI's own defaults (temperature 1). top_k and repetition_penalty are
accepted as top-level fields, as vLLM takes them (the openai client sends them with `extra_body`), and so are
vLLM's ignore_eos (generate max_tokens tokens whatever the model says: load tools fix output lengths with it) and
stream_options.continuous_usage_stats (usage in every streamed chunk), and the speculation fields num_draft_tokens
and request_kind. `usage` carries the request's speculation in an extension object, `usage.speculation`
(USAGE_EXTENSION).
"""

from __future__ import annotations

import time
import uuid
from dataclasses import dataclass, field

from specdeploy.spec.request import NO_END_ID

USAGE_EXTENSION = "speculation"
CHAT_FIELDS = {"model", "messages", "max_tokens", "max_completion_tokens", "temperature", "top_p", "n", "stream",
               "stream_options", "stop", "seed", "user", "logprobs", "top_logprobs", "tools", "tool_choice",
               "parallel_tool_calls", "response_format", "frequency_penalty", "presence_penalty", "logit_bias",
               "top_k", "repetition_penalty", "ignore_eos", "num_draft_tokens", "request_kind"}
COMPLETION_FIELDS = {"model", "prompt", "max_tokens", "temperature", "top_p", "n", "stream", "stream_options", "stop",
                     "seed", "user", "logprobs", "echo", "best_of", "suffix", "frequency_penalty", "presence_penalty",
                     "logit_bias", "top_k", "repetition_penalty", "ignore_eos", "num_draft_tokens",
                     "request_kind"}
ROLES = ("system", "user", "assistant", "developer")
MAX_STOPS = 4  # OpenAI's limit on `stop`


class ApiError(Exception):
    """An error response in OpenAI's shape: {"error": {"message", "type", "param", "code"}}."""

    def __init__(self, status: int, message: str, param: str | None = None,
                 kind: str = "invalid_request_error", code: str | None = None) -> None:
        super().__init__(message)
        self.status, self.message, self.param, self.kind, self.code = status, message, param, kind, code

    def body(self) -> dict:
        return {"error": {"message": self.message, "type": self.kind, "param": self.param, "code": self.code}}


def bad(param: str, message: str) -> ApiError:
    return ApiError(400, f"{param}: {message}", param)


@dataclass
class Generation:
    """A checked request, as the `speculative` model takes it: prompt ids, its scalar inputs by name (unset ones
    left out), stop strings; and how to answer (chat or completion, streamed, a usage chunk)."""

    model: str
    prompt_ids: list[int]
    inputs: dict[str, object] = field(default_factory=dict)
    stop: list[str] = field(default_factory=list)
    stream: bool = False
    include_usage: bool = False
    chat: bool = True
    continuous_usage: bool = False  # usage in every streamed chunk (vLLM's stream_options.continuous_usage_stats)


def check_fields(body: object, allowed: set[str]) -> dict:
    if not isinstance(body, dict):
        raise ApiError(400, "the request body must be a JSON object")
    unknown = sorted(set(body) - allowed)
    if unknown:
        raise bad(unknown[0], f"unrecognized request argument (this server takes: {', '.join(sorted(allowed))})")
    return body


def number(body: dict, name: str, kind: type, low: float | None = None, high: float | None = None):
    """An optional numeric field, range-checked (None: unset)."""
    value = body.get(name)
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, (int, float)) or (kind is int and not isinstance(value, int)):
        raise bad(name, f"must be {'an integer' if kind is int else 'a number'}, got {value!r}")
    if (low is not None and value < low) or (high is not None and value > high):
        raise bad(name, f"must be in [{low}, {high}], got {value}")
    return kind(value)


def refused(body: dict, name: str, allowed: object, why: str) -> None:
    """A field this server cannot honour: refused unless unset or equal to `allowed`."""
    value = body.get(name)
    if value is not None and value != allowed and value != [] and value != {}:
        raise bad(name, f"not supported by this server ({why})")


def common_fields(body: dict, model_name: str) -> dict[str, object]:
    """The fields chat and completions share, as the model's inputs; refusals for those it cannot honour."""
    model = body.get("model")
    if not isinstance(model, str):
        raise bad("model", "required: the served model's name (GET /v1/models)")
    if model != model_name:
        raise ApiError(404, f"The model `{model}` does not exist (this server serves `{model_name}`)", "model",
                       code="model_not_found")
    n = number(body, "n", int, 1)
    if n is not None and n != 1:
        raise bad("n", "only one choice per request (n: 1) is supported")
    for name in ("frequency_penalty", "presence_penalty"):
        refused(body, name, 0, "no frequency or presence penalty; repetition_penalty is")
    refused(body, "logit_bias", None, "no logit bias")
    inputs = {"temperature": number(body, "temperature", float, 0, 2), "top_p": number(body, "top_p", float, 0, 1),
              "top_k": number(body, "top_k", int, 0), "repetition_penalty": number(body, "repetition_penalty", float),
              "random_seed": number(body, "seed", int, 0, 2 ** 64 - 1),
              "num_draft_tokens": number(body, "num_draft_tokens", int, 0)}
    ignore_eos = body.get("ignore_eos")
    if ignore_eos is not None and not isinstance(ignore_eos, bool):
        raise bad("ignore_eos", f"must be true or false, got {ignore_eos!r}")
    if ignore_eos:
        inputs["end_id"] = NO_END_ID
    kind = body.get("request_kind")
    if kind is not None:
        if not isinstance(kind, str):
            raise bad("request_kind", f"must be a string, got {kind!r}")
        inputs["request_kind"] = kind
    if body.get("user") is not None and not isinstance(body["user"], str):
        raise bad("user", "must be a string")
    return inputs


def stop_strings(body: dict) -> list[str]:
    stop = body.get("stop")
    if stop is None:
        return []
    words = [stop] if isinstance(stop, str) else stop
    if not isinstance(words, list) or not all(isinstance(w, str) and w for w in words):
        raise bad("stop", "must be a non-empty string or a list of them")
    if len(words) > MAX_STOPS:
        raise bad("stop", f"at most {MAX_STOPS} stop sequences, got {len(words)}")
    return words


@dataclass
class StreamSettings:
    stream: bool = False
    include_usage: bool = False
    continuous_usage: bool = False


def stream_settings(body: dict) -> StreamSettings:
    stream = body.get("stream", False)
    if not isinstance(stream, bool):
        raise bad("stream", f"must be true or false, got {stream!r}")
    options = body.get("stream_options")
    if options is None:
        return StreamSettings(stream)
    if not stream:
        raise bad("stream_options", "only allowed when stream is true")
    names = ("include_usage", "continuous_usage_stats")
    if not isinstance(options, dict) or set(options) - set(names) or \
            not all(isinstance(options.get(name, False), bool) for name in names):
        raise bad("stream_options", "takes include_usage and continuous_usage_stats (true or false) only")
    include_usage, continuous = options.get("include_usage", False), options.get("continuous_usage_stats", False)
    if continuous and not include_usage:
        raise bad("stream_options", "continuous_usage_stats needs include_usage: true")
    return StreamSettings(stream, include_usage, continuous)


def message_text(message: object, index: int) -> dict[str, str]:
    """One chat message as the chat template takes it: its role and its text (text parts joined)."""
    where = f"messages[{index}]"
    if not isinstance(message, dict) or message.get("role") not in ROLES:
        raise bad(where, f"must be an object with a role of {', '.join(ROLES)}")
    content = message.get("content")
    if isinstance(content, list):
        if not all(isinstance(p, dict) and p.get("type") == "text" and isinstance(p.get("text"), str)
                   for p in content):
            raise bad(f"{where}.content", "only text parts are supported")
        content = "".join(part["text"] for part in content)
    if not isinstance(content, str):
        raise bad(f"{where}.content", "must be text")
    role = "system" if message["role"] == "developer" else message["role"]
    return {"role": role, "content": content}


def chat_request(body: object, tokenizer, model_name: str) -> Generation:
    """A /v1/chat/completions body, checked, its messages rendered with the model's chat template."""
    body = check_fields(body, CHAT_FIELDS)
    inputs = common_fields(body, model_name)
    for name in ("logprobs", "top_logprobs"):
        refused(body, name, False, "no log probabilities")
    refused(body, "tools", None, "no tool calls")
    if body.get("tool_choice") not in (None, "none"):
        raise bad("tool_choice", "not supported by this server (no tool calls)")
    if body.get("response_format") not in (None, {"type": "text"}):
        raise bad("response_format", "only {\"type\": \"text\"} is supported (no JSON mode or schema)")
    messages = body.get("messages")
    if not isinstance(messages, list) or not messages:
        raise bad("messages", "required: a non-empty list of messages")
    conversation = [message_text(message, i) for i, message in enumerate(messages)]
    max_tokens = number(body, "max_completion_tokens", int, 1)
    max_tokens = max_tokens if max_tokens is not None else number(body, "max_tokens", int, 1)
    if getattr(tokenizer, "chat_template", None):
        text = tokenizer.apply_chat_template(conversation, tokenize=False, add_generation_prompt=True)
        ids = tokenizer(text, add_special_tokens=False)["input_ids"]
    else:
        ids = tokenizer("\n".join(m["content"] for m in conversation))["input_ids"]
    settings = stream_settings(body)
    return Generation(model_name, ids, {**inputs, "max_tokens": max_tokens}, stop_strings(body), settings.stream,
                      settings.include_usage, chat=True, continuous_usage=settings.continuous_usage)


def completion_request(body: object, tokenizer, model_name: str) -> Generation:
    """A /v1/completions body, checked; the prompt is raw text (no chat template) or token ids."""
    body = check_fields(body, COMPLETION_FIELDS)
    inputs = common_fields(body, model_name)
    refused(body, "logprobs", None, "no log probabilities")
    refused(body, "echo", False, "the prompt is not echoed")
    refused(body, "suffix", None, "no insertion")
    best_of = number(body, "best_of", int, 1)
    if best_of is not None and best_of != 1:
        raise bad("best_of", "only 1 is supported")
    prompt = body.get("prompt")
    if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], (str, list)):
        prompt = prompt[0]
    if isinstance(prompt, str) and prompt:
        ids = tokenizer(prompt)["input_ids"]
    elif isinstance(prompt, list) and prompt and all(isinstance(t, int) and not isinstance(t, bool) for t in prompt):
        ids = list(prompt)
    else:
        raise bad("prompt", "required: one non-empty string, or one list of token ids")
    settings = stream_settings(body)
    return Generation(model_name, ids, {**inputs, "max_tokens": number(body, "max_tokens", int, 1)},
                      stop_strings(body), settings.stream, settings.include_usage, chat=False,
                      continuous_usage=settings.continuous_usage)


def usage(prompt_tokens: int, statistics: dict[str, float]) -> dict:
    """OpenAI's usage, and the request's speculation in the USAGE_EXTENSION object (cumulative statistics of the
    `speculative` model: serve/requests.py STATISTICS)."""
    completion = int(statistics.get("generated_tokens", 0))
    steps = int(statistics.get("verification_steps", 0))
    return {"prompt_tokens": prompt_tokens, "completion_tokens": completion, "total_tokens": prompt_tokens + completion,
            USAGE_EXTENSION: {"drafted_tokens": int(statistics.get("total_draft_tokens", 0)),
                              "accepted_tokens": int(statistics.get("total_accepted_draft_tokens", 0)),
                              "acceptance_rate": float(statistics.get("acceptance_rate", 0.0)),
                              "verification_steps": steps,
                              "tokens_per_step": round(completion / steps, 4) if steps else 0.0}}


@dataclass
class Answer:
    """The ids and timestamp one request's responses share."""

    generation: Generation
    identifier: str = field(default_factory=lambda: uuid.uuid4().hex[:24])
    created: int = field(default_factory=lambda: int(time.time()))

    @property
    def object(self) -> str:
        return "chat.completion" if self.generation.chat else "text_completion"

    def _head(self, suffix: str = "") -> dict:
        prefix = "chatcmpl" if self.generation.chat else "cmpl"
        return {"id": f"{prefix}-{self.identifier}", "object": self.object + suffix, "created": self.created,
                "model": self.generation.model}

    def whole(self, text: str, finish_reason: str, usage_: dict) -> dict:
        """The non-streamed response."""
        if self.generation.chat:
            choice = {"index": 0, "message": {"role": "assistant", "content": text}, "logprobs": None,
                      "finish_reason": finish_reason}
        else:
            choice = {"index": 0, "text": text, "logprobs": None, "finish_reason": finish_reason}
        return {**self._head(), "choices": [choice], "usage": usage_}

    def chunk(self, text: str, finish_reason: str | None = None, first: bool = False,
              usage_: dict | None = None) -> dict:
        """One streamed chunk (chat: a delta, the first one naming the role); with continuous usage, the usage so
        far."""
        suffix = ".chunk" if self.generation.chat else ""
        if self.generation.chat:
            delta = {"role": "assistant", "content": text} if first else {"content": text}
            choice = {"index": 0, "delta": delta if (text or first) else {}, "logprobs": None,
                      "finish_reason": finish_reason}
        else:
            choice = {"index": 0, "text": text, "logprobs": None, "finish_reason": finish_reason}
        head = self._head(suffix)
        return {**head, "choices": [choice], **({"usage": usage_} if self.generation.include_usage else {})}

    def usage_chunk(self, usage_: dict) -> dict:
        """The last chunk of a stream with include_usage: no choices, the usage."""
        return {**self._head(".chunk" if self.generation.chat else ""), "choices": [], "usage": usage_}


class StopTail:
    """OpenAI leaves a stop sequence out of the text, where the model's text ends with it (the model cuts at its
    first occurrence and keeps it: decoding/stop_strings.py). Streamed text that could be the start of a stop
    sequence is held back until the next piece says whether it is one."""

    def __init__(self, stops: list[str]) -> None:
        self.stops, self.held = stops, ""

    def add(self, text: str, final: bool) -> str:
        """The part of held + text that may be sent now; at the final piece the rest, less a closing stop."""
        text = self.held + text
        if final:
            self.held = ""
            for stop in self.stops:
                if text.endswith(stop):
                    return text[:-len(stop)]
            return text
        keep = max((n for stop in self.stops for n in range(1, len(stop)) if text.endswith(stop[:n])), default=0)
        self.held = text[len(text) - keep:] if keep else ""
        return text[:len(text) - keep] if keep else text
