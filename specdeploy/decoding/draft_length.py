"""How many tokens one sequence drafts at the next step: the one rule both serving flavours follow.

A step's gamma is decided in this order, each term only lowering it:
1. the request's gamma: its own `num_draft_tokens`, else the pipeline's, within `serving.policy.gamma_cap` (set in
   the pipeline, or measured at build and read when the engine loads): `GenerationRequest.gamma`;
2. the schedule: `constant` always asks for that gamma; `heuristic` is the schedule of Hugging Face assisted
   generation (`num_assistant_tokens_schedule="heuristic"`): two more after a step that accepted everything it
   drafted, one fewer after a rejection, kept within [1, gamma], so long verbatim copies verify many tokens per step
   while text that does not repeat stops paying for wide verify forwards;
3. the batch policy: the cap `serving.policy` gives for the number of sequences stepped together (`PolicySpec.gamma`);
4. what is left: the request's last token is always the target's own, and a step never drafts past the sequence
   limit (the room left in the sequence's KV).
"""

from __future__ import annotations

from specdeploy.spec.pipeline import PipelineSpec, PolicySpec
from specdeploy.spec.request import GenerationRequest
from specdeploy.spec.speculation import Schedule

HEURISTIC_START = 4  # first proposal length under the heuristic (then it grows or shrinks)


class ProposalLength:
    """One request's gamma (term 1) and its schedule's current length (term 2)."""

    def __init__(self, schedule: Schedule, gamma: int) -> None:
        self.schedule, self.gamma = schedule, gamma
        self.current = gamma if schedule == "constant" else min(HEURISTIC_START, gamma)

    @classmethod
    def for_request(cls, request: GenerationRequest, pipeline: PipelineSpec) -> ProposalLength:
        return cls(pipeline.speculation.schedule, request.gamma(pipeline))

    def update(self, drafted: int, accepted: int) -> None:
        """Record one step's outcome: `drafted` tokens proposed, `accepted` of them survived."""
        if self.schedule == "constant" or drafted == 0:
            return
        step = 2 if accepted == drafted else -1
        self.current = max(1, min(self.gamma, self.current + step))


def step_gamma(proposal: ProposalLength, policy: PolicySpec | None, batch_size: int, remaining: int,
               room: int) -> int:
    """The tokens a sequence drafts at this step (0: a plain decode step). policy: the batch policy, None for a
    request decoded alone outside a serving loop; batch_size: the sequences stepped together; remaining: the
    tokens the request may still emit; room: the positions left before the sequence limit."""
    gamma = proposal.current
    if policy is not None:
        gamma = min(gamma, policy.gamma(proposal.gamma, batch_size))
    return max(0, min(gamma, remaining - 1, room))
