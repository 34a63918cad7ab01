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

from specdeploy.decoding.draft_length import ProposalLength
from specdeploy.decoding.sampling import (
    RowStreams,
    penalised,
    request_generator,
    sample,
    sampling_distribution,
    seen_after_drafts,
    seen_mask,
)
from specdeploy.decoding.sequence import Sequence
from specdeploy.errors import SpecdeployError
from specdeploy.models.device_transfer import PhaseClock, from_host
from specdeploy.models.kv_cache import KVCache
from specdeploy.models.llama import LlamaModel, ragged_forward_all, tree_forward_all
from specdeploy.models.reductions import argmax
from specdeploy.spec.pipeline import Acceptance, Schedule
from specdeploy.spec.request import GenerationRequest
from specdeploy.speculative.acceptance import AcceptanceResult, accept, accept_greedy
from specdeploy.speculative.proposer import Proposal, Proposer
from specdeploy.speculative.tree import TreeAcceptance, accept_tree, accept_tree_greedy, accept_tree_typical


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
    and the target's hidden states of the verified positions [B, W, H]. A chain keeps row r's first
    len(tokens[r]) positions; a tree keeps the verify indices in paths[r] (the root, then the accepted nodes)."""

    tokens: list[list[int]]
    hidden: torch.Tensor
    paths: list[list[int]] | None = None

    def kept(self, row: int) -> list[int]:
        """The verify indices of row `row` whose tokens were committed (in order)."""
        return list(range(len(self.tokens[row]))) if self.paths is None else self.paths[row]


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

    def new_sequence(self, request: GenerationRequest, gamma: int, schedule: Schedule,
                     end_ids: frozenset[int]) -> Sequence:
        """A sequence for a checked request, ready for prefill. end_ids: the model's end tokens (the request's
        end_id replaces them)."""
        params = request.sampling
        penalised_request = params.repetition_penalty != 1.0
        return Sequence.for_request(request, ProposalLength(schedule, gamma), end_ids,
                                    generator=request_generator(params, self.device),
                                    seen=seen_mask(request.prompt_ids, self.vocab_size, self.device)
                                    if penalised_request else None)

    def prefill(self, sequence: Sequence, row: int) -> list[int]:
        """Run the prompt into cache row `row` and commit the first token. Returns the emitted tokens."""
        started = time.perf_counter()
        prompt = sequence.committed
        with torch.inference_mode():
            view = self.cache.rows(row, row + 1)
            view.lengths[0] = 0
            hidden = self.target(from_host([prompt], self.device),
                                 torch.arange(len(prompt), device=self.device)[None], view)[0]  # [T, H]
            logits = self.target.logits(hidden[-1:])
            probs = sampling_distribution(logits, sequence.params,
                                          None if sequence.seen is None else sequence.seen[None])
            first = read_checked(sample(probs, sequence.generator), logits)
            emitted = self._append(sequence, row, first)
            if sequence.finish_reason is None:
                self.proposer.prefill(row, sequence, hidden)
        sequence.stats.prefill_seconds = time.perf_counter() - started
        return emitted

    def step(self, sequences: list[Sequence], caps: list[int] | None = None) -> list[list[int]]:
        """One decode step for rows 0..B-1. caps[r] caps row r's proposal (default: its schedule's length).
        Returns the tokens each row emitted."""
        gammas = [self._gamma(s, None if caps is None else caps[r]) for r, s in enumerate(sequences)]
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
        """One target forward over every row's pending token + drafted tokens (a chain, or a tree under a tree
        attention mask), then the exact rule for all rows."""
        batch, counts, tree = len(sequences), proposal.counts, proposal.tree
        width = max(counts) + 1
        pending = from_host([[s.committed[-1]] for s in sequences], self.device)
        tokens = torch.cat([pending, proposal.tokens[:, :width - 1]], dim=1)  # [B, W]
        starts = [s.cache_length for s in sequences]
        ancestry = None if tree is None else from_host(tree.ancestry, self.device)[:width, :width]
        if tree is None:
            hidden = ragged_forward_all(self.target, self.cache.rows(0, batch), tokens, starts)  # [B, W, H]
        else:
            hidden = tree_forward_all(self.target, self.cache.rows(0, batch), tokens, starts, tree.depths(),
                                      ancestry)
        # Logits only at each row's real positions (row r's are flat[offsets[r]:offsets[r + 1]]): the vocabulary
        # projection is a fifth of a forward here.
        offsets = [0]
        for count in counts:
            offsets.append(offsets[-1] + count + 1)
        if offsets[-1] == batch * width:  # every row verifies W positions
            real = hidden.reshape(batch * width, -1)
        else:
            real = hidden[from_host([r for r in range(batch) for _ in range(counts[r] + 1)], self.device),
                          from_host([c for r in range(batch) for c in range(counts[r] + 1)], self.device)]
        logits = self._penalised(sequences, proposal, offsets, self.target.logits(real), ancestry)  # [N, V] fp32
        num_drafted = from_host(counts, self.device)
        greedy = [r for r, s in enumerate(sequences) if s.params.greedy]
        sampled = [r for r, s in enumerate(sequences) if not s.params.greedy]
        # Row lists index device tensors as device tensors: a Python list would be copied over with a host sync.
        greedy_rows, sampled_rows = from_host(greedy, self.device, torch.long), from_host(sampled, self.device,
                                                                                           torch.long)
        outcomes = []  # (rows, [len(rows), W + 1]: the emitted tokens, then the accepted count)
        if greedy:  # the logits are final (penalties applied): each position's target token is their argmax
            if len(greedy) == batch and offsets[-1] == batch * width:
                target_tokens = argmax(logits).view(batch, width)
            else:
                places = [(i, c, offsets[r] + c) for i, r in enumerate(greedy) for c in range(counts[r] + 1)]
                target_tokens = torch.zeros(len(greedy), width, dtype=torch.long, device=self.device)
                at_row, at_column, flat = (from_host(list(column), self.device) for column in zip(*places))
                target_tokens[at_row, at_column] = argmax(logits[flat])
            if tree is None:
                result = accept_greedy(tokens[greedy_rows, 1:], target_tokens, num_drafted[greedy_rows])
            else:
                result = accept_tree_greedy(tree, tokens[greedy_rows, 1:], target_tokens, num_drafted[greedy_rows])
            outcomes.append((greedy_rows, outcome_rows(result)))
        if sampled:
            target_probs = torch.zeros(len(sampled), width, self.vocab_size, device=self.device)
            for i, r in enumerate(sampled):
                target_probs[i, :counts[r] + 1] = sampling_distribution(logits[offsets[r]:offsets[r + 1]],
                                                                        sequences[r].params)
            draft_probs = None if proposal.q is None else proposal.q[sampled_rows, :width - 1]
            streams = RowStreams([sequences[r].generator for r in sampled], [counts[r] for r in sampled])
            if tree is None:
                result = accept(tokens[sampled_rows, 1:], draft_probs, target_probs, num_drafted[sampled_rows],
                                streams)
            else:
                result = self.tree_rule(tree, tokens[sampled_rows, 1:], target_probs, num_drafted[sampled_rows],
                                        streams)
            outcomes.append((sampled_rows, outcome_rows(result)))
        if len(outcomes) == 1:
            outcome = outcomes[0][1]  # one kind of row, already in row order
        else:
            outcome = torch.empty(batch, outcomes[0][1].shape[1], dtype=torch.long, device=self.device)
            for rows, part in outcomes:
                outcome[rows] = part
        read = read_checked(outcome, logits)  # the step's one host sync
        if tree is None:
            return Verdict([row[1:row[0] + 2] for row in read], hidden)
        depth = (len(read[0]) - 2) // 2
        return Verdict([row[1:row[0] + 2] for row in read], hidden,
                       [[0] + row[depth + 2:depth + 2 + row[0]] for row in read])

    def _penalised(self, sequences: list[Sequence], proposal: Proposal, offsets: list[int],
                   logits: torch.Tensor, ancestry: torch.Tensor | None) -> torch.Tensor:
        """Apply each penalised row's repetition penalty to its verified positions (each position has seen the
        context and the drafted tokens before it: in a tree, its ancestors'), so greedy and sampled rows then work
        on final logits."""
        for r, sequence in enumerate(sequences):
            if sequence.seen is not None:
                count = proposal.counts[r]
                context = seen_after_drafts(sequence.seen, proposal.tokens[r, :count],
                                            None if ancestry is None else ancestry[:count + 1, :count + 1])
                logits[offsets[r]:offsets[r + 1]] = penalised(logits[offsets[r]:offsets[r + 1]], sequence.params,
                                                              context)
        return logits

    def commit(self, sequence: Sequence, row: int, drafted: int, verdict: Verdict,
               positions: int | None = None) -> list[int]:
        """Append row `row`'s verified tokens; statistics count only what was committed. positions: how many
        successive positions were proposed (default drafted; a tree's depth)."""
        tokens, kept = verdict.tokens[row], verdict.kept(row)
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

    def _gamma(self, sequence: Sequence, cap: int | None) -> int:
        gamma = sequence.proposal.current if cap is None else min(cap, sequence.proposal.current)
        return max(0, min(gamma, sequence.remaining - 1, self.max_length - len(sequence.committed)))

    def _append(self, sequence: Sequence, row: int, tokens: list[int]) -> list[int]:
        """Commit tokens and keep the target's cache at the committed prefix. Returns what was emitted."""
        emitted = sequence.append(tokens)
        if sequence.seen is not None:
            sequence.seen[from_host(emitted, sequence.seen.device, torch.long)] = True
        self.cache.rewind(row, sequence.cache_length)
        stats = sequence.stats
        stats.generated_tokens = sequence.generated
        if sequence.finish_reason:
            stats.finish_reason = sequence.finish_reason
        return emitted
