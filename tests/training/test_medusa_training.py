"""Medusa self-distillation, on the tiny target: the prompt set, resumable answers, head targets aligned with the
token each head predicts, training that lowers the heads' loss, and the accuracy report."""

from __future__ import annotations

import json

import pytest
import torch
from safetensors.torch import load_file

from specdeploy.runtime.engine import Engine
from specdeploy.spec.prompt_sets import load_prompts
from specdeploy.speculative.medusa import MedusaHeads
from specdeploy.speculative.medusa_accuracy import IGNORE, accuracies
from specdeploy.training import medusa as training
from specdeploy.training.prompts import human_eval_prompts, training_prompts, written_prompts


def test_prompt_set_has_humaneval_and_every_kind_and_no_bench_prompt():
    code = human_eval_prompts()
    assert len(code) == 164 and all(p.startswith("Complete this Python function:\n\ndef ") or "def " in p
                                    for p in code)
    bench = [p["prompt"] for p in load_prompts()]
    train, held_out = training_prompts(400, exclude=bench)
    assert len(train) + len(held_out) == 400 and len(held_out) == 40
    assert not set(train) & set(held_out) and not set(train + held_out) & set(bench)
    assert set(code) <= set(train + held_out)
    written = written_prompts()
    for marker in ("JSON", "Summarise", "spelling", "story", "Explain"):
        assert any(marker in p for p in written), marker
    assert training_prompts(400, exclude=bench) == (train, held_out)  # seeded


@pytest.fixture(scope="module")
def tiny_answers(tiny_engines, tmp_path_factory):
    path = tmp_path_factory.mktemp("medusa-train") / "answers.jsonl"
    prompts = [f"Say {word} twice." for word in ("hello", "abc", "xyz", "tiny", "model", "tree", "head", "seed")]
    return path, prompts, training.generate_answers(tiny_engines["ngram"].dir, prompts, 24, path, batch_size=4)


def test_answers_are_the_targets_greedy_output_and_resume(tiny_engines, tiny_answers, monkeypatch):
    path, prompts, answers = tiny_answers
    engine = tiny_engines["ngram"]
    for prompt in prompts[:3]:
        from specdeploy.spec.request import GenerationRequest
        from specdeploy.spec.sampling_params import SamplingParams

        plain = engine.start(GenerationRequest(engine.encode_prompt(prompt), 24, SamplingParams(), 0)).run()
        assert answers[prompt] == plain
    lines = path.read_text().splitlines()
    assert len(lines) == len(prompts)

    def no_engine(*args, **kwargs):
        raise AssertionError("everything was answered already")

    monkeypatch.setattr(training, "Engine", no_engine)
    assert training.generate_answers(engine.dir, prompts, 24, path) == answers
    assert path.read_text().splitlines() == lines


def test_head_targets_are_the_tokens_each_head_predicts(tiny_engines, tiny_answers):
    _, prompts, answers = tiny_answers
    engine = Engine(tiny_engines["ngram"].dir, method="none")
    prompt = prompts[0]
    data = training.features(engine, {prompt: answers[prompt]}, num_heads=3)
    tokens = engine.encode_prompt(prompt) + answers[prompt]
    first = len(engine.encode_prompt(prompt)) - 1
    assert len(data.hidden) == len(tokens) - 1 - first
    for i in range(len(data.hidden)):
        for k in range(3):
            t = first + i + k + 2
            assert int(data.targets[i, k]) == (tokens[t] if t < len(tokens) else IGNORE)
    # the hidden state at t is the target's: its logits choose token t + 1
    logits = engine.target.logits(data.hidden[:4])
    assert logits.argmax(-1).tolist() == tokens[first + 1:first + 5]


def test_training_lowers_the_loss_checkpoints_and_reports(tiny_engines, tiny_answers, tmp_path):
    _, prompts, answers = tiny_answers
    engine = Engine(tiny_engines["ngram"].dir, method="none")
    data = training.features(engine, answers, num_heads=2)
    lm_head = load_file(str(engine.dir / "target" / "model.safetensors"))["lm_head.weight"].float()
    heads = MedusaHeads(data.hidden.shape[1], 2)
    before = training.head_losses(heads, data.hidden, data.targets, lm_head).detach()
    trained = training.train(heads, data, lm_head, epochs=4, work_dir=tmp_path, batch_size=32, lr=3e-3)
    after = training.head_losses(trained, data.hidden, data.targets, lm_head).detach()
    assert bool((after < before * 0.9).all()), (before, after)
    assert sorted(p.name for p in tmp_path.iterdir()) == [f"heads.epoch{e}.safetensors" for e in range(1, 5)]
    resumed = training.train(MedusaHeads(data.hidden.shape[1], 2), data, lm_head, epochs=4, work_dir=tmp_path)
    assert torch.equal(resumed.blocks[0][0].weight, trained.blocks[0][0].weight)  # the last checkpoint, no work
    report = accuracies(trained, data, lm_head)
    assert len(report) == 2 and all(0 <= row["top1"] <= row["top3"] <= row["top5"] <= 1 for row in report)
    assert json.dumps(report)
