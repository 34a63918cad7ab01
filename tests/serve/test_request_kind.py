"""request_kind: a validated label from serving.request_kinds that splits the acceptance counters by kind of
traffic (the real server's side is in test_triton.py)."""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest
from helpers.collector import Collector

from specdeploy.errors import RequestError
from specdeploy.runtime.engine import Engine
from specdeploy.runtime.scheduler import Scheduler
from specdeploy.serve.requests import generation_request
from specdeploy.spec.pipeline import UNSPECIFIED_KIND, ServingSpec
from specdeploy.spec.request import GenerationRequest, check_request
from specdeploy.spec.sampling_params import SamplingParams


def with_kinds(pipeline, *kinds: str):
    return dataclasses.replace(pipeline, serving=ServingSpec(request_kinds=kinds))


def inputs(**extra) -> dict[str, np.ndarray]:
    return {"input_ids": np.array([[5, 6, 7]], dtype=np.int32), **extra}


def test_the_input_is_read_as_text_and_checked_against_the_pipelines_kinds(tiny_engines):
    pipeline = with_kinds(tiny_engines["ngram"].pipeline, "chat", "code")
    request = generation_request(inputs(request_kind=np.array([[b"code"]], dtype=object)), pipeline)
    assert request.kind == "code" and request.kind_label == "code"
    check_request(request, pipeline, 128, 10_000)
    unlabelled = generation_request(inputs(), pipeline)
    assert unlabelled.kind is None and unlabelled.kind_label == UNSPECIFIED_KIND
    with pytest.raises(RequestError, match="request_kind: expected one string per request, got shape"):
        generation_request(inputs(request_kind=np.array([[b"chat", b"code"]], dtype=object)), pipeline)
    with pytest.raises(RequestError, match="request_kind: not valid UTF-8"):
        generation_request(inputs(request_kind=np.array([[b"\xff"]], dtype=object)), pipeline)


@pytest.mark.parametrize("kind, message", [
    ("poetry", "request_kind: 'poetry' is not one of serving.request_kinds (allowed: chat, code)"),
    ("Chat", "request_kind: 'Chat' is not a kind"),
    ("x" * 5000, "request_kind: 'xxxx"),  # named, and short: the message quotes a bounded prefix
    ("unspecified", "request_kind: 'unspecified' is the label of requests without a kind"),
])
def test_unknown_or_malformed_kinds_are_refused_naming_the_field(tiny_engines, kind, message):
    pipeline = with_kinds(tiny_engines["ngram"].pipeline, "chat", "code")
    with pytest.raises(RequestError) as refused:
        check_request(GenerationRequest([5, 6], 4, SamplingParams(), kind=kind), pipeline, 128, 10_000)
    assert str(refused.value).startswith(message) and len(str(refused.value)) < 200


def test_a_pipeline_without_kinds_refuses_every_kind(tiny_engines):
    with pytest.raises(RequestError, match="this pipeline lists no serving.request_kinds"):
        check_request(GenerationRequest([5, 6], 4, SamplingParams(), kind="chat"), tiny_engines["ngram"].pipeline,
                      128, 10_000)


def test_the_serving_loop_counts_acceptance_per_kind(tiny_engines):
    engine = Engine(tiny_engines["draft_target"].dir, batch_size=4)
    engine.pipeline = with_kinds(engine.pipeline, "chat", "code")
    scheduler = Scheduler(engine)
    try:
        sent = {"chat": [[5, 40, 41, 42], [70, 71, 72, 70]], "code": [[10, 11, 12, 13]], None: [[3, 4, 5, 6]]}
        collectors = {kind: [] for kind in sent}
        for kind, prompts in sent.items():
            for prompt in prompts:
                collectors[kind].append(Collector())
                scheduler.submit(GenerationRequest(prompt, 20, SamplingParams(), end_id=-1, kind=kind),
                                 collectors[kind][-1])
        for collected in collectors.values():
            assert all(c.done.wait(60) for c in collected)
        totals = scheduler.counters.by_kind
        assert set(totals) == {"chat", "code", UNSPECIFIED_KIND}
        for kind, collected in collectors.items():
            counted = totals[kind or UNSPECIFIED_KIND]
            assert counted.drafted == sum(c.stats.drafted for c in collected) > 0
            assert counted.accepted == sum(c.stats.accepted for c in collected)
            assert sum(counted.accepted_per_position) == counted.accepted
        assert scheduler.counters.drafted == sum(t.drafted for t in totals.values())
    finally:
        scheduler.stop()
