"""N-gram (prompt lookup) drafts."""

from __future__ import annotations

from specdeploy.decoding.prompt_lookup import prompt_lookup


def test_ngram_prefers_the_longest_most_recent_match():
    def lookup(tokens, gamma, min_n=1, max_n=3):
        return prompt_lookup(tokens, gamma, min_n, max_n)

    tokens = [1, 2, 3, 9, 1, 2, 3, 7, 8, 5, 2, 3]
    assert lookup(tokens, 3) == [7]  # "2 3" last seen before "7 8 5", earlier before "9": cut to one
    tokens = [4, 2, 3, 7, 8, 1, 1, 2, 3, 7, 8, 5, 6, 0, 2, 3]
    assert lookup(tokens, 4) == [7, 8]  # both earlier "2 3" continue "7 8", then differ
    assert lookup([6, 2, 3, 7, 8, 5, 1, 2, 3], 4) == [7, 8, 5, 1]  # one occurrence: all of it
    assert lookup([4, 5, 6], 3) == []
    assert lookup(tokens, 0) == []
    assert lookup([1, 2, 3, 1, 2], 5, min_n=2, max_n=2) == [3, 1, 2]
