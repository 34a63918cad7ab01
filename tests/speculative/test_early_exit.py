"""Early-exit self-speculation: the target's first layers draft, the verify resumes after them, and the cache's two
bookkeeping paths (early layers written ahead while drafting, the rest at verify) leave it exactly as plain decode
would. Greedy equals plain (fp32, alone and in a continuous batch); sampled early exit emits the target's
distribution, and a wrong rule fails the same test; the build measures the exit layer; TensorRT-LLM is refused."""

from __future__ import annotations

import json

import pytest
import torch
from helpers.batch import assert_continuous_batch_equals_alone
from helpers.early_exit import LAYERS, early_exit_pipeline, save_shallow_tail
from helpers.marginals import exact_marginals, sampled_checks
from helpers.pipelines import trtllm_pipeline
from helpers.prompts import PROMPTS

from specdeploy.build.torch_engine import build
from specdeploy.errors import BuildError, PipelineError
from specdeploy.models.llama import DecoderLayer
from specdeploy.runtime import verify_shape
from specdeploy.runtime.engine import Engine
from specdeploy.spec.engine_paths import MEASURED_EXIT_FILE
from specdeploy.spec.pipeline import load_pipeline
from specdeploy.spec.request import NO_END_ID, GenerationRequest
from specdeploy.spec.sampling_params import SamplingParams
from specdeploy.speculative.acceptance import accept
from specdeploy.workflows import build_torch_engine


@pytest.fixture(scope="module")
def shallow_tail(tmp_path_factory):
    return save_shallow_tail(tmp_path_factory.mktemp("early-exit") / "target")


@pytest.fixture(scope="module")
def engine_dir(shallow_tail, tmp_path_factory):
    root = tmp_path_factory.mktemp("early-exit-engine")
    return build(load_pipeline(early_exit_pipeline(root, shallow_tail)), root / "engines", quiet=True).directory


def greedy(prompt, gamma=None, tokens=40):
    return GenerationRequest(prompt, tokens, SamplingParams(), gamma, end_id=NO_END_ID)


def test_greedy_early_exit_equals_plain_alone(engine_dir):
    engine = Engine(engine_dir)
    accepted = rejected = 0
    for prompt in PROMPTS:
        plain = engine.start(greedy(prompt, 0)).run()
        generation = engine.start(greedy(prompt))
        assert generation.run() == plain
        accepted += generation.stats.accepted
        rejected += generation.stats.drafted - generation.stats.accepted
    assert accepted > 0 and rejected > 0  # both paths of the cache's bookkeeping were exercised


def test_greedy_early_exit_equals_plain_in_a_continuous_batch(engine_dir):
    assert_continuous_batch_equals_alone(engine_dir)


def test_the_verify_resumes_after_the_exit_layer(engine_dir, monkeypatch):
    """One step drafting 3 tokens runs each early layer 4 times (the pending token and three drafts, the last
    without its head) and each later layer once (the verify): the early layers' entries are never recomputed."""
    engine = Engine(engine_dir)
    sequence = engine.new_sequence(greedy(PROMPTS[0], 3))
    engine.decoder.prefill(sequence, 0)
    calls = {}
    original = DecoderLayer.forward

    def counted(layer, *args, **kwargs):
        index = next(i for i, candidate in enumerate(engine.target.layers) if candidate is layer)
        calls[index] = calls.get(index, 0) + 1
        return original(layer, *args, **kwargs)

    monkeypatch.setattr(DecoderLayer, "forward", counted)
    engine.decoder.step([sequence])
    assert calls == {0: 4, 1: 4, 2: 1, 3: 1}


def test_a_rejected_burst_leaves_the_cache_as_a_fresh_prefill_would(engine_dir):
    """After a step that rejected drafts, every layer's committed entries equal those of one prefill of the
    committed text: the rejected drafts' early-layer entries, written while drafting, are past the row's length."""
    engine = Engine(engine_dir)
    sequence = engine.new_sequence(greedy(PROMPTS[2], 3, 60))
    engine.decoder.prefill(sequence, 0)
    rejected = False
    while sequence.finish_reason is None and not rejected:
        before = sequence.stats.drafted - sequence.stats.accepted
        engine.decoder.step([sequence])
        rejected = sequence.stats.drafted - sequence.stats.accepted > before
    assert rejected
    length = sequence.cache_length
    fresh = engine.target.new_cache(1, length + 1)
    with torch.inference_mode():
        engine.target(torch.tensor([sequence.committed[:length]]), torch.arange(length)[None], fresh)
    for layer in range(LAYERS):
        for kept, expected in zip(engine.cache.layer(layer), fresh.layer(layer)):
            torch.testing.assert_close(kept[0, :, :length], expected[0, :, :length], atol=1e-4, rtol=1e-4)


