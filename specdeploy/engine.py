"""A built engine directory loaded for generation: prefill, then speculative (or plain) decode steps.

One decode step feeds the pending token plus the drafted tokens to the target in a single forward, applies the
exact acceptance rule and commits accepted + 1 tokens (batch.py). A plain decode step is the same step with
nothing drafted. After every step the target's cache holds the committed prefix (all but the pending token) and
the draft's cache holds a prefix of it (a draft derived from the target shares the target's cache instead).
"""

from __future__ import annotations

import json
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path

import torch
from safetensors.torch import load_file

from specdeploy.batch import BatchDecoder, Sequence
from specdeploy.errors import RequestError, SpecdeployError
from specdeploy.model import LlamaModel
from specdeploy.model_config import ModelConfig
from specdeploy.sampling import SamplingParams
from specdeploy.speculative.draft_model import DraftModelProposer, can_share_cache
from specdeploy.speculative.ngram import NgramProposer
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
    def __init__(self, engine_dir: str | Path, device: str = "cpu", method: str | None = None,
                 batch_size: int = 1) -> None:
        """method: run with another speculation method than the one built ("ngram" and "none" need no draft).
        batch_size: cache rows, i.e. how many sequences `decoder` can step together."""
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
        self.max_length = self.limits["max_sequence_length"]
        # Headroom past the limit: ragged batches pad short rows by up to max_draft_tokens + 1 positions.
        physical_length = self.max_length + self.limits["max_draft_tokens"] + 1
        self.cache = self.target.new_cache(batch_size, physical_length)
        self.draft: DraftModelProposer | None = None
        self.ngram: NgramProposer | None = None
        if self.method == "draft_target":
            draft_meta = self.speculation["draft"]
            draft_model = load_component(self.dir / "draft", device)
            # A draft derived from the target reads the target's keys/values for the committed prefix.
            shared = draft_meta["derive"] != "none" and can_share_cache(draft_model, self.target)
            cache = self.cache if shared else draft_model.new_cache(batch_size, physical_length)
            self.draft = DraftModelProposer(draft_model, cache, shared, draft_meta["early_stop_threshold"])
        elif self.method == "ngram":
            self.ngram = NgramProposer(self.speculation["ngram"]["min_n"], self.speculation["ngram"]["max_n"])
        self.eos_ids = set(self.target.config.eos_token_ids)
        if self.tokenizer.eos_token_id is not None:
            self.eos_ids.add(self.tokenizer.eos_token_id)
        self.decoder = BatchDecoder(self.target, self.cache, self.max_length, self.eos_ids, self.draft, self.ngram)

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

    def new_sequence(self, prompt_ids: list[int], params: SamplingParams, max_tokens: int,
                     num_draft_tokens: int | None = None, stop_sequences: list[list[int]] | None = None) -> Sequence:
        """A checked request, ready for `decoder.prefill`. num_draft_tokens: None → the pipeline's gamma;
        0 → plain decode."""
        gamma = self.num_draft_tokens if num_draft_tokens is None else num_draft_tokens
        self.check_request(prompt_ids, max_tokens, gamma)
        if self.method == "none":
            gamma = 0
        return self.decoder.new_sequence(prompt_ids, params, max_tokens, gamma, self.schedule, stop_sequences)

    def generate(self, prompt_ids: list[int], params: SamplingParams, max_tokens: int,
                 num_draft_tokens: int | None = None) -> Generation:
        """Start generating one request alone (cache row 0)."""
        sequence = self.new_sequence(prompt_ids, params, max_tokens, num_draft_tokens)
        return Generation(self._steps(sequence), sequence.stats)

    def check_request(self, prompt_ids: list[int], max_tokens: int, gamma: int) -> None:
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

    def _steps(self, sequence: Sequence) -> Iterator[list[int]]:
        started = time.perf_counter()
        forwards_before = self.draft.forwards if self.draft is not None else 0
        yield self.decoder.prefill(sequence, 0)
        while sequence.finish_reason is None:
            yield self.decoder.step([sequence])[0]
        if self.draft is not None:
            sequence.stats.draft_forwards = self.draft.forwards - forwards_before
        sequence.stats.total_seconds = time.perf_counter() - started
