"""A Hugging Face directory's weights read a tensor at a time, so a build holds the tensors it is working on, not
the model: a 70B checkpoint is 131 GiB in bf16 and twice that once loaded in fp32.

The files are the ones model.safetensors.index.json names (a sharded checkpoint) or every *.safetensors file beside
config.json. Each tensor is read through safe_open, which maps the file: the tensor is backed by the page cache
until it is converted or copied, and those pages are reclaimable (the kernel drops them before it kills for memory).
"""

from __future__ import annotations

import json
from collections.abc import Iterable, Iterator, Mapping
from pathlib import Path

import torch
from safetensors import safe_open

from specdeploy.errors import BuildError
from specdeploy.models.registry import projection_key

INDEX_FILE = "model.safetensors.index.json"


class HFTensors(Mapping[str, torch.Tensor]):
    """name → tensor of the checkpoint at `directory`, each read when asked for (in the checkpoint's dtype)."""

    def __init__(self, directory: Path) -> None:
        self.directory = Path(directory)
        index = self.directory / INDEX_FILE
        if index.is_file():
            weight_map = json.loads(index.read_text())["weight_map"]
            self.files = {name: self.directory / file for name, file in weight_map.items()}
        else:
            self.files = {}
            for path in sorted(self.directory.glob("*.safetensors")):
                with safe_open(str(path), framework="pt") as weights:
                    self.files.update(dict.fromkeys(weights.keys(), path))
        if not self.files:
            raise BuildError(f"checkpoint {self.directory}: no safetensors weights")

    def read(self, names: Iterable[str]) -> dict[str, torch.Tensor]:
        """Several tensors, each file opened once."""
        by_file: dict[Path, list[str]] = {}
        for name in names:
            if name not in self.files:
                raise KeyError(name)
            by_file.setdefault(self.files[name], []).append(name)
        tensors = {}
        for path, wanted in by_file.items():
            with safe_open(str(path), framework="pt") as weights:
                tensors.update({name: weights.get_tensor(name) for name in wanted})
        return tensors

    def __getitem__(self, name: str) -> torch.Tensor:
        return self.read([name])[name]

    def __iter__(self) -> Iterator[str]:
        return iter(self.files)

    def __len__(self) -> int:
        return len(self.files)


def read_projection(directory: Path) -> torch.Tensor:
    """The vocabulary projection [V, H] of the checkpoint at `directory` (lm_head, or the embedding table when they
    are tied), read alone."""
    tensors = HFTensors(directory)
    return tensors[projection_key(tensors.files)]
