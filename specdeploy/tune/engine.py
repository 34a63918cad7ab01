"""tune_engine: the measurements a build makes on this machine after writing an engine, in their order.

Each step decides whether the pipeline asks for it, whether the engine already holds its record, and otherwise
measures and writes that record. Later steps measure an engine that runs with what earlier ones chose (the gamma
cap times steps run by the kept programs, at the measured exit layer), so a step that runs again makes every step
after it run again: the engine's records always describe one another.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from specdeploy.runtime.step_programs import not_built_reason, read_record, steps_mode
from specdeploy.spec.engine_paths import PIPELINE_FILE, measured_exit_layer, measured_gamma_cap
from specdeploy.spec.pipeline import PipelineSpec, load_pipeline


@dataclass(frozen=True)
class TuneStep:
    """One measurement. skipped: why the pipeline does not ask for it (None: it does). current: the engine holds a
    record of it that the pipeline's settings still describe. run: measure, write the record, and say what was
    chosen, in a sentence."""

    name: str
    skipped: Callable[[PipelineSpec], str | None]
    current: Callable[[PipelineSpec, Path], bool]
    run: Callable[[PipelineSpec, Path, bool], str]


def run_step_programs(pipeline: PipelineSpec, directory: Path, quiet: bool) -> str:
    from specdeploy.tune.step_programs import build_step_programs, verdict

    record = build_step_programs(pipeline, directory, quiet)
    return "; ".join(f"{component}: " + (verdict(entry) if "ratio" in entry else "eager")
                     for component, entry in record["components"].items())


def run_exit_layer(pipeline: PipelineSpec, directory: Path, quiet: bool) -> str:
    from specdeploy.tune.exit_layer import measure_exit_layer

    return measure_exit_layer(directory, quiet)


def run_gamma_cap(pipeline: PipelineSpec, directory: Path, quiet: bool) -> str:
    from specdeploy.tune.gamma_cap import measure_gamma_cap

    return measure_gamma_cap(directory, quiet)


def measured_setting(value: object, key: str) -> str | None:
    return None if value == "measured" else f"{key} is not measured"


STEPS = (
    TuneStep("step programs", not_built_reason,
             lambda pipeline, directory: (read_record(directory) or {}).get("steps") == steps_mode(pipeline),
             run_step_programs),
    TuneStep("exit layer",
             lambda pipeline: measured_setting(getattr(pipeline.speculation.settings, "exit_layer", None),
                                               "speculation.early_exit.exit_layer"),
             lambda pipeline, directory: measured_exit_layer(directory) is not None, run_exit_layer),
    TuneStep("gamma cap",
             lambda pipeline: measured_setting(pipeline.serving.policy.gamma_cap, "serving.policy.gamma_cap"),
             lambda pipeline, directory: measured_gamma_cap(directory) is not None, run_gamma_cap),
)


def tune_engine(directory: Path, quiet: bool = False, again: bool = False) -> list[str]:
    """Run each step the engine's pipeline asks for whose record is missing or stale (again: every one), and every
    step after one that ran; returns what each step that ran chose."""
    directory = Path(directory)
    pipeline = load_pipeline(directory / PIPELINE_FILE)  # the declared settings: "measured" where measured
    said, redo = [], again
    for step in STEPS:
        if step.skipped(pipeline) is not None:
            continue
        if redo or not step.current(pipeline, directory):
            if not quiet:
                print(f"[{pipeline.name}] measuring the {step.name} on this machine")
            said.append(step.run(pipeline, directory, quiet))
            if not quiet:
                print(said[-1])
            redo = True
    return said
