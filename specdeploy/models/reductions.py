"""Argmax and top-k over a vocabulary, computed in blocks.

torch's CPU argmax and topk are not vectorised like its max-reductions, so over a vocabulary they cost many times
an amax, and a decode step calls them up to twice per forward. Reducing each block of BLOCK logits to its maximum
first, then searching only the winning blocks, returns exactly what torch returns (the first index among equal
maxima) in less time (timed: docs/benchmarks.md, "Figures behind the code").
"""

from __future__ import annotations

import torch

BLOCK = 64


def argmax(logits: torch.Tensor) -> torch.Tensor:
    """logits: [N, V] → [N] long, the first index of each row's maximum (as torch.argmax)."""
    rows, vocab = logits.shape
    if vocab % BLOCK or logits.device.type != "cpu":
        return logits.argmax(-1)
    blocks = logits.reshape(rows, vocab // BLOCK, BLOCK)
    # The first block holding the maximum, then the first maximum inside it: the first index overall.
    block = blocks.amax(-1).argmax(-1)  # [N]
    inside = blocks[torch.arange(rows, device=logits.device), block].argmax(-1)
    return block * BLOCK + inside


def topk_indices(logits: torch.Tensor, k: int) -> torch.Tensor:
    """logits: [N, V] → [N, k] long, indices of each row's k largest values (in no particular order).

    A block holding one of the k largest values has a maximum at least that value, and fewer than k other blocks
    can have a larger maximum (each would hold a larger value), so the k largest lie in the k best blocks."""
    rows, vocab = logits.shape
    if vocab % BLOCK or vocab // BLOCK < k or logits.device.type != "cpu":
        return logits.topk(k, dim=-1).indices
    blocks = logits.reshape(rows, vocab // BLOCK, BLOCK)
    best_blocks = blocks.amax(-1).topk(k, dim=-1).indices  # [N, k]
    candidates = blocks.gather(1, best_blocks[..., None].expand(rows, k, BLOCK)).view(rows, k * BLOCK)
    within = candidates.topk(k, dim=-1).indices  # [N, k] into the candidates
    return best_blocks.gather(1, within // BLOCK) * BLOCK + within % BLOCK
