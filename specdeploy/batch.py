"""Sequences decoded together: prefill one into a cache row, then batched speculative steps over all of them.

A step for B sequences (rows 0..B-1 of the caches): the proposer drafts up to gamma_r tokens per row, the target
verifies each row's pending token + drafts in one ragged forward, the exact rule accepts per row, and each row
commits accepted + 1 tokens. A row with gamma 0 is a plain decode step inside the same forward.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field

import torch

from specdeploy.kv_cache import KVCache
from specdeploy.model import LlamaModel, ragged_forward_all
from specdeploy.sampling import (
    SamplingParams,
    greedy_tokens,
    sample,
    sampling_distribution,
    seen_after_drafts,
    seen_mask,
)
from specdeploy.speculative.acceptance import accept, accept_greedy
from specdeploy.speculative.draft_model import DraftModelProposer
from specdeploy.speculative.ngram import NgramProposer
from specdeploy.speculative.schedule import ProposalLength
from specdeploy.stats import RequestStats


@dataclass
class Sequence:
    """One request's decoding state. `committed` is prompt + generated tokens; the last one is pending (not yet
    in the target's cache)."""

    committed: list[int]
    params: SamplingParams
    max_tokens: int
    proposal: ProposalLength
    stats: RequestStats
    generator: torch.Generator | None = None
    seen: torch.Tensor | None = None  # [V] bool, for the repetition penalty
    stop_sequences: list[list[int]] = field(default_factory=list)
    generated: int = 0
    draft_length: int = 0  # entries in the draft's own cache
    finish_reason: str | None = None

    @property
    def cache_length(self) -> int:
        return len(self.committed) - 1


