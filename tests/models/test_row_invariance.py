"""Batch invariance's parts: attention computed as a lone decode step computes it, and linear layers whose rows
must not change with their company (probed, and split into blocks where they do)."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from specdeploy.models.row_invariance import RowBlocks, attend_rows, invariant_rows

KV_HEADS, GROUP, DIM = 3, 3, 64


def lone_decode_attention(q_row: torch.Tensor, keys: torch.Tensor, values: torch.Tensor) -> torch.Tensor:
    """What a plain decode step of one sequence computes: one query position, every key so far, no mask.
    q_row: [kv_heads, G, D]; keys, values: [kv_heads, S, D] → [kv_heads, G, D]."""
    return F.scaled_dot_product_attention(q_row[None], keys[None], values[None])[0]


def test_each_position_is_attended_as_a_lone_decode_step_attends_it():
    """Rows of different lengths and real query counts, padded into one batch with stale keys past each row's end:
    every real query's output equals, bit for bit, the lone decode step at its position, in bf16. The batched
    masked call does not (the kernel's result depends on the padded key length), which is why this exists."""
    torch.manual_seed(0)
    committed, real = [37, 300, 5, 129], [1, 4, 6, 2]
    batch, width = len(committed), max(real)
    slots = max(c + t for c, t in zip(committed, real)) + 7
    keys = torch.randn(batch, KV_HEADS, slots, DIM).bfloat16()
    values = torch.randn(batch, KV_HEADS, slots, DIM).bfloat16()
    q = torch.randn(batch, KV_HEADS, GROUP * width, DIM).bfloat16()
    spans = [(t, c + t) for c, t in zip(committed, real)]
    out = attend_rows(q, keys, values, None, spans, GROUP).view(batch, KV_HEADS, GROUP, width, DIM)
    by_group = q.view(batch, KV_HEADS, GROUP, width, DIM)
    mask = torch.zeros(batch, 1, GROUP, width, slots, dtype=torch.bool)
    for row, (c, t) in enumerate(zip(committed, real)):
        for i in range(t):
            seen = c + i + 1
            expected = lone_decode_attention(by_group[row, :, :, i], keys[row, :, :seen], values[row, :, :seen])
            assert torch.equal(out[row, :, :, i], expected), (row, i)
            mask[row, :, :, i, :seen] = True
        assert not out[row, :, :, t:].any()  # padding queries stay zero
    batched = F.scaled_dot_product_attention(q, keys, values, attn_mask=mask.view(batch, 1, GROUP * width, slots))
    batched = batched.view(batch, KV_HEADS, GROUP, width, DIM)
    assert any(not torch.equal(batched[row, :, :, i], out[row, :, :, i])
               for row, t in enumerate(real) for i in range(t))


def test_a_masked_row_is_attended_over_its_own_queries_and_keys():
    """A tree's rows (an explicit mask) are attended in one call each over exactly their t queries and s keys:
    the same call the row makes alone, whatever the batch pads around it."""
    torch.manual_seed(1)
    spans = [(3, 20), (5, 40)]
    batch, width, slots = 2, 5, 48
    keys = torch.randn(batch, KV_HEADS, slots, DIM).bfloat16()
    values = torch.randn(batch, KV_HEADS, slots, DIM).bfloat16()
    q = torch.randn(batch, KV_HEADS, GROUP * width, DIM).bfloat16()
    mask = torch.rand(batch, 1, GROUP * width, slots) < 0.7
    mask[..., 0] = True
    out = attend_rows(q, keys, values, mask, spans, GROUP).view(batch, KV_HEADS, GROUP, width, DIM)
    for row, (t, s) in enumerate(spans):
        alone_q = q[row:row + 1].view(1, KV_HEADS, GROUP, width, DIM)[:, :, :, :t].reshape(1, KV_HEADS, GROUP * t, DIM)
        alone_mask = mask[row:row + 1].view(1, 1, GROUP, width, slots)[..., :t, :s].reshape(1, 1, GROUP * t, s)
        alone = F.scaled_dot_product_attention(alone_q, keys[row:row + 1, :, :s], values[row:row + 1, :, :s],
                                               attn_mask=alone_mask).view(1, KV_HEADS, GROUP, t, DIM)
        assert torch.equal(out[row:row + 1, :, :, :t], alone)


class RowsChangeAbove(nn.Module):
    """A linear layer whose kernel rounds differently once it gets more than `rows` rows (as oneDNN's bf16 kernel
    does for the down projection on an AVX-512 EPYC from 17 rows)."""

    def __init__(self, rows: int) -> None:
        super().__init__()
        self.rows = rows

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = x[..., :8] * 3  # elementwise: rows are independent unless the count says otherwise
        return out * (1 + 2**-10) if x.reshape(-1, x.shape[-1]).shape[0] > self.rows else out


def test_the_probe_finds_the_most_rows_a_kernel_keeps_and_blocks_compute_rows_as_alone():
    for rows in (1, 5, 16, 40):
        layer = RowsChangeAbove(rows)
        found = invariant_rows(layer, 16, torch.float32, torch.device("cpu"), max_rows=64)
        assert found == min(rows, 32)  # beyond 32 only some counts are probed: blocks stay at most 32 rows
        x = torch.randn(2, 50, 16)
        blocked = RowBlocks(layer, found)(x)
        alone = torch.cat([layer(row[None]) for row in x.reshape(-1, 16)]).view(2, 50, 8)
        assert torch.equal(blocked, alone)
        assert not torch.equal(layer(x), alone)  # the probe's power: unblocked, the rows change
    assert invariant_rows(RowsChangeAbove(100), 16, torch.float32, torch.device("cpu"), max_rows=64) == 64
