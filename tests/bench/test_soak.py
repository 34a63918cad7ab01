"""scripts/soak.py's verdict without a server: how a request's result is classified, what the server is expected to
have counted, and which failed checks the verdict names (the served run is `make soak`)."""

from __future__ import annotations

import copy

from helpers.repo import load_script

from specdeploy.bench.server_load import RequestResult

soak = load_script("soak")


def finished(text: str = "Hello", tokens: int = 8) -> RequestResult:
    return RequestResult(0, text=text, generated_tokens=tokens, finished=True)


def test_a_finished_request_needs_text_and_a_token_count_its_finish_allows():
    assert soak.finish_problem(finished(), 32, False, None) is None
    assert soak.finish_problem(finished(tokens=33), 32, False, None) == "33 tokens for max_tokens 32"
    assert "without an end token" in soak.finish_problem(finished(tokens=8), 32, True, None)
    assert soak.finish_problem(finished(tokens=32), 32, True, None) is None
    assert soak.finish_problem(finished(text=""), 32, False, None) == "empty text"
    assert soak.finish_problem(finished(text="", tokens=1), 1, False, None) is None  # a character's first bytes
    # greedy text is compared only where a reference is given (fp32, or batch-invariant serving)
    assert soak.finish_problem(finished(text="Hi"), 32, False, "Hello") == "greedy text differs from the request alone"


def test_results_are_classified_hung_before_failed_before_cancelled():
    assert soak.record("stream", RequestResult(0, error="no response", hung=True), 8).outcome == soak.HUNG
    assert soak.record("stream", RequestResult(0, error="boom"), 8).outcome == soak.FAILED
    assert soak.record("cancel", RequestResult(0, cancelled=True), 8).outcome == soak.CANCELLED
    lost = soak.record("stream", RequestResult(0), 8)
    assert (lost.outcome, lost.problem) == (soak.FAILED, "the stream ended without a final response")


def passing_report(records: list) -> dict:
    counts = soak.tally(records)
    expected = counts["expected_server"]
    return {"tally": counts, "idle": True, "stuck_clients": 0,
            "server": {"stop": 1, "length": expected["finished"] - 1, "cancelled": expected["cancelled"],
                       "invalid": expected["invalid"], "error": 0, "shutdown": 0},
            "process": {"start": {"fds": 70, "threads": 110}, "end": {"fds": 72, "threads": 112}},
            "drain": {"exit_status": 0, "problems": []}}


RECORDS = [soak.Record("stream", soak.FINISHED), soak.Record("ensemble", soak.FINISHED),
           soak.Record("cancel", soak.CANCELLED), soak.Record("drop", soak.CANCELLED),
           soak.Record("malformed: top_p above 1", soak.REFUSED, counted_invalid=True),
           soak.Record("malformed: unknown input", soak.REFUSED)]


def test_the_tally_expects_the_model_to_count_its_own_refusals_only():
    counts = soak.tally(RECORDS)
    assert counts["expected_server"] == {"finished": 2, "cancelled": 2, "invalid": 1}
    assert counts["by_kind"]["cancel"] == {soak.CANCELLED: 1} and counts["problems"] == {}
    assert soak.verdict(passing_report(RECORDS)) == []


def test_the_verdict_names_each_failed_check():
    hung = [*RECORDS, soak.Record("stream", soak.HUNG, "no response from speculative within 120 s")]
    report = passing_report(hung)
    assert soak.verdict(report) == ["1 × stream: hung: no response from speculative within 120 s"]
    broken = copy.deepcopy(passing_report(RECORDS))
    broken["server"]["cancelled"] -= 1
    broken["server"]["error"] = 1
    broken["idle"] = False
    broken["process"]["end"]["threads"] += soak.THREAD_SLACK
    broken["drain"] = {"exit_status": None, "problems": ["tritonserver still running"]}
    assert soak.verdict(broken) == [
        "the server counted 1 cancelled, the clients saw 2", "the server counted 1 requests as error",
        "batch, queue or KV reservations not back to idle within 30 s", "threads grew 110 → 122",
        "serve exited None after SIGTERM (None: killed after its timeout)",
        "during the drain: tritonserver still running"]
