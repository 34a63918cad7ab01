"""Draft-model proposer: gamma sequential forwards of a small model sharing the target's tokenizer.

Two ways to hold the draft's keys and values for the committed prefix:
- own cache (any draft model): the proposer's cache holds the committed prefix as the draft computed it. Each
  `propose` first feeds the committed tokens the draft has not seen (the whole prompt on the first call, then one
  or two tokens), and `rewind` after acceptance keeps exactly the accepted part of what it drafted, so the draft
  is never conditioned on tokens the target discarded.
- shared cache (a draft derived from the target, e.g. its weight-only quantized copy: same layers, heads and
  dtype): the draft reads the target's own entries for the committed prefix and writes its drafted entries in the
  slots after it, which the target's verify forward overwrites before anything attends to them. The draft never
  prefills the prompt and never catches up; its entries are the target's, which only helps it agree. Exactness
  does not depend on either choice: q is whatever the draft computed, and acceptance corrects for it.
"""

from __future__ import annotations

import torch

from specdeploy.kv_cache import KVCache
from specdeploy.model import LlamaModel
from specdeploy.sampling import SamplingParams, sample, sampling_distribution


def can_share_cache(draft: LlamaModel, target: LlamaModel) -> bool:
    """True when the draft's cache layout is the target's: same layers, kv heads, head size and dtype."""
    d, t = draft.config, target.config
    return ((d.num_layers, d.num_kv_heads, d.head_dim, draft.dtype)
            == (t.num_layers, t.num_kv_heads, t.head_dim, target.dtype))


class DraftModelProposer:
    def __init__(self, model: LlamaModel, max_length: int, early_stop_threshold: float = 0.0,
                 shared_cache: KVCache | None = None) -> None:
        """shared_cache: the target's cache, for a draft derived from the target (see the module docstring)."""
        self.model = model
        self.shared = shared_cache is not None
        self.cache = shared_cache if self.shared else model.new_cache(1, max_length)
        self.early_stop_threshold = early_stop_threshold
        self.forwards = 0

    def reset(self) -> None:
        if not self.shared:
            self.cache.rewind(0, 0)

    def propose(self, committed: list[int], gamma: int, params: SamplingParams, seen: torch.Tensor | None,
                generator: torch.Generator | None) -> tuple[torch.Tensor, torch.Tensor]:
        """Draft up to gamma tokens after `committed`.

        seen: [V] bool context mask for the repetition penalty (None when the penalty is off).
        Returns drafted tokens [n] long and their sampling distributions q [n, V] (n ≤ gamma; n < gamma only
        when the draft's confidence fell below the early-stop threshold).
        """
        device = self.model.embed.device
        start = self.cache.lengths[0]
        inputs = torch.tensor([committed[start:]], dtype=torch.long, device=device)
        positions = torch.arange(start, len(committed), device=device)[None]
        seen = None if seen is None else seen.clone()
        tokens, dists = [], []
        for _ in range(gamma):
            hidden = self.model(inputs, positions, self.cache)
            self.forwards += 1
            self.cache.rewind(0, self.cache.lengths[0] + inputs.shape[1])
            logits = self.model.logits(hidden[:, -1])  # [1, V]
            # Confidence is the draft model's own top-1 probability (at temperature 0, q is a point mass).
            if self.early_stop_threshold and tokens and logits.softmax(-1).max().item() < self.early_stop_threshold:
                break
            q = sampling_distribution(logits, params, None if seen is None else seen[None])  # [1, V]
            token = sample(q, generator)  # [1]
            tokens.append(token)
            dists.append(q)
            if seen is not None:
                seen[token] = True
            inputs, positions = token[None], positions[:, -1:] + 1
        if self.shared:  # the committed length is the target's; drafted entries are only scratch
            self.cache.rewind(0, start)
        # The last drafted token was sampled but never fed, so the cache ends one short of the drafts.
        return torch.cat(tokens), torch.cat(dists)

    def rewind(self, committed_length: int) -> None:
        """Keep the draft's entries for the committed prefix (a full acceptance leaves the last draft unfed)."""
        if not self.shared:
            self.cache.rewind(0, min(self.cache.lengths[0], committed_length - 1))
