"""Exit-adapter self-distillation on the frozen target (speculative/exit_adapter.py).

Data: the target's greedy answers to the training prompts (training/medusa.generate_answers, cached in the work
directory), then one target forward over each prompt + answer keeping the raw states entering every candidate exit
layer and the target's next token at each position (its argmax there: the token plain greedy decode emits next),
from the prompt's last token on.

Training: one adapter per candidate layer, cross-entropy of the early exit's logits (adapter, the target's final
norm, the target head's rows of the draft vocabulary, all but the adapter frozen) against the target's next token;
positions whose next token lies outside the draft vocabulary are left out of the loss (the draft can never propose
it) and count as misses in the agreement.

Agreement: how often the early exit's top token is the target's next token, without and with the adapter: the
greedy acceptance rate of a chain's first drafted token at that layer.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.nn.functional as F
from rich.console import Console
from rich.table import Table
from safetensors import safe_open
from safetensors.torch import load_file, save_file

from specdeploy.speculative.exit_adapter import ExitAdapter
from specdeploy.speculative.medusa_accuracy import IGNORE
from specdeploy.speculative.speedup import predicted_speedup
from specdeploy.training.exit_adapter_options import ExitAdapterTrainingOptions
from specdeploy.training.loop import LoopSettings, latest_checkpoint, run_epochs
from specdeploy.training.medusa import progress_bar
from specdeploy.training.plots import optional_pyplot

EVAL_BATCH = 1024  # positions per forward when measuring agreement


@dataclass
class ExitStates:
    """Positions of many sequences: states[layer] [N, H] bf16, the raw states entering that layer; next_tokens [N]
    long, the target's own next token at each position."""

    states: dict[int, torch.Tensor]
    next_tokens: torch.Tensor


@dataclass
class ExitHead:
    """The frozen part of the early exit after the adapter: the target's final norm (weight [H] fp32 and eps) and
    its head's rows of the draft vocabulary (rows [Vd, H] fp32, the target ids of those rows draft_ids [Vd]), and
    the target's vocabulary size."""

    norm_weight: torch.Tensor
    eps: float
    rows: torch.Tensor
    draft_ids: torch.Tensor
    vocab_size: int

    def logits(self, states: torch.Tensor) -> torch.Tensor:
        """states [N, H] (adapted or not) → logits over the draft vocabulary [N, Vd]."""
        normed = F.rms_norm(states, (states.shape[-1],), self.norm_weight.to(states.dtype), self.eps)
        return F.linear(normed, self.rows.to(normed.dtype))

    def labels(self, next_tokens: torch.Tensor) -> torch.Tensor:
        """next_tokens [N] target ids → [N] draft-vocabulary indices, IGNORE where a token is outside it."""
        to_draft = torch.full((self.vocab_size,), IGNORE, dtype=torch.long)
        to_draft[self.draft_ids] = torch.arange(len(self.draft_ids))
        return to_draft[next_tokens]


def collect(target, sequences: list[tuple[list[int], int]], layers: list[int],
            on_progress: Callable[[], None] | None = None) -> ExitStates:
    """sequences: (prompt + answer ids, index of the prompt's last token). One target forward each, keeping, at
    every position from that index on, the states entering each of `layers` and the target's argmax."""
    layers = sorted(layers)
    hidden = target.config.hidden_size
    states: dict[int, list[torch.Tensor]] = {layer: [] for layer in layers}
    next_tokens = []
    with torch.inference_mode():
        for tokens, first in sequences:
            cache = target.new_cache(1, len(tokens) + 1)
            forward = target(torch.tensor([tokens]), torch.arange(len(tokens))[None], cache, capture=tuple(layers))
            final = forward.hidden[0, first:]
            next_tokens.append(target.logits(final).argmax(-1).cpu())
            entering = forward.captured[0, first:].reshape(len(final), len(layers), hidden)
            for index, layer in enumerate(layers):
                states[layer].append(entering[:, index].to("cpu", torch.bfloat16).clone())
            if on_progress is not None:
                on_progress()
    return ExitStates({layer: torch.cat(parts) for layer, parts in states.items()}, torch.cat(next_tokens))


def agreement(adapter: ExitAdapter | None, states: torch.Tensor, next_tokens: torch.Tensor, head: ExitHead
              ) -> dict[str, float]:
    """Over positions (states [N, H], next_tokens [N]): how often the early exit's top token (through `adapter`,
    or none) is the target's next token ("top1"), and the mean cross-entropy over positions whose token the draft
    vocabulary holds ("loss")."""
    labels = head.labels(next_tokens)
    hits, loss, counted = 0, 0.0, 0
    with torch.inference_mode(), torch.autocast("cpu", dtype=torch.bfloat16):
        for batch in torch.arange(len(states)).split(EVAL_BATCH):
            h = states[batch].float()
            logits = head.logits(h if adapter is None else adapter(h)).float()
            hits += int((head.draft_ids[logits.argmax(-1)] == next_tokens[batch]).sum())
            valid = labels[batch] != IGNORE
            if valid.any():
                loss += float(F.cross_entropy(logits[valid], labels[batch][valid], reduction="sum"))
                counted += int(valid.sum())
    return {"top1": round(hits / max(len(states), 1), 4), "loss": round(loss / max(counted, 1), 4)}


def modeled_speedup(top1: float, exit_layer: int, num_layers: int, gamma: int) -> float:
    """The speedup a chain of `gamma` drafts would give if each were accepted with probability `top1`
    independently, costing exit_layer / num_layers of a target forward each (the verify and the last draft's extra
    pass through the early layers add up to one forward: speculative/early_exit.py). A ranking of layers, not a
    measurement: the head rows, the adapter and the machine are left out."""
    return round(predicted_speedup(top1, gamma, exit_layer / num_layers, 1.0), 3)


