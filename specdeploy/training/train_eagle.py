"""`specdeploy train-eagle`: an EAGLE-3 head self-distilled on the pipeline's target (training/eagle.py)."""

from __future__ import annotations

import json
import time
from pathlib import Path

from specdeploy.runtime.engine import Engine
from specdeploy.training.distillation import distillation_answers, run_facts
from specdeploy.training.eagle_options import EagleTrainingOptions


def train_eagle(pipeline_path: str | Path, engines_dir: Path, output: Path,
                options: EagleTrainingOptions = EagleTrainingOptions(), console=None) -> dict:
    """Self-distil an EAGLE-3 head for the pipeline's target (training-time test over num_draft_tokens steps) and
    write it to the folder `output` (config.json, model.safetensors), with training.json (losses, held-out
    agreement by depth) and training.png beside them."""
    import torch
    from rich.console import Console

    from specdeploy.models.registry import load_projection
    from specdeploy.speculative.eagle_head import REPORT_FILE, Eagle3Head, EagleConfig, default_feature_layers
    from specdeploy.training import eagle as training
    from specdeploy.training.medusa import progress_bar

    console = console or Console()
    started = time.perf_counter()
    torch.manual_seed(options.seed)
    work_dir = options.work_dir
    pipeline, engine_dir, train_prompts, held_out, answers, answers_seconds = distillation_answers(
        pipeline_path, engines_dir, work_dir, options.prompts, options.max_tokens, console)
    steps = pipeline.speculation.num_draft_tokens
    engine = Engine(engine_dir, method="none")
    target, config = engine.target, engine.target.config
    layers = default_feature_layers(config.num_layers)

    def sequences(prompts: list[str]) -> list[tuple[list[int], int]]:
        return [(engine.encode_prompt(p) + answers[p], len(engine.encode_prompt(p)) - 1) for p in prompts]

    with progress_bar(console) as progress:
        task = progress.add_task("target features", total=len(train_prompts) + len(held_out))
        train_samples = training.collect(target, sequences(train_prompts), layers, lambda: progress.advance(task))
        held_samples = training.collect(target, sequences(held_out), layers, lambda: progress.advance(task))
    ids = training.draft_vocabulary(train_samples, options.draft_vocab, config.vocab_size)
    head_config = EagleConfig(hidden_size=config.hidden_size, intermediate_size=options.intermediate_size,
                              num_heads=config.num_heads, num_kv_heads=config.num_kv_heads, head_dim=config.head_dim,
                              vocab_size=config.vocab_size, draft_vocab_size=len(ids), feature_layers=layers,
                              rms_norm_eps=config.rms_norm_eps, rope_theta=config.rope_theta,
                              max_position_embeddings=config.max_position_embeddings,
                              target_num_layers=config.num_layers)
    head = Eagle3Head(head_config)
    head.set_draft_vocabulary(ids)
    embed = target.embed.detach().float()
    draft_rows = load_projection(engine_dir / "target")[ids]  # [Vd, H]: the target's head on the draft vocabulary
    with progress_bar(console) as progress:
        task = progress.add_task("training the head", total=None)

        def on_step(done: int, total: int, loss: float) -> None:
            progress.update(task, completed=done, total=total, description=f"training the head (loss {loss:.3f})")

        head, losses = training.train(head, train_samples, embed, draft_rows, steps, options.epochs, work_dir,
                                      options.batch_size, options.lr, options.seed, on_step)
    held = training.chain_acceptance(head, held_samples, embed, draft_rows, steps)
    head.save(output)
    covered = sum(int(torch.isin(s.tokens[s.first + 1:], ids).sum()) for s in held_samples)
    answered = sum(len(s.tokens) - s.first - 1 for s in held_samples)
    report = {"head": str(output), "feature_layers": list(layers), "draft_vocab": len(ids),
              "intermediate_size": options.intermediate_size, "ttt_steps": steps, "epochs": options.epochs,
              "epoch_losses": [round(x, 4) for x in losses], "held_out": held,
              "held_out_tokens_in_draft_vocab": round(covered / max(answered, 1), 4),
              **run_facts(train_prompts, held_out, options, answers_seconds, started)}
    (output / REPORT_FILE).write_text(json.dumps(report, indent=2) + "\n")
    training.write_plot(report, output / "training.png")
    return report
