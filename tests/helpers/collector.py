"""A scheduler callback that records what it was given."""

from __future__ import annotations

import threading


class Collector:
    """A scheduler callback that keeps a request's tokens and how it finished."""

    def __init__(self) -> None:
        self.tokens: list[int] = []
        self.reason: str | None = None
        self.stats = None  # the request's statistics at its end
        self.done = threading.Event()

    def __call__(self, tokens: list[int], finished: str | None, stats=None) -> None:
        assert not self.done.is_set(), "tokens after the final callback"
        self.tokens.extend(tokens)
        if finished is not None:
            self.reason, self.stats = finished, stats
            self.done.set()
