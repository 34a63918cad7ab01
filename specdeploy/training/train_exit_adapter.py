"""`specdeploy train-exit-adapter`: an early exit's adapter self-distilled at each candidate exit layer
(training/exit_adapter.py)."""

from __future__ import annotations

import json
import time
from pathlib import Path

from specdeploy.errors import SpecdeployError
from specdeploy.runtime.engine import Engine
from specdeploy.spec.pipeline import PipelineSpec, load_pipeline
from specdeploy.spec.speculation import EXIT_ADAPTER
from specdeploy.training import distillation
from specdeploy.training.exit_adapter_options import ExitAdapterTrainingOptions


def exit_layers_to_train(pipeline: PipelineSpec, options: ExitAdapterTrainingOptions, num_layers: int) -> list[int]:
    """--layers, or the pipeline's early_exit sweep and its exit layer when that is a number, with --layer; an
    error naming the layers that are not below the target's."""
    spec = pipeline.speculation.early_exit
    layers = set(options.layers or (*spec.sweep, *([spec.exit_layer] if spec.exit_layer != "measured" else [])))
    layers |= {options.layer} if options.layer is not None else set()
    outside = sorted(layer for layer in layers if not 1 <= layer < num_layers)
    if outside:
        raise SpecdeployError(f"exit layers {outside} are not layer counts below the target's {num_layers} layers "
                              f"(--layers, --layer or speculation.early_exit.sweep)")
    return sorted(layers)


def train_exit_adapter(pipeline_path: str | Path, engines_dir: Path, output: Path,
                       options: ExitAdapterTrainingOptions = ExitAdapterTrainingOptions(), console=None) -> dict:
    """Self-distil an early exit's adapter at each candidate exit layer on the pipeline's frozen target, measure on
    held-out positions how often the early exit's top token is the target's without and with it, and write the
    chosen layer's adapter to the folder `output` (config.json, model.safetensors) with training.json and
    training.png beside them."""
    import torch
    from rich.console import Console

    from specdeploy.build.checkpoints import target_config
    from specdeploy.build.torch_engine import corpus_vocabulary
    from specdeploy.models.registry import load_projection
    from specdeploy.speculative.exit_adapter import REPORT_FILE, ExitAdapter, ExitAdapterConfig, target_name
    from specdeploy.training import exit_adapter as training
    from specdeploy.training.medusa import progress_bar

    console = console or Console()
    started = time.perf_counter()
    pipeline = load_pipeline(pipeline_path)
    if EXIT_ADAPTER not in pipeline.speculation.traits.trained:
        raise SpecdeployError(f"{pipeline_path}: train-exit-adapter trains an early exit's adapter, and this "
                              f"pipeline's method is not early_exit")
    # checked before the answers, which take minutes
    layers = exit_layers_to_train(pipeline, options, target_config(pipeline).num_layers)
    pipeline, engine_dir, train_prompts, held_out, answers, answers_seconds = distillation.distillation_answers(
        pipeline_path, engines_dir, options.work_dir, options.prompts, options.max_tokens, console)
    engine = Engine(engine_dir, method="none")
    config = engine.target.config

    def sequences(prompts: list[str]) -> list[tuple[list[int], int]]:
        return [(engine.encode_prompt(p) + answers[p], len(engine.encode_prompt(p)) - 1) for p in prompts]

    with progress_bar(console) as progress:
        task = progress.add_task("target states", total=len(train_prompts) + len(held_out))
        train_data = training.collect(engine.target, sequences(train_prompts), layers, lambda: progress.advance(task))
        held_data = training.collect(engine.target, sequences(held_out), layers, lambda: progress.advance(task))
    ids, _ = corpus_vocabulary(engine.tokenizer, pipeline.speculation.early_exit.draft_vocab, config.vocab_size)
    ids = torch.tensor(ids)
    head = training.ExitHead(engine.target.norm.weight.detach().float().cpu(), config.rms_norm_eps,
                             load_projection(engine_dir / "target")[ids], ids, config.vocab_size)
    labels = head.labels(train_data.next_tokens)
    gamma = pipeline.speculation.num_draft_tokens
    rows, adapters = [], {}
    for layer in layers:
        torch.manual_seed(options.seed)
        adapter = ExitAdapter(ExitAdapterConfig(config.hidden_size, options.inner_size, layer,
                                                target_name(pipeline.target.checkpoint), config.num_layers,
                                                config.rms_norm_eps))
        adapters[layer], losses = training.train_with_progress(adapter, train_data.states[layer], labels, head,
                                                               options, console)
        measured = {name: training.agreement(candidate, held_data.states[layer], held_data.next_tokens, head)
                    for name, candidate in (("without_adapter", None), ("with_adapter", adapters[layer]))}
        rows.append({"exit_layer": layer, **measured, "epoch_losses": losses,
                     **{f"modeled_speedup_{name}": training.modeled_speedup(measured[name]["top1"], layer,
                                                                            config.num_layers, gamma)
                        for name in measured}})
    chosen = options.layer or max(rows, key=lambda row: row["modeled_speedup_with_adapter"])["exit_layer"]
    training.print_agreement(rows, chosen, console)
    adapters[chosen].save(output)
    report = {"adapter": str(output), "exit_layer": chosen,
              "chosen_by": "--layer" if options.layer else f"the best modeled speedup at gamma {gamma}",
              "layers": rows, "target": target_name(pipeline.target.checkpoint), "target_layers": config.num_layers,
              "draft_vocab": len(ids), "inner_size": options.inner_size, "epochs": options.epochs,
              "held_out_next_tokens_in_draft_vocab": round(float(torch.isin(held_data.next_tokens, ids).float()
                                                                 .mean()), 4),
              "positions": {"train": len(train_data.next_tokens), "held_out": len(held_data.next_tokens)},
              **distillation.run_facts(train_prompts, held_out, options, answers_seconds, started)}
    (output / REPORT_FILE).write_text(json.dumps(report, indent=2) + "\n")
    training.write_plot(report, output / "training.png")
    return report
