"""Speculation methods (the pipeline's `speculation.method`) → their proposer classes.

A method is its row in spec/speculation.py's `METHODS` (the data the build, the servers and the sizing loop over),
its proposer module here in speculative/, and one line below; docs/architecture.md ("Adding a speculation method")
lists what else a method with trained parts, its own bench analysis or a TensorRT-LLM recipe touches.
"""

from __future__ import annotations

from pathlib import Path

from specdeploy.errors import SpecdeployError
from specdeploy.spec.pipeline import PipelineSpec
from specdeploy.speculative.draft_model import DraftModelProposer
from specdeploy.speculative.eagle import EagleProposer
from specdeploy.speculative.early_exit import EarlyExitProposer
from specdeploy.speculative.lookahead import LookaheadProposer
from specdeploy.speculative.medusa import MedusaProposer
from specdeploy.speculative.ngram import NgramProposer
from specdeploy.speculative.proposer import EngineParts, Proposer

PROPOSERS: dict[str, type[Proposer]] = {
    "none": Proposer,  # plain decode: nothing is ever proposed
    "draft_target": DraftModelProposer,
    "ngram": NgramProposer,
    "medusa": MedusaProposer,
    "eagle": EagleProposer,
    "early_exit": EarlyExitProposer,
    "lookahead": LookaheadProposer,
}


def create_proposer(method: str, parts: EngineParts) -> Proposer:
    if method not in PROPOSERS:
        raise SpecdeployError(f"speculation method {method!r} is not supported (allowed: {', '.join(PROPOSERS)})")
    return PROPOSERS[method].from_engine(parts)


def captured_layers(pipeline: PipelineSpec, directory: Path) -> tuple[int, ...]:
    """The target layers whose entering states the pipeline's proposer reads (Proposer.capture), from the engine at
    `directory` without loading it: what the target's compiled step program returns beside its hidden states."""
    return PROPOSERS[pipeline.speculation.method].captured_layers(directory)
