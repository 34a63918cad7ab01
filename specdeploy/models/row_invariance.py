"""Batch invariance: a row's outputs must not depend on the other rows it is computed with.

A decode step stacks every running request's tokens into one forward, and two parts of a forward can compute a
row differently depending on its company:
- attention: the batched call attends over the longest row's keys with the others masked, and torch's CPU
  attention kernel reduces a row differently when the key length changes, masked keys or not (bf16, torch 2.13:
  a query over 300 keys with 5 masked ones appended differs in its last bits). The fix is structural: attend each
  query over exactly the keys it sees (`attend_rows`), the call a lone plain decode step makes. That also makes a
  chain's verify compute each position as plain decoding does, so greedy text does not depend on speculation; a
  token tree is attended in one masked call over its row's own keys (independent of the other rows, not of the
  tree), so a tree method's greedy text can still part from plain at a near tie.
- matmuls: a kernel may be chosen by the number of rows M (oneDNN picks its blocking, its K-parallel reduction and
  on AMX CPUs even the instruction set by shape; cuBLAS splits K by shape). Whether this machine's kernels keep a
  row's result whatever M is, is measured, not assumed: `invariant_rows` runs each distinct linear layer on rows
  alone and in blocks of many sizes. A layer that changes rows above some M computes in blocks of at most that
  many rows (`RowBlocks`). The probe's rows hold subnormal values, as real activations do: on a CPU with AVX-512
  BF16 the bf16 down projection computed a row with subnormal inputs differently alone than beside another row,
  which normal random rows never showed (docs/serving.md, "What a seed guarantees").
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

# Row counts a probe tries: every count up to EXHAUSTIVE (a block of rows can hold any of them), then larger
# ones around powers of two, where kernels switch blocking.
EXHAUSTIVE = 32
LARGER_ROWS = (33, 47, 48, 63, 64, 65, 96, 127, 128, 129, 136, 192, 256)

def attend_rows(q: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, mask: torch.Tensor | None,
                spans: list[tuple[int, int]], group: int) -> torch.Tensor:
    """Attention computed the way a lone plain decode step computes it.

    q: [B, kv_heads, G*T, D] (query heads grouped by kv head, DecoderLayer's layout); keys, values:
    [B, kv_heads, S, D]; spans[r] = (t, s): row r's first t queries are real and their keys are its first s slots.
    mask: [B, 1, G*T, S] bool (a token tree's), or None for causal rows, whose query i sees the first s - t + i + 1
    keys. A causal row's queries are attended one at a time over exactly the keys each sees, with no mask: the
    call a plain decode step makes for that position, so verifying drafts computes each position as decoding it
    would. A masked row is attended in one call over its own t queries and s keys. Returns [B, kv_heads, G*T, D],
    zeros at padding queries.
    """
    batch, kv_heads, grouped_length, dim = q.shape
    length = grouped_length // group
    out = q.new_zeros(batch, kv_heads, group, length, dim)
    by_group = q.view(batch, kv_heads, group, length, dim)
    for row, (t, s) in enumerate(spans):
        row_keys, row_values = keys[row:row + 1], values[row:row + 1]
        if mask is None or t == 1:  # a row's first query sees every key before it and itself: no mask
            for i in range(t):
                seen = s - t + i + 1
                out[row:row + 1, :, :, i] = F.scaled_dot_product_attention(
                    by_group[row:row + 1, :, :, i], row_keys[:, :, :seen], row_values[:, :, :seen])
            continue
        row_q = by_group[row:row + 1, :, :, :t].reshape(1, kv_heads, group * t, dim)
        row_mask = mask[row:row + 1].view(1, 1, group, length, -1)[..., :t, :s].reshape(1, 1, group * t, s)
        attended = F.scaled_dot_product_attention(row_q, row_keys[:, :, :s], row_values[:, :, :s],
                                                  attn_mask=row_mask)
        out[row:row + 1, :, :, :t] = attended.view(1, kv_heads, group, t, dim)
    return out.view(batch, kv_heads, grouped_length, dim)


class RowBlocks(nn.Module):
    """A linear layer computed in blocks of at most `rows` rows: x [..., K] → [..., N]. With `rows` the most its
    kernel keeps a row's result for (`invariant_rows`), every row comes out as it would alone."""

    def __init__(self, inner: nn.Module, rows: int) -> None:
        super().__init__()
        self.inner, self.rows = inner, rows

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        flat = x.reshape(-1, x.shape[-1])
        if flat.shape[0] <= self.rows:
            return self.inner(x)
        out = torch.cat([self.inner(block) for block in flat.split(self.rows)])
        return out.view(*x.shape[:-1], out.shape[-1])


def invariant_rows(layer: nn.Module, in_features: int, dtype: torch.dtype, device: torch.device,
                   max_rows: int, seed: int = 0) -> int:
    """The most rows `layer` may take in one call with each row computed bit for bit as it is alone: max_rows when
    every count probed passes (each up to EXHAUSTIVE, then LARGER_ROWS), else the largest count below the first
    failure up to which every count was probed. Random rows of the layer's dtype, some entries subnormal."""
    generator = torch.Generator().manual_seed(seed)
    x = torch.randn(max_rows, in_features, generator=generator)
    # A tenth of the entries subnormal: a SiLU-gated activation has them, and kernels differ in whether they flush
    # them (AVX-512 BF16's dot product treats them as zero, an fp32 FMA path does not), which normal values never show.
    tiny = torch.rand(max_rows, in_features, generator=generator) < 0.1
    x = torch.where(tiny, x * 2.0**-130, x).to(dtype=dtype, device=device)
    counts = [n for n in (*range(1, EXHAUSTIVE + 1), *LARGER_ROWS) if n <= max_rows]
    with torch.inference_mode():
        alone = torch.cat([layer(x[i:i + 1]) for i in range(max_rows)])
        for n in counts:
            if not torch.equal(layer(x[:n]), alone[:n]):
                return min(n - 1, EXHAUSTIVE)
    return max_rows
