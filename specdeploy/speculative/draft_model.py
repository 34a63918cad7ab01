"""Draft-model proposer: gamma sequential batched forwards of a small model sharing the target's tokenizer.

Two ways to hold the draft's keys and values for the committed prefix:
- own cache (any draft model): row r of the proposer's cache holds a prefix of sequence r's committed tokens as
  the draft computed them; its length is the proposer's per-row state. `propose` first feeds the committed tokens
  the draft has not seen (one or two after an ordinary step; a row that lags further, because the speculation
  policy skipped drafting for a while, is caught up alone first, so no row pads the batch to another row's lag),
  and after each step the row is cut back to the committed prefix, so the draft is never conditioned on tokens
  the target discarded.
- shared cache (a draft derived from the target, e.g. its weight-only quantized copy: same layers, heads and
  dtype): the draft reads the target's own entries for the committed prefix and writes its drafted entries in the
  slots after it, which the target's verify forward overwrites before anything attends to them. The draft never
  prefills the prompt and never catches up; its entries are the target's, which only helps it agree. Exactness
  does not depend on either choice: q is whatever the draft computed, and acceptance corrects for it.
"""

from __future__ import annotations

import torch

from specdeploy.decoding.sampling import greedy_tokens, sample, sampling_distribution
from specdeploy.decoding.sequence import Sequence
from specdeploy.models.device_transfer import from_host
from specdeploy.models.kv_cache import KVCache
from specdeploy.models.llama import LlamaModel, pad_rows, ragged_forward
from specdeploy.models.reductions import argmax
from specdeploy.models.registry import load_component
from specdeploy.speculative.proposer import EngineParts, Proposal, Proposer

FED_PER_STEP = 2  # committed tokens an own-cache row feeds at most in the batched forward (more: caught up alone)


def can_share_cache(draft: LlamaModel, target: LlamaModel) -> bool:
    """True when the draft's cache layout is the target's: same layers, kv heads, head size and dtype."""
    d, t = draft.config, target.config
    return ((d.num_layers, d.num_kv_heads, d.head_dim, draft.dtype)
            == (t.num_layers, t.num_kv_heads, t.head_dim, target.dtype))


class DraftModelProposer(Proposer):
    def __init__(self, model: LlamaModel, cache: KVCache, shared: bool, early_stop_threshold: float) -> None:
        """cache: the draft's own cache, or the target's when shared (see the module docstring)."""
        self.model = model
        self.cache = cache
        self.shared = shared
        self.early_stop_threshold = early_stop_threshold
        self.forwards = 0

    @classmethod
    def from_engine(cls, parts: EngineParts) -> DraftModelProposer:
        spec = parts.pipeline.speculation.draft
        model = load_component(parts.directory / "draft", parts.device, prepack="draft" not in parts.unpacked,
                               row_invariant=parts.pipeline.serving.determinism == "batch_invariant")
        # A draft derived from the target reads the target's keys/values for the committed prefix.
        shared = spec.derive != "none" and can_share_cache(model, parts.target)
        cache = parts.cache if shared else model.new_cache(parts.cache.batch_size, parts.cache.max_length)
        return cls(model, cache, shared, spec.early_stop_threshold)

    @property
    def device(self) -> torch.device:
        return self.model.embed.device

    def stepped_models(self) -> list[tuple[LlamaModel, KVCache]]:
        return [(self.model, self.cache)]

    def prefill(self, row: int, sequence: Sequence, hidden: torch.Tensor) -> None:
        if not self.shared:
            self.cache.rewind(row, 0)
            self._feed_alone(row, sequence.committed[:-1])

    def on_commit(self, row: int, sequence: Sequence, hidden: torch.Tensor) -> None:
        if not self.shared:  # keep the committed prefix, drop entries of drafted tokens the target rejected
            self.cache.rewind(row, min(self.cache.lengths[row], sequence.cache_length))

    def move_row(self, source: int, destination: int) -> None:
        if not self.shared:
            self.cache.move_row(source, destination)

    def _feed_alone(self, row: int, tokens: list[int]) -> None:
        """Run `tokens` into the row's own cache after its current entries, in a forward of their own."""
        if not tokens:
            return
        start = self.cache.lengths[row]
        self.model(from_host([tokens], self.device),
                   torch.arange(start, start + len(tokens), device=self.device)[None], self.cache.rows(row, row + 1))
        self.cache.rewind(row, start + len(tokens))

    def propose(self, sequences: list[Sequence], gammas: list[int]) -> Proposal:
        """Draft up to gammas[r] tokens after each sequence (row r of the cache). A row drafts fewer only when the
        draft's confidence fell below the early-stop threshold: it stops after that token."""
        batch, width = len(sequences), max(gammas)
        if self.shared:
            inputs = [[s.committed[-1]] for s in sequences]
            starts = [s.cache_length for s in sequences]
        else:
            for row, sequence in enumerate(sequences):
                self._feed_alone(row, sequence.committed[self.cache.lengths[row]:-FED_PER_STEP])
            starts = self.cache.lengths[:batch]
            inputs = [s.committed[start:] for s, start in zip(sequences, starts)]
        counts = list(gammas)
        drafted = torch.zeros(batch, width, dtype=torch.long, device=self.device)
        all_greedy = all(s.params.greedy for s in sequences)
        q = None if all_greedy else torch.zeros(batch, width, self.model.config.vocab_size, device=self.device)
        seen = [None if s.seen is None else s.seen.clone() for s in sequences]
        tokens, lengths = pad_rows(inputs, self.device), [len(fed) for fed in inputs]
        for k in range(width):
            if all(k >= count for count in counts):
                break  # every row stopped early: no row needs this forward
            hidden = ragged_forward(self.model, self.cache.rows(0, batch), tokens, starts, lengths)  # [B, H]
            self.forwards += 1
            starts = [start + length for start, length in zip(starts, lengths)]
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
                    seen[r][drafted[r, k:k + 1]] = True  # a 1-element index: a 0-d one is read on the host
            if self.early_stop_threshold:
                # Confidence is the draft's own top-1 probability. An unsure token is still proposed (its forward
                # is paid for and it may be accepted); the row drafts nothing after it.
                confidence = logits.softmax(-1).amax(-1).tolist()
                counts = [k + 1 if k < count and confidence[r] < self.early_stop_threshold else count
                          for r, count in enumerate(counts)]
            tokens, lengths = drafted[:, k:k + 1], [1] * batch
        if not self.shared:
            for row, fed in enumerate(starts):
                self.cache.rewind(row, fed)  # entries fed so far: the last drafted token was sampled, never fed
        return Proposal(drafted, q, counts)
