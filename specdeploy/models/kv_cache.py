"""Preallocated KV cache indexed by absolute position.

Entries are written at their slot (by default the token's position) and a row's `length` says how many leading
slots hold the committed prefix. Rewinding after a rejection is setting the length: rejected entries stay in place
and are overwritten by the next write at those slots, before anything attends to them.
"""

from __future__ import annotations

import torch

from specdeploy.models.device_transfer import from_host


class KVCache:
    """Keys and values for every layer: `keys[layer]`, `values[layer]` are [batch, kv_heads, max_length, head_dim].

    One tensor per layer, not one [layers, ...] tensor: a compiled step's writes into a layer's slice of a stacked
    tensor become a copy of every layer's entries at each layer (inductor functionalizes the mutation of a view),
    far slower than separate tensors written in place (scripts/measure_compiled_steps.py --cache-writes; figures:
    docs/benchmarks.md, "Compiled steps")."""

    def __init__(self, num_layers: int, batch_size: int, num_kv_heads: int, max_length: int, head_dim: int,
                 dtype: torch.dtype, device: torch.device | str = "cpu") -> None:
        shape = (batch_size, num_kv_heads, max_length, head_dim)
        self.keys = [torch.zeros(shape, dtype=dtype, device=device) for _ in range(num_layers)]
        self.values = [torch.zeros(shape, dtype=dtype, device=device) for _ in range(num_layers)]
        self.max_length = max_length
        self.lengths = [0] * batch_size  # committed prefix per row, host-side so no sync is needed to read it

    @property
    def batch_size(self) -> int:
        return len(self.lengths)

    @classmethod
    def wrapping(cls, keys: list[torch.Tensor], values: list[torch.Tensor]) -> KVCache:
        """A cache over given per-layer tensors, with no committed lengths: for a forward given its mask and slots
        (a compiled step program, models/step_program.py)."""
        cache = object.__new__(cls)
        cache.keys, cache.values = list(keys), list(values)
        cache.max_length = keys[0].shape[2]
        cache.lengths = []
        return cache

    def rewind(self, row: int, length: int) -> None:
        """Keep only the first `length` entries of `row` (the rest are overwritten later)."""
        if not 0 <= length <= self.max_length:
            raise ValueError(f"KV length {length} outside [0, {self.max_length}]")
        self.lengths[row] = length

    def rows(self, start: int, stop: int) -> KVCache:
        """Rows start..stop-1 as a cache sharing this one's storage; its lengths start as a copy of theirs."""
        view = object.__new__(KVCache)
        if start == 0 and stop == self.batch_size:  # every row (each draft forward asks): the tensors themselves
            view.keys, view.values = self.keys, self.values
        else:
            view.keys = [keys[start:stop] for keys in self.keys]
            view.values = [values[start:stop] for values in self.values]
        view.max_length = self.max_length
        view.lengths = self.lengths[start:stop]
        return view

    def stacked(self) -> tuple[torch.Tensor, torch.Tensor]:
        """Copies of every layer's keys and values: [layers, batch, kv_heads, max_length, head_dim] each."""
        return torch.stack(self.keys), torch.stack(self.values)

    def move_row(self, source: int, destination: int) -> None:
        """Copy row `source`'s committed entries into row `destination` (compacting the active rows)."""
        length = self.lengths[source]
        for entries in (*self.keys, *self.values):
            entries[destination, :, :length] = entries[source, :, :length]
        self.lengths[destination] = length

    def move_entries(self, row: int, sources: list[int], destinations: list[int]) -> None:
        """Copy row `row`'s entries at slots `sources` to slots `destinations` in every layer (a verified tree's
        accepted path, moved from where its nodes were written to the positions it now holds)."""
        if sources == destinations:
            return
        source = from_host(sources, self.keys[0].device)
        destination = from_host(destinations, self.keys[0].device)
        for entries in (*self.keys, *self.values):
            entries[row, :, destination] = entries[row, :, source]

    def layer(self, index: int) -> tuple[torch.Tensor, torch.Tensor]:
        """One layer's keys and values: [B, kv_heads, max_length, head_dim] each."""
        return self.keys[index], self.values[index]


def write_entries(keys_cache: torch.Tensor, values_cache: torch.Tensor, slots: torch.Tensor, keys: torch.Tensor,
                  values: torch.Tensor) -> None:
    """Store new entries of one layer. *_cache: [B, kv_heads, max_length, D]; slots: [B, T] long;
    keys/values: [B, kv_heads, T, D]. Indexed assignment, which inductor keeps in place in a compiled step."""
    if slots.shape[0] == 1 and not torch.compiler.is_compiling():  # an exported step takes any number of rows
        keys_cache[:, :, slots[0]] = keys
        values_cache[:, :, slots[0]] = values
        return
    rows = torch.arange(slots.shape[0], device=slots.device)[:, None]
    keys_cache[rows, :, slots] = keys.transpose(1, 2)
    values_cache[rows, :, slots] = values.transpose(1, 2)