SAMPLED = SamplingParams(temperature=1.0, top_k=4, repetition_penalty=1.2)
GENERATIONS, LENGTH = 2000, 3


@pytest.fixture(scope="module")
def marginals(engine_dir):
    return exact_marginals(Engine(engine_dir), PROMPTS[1], SAMPLED, LENGTH)


def test_sampled_early_exit_emits_the_targets_distribution(engine_dir, marginals):
    checks, accepted = sampled_checks(Engine(engine_dir), PROMPTS[1], SAMPLED, GENERATIONS, marginals)
    assert accepted > GENERATIONS // 4  # later positions were often emitted from accepted drafts
    assert all(check.ok for check in checks), "\n".join(map(str, checks))


def test_a_wrong_rule_fails_the_same_test(engine_dir, marginals, monkeypatch):
    """Negative control: the chain rule handed the target's distribution as the draft's (the processors of one side
    on the other, in the extreme), so it accepts every draft: emitted tokens then follow the early exit's q."""
    monkeypatch.setattr(verify_shape, "accept",
                        lambda tokens, q, p, drafted, streams: accept(tokens, p[:, :-1], p, drafted, streams))
    checks, _ = sampled_checks(Engine(engine_dir), PROMPTS[1], SAMPLED, GENERATIONS, marginals)
    assert not all(check.ok for check in checks), "\n".join(map(str, checks))


def test_the_draft_proposes_only_its_vocabulary(engine_dir):
    engine = Engine(engine_dir)
    vocabulary = set(json.loads((engine_dir / "early_exit.json").read_text())["draft_vocab"])
    assert len(vocabulary) == 96
    sequence = engine.new_sequence(GenerationRequest(PROMPTS[0], 30, SamplingParams(temperature=1.0, seed=3), 3,
                                                     end_id=NO_END_ID))
    engine.decoder.prefill(sequence, 0)
    for _ in range(5):
        proposal = engine.proposer.propose([sequence], [3])
        assert set(proposal.tokens[0].tolist()) <= vocabulary
        assert float(proposal.q[0][:, sorted(set(range(128)) - vocabulary)].sum()) == 0.0
        engine.decoder.step([sequence])


def test_build_measures_the_exit_layer(shallow_tail, tmp_path):
    pipeline = load_pipeline(early_exit_pipeline(tmp_path, shallow_tail, "tiny-measured", exit_layer="measured",
                                                 sweep=[1, 2, 3, 9]))
    result = build_torch_engine(pipeline, tmp_path / "engines", quiet=True)
    measured = json.loads((result.directory / MEASURED_EXIT_FILE).read_text())
    assert set(measured["realized_speedup_by_layer"]) == {"1", "2", "3"}  # 9 is past the target's 4 layers
    best = max(measured["realized_speedup_by_layer"], key=measured["realized_speedup_by_layer"].get)
    assert measured["exit_layer"] == int(best)
    assert Engine(result.directory).proposer.model.exit_layer == int(best)


def test_bad_settings_are_named(shallow_tail, tmp_path):
    with pytest.raises(BuildError, match="exit_layer: 4 must be below the target's 4 layers"):
        build(load_pipeline(early_exit_pipeline(tmp_path, shallow_tail, exit_layer=4)), tmp_path / "e", quiet=True)
    with pytest.raises(PipelineError, match="exit_layer: must be ≥ 1 or 'measured', got 0"):
        load_pipeline(early_exit_pipeline(tmp_path, shallow_tail, exit_layer=0))


def test_tensorrt_llm_has_no_early_exit(shallow_tail, tmp_path):
    path = trtllm_pipeline(tmp_path, shallow_tail, speculation={"method": "early_exit"})
    with pytest.raises(PipelineError, match="early_exit has no TensorRT-LLM path"):
        load_pipeline(path)
