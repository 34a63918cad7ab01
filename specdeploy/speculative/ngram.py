"""Prompt lookup (n-gram) proposer: no draft model, so its cost ratio c is essentially zero.

The drafts come from decoding/prompt_lookup.py (the trtllm flavour drafts the same way); q is one-hot on each
proposed token.
"""

from __future__ import annotations

from specdeploy.decoding.prompt_lookup import prompt_lookup
from specdeploy.decoding.sequence import Sequence
from specdeploy.speculative.proposer import EngineParts, Proposal, Proposer


class NgramProposer(Proposer):
    def __init__(self, min_n: int, max_n: int, device: str = "cpu") -> None:
        self.min_n, self.max_n, self.device = min_n, max_n, device

    @classmethod
    def from_engine(cls, parts: EngineParts) -> NgramProposer:
        ngram = parts.pipeline.speculation.ngram
        return cls(ngram.min_n, ngram.max_n, parts.device)

    def propose(self, sequences: list[Sequence], gammas: list[int]) -> Proposal:
        proposals = [prompt_lookup(s.committed, g, self.min_n, self.max_n) for s, g in zip(sequences, gammas)]
        return Proposal.from_lists(proposals, self.device)
