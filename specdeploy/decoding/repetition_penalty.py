"""The repetition penalty and the masks of context tokens it applies to. Pure tensor functions shared by the torch
engine's sampling (sampling.py) and the trtllm flavour's draft logits (serve/trtllm/sampling.py)."""

from __future__ import annotations

import torch

from specdeploy.spec.sampling_params import SamplingParams


def penalised(logits: torch.Tensor, params: SamplingParams, seen: torch.Tensor | None) -> torch.Tensor:
    """fp32 logits [N, V] after the repetition penalty on the `seen` [N, V] tokens."""
    logits = logits.float()
    if params.repetition_penalty == 1.0 or seen is None:
        return logits
    scaled = torch.where(logits > 0, logits / params.repetition_penalty, logits * params.repetition_penalty)
    largest = torch.finfo(torch.float32).max  # a tiny penalty must not overflow a logit to inf
    return torch.where(seen, scaled.clamp(-largest, largest), logits)


def seen_mask(tokens: torch.Tensor, vocab_size: int) -> torch.Tensor:
    """tokens: [n] long → [V] bool on the same device: which tokens occur in `tokens`. (The caller puts the tokens
    on the device, the torch engine without a host sync: models/device_transfer.from_host.)"""
    mask = torch.zeros(vocab_size, dtype=torch.bool, device=tokens.device)
    mask[tokens] = True
    return mask


def seen_after_drafts(seen: torch.Tensor, drafted: torch.Tensor, ancestry: torch.Tensor | None = None) -> torch.Tensor:
    """Context masks for the verified positions: position i has also seen drafted[:i] (a chain), or with
    `ancestry` [G + 1, G + 1] (a tree; entry [i, j]: j is i or an ancestor of i, 0 the pending token) the drafted
    tokens of its ancestors and itself. seen: [V] bool; drafted: [G] long → [G + 1, V] bool."""
    steps = torch.zeros(drafted.shape[0] + 1, seen.shape[0], dtype=torch.bool, device=seen.device)
    steps[torch.arange(1, drafted.shape[0] + 1, device=seen.device), drafted] = True
    if ancestry is None:
        return (steps.cumsum(0) > 0) | seen
    return ((ancestry.float() @ steps.float()) > 0) | seen
