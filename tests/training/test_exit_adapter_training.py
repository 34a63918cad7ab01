"""Exit-adapter self-distillation on a tiny target: the collected states and next tokens are the target's own,
training raises held-out agreement above the plain early exit's and resumes from its checkpoints, the command's
report and folder, and its command line."""

from __future__ import annotations

import json

import pytest
import torch
from helpers.cli import run_cli
from helpers.early_exit import LAYERS, early_exit_pipeline
from helpers.tiny_models import save_tiny_checkpoint

from specdeploy.build.torch_engine import build, corpus_vocabulary
from specdeploy.errors import SpecdeployError
from specdeploy.models.llama import LayerSpan
from specdeploy.models.registry import load_projection
from specdeploy.runtime.engine import Engine
from specdeploy.spec.pipeline import load_pipeline
from specdeploy.speculative.exit_adapter import ExitAdapter, ExitAdapterConfig
from specdeploy.training import distillation
from specdeploy.training import exit_adapter as training
from specdeploy.training.exit_adapter_options import ExitAdapterTrainingOptions
from specdeploy.training.medusa import generate_answers
from specdeploy.training.plots import optional_pyplot
from specdeploy.training.train_exit_adapter import train_exit_adapter

PROMPTS = [f"{verb} {thing}." for verb in ("Say", "Spell", "Write", "Name") for thing in
           ("hello", "abc", "tiny", "model", "seed", "tree", "dogs", "rain")]
HELD_OUT = 6
LAYER = 2


@pytest.fixture(scope="module")
def distilled(tmp_path_factory):
    """A plain random 4-layer target (its layer-2 exit rarely agrees with it), its answers to the prompts and the
    early exit's training material at layers 1 and 2."""
    root = tmp_path_factory.mktemp("exit-adapter-training")
    checkpoint = save_tiny_checkpoint(root / "target", seed=5, num_hidden_layers=LAYERS)
    pipeline = early_exit_pipeline(root, checkpoint, "tiny-exit-train", draft_vocab=0)
    target_only = load_pipeline(pipeline)
    engine_dir = build(target_only, root / "engines", quiet=True).directory
    answers = generate_answers(engine_dir, PROMPTS, 32, root / "answers.jsonl", batch_size=8)
    engine = Engine(engine_dir, method="none")

    def sequences(prompts):
        return [(engine.encode_prompt(p) + answers[p], len(engine.encode_prompt(p)) - 1) for p in prompts]

    train = training.collect(engine.target, sequences(PROMPTS[HELD_OUT:]), [1, LAYER])
    held = training.collect(engine.target, sequences(PROMPTS[:HELD_OUT]), [1, LAYER])
    config = engine.target.config
    ids = torch.tensor(corpus_vocabulary(engine.tokenizer, 0, config.vocab_size)[0])
    head = training.ExitHead(engine.target.norm.weight.detach().float(), config.rms_norm_eps,
                             load_projection(engine_dir / "target")[ids], ids, config.vocab_size)
    return {"root": root, "pipeline": pipeline, "checkpoint": checkpoint, "engine": engine, "answers": answers,
            "train": train, "held": held, "head": head, "sequences": sequences}


def new_adapter(checkpoint, layer=LAYER):
    torch.manual_seed(0)
    return ExitAdapter(ExitAdapterConfig(64, 64, layer, checkpoint.name, LAYERS))


def test_collected_states_and_next_tokens_are_the_targets(distilled):
    engine, prompt = distilled["engine"], PROMPTS[0]
    (tokens, first), = distilled["sequences"]([prompt])
    data = training.collect(engine.target, [(tokens, first)], [LAYER])
    assert len(data.next_tokens) == len(tokens) - first
    assert data.next_tokens[:-1].tolist() == tokens[first + 1:]  # the greedy answer is the target's argmax
    with torch.inference_mode():
        raw = engine.target(torch.tensor([tokens]), torch.arange(len(tokens))[None],
                            engine.target.new_cache(1, len(tokens) + 1), span=LayerSpan(stop=LAYER)).hidden[0, first:]
    torch.testing.assert_close(data.states[LAYER].float(), raw.float(), atol=0.02, rtol=0.02)  # kept in bf16


