"""Continuous batching with a speculation policy: the serving loop over one engine's cache rows.

Requests wait in a FIFO queue until a cache row is free and the KV budget covers their worst case (prompt +
max_tokens + the gamma + 1 slots a speculative step reserves). Between steps, new requests are prefilled into the
next free row and join; finished or cancelled ones leave at once and the last active row is moved into the hole,
so the active rows are always 0..B-1 and one batched step covers exactly them. Before each step the policy picks
the proposal cap for the current batch size (speculation is a scheduling decision: full gamma at low load,
less as the batch fills, none above a threshold, in which case drafting is skipped entirely).

A failure fails the server, not one row. Any exception in the loop (a step, a prefill, a row move, a proposer hook,
a callback) ends every running and queued request with an error naming it, refuses new ones (SchedulerFailed), and
calls `on_failure`, with which the served model has the server stop and `specdeploy serve` exit non-zero, so that
the supervisor or Kubernetes restarts it on a clean state. Why not drop the row and go on:
- a failure is rarely confined to one row: propose, verify and commit run over every row at once, and the target's
  cache, the proposer's per-row state (a draft's cache, EAGLE's pending pairs, lookahead's windows) and the active
  list are changed in place across several calls; an exception between two of them leaves state that belongs to
  one request filed under another's row, which would go on to emit wrong tokens without a word, the one outcome
  worse than an error for an engine whose output must equal the target's;
- the failures this guards against are defects (soak 5: a KeyError in lookahead's row move) that the same request
  pattern triggers again; a restart is loud (restarts are counted, a crash loop is visible) where a limping server
  that fails some requests is not, and it reloads the weights with their checksums checked, which is also what
  non-finite logits (corrupted weights, an overflow) call for;
- what it costs is the running requests, which a failed batched step loses anyway, and a reload.
"""

from __future__ import annotations

import dataclasses
import threading
import time
import traceback
from collections import deque
from collections.abc import Callable

from specdeploy.decoding.finish import Finish
from specdeploy.decoding.serving_request import ServingCounters, ServingRequest, TokenCallback
from specdeploy.errors import SchedulerFailed, ShuttingDown
from specdeploy.runtime.engine import Engine
from specdeploy.spec.pipeline import ServingSpec
from specdeploy.spec.request import GenerationRequest


