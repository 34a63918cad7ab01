"""train-eagle at scale (training/train_eagle.py) on a tiny target: the target writes its own requests and answers
every prompt in batches, its features go to disk in shards, the head starts from the target's head rows and final
norm, and a rerun resumes from the answers, the shards and the checkpoints instead of computing them again."""

from __future__ import annotations

import dataclasses
import json

import pytest
import torch
import yaml
from helpers.pipelines import tiny_pipeline
from helpers.tiny_models import save_tiny_checkpoint

from specdeploy.errors import SpecdeployError
from specdeploy.training.eagle import padded_batch
from specdeploy.training.eagle_data import ShardedSamples, write_shards
from specdeploy.training.eagle_options import EagleTrainingOptions
from specdeploy.training.train_eagle import train_eagle


@pytest.fixture(scope="module")
def pipeline_path(tmp_path_factory):
    root = tmp_path_factory.mktemp("eagle-training")
    target = save_tiny_checkpoint(root / "target", seed=0, num_hidden_layers=6)
    path = tiny_pipeline(root, "tiny-eagle-train", target, method="eagle",
                         speculation_extra={"eagle": {"head": "head", "top_k": 2, "max_nodes": 4}})
    spec = yaml.safe_load(path.read_text())
    spec["limits"] |= {"max_input_length": 1024, "max_sequence_length": 1400}  # a char tokenizer's long prompts
    path.write_text(yaml.safe_dump(spec))
    return path


def test_shards_read_back_what_the_target_computed(tmp_path):
    from transformers import LlamaConfig, LlamaForCausalLM

    from specdeploy.models.config import ModelConfig
    from specdeploy.models.llama import LlamaModel

    config = LlamaConfig(vocab_size=64, hidden_size=32, intermediate_size=48, num_hidden_layers=3,
                         num_attention_heads=4, num_key_value_heads=2)
    torch.manual_seed(0)
    target = LlamaModel(ModelConfig.from_hf(config), LlamaForCausalLM(config).state_dict())
    sequences = [(torch.randint(3, 64, (n,)).tolist(), n // 2) for n in (5, 9, 3, 7)]
    folder = write_shards(target, sequences, (0, 1, 2), tmp_path / "shards")
    samples = ShardedSamples(folder)
    assert len(samples) == 4 and samples.token_count() == 24
    for (tokens, first), sample in zip(sequences, samples):
        forward = target(torch.tensor([tokens]), torch.arange(len(tokens))[None], target.new_cache(1, 16),
                         capture=(0, 1, 2))
        assert sample.tokens.tolist() == tokens and sample.first == first
        torch.testing.assert_close(sample.features.float(), forward.captured[0].to(torch.bfloat16).float())
        torch.testing.assert_close(sample.final.float(), forward.hidden[0].to(torch.bfloat16).float())
    assert padded_batch([samples[0], samples[1]])["features"].shape == (2, 9, 96)
    with pytest.raises(Exception, match="other sequences"):
        write_shards(target, sequences[:2], (0, 1, 2), folder)


def test_train_eagle_distils_at_scale_and_a_rerun_resumes(pipeline_path, tmp_path):
    options = EagleTrainingOptions(work_dir=tmp_path / "work", prompts=40, max_tokens=16, epochs=2,
                                   answer_batch=8, own_requests=30, batch_size=4, draft_vocab=64, intermediate_size=32)
    output = tmp_path / "head"
    report = train_eagle(pipeline_path, tmp_path / "engines", output, options)
    assert report["prompt_source"] == "scaled" and report["prompts"]["train"] + report["prompts"]["held_out"] > 20
    assert len(report["epoch_losses"]) == 2 and report["token_epochs_per_second"] > 0
    assert [d["depth"] for d in report["held_out"]] == [1, 2, 3]
    assert json.loads((output / "training.json").read_text()) == report
    own = (tmp_path / "work" / "self_instruct.jsonl").read_text().splitlines()
    assert len(own) == 30  # the target wrote requests of its own, as many as asked
    shards = sorted((tmp_path / "work" / "runs" / "40").glob("*/shard-*.safetensors"))
    assert shards
    written = {path: path.stat().st_mtime_ns for path in [*shards, tmp_path / "work" / "answers.jsonl"]}
    again = train_eagle(pipeline_path, tmp_path / "engines", tmp_path / "again", options)
    assert {path: path.stat().st_mtime_ns for path in written} == written  # nothing answered or computed again
    assert again["epoch_losses"] == []  # both epochs resumed from their checkpoints
    torch.testing.assert_close(again["held_out"][0]["top1"], report["held_out"][0]["top1"])

    # a point of the agreement-by-data curve: the first 5 training prompts, the same held-out ones and shards
    run = tmp_path / "work" / "runs" / "40"
    fewer = train_eagle(pipeline_path, tmp_path / "engines", tmp_path / "fewer",
                        dataclasses.replace(options, train_prompts=5))
    assert {path: path.stat().st_mtime_ns for path in written} == written
    assert fewer["prompts"] == {"train": 5, "held_out": report["prompts"]["held_out"]}
    assert fewer["train_tokens"] == sum(ShardedSamples(run / "train").lengths()[:5]) < report["train_tokens"]
    assert [d["positions"] for d in fewer["held_out"]] == [d["positions"] for d in report["held_out"]]
    assert len(fewer["epoch_losses"]) == 2 and sorted(p.name for p in (run / "train-5").iterdir()) == [
        "head.epoch1.safetensors", "head.epoch2.safetensors"]
    with pytest.raises(SpecdeployError, match="--train-prompts 999: .* training prompts"):
        train_eagle(pipeline_path, tmp_path / "engines", tmp_path / "more",
                    dataclasses.replace(options, train_prompts=999))


def test_the_answered_source_trains_on_the_work_folders_answers_and_decodes_nothing(pipeline_path, tmp_path):
    """--prompt-source answered: every prompt answers.jsonl holds (no bench prompt), held out as the scaled source
    is, and not one answer decoded again; without answers it says what to run first."""
    from specdeploy.training.distillation import answered_prompts

    options = EagleTrainingOptions(work_dir=tmp_path / "work", prompts=30, max_tokens=12, epochs=1, answer_batch=8,
                                   own_requests=20, batch_size=4, draft_vocab=64, intermediate_size=32)
    train_eagle(pipeline_path, tmp_path / "engines", tmp_path / "scaled", options)
    answers = tmp_path / "work" / "answers.jsonl"
    answered = answered_prompts(answers)
    written = answers.stat().st_mtime_ns
    reused = dataclasses.replace(options, prompt_source="answered", prompts=1000)
    report = train_eagle(pipeline_path, tmp_path / "engines", tmp_path / "answered", reused)
    assert answers.stat().st_mtime_ns == written  # nothing decoded
    assert report["prompts"]["train"] + report["prompts"]["held_out"] == len(answered) == 30
    assert report["prompts"]["held_out"] == 3 and report["prompt_source"] == "answered"
    with pytest.raises(SpecdeployError, match="no answers to train on"):
        answered_prompts(tmp_path / "elsewhere" / "answers.jsonl")


def test_library_prompts_are_the_same_in_every_process():
    """A default printed by its memory address (`<function copy2 at 0x…>`) made three prompts differ per process."""
    import shutil

    from specdeploy.training.distill_prompts import printed_signature

    assert printed_signature(shutil.move) == ""
    assert printed_signature(json.dumps).startswith("(obj, *, skipkeys=False")
