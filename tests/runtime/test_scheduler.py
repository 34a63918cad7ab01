"""Continuous batching: sequences stepped together give exactly what each gives alone, whatever joins or leaves."""

from __future__ import annotations

import pytest
from helpers.collector import Collector

from specdeploy.runtime.engine import Engine
from specdeploy.runtime.scheduler import Scheduler
from specdeploy.spec.pipeline import PolicySpec, ServingSpec
from specdeploy.spec.request import GenerationRequest
from specdeploy.spec.sampling_params import SamplingParams

PROMPTS = [[5, 40, 41, 42, 43, 7, 9], [70, 71, 72, 70, 71, 72, 70, 71], [10, 11, 12, 13, 14, 15, 16, 17, 18, 19, 20],
           [3, 4, 5, 6, 3, 4, 5], [90, 91, 92, 93, 94, 95], [20, 21, 22, 20, 21, 22, 23, 24, 25]]


@pytest.fixture(scope="module")
def batched(tiny_engines) -> dict[str, Engine]:
    return {kind: Engine(tiny_engines[kind].dir, batch_size=4) for kind in ("draft_target", "int4", "ngram")}


@pytest.mark.parametrize("kind", ["draft_target", "int4", "ngram"])
def test_concurrent_sequences_equal_their_solo_outputs(tiny_engines, batched, kind):
    alone = tiny_engines[kind]
    expected = [alone.generate(p, SamplingParams(), 30 + 5 * i).run() for i, p in enumerate(PROMPTS)]
    # Every batch size uses full gamma, so rows with different proposal lengths share steps.
    scheduler = Scheduler(batched[kind], ServingSpec(PolicySpec(full_up_to=4, off_above=4)))
    try:
        collectors = [Collector() for _ in PROMPTS]
        for i, (prompt, collector) in enumerate(zip(PROMPTS, collectors)):  # 6 requests, 4 rows: some queue
            scheduler.submit(GenerationRequest(prompt, 30 + 5 * i, SamplingParams(), 1 + i % 4), collector)
        for collector in collectors:
            assert collector.done.wait(60)
        assert [c.tokens for c in collectors] == expected
        assert all(c.reason in ("stop", "length") for c in collectors)
        assert scheduler.free_kv_slots == scheduler.kv_capacity and not scheduler.active
        assert scheduler.counters.outcomes.get("length", 0) + scheduler.counters.outcomes.get("stop", 0) == 6
    finally:
        scheduler.stop()


def test_sampled_requests_are_independent_of_their_batch(tiny_engines, batched):
    """Each request has its own random stream: seeded outputs do not depend on what shares the batch."""
    params = SamplingParams(temperature=0.8, top_k=30, seed=3)
    solo = Scheduler(batched["draft_target"])
    try:
        first = Collector()
        solo.submit(GenerationRequest(PROMPTS[0], 25, params), first)
        assert first.done.wait(60)
    finally:
        solo.stop()
    crowded = Scheduler(batched["draft_target"], ServingSpec(PolicySpec(full_up_to=4, off_above=4)))
    try:
        others = [Collector() for _ in range(3)]
        for prompt, collector in zip(PROMPTS[1:4], others):
            crowded.submit(GenerationRequest(prompt, 25, SamplingParams(temperature=1.0, seed=9)), collector)
        again = Collector()
        crowded.submit(GenerationRequest(PROMPTS[0], 25, params), again)
        assert again.done.wait(60) and all(c.done.wait(60) for c in others)
    finally:
        crowded.stop()
    assert again.tokens == first.tokens


def test_cancel_frees_the_row_and_its_kv_reservation(batched):
    scheduler = Scheduler(batched["int4"])
    try:
        cancelled, survivor = Collector(), Collector()
        request = scheduler.submit(GenerationRequest(PROMPTS[2], 200, SamplingParams()), cancelled)
        scheduler.submit(GenerationRequest(PROMPTS[1], 40, SamplingParams()), survivor)
        while len(cancelled.tokens) < 3:
            assert not cancelled.done.wait(0.01)
        scheduler.cancel(request)
        assert cancelled.done.wait(30) and cancelled.reason == "cancelled"
        assert survivor.done.wait(60) and survivor.reason in ("stop", "length")
        assert scheduler.free_kv_slots == scheduler.kv_capacity
        assert scheduler.counters.outcomes["cancelled"] == 1
    finally:
        scheduler.stop()


def test_request_over_the_kv_capacity_is_refused(batched):
    from specdeploy.errors import RequestError

    scheduler = Scheduler(batched["ngram"], ServingSpec(kv_capacity_tokens=50))
    try:
        with pytest.raises(RequestError, match="max_tokens.*KV slots"):
            scheduler.submit(GenerationRequest(PROMPTS[0], 100, SamplingParams()), Collector())
    finally:
        scheduler.stop()


def test_a_request_gamma_above_the_pipelines_is_honoured(batched):
    """The policy scales each request's own gamma; a larger per-request num_draft_tokens is not cut to the
    pipeline's (3 for the tiny engines)."""
    scheduler = Scheduler(batched["int4"], ServingSpec(PolicySpec(full_up_to=1, off_above=4)))
    try:
        collector = Collector()
        request = scheduler.submit(GenerationRequest(PROMPTS[1], 40, SamplingParams(), 8), collector)
        assert collector.done.wait(60)
        assert len(request.sequence.stats.drafted_per_position) > 3
    finally:
        scheduler.stop()
