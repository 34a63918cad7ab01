"""For the batch decoder's tests: a counter of host reads, a batch of mixed requests, and requests run together
through a scheduler."""

from __future__ import annotations

import threading

import torch

from helpers.prompts import PROMPTS
from specdeploy.spec.request import NO_END_ID, GenerationRequest
from specdeploy.spec.sampling_params import SamplingParams

GREEDY = SamplingParams()


class HostReads:
    """Counts every read of a tensor's values by Python (the host syncs of a GPU run) while active."""

    READS = ("tolist", "item", "numpy", "__bool__", "__int__", "__float__", "__index__")

    def __init__(self) -> None:
        self.count = 0
        self.saved = {}

    def __enter__(self) -> HostReads:
        for name in self.READS:
            original = getattr(torch.Tensor, name)
            self.saved[name] = torch.Tensor.__dict__.get(name)

            def counted(tensor, *args, _original=original, **kwargs):
                self.count += 1
                return _original(tensor, *args, **kwargs)

            setattr(torch.Tensor, name, counted)
        return self

    def __exit__(self, *exc) -> None:
        for name, saved in self.saved.items():
            if saved is None:
                delattr(torch.Tensor, name)
            else:
                setattr(torch.Tensor, name, saved)


def mixed_requests() -> list[GenerationRequest]:
    """Greedy, sampled, penalised and sampled-penalised requests with proposal lengths 3, 2, 4 and 1."""
    return [GenerationRequest(PROMPTS[0], 30, GREEDY, 3, end_id=NO_END_ID),
            GenerationRequest(PROMPTS[1], 30, SamplingParams(temperature=0.8, top_k=20, seed=1), 2, end_id=NO_END_ID),
            GenerationRequest(PROMPTS[2], 30, SamplingParams(repetition_penalty=1.3), 4, end_id=NO_END_ID),
            GenerationRequest(PROMPTS[1], 30, SamplingParams(temperature=1.0, repetition_penalty=1.2, seed=2), 1,
                              end_id=NO_END_ID)]


def assert_greedy_equals_plain_alone(engine_dir, max_tokens: int) -> tuple[int, int]:
    """Greedy, with speculation, one request at a time: every prompt gives the tokens plain decode gives it.
    Returns the drafted and accepted tokens in all, for the caller to assert the drafts were exercised."""
    from specdeploy.runtime.engine import Engine

    engine = Engine(engine_dir)
    drafted = accepted = 0
    for prompt in PROMPTS:
        plain = engine.start(GenerationRequest(prompt, max_tokens, GREEDY, 0, end_id=NO_END_ID)).run()
        generation = engine.start(GenerationRequest(prompt, max_tokens, GREEDY, None, end_id=NO_END_ID))
        assert generation.run() == plain, f"prompt {PROMPTS.index(prompt)}"
        drafted += generation.stats.drafted
        accepted += generation.stats.accepted
    return drafted, accepted


def assert_continuous_batch_equals_alone(engine_dir, max_tokens: int = 30, batch_size: int = 4) -> None:
    """Greedy, with speculation: every prompt (each twice, so rows join and leave) through a scheduler of
    `batch_size` rows gives the tokens plain decode gives it alone."""
    from helpers.collector import Collector
    from specdeploy.runtime.engine import Engine
    from specdeploy.runtime.scheduler import Scheduler

    engine = Engine(engine_dir)
    expected = [engine.start(GenerationRequest(p, max_tokens, GREEDY, 0, end_id=NO_END_ID)).run() for p in PROMPTS]
    scheduler = Scheduler(lambda: Engine(engine_dir, batch_size=batch_size))
    try:
        collectors = [Collector() for _ in PROMPTS * 2]
        for collector, prompt in zip(collectors, PROMPTS * 2):
            scheduler.submit(GenerationRequest(prompt, max_tokens, GREEDY, None, end_id=NO_END_ID), collector)
        for collector, tokens in zip(collectors, expected * 2):
            assert collector.done.wait(60) and collector.tokens == tokens
    finally:
        scheduler.stop()


def run_together(scheduler, requests: list[GenerationRequest]) -> list[list[int]]:
    """Every request submitted to `scheduler` at once; each one's tokens."""
    outputs: list[list[int]] = [[] for _ in requests]
    done = [threading.Event() for _ in requests]
    for index, request in enumerate(requests):
        def on_tokens(tokens, finished, stats, index=index):
            outputs[index].extend(tokens)
            if finished is not None:
                done[index].set()
        scheduler.submit(request, on_tokens)
    for event in done:
        assert event.wait(300)
    return outputs
