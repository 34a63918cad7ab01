"""Each step's gamma (decoding/draft_length.py): the proposal length of the constant and heuristic schedules, and the
one rule both serving flavours apply, from the request's own value to the room in the sequence (one table, each row
changing one term)."""

from __future__ import annotations

import pytest

from specdeploy.decoding.draft_length import ProposalLength, step_gamma
from specdeploy.spec.pipeline import PolicySpec, parse_pipeline
from specdeploy.spec.request import GenerationRequest
from specdeploy.spec.sampling_params import SamplingParams


def test_heuristic_proposal_length_grows_on_full_acceptance_and_shrinks_on_rejection():
    length = ProposalLength("heuristic", gamma=9)
    assert length.current == 4
    length.update(4, 4)
    assert length.current == 6
    length.update(6, 6)
    length.update(8, 8)
    assert length.current == 9  # capped at gamma
    length.update(9, 2)
    assert length.current == 8
    length.update(0, 0)  # nothing drafted (no n-gram match): no evidence either way
    assert length.current == 8
    for _ in range(20):
        length.update(length.current, 0)
    assert length.current == 1  # never below one
    constant = ProposalLength("constant", gamma=5)
    constant.update(5, 0)
    assert constant.current == 5
    assert ProposalLength("heuristic", gamma=2).current == 2


def pipeline(gamma: int = 5, schedule: str = "constant", gamma_cap: int | None = None, method: str = "ngram"):
    return parse_pipeline({
        "name": "gamma", "target": {"checkpoint": {"source": "gguf", "path": "model.gguf"}},
        "speculation": {"method": method, "num_draft_tokens": gamma, "schedule": schedule},
        "serving": {"policy": {"full_up_to": 2, "off_above": 6, "gamma_cap": gamma_cap}}})


def request(num_draft_tokens: int | None = None) -> GenerationRequest:
    return GenerationRequest([1, 2, 3], 64, SamplingParams(), num_draft_tokens)


POLICY = PolicySpec(full_up_to=2, off_above=6)  # the pipeline's: full gamma up to 2 rows, none above 6

# (why, pipeline, request's num_draft_tokens, policy, batch size, remaining, room, expected)
TABLE = [
    ("the pipeline's gamma", pipeline(5), None, None, 1, 64, 200, 5),
    ("the request's own gamma", pipeline(5), 3, None, 1, 64, 200, 3),
    ("a request's gamma above the pipeline's", pipeline(5), 7, None, 1, 64, 200, 7),
    ("0 from the request: plain decode", pipeline(5), 0, POLICY, 1, 64, 200, 0),
    ("the pipeline's cap", pipeline(5, gamma_cap=2), None, None, 1, 64, 200, 2),
    ("the cap over the request's own", pipeline(5, gamma_cap=2), 7, None, 1, 64, 200, 2),
    ("a cap of 0: no drafting", pipeline(5, gamma_cap=0), 4, None, 1, 64, 200, 0),
    ("a method that does not speculate", pipeline(5, method="none"), 4, None, 1, 64, 200, 0),
    ("the heuristic schedule starts at 4", pipeline(8, schedule="heuristic"), None, None, 1, 64, 200, 4),
    ("... or at gamma when it is smaller", pipeline(3, schedule="heuristic"), None, None, 1, 64, 200, 3),
    ("the policy at a full-speed batch", pipeline(8), None, POLICY, 2, 64, 200, 8),
    ("the policy's linear reduction", pipeline(8), None, POLICY, 4, 64, 200, 5),
    ("the policy past off_above", pipeline(8), None, POLICY, 7, 64, 200, 0),
    ("the policy scales the request's own gamma", pipeline(8), 4, POLICY, 4, 64, 200, 2),
    ("the last token is the target's own", pipeline(5), None, None, 1, 3, 200, 2),
    ("one token left: plain", pipeline(5), None, None, 1, 1, 200, 0),
    ("the room before the sequence limit", pipeline(5), None, None, 1, 64, 3, 3),
    ("no room", pipeline(5), None, None, 1, 64, 0, 0),
    ("the smallest term wins", pipeline(8, gamma_cap=6), None, POLICY, 4, 5, 7, 4),
]


@pytest.mark.parametrize("why, spec, own, policy, batch_size, remaining, room, expected", TABLE,
                         ids=[row[0] for row in TABLE])
def test_step_gamma(why, spec, own, policy, batch_size, remaining, room, expected):
    proposal = ProposalLength.for_request(request(own), spec)
    assert step_gamma(proposal, policy, batch_size, remaining, room) == expected


def test_the_heuristic_schedule_moves_within_the_requests_gamma():
    proposal = ProposalLength.for_request(request(6), pipeline(5, schedule="heuristic", gamma_cap=9))
    proposal.update(4, 4)  # everything accepted: two more, but never past the request's gamma
    assert step_gamma(proposal, None, 1, 64, 200) == 6
    proposal.update(6, 1)  # a rejection: one fewer
    assert step_gamma(proposal, POLICY, 1, 64, 200) == 5
    assert step_gamma(proposal, POLICY, 5, 64, 200) == 2  # the policy scales the request's gamma (6 x 2/5)
