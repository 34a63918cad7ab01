"""The build manifest: what an engine was built from and what it holds.

- Inputs: the spec sections that shape the engine, every source file (path, size, modification time, SHA-256) and
  the versions that matter. An unchanged build is skipped.
- Outputs: every file of the engine's components (size, modification time, SHA-256). `build` rebuilds an engine
  whose files no longer match, and loading refuses one, naming the file: truncated or overwritten weights are an
  error, not a server that fails to start or empty text.

Hashing the embedded 270 MB checkpoint is slow next to reading a file's size and time
(docs/benchmarks.md, "Figures behind the code"), and build, generate, bench and every server start ask these
questions, so a file whose size and modification time match its record keeps the recorded hash; only a changed file
is hashed again.
"""

from __future__ import annotations

import hashlib
import json
import time
from collections.abc import Callable
from pathlib import Path

from specdeploy.errors import SpecdeployError
from specdeploy.spec.engine_paths import MANIFEST_FILE, PIPELINE_FILE, build_lock, save_engine_pipeline, write_json
from specdeploy.spec.pipeline import PipelineSpec, load_pipeline

ENGINE_SECTIONS = ("name", "target", "speculation", "limits", "backend")  # a change in these rebuilds the engine
FINGERPRINT_KEYS = ("spec", "source_checksum", "versions")


def read_manifest(engine_dir: Path) -> dict | None:
    path = Path(engine_dir) / MANIFEST_FILE
    return json.loads(path.read_text()) if path.is_file() else None


def file_sha256(path: Path) -> str:
    digest = hashlib.sha256()
    with path.open("rb") as handle:
        for block in iter(lambda: handle.read(1 << 22), b""):
            digest.update(block)
    return digest.hexdigest()


def file_record(path: Path, name: str, known: dict[tuple, str]) -> dict:
    """{"path": name, "size", "mtime_ns", "sha256"}; the hash is taken from `known` when (name, size, mtime) match."""
    stat = path.stat()
    key = (name, stat.st_size, stat.st_mtime_ns)
    return {"path": name, "size": key[1], "mtime_ns": key[2], "sha256": known.get(key) or file_sha256(path)}


def known_hashes(records: object) -> dict[tuple, str]:
    return {(r.get("path"), r.get("size"), r.get("mtime_ns")): r["sha256"]
            for r in (records if isinstance(records, list) else []) if isinstance(r, dict) and "sha256" in r}


def source_records(files: list[Path], recorded: list[dict]) -> list[dict]:
    """One record per source file (by absolute path)."""
    known = known_hashes(recorded)
    return [file_record(file, str(file), known) for file in files]


def fingerprint(pipeline: PipelineSpec, files: list[Path], versions: dict, engine_dir: Path) -> dict:
    """Everything a build depends on; `engine_dir`'s current manifest, if any, saves rehashing unchanged files."""
    spec = pipeline.resolved().to_dict()
    records = source_records(files, (read_manifest(engine_dir) or {}).get("sources", []))
    combined = hashlib.sha256()
    for record in records:
        combined.update(Path(record["path"]).name.encode())
        combined.update(record["sha256"].encode())
    engine = {key: spec[key] for key in ENGINE_SECTIONS}
    # where a torch engine runs is not what it is: the same files serve on a CPU and a GPU
    engine["backend"] = {key: value for key, value in spec["backend"].items() if key != "torch"}
    return {"spec": engine, "source_checksum": combined.hexdigest(),
            "sources": records, "versions": versions}


def output_records(engine_dir: Path) -> list[dict]:
    """Records of the engine's component files (paths relative to the engine), as a build writes them. The
    pipeline.json beside them is not one: serving defaults may change it without a rebuild, and it is validated
    whenever it is read."""
    engine_dir = Path(engine_dir)
    files = sorted(p for p in engine_dir.rglob("*") if p.is_file() and p.parent != engine_dir)
    return [file_record(file, file.relative_to(engine_dir).as_posix(), {}) for file in files]


