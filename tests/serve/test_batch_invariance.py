"""serving.determinism: batch_invariant on the real SmolLM2 in bf16, where batching changes text otherwise.

In-process, many batch compositions through the scheduler (sizes, orders, plain and speculative rows, greedy and
seeded rows side by side) give each request byte-identical tokens to the same request alone; the same engine
loaded batch_dependent fails the same comparison (the test's power). Over gRPC, a served bf16 pipeline answers
greedy and seeded requests alone and in a full batch with the same text. The claims of both modes, one by one:
tests/runtime/test_what_a_seed_guarantees.py.
"""

from __future__ import annotations

import random
from concurrent.futures import ThreadPoolExecutor

import pytest
from helpers.batch import run_together

from specdeploy.serve.client import generate
from specdeploy.spec.request import GenerationRequest

pytestmark = [pytest.mark.smollm2, pytest.mark.slow]
PROMPTS = ["Explain what a CPU cache is in two sentences.", "Write a haiku about rain.",
           "What is the capital of France?", "List three uses of Python.", "Describe a cat in one sentence.",
           "What is 17 times 23?", "Give me a tip for sleeping well.", "Summarise the plot of Hamlet."]
MAX_TOKENS = 32
SEEDED = {"temperature": 0.8, "seed": 1234}


def requests_for(engine, rng: random.Random, count: int) -> list[GenerationRequest]:
    """`count` requests: random prompts, plain or speculative, greedy or seeded."""
    chosen = []
    for _ in range(count):
        prompt = rng.choice(PROMPTS)
        sampling = SEEDED if rng.random() < 0.5 else {}
        gamma = 0 if rng.random() < 0.5 else None
        chosen.append(GenerationRequest.with_defaults(engine.pipeline, engine.encode_prompt(prompt),
                                                      max_tokens=MAX_TOKENS, num_draft_tokens=gamma, **sampling))
    return chosen


def differences_in_batches(engine_dir, determinism: str, compositions: int,
                           until_one_differs: bool = False) -> tuple[int, int]:
    """(requests whose tokens differed from the same request alone, requests compared) over random batches of
    greedy rows (plain or speculative) and seeded plain rows, stopping after the first batch with a difference when
    `until_one_differs`. Seeded speculative rows are left out: the policy changes their proposal lengths with the
    batch, and so which positions sampling decides (docs/serving.md)."""
    from specdeploy.runtime.engine import Engine
    from specdeploy.runtime.scheduler import Scheduler

    engine = Engine(engine_dir, batch_size=8, determinism=determinism)
    scheduler = Scheduler(engine)
    try:
        rng = random.Random(0)
        alone: dict = {}
        differed = compared = 0
        for _ in range(compositions):
            batch = [r for r in requests_for(engine, rng, rng.randint(2, 8))
                     if r.sampling.greedy or r.num_draft_tokens == 0]
            for request, tokens in zip(batch, run_together(scheduler, batch)):
                key = (tuple(request.prompt_ids), request.num_draft_tokens, request.sampling)
                if key not in alone:
                    alone[key] = run_together(scheduler, [request])[0]
                differed += tokens != alone[key]
                compared += 1
            if until_one_differs and differed:
                break
        return differed, compared
    finally:
        scheduler.stop()


def test_every_batch_composition_gives_each_request_its_text_alone(smollm2_bf16_engine_dir):
    """Batch-invariant: greedy requests (plain or speculative, under the batch-size policy) and seeded plain ones
    come out byte-identical to the same request alone in every composition. Batch-dependent, the same comparison
    finds requests whose text the batch changed: the test can fail."""
    differed, compared = differences_in_batches(smollm2_bf16_engine_dir, "batch_invariant", 4)
    assert compared >= 12 and differed == 0
    differed, compared = differences_in_batches(smollm2_bf16_engine_dir, "batch_dependent", 4, until_one_differs=True)
    assert differed > 0, f"batch-dependent decoding matched alone in all {compared} requests"


def test_greedy_text_is_the_same_with_and_without_speculation(smollm2_bf16_engine_dir):
    """A chain method's (n-gram's) batch-invariant verify steps compute each position as plain decoding does, so a
    greedy speculative request and a plain one give the same tokens in bf16. (A tree method's do not:
    tests/runtime/test_what_a_seed_guarantees.py.)"""
    from specdeploy.runtime.engine import Engine
    from specdeploy.spec.sampling_params import SamplingParams

    engine = Engine(smollm2_bf16_engine_dir)
    for prompt in PROMPTS[:4]:
        ids = engine.encode_prompt(prompt)
        speculative = engine.generate(ids, SamplingParams(), MAX_TOKENS)
        tokens = speculative.run()
        assert speculative.stats.accepted > 0
        assert tokens == engine.generate(ids, SamplingParams(), MAX_TOKENS, num_draft_tokens=0).run()


def test_served_bf16_text_is_the_same_alone_and_in_a_full_batch(smollm2_bf16_engine_dir, tmp_path):
    """Over gRPC through the ensemble: eight streams at once (the batch full) answer each greedy speculative
    request and each seeded plain request with the bytes it gets alone."""
    from specdeploy.package.repository import write_repository
    from specdeploy.serve.tritonserver import TritonServer

    requests = [(prompt, {"temperature": 0.0}) for prompt in PROMPTS[:4]]
    requests += [(prompt, {"temperature": 0.8, "random_seed": 1234, "num_draft_tokens": 0}) for prompt in PROMPTS[4:]]
    repository = write_repository(smollm2_bf16_engine_dir, tmp_path / "repository")
    with TritonServer(repository, log_file=tmp_path / "tritonserver.log") as server:
        def text(request) -> str:
            prompt, fields = request
            return "".join(c.text for c in generate(server.grpc_url, prompt, MAX_TOKENS, model="ensemble",
                                                    **fields))

        alone = [text(request) for request in requests]
        with ThreadPoolExecutor(len(requests)) as pool:
            together = list(pool.map(text, requests))
    assert all(alone) and together == alone
