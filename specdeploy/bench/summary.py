"""The summary maths of a bench: speeds, acceptance and costs over every prompt's plain and speculative runs, and
the speedup the cost model predicts from them (speculative/speedup.py)."""

from __future__ import annotations

from dataclasses import dataclass

from specdeploy.bench.results import KindSpeeds, Summary
from specdeploy.decoding.stats import RequestStats, decode_rate, mean_accepted_length
from specdeploy.runtime.engine import Engine
from specdeploy.speculative.speedup import predicted_speedup


@dataclass
class PromptRun:
    """One prompt decoded plain and with speculation."""
    kind: str
    plain: RequestStats
    speculative: RequestStats
    plain_tokens: list[int]
    speculative_tokens: list[int]


def plain_step_seconds(plain: list[RequestStats]) -> float:
    """The mean time of one plain decode step: the unit of draft, head and verify costs."""
    return sum(s.verify_seconds for s in plain) / max(sum(s.steps for s in plain), 1)


def acceptance_by_position(speculative: list[RequestStats], gamma: int) -> list[float]:
    """[i]: of the steps that drafted position i + 1, the fraction that accepted it. A position no step drafted
    (past a gamma cap) has no acceptance to report, rather than 0, and is left out."""
    drafted, accepted = [0] * gamma, [0] * gamma
    for s in speculative:
        for i, (d, a) in enumerate(zip(s.drafted_per_position, s.accepted_per_position)):
            drafted[i] += d
            accepted[i] += a
    return [a / d for d, a in zip(drafted, accepted) if d]


def speeds_by_kind(runs: list[PromptRun]) -> dict[str, KindSpeeds]:
    by_kind = {}
    for kind in sorted({r.kind for r in runs}):
        chosen = [r for r in runs if r.kind == kind]
        base, rate = decode_rate([r.plain for r in chosen]), decode_rate([r.speculative for r in chosen])
        if base and rate:  # a kind whose answers ended at once decoded nothing: there is no speed to compare
            tokens = mean_accepted_length(sum(r.speculative.decode_tokens for r in chosen),
                                          sum(r.speculative.steps for r in chosen))
            by_kind[kind] = KindSpeeds(speedup=rate / base, prompts=len(chosen), plain_tokens_per_s=base,
                                       speculative_tokens_per_s=rate, mean_accepted_length=tokens)
    return by_kind


def summarize(engine: Engine, runs: list[PromptRun]) -> Summary:
    plain = [r.plain for r in runs]
    spec = [r.speculative for r in runs]
    baseline, speculative = decode_rate(plain), decode_rate(spec)
    drafted, accepted = sum(s.drafted for s in spec), sum(s.accepted for s in spec)
    steps = sum(s.steps for s in spec)
    emitted = sum(s.decode_tokens for s in spec)
    plain_step = plain_step_seconds(plain)
    # c per draft forward for a draft model; per drafted token for a draft-free proposer (no forwards).
    draft_units = sum(s.draft_forwards for s in spec) or drafted
    draft_cost = sum(s.draft_seconds for s in spec) / max(draft_units, 1) / plain_step
    verify_cost = sum(s.verify_seconds for s in spec) / max(steps, 1) / plain_step
    alpha = accepted / drafted if drafted else 0.0
    speculative_steps = sum(s.speculative_steps for s in spec)
    mean_drafted = drafted / speculative_steps if speculative_steps else 0.0
    # Under the heuristic schedule gamma varies per step: the formula gets the mean proposal length instead.
    formula_gamma = engine.num_draft_tokens if engine.pipeline.speculation.schedule == "constant" else mean_drafted
    return Summary(
        baseline_tokens_per_s=baseline,
        speculative_tokens_per_s=speculative,
        speedup=speculative / baseline if baseline else 0.0,
        acceptance_rate=alpha,
        mean_accepted_length=mean_accepted_length(emitted, steps),
        draft_cost_ratio=draft_cost,
        verify_cost_ratio=verify_cost,
        predicted_speedup=predicted_speedup(alpha, formula_gamma, draft_cost, verify_cost),
        mean_draft_tokens_per_step=mean_drafted,
        proposal_cost_per_step=sum(s.draft_seconds for s in spec) / max(speculative_steps, 1) / plain_step,
        per_position_acceptance=acceptance_by_position(spec, engine.num_draft_tokens),
        by_kind=speeds_by_kind(runs))
