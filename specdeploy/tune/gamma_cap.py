"""The gamma cap a pipeline asks to be measured (serving.policy.gamma_cap: measured).

How many tokens a step should draft depends on the machine: a verify's cost grows with its width where the kernels
are not bandwidth bound (an int4 target on a CPU), and on an MoE target verifying n tokens reads the union of their
experts. For a tree method (Medusa, EAGLE, lookahead) gamma is the tree's depth cap, so the cap cuts the tree to
its first levels, or turns drafting off where no depth pays. So the cap is measured where the engine runs: every
calibration prompt decoded plain, at the pipeline's full gamma and at each smaller gamma of SWEEP, and the gamma
whose realized speedup is best becomes the cap (the pipeline's own unless a smaller one beats it by MARGIN), or 0
(no drafting) when none beats plain decode. It is written into the engine (engine_paths.MEASURED_POLICY_FILE),
which serves with it from then on.

`specdeploy build` (tune/engine.py) measures it on the calibration prompts the bench never uses; `specdeploy bench
--measure-gamma-cap` measures it again on the bench's prompts, with what else its report saw.
"""

from __future__ import annotations

import time
from pathlib import Path

import torch

from specdeploy.errors import SpecdeployError
from specdeploy.models import machine
from specdeploy.runtime.engine import Engine
from specdeploy.spec.engine_paths import MEASURED_POLICY_FILE, PIPELINE_FILE, write_json
from specdeploy.spec.pipeline import load_pipeline
from specdeploy.tune import contention
from specdeploy.tune.calibration import CALIBRATION_TOKENS, calibrate, calibration_prompts

SWEEP = (1, 2, 3, 4, 6, 8, 12, 16)  # the gammas tried below the pipeline's own
# A smaller gamma than the pipeline's is picked only when it beats it by more than this: side by side in one run,
# gammas whose speedups differ by less swap places from run to run on this project's shared machines.
MARGIN = 1.03
CONTENDED_RULE = "every calibration was contended, so the rule: the pipeline's own gamma"


def sweep_gammas(gamma: int) -> tuple[int, ...]:
    """The gammas a measurement decodes at besides the pipeline's `gamma`."""
    return tuple(g for g in SWEEP if g < gamma)


def gamma_cap_record(by_gamma: dict[int, float], full: int) -> dict:
    """The cap picked from realized speedups by gamma (`full`: the pipeline's own gamma, measured too), with them."""
    missing = set(sweep_gammas(full)) - set(by_gamma)
    if missing or full not in by_gamma:
        raise SpecdeployError(f"a gamma cap is picked from speedups at gammas {sorted(missing | {full})} too, which "
                              f"were not measured")
    best = max(by_gamma, key=by_gamma.__getitem__)
    if by_gamma[best] < by_gamma[full] * MARGIN:
        best = full
    return {"gamma_cap": best if by_gamma[best] > 1 else 0, "measured_at_gamma": full,
            "realized_speedup_by_gamma": {str(g): by_gamma[g] for g in sorted(by_gamma)},
            "machine": machine.describe(), "measured": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())}


def lift_gamma_cap(engine: Engine) -> None:
    """Let `engine` draft its pipeline's full gamma, whatever its cap, so every gamma up to it can be measured (a
    chain's length, or a tree's depth: Medusa, EAGLE and lookahead cut their trees at a row's gamma)."""
    if not engine.speculation.speculates:
        raise SpecdeployError(f"{engine.pipeline.name}: a measured gamma cap needs speculation, and the pipeline's "
                              f"method is none")
    engine.pipeline = engine.pipeline.with_gamma_cap(None)


def write_gamma_cap(engine_dir: Path, record: dict) -> str:
    """Write the measured policy into the engine; returns what it picked and why, in a sentence."""
    path = Path(engine_dir) / MEASURED_POLICY_FILE
    write_json(path, record)
    cap, by_gamma = record["gamma_cap"], record["realized_speedup_by_gamma"]
    sweep = ", ".join(f"{g}: {v:.2f}x" for g, v in by_gamma.items())
    picked = ("gamma cap 0: no gamma beat plain decode here, so the engine decodes plain" if cap == 0 else
              f"gamma cap {cap}: {by_gamma[str(cap)]:.2f}x plain decode")
    if record.get("decided_by", "timing") != "timing":
        picked = f"gamma cap {cap} by rule ({record['decided_by']}; `specdeploy tune` measures again)"
    text = (f"{picked} (realized by gamma: {sweep}; {record['prompts']} prompts, {record['seconds']:.0f} s); "
            f"written to {path}")
    declared = load_pipeline(Path(engine_dir) / PIPELINE_FILE).serving.policy.gamma_cap
    if declared != "measured":
        text += (f". This pipeline's serving.policy.gamma_cap is {declared!r}: set it to measured (and rebuild) to "
                 f"serve with it")
    return text


def measure_gamma_cap(engine_dir: Path, quiet: bool = False) -> str:
    """Measure the engine's gamma cap on the calibration prompts and write it into the engine; returns what it
    picked, in a sentence."""
    started = time.perf_counter()
    engine = Engine(engine_dir)
    lift_gamma_cap(engine)
    prompts, full = calibration_prompts(engine), engine.num_draft_tokens

    def measure() -> dict:
        with contention.Watch() as watch:
            run, = calibrate([engine], prompts, CALIBRATION_TOKENS, sweep_gammas(full), quiet)
        conditions = contention.judge(watch.wall_seconds, watch.cpu_seconds, torch.get_num_threads(), {})
        return {"by_gamma": {**{g: run.speedup(g) for g in sweep_gammas(full)}, full: run.speedup()},
                "conditions": conditions.as_record()}

    measured, attempts = contention.until_quiet(measure, pause=contention.PAUSE_SECONDS)
    record = decided_gamma_cap(measured["by_gamma"], full, attempts)
    record |= {"prompts": len(prompts), "max_tokens": CALIBRATION_TOKENS,
               "seconds": round(time.perf_counter() - started, 1)}
    return write_gamma_cap(engine_dir, record)


def decided_gamma_cap(by_gamma: dict[int, float], full: int, attempts: list[dict]) -> dict:
    """gamma_cap_record, with the conditions of every attempt beside it; when every one was contended the speedups
    are noise and the stated rule decides: the pipeline's own gamma (its author's choice), no cap below it."""
    record = gamma_cap_record(by_gamma, full) | {"conditions": attempts, "decided_by": "timing"}
    if attempts and all(conditions["contended"] for conditions in attempts):
        record |= {"gamma_cap": full, "decided_by": f"{CONTENDED_RULE}; last: {attempts[-1]['contended']}"}
    return record
