"""A store of derived artefacts kept across engines: a GGUF's conversion (build/gguf_store.py), compiled step
programs (tune/program_store.py). Each entry is named by a key over everything it was derived from, so an entry
found is one that can be used as it is; it is written under a staging name and renamed into place, so a build
running beside this one reads an entry whole or not at all. A store that cannot be written is skipped: the work is
done again next time, never failed.
"""

from __future__ import annotations

import hashlib
import json
import shutil
import sys
import uuid
from collections.abc import Callable
from pathlib import Path


def content_key(described: object) -> str:
    """A short hash of `described` (plain data: what an entry depends on), for its name."""
    return hashlib.sha256(json.dumps(described, sort_keys=True, default=str).encode()).hexdigest()[:32]


class ArtefactStore:
    """The entries (files or folders) under `folder`; None: no store (nothing is found, nothing kept)."""

    def __init__(self, folder: Path | None) -> None:
        self.folder = None if folder is None else Path(folder)

    def find(self, name: str, holds: str | None = None) -> Path | None:
        """The entry `name` (a folder: only where it holds the file `holds`), or None."""
        if self.folder is None:
            return None
        entry = self.folder / name
        present = (entry / holds).is_file() if holds else entry.exists()
        return entry if present else None

    def add(self, name: str, write: Callable[[Path], None]) -> Path | None:
        """Create the entry `name` by `write(staging)` (a file or a folder at `staging`, which must not exist
        before), renamed into place; the entry, or None where the store cannot be written (said once on stderr).
        An entry another process added first is kept, and this one dropped. An exception of `write` propagates,
        its partial output removed."""
        if self.folder is None:
            return None
        entry = self.folder / name
        staging = self.folder / f".{name}.partial-{uuid.uuid4().hex[:8]}"
        try:
            self.folder.mkdir(parents=True, exist_ok=True)
            try:
                write(staging)
            except BaseException:
                remove(staging)
                raise
            try:
                staging.rename(entry) if staging.is_dir() else staging.replace(entry)
            except OSError:  # a folder another process added first
                remove(staging)
        except OSError as error:
            print(f"note: {name} is not kept in {self.folder} ({error})", file=sys.stderr)
            return None
        return entry


def remove(path: Path) -> None:
    if path.is_dir():
        shutil.rmtree(path, ignore_errors=True)
    else:
        path.unlink(missing_ok=True)
