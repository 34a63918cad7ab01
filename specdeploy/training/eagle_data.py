"""An EAGLE-3 head's training data kept on disk in shards: the target's features over millions of tokens do not fit
in memory (3 captured layers and the final state, about 4.6 KB a token for SmolLM2 in bf16), and computing them
again every epoch would cost a target forward per token per epoch.

`write_shards` runs the target once over each prompt + answer and writes shard after shard (`shard-<n>.safetensors`,
SHARD_SEQUENCES sequences each: tokens, features, final states, each sequence's offsets and first answer index);
a shard already written is kept, so an interrupted run resumes. `ShardedSamples` reads them back as
training/eagle.py's Samples, memory-mapped, one at a time.
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path

import torch
from safetensors import safe_open
from safetensors.torch import save_file

from specdeploy.errors import SpecdeployError

SHARD_SEQUENCES = 256
INDEX_FILE = "shards.json"


@dataclass
class Sample:
    """One prompt + answer: tokens [T]; features [T, 3H] and final [T, H] (bf16), the target's at each position;
    first: the index of the prompt's last token (losses count only predictions of answer tokens)."""

    tokens: torch.Tensor
    features: torch.Tensor
    final: torch.Tensor
    first: int


def sequences_key(sequences: list[tuple[list[int], int]], feature_layers: tuple[int, ...]) -> str:
    """What the shards were written from: a hash of every sequence and the captured layers."""
    digest = hashlib.sha256(json.dumps(list(feature_layers)).encode())
    for tokens, first in sequences:
        digest.update(json.dumps([first, tokens]).encode())
    return digest.hexdigest()[:24]


def write_shards(target, sequences: list[tuple[list[int], int]], feature_layers: tuple[int, ...], folder: Path,
                 on_progress: Callable[[int], None] | None = None) -> Path:
    """The target's features and final states over `sequences` ((prompt + answer ids, index of the prompt's last
    token)) in shards under `folder`; shards written before for the same sequences are kept. on_progress(tokens)
    after each sequence. Returns `folder`."""
    folder.mkdir(parents=True, exist_ok=True)
    key = sequences_key(sequences, feature_layers)
    index_path = folder / INDEX_FILE
    if index_path.is_file() and json.loads(index_path.read_text()).get("key") != key:
        raise SpecdeployError(f"{folder}: its shards were written from other sequences or layers; remove the folder "
                              f"or choose another --work-dir")
    index_path.write_text(json.dumps({"key": key, "sequences": len(sequences), "shard_sequences": SHARD_SEQUENCES,
                                      "feature_layers": list(feature_layers)}))
    for number, start in enumerate(range(0, len(sequences), SHARD_SEQUENCES)):
        path = folder / f"shard-{number:05d}.safetensors"
        chunk = sequences[start:start + SHARD_SEQUENCES]
        if path.is_file():
            if on_progress is not None:
                on_progress(sum(len(tokens) for tokens, _ in chunk))
            continue
        tokens, features, final, offsets, firsts = [], [], [], [0], []
        with torch.inference_mode():
            for ids, first in chunk:
                forward = target(torch.tensor([ids]), torch.arange(len(ids))[None], target.new_cache(1, len(ids) + 1),
                                 capture=tuple(feature_layers))
                tokens.append(torch.tensor(ids, dtype=torch.int32))
                features.append(forward.captured[0].to(torch.bfloat16))
                final.append(forward.hidden[0].to(torch.bfloat16))
                offsets.append(offsets[-1] + len(ids))
                firsts.append(first)
                if on_progress is not None:
                    on_progress(len(ids))
        partial = path.with_suffix(".partial")
        save_file({"tokens": torch.cat(tokens), "features": torch.cat(features).contiguous(),
                   "final": torch.cat(final).contiguous(), "offsets": torch.tensor(offsets),
                   "firsts": torch.tensor(firsts)}, str(partial))
        partial.replace(path)  # whole or absent
    return folder


class ShardedSamples:
    """The samples of a folder of shards, as a sequence: len(), [i] (a Sample, its tensors read from the mapped
    file), tokens(i) (the ids alone); limit: the first `limit` samples alone (None: all)."""

    def __init__(self, folder: Path, limit: int | None = None) -> None:
        self.paths = sorted(Path(folder).glob("shard-*.safetensors"))
        self.files = [safe_open(str(path), framework="pt") for path in self.paths]
        self.places: list[tuple[int, int]] = []  # sample → (shard, index in it)
        self.offsets, self.firsts = [], []
        for number, handle in enumerate(self.files):
            offsets, firsts = handle.get_tensor("offsets").tolist(), handle.get_tensor("firsts").tolist()
            self.offsets.append(offsets)
            self.firsts.append(firsts)
            self.places += [(number, index) for index in range(len(firsts))]
        self.places = self.places[:limit]

    def __len__(self) -> int:
        return len(self.places)

    def _span(self, i: int) -> tuple[int, int, int]:
        shard, index = self.places[i]
        return shard, self.offsets[shard][index], self.offsets[shard][index + 1]

    def tokens(self, i: int) -> torch.Tensor:
        shard, start, end = self._span(i)
        return self.files[shard].get_slice("tokens")[start:end].long()

    def __getitem__(self, i: int) -> Sample:
        shard, start, end = self._span(i)
        handle = self.files[shard]
        return Sample(handle.get_slice("tokens")[start:end].long(), handle.get_slice("features")[start:end],
                      handle.get_slice("final")[start:end], self.firsts[shard][self.places[i][1]])

    def __iter__(self) -> Iterator[Sample]:
        return (self[i] for i in range(len(self)))

    def token_count(self) -> int:
        return sum(self.lengths())

    def lengths(self) -> list[int]:
        """Each sample's token count, read from the index alone."""
        return [self.offsets[shard][index + 1] - self.offsets[shard][index] for shard, index in self.places]
