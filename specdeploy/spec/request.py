"""A generation request in token ids, and the one function that decides whether it can be served.

The Triton `speculative` model and the in-process engine both build a GenerationRequest and call
`check_request`, so the same input gets the same error text everywhere. Field names follow tensorrtllm_backend.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from specdeploy.errors import RequestError
from specdeploy.spec.pipeline import UNSPECIFIED_KIND, PipelineSpec, request_kind_problem
from specdeploy.spec.sampling_params import SamplingParams
from specdeploy.spec.strict_yaml import quoted

NO_END_ID = -1  # end_id that disables end-of-sequence stopping: the request runs to max_tokens


@dataclass(frozen=True)
class GenerationRequest:
    """prompt_ids: the prompt, already through the chat template. num_draft_tokens: None for the pipeline's gamma,
    0 for plain decode. stop_sequences: token sequences that end the request once the generated tokens end with
    one (token-level, as tensorrtllm_backend's stop_words_ids). stop_strings: text that ends the request where it
    appears in the generated text (the `stop_words` input; decoding/stop_strings.py). end_id: None for the model's
    end-of-sequence tokens, another id to end on that token instead, or -1 for
    no end token. kind: the request's kind of traffic (one of serving.request_kinds), which labels its acceptance in
    the metrics; None: unspecified."""

    prompt_ids: list[int]
    max_tokens: int
    sampling: SamplingParams
    num_draft_tokens: int | None = None
    stop_sequences: list[list[int]] = field(default_factory=list)
    end_id: int | None = None
    kind: str | None = None
    stop_strings: list[str] = field(default_factory=list)

    @classmethod
    def with_defaults(cls, pipeline: PipelineSpec, prompt_ids: list[int], max_tokens: int | None = None,
                      temperature: float | None = None, top_k: int | None = None, top_p: float | None = None,
                      repetition_penalty: float | None = None, seed: int | None = None,
                      num_draft_tokens: int | None = None, stop_sequences: list[list[int]] | None = None,
                      end_id: int | None = None, kind: str | None = None,
                      stop_strings: list[str] | None = None) -> GenerationRequest:
        """A request whose fields left None take the pipeline's values (its `sampling` section)."""
        sampling = pipeline.sampling
        return cls(prompt_ids, sampling.max_tokens if max_tokens is None else max_tokens,
                   sampling.params(temperature, top_k, top_p, repetition_penalty, seed), num_draft_tokens,
                   stop_sequences or [], end_id, kind, stop_strings or [])

    @property
    def kind_label(self) -> str:
        """The request's kind as its acceptance counters label it."""
        return UNSPECIFIED_KIND if self.kind is None else self.kind

    def gamma(self, pipeline: PipelineSpec) -> int:
        """The request's proposal length: its own, else the pipeline's, within serving.policy.gamma_cap; 0 when the
        pipeline does not speculate."""
        if not pipeline.speculation.speculates:
            return 0
        gamma = pipeline.speculation.num_draft_tokens if self.num_draft_tokens is None else self.num_draft_tokens
        cap = pipeline.serving.policy.gamma_cap  # "measured" here: the engine has no measurement yet (no cap)
        return min(gamma, cap) if isinstance(cap, int) else gamma

    def kv_slots(self, pipeline: PipelineSpec) -> int:
        """The KV entries the request may occupy at worst: prompt, every output token, and the gamma + 1 slots a
        speculative step writes before it knows what it keeps."""
        return len(self.prompt_ids) + self.max_tokens + self.gamma(pipeline) + 1


def check_request(request: GenerationRequest, pipeline: PipelineSpec, vocab_size: int, kv_capacity: int) -> None:
    """RequestError naming the field when `request` cannot be served by an engine of this pipeline and vocabulary
    whose KV budget is `kv_capacity` tokens."""
    limits = pipeline.limits
    prompt = request.prompt_ids
    if not prompt:
        raise RequestError("prompt: must not be empty")
    if len(prompt) > limits.max_input_length:
        raise RequestError(f"prompt: {len(prompt)} tokens is over limits.max_input_length ({limits.max_input_length})")
    if any(not 0 <= token < vocab_size for token in prompt):
        raise RequestError(f"input_ids: token ids must be in [0, {vocab_size})")
    if request.max_tokens < 1:
        raise RequestError(f"max_tokens: must be ≥ 1, got {request.max_tokens}")
    if len(prompt) + request.max_tokens > limits.max_sequence_length:
        raise RequestError(f"max_tokens: prompt ({len(prompt)} tokens) + max_tokens ({request.max_tokens}) is over "
                           f"limits.max_sequence_length ({limits.max_sequence_length})")
    gamma = request.num_draft_tokens
    if gamma is not None and not 0 <= gamma <= limits.max_draft_tokens:
        raise RequestError(f"num_draft_tokens: must be in [0, {limits.max_draft_tokens}] "
                           f"(limits.max_draft_tokens), got {gamma}")
    if request.end_id is not None and not NO_END_ID <= request.end_id < vocab_size:
        raise RequestError(f"end_id: must be a token id in [0, {vocab_size}) or {NO_END_ID} (none), "
                           f"got {request.end_id}")
    if any(not 0 <= token < vocab_size for stop in request.stop_sequences for token in stop):
        raise RequestError(f"stop_words: token ids must be in [0, {vocab_size})")
    check_stop_strings(request.stop_strings)
    if request.kind is not None:
        check_kind(request.kind, pipeline)
    slots = request.kv_slots(pipeline)
    if slots > kv_capacity:
        raise RequestError(f"max_tokens: prompt ({len(prompt)}) + max_tokens ({request.max_tokens}) + "
                           f"{slots - len(prompt) - request.max_tokens} reserved speculative slots need {slots} KV "
                           f"slots, over the capacity of {kv_capacity}")


MAX_STOP_STRINGS = 16
MAX_STOP_STRING_LENGTH = 256


def check_stop_strings(stops: list[str]) -> None:
    """RequestError naming `stop_words` for a stop string that is empty or only spaces and tabs (it would match
    anywhere, or at the first space; a line break is allowed), or too many or too long ones."""
    if len(stops) > MAX_STOP_STRINGS:
        raise RequestError(f"stop_words: at most {MAX_STOP_STRINGS} stop words, got {len(stops)}")
    for index, stop in enumerate(stops):
        if not stop.strip() and "\n" not in stop:  # a line break is a stop people use: "end of the line"
            raise RequestError(f"stop_words: word {index} is {'empty' if not stop else 'only whitespace'} "
                               f"({stop!r}); give text that ends the output, or leave it out")
        if len(stop) > MAX_STOP_STRING_LENGTH:
            raise RequestError(f"stop_words: word {index} has {len(stop)} characters, over "
                               f"{MAX_STOP_STRING_LENGTH}")


def check_kind(kind: str, pipeline: PipelineSpec) -> None:
    """RequestError unless `kind` is one of the pipeline's serving.request_kinds."""
    allowed = pipeline.serving.request_kinds
    if kind in allowed:
        return
    problem = request_kind_problem(kind)
    if problem:
        raise RequestError(f"request_kind: {problem}")
    if not allowed:
        raise RequestError(f"request_kind: this pipeline lists no serving.request_kinds, so {quoted(kind)} is not "
                           "one")
    raise RequestError(f"request_kind: {quoted(kind)} is not one of serving.request_kinds "
                       f"(allowed: {', '.join(allowed)})")