def output_mismatch(engine_dir: Path, components: list[str] | None = None) -> str | None:
    """None when the engine's component files (or only those of `components`) match the manifest; otherwise what
    does not, naming the file."""
    engine_dir = Path(engine_dir)
    recorded = read_manifest(engine_dir)
    if recorded is None or not isinstance(recorded.get("outputs"), list):
        return f"{engine_dir / MANIFEST_FILE}: missing or without a record of the engine's files"
    known = known_hashes(recorded["outputs"])
    for record in recorded["outputs"]:
        name = record["path"]
        if components is not None and name.split("/")[0] not in components:
            continue
        path = engine_dir / name
        if not path.is_file():
            return f"{path}: missing"
        if path.stat().st_size != record["size"]:
            return f"{path}: {path.stat().st_size} bytes, the build wrote {record['size']}"
        if file_record(path, name, known)["sha256"] != record["sha256"]:
            return f"{path}: its contents changed since the build (SHA-256 differs)"
    return None


def check_outputs(engine_dir: Path, components: list[str]) -> None:
    """SpecdeployError naming the first file of `components` that does not match what the build wrote."""
    problem = output_mismatch(engine_dir, components)
    if problem is not None:
        raise SpecdeployError(f"engine does not match its build manifest: {problem}; rebuild it "
                              f"(specdeploy build --force)")


def up_to_date(engine_dir: Path, inputs: dict) -> bool:
    """Whether the engine at `engine_dir` was built from exactly these inputs and still holds what it wrote."""
    recorded = read_manifest(engine_dir)
    return (recorded is not None and all(recorded.get(k) == inputs[k] for k in FINGERPRINT_KEYS)
            and (Path(engine_dir) / PIPELINE_FILE).is_file() and output_mismatch(engine_dir) is None)


def record_sources(engine_dir: Path, inputs: dict) -> None:
    """For an up-to-date engine: save its sources' current sizes and times (a touched but unchanged file), so the
    next check does not hash them again."""
    recorded = read_manifest(engine_dir)
    if recorded.get("sources") != inputs["sources"]:
        write_json(Path(engine_dir) / MANIFEST_FILE, {**recorded, "sources": inputs["sources"]})


def reuse(engine_dir: Path, inputs: dict, pipeline: PipelineSpec) -> bool:
    """Whether the engine at `engine_dir` is up to date with `inputs`. If it is, its sources' sizes and times are
    recorded and its pipeline.json rewritten when only sections that do not shape it (serving, sampling) changed."""
    if not up_to_date(engine_dir, inputs):
        return False
    record_sources(engine_dir, inputs)
    if load_pipeline(Path(engine_dir) / PIPELINE_FILE) != pipeline.resolved():
        save_engine_pipeline(engine_dir, pipeline)
    return True


def write_manifest(staging: Path, inputs: dict, started: float) -> None:
    """The build manifest, written last: the inputs' fingerprint, when the build ended and the seconds it took
    (started: its time.perf_counter() at the start), the components and every file."""
    staging = Path(staging)
    manifest = dict(inputs, built_at=time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
                    build_seconds=round(time.perf_counter() - started, 3),
                    components=sorted(p.name for p in staging.iterdir() if p.is_dir()),
                    outputs=output_records(staging))
    (staging / MANIFEST_FILE).write_text(json.dumps(manifest, indent=2))


def build_unless_current(final: Path, inputs: dict, pipeline: PipelineSpec, force: bool,
                         write: Callable[[], None]) -> bool:
    """Run `write` (which builds the engine into `final`) under final's build lock, unless the engine there is
    up to date with `inputs` and not `force`d. Returns whether it built. Checked under the lock: a build that held
    it before us may have just written it."""
    with build_lock(final):
        if not force and reuse(final, inputs, pipeline):
            return False
        write()
    return True