class BatchDecoder:
    """The models and caches of one engine, stepping any number (≤ the caches' rows) of sequences."""

    def __init__(self, target: LlamaModel, cache: KVCache, max_length: int, eos_ids: set[int],
                 draft: DraftModelProposer | None = None, ngram: NgramProposer | None = None) -> None:
        """max_length: the logical sequence limit (the caches have headroom past it for ragged padding)."""
        self.target, self.cache, self.max_length, self.eos_ids = target, cache, max_length, eos_ids
        self.draft, self.ngram = draft, ngram
        self.vocab_size = target.config.vocab_size
        self.device = target.embed.device

    def new_sequence(self, prompt: list[int], params: SamplingParams, max_tokens: int, gamma: int,
                     schedule: str, stop_sequences: list[list[int]] | None = None) -> Sequence:
        """A sequence ready for prefill. max_tokens is cut to what the sequence limit leaves."""
        penalised = params.repetition_penalty != 1.0
        return Sequence(committed=list(prompt), params=params,
                        max_tokens=min(max_tokens, self.max_length - len(prompt)),
                        proposal=ProposalLength(schedule, gamma), stats=RequestStats(prompt_tokens=len(prompt)),
                        generator=params.generator(self.device),
                        seen=seen_mask(prompt, self.vocab_size, self.device) if penalised else None,
                        stop_sequences=[s for s in stop_sequences or [] if s])

    def prefill(self, sequence: Sequence, row: int) -> list[int]:
        """Run the prompt into cache row `row` and commit the first token. Returns the emitted tokens."""
        started = time.perf_counter()
        prompt = sequence.committed
        with torch.inference_mode():
            view = self.cache.rows(row, row + 1)
            view.lengths[0] = 0
            hidden = self.target(torch.tensor([prompt], device=self.device),
                                 torch.arange(len(prompt), device=self.device)[None], view)
            probs = sampling_distribution(self.target.logits(hidden[:, -1]), sequence.params,
                                          None if sequence.seen is None else sequence.seen[None])
            first = sample(probs, sequence.generator).tolist()
        emitted = self._commit(sequence, row, first)
        if self.draft is not None and not self.draft.shared and sequence.finish_reason is None:
            with torch.inference_mode():
                self.draft.prefill(sequence, row)
            self.draft.cache.rewind(row, sequence.draft_length)
        sequence.stats.prefill_seconds = time.perf_counter() - started
        return emitted

    def step(self, sequences: list[Sequence], gammas: list[int] | None = None) -> list[list[int]]:
        """One decode step for rows 0..B-1. gammas[r] caps row r's proposal (default: its schedule's length).
        Returns the tokens each row emitted."""
        gammas = [self._step_gamma(s, None if gammas is None else gammas[r]) for r, s in enumerate(sequences)]
        draft_started = time.perf_counter()
        with torch.inference_mode():
            drafted, q, counts = self._propose(sequences, gammas)
            verify_started = time.perf_counter()
            inputs = [[s.committed[-1]] + drafted[r, :counts[r]].tolist() for r, s in enumerate(sequences)]
            hidden = ragged_forward_all(self.target, self.cache.rows(0, len(sequences)), inputs,
                                        [s.cache_length for s in sequences])
            logits = self.target.logits(torch.cat([hidden[r, :len(row)] for r, row in enumerate(inputs)]))
            results, offset = [], 0
            for r, sequence in enumerate(sequences):
                count = counts[r]
                row_logits, offset = logits[offset:offset + count + 1], offset + count + 1
                context = None if sequence.seen is None else seen_after_drafts(sequence.seen, drafted[r, :count])
                num_drafted = torch.tensor([count], device=self.device)
                if sequence.params.greedy:  # p and the row's q (or the one-hot proposal) are point masses
                    target_tokens = greedy_tokens(row_logits, sequence.params, context)  # [count + 1]
                    outcome = accept_greedy(drafted[r:r + 1, :count], target_tokens[None], num_drafted)
                else:
                    p = sampling_distribution(row_logits, sequence.params, context)  # [count + 1, V]
                    outcome = accept(drafted[r:r + 1, :count], None if q is None else q[r:r + 1, :count], p[None],
                                     num_drafted, sequence.generator)
                row = outcome.tokens[0].tolist()  # the row's one host sync
                accepted = row.index(-1) - 1 if -1 in row else count
                results.append((row[:accepted + 1], accepted))
        finished = time.perf_counter()
        emitted_all = []
        for r, (sequence, (tokens, accepted)) in enumerate(zip(sequences, results)):
            sequence.stats.draft_seconds += verify_started - draft_started
            sequence.stats.verify_seconds += finished - verify_started
            sequence.stats.record_step(counts[r], accepted)
            sequence.proposal.update(counts[r], accepted)
            emitted_all.append(self._commit(sequence, r, tokens))
        return emitted_all

    def _step_gamma(self, sequence: Sequence, cap: int | None) -> int:
        gamma = sequence.proposal.current if cap is None else min(cap, sequence.proposal.current)
        if self.draft is None and self.ngram is None:
            gamma = 0
        return max(0, min(gamma, sequence.max_tokens - sequence.generated - 1,
                          self.max_length - len(sequence.committed)))

    def _propose(self, sequences: list[Sequence], gammas: list[int]
                 ) -> tuple[torch.Tensor, torch.Tensor | None, list[int]]:
        """Drafted tokens [B, G], q [B, G, V] (None for one-hot proposers), and each row's count."""
        if self.draft is not None and max(gammas) > 0:
            return self.draft.propose(sequences, gammas)
        proposals = [self.ngram.propose(s.committed, g) if self.ngram is not None and g > 0 else []
                     for s, g in zip(sequences, gammas)]
        width = max([len(p) for p in proposals] + [0])
        drafted = torch.tensor([p + [0] * (width - len(p)) for p in proposals], dtype=torch.long,
                               device=self.device).reshape(len(sequences), width)
        return drafted, None, [len(p) for p in proposals]

    def _commit(self, sequence: Sequence, row: int, tokens: list[int]) -> list[int]:
        """Append a step's tokens, cut at a stop token, stop sequence or the length limit; keep the caches at the
        committed prefix. Returns what was emitted."""
        emitted = []
        for token in tokens[:sequence.max_tokens - sequence.generated]:
            emitted.append(token)
            sequence.committed.append(token)
            if token in self.eos_ids or any(sequence.committed[-len(s):] == s for s in sequence.stop_sequences):
                sequence.finish_reason = "stop"
                break
        sequence.generated += len(emitted)
        if sequence.seen is not None:
            sequence.seen[emitted] = True
        if sequence.finish_reason is None and sequence.generated >= sequence.max_tokens:
            sequence.finish_reason = "length"
        self.cache.rewind(row, sequence.cache_length)
        sequence.draft_length = min(sequence.draft_length, sequence.cache_length)
        if self.draft is not None and not self.draft.shared:
            self.draft.cache.rewind(row, sequence.draft_length)
        stats = sequence.stats
        stats.generated_tokens = sequence.generated
        if sequence.finish_reason:
            stats.finish_reason = sequence.finish_reason
        return emitted
