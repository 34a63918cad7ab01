"""A draft's vocabulary: the target tokens it may propose, the most frequent in some text (EAGLE-3 picks its head's
rows from its training data; an early exit its head's rows from the shipped text corpus)."""

from __future__ import annotations

from collections import Counter
from collections.abc import Iterable


def most_frequent_tokens(token_lists: Iterable[Iterable[int]], size: int, vocab_size: int) -> list[int]:
    """The `size` target ids most frequent in `token_lists` (ties and unseen ids by id, lowest first), ascending;
    every id when size is 0 or covers the vocabulary."""
    if size == 0 or size >= vocab_size:
        return list(range(vocab_size))
    counts = Counter(token for tokens in token_lists for token in tokens)
    ranked = sorted(range(vocab_size), key=lambda token: (-counts.get(token, 0), token))
    return sorted(ranked[:size])
