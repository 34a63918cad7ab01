"""The build manifest: what an engine was built from, so an unchanged build is skipped and a finished one is known.

The fingerprint holds the spec sections that shape the engine, every source file (path, size, modification time,
SHA-256) and the versions that matter. Hashing the embedded 270 MB checkpoint takes about a second, and build,
generate and bench all ask whether the engine is up to date, so a file whose size and modification time match the
manifest's record keeps the recorded hash; only a changed file is hashed again.
"""

from __future__ import annotations

import hashlib
import json
from pathlib import Path

from specdeploy.layout import MANIFEST_FILE, write_json
from specdeploy.pipeline import PipelineSpec

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


def source_records(files: list[Path], recorded: list[dict]) -> list[dict]:
    """One record per file; the SHA-256 is reused from `recorded` when path, size and mtime are unchanged."""
    known = {(r.get("path"), r.get("size"), r.get("mtime_ns")): r["sha256"]
             for r in recorded if isinstance(r, dict) and "sha256" in r}
    records = []
    for file in files:
        stat = file.stat()
        key = (str(file), stat.st_size, stat.st_mtime_ns)
        records.append({"path": key[0], "size": key[1], "mtime_ns": key[2],
                        "sha256": known.get(key) or file_sha256(file)})
    return records


def fingerprint(pipeline: PipelineSpec, files: list[Path], versions: dict, engine_dir: Path) -> dict:
    """Everything a build depends on; `engine_dir`'s current manifest, if any, saves rehashing unchanged files."""
    spec = pipeline.resolved().to_dict()
    recorded = (read_manifest(engine_dir) or {}).get("sources", [])
    records = source_records(files, recorded if isinstance(recorded, list) else [])
    combined = hashlib.sha256()
    for record in records:
        combined.update(Path(record["path"]).name.encode())
        combined.update(record["sha256"].encode())
    return {"spec": {key: spec[key] for key in ENGINE_SECTIONS}, "source_checksum": combined.hexdigest(),
            "sources": records, "versions": versions}


def up_to_date(engine_dir: Path, inputs: dict) -> bool:
    """Whether the engine at `engine_dir` was built from exactly these inputs (a fingerprint())."""
    recorded = read_manifest(engine_dir)
    return recorded is not None and all(recorded.get(k) == inputs[k] for k in FINGERPRINT_KEYS)


def record_sources(engine_dir: Path, inputs: dict) -> None:
    """For an up-to-date engine: save its sources' current sizes and times (a touched but unchanged file), so the
    next check does not hash them again."""
    recorded = read_manifest(engine_dir)
    if recorded.get("sources") != inputs["sources"]:
        write_json(Path(engine_dir) / MANIFEST_FILE, {**recorded, "sources": inputs["sources"]})
