"""A test double of one model of Triton's `tensorrtllm` backend (TensorRT-LLM 1.2.1's in-flight batching executor
over an engine), running our torch model, so the trtllm flavour's orchestration runs for real here.

What it implements, as the backend documents it (tensorrtllm_backend docs/model_config.md, the template in
builders/trtllm_upstream.py):
- `input_ids` [1, L] int32 with `input_lengths` L: the whole sequence; the prefix cached by the previous request is
  reused (the backend's KV block reuse), the rest is prefilled.
- `request_output_len` n: at most n new tokens; generation stops at `end_id` (not returned, as the executor
  does: it never counts the end token in the sequence length) unless it is -1.
- `streaming`: one response per engine step with that step's new tokens, else one response at the end.
- sampling: `temperature`, `runtime_top_k` (1: greedy; 0: off), `runtime_top_p`, `repetition_penalty`, `seed`
  (absent: 0, as the executor seeds it, so calls without one repeat one random stream).
- `return_generation_logits`: `generation_logits` [1, 1, n, V], the raw logits each new token was sampled from.
- `draft_input_ids` [1, k] (`draft_tokens_external`): one verification step over the k drafted tokens, answering
  the accepted prefix plus one token. With `draft_logits` [1, k, V] the acceptance test compares the target's
  sampling distribution p with the draft's q (both from logits through the request's sampling), drawing the test
  at random (no `draft_acceptance_threshold`), and resamples from max(0, p - q) at a rejection; without them q is
  a point mass on each drafted token. Both are the exact rule (specdeploy.speculative.acceptance).
- outputs exclude the input (`exclude_input_in_output`): `output_ids` [1, 1, n], `sequence_length` [1, 1] = n.
What it does not do: batch requests (one at a time, a lock per call), page the KV cache, or decode on past the
verification step (after a rejection the real executor may keep decoding up to request_output_len; the
orchestration takes every token it gets either way).
"""

from __future__ import annotations

import threading
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch

from specdeploy.models.llama import ragged_forward_all
from specdeploy.models.registry import load_component
from specdeploy.sampling import request_generator, sample, sampling_distribution, seen_after_drafts, seen_mask
from specdeploy.sampling_params import SamplingParams
from specdeploy.speculative.acceptance import accept
from specdeploy.speculative.ngram import common_prefix_length


class DoubleError(ValueError):
    """A request the real backend would refuse; the message names the input."""


@dataclass
class Step:
    tokens: list[int]
    logits: np.ndarray | None  # [n, V] raw logits of the tokens, when asked


def responses(steps: Iterator[Step], streaming: bool) -> Iterator[Step]:
    """What the backend sends: streaming, each engine step as it comes; otherwise one response with everything."""
    if streaming:
        yield from steps
        return
    steps = list(steps)
    logits = [step.logits for step in steps if step.logits is not None]
    yield Step([token for step in steps for token in step.tokens], np.concatenate(logits) if logits else None)


def one(inputs: dict, name: str, default=None):
    value = inputs.get(name)
    if value is None:
        if default is None:
            raise DoubleError(f"{name}: required input is missing")
        return default
    if value.size != 1:
        raise DoubleError(f"{name}: expected one value per request, got shape {list(value.shape)}")
    return value.reshape(-1)[0].item()


class TensorrtllmDouble:
    def __init__(self, component_dir: Path, max_length: int = 4096) -> None:
        self.model = load_component(Path(component_dir))
        self.vocab_size = self.model.config.vocab_size
        self.cache = self.model.new_cache(1, max_length)
        self.cached: list[int] = []  # the tokens whose keys and values cache row 0 holds
        self.lock = threading.Lock()

    def logits(self, tokens: list[int], last: int) -> torch.Tensor:
        """fp32 logits [last, V] at the last `last` positions of `tokens`, reusing the cached prefix."""
        reuse = min(common_prefix_length(self.cached, tokens), len(tokens) - last)
        fed = torch.tensor([tokens[reuse:]], dtype=torch.long)
        with torch.inference_mode():
            hidden = ragged_forward_all(self.model, self.cache, fed, [reuse])
            logits = self.model.logits(hidden[0, -last:])
        self.cached = list(tokens)
        return logits

    def run(self, inputs: dict):
        """One request's responses (a generator of Step); DoubleError for a request the backend refuses."""
        ids = inputs.get("input_ids")
        if ids is None or ids.ndim != 2 or ids.shape[0] != 1:
            raise DoubleError("input_ids: expected [1, L] int32")
        tokens = ids.reshape(-1).astype(int).tolist()
        if one(inputs, "input_lengths") != len(tokens):
            raise DoubleError(f"input_lengths: {one(inputs, 'input_lengths')} is not the {len(tokens)} input_ids")
        count = one(inputs, "request_output_len")
        if count < 1:
            raise DoubleError(f"request_output_len: must be ≥ 1, got {count}")
        top_k = one(inputs, "runtime_top_k", 0)
        params = SamplingParams(temperature=0.0 if top_k == 1 else one(inputs, "temperature", 1.0),
                                top_k=0 if top_k == 1 else top_k, top_p=one(inputs, "runtime_top_p", 1.0),
                                repetition_penalty=one(inputs, "repetition_penalty", 1.0),
                                seed=inputs["seed"].reshape(-1)[0].item() if "seed" in inputs else 0)
        generator = request_generator(params)
        end_id = one(inputs, "end_id", -1)
        with_logits = bool(one(inputs, "return_generation_logits", False))
        drafts = inputs.get("draft_input_ids")
        with self.lock:
            if drafts is not None and drafts.size:
                step = self.verify(tokens, drafts.reshape(-1).astype(int).tolist(), inputs.get("draft_logits"),
                                   params, generator)
                if end_id in step.tokens:  # not returned, and nothing after it
                    step.tokens = step.tokens[:step.tokens.index(end_id)]
                if step.tokens:
                    yield step
                return
            for _ in range(count):
                logits = self.logits(tokens, 1)
                seen = seen_mask(tokens, self.vocab_size)[None]
                token = int(sample(sampling_distribution(logits, params, seen), generator)[0])
                if token == end_id:
                    return  # the executor stops at the end token without returning it
                tokens.append(token)
                yield Step([token], logits.numpy() if with_logits else None)

    def verify(self, tokens: list[int], drafts: list[int], draft_logits: np.ndarray | None,
               params: SamplingParams, generator) -> Step:
        k = len(drafts)
        if draft_logits is not None and draft_logits.shape != (1, k, self.vocab_size):
            raise DoubleError(f"draft_logits: expected [1, {k}, {self.vocab_size}] for {k} draft_input_ids, got "
                              f"{list(draft_logits.shape)}")
        drafted = torch.tensor(drafts, dtype=torch.long)
        seen = seen_after_drafts(seen_mask(tokens, self.vocab_size), drafted)  # [k + 1, V]
        p = sampling_distribution(self.logits(tokens + drafts, k + 1), params, seen)
        q = None if draft_logits is None else sampling_distribution(torch.from_numpy(draft_logits[0]), params,
                                                                    seen[:k])
        result = accept(drafted[None], None if q is None else q[None], p[None], torch.tensor([k]), generator)
        accepted = int(result.num_accepted[0])
        return Step(result.tokens[0, :accepted + 1].tolist(), None)
