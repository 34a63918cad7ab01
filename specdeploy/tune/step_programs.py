"""Compiling, timing and keeping an engine's step programs: the first step of tune_engine (tune/engine.py).

For each model an engine steps (runtime/step_programs.py says which, and what a load does with the result), the
build compiles its step program, times a decode step and a verify with it and eagerly, and keeps it where it pays (or
always, with backend.torch.steps: compiled). A model with int4 layers gets two programs, its matmuls compiled two
ways (step_program.VARIANTS: torch's int4 kernel, or inductor's weight-only GEMM template), and keeps the faster:
which one wins depends on the CPU.

Each program is compiled, and then each component's programs timed, in fresh processes (`python -m
specdeploy.tune.step_programs DIR NAME compile VARIANT | time VARIANT...`): export needs a model with its weights
unpacked, and the timings should not share a process with a compiler's threads and caches. The compiles run side by
side (a draft-target build's three take about as long as two one after another), the timings one component at a
time, its variants and the eager model in alternating rounds. A variant that fails to compile is left out.
"""

from __future__ import annotations

import json
import os
import shutil
import statistics
import subprocess
import sys
import time
from pathlib import Path

import torch
from rich.progress import Progress, SpinnerColumn, TextColumn, TimeElapsedColumn
from safetensors import safe_open

from specdeploy.errors import BuildError
from specdeploy.models.cpu_threads import apply_once
from specdeploy.models.llama import LlamaModel
from specdeploy.models.registry import load_component
from specdeploy.models.step_program import VARIANTS, export_step_program
from specdeploy.runtime.step_programs import (
    RECORD,
    STEPS_DIR,
    machine,
    stepped_components,
    steps_mode,
    use_program,
)
from specdeploy.spec.engine_paths import engine_pipeline
from specdeploy.spec.pipeline import PipelineSpec
from specdeploy.speculative.registry import captured_layers
from specdeploy.tune import contention, program_store

KEEP_BELOW = 0.97  # measured: a program is kept when it takes less than this fraction of the eager time
CONTEXT = 128  # cached tokens the timings step over
VERIFY_WIDTH = 6  # the verify the timings add to a decode step (gamma 5)
TIMED_STEPS = 15
EAGER = "eager"  # the eager model's name beside the variants' in a timing


def build_step_programs(pipeline: PipelineSpec, directory: Path, quiet: bool = False) -> dict:
    """Compile, time and keep or drop each stepped model's program; returns the record written. The programs
    compile side by side (each compiler is mostly one thread) and are then timed one after another, alone."""
    steps = Path(directory) / STEPS_DIR
    (steps / RECORD).unlink(missing_ok=True)
    steps.mkdir(exist_ok=True)
    mode = steps_mode(pipeline)
    record = {"torch": torch.__version__, "machine": machine(), "steps": mode, "components": {}}
    columns = (SpinnerColumn(), TextColumn("{task.description}"), TimeElapsedColumn())
    with Progress(*columns, disable=quiet) as progress:
        tasks = {component: progress.add_task(f"[{pipeline.name}] compiling the {component}'s step program "
                                              f"(AOTInductor)", total=None)
                 for component in stepped_components(pipeline)}
        started = time.perf_counter()
        compiling = {(component, variant): run_phase(directory, component, "compile", variant)
                     for component in tasks for variant in program_variants(Path(directory) / component)}
        try:
            compiled = {key: phase_result(process) for key, process in compiling.items()}
        finally:  # an interrupted build leaves no compiler running
            for process in compiling.values():
                process.kill()
                process.wait()
        record["compile_wall_seconds"] = round(time.perf_counter() - started, 1)
        measure_programs(pipeline, directory, compiled, record, progress, tasks)
    (steps / RECORD).write_text(json.dumps(record, indent=2))
    return record


def program_variants(folder: Path) -> list[str]:
    """The variants (step_program.VARIANTS) a build compiles and times for the model in `folder`: inductor's C++
    GEMM templates only where a model has int4 layers, whose weight-only template is what can beat torch's int4
    kernel; a dense model's matmuls are oneDNN's either way."""
    with safe_open(str(folder / "model.safetensors"), framework="pt") as weights:
        int4 = any(name.endswith(".codes") for name in weights.keys())
    return [name for name in VARIANTS if int4 or name == "aten"]


