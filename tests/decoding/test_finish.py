"""Finish reasons: the outcome label is the reason alone, the detail travels apart, and the failures are the two
reasons a client receives as an error."""

from __future__ import annotations

from specdeploy.decoding.finish import Finish, finish_message
from specdeploy.decoding.serving_request import ServingCounters
from specdeploy.decoding.stats import RequestStats


def test_failures_are_error_and_shutdown():
    assert [f for f in Finish if f.is_failure] == [Finish.ERROR, Finish.SHUTDOWN]


def test_message_joins_reason_and_detail():
    assert finish_message(Finish.ERROR, "RuntimeError: boom") == "error: RuntimeError: boom"
    assert finish_message(Finish.STOP) == "stop"


def test_counters_label_outcomes_by_reason_not_detail():
    counters = ServingCounters()
    counters.add(RequestStats(), Finish.ERROR, "chat")
    counters.add(RequestStats(), Finish.ERROR, "chat")
    counters.count_outcome(Finish.SHUTDOWN)
    assert counters.outcomes == {"error": 2, "shutdown": 1}
