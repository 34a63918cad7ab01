"""What a seed guarantees (docs/serving.md), checked claim by claim on SmolLM2 in bf16 in each serving.determinism:
the same request alone, alone again and beside seven companions (in-process, through the scheduler), and greedy text
with speculation against plain decode's, alone.

A "same" claim holds on every prompt tried. A "may differ" claim is shown to differ on some prompt, at a near tie of
the target's top two logits where greedy: otherwise the docs would promise less than the mode keeps (or the batch
invariant mode would buy nothing). Which prompts part depends on the CPU's kernels, so the tests try several.
"""

from __future__ import annotations

import pytest
from helpers.batch import run_together

from specdeploy.bench.greedy_check import compare_greedy
from specdeploy.runtime.engine import Engine
from specdeploy.runtime.scheduler import Scheduler
from specdeploy.spec.pipeline import PolicySpec, ServingSpec
from specdeploy.spec.request import GenerationRequest
from specdeploy.spec.sampling_params import SamplingParams

pytestmark = [pytest.mark.smollm2, pytest.mark.slow]
# The first prompts are those that parted first on a 2-core AVX-512 EPYC; the others give another CPU's near ties a
# chance before a test fails.
PROMPTS = ["Summarise the plot of Hamlet.", "What are three good habits for staying healthy? Explain each briefly.",
           "Give me a recipe idea for a quick vegetarian dinner.", "Explain what a CPU cache is in two sentences.",
           "Write a haiku about rain.", "List three uses of Python.", "Give me a tip for sleeping well.",
           "Describe a cat in one sentence."]
MAX_TOKENS = 24
SEEDED = {"temperature": 0.7, "top_k": 40, "top_p": 0.9, "repetition_penalty": 1.1, "seed": 13}  # soak 5's repro
COMPANION = "Count from 1 to 3000."
COMPANIONS = 7  # a full batch of 8, as under load
# Every request keeps its gamma in a batch of 8, so that only the batch differs between alone and beside companions.
KEEP_GAMMA = ServingSpec(PolicySpec(full_up_to=8, off_above=8, gamma_cap=8))
REQUESTS = {"seeded plain": {**SEEDED, "num_draft_tokens": 0}, "seeded speculative": SEEDED,
            "greedy speculative": {}}


def alone_again_and_beside_companions(scheduler: Scheduler, engine: Engine, prompt: str,
                                      fields: dict) -> tuple[list[int], list[int], list[int]]:
    """The request's tokens alone, alone again, and beside COMPANIONS long greedy requests."""
    request = GenerationRequest.with_defaults(engine.pipeline, engine.encode_prompt(prompt), max_tokens=MAX_TOKENS,
                                              **fields)
    companion = GenerationRequest.with_defaults(engine.pipeline, engine.encode_prompt(COMPANION),
                                                max_tokens=2 * MAX_TOKENS, end_id=-1)
    alone, again = (run_together(scheduler, [request])[0] for _ in range(2))
    beside = run_together(scheduler, [request] + [companion] * COMPANIONS)[0]
    return alone, again, beside


@pytest.mark.parametrize("method", ["ngram", "lookahead"])  # a chain method and a tree method
def test_batch_invariant_keeps_each_request_its_text_beside_companions(smollm2_bf16_engine_dir, method):
    """batch_invariant, the policy keeping every request's gamma: seeded plain, seeded speculative and greedy
    speculative requests get the same text alone, alone again and beside seven companions."""
    engine = Engine(smollm2_bf16_engine_dir, method=method, batch_size=1 + COMPANIONS,
                    determinism="batch_invariant")
    scheduler = Scheduler(engine, KEEP_GAMMA)
    try:
        for prompt in PROMPTS[1:2]:  # one prompt, three kinds of request: about 15 s a prompt and method
            for kind, fields in REQUESTS.items():
                alone, again, beside = alone_again_and_beside_companions(scheduler, engine, prompt, fields)
                assert again == alone and beside == alone, (prompt, kind)
    finally:
        scheduler.stop()


def test_batch_dependent_changes_seeded_plain_text_beside_companions(smollm2_bf16_engine_dir):
    """batch_dependent (the default): a seeded plain request gets the same text alone and alone again, and beside
    seven companions text of its own (soak 5: 107 of 107 under load). Plain decode in a batch is no exception."""
    engine = Engine(smollm2_bf16_engine_dir, batch_size=1 + COMPANIONS, determinism="batch_dependent")
    scheduler = Scheduler(engine, KEEP_GAMMA)
    try:
        for prompt in PROMPTS:
            alone, again, beside = alone_again_and_beside_companions(scheduler, engine, prompt,
                                                                     REQUESTS["seeded plain"])
            assert again == alone, prompt
            if beside != alone:
                return
    finally:
        scheduler.stop()
    pytest.fail(f"a seeded plain request got its text alone beside {COMPANIONS} companions for all {len(PROMPTS)} "
                f"prompts")


def test_a_seeded_speculative_request_gets_other_text_once_the_policy_turns_drafting_off(smollm2_bf16_engine_dir):
    """batch_invariant too: beside seven companions the pipeline's own policy (off above 4 sequences) turns drafting
    off, so every position of a seeded speculative request is sampled, where alone acceptance decided some: its text
    differs from its text alone, for some prompt."""
    engine = Engine(smollm2_bf16_engine_dir, method="lookahead", batch_size=1 + COMPANIONS,
                    determinism="batch_invariant")
    assert engine.pipeline.serving.policy.off_above < 1 + COMPANIONS
    scheduler = Scheduler(engine)
    try:
        for prompt in PROMPTS:
            alone, again, beside = alone_again_and_beside_companions(scheduler, engine, prompt,
                                                                     REQUESTS["seeded speculative"])
            assert again == alone, prompt
            if beside != alone:
                return
    finally:
        scheduler.stop()
    pytest.fail(f"a seeded speculative request got its text alone with drafting off for all {len(PROMPTS)} prompts")


@pytest.mark.parametrize(("method", "determinism"), [("ngram", "batch_dependent"), ("lookahead", "batch_dependent"),
                                                     ("lookahead", "batch_invariant")])
def test_greedy_speculation_alone_parts_from_plain_at_a_near_tie(smollm2_bf16_engine_dir, method, determinism):
    """Served alone, greedy text with speculation parts from plain decode's for some prompt, at a near tie: in
    batch_dependent for any method (a verify computes a position among others in one call), in batch_invariant for a
    tree method (its tree is attended in one masked call). A chain method's batch-invariant verify computes each
    position as plain decode does: tests/serve/test_batch_invariance.py."""
    engine = Engine(smollm2_bf16_engine_dir, method=method, determinism=determinism)
    for prompt in PROMPTS:
        ids = engine.encode_prompt(prompt)
        plain = engine.generate(ids, SamplingParams(), MAX_TOKENS, num_draft_tokens=0).run()
        speculative = engine.generate(ids, SamplingParams(), MAX_TOKENS).run()
        verdict = compare_greedy(engine, ids, plain, speculative)
        if verdict["verdict"] != "match":
            assert verdict["verdict"] == "near_tie", (prompt, verdict)
            return
    # Near ties are where this CPU's kernels put them: none among these prompts is not a defect, only no evidence
    pytest.skip(f"greedy {method} text equalled plain decode's for all {len(PROMPTS)} prompts on this CPU")
