"""bench --context: prompts padded with held-out text to each length, decoded past the pipeline's own limits, and
the bytes model that carries the shortest length's costs to the others (bench/context_sweep.py)."""

from __future__ import annotations

import json

import pytest
from helpers.cli import run_cli
from helpers.pipelines import tiny_pipeline
from PIL import Image

from specdeploy.bench.context_markdown import write_context_report
from specdeploy.bench.context_sweep import StepBytes, carried_costs, check_contexts, run_context_sweep
from specdeploy.errors import SpecdeployError
from specdeploy.runtime.engine import Engine

PROMPTS = [{"prompt": "hello world, hello", "kind": "open"}, {"prompt": "abcabcabcabc", "kind": "copy"}]


@pytest.fixture(scope="module")
def roomy_engines(tiny_engines):
    """The tiny draft-target and n-gram engines with room for 400-token prompts (their pipelines allow 64)."""
    return {key: Engine(tiny_engines[key].dir, max_sequence_length=440) for key in ("draft_target", "ngram")}


def test_prompts_are_padded_to_each_length_and_decoded_past_the_pipelines_limits(roomy_engines, tmp_path):
    engine = roomy_engines["draft_target"]
    assert engine.pipeline.limits.max_input_length == 439 and engine.cache.max_length > 440
    sweep = run_context_sweep(engine, PROMPTS, (300, 40), 16, 0.0, 0, quiet=True)
    assert [p.context for p in sweep.points] == [40, 300]  # measured shortest first: the model's anchor
    for point in sweep.points:  # decoded text re-tokenizes within a token or two of the length asked
        assert point.context - 3 <= point.prompt_tokens <= point.context
        assert point.kv_positions == pytest.approx(point.prompt_tokens + 8)
        assert point.plain_tokens_per_s > 0 and point.speculative_tokens_per_s > 0
        assert point.speedup == pytest.approx(point.speculative_tokens_per_s / point.plain_tokens_per_s)
    first = sweep.points[0]
    # at the anchor the bytes model predicts what the measured costs give
    assert first.predicted_speedup == pytest.approx(first.speedup_from_measured_costs)
    assert first.plain_slowdown == first.predicted_plain_slowdown == 1.0
    assert sweep.draft_weight_bytes > 0 and sweep.target_kv_bytes_per_position == 2 * 2 * 2 * 16 * 4
    report = write_context_report(sweep, tmp_path / "report")
    text = report.read_text()
    assert "| context | 40 | 300 |" in text and f"{sweep.points[1].speedup:.2f}×" in text
    assert json.loads((tmp_path / "report" / "context.json").read_text())["points"][1]["context"] == 300
    with Image.open(tmp_path / "report" / "context.png") as image:
        assert image.format == "PNG" and image.size[0] >= 800


def test_a_draft_free_proposer_has_no_draft_bytes(roomy_engines):
    sweep = run_context_sweep(roomy_engines["ngram"], PROMPTS[:1], (32, 200), 8, 0.0, 0, quiet=True)
    assert sweep.draft_weight_bytes is None and sweep.draft_kv_bytes_per_position is None
    assert sweep.points[1].prompt_tokens > sweep.points[0].prompt_tokens


def test_the_bytes_model_carries_costs_by_what_each_step_reads():
    """W = 100, K = 1: at m = 100 a plain step reads twice the bytes of m = 0."""
    draft = StepBytes(weights=100, kv_per_position=1, draft_weights=25, draft_kv_per_position=1)
    costs = carried_costs(draft, proposal_cost=0.5, verify_cost=1.2, m0=0, m=100)
    assert costs.plain_slowdown == pytest.approx(2.0)
    assert costs.verify_cost == pytest.approx((1.2 * 100 + 100) / 200)  # the KV is read once: v falls toward 1
    assert costs.proposal_cost_per_step == pytest.approx(0.5 * (125 / 25) / 2)  # a derived draft's c grows
    free = carried_costs(StepBytes(weights=100, kv_per_position=1), proposal_cost=0.5, verify_cost=1.2, m0=0, m=100)
    assert free.proposal_cost_per_step == pytest.approx(0.25)  # the same time, half as many plain steps
    same = carried_costs(draft, proposal_cost=0.5, verify_cost=1.2, m0=50, m=50)
    assert (same.plain_slowdown, same.proposal_cost_per_step, same.verify_cost) == pytest.approx((1, 0.5, 1.2))


def test_lengths_the_model_or_the_engine_cannot_hold_are_refused(tiny_engines, roomy_engines):
    with pytest.raises(SpecdeployError, match="--context: give context lengths of at least 1"):
        check_contexts(roomy_engines["ngram"], (0, 64), 8)
    positions = roomy_engines["ngram"].target.config.max_position_embeddings
    with pytest.raises(SpecdeployError, match=f"max_position_embeddings is {positions}"):
        check_contexts(roomy_engines["ngram"], (positions,), 8)
    with pytest.raises(SpecdeployError, match="loaded for sequences of 256 tokens"):
        check_contexts(tiny_engines["ngram"], (300,), 8)


def test_the_command_sweeps_a_pipeline_beyond_its_limits_and_refuses_what_it_cannot(tmp_path, tiny_checkpoints):
    path = tiny_pipeline(tmp_path, "tiny-context", tiny_checkpoints["target"], method="ngram")
    prompts = tmp_path / "prompts.jsonl"
    prompts.write_text(json.dumps({"prompt": "hello world", "kind": "open"}) + "\n")
    engines, out = tmp_path / "engines", tmp_path / "context.json"
    result = run_cli("bench", str(path), "--context", "32,300", "--prompts", str(prompts), "--max-tokens", "8",
                     "--engines-dir", str(engines), "--json", str(out))
    assert result.returncode == 0, result.stderr
    assert [point["context"] for point in json.loads(out.read_text())["points"]] == [32, 300]
    for arguments, message in ((["--context", "1,x"], "--context"),
                               (["--context", "32", "--url", "localhost:1"], "--context measures one pipeline"),
                               (["--context", "32", "--gammas", "1"], "--context runs its own sweep")):
        refused = run_cli("bench", str(path), *arguments, "--engines-dir", str(engines))
        assert refused.returncode != 0 and message in refused.stderr, refused.stderr
