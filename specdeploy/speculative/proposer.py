"""The proposer interface: what the batch decoder asks of every speculation method.

The decoder steps the sequences in cache rows 0..B-1 together. For each row a proposer sees, in order:
- `prefill(row, sequence, hidden)` once the target has run the prompt into that row;
- `propose(sequences, gammas)` before each verification: up to gammas[r] tokens for row r;
- `on_commit(row, sequence, hidden)` after each verification committed tokens to the row;
- `move_row(source, destination)` when the scheduler moves a sequence to another row.
`hidden` is the target's final hidden states [n, H] at the positions just committed to the target's cache (the
prompt at prefill; the pending token and the accepted drafts after a step), or, for a proposer that captures
layers (`capture`), the states entering them [n, len(capture) * H]. Its last row is the state whose
logits chose the new pending token, which is what a head-based proposer (Medusa) drafts from.

A proposer keeps whatever per-row state it needs (a draft model's own KV cache, for one) and is built from the
engine it serves by `from_engine`; speculative/registry.py maps each pipeline method to its class.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

import torch

from specdeploy.decoding.sequence import Sequence
from specdeploy.models.device_transfer import from_host
from specdeploy.models.kv_cache import KVCache
from specdeploy.spec.pipeline import PipelineSpec
from specdeploy.speculative.row_trees import RowTrees

if TYPE_CHECKING:
    from specdeploy.models.llama import LayerSpan, LlamaModel


@dataclass
class Proposal:
    """Drafted tokens: a chain per row (each token follows the one before), or with `tree` the nodes of a token
    tree per row (row r proposes counts[r] nodes, each following its parent: tree.parents[r])."""

    tokens: torch.Tensor  # [B, G] long: row r's drafted tokens in tokens[r, :counts[r]], scratch after them
    q: torch.Tensor | None  # [B, G, V] the distributions they were sampled from; None: point masses on `tokens`
    counts: list[int]  # [B] tokens drafted per row
    tree: RowTrees | None = None  # the shape of each row's tree proposal (q is then None)
    # the target's layers before resume.start already ran over the W verified positions while drafting (early
    # exit), so the verify resumes there from the states entering it (resume.entering [B, W, H])
    resume: LayerSpan | None = None

    def positions(self, row: int) -> int:
        """How many successive positions row `row` proposes: its drafted tokens, or its tree nodes' deepest depth."""
        if self.tree is None:
            return self.counts[row]
        return self.tree.max_depth(row)

    @staticmethod
    def empty(batch: int, device: torch.device | str) -> Proposal:
        return Proposal(torch.zeros(batch, 0, dtype=torch.long, device=device), None, [0] * batch)

    @staticmethod
    def from_lists(proposals: list[list[int]], device: torch.device | str) -> Proposal:
        """Token-list proposals (q one-hot on each), padded into one tensor."""
        width = max([len(p) for p in proposals] + [0])
        tokens = from_host([p + [0] * (width - len(p)) for p in proposals], device,
                           torch.long).reshape(len(proposals), width)
        return Proposal(tokens, None, [len(p) for p in proposals])


@dataclass
class EngineParts:
    """What an engine offers a proposer it builds: its directory, pipeline, target model and the target's cache."""

    directory: Path
    pipeline: PipelineSpec
    target: LlamaModel
    cache: KVCache
    device: str
    unpacked: frozenset[str] = frozenset()  # components whose weights stay unpacked (a compiled step reads them)


class Proposer:
    """Base class: every hook is a no-op and nothing is proposed. `forwards` counts draft-model forwards.
    reads_guesses: the proposer is handed the target's argmax at every verified position (`observe`), read in the
    step's one host read (lookahead's Jacobi guesses). capture: the target layers whose entering hidden states the
    proposer reads, side by side, instead of the final ones (EAGLE-3's three); every target forward of a step
    returns them (LlamaModel.forward's capture)."""

    forwards: int = 0
    reads_guesses: bool = False
    capture: tuple[int, ...] = ()

    @classmethod
    def from_engine(cls, parts: EngineParts) -> Proposer:
        return cls()

    @classmethod
    def captured_layers(cls, directory: Path) -> tuple[int, ...]:
        """What `capture` will be for the engine at `directory`, read without building the proposer."""
        return cls.capture

    def prefill(self, row: int, sequence: Sequence, hidden: torch.Tensor) -> None:
        pass

    def stepped_models(self) -> list[tuple[LlamaModel, KVCache]]:
        """The models this proposer runs a forward of at every step, each with the cache it runs on (what compiled
        steps compile besides the target)."""
        return []

    def propose(self, sequences: list[Sequence], gammas: list[int]) -> Proposal:
        return Proposal.empty(len(sequences), "cpu")

    def observe(self, row: int, guesses: list[int]) -> None:
        """With reads_guesses: the target's argmax at each of row `row`'s verify indices (0: its pending token), the
        step's final logits (penalties applied), before `on_commit`."""

    def on_commit(self, row: int, sequence: Sequence, hidden: torch.Tensor) -> None:
        pass

    def move_row(self, source: int, destination: int) -> None:
        pass