def measure_programs(pipeline: PipelineSpec, directory: Path, compiled: dict[tuple[str, str], dict], record: dict,
                     progress: Progress, tasks: dict) -> None:
    """Given every compile's result, time each component's compiled variants (alone: no compiler beside them), keep
    the fastest where it beats eager, and record the verdicts. A variant that failed to compile is recorded and
    left out; the component runs eagerly (or, in compiled mode, the build fails) only when none compiled."""
    steps, mode = Path(directory) / STEPS_DIR, record["steps"]
    for component in tasks:
        variants = {variant: entry for (name, variant), entry in compiled.items() if name == component}
        working = {variant: entry for variant, entry in variants.items() if not failed(entry)}
        if working:
            progress.update(tasks[component], description=f"[{pipeline.name}] timing the {component}'s step "
                                                          f"programs against eager")
            # a timing on a machine busy with other work is taken again, and its conditions kept (contention.py)
            timed, attempts = contention.until_quiet(
                lambda name=component, names=tuple(working): phase_result(run_phase(directory, name, "time", *names)),
                pause=contention.PAUSE_SECONDS)
            entry = timed if failed(timed) else chosen(working, timed, by_rule=contended(attempts))
            if attempts:
                entry["conditions"] = attempts
            entry["variants"] = entry.get("variants", {}) | {name: variants[name] for name in variants
                                                            if name not in working}
            doing = "timing"
        else:
            entry, doing = next(iter(variants.values())), "compiling"
        record["components"][component] = entry
        if failed(entry):
            refuse_in_compiled_mode(entry, directory, component, doing, mode)
            entry["kept"] = False
            why = "eager, " + entry["skipped"] if "skipped" in entry else f"{doing} failed, eager"
            progress.update(tasks[component], completed=1, total=1, description=f"[{pipeline.name}] {component}: {why}")
        else:
            entry["kept"], entry["decided_by"] = keep_program(entry, mode)
            if entry["kept"]:
                program_path(directory, component, entry["variant"]).replace(steps / f"{component}.pt2")
            progress.update(tasks[component], completed=1, total=1,
                            description=f"[{pipeline.name}] {component}: " + verdict(entry))
        for variant in variants:
            program_path(directory, component, variant).unlink(missing_ok=True)


def contended(attempts: list[dict]) -> bool:
    """Whether every timing of a component ran on a contended machine (none to choose from)."""
    return bool(attempts) and all(conditions["contended"] for conditions in attempts)


# What a build does when every timing was contended: keep the program (torch's int4 kernel's variant, which every
# model has). Timed quietly, every model's program took 0.72 to 0.77 of its eager step (docs/benchmarks.md,
# "Compiled step programs"); a noisy timing that says otherwise is noise.
CONTENDED_RULE = "every timing was contended, so the rule: keep the aten program (quietly 0.72-0.77 of eager)"


def keep_program(entry: dict, mode: str) -> tuple[bool, str]:
    """Whether to keep a component's timed program, and what decided it: the mode, the timing, or the rule."""
    if mode == "compiled":
        return True, "backend.torch.steps: compiled"
    if contended(entry.get("conditions", [])):
        return True, f"{CONTENDED_RULE}; last: {entry['conditions'][-1]['contended']}"
    return entry["ratio"] < KEEP_BELOW, "timing" + (" (taken again: contended)" if len(entry.get("conditions", []))
                                                    > 1 else "")


def failed(entry: dict) -> bool:
    """Whether a phase's result is a failure or a compile skipped for want of a compiler."""
    return "error" in entry or "skipped" in entry


def chosen(compiles: dict[str, dict], timed: dict, by_rule: bool = False) -> dict:
    """A component's record entry: the fastest variant's figures (by_rule: the aten variant's, CONTENDED_RULE),
    and every variant's compile and timing."""
    variants = {variant: compiles[variant] | timed["variants"][variant] for variant in compiles}
    fastest = min(variants, key=lambda variant: variants[variant]["compiled_ms"])
    if by_rule and "aten" in variants:
        fastest = "aten"
    best = variants[fastest]
    return {"variant": fastest, "compile_seconds": round(sum(v["compile_seconds"] for v in variants.values()), 1),
            "from_store": all(v["from_store"] for v in variants.values()), "load_seconds": best["load_seconds"],
            "package_bytes": best["package_bytes"], "compiled_ms": best["compiled_ms"], "eager_ms": timed["eager_ms"],
            "ratio": round(best["compiled_ms"] / timed["eager_ms"], 3), "variants": variants,
            "cpu_threads": timed.get("cpu_threads")}


def program_path(directory: Path, component: str, variant: str) -> Path:
    """Where a variant's program is compiled to; the kept one becomes steps/<component>.pt2."""
    return Path(directory) / STEPS_DIR / f"{component}.{variant}.pt2"


def run_phase(directory: Path, component: str, phase: str, *variants: str) -> subprocess.Popen:
    return subprocess.Popen([sys.executable, "-m", "specdeploy.tune.step_programs", str(directory), component,
                             phase, *variants], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)


def phase_result(process: subprocess.Popen) -> dict:
    """The JSON a phase printed, or {"error": the end of what it wrote to stderr}."""
    stdout, stderr = process.communicate()
    if process.returncode != 0:
        return {"error": stderr.strip()[-1500:]}
    return json.loads(stdout.splitlines()[-1])


def refuse_in_compiled_mode(entry: dict, directory: Path, component: str, doing: str, mode: str) -> None:
    """In compiled mode a component left without a program fails the build; in measured mode its failure or skip is
    recorded (the model runs eagerly, usable_programs says why)."""
    if mode != "compiled":
        return
    if "skipped" in entry:
        raise BuildError(f"backend.torch.steps: compiled: the {component}'s {entry['skipped']}: install g++, or use "
                         f"steps: measured")
    raise BuildError(f"{directory}: {doing} the {component}'s step program failed:\n{entry['error']}")


