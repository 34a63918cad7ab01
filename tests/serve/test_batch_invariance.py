"""serving.determinism: batch_invariant on the real SmolLM2 in bf16, where batching changes text otherwise.

In-process, many batch compositions through the scheduler (sizes, orders, plain and speculative rows, greedy and
seeded rows side by side) give each request byte-identical tokens to the same request alone; the same engine
loaded batch_dependent fails the same comparison (the test's power). Over gRPC, a served bf16 pipeline answers
greedy and seeded requests alone and in a full batch with the same text.
"""

from __future__ import annotations

import random
import threading
from concurrent.futures import ThreadPoolExecutor

import pytest
import yaml
from helpers.pipelines import write_pipeline
from helpers.repo import REPO

from specdeploy.serve.client import generate
from specdeploy.spec.request import GenerationRequest

pytestmark = [pytest.mark.smollm2, pytest.mark.slow]
PROMPTS = ["Explain what a CPU cache is in two sentences.", "Write a haiku about rain.",
           "What is the capital of France?", "List three uses of Python.", "Describe a cat in one sentence.",
           "What is 17 times 23?", "Give me a tip for sleeping well.", "Summarise the plot of Hamlet."]
MAX_TOKENS = 32
SEEDED = {"temperature": 0.8, "seed": 1234}


@pytest.fixture(scope="module")
def bf16_engine_dir(tmp_path_factory):
    """The shipped n-gram pipeline with a bf16 target (dense: its matmuls are oneDNN's bf16 kernels) and
    batch-invariant serving; gamma capped at 8 instead of measured at build."""
    from specdeploy.build.torch_engine import build
    from specdeploy.spec.pipeline import load_pipeline

    root = tmp_path_factory.mktemp("bf16")
    spec = yaml.safe_load((REPO / "pipelines" / "smollm2-ngram.yaml").read_text())
    spec["name"] = "smollm2-bf16-invariant"
    spec["target"].pop("weight_only")
    spec["serving"] = {"policy": {"gamma_cap": 8}, "determinism": "batch_invariant"}
    return build(load_pipeline(write_pipeline(root / "bf16.yaml", **spec)), root / "engines", quiet=True).directory


def run_together(scheduler, engine, requests: list[GenerationRequest]) -> list[list[int]]:
    """Submit every request at once; each one's tokens."""
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
            for request, tokens in zip(batch, run_together(scheduler, engine, batch)):
                key = (tuple(request.prompt_ids), request.num_draft_tokens, request.sampling)
                if key not in alone:
                    alone[key] = run_together(scheduler, engine, [request])[0]
                differed += tokens != alone[key]
                compared += 1
            if until_one_differs and differed:
                break
        return differed, compared
    finally:
        scheduler.stop()


def test_every_batch_composition_gives_each_request_its_text_alone(bf16_engine_dir):
    """Batch-invariant: greedy requests (plain or speculative, under the batch-size policy) and seeded plain ones
    come out byte-identical to the same request alone in every composition. Batch-dependent, the same comparison
    finds requests whose text the batch changed: the test can fail."""
    differed, compared = differences_in_batches(bf16_engine_dir, "batch_invariant", 4)
    assert compared >= 12 and differed == 0
    differed, compared = differences_in_batches(bf16_engine_dir, "batch_dependent", 4, until_one_differs=True)
    assert differed > 0, f"batch-dependent decoding matched alone in all {compared} requests"


def test_greedy_text_is_the_same_with_and_without_speculation(bf16_engine_dir):
    """Batch-invariant verify steps compute each position as plain decoding does, so a greedy speculative request
    and a plain one give the same tokens in bf16."""
    from specdeploy.runtime.engine import Engine
    from specdeploy.spec.sampling_params import SamplingParams

    engine = Engine(bf16_engine_dir)
    for prompt in PROMPTS[:4]:
        ids = engine.encode_prompt(prompt)
        speculative = engine.generate(ids, SamplingParams(), MAX_TOKENS)
        tokens = speculative.run()
        assert speculative.stats.accepted > 0
        assert tokens == engine.generate(ids, SamplingParams(), MAX_TOKENS, num_draft_tokens=0).run()


def test_served_bf16_text_is_the_same_alone_and_in_a_full_batch(bf16_engine_dir, tmp_path):
    """Over gRPC through the ensemble: eight streams at once (the batch full) answer each greedy speculative
    request and each seeded plain request with the bytes it gets alone."""
    from specdeploy.package.repository import write_repository
    from specdeploy.serve.tritonserver import TritonServer

    requests = [(prompt, {"temperature": 0.0}) for prompt in PROMPTS[:4]]
    requests += [(prompt, {"temperature": 0.8, "random_seed": 1234, "num_draft_tokens": 0}) for prompt in PROMPTS[4:]]
    repository = write_repository(bf16_engine_dir, tmp_path / "repository")
    with TritonServer(repository, log_file=tmp_path / "tritonserver.log") as server:
        def text(request) -> str:
            prompt, fields = request
            return "".join(c.text for c in generate(server.grpc_url, prompt, MAX_TOKENS, model="ensemble",
                                                    **fields))

        alone = [text(request) for request in requests]
        with ThreadPoolExecutor(len(requests)) as pool:
            together = list(pool.map(text, requests))
    assert all(alone) and together == alone