def train_with_progress(adapter: ExitAdapter, states: torch.Tensor, labels: torch.Tensor, head: ExitHead,
                        options: ExitAdapterTrainingOptions, console: Console | None = None
                        ) -> tuple[ExitAdapter, list[float]]:
    """`train` with the options' settings, drawing a progress bar."""
    with progress_bar(console) as progress:
        description = f"adapter at layer {adapter.config.exit_layer}"
        task = progress.add_task(description, total=None)

        def on_step(done: int, total: int, loss: float) -> None:
            progress.update(task, completed=done, total=total, description=f"{description} (loss {loss:.3f})")

        return train(adapter, states, labels, head, options.epochs, options.work_dir, options.batch_size, options.lr,
                     options.seed, on_step)


def checkpoint_path(work_dir: Path, layer: int, epoch: int) -> Path:
    return Path(work_dir) / f"adapter.layer{layer}.epoch{epoch}.safetensors"


def train(adapter: ExitAdapter, states: torch.Tensor, labels: torch.Tensor, head: ExitHead, epochs: int,
          work_dir: Path, batch_size: int = 512, lr: float = 1e-3, seed: int = 0,
          on_step: Callable[[int, int, float], None] | None = None) -> tuple[ExitAdapter, list[float]]:
    """training/loop.py over positions (states [N, H], labels [N] draft indices or IGNORE); a checkpoint after each
    epoch (checkpoint_path, its mean loss in the file's metadata), resumed from the latest. on_step(done, total,
    loss) reports progress. Returns the adapter and every epoch's mean loss."""
    layer = adapter.config.exit_layer
    checkpoint, start = latest_checkpoint(lambda epoch: checkpoint_path(work_dir, layer, epoch), epochs)
    if checkpoint is not None:
        adapter = ExitAdapter.from_state(adapter.config, load_file(str(checkpoint)), str(checkpoint))
    losses = [epoch_loss(checkpoint_path(work_dir, layer, epoch)) for epoch in range(1, start + 1)]
    keep = labels != IGNORE
    states, labels = states[keep], labels[keep]

    def batch_loss(batch: torch.Tensor) -> torch.Tensor:
        # bf16 matmuls (AMX on a CPU), as training/medusa.py trains; the loss itself is computed in fp32
        with torch.autocast("cpu", dtype=torch.bfloat16):
            logits = head.logits(adapter(states[batch].float()))
        return F.cross_entropy(logits.float(), labels[batch])

    def after_epoch(epoch: int, loss: float) -> None:
        save_file(adapter.state(), str(checkpoint_path(work_dir, layer, epoch)),
                  metadata={"epoch_loss": str(round(loss, 4))})

    run = run_epochs(adapter, len(states), LoopSettings(epochs, batch_size, lr, seed), batch_loss, after_epoch,
                     start, on_step)
    return adapter, losses + [round(loss, 4) for loss in run]


def epoch_loss(checkpoint: Path) -> float | None:
    """The mean loss a checkpoint's epoch recorded (None for a file without it)."""
    with safe_open(str(checkpoint), framework="pt") as handle:
        recorded = (handle.metadata() or {}).get("epoch_loss")
    return None if recorded is None else float(recorded)


def print_agreement(rows: list[dict], chosen: int, console: Console) -> None:
    """The held-out report, a row per exit layer: agreement and loss without and with the adapter."""
    table = Table(title="Early exit on held-out positions: top-1 = the target's next token (first-draft acceptance)")
    for column in ("exit layer", "top-1 without", "top-1 with", "loss without", "loss with", "modeled speedup "
                   "without → with"):
        table.add_column(column, justify="right")
    for row in rows:
        without, with_ = row["without_adapter"], row["with_adapter"]
        marker = " (written)" if row["exit_layer"] == chosen else ""
        table.add_row(f"{row['exit_layer']}{marker}", f"{without['top1']:.3f}", f"{with_['top1']:.3f}",
                      f"{without['loss']:.3f}", f"{with_['loss']:.3f}",
                      f"{row['modeled_speedup_without_adapter']:.2f}x → {row['modeled_speedup_with_adapter']:.2f}x")
    console.print(table)


def write_plot(report: dict, path: Path) -> bool:
    """training.png: held-out top-1 agreement by exit layer without and with the adapter, and each layer's loss by
    epoch; False without matplotlib."""
    plt = optional_pyplot()
    if plt is None:
        return False
    figure, (left, right) = plt.subplots(1, 2, figsize=(10, 4))
    rows = report["layers"]
    positions = range(len(rows))
    left.bar([p - 0.2 for p in positions], [row["without_adapter"]["top1"] for row in rows], 0.4,
             label="without adapter")
    left.bar([p + 0.2 for p in positions], [row["with_adapter"]["top1"] for row in rows], 0.4, label="with adapter")
    left.set_xticks(list(positions), [str(row["exit_layer"]) for row in rows])
    left.set(xlabel="exit layer", ylabel="top-1 = target's next token", ylim=(0, 1),
             title="held-out first-draft acceptance (greedy)")
    left.legend()
    for row in rows:
        losses = [loss for loss in row["epoch_losses"] if loss is not None]
        right.plot(range(1, len(losses) + 1), losses, marker="o", label=f"layer {row['exit_layer']}")
    right.set(xlabel="epoch", ylabel="cross-entropy", title="training loss")
    right.legend()
    figure.tight_layout()
    figure.savefig(path, dpi=120)
    plt.close(figure)
    return True
