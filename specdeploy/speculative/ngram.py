"""Prompt lookup (n-gram) proposer: no draft model, so its cost ratio c is essentially zero.

The last n tokens of prompt + output are matched against earlier text (longest n first, most recent match
first) and the tokens that followed the match are proposed. q is one-hot on each proposed token.
"""

from __future__ import annotations


class NgramProposer:
    def __init__(self, min_n: int = 2, max_n: int = 4) -> None:
        self.min_n, self.max_n = min_n, max_n

    def propose(self, tokens: list[int], gamma: int) -> list[int]:
        """Up to gamma tokens continuing `tokens`, or [] when no n-gram of the tail occurred before."""
        if gamma <= 0:
            return []
        for n in range(min(self.max_n, len(tokens) - 1), self.min_n - 1, -1):
            tail = tokens[-n:]
            # Most recent earlier occurrence first: recent text predicts the continuation best.
            for start in range(len(tokens) - n - 1, -1, -1):
                if tokens[start:start + n] == tail:
                    return tokens[start + n:start + n + gamma]
        return []
