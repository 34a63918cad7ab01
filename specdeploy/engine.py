"""A built engine directory loaded for generation: prefill, then speculative (or plain) decode steps.

One decode step feeds the pending token plus the drafted tokens to the target in a single forward, applies the
exact acceptance rule and commits accepted + 1 tokens. A plain decode step is the same step with nothing drafted.
After every step the target's cache holds the committed prefix (all but the pending token) and the draft's
cache holds a prefix of it (a draft derived from the target shares the target's cache instead).
"""

from __future__ import annotations

import json
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path

import torch
from safetensors.torch import load_file

from specdeploy.errors import RequestError, SpecdeployError
from specdeploy.model import LlamaModel
from specdeploy.model_config import ModelConfig
from specdeploy.sampling import SamplingParams, sample, sampling_distribution, seen_after_drafts, seen_mask
from specdeploy.speculative.acceptance import accept
from specdeploy.speculative.draft_model import DraftModelProposer, can_share_cache
from specdeploy.speculative.ngram import NgramProposer
from specdeploy.speculative.schedule import ProposalLength
from specdeploy.stats import RequestStats

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16}


def load_component(directory: Path, device: str = "cpu") -> LlamaModel:
    """A model from `<engine>/<component>/` (config.json + model.safetensors)."""
    meta = json.loads((directory / "config.json").read_text())
    config = ModelConfig.from_dict(meta["model"])
    state = load_file(str(directory / "model.safetensors"), device=device)
    return LlamaModel(config, state, DTYPES[meta["dtype"]]).to(device).eval()


@dataclass
class Generation:
    """Iterate to receive the tokens committed by each step; `stats` and `tokens` fill in as it runs."""

    steps: Iterator[list[int]]
    stats: RequestStats
    tokens: list[int] = field(default_factory=list)

    def __iter__(self) -> Iterator[list[int]]:
        for emitted in self.steps:
            self.tokens.extend(emitted)
            yield emitted

    def run(self) -> list[int]:
        for _ in self:
            pass
        return self.tokens


