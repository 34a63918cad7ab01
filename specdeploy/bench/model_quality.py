"""Scoring one model against another on held-out text (text_corpus.py's held-out half, which no derivation or
calibration reads): teacher-forced over the same token sequences, the fraction of positions where both pick the
same next token, the mean KL divergence from the reference's next-token distribution, and perplexity."""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F

from specdeploy.build import text_corpus as corpus
from specdeploy.models.llama import LlamaModel


def held_out_sequences(tokenizer, count: int = 12, max_length: int = 256) -> list[list[int]]:
    _, texts = corpus.calibration_split()
    return [tokenizer.encode(text)[:max_length] for text in texts[:count]]


def teacher_forced_logits(model: LlamaModel, tokens: list[int]) -> torch.Tensor:
    """[T, V] fp32: the next-token logits at every position of `tokens`."""
    with torch.inference_mode():
        ids = torch.tensor([tokens])
        return model.logits(model(ids, torch.arange(len(tokens))[None], model.new_cache(1, len(tokens))).hidden)[0]


def perplexity(logits: list[torch.Tensor], sequences: list[list[int]]) -> float:
    losses = [F.cross_entropy(scores[:-1], torch.tensor(tokens[1:]), reduction="sum")
              for scores, tokens in zip(logits, sequences)]
    return math.exp(float(sum(losses)) / sum(len(s) - 1 for s in sequences))


def compare(reference: list[torch.Tensor], logits: list[torch.Tensor]) -> dict[str, float]:
    """Per-sequence [T, V] logits of a model against the reference's (a dense, unquantized model: hence the key):
    greedy_agreement and kl_from_dense, per position."""
    positions = sum(len(r) for r in reference)
    agree = sum(int((ref.argmax(-1) == other.argmax(-1)).sum()) for ref, other in zip(reference, logits))
    divergence = sum(float(F.kl_div(other.log_softmax(-1), ref.log_softmax(-1), log_target=True, reduction="sum"))
                     for ref, other in zip(reference, logits))
    return {"greedy_agreement": agree / positions, "kl_from_dense": divergence / positions}
