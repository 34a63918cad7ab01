"""How well Medusa heads guess the target's tokens: hidden states and head targets over token sequences the target
produced, and each head's accuracy by rank (what train-medusa reports and the tree builder and bench use)."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from specdeploy.speculative.medusa import MedusaHeads

TOP_K = (1, 3, 5)  # accuracies reported per head
RANKS = 10  # ranks whose accuracy is recorded for the tree builder
IGNORE = -100  # a target past the end of a sequence


@dataclass
class Features:
    hidden: torch.Tensor  # [N, H] fp32: the target's final hidden state at each position t
    targets: torch.Tensor  # [N, K] long: the token at t + k + 2 for head k, IGNORE past the sequence's end


def hidden_features(target, sequences: list[tuple[list[int], int]], num_heads: int,
                    on_progress: Callable[[], None] | None = None) -> Features:
    """sequences: (tokens, first) pairs, the target's own tokens from index first + 1 on (a prompt and the
    target's answer: first is the prompt's last index). One target forward per sequence; positions first ..
    len - 2 (each has at least the next token; heads whose target lies past the end are ignored)."""
    hidden_rows, target_rows = [], []
    with torch.inference_mode():
        for tokens, first in sequences:
            cache = target.new_cache(1, len(tokens) + 1)
            hidden = target(torch.tensor([tokens]), torch.arange(len(tokens))[None], cache).hidden[0].float()
            padded = torch.tensor(tokens + [IGNORE] * (num_heads + 1))
            targets = torch.stack([padded[t + 2:t + 2 + num_heads] for t in range(first, len(tokens) - 1)])
            hidden_rows.append(hidden[first:len(tokens) - 1])
            target_rows.append(targets)
            if on_progress is not None:
                on_progress()
    return Features(torch.cat(hidden_rows), torch.cat(target_rows))


def accuracies(heads: MedusaHeads, data: Features, lm_head: torch.Tensor, batch_size: int = 512,
               vocabulary: list[int] | None = None) -> list[dict]:
    """Per head, over `data`: top-k accuracy (k in TOP_K) of its guess for the token at t + k + 2, and by_rank[i],
    how often its i-th most likely token is that token (what the tree builder needs), for i < RANKS. vocabulary:
    the ids the heads may propose (speculation.medusa.draft_vocab), None for every id."""
    outside = None
    if vocabulary is not None and len(vocabulary) < lm_head.shape[0]:
        outside = torch.ones(lm_head.shape[0], dtype=torch.bool)
        outside[vocabulary] = False
    hits = torch.zeros(heads.num_heads, RANKS)
    counts = torch.zeros(heads.num_heads)
    with torch.inference_mode():
        for batch in torch.arange(len(data.hidden)).split(batch_size):
            logits = F.linear(heads.hidden(data.hidden[batch]), lm_head)  # [n, K, V]
            if outside is not None:
                logits[..., outside] = float("-inf")
            top = logits.topk(RANKS, dim=-1).indices  # [n, K, RANKS], best first
            targets = data.targets[batch]
            valid = targets != IGNORE
            hits += ((top == targets[..., None]) & valid[..., None]).sum(0)
            counts += valid.sum(0)
    by_rank = hits / counts[:, None].clamp(min=1)
    return [{f"top{k}": float(by_rank[h, :k].sum()) for k in TOP_K}
            | {"by_rank": [round(float(x), 5) for x in by_rank[h]], "positions": int(counts[h])}
            for h in range(heads.num_heads)]
