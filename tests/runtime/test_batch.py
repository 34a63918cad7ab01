"""The batch decoder's seams: one host read per step, proposers kept in step across policy changes, statistics of
what was committed, stop sequences over generated text only, and what a seed reproduces."""

from __future__ import annotations

import pytest
import torch
from helpers.batch import HostReads, mixed_requests
from helpers.collector import Collector
from helpers.prompts import PROMPTS

from specdeploy.runtime.engine import Engine
from specdeploy.runtime.scheduler import Scheduler
from specdeploy.spec.pipeline import PolicySpec, ServingSpec
from specdeploy.spec.request import NO_END_ID, GenerationRequest
from specdeploy.spec.sampling_params import SamplingParams

GREEDY = SamplingParams()


@pytest.fixture(scope="module")
def rows(tiny_engines) -> dict[str, Engine]:
    """Engines with five cache rows."""
    return {kind: Engine(tiny_engines[kind].dir, batch_size=5) for kind in ("draft_target", "int4", "ngram")}


def test_host_read_counter_counts():
    with HostReads() as reads:
        torch.tensor([1, 2]).tolist()
        int(torch.tensor(3))
        bool(torch.tensor(True))
    assert reads.count == 3
    assert torch.Tensor.tolist is torch._C.TensorBase.tolist  # restored


@pytest.mark.parametrize("kind", ["draft_target", "int4", "ngram"])
def test_one_host_read_per_batched_step(rows, kind):
    """Greedy, sampled and penalised rows with different proposal lengths verify with one host read per step."""
    engine = rows[kind]
    sequences = [engine.new_sequence(request) for request in mixed_requests()]
    for row, sequence in enumerate(sequences):
        engine.decoder.prefill(sequence, row)
    drafted_before = [s.stats.drafted for s in sequences]
    for _ in range(4):
        with HostReads() as reads:
            engine.decoder.step(sequences)
        assert reads.count == 1
    if kind != "ngram":  # a draft model proposes for every row; prompt lookup only where an n-gram recurs
        assert all(s.stats.drafted > before for s, before in zip(sequences, drafted_before))


@pytest.mark.parametrize("kind", ["draft_target", "int4"])
def test_drafting_resumes_after_the_policy_turned_it_off(tiny_engines, rows, kind):
    """Five rows turn drafting off. When four of them finish together, a request with a 50-token prompt takes a
    freed row and drafting resumes: the long request's own-cache draft lags by every token it skipped (~230),
    more than the new row has room for past its own length. Each row catches up alone, so no row is padded to
    another's lag (which wrote past the cache's end: IndexError for every active request). Every output equals
    the same request served alone."""
    long_prompt = [(7 * i) % 90 + 3 for i in range(50)]
    requests = [GenerationRequest(PROMPTS[2], 240, GREEDY, end_id=NO_END_ID)]
    requests += [GenerationRequest(PROMPTS[i % 3], 230, GREEDY, end_id=NO_END_ID) for i in range(4)]
    requests += [GenerationRequest(long_prompt, 100, GREEDY, end_id=NO_END_ID)]  # waits for a free row
    expected = [tiny_engines[kind].start(request).run() for request in requests]
    scheduler = Scheduler(rows[kind], ServingSpec(PolicySpec(full_up_to=2, off_above=4)))
    try:
        collectors = [Collector() for _ in requests]
        queued = [scheduler.submit(request, collector) for request, collector in zip(requests, collectors)]
        assert all(collector.done.wait(120) for collector in collectors)
    finally:
        scheduler.stop()
    assert [c.reason for c in collectors] == ["length"] * 6
    assert [c.tokens for c in collectors] == expected
    assert queued[-1].sequence.stats.drafted > 0  # drafting did resume


