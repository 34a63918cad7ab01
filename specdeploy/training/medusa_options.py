"""How `specdeploy train-medusa` distils, with its defaults: the CLI's options read them from here, so each default
has one home. Only dataclasses are imported, so the CLI loads it without torch."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path


@dataclass(frozen=True)
class MedusaTrainingOptions:
    work_dir: Path = Path("medusa-work")  # answers and checkpoints; a rerun resumes from them
    prompts: int = 1000  # prompts to distil on, a tenth of them held out
    max_tokens: int = 128  # length of the target's answers
    epochs: int = 4
