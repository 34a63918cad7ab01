"""Request and response fields of the Triton models: names (tensorrtllm_backend's), validation, text handling.

Pure functions over numpy arrays, so they are tested without a server.
"""

from __future__ import annotations

import json

import numpy as np

from specdeploy.errors import RequestError
from specdeploy.sampling import SamplingParams

# Statistics every response carries (cumulative for the request so far): name, Triton type, RequestStats field.
STATISTICS = [("total_draft_tokens", "TYPE_INT32", "drafted"),
              ("total_accepted_draft_tokens", "TYPE_INT32", "accepted"),
              ("acceptance_rate", "TYPE_FP32", "acceptance_rate"),
              ("generated_tokens", "TYPE_INT32", "generated_tokens"),
              ("verification_steps", "TYPE_INT32", "steps")]

# Scalar inputs of the ensemble and the speculative model (all optional but max_tokens): name → Triton type.
SCALAR_INPUTS = {
    "max_tokens": "TYPE_INT32", "temperature": "TYPE_FP32", "top_k": "TYPE_INT32", "top_p": "TYPE_FP32",
    "repetition_penalty": "TYPE_FP32", "random_seed": "TYPE_UINT64", "end_id": "TYPE_INT32", "stream": "TYPE_BOOL",
    "num_draft_tokens": "TYPE_INT32",
}


def model_tokenizer(args: dict):
    """The tokenizer named by a Python model's `tokenizer_dir` parameter (args: what initialize() receives)."""
    from transformers import AutoTokenizer

    parameters = json.loads(args["model_config"])["parameters"]
    return AutoTokenizer.from_pretrained(parameters["tokenizer_dir"]["string_value"])


def _text(value: np.ndarray) -> str:
    item = value.reshape(-1)[0] if value.size else b""
    return item.decode("utf-8", errors="strict") if isinstance(item, bytes) else str(item)


def encode_request(tokenizer, text_input: np.ndarray, stop_words: np.ndarray | None) -> tuple[list[int], list[int]]:
    """text_input [1, 1] or [1] bytes → prompt ids (chat template when the tokenizer has one); stop_words [1, N]
    bytes → their ids, flattened with -1 after each word. ValueError names the bad field."""
    if text_input.size != 1:
        raise ValueError(f"text_input: expected one string per request, got shape {list(text_input.shape)}")
    try:
        text = _text(text_input)
    except UnicodeDecodeError:
        raise ValueError("text_input: not valid UTF-8") from None
    if not text.strip():
        raise ValueError("text_input: must not be empty")
    if getattr(tokenizer, "chat_template", None):
        text = tokenizer.apply_chat_template([{"role": "user", "content": text}], tokenize=False,
                                             add_generation_prompt=True)
        ids = tokenizer(text, add_special_tokens=False)["input_ids"]
    else:
        ids = tokenizer(text)["input_ids"]
    stop_ids: list[int] = []
    for word in [] if stop_words is None else stop_words.reshape(-1):
        word = word.decode("utf-8", errors="replace") if isinstance(word, bytes) else str(word)
        if word:
            stop_ids += tokenizer(word, add_special_tokens=False)["input_ids"] + [-1]
    return ids, stop_ids


def split_stop_ids(flat: list[int]) -> list[list[int]]:
    """[a, b, -1, c, -1] → [[a, b], [c]]."""
    words, current = [], []
    for token in flat:
        if token == -1:
            if current:
                words.append(current)
            current = []
        else:
            current.append(token)
    return words + ([current] if current else [])


def scalar(inputs: dict[str, np.ndarray], name: str, default):
    """One request's scalar input, checked for exactly one element."""
    value = inputs.get(name)
    if value is None:
        return default
    if value.size != 1:
        raise RequestError(f"{name}: expected one value, got shape {list(value.shape)}")
    return value.reshape(-1)[0].item()


def sampling_from(inputs: dict[str, np.ndarray], defaults: SamplingParams) -> SamplingParams:
    """SamplingParams from a request's tensors (tensorrtllm_backend names); RequestError names the bad field."""
    seed = scalar(inputs, "random_seed", None)
    return SamplingParams(temperature=float(scalar(inputs, "temperature", defaults.temperature)),
                          top_k=int(scalar(inputs, "top_k", defaults.top_k)),
                          top_p=float(scalar(inputs, "top_p", defaults.top_p)),
                          repetition_penalty=float(scalar(inputs, "repetition_penalty", defaults.repetition_penalty)),
                          seed=None if seed is None else int(seed))
