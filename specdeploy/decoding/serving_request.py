"""A request inside a serving loop, as both flavours keep it: the torch flavour's scheduler (runtime/scheduler.py)
and the trtllm flavour's orchestrator (serve/trtllm/orchestration.py). Each holds its running requests as
`ServingRequest`s, hands their tokens to a `TokenCallback`, and counts the finished ones in `ServingCounters`, which
the specdeploy_* metrics read (serve/served_model.py). Nothing here runs a model, so the trtllm flavour, which
loads no weights, imports it without the torch engine."""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass, field

from specdeploy.decoding.finish import Finish
from specdeploy.decoding.sequence import Sequence
from specdeploy.decoding.stats import RequestStats
from specdeploy.spec.pipeline import UNSPECIFIED_KIND

# on_tokens(tokens, finished, stats): new tokens of one request; finished is None until its last call, then how it
# ended; stats: the request's RequestStats so far (at the end, with the finish's detail).
TokenCallback = Callable[[list[int], Finish | None, RequestStats], None]


@dataclass(eq=False)  # a request is itself: rows and queues find it by identity
class ServingRequest:
    sequence: Sequence
    on_tokens: TokenCallback
    is_cancelled: Callable[[], bool] = lambda: False  # the client's side: a disconnected stream
    kind: str = UNSPECIFIED_KIND  # the request's kind of traffic: its acceptance counters' label
    reserved: int = 0  # KV slots priced at admission
    cancel_requested: bool = False  # the server's side: cancelled through the loop
    submitted: float = field(default_factory=time.perf_counter)

    @property
    def cancelled(self) -> bool:
        """Cancelled through the serving loop or by the client."""
        return self.cancel_requested or self.is_cancelled()


@dataclass
class AcceptanceTotals:
    """Drafting and acceptance summed over finished requests (of one kind of traffic)."""

    drafted: int = 0
    accepted: int = 0
    steps: int = 0  # verification steps, summed over requests
    accepted_per_position: list[int] = field(default_factory=list)

    def add(self, stats: RequestStats) -> None:
        self.drafted += stats.drafted
        self.accepted += stats.accepted
        self.steps += stats.steps
        for i, count in enumerate(stats.accepted_per_position):
            if i >= len(self.accepted_per_position):
                self.accepted_per_position.append(0)
            self.accepted_per_position[i] += count


@dataclass
class ServingCounters:
    """Monotonic totals over finished requests, for metrics: acceptance by request kind, outcomes."""

    by_kind: dict[str, AcceptanceTotals] = field(default_factory=dict)
    outcomes: dict[str, int] = field(default_factory=dict)

    def add(self, stats: RequestStats, finish: Finish, kind: str) -> None:
        """Count a finished request of `kind`: its statistics, and its outcome."""
        self.by_kind.setdefault(kind, AcceptanceTotals()).add(stats)
        self.count_outcome(finish)

    def count_outcome(self, finish: Finish) -> None:
        self.outcomes[finish.value] = self.outcomes.get(finish.value, 0) + 1

    @property
    def drafted(self) -> int:
        return sum(totals.drafted for totals in self.by_kind.values())

    @property
    def accepted(self) -> int:
        return sum(totals.accepted for totals in self.by_kind.values())
