"""Lookahead decoding: the target guesses ahead in its own verify forward, and verifies n-grams pooled from those
guesses, with TensorRT-LLM's parameters W (window), N (n-gram) and G (verification set).

Per row, as TensorRT-LLM's lookahead layer keeps it (cpp/tensorrt_llm/layers/lookaheadAlgorithm.cpp; facts and
commits in docs/lookahead.md):
- a window of W rows of N - 1 levels: row j holds guesses for the positions after the pending token g (the
  golden token, at position p): row j's level k sits at p + j + k. Row 0's level 0 is g itself. Each row is a chain
  (level k follows level k - 1) and the rows' level-0 tokens form a chain along the window, so the window is a
  token tree below g: (N - 2) + (W - 1)(N - 1) nodes;
- a pool of n-grams keyed by their first token, at most G per key, the oldest evicted (re-inserting one moves it to
  the newest), seeded with the prompt's n-grams;
- up to G of the pool's n-grams keyed by g, its newest first: each a chain of N - 1 tokens below g.
All of these are nodes of one token tree (identical prefixes merged), verified in one target forward under the
tree mask by the exact tree rule: every node is a deterministic proposal, so recursive rejection over siblings
keeps each emitted token distributed as the target's at any temperature (TensorRT-LLM's own lookahead verifies
greedily and takes every request greedy, whatever its sampling: serve/ and build/trtllm/ refuse sampled lookahead).

After the verify, the target's argmax at each window node is its Jacobi guess for the next position: during the
first N - 2 steps each row grows one level from its last level's guess; after that each row drops its first token,
shifts, appends its last level's guess, and the pool takes the n-gram (dropped token + new row). The window moves
one column per step whatever was accepted. The committed text's own n-grams go into the pool too.
"""

from __future__ import annotations

import random
from collections import OrderedDict
from dataclasses import dataclass, field

import torch

from specdeploy.decoding.sequence import Sequence
from specdeploy.spec.speculation import LookaheadSpec
from specdeploy.speculative.proposer import EngineParts, Proposal, Proposer
from specdeploy.speculative.row_trees import RowTrees


class NgramPool:
    """n-grams keyed by their first token: the N - 1 tokens after it, at most `per_key` per key, oldest first."""

    def __init__(self, ngram: int, per_key: int) -> None:
        self.ngram, self.per_key = ngram, per_key
        self.entries: dict[int, OrderedDict[tuple[int, ...], None]] = {}

    def insert(self, key: int, following: tuple[int, ...]) -> None:
        if self.per_key == 0 or len(following) != self.ngram - 1:
            return
        kept = self.entries.setdefault(key, OrderedDict())
        kept.pop(following, None)  # a repeat moves to the newest
        if len(kept) >= self.per_key:
            kept.popitem(last=False)
        kept[following] = None

    def insert_text(self, tokens: list[int], first_end: int = 0) -> None:
        """Every n-gram of `tokens` whose last token's index is ≥ first_end."""
        for end in range(max(first_end, self.ngram - 1), len(tokens)):
            start = end - self.ngram + 1
            self.insert(tokens[start], tuple(tokens[start + 1:end + 1]))

    def guesses(self, key: int, count: int) -> list[tuple[int, ...]]:
        """Up to `count` n-grams keyed by `key`, newest first."""
        return list(reversed(self.entries.get(key, {})))[:count]


@dataclass
class RowState:
    """One sequence's window (rows[j][k]: row j's level k; row 0's level 0 stands for the golden token), how many
    levels are filled, its pool, how much of its text the pool has seen, and where the last proposal put each
    window cell (verify index by (j, k))."""

    rows: list[list[int]]
    filled: int
    pool: NgramPool
    pooled_upto: int
    placed: dict[tuple[int, int], int] = field(default_factory=dict)


class TreeBuilder:
    """One row's token tree: nodes (token, parent verify index), identical children of one parent merged."""

    def __init__(self, depth_cap: int) -> None:
        self.tokens: list[int] = []
        self.parents: list[int] = []
        self.depths = [0]
        self.children: dict[tuple[int, int], int] = {}
        self.depth_cap = depth_cap

    def add(self, parent: int, token: int) -> int | None:
        """The verify index of `token` below verify index `parent` (added unless present); None past the cap."""
        if parent is None or self.depths[parent] + 1 > self.depth_cap:
            return None
        index = self.children.get((parent, token))
        if index is None:
            self.tokens.append(token)
            self.parents.append(parent)
            self.depths.append(self.depths[parent] + 1)
            index = self.children[(parent, token)] = len(self.tokens)
        return index

    def chain(self, tokens: tuple[int, ...] | list[int]) -> None:
        parent = 0
        for token in tokens:
            parent = self.add(parent, token)
            if parent is None:
                return


