"""The row-lifecycle fuzz (issue 64 point 3): a seeded driver of the scheduler and batch decoder through random
request lifecycles, checking every proposer's per-row state against the active rows after each event.

Everything random happens on the scheduler's own thread, in its `on_step` calls and token callbacks, so a seed
replays the same sequence of events: joins in the middle of an iteration (a request submitted while another
leaves, or between admission and prefill), requests that end at their prefill (max_tokens 1, or end_id equal to
their first token), cancellations while queued, before the first step and inside a burst (while a step's tokens
are being delivered), rows moved by `_finish`, and a full batch with a queue behind it."""

from __future__ import annotations

import random
import threading
import time
from dataclasses import dataclass, field

from specdeploy.decoding.serving_request import ServingRequest
from specdeploy.runtime.engine import Engine
from specdeploy.runtime.scheduler import Scheduler
from specdeploy.spec.pipeline import PolicySpec, ServingSpec
from specdeploy.spec.request import NO_END_ID, GenerationRequest
from specdeploy.spec.sampling_params import SamplingParams
from specdeploy.speculative.draft_model import DraftModelProposer
from specdeploy.speculative.eagle import EagleProposer
from specdeploy.speculative.lookahead import LookaheadProposer
from specdeploy.speculative.medusa import MedusaProposer

LONGEST = 24  # tokens of each prompt's solo run; every request stops within them


def cache_sum(cache, row: int) -> float:
    """A checksum of a cache row's committed entries."""
    length = cache.lengths[row]
    return sum(float(keys[row, :, :length].sum()) for keys in cache.keys)


def proposer_state(proposer, row: int) -> object:
    """What identifies the proposer's state for row `row`: it must follow its sequence through every row move."""
    if isinstance(proposer, LookaheadProposer):
        return id(proposer.states.get(row))
    if isinstance(proposer, EagleProposer):
        return (proposer.cache.lengths[row], cache_sum(proposer.cache, row), [id(t) for t in proposer.pending[row]],
                proposer.root[row].tolist())
    if isinstance(proposer, MedusaProposer):
        return proposer.last[row].tolist()
    if isinstance(proposer, DraftModelProposer) and not proposer.shared:
        return proposer.cache.lengths[row], cache_sum(proposer.cache, row)
    return None  # n-gram, and drafts that read the target's cache: nothing per row beyond the target's


@dataclass
class FuzzRequest:
    prompt: int  # index into the prompts
    max_tokens: int
    end_id: int
    tokens: list[int] = field(default_factory=list)
    reason: str | None = None
    detail: str = ""
    prefilled: bool = False
    serving: ServingRequest | None = None


@dataclass
class Coverage:
    """How often each event happened, so a test can see the fuzz reached it."""

    ended_at_prefill: int = 0
    cancelled_before_first_step: int = 0
    cancelled_in_burst: int = 0
    joined_mid_iteration: int = 0
    moves: int = 0
    full_batches: int = 0
    checks: int = 0


