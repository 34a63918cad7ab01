"""A draft's vocabulary: the target tokens it may propose, the most frequent in some text (EAGLE-3 picks its head's
rows from its training data; an early exit and Medusa heads their target head's rows from the shipped text corpus).

Over an int4 target the head is a large share of a step (SmolLM2: 49,152 rows of 576, a third of the bytes one
decode step reads), so a draft that runs the whole head per drafted token pays for it every time; its rows of a few
thousand frequent tokens cost a tenth of that. Only q changes: the target's verify reads its whole head.
"""

from __future__ import annotations

import json
from collections import Counter
from collections.abc import Iterable
from pathlib import Path

import torch

from specdeploy.errors import SpecdeployError
from specdeploy.models.llama import WHOLE_MATRIX_LINEARS, DenseLinear, LlamaModel


def most_frequent_tokens(token_lists: Iterable[Iterable[int]], size: int, vocab_size: int) -> list[int]:
    """The `size` target ids most frequent in `token_lists` (ties and unseen ids by id, lowest first), ascending;
    every id when size is 0 or covers the vocabulary."""
    if size == 0 or size >= vocab_size:
        return list(range(vocab_size))
    counts = Counter(token for tokens in token_lists for token in tokens)
    ranked = sorted(range(vocab_size), key=lambda token: (-counts.get(token, 0), token))
    return sorted(ranked[:size])


def read_vocabulary_file(path: Path, written_by: str) -> list[int]:
    """The ids of a draft vocabulary file ({"draft_vocab": [ids], "source": how they were counted}); an error
    naming what writes it when it is missing."""
    if not path.is_file():
        raise SpecdeployError(f"{path.parent}: no {path.name}, which {written_by} writes (run specdeploy build "
                              f"--force with this pipeline)")
    return json.loads(path.read_text())["draft_vocab"]


class VocabularyHead:
    """The target's head restricted to a draft vocabulary: logits over every id, -inf outside it (so a draft never
    proposes a token there, and its q is 0 there)."""

    def __init__(self, target: LlamaModel, ids: torch.Tensor, key: str) -> None:
        """ids: the target ids covered [Vd] (every id: the whole head). key: the pipeline key that asked for it,
        named when the target's head cannot be cut."""
        self.target, self.ids = target, ids
        self.vocab_size = target.config.vocab_size
        self.whole = len(ids) == self.vocab_size
        self.rows = None if self.whole else head_rows(target, ids, key)

    def __call__(self, hidden: torch.Tensor) -> torch.Tensor:
        """hidden: [..., H] in the target's dtype → fp32 logits [..., V]."""
        if self.whole:
            return self.target.logits(hidden)
        logits = torch.full((*hidden.shape[:-1], self.vocab_size), float("-inf"), device=hidden.device)
        logits[..., self.ids] = self.rows(hidden).float()
        return logits


def head_rows(target: LlamaModel, ids: torch.Tensor, key: str) -> DenseLinear:
    """The target head's rows of `ids` as a linear [H] → [Vd], prepacked like the target's own. Read as the head's
    output for the unit vectors of its input, which is exact for a head that reads its whole matrix (dense, int4 or
    int8 weight-only) whatever its packing; a rescored head is not linear, so it is refused."""
    if not isinstance(target.lm_head, WHOLE_MATRIX_LINEARS):
        raise SpecdeployError(f"{key}: the target's head ({type(target.lm_head).__name__}) is not one matrix whose "
                              f"rows can be taken; set {key.rsplit('.', 1)[-1]}: 0 (the whole head)")
    eye = torch.eye(target.config.hidden_size, dtype=target.dtype, device=target.embed.device)
    with torch.inference_mode():
        rows = DenseLinear(target.lm_head(eye)[:, ids].T.contiguous())  # [H, V] → [Vd, H]
    rows.prepack()
    return rows
