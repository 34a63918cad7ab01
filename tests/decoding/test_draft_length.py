"""The proposal length: constant, or the heuristic schedule."""

from __future__ import annotations

from specdeploy.decoding.draft_length import ProposalLength


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
