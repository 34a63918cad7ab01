"""A scheduler that cannot die silently (issue 64 point 2): an exception anywhere in the loop, here injected into a
proposer hook under load, ends every running and queued request with an error naming it, refuses new requests,
and reports the failure once; runtime/scheduler.py's docstring says why it stops rather than dropping a row."""

from __future__ import annotations

import pytest
from helpers.collector import Collector

from specdeploy.errors import SchedulerFailed
from specdeploy.runtime.engine import Engine
from specdeploy.runtime.fault_injection import FAULT_VARIABLE, inject_fault, inject_from_environment
from specdeploy.runtime.scheduler import Scheduler
from specdeploy.spec.pipeline import PolicySpec, ServingSpec
from specdeploy.spec.request import NO_END_ID, GenerationRequest
from specdeploy.spec.sampling_params import SamplingParams

PROMPTS = [[5, 40, 41, 42, 43, 7, 9], [70, 71, 72, 70, 71, 72, 70, 71], [10, 11, 12, 13, 14, 15, 16, 17, 18, 19, 20],
           [3, 4, 5, 6, 3, 4, 5], [90, 91, 92, 93, 94, 95], [20, 21, 22, 20, 21, 22, 23, 24, 25]]


# the call that fails: prefill's 6th is a queued request joining; move_row's 1st, the first row to leave
@pytest.mark.parametrize("hook, call", [("prefill", 6), ("propose", 4), ("on_commit", 9), ("move_row", 1)])
def test_a_failing_proposer_hook_ends_every_request_with_an_error_naming_it(tiny_engines, hook, call):
    engine = Engine(tiny_engines["draft_target"].dir, batch_size=4)
    inject_fault(engine.proposer, hook, call)
    failures = []
    scheduler = Scheduler(engine, ServingSpec(PolicySpec(full_up_to=4, off_above=4)), on_failure=failures.append)
    try:
        collectors = [Collector() for _ in range(8)]
        with scheduler._lock:  # all queued before the first iteration: 4 run, 4 wait
            for i, collector in enumerate(collectors):  # lengths differ, so an early row leaves and one is moved
                scheduler.submit(GenerationRequest(PROMPTS[i % 6], 6 + 9 * (i % 4), SamplingParams(),
                                                   end_id=NO_END_ID), collector)
        for collector in collectors:
            assert collector.done.wait(60), "a request was left waiting"
        failed = [c for c in collectors if c.reason == "error"]
        assert failed and all(c.reason in ("error", "length") for c in collectors)
        assert len(failures) == 1 and f"InjectedFault: {hook} call {call} failed" in failures[0]
        assert all(c.stats.finish_detail == failures[0] for c in failed)
        assert scheduler.counters.outcomes["error"] == len(failed)
        assert scheduler.failure == failures[0] and not scheduler.active and not scheduler.waiting
        with pytest.raises(SchedulerFailed, match=f"{hook} call {call}"):
            scheduler.submit(GenerationRequest(PROMPTS[0], 4, SamplingParams()), Collector())
    finally:
        scheduler.stop()


def test_a_callback_that_fails_while_the_scheduler_fails_keeps_no_one_else_waiting(tiny_engines):
    """The failure path touches neither the engine nor its rows, and one request's callback raising in it does not
    keep the others from their error (soak 5's hang: the old error path moved rows again, and raised again)."""
    engine = Engine(tiny_engines["draft_target"].dir, batch_size=4)
    inject_fault(engine.proposer, "propose", 2)

    def broken(tokens, finished, stats=None):
        if finished is not None:
            raise RuntimeError("a client's callback failed")

    scheduler = Scheduler(engine, ServingSpec(PolicySpec(full_up_to=4, off_above=4)))
    try:
        collectors = [Collector() for _ in range(5)]
        with scheduler._lock:
            scheduler.submit(GenerationRequest(PROMPTS[0], 20, SamplingParams(), end_id=NO_END_ID), broken)
            for i, collector in enumerate(collectors):
                scheduler.submit(GenerationRequest(PROMPTS[i + 1], 20, SamplingParams(), end_id=NO_END_ID),
                                 collector)
        assert all(c.done.wait(60) and c.reason == "error" for c in collectors)
    finally:
        scheduler.stop()


def test_the_injected_fault_is_read_from_the_environment_and_checked(tiny_engines, monkeypatch):
    engine = Engine(tiny_engines["ngram"].dir)
    assert inject_from_environment(engine.proposer) is None
    monkeypatch.setenv(FAULT_VARIABLE, "propose:2")
    assert inject_from_environment(engine.proposer) == "propose:2"
    engine.proposer.propose([], [])  # the first call runs the hook
    with pytest.raises(RuntimeError, match="propose call 2 failed, as SPECDEPLOY_TEST_FAULT asked"):
        engine.proposer.propose([], [])
    for bad in ("verify:1", "propose:0", "propose"):
        monkeypatch.setenv(FAULT_VARIABLE, bad)
        with pytest.raises(ValueError, match="HOOK:N with HOOK one of"):
            inject_from_environment(engine.proposer)
