"""SamplingParams: how one request samples, and the one definition of each parameter's allowed range.

Torch-free, so the pipeline spec (whose `sampling` section holds a pipeline's defaults) can sit below it in the
import graph. The distribution these parameters produce is built in `sampling.py`.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from specdeploy.errors import RequestError

SEED_LIMIT = 2**64


def sampling_problems(temperature: float, top_k: int, top_p: float, repetition_penalty: float) -> list[tuple[str, str]]:
    """(field, problem) for every value outside its range; the one place these ranges are defined."""
    problems = []
    if not 0 <= temperature < math.inf:  # written so that NaN fails too
        problems.append(("temperature", f"must be ≥ 0 and finite, got {temperature}"))
    if top_k < 0:
        problems.append(("top_k", f"must be ≥ 0, got {top_k}"))
    if not 0 < top_p <= 1:
        problems.append(("top_p", f"must be in (0, 1], got {top_p}"))
    if not 0 < repetition_penalty < math.inf:
        problems.append(("repetition_penalty", f"must be > 0 and finite, got {repetition_penalty}"))
    return problems


@dataclass(frozen=True)
class SamplingParams:
    """The processors applied to the logits, in this order: repetition penalty, temperature, top-k, top-p.

    These defaults switch every processor off (temperature 0 is greedy, top_k 0 and top_p 1 keep every token, a
    penalty of 1 changes nothing); a pipeline's own defaults for its requests are its `sampling` section. `seed`
    fixes the request's random stream (None: a fresh one).
    """

    temperature: float = 0.0
    top_k: int = 0
    top_p: float = 1.0
    repetition_penalty: float = 1.0
    seed: int | None = None

    def __post_init__(self) -> None:
        for key, problem in sampling_problems(self.temperature, self.top_k, self.top_p, self.repetition_penalty):
            raise RequestError(f"{key}: {problem}")
        if self.seed is not None and not 0 <= self.seed < SEED_LIMIT:  # tensorrtllm_backend's random_seed: UINT64
            raise RequestError(f"random_seed: must be in [0, 2**64), got {self.seed}")

    @property
    def greedy(self) -> bool:
        return self.temperature == 0
