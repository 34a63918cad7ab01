"""What a model repository was packaged from, so that `specdeploy package` with unchanged inputs does nothing (the
Kubernetes build Job reruns it on every rollout).

The stamp names the engine's build manifest (rewritten by every build), its pipeline (a sampling or serving change
updates it without a rebuild), its measured policy, the Triton model code, the specdeploy version and the packaging
arguments. It is written into the repository after the repository is complete: a run interrupted before that
packages again.
"""

from __future__ import annotations

import hashlib
import json
from pathlib import Path

import specdeploy
from specdeploy.serve.model_files import MODEL_CODE
from specdeploy.spec.engine_paths import MANIFEST_FILE, MEASURED_POLICY_FILE, PIPELINE_FILE, write_json

STAMP_FILE = ".specdeploy-package.json"  # Triton reads only directories at a repository's top level


def digest(path: Path) -> str | None:
    return hashlib.sha256(path.read_bytes()).hexdigest() if path.is_file() else None


def package_stamp(pipeline_file: Path, engine_dir: Path, served_at: Path, trtllm_source: Path | None) -> dict:
    """The inputs of packaging `engine_dir` (built from `pipeline_file`), as the stamp records them. The pipeline
    file's own digest lets a deployment wait for the repository of the pipeline it was given (k8s_base.py)."""
    engine_dir = Path(engine_dir).resolve()
    files = {"pipeline_file": digest(Path(pipeline_file))}
    files.update({name: digest(engine_dir / name) for name in (MANIFEST_FILE, PIPELINE_FILE, MEASURED_POLICY_FILE)})
    files.update(model_code_files())
    return {"specdeploy": specdeploy.__version__, "engine": str(engine_dir), "served_at": str(served_at),
            "trtllm_source": str(Path(trtllm_source).resolve()) if trtllm_source else None, "files": files}


def model_code_files() -> dict[str, str | None]:
    """The Triton model code this specdeploy copies into a repository, by its stamp key, with its digests."""
    return {f"model_repo/{path.relative_to(MODEL_CODE)}": digest(path) for path in sorted(MODEL_CODE.rglob("*.py"))}


def stale_for_this_code(stamp: dict, pipeline_digest: str, code: dict[str, str | None]) -> str | None:
    """Why a repository stamped `stamp` is not what this specdeploy packages from the pipeline file whose digest is
    `pipeline_digest` (another pipeline, another specdeploy version, other Triton model code than `code`, which
    model_code_files gives), None when it is. A serving pod of a new image must not start on a repository, and its
    model.py, that an older image packaged."""
    if stamp.get("files", {}).get("pipeline_file") != pipeline_digest:
        return f"it was packaged from another pipeline file than {pipeline_digest[:12]}"
    if stamp.get("specdeploy") != specdeploy.__version__:
        return f"it was packaged by specdeploy {stamp.get('specdeploy')}, this image has {specdeploy.__version__}"
    changed = sorted(name for name, value in code.items() if stamp["files"].get(name) != value)
    if changed:
        return f"its Triton model code differs from this image's ({', '.join(changed[:3])})"
    return None


def is_current(repository: Path, stamp: dict) -> bool:
    """True when `repository` was packaged from exactly these inputs."""
    path = Path(repository) / STAMP_FILE
    try:
        return json.loads(path.read_text()) == stamp
    except (OSError, ValueError):
        return False


def write_stamp(repository: Path, stamp: dict) -> None:
    write_json(Path(repository) / STAMP_FILE, stamp)
