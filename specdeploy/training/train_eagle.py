"""`specdeploy train-eagle`: an EAGLE-3 head self-distilled on the pipeline's target (training/eagle.py).

The work folder holds everything a rerun resumes from: the target's own requests and its answers (shared by every
run in the folder), and per prompt count the target's features in shards (training/eagle_data.py) and a checkpoint
after each epoch (`runs/<prompts>/`). The agreement-by-data curve trains on prefixes of one run's training prompts
(--train-prompts): the same held-out prompts and features, checkpoints of their own (`runs/<prompts>/train-<n>/`).
"""

from __future__ import annotations

import json
import time
from pathlib import Path

from specdeploy.errors import SpecdeployError
from specdeploy.runtime.engine import Engine
from specdeploy.training.distillation import distillation_answers, run_facts
from specdeploy.training.eagle_options import EagleTrainingOptions


def train_eagle(pipeline_path: str | Path, engines_dir: Path, output: Path,
                options: EagleTrainingOptions = EagleTrainingOptions(), console=None) -> dict:
    """Self-distil an EAGLE-3 head for the pipeline's target (training-time test over num_draft_tokens steps) and
    write it to the folder `output` (config.json, model.safetensors), with training.json (losses, held-out
    agreement by depth, throughput) and training.png beside them."""
    import torch
    from rich.console import Console

    from specdeploy.models.registry import load_projection
    from specdeploy.speculative.draft_vocabulary import most_frequent_tokens
    from specdeploy.speculative.eagle_head import REPORT_FILE, Eagle3Head, EagleConfig, default_feature_layers
    from specdeploy.training import eagle as training
    from specdeploy.training.eagle_data import ShardedSamples, write_shards
    from specdeploy.training.medusa import progress_bar

    console = console or Console()
    started = time.perf_counter()
    torch.manual_seed(options.seed)
    work_dir = options.work_dir
    pipeline, engine_dir, train_prompts, held_out, answers, answers_seconds = distillation_answers(
        pipeline_path, engines_dir, work_dir, options.prompts, options.max_tokens, console, options.prompt_source,
        options.answer_batch, options.own_requests)
    train_prompts = [p for p in train_prompts if p in answers]  # a prompt over the input limit has no answer
    held_out = [p for p in held_out if p in answers]
    if options.train_prompts is not None and options.train_prompts > len(train_prompts):
        raise SpecdeployError(f"--train-prompts {options.train_prompts}: the run of --prompts {options.prompts} has "
                              f"{len(train_prompts)} training prompts; choose at most that many")
    steps = pipeline.speculation.num_draft_tokens
    engine = Engine(engine_dir, method="none")
    target, config = engine.target, engine.target.config
    layers = default_feature_layers(config.num_layers)
    run_dir = work_dir / "runs" / str(options.prompts)
    checkpoints = run_dir if options.train_prompts is None else run_dir / f"train-{options.train_prompts}"

    def sequences(prompts: list[str]) -> list[tuple[list[int], int]]:
        encoded = [engine.encode_prompt(p) for p in prompts]
        return [(ids + answers[p], len(ids) - 1) for p, ids in zip(prompts, encoded)]

    features_started = time.perf_counter()
    train_sequences, held_sequences = sequences(train_prompts), sequences(held_out)
    with progress_bar(console) as progress:
        task = progress.add_task("target features (tokens)",
                                 total=sum(len(tokens) for tokens, _ in train_sequences + held_sequences))
        advance = lambda tokens: progress.advance(task, tokens)  # noqa: E731
        train_samples = ShardedSamples(write_shards(target, train_sequences, layers, run_dir / "train", advance),
                                       limit=options.train_prompts)
        held_samples = ShardedSamples(write_shards(target, held_sequences, layers, run_dir / "held_out", advance))
    features_seconds = time.perf_counter() - features_started
    train_sequences = train_sequences[:options.train_prompts]  # the shards' order: the first n are those trained on
    answer_tokens = [tokens[first + 1:] for tokens, first in train_sequences]
    ids = torch.tensor(most_frequent_tokens(answer_tokens, options.draft_vocab, config.vocab_size))
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
    with torch.no_grad():  # the head predicts what the target's head does: start from its rows and its final norm
        head.w("lm_head.weight").copy_(draft_rows)
        head.w("norm.weight").copy_(target.norm.weight.detach().float())
    training_started = time.perf_counter()
    with progress_bar(console) as progress:
        task = progress.add_task("training the head", total=None)

        def on_step(done: int, total: int, loss: float) -> None:
            progress.update(task, completed=done, total=total, description=f"training the head (loss {loss:.3f})")

        head, losses = training.train(head, train_samples, embed, draft_rows, steps, options.epochs, checkpoints,
                                      options.batch_size, options.lr, options.seed, on_step, options.autocast)
    training_seconds = time.perf_counter() - training_started
    held = training.chain_acceptance(head, held_samples, embed, draft_rows, steps, autocast=options.autocast)
    head.save(output)
    held_answers = [torch.tensor(tokens[first + 1:]) for tokens, first in held_sequences]
    covered = sum(int(torch.isin(tokens, ids).sum()) for tokens in held_answers)
    answered = sum(len(tokens) for tokens in held_answers)
    trained_epochs = len(losses)
    report = {"head": str(output), "feature_layers": list(layers), "draft_vocab": len(ids),
              "intermediate_size": options.intermediate_size, "ttt_steps": steps, "epochs": options.epochs,
              "prompt_source": options.prompt_source, "answer_tokens": sum(len(t) for t in answer_tokens),
              "train_tokens": train_samples.token_count(), "epoch_losses": [round(x, 4) for x in losses],
              "held_out": held, "held_out_tokens_in_draft_vocab": round(covered / max(answered, 1), 4),
              "autocast": options.autocast,
              "token_epochs_per_second": round(train_samples.token_count() * trained_epochs
                                               / max(training_seconds, 1e-9), 1) if trained_epochs else None,
              **run_facts(train_prompts[:options.train_prompts], held_out, options, answers_seconds, started)}
    report["seconds"] |= {"features": round(features_seconds), "training": round(training_seconds)}
    (output / REPORT_FILE).write_text(json.dumps(report, indent=2) + "\n")
    training.write_plot(report, output / "training.png")
    return report
