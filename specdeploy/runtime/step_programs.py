"""An engine's compiled step programs (models/step_program.py) at load: which the Engine runs, and why the others
run eagerly. `specdeploy build` compiles, times and keeps them (tune/step_programs.py).

`backend.torch.steps` says what the build does for each model an engine steps (the target, and a draft model):
measured (the default) keeps a model's program where it beats eager on this machine, compiled keeps it whatever the
timing, eager compiles nothing. The build writes `steps/<component>.pt2` and `steps/build.json` (what was compiled,
its seconds, the timings and the verdicts, the torch version and the CPU). A load uses a kept program when the torch
and the CPU it runs on are the build's, and otherwise runs eagerly and says why (Engine.step_programs); the engine
directory is only read.
"""

from __future__ import annotations

import json
import os
import platform
import time
from pathlib import Path

import torch

from specdeploy.errors import BuildError
from specdeploy.models.llama import LlamaModel
from specdeploy.models.step_program import load_step_program, run_compiled
from specdeploy.spec.pipeline import PipelineSpec

STEPS_DIR = "steps"  # under the engine directory
RECORD = "build.json"  # in STEPS_DIR, written last
STEPS_VARIABLE = "SPECDEPLOY_STEPS"  # overrides backend.torch.steps at build (eager: a quick build, as the tests do)


def steps_mode(pipeline: PipelineSpec) -> str:
    """backend.torch.steps, or what $SPECDEPLOY_STEPS says instead."""
    mode = os.environ.get(STEPS_VARIABLE) or pipeline.backend.steps
    if mode not in ("measured", "compiled", "eager"):
        raise BuildError(f"${STEPS_VARIABLE} is {mode!r}: allowed values are measured, compiled and eager")
    return mode


def stepped_components(pipeline: PipelineSpec) -> list[str]:
    """The engine's models a step runs a forward of: the target, and a draft model."""
    return ["target", *(["draft"] if pipeline.speculation.draft is not None else [])]


def not_built_reason(pipeline: PipelineSpec) -> str | None:
    """Why this pipeline's engine has no step programs at all, None when the build makes them."""
    if pipeline.backend.kind != "torch":
        return "backend.kind is not torch"
    if steps_mode(pipeline) == "eager":
        return f"backend.torch.steps (or ${STEPS_VARIABLE}): eager"
    if pipeline.serving.determinism == "batch_invariant":
        return "serving.determinism batch_invariant attends row by row, which a program does not"
    if torch.device(pipeline.backend.device).type != "cpu":
        return "programs are measured on the CPU only"
    return None


def eager_first_run(pipeline: PipelineSpec, directory: Path) -> str | None:
    """For `specdeploy demo`: when the engine at `directory` holds no compiled programs yet and its build would
    compile them (minutes: about 4 for a draft-target pipeline on 2 cores), build and serve it eagerly instead, by
    setting $SPECDEPLOY_STEPS to eager for this process and the server it starts, so that a newcomer sees tokens
    within the first minute and no request waits for a compiler. A later `specdeploy build` of the same pipeline
    compiles and keeps the programs (the build measures what the engine lacks). Returns the sentence that says so,
    None where nothing changes (programs already built, not asked for, or $SPECDEPLOY_STEPS set)."""
    if os.environ.get(STEPS_VARIABLE) or not_built_reason(pipeline) is not None or read_record(directory) is not None:
        return None
    os.environ[STEPS_VARIABLE] = "eager"
    return (f"{pipeline.name}: built and served without compiled step programs, to answer sooner; `specdeploy "
            f"build` of this pipeline compiles them (minutes), and the next demo or server runs them")


def machine() -> str:
    """The CPU a program was compiled for (its kernels use that CPU's vector instructions)."""
    model = next((line.split(":", 1)[1].strip() for line in Path("/proc/cpuinfo").read_text().splitlines()
                  if line.startswith("model name")), platform.processor()) if Path("/proc/cpuinfo").exists() \
        else platform.processor()
    return f"{platform.machine()} {model} {torch.backends.cpu.get_cpu_capability()}"


def read_record(directory: Path) -> dict | None:
    path = Path(directory) / STEPS_DIR / RECORD
    return json.loads(path.read_text()) if path.is_file() else None


def programs_compile_seconds(directory: Path) -> float | None:
    """Wall seconds the build spent compiling the engine's step programs (side by side, so less than the sum of
    each program's compile seconds), None when it compiled none."""
    record = read_record(directory) or {}
    compiled = any("compile_seconds" in entry for entry in record.get("components", {}).values())
    return record.get("compile_wall_seconds") if compiled else None


def usable_programs(pipeline: PipelineSpec, directory: Path) -> tuple[dict[str, Path], dict[str, str]]:
    """(component → program to load, component → why it runs eagerly) for the engine at `directory`."""
    components = stepped_components(pipeline)
    reason = not_built_reason(pipeline)
    record = read_record(directory) if reason is None else None
    if reason is None and record is None:
        reason = "the build compiled no step programs (rebuild with specdeploy build --force)"
    elif record is not None and record["torch"] != torch.__version__:
        reason = f"compiled for torch {record['torch']}, this is {torch.__version__} (rebuild the engine)"
    elif record is not None and record["machine"] != machine():
        reason = f"compiled on another CPU ({record['machine']}; rebuild the engine here)"
    if reason is not None:
        return {}, {component: reason for component in components}
    programs, eager = {}, {}
    for component in components:
        entry = record["components"].get(component)
        if entry is None:
            eager[component] = "the build compiled no program for it"
        elif "skipped" in entry:
            eager[component] = entry["skipped"]
        elif "error" in entry:
            eager[component] = f"compiling its program failed at build: {entry['error'].splitlines()[-1]}"
        elif not entry["kept"]:
            eager[component] = f"measured at build: {entry['compiled_ms']:.1f} ms compiled, {entry['eager_ms']:.1f} " \
                               f"ms eager"
        else:
            programs[component] = Path(directory) / STEPS_DIR / f"{component}.pt2"
    return programs, eager


def use_program(model: LlamaModel, path: Path, capture: tuple[int, ...] = ()) -> float:
    """Run `model`'s forwards through the program at `path`, compiled to capture `capture`; returns the seconds
    loading it took."""
    started = time.perf_counter()
    run_compiled(model, load_step_program(model, path), capture)
    return time.perf_counter() - started