class RowFuzz:
    def __init__(self, engine_dir, seed: int, requests: int, batch_size: int = 3) -> None:
        self.rng = random.Random(seed)
        self.budget, self.batch_size = requests, batch_size
        solo = Engine(engine_dir)
        self.prompts = [self._prompt() for _ in range(6)]
        # fp32 plain greedy alone: what every request must equal (up to its end)
        self.solo = [solo.start(GenerationRequest(p, LONGEST, SamplingParams(), 0, end_id=NO_END_ID)).run()
                     for p in self.prompts]
        self.requests: list[FuzzRequest] = []
        self.coverage = Coverage()
        self.problem: str | None = None
        self.lock = threading.Lock()
        self.records: dict[int, object] = {}  # id(sequence) → its rows' state after its last prefill or commit
        self.engine = Engine(engine_dir, batch_size=batch_size)
        self._record_after(self.engine.proposer, "prefill")
        self._record_after(self.engine.proposer, "on_commit")
        moving = self.engine.decoder.move_row

        def counted_move(source: int, destination: int) -> None:
            self.coverage.moves += 1
            moving(source, destination)

        self.engine.decoder.move_row = counted_move
        self.scheduler: Scheduler | None = None
        self.inside = False

    def _prompt(self) -> list[int]:
        """3 to 12 tokens, half of them a repeated pattern (which n-gram and lookahead drafts find)."""
        if self.rng.random() < 0.5:
            pattern = [self.rng.randrange(3, 128) for _ in range(self.rng.randint(2, 3))]
            return (pattern * 6)[:self.rng.randint(4, 12)]
        return [self.rng.randrange(3, 128) for _ in range(self.rng.randint(3, 12))]

    def _record_after(self, proposer, hook: str) -> None:
        original = getattr(proposer, hook)

        def recorded(row, sequence, hidden):
            original(row, sequence, hidden)
            self.records[id(sequence)] = self._state(row)

        setattr(proposer, hook, recorded)

    def _state(self, row: int) -> tuple:
        cache = self.engine.cache
        return cache.lengths[row], cache_sum(cache, row), proposer_state(self.engine.proposer, row)

    # ---- the run -------------------------------------------------------------------------------------------
    def run(self, timeout: float = 120) -> Coverage:
        """Drive the requests to their ends, then check each against its solo run (AssertionError on any miss)."""
        self.scheduler = Scheduler(self.engine, ServingSpec(PolicySpec(full_up_to=self.batch_size,
                                                                       off_above=self.batch_size)),
                                   on_step=self.on_step)
        try:
            with self.scheduler._lock:  # a full batch and a queue, admitted together
                self.submit(self.batch_size + 2)
            while True:
                with self.lock:
                    pending = [r for r in self.requests if r.reason is None]
                if pending:
                    assert all(self._wait(r, timeout) for r in pending), "a request was left waiting"
                    continue
                if len(self.requests) >= self.budget or self.problem or self.scheduler.failure:
                    break
                with self.scheduler._lock:  # everything ended early: the next wave, the scheduler idle
                    self.submit(self.rng.randint(1, self.batch_size + 2))
        finally:
            self.scheduler.stop()
        assert self.problem is None, self.problem
        assert self.scheduler.failure is None, self.scheduler.failure
        for index, request in enumerate(self.requests):
            expected = self.expected(request)
            what = f"request {index} ({request}), expected {expected}"
            if request.reason == "cancelled":
                assert request.tokens == expected[:len(request.tokens)], what
            else:
                assert request.reason in ("stop", "length") and request.tokens == expected, what
        return self.coverage

    @staticmethod
    def _wait(request: FuzzRequest, timeout: float) -> bool:
        deadline = time.monotonic() + timeout
        while request.reason is None and time.monotonic() < deadline:
            time.sleep(0.01)
        return request.reason is not None

    def expected(self, request: FuzzRequest) -> list[int]:
        tokens = self.solo[request.prompt][:request.max_tokens]
        if request.end_id in tokens:
            tokens = tokens[:tokens.index(request.end_id) + 1]
        return tokens

    def submit(self, count: int) -> None:
        for _ in range(min(count, self.budget - len(self.requests))):
            prompt = self.rng.randrange(len(self.prompts))
            kind = self.rng.choice(["one", "first", "later", "plain", "plain"])
            max_tokens = 1 if kind == "one" else self.rng.randint(2, LONGEST)
            end_id = {"first": self.solo[prompt][0], "later": self.rng.choice(self.solo[prompt])}.get(kind, NO_END_ID)
            request = FuzzRequest(prompt, max_tokens, end_id)
            request.serving = self.scheduler.submit(
                GenerationRequest(self.prompts[prompt], max_tokens, SamplingParams(), end_id=end_id),
                lambda tokens, finished, stats, request=request: self.on_tokens(request, tokens, finished, stats))
            with self.lock:
                self.requests.append(request)

    # ---- events, on the scheduler's thread --------------------------------------------------------------------
    def on_tokens(self, request: FuzzRequest, tokens: list[int], finished, stats) -> None:
        if not request.prefilled and finished is not None and finished != "cancelled" and tokens:
            self.coverage.ended_at_prefill += 1
        if finished == "cancelled" and not request.prefilled:
            self.coverage.cancelled_before_first_step += 1
        request.prefilled = request.prefilled or bool(tokens)
        request.tokens.extend(tokens)
        if finished is not None:
            request.detail = stats.finish_detail if stats is not None else ""
            request.reason = str(finished)
        elif len(tokens) > 1 and self.rng.random() < 0.3:  # inside a burst: cancel one of this step's rows
            victim = self.rng.choice(self.scheduler.active)
            self.scheduler.cancel(victim)
            self.coverage.cancelled_in_burst += 1

    def on_step(self, scheduler: Scheduler) -> None:
        if self.inside or threading.current_thread() is not scheduler._thread or scheduler.failure:
            return  # a submission's own call, the main thread's, or the failed scheduler's last
        self.inside = True
        try:
            self.check(scheduler)
            if len(scheduler.active) == self.batch_size and scheduler.waiting:
                self.coverage.full_batches += 1
            if self.rng.random() < 0.35 and len(self.requests) < self.budget:
                self.coverage.joined_mid_iteration += 1
                self.submit(self.rng.randint(1, 3))
            if self.rng.random() < 0.15:
                candidates = list(scheduler.active) + list(scheduler.waiting)
                if candidates:
                    scheduler.cancel(self.rng.choice(candidates))
        finally:
            self.inside = False

    def check(self, scheduler: Scheduler) -> None:
        """Every prefilled active row holds its own sequence's state: the target's cache and the proposer's."""
        self.coverage.checks += 1
        prefilled = {id(r.serving): r.prefilled for r in self.requests if r.serving is not None}
        for row, serving in enumerate(scheduler.active):
            sequence = serving.sequence
            if not prefilled.get(id(serving)) or sequence.finish_reason is not None:
                continue
            if self._state(row) != self.records.get(id(sequence)) and self.problem is None:
                self.problem = (f"row {row}: its state {self._state(row)} is not its sequence's "
                                f"{self.records.get(id(sequence))} (after {self.coverage.moves} row moves)")
                raise AssertionError(self.problem)