def test_statistics_count_only_committed_drafts(tiny_engines):
    """A stop sequence that ends inside a run of accepted drafts: the drafts after it were accepted by
    verification but never emitted, and are not counted."""
    engine = tiny_engines["int4"]
    generation = engine.start(GenerationRequest(PROMPTS[0], 60, GREEDY, 4, end_id=NO_END_ID))
    chunks = list(generation)
    tokens = generation.tokens
    step = next(i for i, chunk in enumerate(chunks) if i > 0 and len(chunk) >= 3)
    end = sum(len(chunk) for chunk in chunks[:step]) + 1  # cut after the first accepted draft of that step
    stop = next(tokens[end - n:end] for n in range(1, end) if tokens[end - n:end] not in
                [tokens[i - n:i] for i in range(n, end)])  # the shortest tail that occurs nowhere earlier
    stopped = engine.start(GenerationRequest(PROMPTS[0], 60, GREEDY, 4, [stop], end_id=NO_END_ID))
    assert stopped.run() == tokens[:end]
    stats = stopped.stats
    assert stats.finish_reason == "stop" and stats.steps == step
    # Every step commits its accepted drafts and its final token, except the last, cut after one accepted draft.
    assert stats.accepted == stats.generated_tokens - stats.steps == sum(stats.accepted_per_position)
    assert stats.accepted < generation.stats.accepted


def test_a_stop_sequence_beginning_in_the_prompt_does_not_fire(tiny_engines):
    engine = tiny_engines["draft_target"]
    plain = engine.start(GenerationRequest(PROMPTS[0], 12, GREEDY, 0, end_id=NO_END_ID)).run()
    across = [PROMPTS[0][-1], plain[0]]  # the prompt's last token, then the first generated one
    generation = engine.start(GenerationRequest(PROMPTS[0], 12, GREEDY, 3, [across], end_id=NO_END_ID))
    assert generation.run() == plain and generation.stats.finish_reason == "length"
    inside = engine.start(GenerationRequest(PROMPTS[0], 12, GREEDY, 3, [plain[1:3]], end_id=NO_END_ID))
    assert inside.run() == plain[:3] and inside.stats.finish_reason == "stop"


def test_end_id_replaces_the_end_of_sequence_tokens(tiny_engines):
    engine = tiny_engines["ngram"]
    plain = engine.start(GenerationRequest(PROMPTS[2], 20, GREEDY, end_id=NO_END_ID)).run()
    generation = engine.start(GenerationRequest(PROMPTS[2], 20, GREEDY, end_id=plain[4]))
    assert generation.run() == plain[:plain.index(plain[4]) + 1] and generation.stats.finish_reason == "stop"


def test_a_seed_reproduces_plain_decode_whatever_shares_the_batch(tiny_engines):
    """What a seed guarantees (docs/serving.md): a seed is the request's own random stream, so with batch-invariant
    serving a seeded plain request (num_draft_tokens 0) gets its text alone beside speculative neighbours that draw
    their own samples, drafting turned on and off. (batch_dependent keeps no such promise in a batch:
    tests/runtime/test_what_a_seed_guarantees.py.)"""
    params = SamplingParams(temperature=0.9, top_p=0.95, seed=11)
    request = GenerationRequest(PROMPTS[0], 40, params, 0, end_id=NO_END_ID)
    engine = Engine(tiny_engines["draft_target"].dir, batch_size=5, determinism="batch_invariant")
    alone = engine.start(request).run()
    scheduler = Scheduler(engine, ServingSpec(PolicySpec(full_up_to=1, off_above=2)))
    try:
        others = [Collector() for _ in range(3)]
        for prompt, collector in zip(PROMPTS, others):  # speculative neighbours, drafting turned on and off
            scheduler.submit(GenerationRequest(prompt, 15, SamplingParams(temperature=1.0, seed=3)), collector)
        again = Collector()
        scheduler.submit(request, again)
        assert again.done.wait(60) and all(c.done.wait(60) for c in others)
    finally:
        scheduler.stop()
    assert again.tokens == alone
