"""The optimiser loop every train-* command runs (Medusa heads, an EAGLE-3 head, an exit adapter): AdamW without
weight decay, a cosine schedule over every step (after an optional linear warm-up), the items reshuffled each epoch
from a seeded generator, gradients optionally clipped, and a checkpoint after each epoch that a later run resumes
from, drawing the same batches as an uninterrupted run would."""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import torch


@dataclass(frozen=True)
class LoopSettings:
    """epochs: in all, those resumed included. warmup_fraction: of all steps, warmed up linearly (0: none).
    clip: the largest gradient norm (None: no clipping)."""

    epochs: int
    batch_size: int
    lr: float
    seed: int = 0
    warmup_fraction: float = 0.0
    clip: float | None = None


def latest_checkpoint(path_of_epoch: Callable[[int], Path], epochs: int) -> tuple[Path | None, int]:
    """The newest epoch's checkpoint that exists (path_of_epoch(n) names epoch n's) and its epoch, or (None, 0)."""
    for epoch in range(epochs, 0, -1):
        if path_of_epoch(epoch).exists():
            return path_of_epoch(epoch), epoch
    return None, 0


def run_epochs(module: torch.nn.Module, count: int, settings: LoopSettings, batch_loss: Callable[[torch.Tensor],
               torch.Tensor], after_epoch: Callable[[int, float], None], start: int = 0,
               on_step: Callable[[int, int, float], None] | None = None,
               lengths: list[int] | None = None) -> list[float]:
    """Train `module` over `count` items from epoch `start` (the epochs before it resumed from a checkpoint):
    batch_loss(indices [b] long) is a batch's loss; after_epoch(epoch number, mean loss) writes its checkpoint;
    on_step(done, total, loss) reports progress. lengths: each item's length, for batches of similar lengths
    (length_grouped). Returns the mean loss of each epoch run here."""
    optimizer = torch.optim.AdamW(module.parameters(), lr=settings.lr, weight_decay=0.0)
    per_epoch = max(1, math.ceil(count / settings.batch_size))
    total = per_epoch * settings.epochs
    warm = max(1, int(total * settings.warmup_fraction)) if settings.warmup_fraction else 0

    def rate(step: int) -> float:
        step += start * per_epoch
        warming = min(1.0, (step + 1) / warm) if warm else 1.0
        return warming * 0.5 * (1 + math.cos(math.pi * min(step, total) / total))

    schedule = torch.optim.lr_scheduler.LambdaLR(optimizer, rate)
    generator = torch.Generator().manual_seed(settings.seed)
    for _ in range(start):  # the same order as an uninterrupted run
        torch.randperm(count, generator=generator)
    losses, done = [], start * per_epoch
    for epoch in range(start, settings.epochs):
        summed = 0.0
        order = torch.randperm(count, generator=generator)
        batches = order.split(settings.batch_size) if lengths is None else \
            length_grouped(order, lengths, settings.batch_size, generator)
        for batch in batches:
            loss = batch_loss(batch)
            optimizer.zero_grad()
            loss.backward()
            if settings.clip is not None:
                torch.nn.utils.clip_grad_norm_(module.parameters(), settings.clip)
            optimizer.step()
            schedule.step()
            done += 1
            summed += float(loss.detach())
            if on_step is not None:
                on_step(done, total, float(loss.detach()))
        losses.append(summed / per_epoch)
        after_epoch(epoch + 1, losses[-1])
    return losses


GROUP_BATCHES = 64  # batches whose items are sorted by length together: similar lengths, still shuffled


def length_grouped(order: torch.Tensor, lengths: list[int], batch_size: int,
                   generator: torch.Generator) -> list[torch.Tensor]:
    """`order` cut into batches of similar lengths (less padding): each run of GROUP_BATCHES batches' items is sorted
    by length before it is cut, and the batches are then shuffled."""
    batches = []
    span = batch_size * GROUP_BATCHES
    for start in range(0, len(order), span):
        chunk = order[start:start + span]
        ranked = chunk[torch.tensor([lengths[i] for i in chunk.tolist()]).argsort(stable=True)]
        batches += list(ranked.split(batch_size))
    return [batches[i] for i in torch.randperm(len(batches), generator=generator).tolist()]
