"""Sequences decoded together: prefill one into a cache row, then batched speculative steps over all of them.

A step for B sequences (rows 0..B-1 of the target's cache) has three phases:
- propose: the proposer drafts up to gamma_r tokens for row r (gamma 0 makes the row a plain decode step);
- verify: one ragged target forward over every row's pending token and drafts, the exact rule for all rows at once
  (greedy rows through one `accept_greedy`, sampled rows through one `accept`), and one host read of the outcome;
- commit: each row appends its accepted drafts and the recovered or bonus token (cut at an end token, a stop
  sequence or max_tokens), its caches keep exactly the committed prefix, and the proposer is handed the target's
  hidden states at the committed positions.
"""

from __future__ import annotations

import time
from dataclasses import dataclass

import torch

from specdeploy.decoding.draft_length import ProposalLength, step_gamma
from specdeploy.decoding.repetition_penalty import penalised, seen_after_drafts, seen_mask
from specdeploy.decoding.sampling import RowStreams, request_generator, sample, sampling_distribution
from specdeploy.decoding.sequence import Sequence
from specdeploy.errors import SpecdeployError
from specdeploy.models.device_transfer import PhaseClock, from_host
from specdeploy.models.kv_cache import KVCache
from specdeploy.models.llama import LlamaModel
from specdeploy.models.reductions import argmax
from specdeploy.runtime.verify_shape import ChainShape, TreeShape
from specdeploy.spec.pipeline import PolicySpec
from specdeploy.spec.request import GenerationRequest
from specdeploy.spec.speculation import Acceptance
from specdeploy.speculative.acceptance import AcceptanceResult
from specdeploy.speculative.proposer import Proposal, Proposer
from specdeploy.speculative.tree import TreeAcceptance, accept_tree, accept_tree_typical


def outcome_rows(result: AcceptanceResult) -> torch.Tensor:
    """One row per sequence for the step's host read: the accepted count, the emitted tokens (-1 after), and for a
    tree the accepted path's verify indices: [B, 1 + D + 1 (+ D)]."""
    parts = [result.num_accepted[:, None], result.tokens]
    if isinstance(result, TreeAcceptance):
        parts.append(result.path)
    return torch.cat(parts, dim=1)


def read_checked(values: torch.Tensor, logits: torch.Tensor) -> list:
    """values ([N] or [B, W]) as lists, read in the same host sync as a check that `logits` are finite: a target
    whose logits turn NaN or inf (corrupted weights, an overflow) raises instead of sampling garbage or nothing."""
    finite = torch.isfinite(logits).all().to(values.dtype).view(1)
    *flat, ok = torch.cat([values.flatten(), finite]).tolist()
    if not ok:
        raise SpecdeployError("the target's logits are not finite: its weights may be corrupted (rebuild the "
                              "engine with specdeploy build --force)")
    if values.dim() == 1:
        return flat
    width = values.shape[1]
    return [flat[i:i + width] for i in range(0, len(flat), width)]


@dataclass
class Verdict:
    """A verified step, read to the host: per row the accepted drafted tokens then the recovered or bonus token,
    and what the proposer reads of the verified positions (the target's final hidden states [B, W, H], or the
    states entering the layers it captures side by side: Proposer.capture). A chain keeps row r's first
    len(tokens[r]) positions; a tree keeps the verify indices in paths[r] (the root, then the accepted nodes)."""

    tokens: list[list[int]]
    hidden: torch.Tensor
    paths: list[list[int]] | None = None
    guesses: list[list[int]] | None = None  # for a proposer that reads_guesses: the target's argmax by verify index

    def kept(self, row: int) -> list[int]:
        """The verify indices of row `row` whose tokens were committed (in order)."""
        return list(range(len(self.tokens[row]))) if self.paths is None else self.paths[row]


@dataclass
class Scores:
    """The target's final logits (fp32, repetition penalties applied) at one step's real positions, before any rule:
    row r's counts[r] + 1 positions (its pending token, then its drafts) are rows offsets[r]:offsets[r + 1] of
    logits [N, V]. Rows shorter than W = max(counts) + 1 are padded in the [B, W] inputs, not here."""

    counts: list[int]
    offsets: list[int]
    logits: torch.Tensor

    @property
    def width(self) -> int:
        return max(self.counts) + 1

    @property
    def unpadded(self) -> bool:
        """Every row verifies W positions, so logits are the [B, W] positions row-major."""
        return self.offsets[-1] == len(self.counts) * self.width


