"""Where things live: the engines root, an engine directory and the files in it, the default model repository.

An engine directory `engines/<pipeline name>/` holds one folder per component (`target/`, `draft/`), the
validated pipeline it was built from (`pipeline.json`, which every later stage re-parses) and the build manifest,
written last, whose presence marks the engine complete. `bench --measure-gamma-cap` may add
`measured_policy.json`: the gamma cap it measured for this engine on this machine (a rebuild removes it).
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
MEASURED_POLICY_FILE = "measured_policy.json"


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
    """The validated pipeline an engine was built from, a gamma cap of "measured" replaced by the engine's
    measurement (None while it has none)."""
    pipeline = load_pipeline(check_engine(directory) / PIPELINE_FILE)
    if pipeline.serving.policy.gamma_cap != "measured":
        return pipeline
    return pipeline.with_gamma_cap(measured_gamma_cap(directory))


def measured_gamma_cap(directory: Path) -> int | None:
    """The gamma cap `bench --measure-gamma-cap` wrote into the engine at `directory`, None if it has not."""
    path = Path(directory) / MEASURED_POLICY_FILE
    if not path.is_file():
        return None
    try:
        cap = json.loads(path.read_text())["gamma_cap"]
    except (ValueError, KeyError, TypeError):
        raise SpecdeployError(f"{path}: not a measured policy (no gamma_cap); rerun specdeploy bench "
                              f"--measure-gamma-cap or delete it") from None
    if type(cap) is not int or cap < 1:
        raise SpecdeployError(f"{path}: gamma_cap must be an integer ≥ 1, got {cap!r}")
    return cap


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