def test_training_raises_held_out_agreement_and_resumes(distilled, tmp_path):
    train, held, head = distilled["train"], distilled["held"], distilled["head"]
    labels = head.labels(train.next_tokens)
    untrained = training.agreement(None, held.states[LAYER], held.next_tokens, head)
    assert training.agreement(new_adapter(distilled["checkpoint"]), held.states[LAYER], held.next_tokens,
                              head) == untrained  # W_down starts at zero
    adapter, losses = training.train(new_adapter(distilled["checkpoint"]), train.states[LAYER], labels, head,
                                     epochs=6, work_dir=tmp_path, batch_size=64, lr=3e-3)
    trained = training.agreement(adapter, held.states[LAYER], held.next_tokens, head)
    assert trained["top1"] > untrained["top1"] + 0.05, (untrained, trained)
    assert trained["loss"] < untrained["loss"]
    assert losses[-1] < losses[0] and len(losses) == 6
    assert sorted(p.name for p in tmp_path.iterdir()) == [f"adapter.layer2.epoch{e}.safetensors" for e in range(1, 7)]

    def no_step(*args):
        raise AssertionError("the last checkpoint holds every epoch")

    resumed, resumed_losses = training.train(new_adapter(distilled["checkpoint"]), train.states[LAYER], labels,
                                             head, epochs=6, work_dir=tmp_path, on_step=no_step)
    assert torch.equal(resumed.up.weight, adapter.up.weight) and resumed_losses == losses
    (tmp_path / "adapter.layer2.epoch6.safetensors").unlink()
    steps = []
    _, again = training.train(new_adapter(distilled["checkpoint"]), train.states[LAYER], labels, head, epochs=6,
                              work_dir=tmp_path, batch_size=64, lr=3e-3, on_step=lambda *args: steps.append(args))
    per_epoch = -(-int((labels != -100).sum()) // 64)
    assert len(steps) == per_epoch and steps[0][0] == 5 * per_epoch + 1  # only epoch 6 ran, from epoch 5's weights
    assert again[:5] == losses[:5] and (tmp_path / "adapter.layer2.epoch6.safetensors").exists()


def test_the_command_writes_the_adapter_and_its_report(distilled, monkeypatch, tmp_path):
    def tiny_distillation(pipeline_path, engines_dir, work_dir, prompts, max_tokens, console):
        work_dir.mkdir(parents=True, exist_ok=True)
        pipeline = load_pipeline(pipeline_path)
        return distillation.Distillation(pipeline, distilled["engine"].dir, PROMPTS[HELD_OUT:], PROMPTS[:HELD_OUT],
                                         distilled["answers"], 0.0)

    monkeypatch.setattr(distillation, "distillation_answers", tiny_distillation)
    options = ExitAdapterTrainingOptions(work_dir=tmp_path / "work", epochs=3, layers=(1, LAYER), inner_size=32,
                                         batch_size=64, lr=3e-3)
    output = tmp_path / "adapter"
    report = train_exit_adapter(distilled["pipeline"], tmp_path / "engines", output, options)
    assert [row["exit_layer"] for row in report["layers"]] == [1, LAYER]
    assert report["exit_layer"] in (1, LAYER) and report["positions"]["held_out"] > 0
    for row in report["layers"]:
        assert 0 <= row["without_adapter"]["top1"] <= 1 and 0 <= row["with_adapter"]["top1"] <= 1
        assert len(row["epoch_losses"]) == 3
    assert json.loads((output / "training.json").read_text()) == report
    assert (output / "training.png").exists() == (optional_pyplot() is not None)
    ExitAdapter.load(output, distilled["checkpoint"].name, LAYERS, 64, report["exit_layer"])


def test_the_command_refuses_layers_past_the_target_before_answering(distilled, monkeypatch, tmp_path):
    def no_answers(*args):
        raise AssertionError("the layers are checked first")

    monkeypatch.setattr(distillation, "distillation_answers", no_answers)
    with pytest.raises(SpecdeployError, match=r"exit layers \[4, 9\] are not layer counts below the target's 4"):
        train_exit_adapter(distilled["pipeline"], tmp_path / "engines", tmp_path / "adapter",
                           ExitAdapterTrainingOptions(layers=(2, 4, 9)))


def test_the_command_line(tmp_path):
    result = run_cli("train-exit-adapter", "--help")
    assert result.returncode == 0
    for flag in ("--output", "--layers", "--layer", "--inner-size", "--work-dir", "--epochs"):
        assert flag in result.stdout
    bad = run_cli("train-exit-adapter", "p.yaml", "--output", str(tmp_path / "a"), "--layers", "4,x")
    assert bad.returncode == 2 and "--layers" in bad.stderr and "expected comma-separated integers" in bad.stderr
