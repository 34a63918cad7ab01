"""Speculation methods (the pipeline's `speculation.method`) → their proposer classes.

A new method is one module with a `Proposer` subclass, its name in `pipeline.Method` and one line here.
"""

from __future__ import annotations

from specdeploy.errors import SpecdeployError
from specdeploy.speculative.draft_model import DraftModelProposer
from specdeploy.speculative.medusa import MedusaProposer
from specdeploy.speculative.ngram import NgramProposer
from specdeploy.speculative.proposer import EngineParts, Proposer

PROPOSERS: dict[str, type[Proposer]] = {
    "none": Proposer,  # plain decode: nothing is ever proposed
    "draft_target": DraftModelProposer,
    "ngram": NgramProposer,
    "medusa": MedusaProposer,
}


def create_proposer(method: str, parts: EngineParts) -> Proposer:
    if method not in PROPOSERS:
        raise SpecdeployError(f"speculation method {method!r} is not supported (allowed: {', '.join(PROPOSERS)})")
    return PROPOSERS[method].from_engine(parts)
