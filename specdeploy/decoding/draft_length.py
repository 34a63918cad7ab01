"""How many tokens to draft at the next step of one request.

`constant` always asks for the request's gamma. `heuristic` is the schedule of Hugging Face assisted generation
(`num_assistant_tokens_schedule="heuristic"`): two more after a step that accepted everything it drafted, one fewer
after a rejection, kept within [1, gamma]. Long verbatim copies then verify many tokens per step, while text that
does not repeat stops paying for wide verify forwards (on this CPU a 17-token verify costs ~4 plain steps).
"""

from __future__ import annotations

from specdeploy.spec.pipeline import Schedule

HEURISTIC_START = 4  # first proposal length under the heuristic (then it grows or shrinks)


class ProposalLength:
    def __init__(self, schedule: Schedule, gamma: int) -> None:
        self.schedule, self.gamma = schedule, gamma
        self.current = gamma if schedule == "constant" else min(HEURISTIC_START, gamma)

    def update(self, drafted: int, accepted: int) -> None:
        """Record one step's outcome: `drafted` tokens proposed, `accepted` of them survived."""
        if self.schedule == "constant" or drafted == 0:
            return
        step = 2 if accepted == drafted else -1
        self.current = max(1, min(self.gamma, self.current + step))
