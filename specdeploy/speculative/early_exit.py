"""Early-exit self-speculation: the target's first L layers, its final norm and its head draft a chain.

The draft is a view of the target, not a second model: a draft forward runs layers 0..L-1 of the target on the
pending or last drafted token, writing those layers' keys and values into the target's own cache at the token's
slot, then the final norm and the head's rows of a draft vocabulary (the most frequent tokens, engine file
EARLY_EXIT_FILE) give the draft's distribution. That is the cache's second bookkeeping path (models/kv_cache.py):
after drafting, layers < L hold entries up to the last drafted token while layers ≥ L hold only the committed
prefix.

The verify forward does not run layers < L again: the draft keeps the hidden states entering layer L at every
position it ran (the pending token, then each drafted token, the last one fed once more without its head), and the
target resumes there (`Proposal.resume`), writing layers ≥ L at the same slots. A rejection rewinds the row's
length, which covers both paths: every entry past the committed prefix, in every layer, is overwritten before
anything attends to it. Exactness does not depend on L: q is the early exit's distribution, and the chain rule
corrects for it.

With an adapter (speculative/exit_adapter.py, speculation.early_exit.adapter), the draft's logits come from the
final norm and head over adapter(raw states); the states kept for the verify stay the raw ones, so the adapter
changes q and never p.
"""

from __future__ import annotations

from pathlib import Path

import torch

from specdeploy.decoding.sequence import Sequence
from specdeploy.errors import SpecdeployError
from specdeploy.models.device_transfer import from_host
from specdeploy.models.kv_cache import KVCache
from specdeploy.models.llama import Forward, LayerSpan, LlamaModel
from specdeploy.speculative.draft_model import DraftModelProposer
from specdeploy.speculative.draft_vocabulary import VocabularyHead, read_vocabulary_file
from specdeploy.speculative.exit_adapter import ADAPTER_DIR, ExitAdapter, target_name
from specdeploy.speculative.proposer import EngineParts, Proposal

EARLY_EXIT_FILE = "early_exit.json"  # in the engine: {"draft_vocab": [ids], "source": how they were counted}


def read_early_exit(engine_dir: Path) -> list[int]:
    """The engine's early-exit draft vocabulary; an error saying how to get it when it is missing."""
    return read_vocabulary_file(Path(engine_dir) / EARLY_EXIT_FILE, "an early_exit build")


class EarlyExitDraft:
    """The target's first `exit_layer` layers as a draft model, with the interface the draft-model proposer calls
    (config, embed, a forward, logits). Each forward keeps the raw hidden states entering layer `exit_layer`
    ([B, T, H]) in `states`, which the proposer hands to the verify."""

    def __init__(self, target: LlamaModel, exit_layer: int, draft_ids: torch.Tensor,
                 adapter: ExitAdapter | None = None) -> None:
        """draft_ids: the target ids the draft's head covers [Vd] long (every id: the whole head). adapter: applied
        to the raw states before the final norm (its parameters in the target's dtype and device); None: the plain
        early exit."""
        if not 1 <= exit_layer < target.config.num_layers:
            raise SpecdeployError(f"speculation.early_exit.exit_layer: {exit_layer} is not a layer count below the "
                                  f"target's {target.config.num_layers} layers")
        self.target, self.exit_layer = target, exit_layer
        self.config, self.embed = target.config, target.embed
        self.head = VocabularyHead(target, draft_ids, "speculation.early_exit.draft_vocab")
        self.adapter = adapter
        self.states: list[torch.Tensor] = []

    def __call__(self, tokens: torch.Tensor, positions: torch.Tensor, cache: KVCache,
                 row_lengths: list[int] | None = None, span: LayerSpan | None = None,
                 capture: tuple[int, ...] = ()) -> Forward:
        """Layers 0..exit_layer-1 over tokens [B, T] at positions [B, T]; returns the normed states [B, T, H] (of the
        adapted states, with an adapter). `states` keeps the raw ones: the verify resumes from the target's own.
        A draft forward is always the whole draft (no span) and captures nothing."""
        if span is not None or capture:
            raise ValueError("an early exit's draft runs its layers whole and captures nothing")
        raw = self.target(tokens, positions, cache, row_lengths=row_lengths,
                          span=LayerSpan(stop=self.exit_layer)).hidden
        self.states.append(raw)
        return Forward(self.target.norm(raw if self.adapter is None else self.adapter(raw)))

    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """hidden: [B, H] → fp32 logits [B, V], -inf outside the draft vocabulary."""
        return self.head(hidden)


def engine_adapter(parts: EngineParts, exit_layer: int) -> ExitAdapter:
    """The engine's exit adapter (its ADAPTER_DIR folder), checked against its target and `exit_layer`, in the
    target's dtype on its device, frozen."""
    config = parts.target.config
    adapter = ExitAdapter.load(parts.directory / ADAPTER_DIR, target_name(parts.pipeline.target.checkpoint),
                               config.num_layers, config.hidden_size, exit_layer)
    return adapter.to(parts.device, parts.target.dtype).requires_grad_(False).eval()


class EarlyExitProposer(DraftModelProposer):
    """Drafts a chain with the target's early layers (see the module docstring); shares the target's cache."""

    model: EarlyExitDraft

    @classmethod
    def from_engine(cls, parts: EngineParts) -> EarlyExitProposer:
        exit_layer = parts.pipeline.speculation.early_exit.exit_layer
        if exit_layer == "measured":
            raise SpecdeployError(f"{parts.directory}: speculation.early_exit.exit_layer is 'measured' and this "
                                  f"engine has no measurement yet (specdeploy build measures it)")
        ids = from_host(read_early_exit(parts.directory), parts.device, torch.long)
        adapter = engine_adapter(parts, exit_layer) if parts.pipeline.speculation.early_exit.adapter else None
        return cls(EarlyExitDraft(parts.target, exit_layer, ids, adapter), parts.cache, shared=True,
                   early_stop_threshold=0.0)

    def stepped_models(self) -> list:
        return []  # the draft's forwards are the target's own layers

    def prefill(self, row: int, sequence: Sequence, hidden: torch.Tensor) -> None:
        pass  # the prompt's entries are the target's, in every layer

    def propose(self, sequences: list[Sequence], gammas: list[int]) -> Proposal:
        """The draft-model chain, then the last drafted token through the early layers (its head unused), so the
        verify finds every position's state entering the exit layer: Proposal.resume [B, W, H]."""
        self.model.states = []
        proposal = super().propose(sequences, gammas)
        width = len(self.model.states)  # positions fed: the pending token and drafted tokens 1..width-1
        starts = from_host([s.cache_length + width for s in sequences], self.device)[:, None]
        cache = self.cache.rows(0, len(sequences))
        cache.lengths = [s.cache_length + width for s in sequences]
        self.model(proposal.tokens[:, width - 1:width], starts, cache, row_lengths=[1] * len(sequences))
        self.forwards += 1
        proposal.resume = LayerSpan(start=self.model.exit_layer, entering=torch.cat(self.model.states, dim=1))
        self.model.states = []
        return proposal
