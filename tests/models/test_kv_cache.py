"""KVCache: one tensor per layer; row views share the storage but not the lengths; moves and writes."""

from __future__ import annotations

import pytest
import torch

from specdeploy.models.kv_cache import KVCache, write_entries


def filled_cache() -> KVCache:
    """3 layers, 3 rows, 2 kv heads, 6 slots, head dim 4; entry values name their layer, row and slot."""
    cache = KVCache(3, 3, 2, 6, 4, torch.float32)
    for layer, (keys, values) in enumerate(zip(cache.keys, cache.values)):
        slots = torch.arange(6.0)[None, None, :, None]
        keys.copy_((100 * layer + 10 * torch.arange(3.0)[:, None, None, None] + slots).expand_as(keys))
        values.copy_(-keys)
    cache.lengths = [4, 5, 6]
    return cache


def test_layers_are_separate_tensors_and_stacked_copies_them():
    cache = filled_cache()
    assert len({keys.data_ptr() for keys in cache.keys + cache.values}) == 6
    keys, values = cache.stacked()
    assert keys.shape == (3, 3, 2, 6, 4)
    torch.testing.assert_close(values, -keys)
    keys.zero_()
    assert cache.keys[1].abs().sum() > 0  # a copy, not the cache


@pytest.mark.parametrize("start, stop", [(0, 3), (1, 3), (0, 1)])
def test_a_row_view_writes_through_and_keeps_its_own_lengths(start, stop):
    cache = filled_cache()
    view = cache.rows(start, stop)
    assert view.lengths == cache.lengths[start:stop]
    view.lengths = [0] * (stop - start)
    assert cache.lengths == [4, 5, 6]
    entries = torch.full((stop - start, 2, 1, 4), 7.0)
    keys, values = view.layer(2)
    write_entries(keys, values, torch.full((stop - start, 1), 5), entries, -entries)
    assert (cache.keys[2][start:stop, :, 5] == 7).all() and (cache.values[2][start:stop, :, 5] == -7).all()
    untouched = [row for row in range(3) if not start <= row < stop]
    assert all((cache.keys[2][row, :, 5] == 200 + 10 * row + 5).all() for row in untouched)


def test_moves_copy_every_layer():
    cache = filled_cache()
    cache.move_row(2, 0)
    assert cache.lengths[0] == 6
    for layer in range(3):
        torch.testing.assert_close(cache.keys[layer][0], cache.keys[layer][2])
    cache.move_entries(1, [4, 5], [2, 3])
    for layer, values in enumerate(cache.values):
        assert (values[1, :, 2] == -(100 * layer + 10 + 4)).all() and (values[1, :, 3] == -(100 * layer + 15)).all()