class LookaheadProposer(Proposer):
    """Lookahead decoding's proposals (see the module docstring); reads the target's argmax at every verified node
    (`reads_guesses`), which the decoder returns in the step's one host read."""

    reads_guesses = True

    def __init__(self, spec: LookaheadSpec, device: torch.device | str) -> None:
        self.window, self.ngram, self.verification_set = spec.window, spec.ngram, spec.verification_set
        self.device = device
        self.states: dict[int, RowState] = {}

    @classmethod
    def from_engine(cls, parts: EngineParts) -> LookaheadProposer:
        return cls(parts.pipeline.speculation.lookahead, parts.device)

    def prefill(self, row: int, sequence: Sequence, hidden: torch.Tensor) -> None:
        """A fresh window, its level 0 drawn from the prompt (seeded by the prompt, so a run repeats), and the pool
        seeded with the prompt's n-grams."""
        prompt = sequence.committed[:-1] or sequence.committed
        chooser = random.Random(len(prompt) * 1_000_003 + prompt[-1])
        rows = [[sequence.committed[-1]]] + [[chooser.choice(prompt)] for _ in range(self.window - 1)]
        pool = NgramPool(self.ngram, self.verification_set)
        pool.insert_text(sequence.committed)
        self.states[row] = RowState(rows, 1, pool, len(sequence.committed))

    def propose(self, sequences: list[Sequence], gammas: list[int]) -> Proposal:
        """Each row's window and its pool's guesses for its pending token, as one tree per row, at most gammas[r]
        deep (0: nothing)."""
        rows_tokens, rows_parents = [], []
        for row, (sequence, gamma) in enumerate(zip(sequences, gammas)):
            state = self.states[row]
            golden = sequence.committed[-1]
            state.rows[0][0] = golden
            tree = TreeBuilder(gamma)
            state.placed = {}
            if gamma > 0:
                self._place_window(state, tree)
                for guess in state.pool.guesses(golden, self.verification_set):
                    tree.chain(guess)
            rows_tokens.append(tree.tokens)
            rows_parents.append(tree.parents)
        proposal = Proposal.from_lists(rows_tokens, self.device)
        proposal.tree = RowTrees(rows_parents)
        return proposal

    def _place_window(self, state: RowState, tree: TreeBuilder) -> None:
        """Row 0's levels 1.. below the golden token; row j ≥ 1's level 0 below row j - 1's level 0 (row 1's below
        the golden token), its level k below its level k - 1."""
        state.placed[(0, 0)] = 0
        spine = 0
        for j, levels in enumerate(state.rows):
            for k in range(state.filled):
                if j == 0 and k == 0:
                    continue
                parent = state.placed.get((j, k - 1)) if k > 0 else spine
                index = tree.add(parent, levels[k])
                if index is None:
                    break
                state.placed[(j, k)] = index
                if k == 0:
                    spine = index

    def observe(self, row: int, guesses: list[int]) -> None:
        """The target's argmax at each of the row's verify indices (0: the golden token): the window's Jacobi step.
        A row whose last level was not verified (the tree was cut by the step's gamma) stays as it is."""
        state = self.states.get(row)
        if state is None or not state.placed:
            return
        last = state.filled - 1
        for j, levels in enumerate(state.rows):
            index = state.placed.get((j, last))
            if index is None or index >= len(guesses):
                continue
            guess = guesses[index]
            if state.filled < self.ngram - 1:
                levels.append(guess)
            else:
                state.pool.insert(levels[0], tuple(levels[1:]) + (guess,))
                levels[:] = levels[1:] + [guess]
        if state.filled < self.ngram - 1 and all(len(levels) > state.filled for levels in state.rows):
            state.filled += 1
        for levels in state.rows:  # rows cut short by a gamma stay at the filled levels
            del levels[state.filled:]

    def on_commit(self, row: int, sequence: Sequence, hidden: torch.Tensor) -> None:
        """The committed text's new n-grams into the pool."""
        state = self.states[row]
        state.pool.insert_text(sequence.committed, state.pooled_upto)
        state.pooled_upto = len(sequence.committed)

    def move_row(self, source: int, destination: int) -> None:
        """The scheduler also moves a row admitted but not prefilled yet (another left at its prefill or was
        cancelled in the same iteration): such a row has no state, and neither has its destination after the move."""
        state = self.states.pop(source, None)
        if state is None:
            self.states.pop(destination, None)
        else:
            self.states[destination] = state
