"""What every train-* command starts from: the target's own engine and its greedy answers to the training prompts
(self-distillation), split into training and held-out prompts, none of them the bench's."""

from __future__ import annotations

import dataclasses
import platform
import time
from pathlib import Path
from typing import NamedTuple

from specdeploy.build.torch_engine import build
from specdeploy.spec.pipeline import PipelineSpec, load_pipeline
from specdeploy.spec.prompt_sets import load_prompts
from specdeploy.spec.speculation import SpeculationSpec
from specdeploy.training.medusa import generate_answers
from specdeploy.training.prompts import training_prompts


class Distillation(NamedTuple):
    """What the train-* commands start from: the target's own engine, the prompts split into training and held-out
    ones, and the target's greedy answer to each (prompt text → ids)."""

    pipeline: PipelineSpec
    engine_dir: Path
    train_prompts: list[str]
    held_out: list[str]
    answers: dict[str, list[int]]
    answers_seconds: float


def distillation_answers(pipeline_path: str | Path, engines_dir: Path, work_dir: Path, prompts: int,
                         max_tokens: int, console) -> Distillation:
    """Build the pipeline's target alone, under its own name (the heads do not exist yet, so the pipeline's own
    engine cannot be built), and have it answer the training prompts, cached in work_dir/answers.jsonl."""
    started = time.perf_counter()
    pipeline = load_pipeline(pipeline_path)
    target_only = dataclasses.replace(pipeline, name=f"{pipeline.name}-target", speculation=SpeculationSpec())
    engine_dir = build(target_only, engines_dir).directory
    work_dir.mkdir(parents=True, exist_ok=True)
    train_prompts, held_out = training_prompts(prompts, exclude=[p["prompt"] for p in load_prompts()])
    answers = generate_answers(engine_dir, train_prompts + held_out, max_tokens, work_dir / "answers.jsonl",
                               pipeline.limits.max_batch_size, console)
    return Distillation(pipeline, engine_dir, train_prompts, held_out, answers, time.perf_counter() - started)


def run_facts(train_prompts: list[str], held_out: list[str], options, answers_seconds: float,
              started: float) -> dict:
    """What a train-eagle or train-exit-adapter report records of its run: the prompt split, the optimiser's
    settings, the Python version (the written prompts quote its standard library) and the seconds it took."""
    return {"prompts": {"train": len(train_prompts), "held_out": len(held_out)}, "max_tokens": options.max_tokens,
            "lr": options.lr, "batch_size": options.batch_size, "seed": options.seed,
            "python": platform.python_version(),
            "seconds": {"answers": round(answers_seconds), "total": round(time.perf_counter() - started)}}
