"""Targeted exactness checks of a tree engine's sampled steps, token by token (exactness-5's K test and more).

Seeded generations run in one batch through the engine's own decoder, and every step's tree is recorded. Each
emitted token then gets its exact conditional distribution: the target's, given the prompt and every token emitted
before it (one teacher-forced forward, the repetition penalty over prompt and prefix, then temperature, top-k,
top-p). Where a token was decided is known before it is drawn (the step's tree is fixed before its uniforms, and
the path to the node is the tokens already emitted), so any indicator of that token with a predictable set has an
exact conditional mean, and the sum of (indicator - mean) over all tokens is a martingale: its z-score is
standard normal under the exact rule, whatever the correlations between a generation's steps.

- Impossible tokens: emitted tokens of exact probability 0 (must be none).
- Sibling calibration (at nodes with two or more distinct children): the token is the first child, one of the
  later children, or none of them. Under the exact rule these have probabilities p(first), the sum of p over the
  later children, and the rest, since each emitted token is distributed as p. A rule that tries later children
  against p instead of p with the rejected siblings removed takes them too rarely.
- Penalty calibration (tokens decided below the root, after an accepted node): the token is one already in the
  context (prompt, earlier tokens, the accepted path), or one drafted in another branch of the step's tree. A
  penalty that misses the path's tokens makes the first too frequent (penalty > 1); one that sees other branches'
  tokens (a tree penalised as if it were a chain, without its ancestry) makes the second too rare.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import torch

from specdeploy.decoding.sampling import sampling_distribution
from specdeploy.decoding.sequence import Sequence
from specdeploy.runtime.batch import Verdict
from specdeploy.runtime.engine import Engine
from specdeploy.spec.request import NO_END_ID, GenerationRequest
from specdeploy.spec.sampling_params import SamplingParams
from specdeploy.speculative.proposer import Proposal
from specdeploy.speculative.tree import TreeAcceptance


@dataclass
class Decision:
    """One emitted token and the node it was decided at."""

    row: int  # the generation
    position: int  # its index among the generation's emitted tokens
    token: int
    depth: int  # accepted nodes before it in its step (0: at the root; the prefill's token too)
    children: list[int]  # the node's children's distinct tokens, in the order they are tried
    elsewhere: set[int]  # tokens drafted in the step's other branches: neither on the path to it nor below it


Z_LIMIT = 4.0  # |z| at or above it fails (two-sided p 6e-5 for each of a run's five z-scores)
# The tests' setting: a penalty of 1.5 under top-k 4 moves tokens in and out of the top 4, so a penalty that sees
# the wrong tokens emits tokens of exact probability 0; 300 generations of 30 steps give ~12,000 tokens.
CALIBRATED = SamplingParams(temperature=1.0, top_k=4, repetition_penalty=1.5)
ROWS, STEPS = 300, 30


@dataclass
class Calibration:
    """z-scores of the indicators (observed minus exact mean over their standard deviation), and counts."""

    tokens: int
    impossible: int
    at_siblings: int  # tokens decided at nodes with ≥ 2 children
    z_first: float
    z_later: float
    z_none: float
    below_root: int  # tokens decided after an accepted node
    z_seen: float
    z_elsewhere: float
    accepted: int  # drafted tokens accepted in all

    @property
    def ok(self) -> bool:
        z = (self.z_first, self.z_later, self.z_none, self.z_seen, self.z_elsewhere)
        return self.impossible == 0 and all(abs(value) < Z_LIMIT for value in z)

    def __str__(self) -> str:
        return (f"{self.tokens} tokens, {self.impossible} impossible, {self.accepted} accepted drafts; "
                f"siblings ({self.at_siblings}): z first {self.z_first:+.2f}, later {self.z_later:+.2f}, none "
                f"{self.z_none:+.2f}; penalty ({self.below_root} below the root): z seen {self.z_seen:+.2f}, "
                f"elsewhere in the tree {self.z_elsewhere:+.2f}")


def sampled_decisions(engine: Engine, prompt: list[int], params: SamplingParams, rows: int, steps: int,
                      first_seed: int = 0) -> tuple[list[list[int]], list[Decision]]:
    """`rows` generations seeded first_seed, first_seed + 1, ... stepped together `steps` times by the engine's
    decoder (engine: of at least `rows` cache rows): each generation's emitted tokens, and every token's decision."""
    max_tokens = steps * (engine.num_draft_tokens + 1) + 2  # never reached: no step's gamma is cut
    sequences = []
    for row in range(rows):
        seeded = SamplingParams(temperature=params.temperature, top_k=params.top_k, top_p=params.top_p,
                                repetition_penalty=params.repetition_penalty, seed=first_seed + row)
        sequences.append(engine.new_sequence(GenerationRequest(prompt, max_tokens, seeded, None, end_id=NO_END_ID)))
    decoder = engine.decoder
    emitted = [decoder.prefill(sequence, row) for row, sequence in enumerate(sequences)]
    decisions = [Decision(row, 0, tokens[0], 0, [], set()) for row, tokens in enumerate(emitted)]
    verified: list = []  # the step's proposal and verdict

    def recording(batch: list[Sequence], proposal: Proposal) -> Verdict:
        verdict = verify(batch, proposal)
        verified[:] = [proposal, verdict]
        return verdict

    verify, decoder.verify = decoder.verify, recording
    try:
        for _ in range(steps):
            step = decoder.step(sequences)
            proposal, verdict = verified
            for row in range(rows):
                assert len(step[row]) == len(verdict.tokens[row])  # nothing cut: every verified token was emitted
                decisions += _step_decisions(row, len(emitted[row]), proposal, verdict)
                emitted[row] += step[row]
    finally:
        del decoder.verify  # the class's own again
    return emitted, decisions


def _step_decisions(row: int, start: int, proposal: Proposal, verdict: Verdict) -> list[Decision]:
    """Where each token row `row` emitted at one step was decided; start: the tokens it emitted before."""
    count = proposal.counts[row]
    parents = proposal.tree.parents[row] if count else []
    tokens = proposal.tokens[row, :count].tolist()
    path = verdict.kept(row)  # verify indices: the root, then the accepted nodes
    decisions = []
    for depth, (node, token) in enumerate(zip(path, verdict.tokens[row])):
        below = {node}  # the node and its descendants (parents come before children)
        for index, parent in enumerate(parents, start=1):
            if parent in below:
                below.add(index)
        children = list(dict.fromkeys(t for t, parent in zip(tokens, parents) if parent == node))
        elsewhere = {t for index, t in enumerate(tokens, start=1) if index not in below and index not in path[:depth]}
        decisions.append(Decision(row, start + depth, token, depth, children, elsewhere))
    return decisions


def exact_conditionals(engine: Engine, prompt: list[int], params: SamplingParams,
                       emitted: list[list[int]]) -> list[torch.Tensor]:
    """Each generation's exact distribution of each emitted token given everything before it: [n_r, V] float64."""
    target, vocab = engine.target, engine.vocab_size
    longest = max(len(tokens) for tokens in emitted)
    width = len(prompt) + longest
    sequences = torch.tensor([prompt + tokens + [0] * (longest - len(tokens)) for tokens in emitted])
    cache = target.new_cache(len(emitted), width + 1)
    with torch.inference_mode():
        hidden = target(sequences, torch.arange(width)[None].expand(len(emitted), -1), cache).hidden
        logits = target.logits(hidden[:, len(prompt) - 1:-1]).float()  # [R, longest, V]: before each emitted token
    conditionals = []
    for row, tokens in enumerate(emitted):
        seen = torch.zeros(len(tokens), vocab, dtype=torch.bool)
        seen[:, prompt] = True
        for position in range(1, len(tokens)):
            seen[position] = seen[position - 1]
            seen[position, tokens[position - 1]] = True
        conditionals.append(sampling_distribution(logits[row, :len(tokens)], params, seen).double())
    return conditionals