@dataclass
class Rows:
    """The rows of the batch one rule decides, as host indices and as a device tensor [R] to index device tensors
    with (a Python list would be copied over with a host sync)."""

    indices: list[int]
    tensor: torch.Tensor


class BatchDecoder:
    """The target, its cache and the proposer of one engine, stepping up to the cache's rows of sequences."""

    def __init__(self, target: LlamaModel, cache: KVCache, proposer: Proposer, max_length: int,
                 acceptance: Acceptance = "exact") -> None:
        """max_length: the logical sequence limit (the cache has headroom past it for ragged padding).
        acceptance: "typical" verifies sampled rows' trees with Medusa's lossy typical acceptance."""
        self.target, self.cache, self.proposer, self.max_length = target, cache, proposer, max_length
        self.tree_rule = accept_tree_typical if acceptance == "typical" else accept_tree
        self.vocab_size = target.config.vocab_size
        self.device = target.embed.device
        self.clock = PhaseClock(self.device)

    def new_sequence(self, request: GenerationRequest, proposal: ProposalLength, end_ids: frozenset[int],
                     tokenizer=None) -> Sequence:
        """A sequence for a checked request, ready for prefill. end_ids: the model's end tokens (the request's
        end_id replaces them). tokenizer: for the request's stop strings."""
        params = request.sampling
        seen = (seen_mask(from_host(request.prompt_ids, self.device, torch.long), self.vocab_size)
                if params.repetition_penalty != 1.0 else None)
        return Sequence.for_request(request, proposal, end_ids,
                                    generator=request_generator(params, self.device), seen=seen, tokenizer=tokenizer)

    def prefill(self, sequence: Sequence, row: int) -> list[int]:
        """Run the prompt into cache row `row` and commit the first token. Returns the emitted tokens."""
        started = time.perf_counter()
        prompt = sequence.committed
        with torch.inference_mode():
            view = self.cache.rows(row, row + 1)
            view.lengths[0] = 0
            forward = self.target(from_host([prompt], self.device),
                                  torch.arange(len(prompt), device=self.device)[None], view,
                                  capture=self.proposer.capture)
            logits = self.target.logits(forward.hidden[0, -1:])
            probs = sampling_distribution(logits, sequence.params,
                                          None if sequence.seen is None else sequence.seen[None])
            first = read_checked(sample(probs, sequence.generator), logits)
            emitted = self._append(sequence, row, first)
            if sequence.finish_reason is None:
                features = forward.hidden if forward.captured is None else forward.captured
                self.proposer.prefill(row, sequence, features[0])
        sequence.stats.prefill_seconds = time.perf_counter() - started
        return emitted

    def step(self, sequences: list[Sequence], policy: PolicySpec | None = None) -> list[list[int]]:
        """One decode step for rows 0..B-1, each drafting what `step_gamma` allows under the batch policy `policy`
        (None: no policy). Returns the tokens each row emitted."""
        gammas = [step_gamma(s.proposal, policy, len(sequences), s.remaining, self.max_length - len(s.committed))
                  for s in sequences]
        self.clock.start()
        with torch.inference_mode():
            proposal = (self.proposer.propose(sequences, gammas) if max(gammas) > 0
                        else Proposal.empty(len(sequences), self.device))
            self.clock.drafted()
            verdict = self.verify(sequences, proposal)
            draft_seconds, verify_seconds = self.clock.verified()
            emitted = [self.commit(sequence, row, proposal.counts[row], verdict, proposal.positions(row))
                       for row, sequence in enumerate(sequences)]
        for sequence in sequences:
            sequence.stats.draft_seconds += draft_seconds
            sequence.stats.verify_seconds += verify_seconds
        return emitted

    def verify(self, sequences: list[Sequence], proposal: Proposal) -> Verdict:
        """One target forward over every row's pending token and drafts, then the exact rule for all rows (greedy
        rows in one call, sampled rows in another) and the step's one host read. The drafts are a chain
        (draft-target, n-gram, early exit) or, when the proposal carries a tree, the nodes of a token tree per row
        (Medusa, EAGLE-3, lookahead): runtime/verify_shape.py lays out each."""
        batch = len(sequences)
        shape = (ChainShape(proposal) if proposal.tree is None
                 else TreeShape(proposal.tree.tensors(self.device), self.tree_rule))
        tokens = self._step_tokens(sequences, proposal)  # [B, W]
        forward = shape.forward(self.target, self.cache.rows(0, batch), tokens, [s.cache_length for s in sequences],
                                [count + 1 for count in proposal.counts], self.proposer.capture)  # [B, W, H]
        scores = self._scores(sequences, proposal, forward.hidden, shape.ancestry)
        num_drafted = from_host(proposal.counts, self.device)
        greedy, sampled = self._rows(sequences)
        outcomes = []  # (rows [R], outcome_rows [R, X])
        if greedy.indices:
            result = shape.accept_greedy(greedy.tensor, tokens[greedy.tensor, 1:],
                                         self._target_tokens(scores, greedy.indices), num_drafted[greedy.tensor])
            outcomes.append((greedy.tensor, outcome_rows(result)))
        if sampled.indices:
            target_probs, streams = self._sampled_inputs(sequences, scores, sampled.indices)
            result = shape.accept_sampled(sampled.tensor, tokens[sampled.tensor, 1:], target_probs,
                                          num_drafted[sampled.tensor], streams)
            outcomes.append((sampled.tensor, outcome_rows(result)))
        guesses = None
        if self.proposer.reads_guesses:  # the argmax at every verify index, in the same host read
            guesses = self._target_tokens(scores, list(range(batch)))
            outcomes = [(rows, torch.cat([part, guesses[rows]], dim=1)) for rows, part in outcomes]
        read = self._read(outcomes, scores.logits, batch)
        if guesses is not None:
            guesses = [row[-scores.width:][:count + 1] for row, count in zip(read, scores.counts)]
            read = [row[:-scores.width] for row in read]
        features = forward.hidden if forward.captured is None else forward.captured
        return Verdict([row[1:row[0] + 2] for row in read], features, shape.paths(read), guesses)

    def _step_tokens(self, sequences: list[Sequence], proposal: Proposal) -> torch.Tensor:
        """Each row's pending token (committed, not yet in the cache), then its drafts: [B, W]."""
        width = max(proposal.counts) + 1
        pending = from_host([[s.committed[-1]] for s in sequences], self.device)
        return torch.cat([pending, proposal.tokens[:, :width - 1]], dim=1)

    def _scores(self, sequences: list[Sequence], proposal: Proposal, hidden: torch.Tensor,
                ancestry: torch.Tensor | None) -> Scores:
        """The final logits at each row's real positions only (the vocabulary projection is a fifth of a forward
        here), from the hidden states [B, W, H]. ancestry: each row's tree [B, W, W], for the repetition penalty."""
        batch, counts = len(sequences), proposal.counts
        width = max(counts) + 1
        offsets = [0]
        for count in counts:
            offsets.append(offsets[-1] + count + 1)
        if offsets[-1] == batch * width:  # every row verifies W positions
            real = hidden.reshape(batch * width, -1)
        else:
            real = hidden[from_host([r for r in range(batch) for _ in range(counts[r] + 1)], self.device),
                          from_host([c for r in range(batch) for c in range(counts[r] + 1)], self.device)]
        return Scores(counts, offsets, self._penalised(sequences, proposal, offsets, self.target.logits(real),
                                                       ancestry))

    def _rows(self, sequences: list[Sequence]) -> tuple[Rows, Rows]:
        """The greedy rows and the sampled rows."""
        greedy = [r for r, s in enumerate(sequences) if s.params.greedy]
        sampled = [r for r, s in enumerate(sequences) if not s.params.greedy]
        return (Rows(greedy, from_host(greedy, self.device, torch.long)),
                Rows(sampled, from_host(sampled, self.device, torch.long)))

    def _target_tokens(self, scores: Scores, greedy: list[int]) -> torch.Tensor:
        """The greedy rows' target token at each verified position, the argmax of the final logits: [G, W] (0 past
        a row's positions)."""
        batch, width, counts, offsets = len(scores.counts), scores.width, scores.counts, scores.offsets
        if len(greedy) == batch and scores.unpadded:
            return argmax(scores.logits).view(batch, width)
        places = [(i, c, offsets[r] + c) for i, r in enumerate(greedy) for c in range(counts[r] + 1)]
        target_tokens = torch.zeros(len(greedy), width, dtype=torch.long, device=self.device)
        at_row, at_column, flat = (from_host(list(column), self.device) for column in zip(*places))
        target_tokens[at_row, at_column] = argmax(scores.logits[flat])
        return target_tokens

    def _sampled_inputs(self, sequences: list[Sequence], scores: Scores,
                        sampled: list[int]) -> tuple[torch.Tensor, RowStreams]:
        """The sampled rows' target distributions at their verified positions [S, W, V] (zero past a row's
        positions) and their random streams (each row draws from its own request's generator)."""
        target_probs = torch.zeros(len(sampled), scores.width, self.vocab_size, device=self.device)
        for i, r in enumerate(sampled):
            target_probs[i, :scores.counts[r] + 1] = sampling_distribution(
                scores.logits[scores.offsets[r]:scores.offsets[r + 1]], sequences[r].params)
        return target_probs, RowStreams([sequences[r].generator for r in sampled], [scores.counts[r] for r in sampled])

    def _read(self, outcomes: list[tuple[torch.Tensor, torch.Tensor]], logits: torch.Tensor,
              batch: int) -> list[list[int]]:
        """The step's one host sync: every row's outcome in row order (outcomes: (rows [R], outcome_rows [R, X]) per
        rule), read with the check that the logits are finite."""
        if len(outcomes) == 1:
            outcome = outcomes[0][1]  # one kind of row, already in row order
        else:
            outcome = torch.empty(batch, outcomes[0][1].shape[1], dtype=torch.long, device=self.device)
            for rows, part in outcomes:
                outcome[rows] = part
        return read_checked(outcome, logits)

    def _penalised(self, sequences: list[Sequence], proposal: Proposal, offsets: list[int],
                   logits: torch.Tensor, ancestry: torch.Tensor | None) -> torch.Tensor:
        """Apply each penalised row's repetition penalty to its verified positions (each position has seen the
        context and the drafted tokens before it: in a tree, its ancestors'), so greedy and sampled rows then work
        on final logits."""
        for r, sequence in enumerate(sequences):
            if sequence.seen is not None:
                count = proposal.counts[r]
                context = seen_after_drafts(sequence.seen, proposal.tokens[r, :count],
                                            None if ancestry is None else ancestry[r, :count + 1, :count + 1])
                logits[offsets[r]:offsets[r + 1]] = penalised(logits[offsets[r]:offsets[r + 1]], sequence.params,
                                                              context)
        return logits

    def commit(self, sequence: Sequence, row: int, drafted: int, verdict: Verdict,
               positions: int | None = None) -> list[int]:
        """Append row `row`'s verified tokens; statistics count only what was committed. positions: how many
        successive positions were proposed (default drafted; a tree's depth)."""
        tokens, kept = verdict.tokens[row], verdict.kept(row)
        if verdict.guesses is not None:
            self.proposer.observe(row, verdict.guesses[row])
        start = sequence.cache_length
        # A tree's accepted nodes were written at their node's slot: move them to the positions they now hold.
        self.cache.move_entries(row, [start + index for index in kept], list(range(start, start + len(kept))))
        emitted = self._append(sequence, row, tokens)
        accepted = min(len(tokens) - 1, len(emitted))  # drafted tokens accepted *and* committed
        sequence.stats.record_step(drafted, accepted, positions)
        sequence.proposal.update(drafted, len(tokens) - 1)
        if sequence.finish_reason is None:
            committed = kept[:len(emitted)]  # a chain's are its first positions; a tree's, its accepted path
            where = slice(0, len(committed)) if verdict.paths is None else from_host(committed, self.device)
            self.proposer.on_commit(row, sequence, verdict.hidden[row, where])
        return emitted

    def move_row(self, source: int, destination: int) -> None:
        """Move the sequence in row `source` to row `destination` (compacting the active rows)."""
        self.cache.move_row(source, destination)
        self.proposer.move_row(source, destination)

    def _append(self, sequence: Sequence, row: int, tokens: list[int]) -> list[int]:
        """Commit tokens and keep the target's cache at the committed prefix. Returns what was emitted."""
        emitted = sequence.append(tokens)
        if sequence.seen is not None:
            sequence.seen[from_host(emitted, sequence.seen.device, torch.long)] = True
        self.cache.rewind(row, sequence.cache_length)
        stats = sequence.stats
        stats.generated_tokens = sequence.generated
        return emitted
