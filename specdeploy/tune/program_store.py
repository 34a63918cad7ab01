"""Compiled step programs kept across engines: a program depends on a model's shapes, not on its weights' values
(it reads them from the model: models/step_program.py), so one compiled for SmolLM2 in int4 serves every engine
of that model in that form on this torch and CPU. A build looks here before compiling and adds what it compiles,
so a rebuild, a second pipeline of the same model, or an image whose programs were compiled when it was built
(build/Dockerfile.cpu: the image holds no compiler) loads a program instead of compiling one.

The store (spec/artefact_store.py) is the folder `$SPECDEPLOY_PROGRAMS` (default `~/.cache/specdeploy/programs`),
one `<key>.pt2` per program; the key hashes everything the compiled code depends on: the model's config, every
tensor's name, shape and dtype (its quantized form), the layers it captures, the most rows it takes, the torch
version, the CPU, how its matmuls are compiled (the variant), and the source of the model code that is traced.
"""

from __future__ import annotations

import dataclasses
import hashlib
import os
import shutil
from pathlib import Path

import torch

import specdeploy.models
from specdeploy.models.llama import LlamaModel
from specdeploy.spec.artefact_store import ArtefactStore, content_key

STORE_VARIABLE = "SPECDEPLOY_PROGRAMS"


def store() -> ArtefactStore:
    return ArtefactStore(Path(os.environ.get(STORE_VARIABLE) or Path.home() / ".cache" / "specdeploy" / "programs"))


def traced_code_digest() -> str:
    """The source of the model code a program traces (everything under specdeploy/models)."""
    digest = hashlib.sha256()
    for path in sorted(Path(specdeploy.models.__file__).parent.glob("*.py")):
        digest.update(path.name.encode() + path.read_bytes())
    return digest.hexdigest()


def program_key(model: LlamaModel, max_rows: int, machine: str, variant: str, capture: tuple[int, ...] = ()) -> str:
    """The store's name for `model`'s program compiled as `variant` (step_program.VARIANTS) on `machine`, capturing
    the states entering the layers of `capture`."""
    layout = [(name, list(tensor.shape), str(tensor.dtype))
              for name, tensor in [*model.named_parameters(), *model.named_buffers()]]
    return content_key({"class": type(model).__name__, "config": dataclasses.asdict(model.config), "layout": layout,
                        "features": list(capture), "max_rows": max_rows, "torch": torch.__version__,
                        "machine": machine, "variant": variant, "code": traced_code_digest()})


def fetch(key: str, destination: Path) -> bool:
    """Copy the stored program `key` to `destination`; False when the store has none."""
    stored = store().find(f"{key}.pt2")
    if stored is None:
        return False
    shutil.copyfile(stored, destination)
    return True


def keep(key: str, program: Path) -> bool:
    """Add a compiled program to the store; False where the store cannot be written (a read-only image folder),
    which only means the next build compiles it again."""
    return store().add(f"{key}.pt2", lambda staging: shutil.copyfile(program, staging)) is not None
