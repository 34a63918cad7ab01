"""`specdeploy build`'s last step for backend.torch.compile: compile the engine's steps into its inductor cache
(models/compiled.py) by loading it as a server and as an in-process run do, and record how long that took.

Each load runs in a fresh process, as a server's does: dynamo keeps per-process state about the code it has
compiled (sizes it saw change), so a load inside a process that compiled something else would build graphs a
fresh load never asks for, and the cache would miss. `python -m specdeploy.runtime.compile_engine DIR ROWS` is
that process."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

from rich.progress import Progress, SpinnerColumn, TextColumn, TimeElapsedColumn

from specdeploy.errors import BuildError
from specdeploy.models.compiled import CACHE_DIR, RECORD, keep_cache, record_build
from specdeploy.spec.pipeline import PipelineSpec


def is_compiled(directory: Path) -> bool:
    """Whether a build compiled this engine's steps (its record is written last)."""
    return (Path(directory) / CACHE_DIR / RECORD).is_file()


def compile_engine(pipeline: PipelineSpec, directory: Path, quiet: bool = False) -> dict:
    """Fill `directory`'s inductor cache from scratch; returns the record (compile_seconds, torch, cache_bytes)."""
    (Path(directory) / CACHE_DIR / RECORD).unlink(missing_ok=True)
    columns = (SpinnerColumn(), TextColumn("{task.description}"), TimeElapsedColumn())
    with Progress(*columns, disable=quiet, transient=False) as progress:
        task = progress.add_task(f"[{pipeline.name}] compiling decode and verify steps (torch.compile)", total=None)
        seconds = 0.0
        # as a server loads it (every cache row) and as generate and bench do (one row): dynamo's graphs for one row
        # differ between a cache of one row and a view into a larger one, so each is compiled once here
        for rows in sorted({pipeline.limits.max_batch_size, 1}):
            seconds += compile_in_fresh_process(Path(directory), rows)
        record = record_build(directory, seconds)
        progress.update(task, description=f"[{pipeline.name}] steps compiled in {record['compile_seconds']:.0f} s "
                                          f"({record['cache_bytes'] / 2**20:.1f} MiB of cache in {CACHE_DIR}/)")
    return record


def compile_in_fresh_process(directory: Path, rows: int) -> float:
    """Load the engine with `rows` cache rows in a new process that adds what it compiles to the engine's cache;
    returns the seconds its compiling took."""
    done = subprocess.run([sys.executable, "-m", "specdeploy.runtime.compile_engine", str(directory), str(rows)],
                          capture_output=True, text=True)
    if done.returncode != 0:
        raise BuildError(f"{directory}: compiling the engine's steps failed:\n{done.stderr[-3000:]}")
    return json.loads(done.stdout.splitlines()[-1])["compile_seconds"]


def main(directory: str, rows: str) -> None:
    from specdeploy.runtime.engine import Engine

    engine = Engine(directory, device="cpu", batch_size=int(rows))
    keep_cache(Path(directory))
    print(json.dumps({"compile_seconds": engine.compile_seconds}))


if __name__ == "__main__":
    main(*sys.argv[1:])
