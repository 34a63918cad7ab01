"""The prompts a build calibrates on, and the realized speedups its tuning steps choose by.

Realized, not predicted: an n-gram drafter's acceptance by position is conditional on a match long enough to draft
that position, which the by-position prediction (a chain's prefix probabilities) overstates by 2x and more."""

from __future__ import annotations

from dataclasses import dataclass, field
from itertools import islice

from rich.progress import track

from specdeploy.decoding.stats import RequestStats, decode_rate, mean_accepted_length
from specdeploy.errors import SpecdeployError
from specdeploy.runtime.engine import Engine
from specdeploy.spec.request import GenerationRequest

# Two written prompts of each kind the training prompts have (code edits, fixes, edits, summaries, JSON, messages,
# open-ended), none of them the bench's, decoded for this many tokens.
CALIBRATION_PROMPTS_PER_KIND = 2
CALIBRATION_TOKENS = 48
OWN_GAMMA = None  # a Calibration's key for the engine's own gamma


def calibration_prompts(engine: Engine) -> list[dict]:
    """The first CALIBRATION_PROMPTS_PER_KIND written training prompts of each kind that fit the engine's
    limits.max_input_length."""
    from specdeploy.training.prompts import written_families

    longest = engine.pipeline.limits.max_input_length
    chosen = []
    for kind, prompts in written_families(0).items():
        fitting = (p for p in prompts if len(engine.encode_prompt(p)) <= longest)  # encoded only until enough fit
        chosen += [{"prompt": prompt, "kind": kind} for prompt in islice(fitting, CALIBRATION_PROMPTS_PER_KIND)]
    if not chosen:
        raise SpecdeployError(f"{engine.pipeline.name}: no calibration prompt fits limits.max_input_length "
                              f"({longest} tokens), so nothing can be measured on it")
    return chosen


@dataclass
class Calibration:
    """One engine's decodes of the calibration prompts: plain, and by gamma (OWN_GAMMA: the pipeline's own)."""

    plain: list[RequestStats] = field(default_factory=list)
    by_gamma: dict[int | None, list[RequestStats]] = field(default_factory=dict)

    def speedup(self, gamma: int | None = OWN_GAMMA) -> float:
        """Decode tokens/s at `gamma` over plain decode's, every prompt together."""
        base = decode_rate(self.plain)
        return decode_rate(self.by_gamma[gamma]) / base if base else 0.0

    def mean_accepted_length(self, gamma: int | None = OWN_GAMMA) -> float:
        stats = self.by_gamma[gamma]
        return mean_accepted_length(sum(s.decode_tokens for s in stats), sum(s.steps for s in stats))

    def draft_cost_ratio(self, gamma: int | None = OWN_GAMMA) -> float:
        """Seconds per draft forward (per drafted token for a proposer without forwards) over a plain step's."""
        stats = self.by_gamma[gamma]
        plain_step = sum(s.verify_seconds for s in self.plain) / max(sum(s.steps for s in self.plain), 1)
        units = sum(s.draft_forwards for s in stats) or sum(s.drafted for s in stats)
        return sum(s.draft_seconds for s in stats) / max(units, 1) / plain_step if plain_step else 0.0


def calibrate(engines: list[Engine], prompts: list[dict], max_tokens: int, gammas: tuple[int, ...] = (),
              quiet: bool = False) -> list[Calibration]:
    """Decode every prompt with each engine plain, at its own gamma and at each of `gammas`, greedy at the
    pipeline's defaults otherwise; for each prompt in turn every engine and gamma takes its turn, so the machine's
    load drifts over all of them alike."""
    requests = [GenerationRequest.with_defaults(e.pipeline, [], max_tokens, None, seed=0) for e in engines]
    encoded = [[e.encode_prompt(p["prompt"]) for p in prompts] for e in engines]
    for engine, request, ids in zip(engines, requests, encoded):
        engine.generate(ids[0], request.sampling, 8).run()  # warm-up: first calls allocate and page in weights
    runs = [Calibration() for _ in engines]
    for index in track(range(len(prompts)), description="calibrating", disable=quiet):
        for engine, request, ids, run in zip(engines, requests, encoded, runs):
            for gamma in (0, OWN_GAMMA, *gammas):
                generation = engine.generate(ids[index], request.sampling, request.max_tokens, num_draft_tokens=gamma)
                generation.run()
                (run.plain if gamma == 0 else run.by_gamma.setdefault(gamma, [])).append(generation.stats)
    return runs