def calibration(engine_dir: str | Path, prompt: list[int], tree_rule: Callable[..., TreeAcceptance] | None = None,
                params: SamplingParams = CALIBRATED, rows: int = ROWS, steps: int = STEPS,
                first_seed: int = 0) -> Calibration:
    """Sample `rows` generations for `steps` steps on a fresh engine (`sampled_decisions`; tree_rule: another
    rule than the engine's for its sampled rows) and check every token against its exact conditional distribution.
    One torch thread: the ops are on tiny tensors, and on a loaded machine threads cost far more than they give."""
    threads = torch.get_num_threads()
    try:
        engine = Engine(engine_dir, batch_size=rows)
        torch.set_num_threads(1)
        if tree_rule is not None:
            engine.decoder.tree_rule = tree_rule
        emitted, decisions = sampled_decisions(engine, prompt, params, rows, steps, first_seed)
        conditionals = exact_conditionals(engine, prompt, params, emitted)
    finally:
        torch.set_num_threads(threads)
    impossible = 0
    siblings = _Martingales(3)
    penalty = _Martingales(2)
    for decision in decisions:
        p = conditionals[decision.row][decision.position]
        impossible += int(p[decision.token] == 0)
        if len(decision.children) >= 2:
            first, later = decision.children[0], decision.children[1:]
            is_first, is_later = decision.token == first, decision.token in later
            mass_first, mass_later = float(p[first]), float(p[later].sum())
            siblings.add([is_first, is_later, not (is_first or is_later)],
                         [mass_first, mass_later, 1.0 - mass_first - mass_later])
        if decision.depth >= 1:
            context = set(prompt) | set(emitted[decision.row][:decision.position])
            elsewhere = sorted(decision.elsewhere - context)
            penalty.add([decision.token in context, decision.token in elsewhere],
                        [float(p[sorted(context)].sum()), float(p[elsewhere].sum())])
    accepted = sum(decision.depth >= 1 for decision in decisions)
    return Calibration(len(decisions), impossible, siblings.count, *siblings.z(), penalty.count, *penalty.z(),
                       accepted)


class _Martingales:
    """Sums of indicator - exact mean and of the means' variances, for several indicators at once."""

    def __init__(self, size: int) -> None:
        self.count = 0
        self.deviation = [0.0] * size
        self.variance = [0.0] * size

    def add(self, indicators: list[bool], means: list[float]) -> None:
        self.count += 1
        for i, (indicator, mean) in enumerate(zip(indicators, means)):
            mean = min(max(mean, 0.0), 1.0)
            self.deviation[i] += float(indicator) - mean
            self.variance[i] += mean * (1.0 - mean)

    def z(self) -> list[float]:
        return [d / math.sqrt(v) if v > 0 else 0.0 for d, v in zip(self.deviation, self.variance)]
