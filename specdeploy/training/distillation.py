"""What every train-* command starts from: the target's own engine and its greedy answers to the training prompts
(self-distillation), split into training and held-out prompts, none of them the bench's.

Three prompt sources: "written" (training/prompts.py: HumanEval and the written families, about 1,800 prompts; what
the shipped Medusa heads were trained on), "scaled" (training/distill_prompts.py: those, the standard library's
documented functions and classes, Python's reference topics and the target's own requests, about 6,800), and
"answered" (every prompt the work folder's answers.jsonl already answers, in the file's order: a distillation made
earlier, or elsewhere, trained on as it is, nothing decoded). The held-out part of the last two is SCALED_HELD_OUT
prompts."""

from __future__ import annotations

import dataclasses
import platform
import time
from pathlib import Path
from typing import NamedTuple

from specdeploy.build.torch_engine import build
from specdeploy.decoding.light_tokenizer import load_tokenizer_files
from specdeploy.errors import SpecdeployError
from specdeploy.spec.pipeline import PipelineSpec, load_pipeline
from specdeploy.spec.prompt_sets import load_prompts
from specdeploy.spec.speculation import SpeculationSpec
from specdeploy.training.distill_prompts import (
    clean_request,
    distillation_prompts,
    self_instruct_requests,
    split_held_out,
)
from specdeploy.training.medusa import generate_answers
from specdeploy.training.prompts import training_prompts

SCALED_HELD_OUT = 200  # held-out prompts of the scaled source (a tenth of fewer prompts)
SELF_INSTRUCT_TOKENS = 64  # the longest request the target writes for itself


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
                         max_tokens: int, console, source: str = "written", batch: int | None = None,
                         own_requests: int | None = None) -> Distillation:
    """Build the pipeline's target alone, under its own name (the heads do not exist yet, so the pipeline's own
    engine cannot be built), and have it answer the training prompts of `source`, `batch` at a time (default: the
    pipeline's limits.max_batch_size), cached in work_dir/answers.jsonl. own_requests: how many requests the target
    writes for itself for the scaled source (None: one per seed kind and topic); the same count gives the same
    prompt order, so a smaller --prompts takes a prefix of a larger one's prompts (and its answers)."""
    started = time.perf_counter()
    pipeline = load_pipeline(pipeline_path)
    target_only = dataclasses.replace(pipeline, name=f"{pipeline.name}-target", speculation=SpeculationSpec())
    engine_dir = build(target_only, engines_dir).directory
    work_dir.mkdir(parents=True, exist_ok=True)
    batch = batch or pipeline.limits.max_batch_size
    bench = [p["prompt"] for p in load_prompts()]
    if source == "scaled":
        requests = self_instruct_requests()[:own_requests]
        written = generate_answers(engine_dir, requests, SELF_INSTRUCT_TOKENS, work_dir / "self_instruct.jsonl",
                                   batch, console, description="the target's own requests")
        tokenizer = load_tokenizer_files(engine_dir / "target")
        own = [clean_request(tokenizer.decode(written[r], skip_special_tokens=True)) for r in requests]
        chosen = distillation_prompts([p for p in own if p], exclude=bench)[:prompts]
        train_prompts, held_out = split_held_out(chosen, min(SCALED_HELD_OUT, len(chosen) // 10))
    elif source == "answered":
        excluded = set(bench)
        chosen = [p for p in answered_prompts(work_dir / "answers.jsonl") if p not in excluded][:prompts]
        train_prompts, held_out = split_held_out(chosen, min(SCALED_HELD_OUT, len(chosen) // 10))
    else:
        train_prompts, held_out = training_prompts(prompts, exclude=bench)
    answers = generate_answers(engine_dir, train_prompts + held_out, max_tokens, work_dir / "answers.jsonl", batch,
                               console)
    return Distillation(pipeline, engine_dir, train_prompts, held_out, answers, time.perf_counter() - started)


def run_facts(train_prompts: list[str], held_out: list[str], options, answers_seconds: float,
              started: float) -> dict:
    """What a train-eagle or train-exit-adapter report records of its run: the prompt split, the optimiser's
    settings, the Python version (the written prompts quote its standard library) and the seconds it took."""
    return {"prompts": {"train": len(train_prompts), "held_out": len(held_out)}, "max_tokens": options.max_tokens,
            "lr": options.lr, "batch_size": options.batch_size, "seed": options.seed,
            "python": platform.python_version(),
            "seconds": {"answers": round(answers_seconds), "total": round(time.perf_counter() - started)}}


def answered_prompts(path: Path) -> list[str]:
    """The prompts an answers file (generate_answers' JSON Lines) holds, each once, in the file's order."""
    import json

    if not path.is_file():
        raise SpecdeployError(f"{path}: no answers to train on (--prompt-source answered reuses a work folder's "
                              f"answers.jsonl; make them with --prompt-source scaled or written first)")
    return list(dict.fromkeys(json.loads(line)["prompt"] for line in path.read_text().splitlines() if line.strip()))
