"""How `specdeploy train-eagle` distils, with its defaults: the CLI's options read them from here, so each default
has one home. Only dataclasses are imported, so the CLI loads it without torch."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path


@dataclass(frozen=True)
class EagleTrainingOptions:
    work_dir: Path = Path("eagle-work")  # answers, features and checkpoints; a rerun resumes from them
    prompts: int = 7000  # prompts to distil on (training/distillation.py says how many are held out)
    max_tokens: int = 320  # length of the target's answers
    epochs: int = 2
    prompt_source: str = "scaled"  # training/distillation.py: "scaled", "written" or "answered"
    answer_batch: int = 32  # the target's answers decoded together
    own_requests: int | None = None  # requests the target writes for itself (None: every seed kind and topic)
    autocast: bool = True  # the head's matmuls in bf16 (fp32 weights and losses)
    # the draft vocabulary: the target's most frequent tokens in the answers (SmolLM2's whole head is 49,152 rows, a
    # fifth of its weights; a draft step over it would cost more than the rest of the head)
    draft_vocab: int = 3072
    intermediate_size: int = 768  # the head's MLP width (the asset stays near 10 MB in bf16)
    # train on the first N of the run's training prompts alone (None: all of them); the held-out prompts and the
    # features on disk stay those of `prompts`, so runs differing only here give the agreement-by-data curve
    train_prompts: int | None = None
    batch_size: int = 8  # batch 16 trained at 0.56x batch 8's token-epochs/s on a 2-thread EPYC (docs/eagle.md)
    lr: float = 1e-3
    seed: int = 0