class Scheduler:
    def __init__(self, engine: Engine | Callable[[], Engine], serving: ServingSpec | None = None,
                 on_step: Callable[[Scheduler], None] | None = None,
                 on_failure: Callable[[str], None] | None = None) -> None:
        """engine: loaded with batch_size = the most sequences stepped together, or a function that loads it.
        Given a function, the engine is loaded on the scheduler's own thread, which then runs every forward: with
        torch's OpenMP, a thread other than the one whose parallel regions came first runs them much slower
        (measured: docs/benchmarks.md, "Figures behind the code"), so a server whose main thread loads the weights must
        not decode on another thread. serving: the speculation policy and KV budget, when not the engine pipeline's
        own. on_step: called after each step and whenever requests join, queue or leave (metrics: the gauges
        follow the batch as it changes, not a step behind); a request queued calls it on the submitting thread.
        on_failure: called once, on the scheduler's thread, with the failure's description after the loop failed
        and ended every request (see the module docstring)."""
        self.on_step = on_step
        self.on_failure = on_failure
        self.failure: str | None = None  # set when the loop failed: what failed
        self.waiting: deque[ServingRequest] = deque()
        self.active: list[ServingRequest] = []
        self.counters = ServingCounters()
        self._lock = threading.Condition()
        self._stopped = False
        self._drain_deadline: float | None = None  # time.time() at which running requests are ended
        self._loaded = threading.Event()
        self._load_error: BaseException | None = None
        self._thread = threading.Thread(target=self._run, args=(engine, serving),
                                        name="specdeploy-scheduler", daemon=True)
        self._thread.start()
        self._loaded.wait()
        if self._load_error is not None:
            raise self._load_error

    def _run(self, engine: Engine | Callable[[], Engine], serving: ServingSpec | None) -> None:
        try:
            self.engine = engine if isinstance(engine, Engine) else engine()
            pipeline = self.engine.pipeline
            if serving is not None:
                pipeline = dataclasses.replace(pipeline, serving=serving)
            self.policy = pipeline.serving.policy
            self.kv_capacity = pipeline.kv_capacity_tokens
            self.max_batch_size = self.engine.cache.batch_size
        except BaseException as exc:  # reported by __init__ on the caller's thread
            self._load_error = exc
            return
        finally:
            self._loaded.set()
        self._loop()

    # ---- requests -------------------------------------------------------------------------------------------
    def submit(self, request: GenerationRequest, on_tokens: TokenCallback,
               is_cancelled: Callable[[], bool] = lambda: False) -> ServingRequest:
        """Queue a request (RequestError if it is invalid or can never fit the KV budget, ShuttingDown while the
        scheduler drains)."""
        if self._drain_deadline is not None:
            raise ShuttingDown("server is shutting down: not accepting new requests")
        sequence = self.engine.new_sequence(request, self.kv_capacity)
        queued = ServingRequest(sequence, on_tokens, is_cancelled, kind=request.kind_label,
                                reserved=request.kv_slots(self.engine.pipeline))
        with self._lock:
            if self.failure is not None:  # checked under the lock: a request never lands in a dead loop's queue
                raise SchedulerFailed(self.failure)
            self.waiting.append(queued)
            self._lock.notify()
        if self.on_step is not None:
            self.on_step(self)  # the queued-requests gauge
        return queued

    def drain(self, deadline: float) -> None:
        """Take no new requests, end the queued ones now and the running ones at `deadline` (time.time()) if they
        have not finished by then; each ends with Finish.SHUTDOWN."""
        with self._lock:
            self._drain_deadline = deadline
            self._lock.notify()

    def cancel(self, request: ServingRequest) -> None:
        with self._lock:
            request.cancel_requested = True
            self._lock.notify()

    @property
    def idle(self) -> bool:
        """No request running or queued (a drain is over once it is)."""
        return not self.active and not self.waiting

    @property
    def reserved_kv(self) -> int:
        return sum(r.reserved for r in self.active)

    @property
    def free_kv_slots(self) -> int:
        return self.kv_capacity - self.reserved_kv

    def stop(self) -> None:
        with self._lock:
            self._stopped = True
            self._lock.notify()
        self._thread.join(timeout=30)

    # ---- the loop ---------------------------------------------------------------------------------------------
    def _loop(self) -> None:
        try:
            while self._iteration():
                pass
        except Exception as exc:  # anything at all: see the module docstring
            self._fail(exc)
            return
        for request in list(self.active) + list(self.waiting):
            request.sequence.end(Finish.CANCELLED)
            request.on_tokens([], Finish.CANCELLED, request.sequence.stats)

    def _iteration(self) -> bool:
        """Admit, drop the cancelled, prefill the joining, step. Returns False once stopped."""
        with self._lock:
            while not self._stopped and not self.waiting and not self.active:
                self._lock.wait()
            if self._stopped:
                return False
            if self._drain_deadline is not None:
                self._end_for_shutdown()
            joining = self._admit()
        if joining and self.on_step is not None:
            self.on_step(self)  # the batch and queue gauges, before the joining requests' prefills
        self._drop_cancelled()
        for request in joining:
            if request not in self.active:
                continue  # cancelled between admission and prefill
            row = self.active.index(request)
            self._deliver(request, self.engine.decoder.prefill(request.sequence, row))
        if self.active:
            self._step()
        if self.on_step is not None:
            self.on_step(self)
        return True

    def _fail(self, exc: Exception) -> None:
        """The loop failed: refuse new requests, end every running and queued one with an error naming the failure
        (touching neither the engine nor its rows, whose state is not to be trusted now), then call on_failure.
        One callback failing does not keep the others from their error."""
        traceback.print_exc()
        failure = (f"the scheduler failed ({type(exc).__name__}: {exc}); the server stops so that it is restarted "
                   "on a clean state")
        with self._lock:
            self.failure = failure
            ended = list(self.active) + list(self.waiting)
            self.active.clear()
            self.waiting.clear()
        for request in ended:
            try:
                request.sequence.end(Finish.ERROR, failure)
                self.counters.count_outcome(Finish.ERROR)
                request.on_tokens([], Finish.ERROR, request.sequence.stats)
            except Exception:
                traceback.print_exc()
        try:
            if self.on_step is not None:
                self.on_step(self)  # the gauges at empty, the errors counted
        except Exception:
            traceback.print_exc()
        if self.on_failure is not None:
            self.on_failure(failure)

    def _end_for_shutdown(self) -> None:
        """While draining: queued requests end now, running ones once the deadline has passed."""
        while self.waiting:
            request = self.waiting.popleft()
            request.sequence.end(Finish.SHUTDOWN, "the server is shutting down before this request started")
            self.counters.count_outcome(Finish.SHUTDOWN)
            request.on_tokens([], request.sequence.finish_reason, request.sequence.stats)
        if time.time() >= self._drain_deadline:
            for request in list(self.active):
                request.sequence.end(Finish.SHUTDOWN, "the server is shutting down and this request did not finish "
                                                      "within the drain timeout")
                self._finish(request)

    def _admit(self) -> list[ServingRequest]:
        """Move waiting requests into free rows while the KV budget allows (FIFO: no overtaking)."""
        joining = []
        while self.waiting and len(self.active) < self.max_batch_size:
            request = self.waiting[0]
            if request.cancelled:
                self.waiting.popleft()
                request.sequence.end(Finish.CANCELLED)
                self.counters.count_outcome(Finish.CANCELLED)
                request.on_tokens([], Finish.CANCELLED, request.sequence.stats)
                continue
            if self.reserved_kv + request.reserved > self.kv_capacity:
                break
            self.waiting.popleft()
            self.active.append(request)
            joining.append(request)
        return joining

    def _drop_cancelled(self) -> None:
        for request in list(self.active):
            if request.cancelled:
                request.sequence.end(Finish.CANCELLED)
                self._finish(request)

    def _step(self) -> None:
        emitted = self.engine.decoder.step([r.sequence for r in self.active], self.policy)
        for request, tokens in zip(list(self.active), emitted):
            self._deliver(request, tokens)

    def _deliver(self, request: ServingRequest, tokens: list[int]) -> None:
        """Hand a step's tokens to the request; a finished request leaves first, so its last callback comes
        after its row, reservation and counts are settled."""
        if request.sequence.finish_reason is None:
            request.on_tokens(tokens, None, request.sequence.stats)
        else:
            self._finish(request, tokens)

    def _finish(self, request: ServingRequest, tokens: list[int] | None = None) -> None:
        """Remove an active request (its row is refilled by the last active row), count it, report its end."""
        row, last = self.active.index(request), len(self.active) - 1
        if row != last:
            self.engine.decoder.move_row(last, row)
        self.active[row] = self.active[last]
        self.active.pop()
        stats = request.sequence.stats
        stats.total_seconds = time.perf_counter() - request.submitted
        reason = request.sequence.finish_reason
        self.counters.add(stats, reason, request.kind)
        if self.on_step is not None:
            self.on_step(self)
        request.on_tokens(tokens or [], reason, stats)
