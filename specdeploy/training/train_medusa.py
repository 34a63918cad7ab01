"""`specdeploy train-medusa`: Medusa heads self-distilled on the pipeline's frozen target (training/medusa.py)."""

from __future__ import annotations

import json
import platform
import time
from pathlib import Path

from specdeploy.runtime.engine import Engine
from specdeploy.training.distillation import distillation_answers
from specdeploy.training.medusa_options import MedusaTrainingOptions


def train_medusa(pipeline_path: str | Path, engines_dir: Path, output: Path,
                 options: MedusaTrainingOptions = MedusaTrainingOptions(), console=None) -> dict:
    """Self-distil the pipeline's Medusa heads (speculation.medusa: num_heads, num_layers) on its frozen target and
    write them to `output`, with a report of each head's held-out accuracy beside it (<output>.json)."""
    from rich.console import Console

    from specdeploy.models.registry import load_projection
    from specdeploy.speculative.medusa import MedusaHeads
    from specdeploy.speculative.medusa_accuracy import accuracies
    from specdeploy.training import medusa as training

    console = console or Console()
    started = time.perf_counter()
    work_dir = options.work_dir
    pipeline, engine_dir, train_prompts, held_out, answers, answers_seconds = distillation_answers(
        pipeline_path, engines_dir, work_dir, options.prompts, options.max_tokens, console)
    spec = pipeline.speculation.medusa
    engine = Engine(engine_dir, method="none")
    train_data = training.features(engine, {p: answers[p] for p in train_prompts}, spec.num_heads, console)
    held_data = training.features(engine, {p: answers[p] for p in held_out}, spec.num_heads, console)
    lm_head = load_projection(engine_dir / "target")
    heads = MedusaHeads(train_data.hidden.shape[1], spec.num_heads, spec.num_layers)
    heads = training.train(heads, train_data, lm_head, options.epochs, work_dir, console=console)
    report = accuracies(heads, held_data, lm_head)
    training.print_accuracies(report, console)
    output.parent.mkdir(parents=True, exist_ok=True)
    heads.save(output)
    summary = {"heads": str(output), "num_heads": spec.num_heads, "num_layers": spec.num_layers,
               "prompts": {"train": len(train_prompts), "held_out": len(held_out)},
               "positions": {"train": len(train_data.hidden), "held_out": len(held_data.hidden)},
               "max_tokens": options.max_tokens, "epochs": options.epochs, "held_out_accuracy": report,
               # the written prompts quote the standard library, which changes between Python versions
               "python": platform.python_version(),
               "seconds": {"answers": round(answers_seconds), "total": round(time.perf_counter() - started)}}
    output.with_suffix(".json").write_text(json.dumps(summary, indent=2) + "\n")
    return summary
