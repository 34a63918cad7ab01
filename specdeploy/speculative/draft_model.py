"""Draft-model proposer: gamma sequential batched forwards of a small model sharing the target's tokenizer.

Two ways to hold the draft's keys and values for the committed prefix:
- own cache (any draft model): row r of the proposer's cache holds sequence r's committed prefix as the draft
  computed it. Each `propose` first feeds the committed tokens the draft has not seen (one or two), and after
  acceptance the sequence's `draft_length` is cut back to the committed prefix, so the draft is never conditioned
  on tokens the target discarded.
- shared cache (a draft derived from the target, e.g. its weight-only quantized copy: same layers, heads and
  dtype): the draft reads the target's own entries for the committed prefix and writes its drafted entries in the
  slots after it, which the target's verify forward overwrites before anything attends to them. The draft never
  prefills the prompt and never catches up; its entries are the target's, which only helps it agree. Exactness
  does not depend on either choice: q is whatever the draft computed, and acceptance corrects for it.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch

from specdeploy.kv_cache import KVCache
from specdeploy.model import LlamaModel, ragged_forward
from specdeploy.reductions import argmax
from specdeploy.sampling import greedy_tokens, sample, sampling_distribution

if TYPE_CHECKING:
    from specdeploy.batch import Sequence


def can_share_cache(draft: LlamaModel, target: LlamaModel) -> bool:
    """True when the draft's cache layout is the target's: same layers, kv heads, head size and dtype."""
    d, t = draft.config, target.config
    return ((d.num_layers, d.num_kv_heads, d.head_dim, draft.dtype)
            == (t.num_layers, t.num_kv_heads, t.head_dim, target.dtype))


class DraftModelProposer:
    def __init__(self, model: LlamaModel, cache: KVCache, shared: bool, early_stop_threshold: float = 0.0) -> None:
        """cache: the draft's own cache, or the target's when shared (see the module docstring)."""
        self.model = model
        self.cache = cache
        self.shared = shared
        self.early_stop_threshold = early_stop_threshold
        self.forwards = 0

    def prefill(self, sequence: Sequence, row: int) -> None:
        """Feed a new sequence's prompt into row `row` of the draft's own cache (not needed when shared)."""
        tokens = sequence.committed[:-1]
        view = self.cache.rows(row, row + 1)
        view.lengths[0] = 0
        self.model(torch.tensor([tokens], device=self.model.embed.device),
                   torch.arange(len(tokens), device=self.model.embed.device)[None], view)
        sequence.draft_length = len(tokens)

    def propose(self, sequences: list[Sequence], gammas: list[int]) -> tuple[torch.Tensor, torch.Tensor, list[int]]:
        """Draft up to gammas[r] tokens after each sequence (row r of the cache).

        Returns drafted tokens [B, G] long, their sampling distributions q [B, G, V] (G = max gamma; None when
        every row is greedy, q then being the point mass on each drafted token) and how many each row drafted
        (fewer than gammas[r] only when the draft's confidence fell below the early-stop threshold: the row stops
        after that token). Entries past a row's count are scratch.
        """
        device = self.model.embed.device
        batch, width = len(sequences), max(gammas)
        if self.shared:
            inputs = [[s.committed[-1]] for s in sequences]
            starts = [len(s.committed) - 1 for s in sequences]
        else:
            inputs = [s.committed[s.draft_length:] for s in sequences]
            starts = [s.draft_length for s in sequences]
        seen = [None if s.seen is None else s.seen.clone() for s in sequences]
        counts = list(gammas)
        drafted = torch.zeros(batch, width, dtype=torch.long, device=device)
        all_greedy = all(s.params.greedy for s in sequences)
        q = None if all_greedy else torch.zeros(batch, width, self.model.config.vocab_size, device=device)
        for k in range(width):
            if all(k >= count for count in counts):
                break  # every row stopped early: no row needs this forward
            hidden = ragged_forward(self.model, self.cache.rows(0, batch), inputs, starts)  # [B, H]
            self.forwards += 1
            starts = [start + len(fed) for start, fed in zip(starts, inputs)]
            logits = self.model.logits(hidden)  # [B, V]
            drafted[:, k] = argmax(logits)  # every greedy row without a repetition penalty, in one call
            for r, sequence in enumerate(sequences):
                if k >= counts[r]:
                    continue
                context = None if seen[r] is None else seen[r][None]
                if q is None:  # every row greedy: q is the point mass on the drafted token
                    if context is not None:
                        drafted[r, k] = greedy_tokens(logits[r:r + 1], sequence.params, context)[0]
                else:
                    q[r, k] = sampling_distribution(logits[r:r + 1], sequence.params, context)[0]
                    drafted[r, k] = sample(q[r, k:k + 1], sequence.generator)[0]
                if seen[r] is not None:
                    seen[r][drafted[r, k]] = True
                # Confidence is the draft's own top-1 probability. An unsure token is still proposed (its forward
                # is paid for and it may be accepted); the row drafts nothing after it.
                if self.early_stop_threshold and logits[r].softmax(-1).max().item() < self.early_stop_threshold:
                    counts[r] = k + 1
            inputs = [[token] for token in drafted[:, k].tolist()]
        if not self.shared:
            for sequence, fed in zip(sequences, starts):
                sequence.draft_length = fed  # entries fed so far: the last drafted token was sampled, never fed
        return drafted, q, counts