def verdict(entry: dict) -> str:
    """One line on a component's program: compiled in how long (or taken from the store), its step against eager,
    kept or not."""
    kept = "kept" if entry["kept"] else "not kept (eager is as fast)"
    if entry.get("decided_by", "").startswith(CONTENDED_RULE):
        kept = f"kept by rule ({entry['decided_by']})"
    made = "programs from the store" if entry["from_store"] else \
        f"programs compiled in {entry['compile_seconds']:.0f} s"
    return (f"{made}; {entry['variant']} fastest, decode + verify {entry['compiled_ms']:.1f} ms "
            f"against {entry['eager_ms']:.1f} ms eager ({entry['ratio']:.2f}×): {kept}")


def time_steps(models: dict[str, LlamaModel], rows: int = 1, capture: tuple[int, ...] = ()) -> dict[str, list[float]]:
    """Milliseconds of each timed round of a decode step plus a verify of VERIFY_WIDTH tokens after CONTEXT cached
    ones, for each of `models`, timed in alternating rounds (one step of each in turn) so that a slow spell of a
    shared machine falls on all of them alike. capture: what each forward captures, as the engine's steps do."""
    caches = {name: model.new_cache(rows, CONTEXT + VERIFY_WIDTH + 2) for name, model in models.items()}
    generator = torch.Generator().manual_seed(0)
    vocab = next(iter(models.values())).config.vocab_size
    prompt = torch.randint(0, vocab, (rows, CONTEXT), generator=generator)
    times: dict[str, list[float]] = {name: [] for name in models}
    with torch.inference_mode():
        for name, model in models.items():
            model(prompt, torch.arange(CONTEXT)[None].expand(rows, -1), caches[name], capture=capture)
        for _ in range(3 + TIMED_STEPS):
            for name, model in models.items():
                started = time.perf_counter()
                for width in (1, VERIFY_WIDTH):
                    caches[name].lengths = [CONTEXT] * rows
                    positions = (CONTEXT + torch.arange(width))[None].expand(rows, -1)
                    model.logits(model(torch.randint(0, vocab, (rows, width), generator=generator), positions,
                                       caches[name], capture=capture).hidden)
                times[name].append(time.perf_counter() - started)
    return {name: [span * 1000 for span in spans[3:]] for name, spans in times.items()}


def main(directory: str, component: str, phase: str, *variants: str) -> None:
    """One phase of `component`'s programs in directory/steps/, printing its figures as JSON.
    compile VARIANT: take the variant's program from the store, or compile it (and add it to the store);
    {"skipped": why} when there is neither a stored program nor a compiler.
    time VARIANT...: load each variant's program, and the eager model (prepacked, as an engine without a program loads
    it), and time them in alternating rounds (time_steps)."""
    folder = Path(directory) / component
    pipeline = engine_pipeline(Path(directory))

    # the target's program returns what the proposer captures of it (EAGLE-3's layers), as the engine asks
    capture = captured_layers(pipeline, Path(directory)) if component == "target" else ()

    if phase == "compile":
        (variant,) = variants
        model, path = load_component(folder, "cpu", prepack=False), program_path(Path(directory), component, variant)
        key = program_store.program_key(model, pipeline.limits.max_batch_size, machine(), variant, capture)
        compile_seconds, from_store = 0.0, program_store.fetch(key, path)
        if not from_store:
            compiler = os.environ.get("CXX", "g++")
            if shutil.which(compiler) is None:  # inductor compiles the program's C++ with it
                print(json.dumps({"skipped": f"no C++ compiler ({compiler}) to compile step programs, and no "
                                             f"stored program for this model"}))
                return
            compile_seconds = export_step_program(model, path, pipeline.limits.max_batch_size, variant, capture)
            program_store.keep(key, path)
        print(json.dumps({"compile_seconds": round(compile_seconds, 1), "from_store": from_store}))
        return
    threads = apply_once()  # this process times the steps: with the threads an engine here would run
    models, loaded = {}, {}
    for variant in variants:
        models[variant], path = load_component(folder, "cpu", prepack=False), program_path(Path(directory),
                                                                                           component, variant)
        loaded[variant] = {"load_seconds": round(use_program(models[variant], path, capture), 2),
                           "package_bytes": path.stat().st_size}
    models[EAGER] = load_component(folder, "cpu")
    with contention.Watch() as watch:
        rounds = time_steps(models, capture=capture)
    conditions = contention.judge(watch.wall_seconds, watch.cpu_seconds, torch.get_num_threads(), rounds)
    milliseconds = {name: statistics.median(spans) for name, spans in rounds.items()}
    print(json.dumps({"variants": {variant: loaded[variant] | {"compiled_ms": round(milliseconds[variant], 2)}
                                   for variant in variants}, "eager_ms": round(milliseconds[EAGER], 2),
                      "cpu_threads": threads.as_record(), "conditions": conditions.as_record()}))


if __name__ == "__main__":
    main(*sys.argv[1:])
