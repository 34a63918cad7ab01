"""GGUF checkpoints converted once, and loaded from the conversion afterwards.

transformers reads a GGUF file's whole metadata (a vocabulary is tens of thousands of fields) once for its
configuration, again for its tokenizer and again for its weights, and maps every tensor name through a table it
rebuilds per tensor: about 20 s of a 22 s SmolLM2 build on this CPU, before any weight is written. The store keeps
what that conversion yields, keyed by the file's bytes and the transformers and gguf versions that converted it:
the configuration, the tokenizer files and the fp32 weights as safetensors (what `load_checkpoint` holds, bit for
bit), so a rebuild, another pipeline of the same model, or a test loads those in a second or two.

The store (spec/artefact_store.py) is `$SPECDEPLOY_CHECKPOINTS`, else `.checkpoints` beside the engines of the build
that asked (on the data volume in a pod), else none. A conversion is written to a staging folder and renamed into
place, so concurrent builds never read half of one; where the store cannot be written, the GGUF is loaded as before.
"""

from __future__ import annotations

import functools
import gc
import hashlib
import importlib.metadata
import os
import shutil
from pathlib import Path

from specdeploy.spec.artefact_store import ArtefactStore

STORE_VARIABLE = "SPECDEPLOY_CHECKPOINTS"
STORE_FOLDER = ".checkpoints"  # beside the engines of a build that names its engines root
CONFIG_SUFFIX = ".config"  # a folder with the configuration alone (planning, sizing), before any conversion
CHUNK = 1 << 24
WEIGHTS = "model.safetensors"
CONVERSION = 1  # what `convert` saves: a change to it takes a new number, so no older entry is read


def store_dir(engines_root: Path | None) -> Path | None:
    if os.environ.get(STORE_VARIABLE):
        return Path(os.environ[STORE_VARIABLE])
    return None if engines_root is None else Path(engines_root) / STORE_FOLDER


@functools.lru_cache(maxsize=16)
def _content_key(path: str, size: int, mtime_ns: int) -> str:
    digest = hashlib.sha256(f"conversion {CONVERSION}\n".encode())
    for package in ("transformers", "gguf"):  # what the conversion depends on beside the file
        digest.update(f"{package}=={importlib.metadata.version(package)}\n".encode())
    with open(path, "rb") as handle:
        while chunk := handle.read(CHUNK):
            digest.update(chunk)
    return digest.hexdigest()[:32]


def entry_name(gguf: Path) -> str:
    """`<file stem>-<key>`; the key is hashed once per file version in a process."""
    stat = gguf.stat()
    return f"{gguf.stem}-{_content_key(str(gguf.resolve()), stat.st_size, stat.st_mtime_ns)}"


def converted(gguf: Path, engines_root: Path | None) -> Path | None:
    """The folder holding `gguf` converted (config.json, tokenizer files, model.safetensors in fp32), converting it
    on first use; None where there is no store or it cannot be written (the caller loads the GGUF itself)."""
    store = ArtefactStore(store_dir(engines_root))
    if store.folder is None:
        return None
    name = entry_name(gguf)  # hashes the file: only where there is a store
    found = store.find(name, holds="config.json")
    if found is not None:
        return found

    def write(staging: Path) -> None:
        convert(gguf, staging)
        gc.collect()  # the converted model, before its saved copy is loaded: one fp32 copy held at a time

    return store.add(name, write)


def convert(gguf: Path, destination: Path) -> None:
    """transformers' own conversion of `gguf`, saved as it loads it: the configuration (less the record that it came
    from a GGUF, which would make the folder read as a quantized one), the fp32 state dict (a tied head left to its
    embedding) and the tokenizer. transformers will not save a model it loaded from a GGUF, so the parts are saved
    here."""
    import torch
    from safetensors.torch import save_file
    from transformers import AutoModelForCausalLM, AutoTokenizer

    try:
        tokenizer = AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name)
        model = AutoModelForCausalLM.from_pretrained(gguf.parent, gguf_file=gguf.name, dtype=torch.float32)
        config = model.config
        del config.quantization_config
        state = {name: tensor.detach().contiguous() for name, tensor in model.state_dict().items()}
        if config.tie_word_embeddings:
            state.pop("lm_head.weight", None)
        destination.mkdir(parents=True)
        config.save_pretrained(destination)
        save_file(state, destination / WEIGHTS)
        tokenizer.save_pretrained(destination)
    except BaseException:
        shutil.rmtree(destination, ignore_errors=True)
        raise


def load(folder: Path) -> tuple[object, dict, object]:
    """(transformers configuration, fp32 state dict by transformers' names, tokenizer) of a conversion."""
    from safetensors.torch import load_file
    from transformers import AutoConfig, AutoTokenizer

    return AutoConfig.from_pretrained(folder), load_file(folder / WEIGHTS), AutoTokenizer.from_pretrained(folder)


def hf_config(gguf: Path, engines_root: Path | None = None):
    """`gguf`'s transformers configuration without converting its weights: from the conversion, or from a
    configuration saved the first time the GGUF's metadata was read (every later plan reads that); read from the
    GGUF where there is no store."""
    from transformers import AutoConfig

    store = ArtefactStore(store_dir(engines_root))
    if store.folder is None:
        return AutoConfig.from_pretrained(gguf.parent, gguf_file=gguf.name)
    name = entry_name(gguf)
    for entry in (name, f"{name}{CONFIG_SUFFIX}"):
        found = store.find(entry, holds="config.json")
        if found is not None:
            return AutoConfig.from_pretrained(found)
    config = AutoConfig.from_pretrained(gguf.parent, gguf_file=gguf.name)
    store.add(f"{name}{CONFIG_SUFFIX}", config.save_pretrained)
    return config
