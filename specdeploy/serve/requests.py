"""Request and response fields of the Triton models: names (tensorrtllm_backend's) and the conversion of a
request's tensors into a GenerationRequest. Pure functions over numpy arrays, so they are tested without a server.
"""

from __future__ import annotations

import traceback

import numpy as np

from specdeploy.decoding.chat_template import encode_prompt
from specdeploy.errors import RequestError, ShuttingDown
from specdeploy.spec.pipeline import PipelineSpec
from specdeploy.spec.request import GenerationRequest

# Statistics every response carries (cumulative for the request so far): name, Triton type, RequestStats field.
STATISTICS = [("total_draft_tokens", "TYPE_INT32", "drafted"),
              ("total_accepted_draft_tokens", "TYPE_INT32", "accepted"),
              ("acceptance_rate", "TYPE_FP32", "acceptance_rate"),
              ("generated_tokens", "TYPE_INT32", "generated_tokens"),
              ("verification_steps", "TYPE_INT32", "steps")]

# Scalar inputs of the ensemble and the speculative model, all optional (unset: the pipeline's value): name → type.
SCALAR_INPUTS = {
    "max_tokens": "TYPE_INT32", "temperature": "TYPE_FP32", "top_k": "TYPE_INT32", "top_p": "TYPE_FP32",
    "repetition_penalty": "TYPE_FP32", "random_seed": "TYPE_UINT64", "end_id": "TYPE_INT32", "stream": "TYPE_BOOL",
    "num_draft_tokens": "TYPE_INT32", "request_kind": "TYPE_STRING",
}

# The inputs of upstream's `ensemble` (NVIDIA/TensorRT-LLM@2a9abd95 triton_backend/all_models/inflight_batcher_llm/
# ensemble/config.pbtxt) that ours and the speculative model do not declare, so Triton refuses a request carrying one
# before any model sees it: "unexpected inference input '<name>' for model '<model>'". Upstream's `seed` is our
# `random_seed` (tensorrtllm_backend's older name); the rest have no counterpart here (docs/serving.md says why).
UPSTREAM_INPUTS_NOT_TAKEN = (
    "decoder_text_input", "num_return_sequences", "bad_words", "exclude_input_in_output", "pad_id", "length_penalty",
    "min_tokens", "presence_penalty", "frequency_penalty", "seed", "return_log_probs", "return_context_logits",
    "return_generation_logits", "return_perf_metrics", "return_num_input_tokens", "return_num_output_tokens",
    "beam_width", "prompt_embedding_table", "prompt_table_extra_id", "prompt_vocab_size", "embedding_bias_words",
    "embedding_bias_weights", "lora_task_id", "lora_weights", "lora_config", "guided_decoding_guide_type",
    "guided_decoding_guide",
)


def required(value: np.ndarray | None, name: str) -> np.ndarray:
    if value is None:
        raise RequestError(f"{name}: required input is missing")
    return value


def one_row(value: np.ndarray, name: str) -> list:
    """A request's 1-D input as a list: [1, N] (one request's row) or [N]. A [B, N] tensor holds B requests'
    rows, which must not be joined into one."""
    if value.ndim > 2 or (value.ndim == 2 and value.shape[0] != 1):
        raise RequestError(f"{name}: expected one row per request ([1, N]), got shape {list(value.shape)}")
    return value.reshape(-1).tolist()


def error_response(pb_utils, exc: Exception):
    """The response for a failed request: a RequestError's message as INVALID_ARG; anything else as an internal
    error naming only its type (the traceback, with its file paths, goes to the server's log)."""
    if isinstance(exc, RequestError):
        return pb_utils.InferenceResponse(error=pb_utils.TritonError(str(exc), pb_utils.TritonError.INVALID_ARG))
    if isinstance(exc, ShuttingDown):
        return pb_utils.InferenceResponse(error=pb_utils.TritonError(str(exc), pb_utils.TritonError.UNAVAILABLE))
    pb_utils.Logger.log_error(traceback.format_exc())
    return pb_utils.InferenceResponse(error=pb_utils.TritonError(
        f"internal error ({type(exc).__name__}); the server's log has the details", pb_utils.TritonError.INTERNAL))


def text_of(value: np.ndarray, name: str) -> str:
    """One string input ([1, 1] or [1] bytes) as text; RequestError names the field."""
    if value.size != 1:
        raise RequestError(f"{name}: expected one string per request, got shape {list(value.shape)}")
    item = value.reshape(-1)[0]
    try:
        return item.decode("utf-8", errors="strict") if isinstance(item, bytes) else str(item)
    except UnicodeDecodeError:
        raise RequestError(f"{name}: not valid UTF-8") from None


def words_of(value: np.ndarray) -> list[str]:
    """stop_words [1, N] bytes → the words (RequestError for none, or one that is not UTF-8)."""
    words = one_row(value, "stop_words")
    if not words:
        raise RequestError("stop_words: no words given (leave the input out for none)")
    try:
        return [w.decode("utf-8", errors="strict") if isinstance(w, bytes) else str(w) for w in words]
    except UnicodeDecodeError:
        raise RequestError("stop_words: not valid UTF-8") from None


def encode_request(tokenizer, text_input: np.ndarray | None) -> list[int]:
    """The preprocessing model: text_input → prompt ids (chat template included). RequestError names the bad
    field."""
    return encode_prompt(tokenizer, text_of(required(text_input, "text_input"), "text_input"))


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


def scalar(inputs: dict[str, np.ndarray], name: str):
    """One request's scalar input, checked for exactly one element; None when the request does not set it."""
    value = inputs.get(name)
    if value is None:
        return None
    if value.size != 1:
        raise RequestError(f"{name}: expected one value, got shape {list(value.shape)}")
    return value.reshape(-1)[0].item()


def generation_request(inputs: dict[str, np.ndarray], pipeline: PipelineSpec) -> GenerationRequest:
    """A GenerationRequest from the speculative model's input tensors; unset fields take the pipeline's values.
    stop_words (text, matched on the output) and stop_words_ids (token sequences) may both be given."""

    def value(name: str, kind: type):
        item = scalar(inputs, name)
        return None if item is None else kind(item)

    stops = inputs.get("stop_words_ids")
    prompt = one_row(required(inputs.get("input_ids"), "input_ids"), "input_ids")
    return GenerationRequest.with_defaults(
        pipeline, prompt, max_tokens=value("max_tokens", int),
        temperature=value("temperature", float), top_k=value("top_k", int), top_p=value("top_p", float),
        repetition_penalty=value("repetition_penalty", float), seed=value("random_seed", int),
        num_draft_tokens=value("num_draft_tokens", int), end_id=value("end_id", int),
        stop_sequences=None if stops is None else split_stop_ids(one_row(stops, "stop_words_ids")),
        kind=None if "request_kind" not in inputs else text_of(inputs["request_kind"], "request_kind"),
        stop_strings=None if "stop_words" not in inputs else words_of(inputs["stop_words"]))
