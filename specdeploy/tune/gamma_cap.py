"""The gamma cap a pipeline asks to be measured (serving.policy.gamma_cap: measured). How many tokens a step should
draft depends on the machine: a verify's cost grows with its width where the kernels are not bandwidth bound (an
int4 target on a CPU), and on an MoE target verifying n tokens reads the union of their experts. So the cap is
measured where the engine runs: every prompt decoded plain, at the pipeline's full gamma and at each smaller gamma of
SWEEP, and the gamma whose realized speedup is best becomes the cap (the pipeline's own unless a smaller one beats it
by MARGIN), or 0 (no drafting) when none beats plain decode.
It is written into the engine (engine_paths.MEASURED_POLICY_FILE), which serves with it from then on.

`specdeploy build` measures it on calibration prompts the bench never uses; `specdeploy bench --measure-gamma-cap`
measures it again on the bench's prompts. Realized speedups, not predicted ones: an n-gram drafter's acceptance by
position is conditional on a match long enough to draft that position, which the by-position prediction (a chain's
prefix probabilities) overstates by 2x and more."""

from __future__ import annotations

import time
from dataclasses import asdict
from itertools import islice
from pathlib import Path

from specdeploy.bench.results import BenchReport
from specdeploy.errors import SpecdeployError
from specdeploy.runtime.engine import Engine
from specdeploy.spec.engine_paths import MEASURED_POLICY_FILE, PIPELINE_FILE, write_json
from specdeploy.spec.pipeline import load_pipeline

SWEEP = (1, 2, 3, 4, 6, 8, 12, 16)  # the gammas tried below the pipeline's own
# A smaller gamma than the pipeline's is picked only when it beats it by more than this: side by side in one run,
# gammas whose speedups differ by less swap places from run to run on this project's shared machines.
MARGIN = 1.03
# At build: two written prompts of each kind the Medusa training prompts have (code edits, fixes, edits, summaries,
# JSON, messages, open-ended), none of them the bench's, decoded for this many tokens.
CALIBRATION_PROMPTS_PER_KIND = 2
CALIBRATION_TOKENS = 48


def sweep_gammas(gamma: int) -> tuple[int, ...]:
    """The gammas a measurement decodes at besides the pipeline's `gamma`."""
    return tuple(g for g in SWEEP if g < gamma)


def measured_policy(report: BenchReport) -> dict:
    """What is written into the engine: the cap, the realized speedup by gamma it was picked from, and what else
    the measurement saw (and the seconds it took)."""
    full = report.setup.num_draft_tokens
    by_gamma = {**(report.gamma_sweep or {}), full: report.summary.speedup}
    best = max(by_gamma, key=by_gamma.__getitem__)
    if by_gamma[best] < by_gamma[full] * MARGIN:
        best = full
    summary = report.summary
    policy = {"gamma_cap": best if by_gamma[best] > 1 else 0, "measured_at_gamma": report.setup.num_draft_tokens,
              "realized_speedup_by_gamma": {str(g): by_gamma[g] for g in sorted(by_gamma)},
              "per_position_acceptance": summary.per_position_acceptance,
              "draft_cost_ratio": summary.draft_cost_ratio, "verify_costs": report.verify_costs,
              "prompts": report.setup.prompts, "max_tokens": report.setup.max_tokens,
              "seconds": round(sum(report.phase_seconds.values()), 1), "machine": asdict(report.setup.machine),
              "measured": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())}
    if report.moe is not None:  # the MoE's union-curve prediction, beside what was realized
        policy["moe_predicted_speedup_by_gamma"] = report.moe.predicted_speedup_by_gamma
    return policy


def lift_gamma_cap(engine: Engine) -> None:
    """Let `engine` draft its pipeline's full gamma, whatever its cap, so every gamma up to it can be measured."""
    if not engine.speculation.drafts_outside_target:
        raise SpecdeployError(f"{engine.pipeline.name}: a measured gamma cap needs draft_target or ngram "
                              f"speculation (a Medusa tree sets its own width), the pipeline's is {engine.method}")
    engine.pipeline = engine.pipeline.with_gamma_cap(None)


def save_gamma_cap(engine: Engine, report: BenchReport) -> str:
    """Write the measured policy into the engine; returns what it picked and why, in a sentence."""
    missing = set(sweep_gammas(report.setup.num_draft_tokens)) - set(report.gamma_sweep or {})
    if missing:
        raise SpecdeployError(f"{engine.pipeline.name}: a gamma cap is picked from speedups at gammas "
                              f"{sorted(missing)} too, which were not measured")
    policy = measured_policy(report)
    path = engine.dir / MEASURED_POLICY_FILE
    write_json(path, policy)
    cap, by_gamma = policy["gamma_cap"], policy["realized_speedup_by_gamma"]
    sweep = ", ".join(f"{g}: {v:.2f}x" for g, v in by_gamma.items())
    picked = ("gamma cap 0: no gamma beat plain decode here, so the engine decodes plain" if cap == 0 else
              f"gamma cap {cap}: {by_gamma[str(cap)]:.2f}x plain decode")
    text = (f"{picked} (realized by gamma: {sweep}; {policy['prompts']} prompts, {policy['seconds']:.0f} s); "
            f"written to {path}")
    declared = load_pipeline(engine.dir / PIPELINE_FILE).serving.policy.gamma_cap
    if declared != "measured":
        text += (f". This pipeline's serving.policy.gamma_cap is {declared!r}: set it to measured (and rebuild) to "
                 f"serve with it")
    return text


def calibration_prompts(engine: Engine) -> list[dict]:
    """The build's prompts: the first CALIBRATION_PROMPTS_PER_KIND written training prompts of each kind that fit
    the engine's limits.max_input_length."""
    from specdeploy.training.prompts import written_families

    longest = engine.pipeline.limits.max_input_length
    chosen = []
    for kind, prompts in written_families(0).items():
        fitting = (p for p in prompts if len(engine.encode_prompt(p)) <= longest)  # encoded only until enough fit
        chosen += [{"prompt": prompt, "kind": kind} for prompt in islice(fitting, CALIBRATION_PROMPTS_PER_KIND)]
    if not chosen:
        raise SpecdeployError(f"{engine.pipeline.name}: no calibration prompt fits limits.max_input_length "
                              f"({longest} tokens), so no gamma cap can be measured")
    return chosen


def measure_gamma_cap(engine_dir: Path, quiet: bool = False) -> str:
    """At build: measure the engine's gamma cap on the calibration prompts and write it into the engine; returns
    what it picked, in a sentence."""
    from specdeploy.bench.run import run_benches

    engine = Engine(engine_dir)
    lift_gamma_cap(engine)
    report, = run_benches([engine], calibration_prompts(engine), CALIBRATION_TOKENS, temperature=None, seed=0,
                          with_transformers=False, quiet=quiet, gammas=sweep_gammas(engine.num_draft_tokens))
    return save_gamma_cap(engine, report)