class Engine:
    def __init__(self, engine_dir: str | Path, device: str = "cpu", method: str | None = None) -> None:
        """method: run with another speculation method than the one built ("ngram" and "none" need no draft)."""
        from transformers import AutoTokenizer

        self.dir = Path(engine_dir)
        manifest_path = self.dir / "build_manifest.json"
        if not manifest_path.is_file():
            raise SpecdeployError(f"{self.dir}: not a complete engine (no build_manifest.json); run specdeploy build")
        self.manifest = json.loads(manifest_path.read_text())
        target_meta = json.loads((self.dir / "target" / "config.json").read_text())
        self.speculation = target_meta["speculation"]
        self.limits = target_meta["limits"]
        self.dtype = target_meta["dtype"]
        self.device = device
        self.target = load_component(self.dir / "target", device)
        self.tokenizer = AutoTokenizer.from_pretrained(self.dir / "target")
        self.method = method or self.speculation["method"]
        if self.method not in ("draft_target", "ngram", "none"):
            raise SpecdeployError(f"method {self.method!r} is not supported (allowed: draft_target, ngram, none)")
        if self.method == "draft_target" and not (self.dir / "draft").is_dir():
            raise SpecdeployError(f"{self.dir}: method 'draft_target' needs a draft engine, and none was built")
        self.num_draft_tokens = self.speculation["num_draft_tokens"]
        self.schedule = self.speculation["schedule"]
        max_length = self.limits["max_sequence_length"]
        self.cache = self.target.new_cache(1, max_length)
        self.draft: DraftModelProposer | None = None
        self.ngram: NgramProposer | None = None
        if self.method == "draft_target":
            draft_meta = self.speculation["draft"]
            draft_model = load_component(self.dir / "draft", device)
            # A draft derived from the target reads the target's keys/values for the committed prefix.
            derived = draft_meta["derive"] != "none" and can_share_cache(draft_model, self.target)
            self.draft = DraftModelProposer(draft_model, max_length, draft_meta["early_stop_threshold"],
                                            shared_cache=self.cache if derived else None)
        elif self.method == "ngram":
            self.ngram = NgramProposer(self.speculation["ngram"]["min_n"], self.speculation["ngram"]["max_n"])
        self.eos_ids = set(self.target.config.eos_token_ids)
        if self.tokenizer.eos_token_id is not None:
            self.eos_ids.add(self.tokenizer.eos_token_id)

    @property
    def vocab_size(self) -> int:
        return self.target.config.vocab_size

    def encode_prompt(self, prompt: str, chat: bool = True) -> list[int]:
        """Token ids for a user prompt; wrapped in the chat template when the tokenizer has one."""
        if not prompt or not prompt.strip():
            raise RequestError("prompt: must not be empty")
        if chat and getattr(self.tokenizer, "chat_template", None):
            text = self.tokenizer.apply_chat_template([{"role": "user", "content": prompt}], tokenize=False,
                                                      add_generation_prompt=True)
            return self.tokenizer(text, add_special_tokens=False)["input_ids"]
        return self.tokenizer(prompt)["input_ids"]

    def decode(self, tokens: list[int]) -> str:
        return self.tokenizer.decode([t for t in tokens if t not in self.eos_ids], skip_special_tokens=True)

    def generate(self, prompt_ids: list[int], params: SamplingParams, max_tokens: int,
                 num_draft_tokens: int | None = None) -> Generation:
        """Start generating. num_draft_tokens: None → the pipeline's gamma; 0 → plain decode."""
        gamma = self.num_draft_tokens if num_draft_tokens is None else num_draft_tokens
        if self.method == "none":
            gamma = 0
        self._check_request(prompt_ids, max_tokens, gamma)
        stats = RequestStats(prompt_tokens=len(prompt_ids))
        return Generation(self._steps(list(prompt_ids), params, max_tokens, gamma, stats), stats)

    def _check_request(self, prompt_ids: list[int], max_tokens: int, gamma: int) -> None:
        limit = self.limits["max_input_length"]
        if not prompt_ids:
            raise RequestError("prompt: must not be empty")
        if len(prompt_ids) > limit:
            raise RequestError(f"prompt: {len(prompt_ids)} tokens is over the limit of {limit} (max_input_length)")
        if max_tokens <= 0:
            raise RequestError(f"max_tokens: must be ≥ 1, got {max_tokens}")
        if not 0 <= gamma <= self.limits["max_draft_tokens"]:
            raise RequestError(f"num_draft_tokens: must be in [0, {self.limits['max_draft_tokens']}], got {gamma}")
        if any(not 0 <= t < self.vocab_size for t in prompt_ids):
            raise RequestError(f"prompt: token ids must be in [0, {self.vocab_size})")

    def _propose(self, committed: list[int], gamma: int, params: SamplingParams, seen: torch.Tensor | None,
                 generator: torch.Generator | None) -> tuple[torch.Tensor, torch.Tensor | None]:
        """Drafted tokens [n] and their q [n, V] (None for one-hot proposers)."""
        if gamma > 0 and self.draft is not None:
            return self.draft.propose(committed, gamma, params, seen, generator)
        if gamma > 0 and self.ngram is not None:
            proposal = self.ngram.propose(committed, gamma)
            return torch.tensor(proposal, dtype=torch.long, device=self.device), None
        return torch.empty(0, dtype=torch.long, device=self.device), None

    def _steps(self, committed: list[int], params: SamplingParams, max_tokens: int, gamma: int,
               stats: RequestStats) -> Iterator[list[int]]:
        started = time.perf_counter()
        max_length = self.cache.max_length
        max_tokens = min(max_tokens, max_length - len(committed))
        generator = params.generator(self.device)
        proposal_length = ProposalLength(self.schedule, gamma)
        penalised = params.repetition_penalty != 1.0
        seen = seen_mask(committed, self.vocab_size, self.device) if penalised else None
        self.cache.rewind(0, 0)
        if self.draft is not None:
            self.draft.reset()
            forwards_before = self.draft.forwards

        with torch.inference_mode():
            prompt = torch.tensor([committed], dtype=torch.long, device=self.device)
            hidden = self.target(prompt, torch.arange(len(committed), device=self.device)[None], self.cache)
            self.cache.rewind(0, len(committed))
            probs = sampling_distribution(self.target.logits(hidden[:, -1]), params,
                                          None if seen is None else seen[None])
            first = sample(probs, generator).tolist()
        stats.prefill_seconds = time.perf_counter() - started
        emitted, generated = first, 0

        while True:
            emitted = emitted[:max_tokens - generated]
            finished = next((i for i, t in enumerate(emitted) if t in self.eos_ids), None)
            if finished is not None:
                emitted = emitted[:finished + 1]
            generated += len(emitted)
            committed.extend(emitted)
            # A stop token or the length limit may cut a step short: drop the cut tokens' KV entries too.
            self.cache.rewind(0, min(self.cache.lengths[0], len(committed) - 1))
            if self.draft is not None:
                self.draft.rewind(len(committed))
            if seen is not None:
                seen[emitted] = True
            stats.generated_tokens = generated
            yield emitted
            if finished is not None or generated >= max_tokens:
                stats.finish_reason = "stop" if finished is not None else "length"
                break

            with torch.inference_mode():  # not across the yield: the caller runs outside it
                step_gamma = min(proposal_length.current, max_tokens - generated - 1, max_length - len(committed))
                draft_started = time.perf_counter()
                drafted, q = self._propose(committed, step_gamma, params, seen, generator)
                verify_started = time.perf_counter()
                n_drafted = drafted.shape[0]
                length = len(committed) - 1  # the pending token is fed now, at this position
                inputs = torch.cat([torch.tensor([committed[-1]], device=self.device), drafted])[None]
                positions = torch.arange(length, length + n_drafted + 1, device=self.device)[None]
                hidden = self.target(inputs, positions, self.cache)
                context = None if seen is None else seen_after_drafts(seen, drafted)
                p = sampling_distribution(self.target.logits(hidden[0]), params, context)  # [n + 1, V]
                if n_drafted == 0:
                    emitted, n_accepted = sample(p, generator).tolist(), 0
                else:
                    result = accept(drafted[None], None if q is None else q[None], p[None],
                                    torch.tensor([n_drafted], device=self.device), generator)
                    row = result.tokens[0].tolist()  # the step's one host sync
                    n_accepted = row.index(-1) - 1 if -1 in row else n_drafted
                    emitted = row[:n_accepted + 1]
                self.cache.rewind(0, length + n_accepted + 1)
            stats.draft_seconds += verify_started - draft_started
            stats.verify_seconds += time.perf_counter() - verify_started
            stats.record_step(n_drafted, n_accepted)
            proposal_length.update(n_drafted, n_accepted)

        if self.draft is not None:
            stats.draft_forwards = self.draft.forwards - forwards_before
        stats.total_seconds = time.perf_counter() - started
