"""How `specdeploy train-exit-adapter` distils, with its defaults: the CLI's options read them from here, so each
default has one home. Only dataclasses are imported, so the CLI loads it without torch."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path


@dataclass(frozen=True)
class ExitAdapterTrainingOptions:
    work_dir: Path = Path("exit-adapter-work")  # answers and per-epoch checkpoints; a rerun resumes from them
    # prompts to distil on, a tenth of them held out: train-eagle's count, so its answers can be reused (--work-dir)
    prompts: int = 600
    max_tokens: int = 128  # length of the target's answers
    epochs: int = 12  # SmolLM2 at exit layer 8: held-out top-1 0.29 after 4 epochs, 0.35 after 12 (about 1 min a layer)
    layers: tuple[int, ...] | None = None  # exit layers to train an adapter at (None: the pipeline's early_exit sweep)
    layer: int | None = None  # the one written to --output (None: the best modeled speedup)
    # the adapter's inner width: its two matrices cost about a fifth of a SmolLM2 layer per drafted token
    inner_size: int = 1024
    batch_size: int = 512  # positions per step
    lr: float = 1e-3
    seed: int = 0
