"""Where things live: the engines root, an engine directory and the files in it, the default model repository.

An engine directory `engines/<pipeline name>/` holds one folder per component (`target/`, `draft/`), the
validated pipeline it was built from (`pipeline.json`, which every later stage re-parses) and the build manifest,
written last, whose presence marks the engine complete.
"""

from __future__ import annotations

import json
import os
import shutil
from contextlib import contextmanager
from pathlib import Path

from specdeploy.errors import SpecdeployError
from specdeploy.pipeline import PipelineSpec, load_pipeline

ENGINES_DIR = Path("engines")  # the default root of engines/<name>/ ($SPECDEPLOY_ENGINES overrides it in the CLI)
MODEL_REPOSITORIES_DIR = Path("model_repository")  # the default root of `specdeploy package` outputs
PIPELINE_FILE = "pipeline.json"
MANIFEST_FILE = "build_manifest.json"


def engine_path(engines_root: Path, pipeline: PipelineSpec) -> Path:
    """engines_root/<name>, refused unless it is a directory directly inside the root (not a link elsewhere): a
    build replaces and removes this path, and must never reach anything outside the engine it builds."""
    root = Path(engines_root)
    path = root / pipeline.name
    if path.resolve().parent != root.resolve():
        raise SpecdeployError(f"{path}: an engine must be a directory directly inside {root}, not a link elsewhere")
    return path


def check_engine(directory: Path) -> Path:
    """`directory` if it holds a complete engine; otherwise an error saying how to get one."""
    directory = Path(directory)
    if not (directory / MANIFEST_FILE).is_file():
        raise SpecdeployError(f"{directory}: not a complete engine (no {MANIFEST_FILE}); run specdeploy build")
    return directory


def engine_pipeline(directory: Path) -> PipelineSpec:
    """The validated pipeline an engine was built from."""
    return load_pipeline(check_engine(directory) / PIPELINE_FILE)


def write_json(path: Path, data: object) -> None:
    """Write JSON so that a reader never sees a half-written file (a temporary file renamed into place)."""
    partial = path.with_name(f".{path.name}.partial-{os.getpid()}")
    partial.write_text(json.dumps(data, indent=2))
    partial.replace(path)


def save_engine_pipeline(directory: Path, pipeline: PipelineSpec) -> None:
    """Save the pipeline with absolute checkpoint paths, so the copy means the same wherever it is read."""
    write_json(Path(directory) / PIPELINE_FILE, pipeline.resolved().to_dict())


@contextmanager
def staging_dir(final: Path):
    """A hidden directory beside `final` that replaces it on success and disappears on failure."""
    staging = final.parent / f".{final.name}.partial-{os.getpid()}"
    shutil.rmtree(staging, ignore_errors=True)
    staging.mkdir(parents=True)
    try:
        yield staging
    except BaseException:
        shutil.rmtree(staging, ignore_errors=True)
        raise
    old = final.parent / f".{final.name}.old-{os.getpid()}"
    if final.exists():
        final.rename(old)
    staging.rename(final)
    shutil.rmtree(old, ignore_errors=True)
