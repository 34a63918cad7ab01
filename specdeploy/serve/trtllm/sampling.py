"""The draft logits the orchestration hands TensorRT-LLM's target engine, so that its acceptance rule is exact.

The target turns `draft_logits` into q with a softmax and nothing else: no temperature, penalty, top-k or top-p
(cpp/tensorrt_llm/layers/externalDraftTokensLayer.cpp, invokeAddBiasSoftMax on the raw tensor at step 0), then
accepts a drafted token x when p(x) > u·q(x) and resamples from max(0, p − q) at a rejection
(kernels/speculativeDecoding/externalDraftTokensKernels.cu). That is the exact rule only when q is the distribution x
was really drawn from. So the orchestration sends log q of that distribution:
- a drafted token from the draft engine was drawn by the executor's sampling layers from the draft's raw logits
  (which `generation_logits` returns, before any processing): `executor_distribution` below;
- an n-gram proposal is a point mass: logit 0 on its token, the lowest float everywhere else.
Without draft logits the target accepts x only if it equals its own sample and draws a fresh sample at a rejection,
which gives x the probability p(x)(2 − p(x)): exact only when greedy (top-k 1), the one case that sends none.

How the executor samples one token (NVIDIA/TensorRT-LLM, docs/tensorrt-llm.md has the commits):
- penaltyKernels.cu: the logits times 1 / (T + 1e-6), then the repetition penalty on every token of the prompt and
  the output so far (logit < 0 ? logit × r : logit / r; both scale by a positive factor, so the order is moot);
- samplingTopKKernels.cu / samplingTopPKernels.cu: the candidates in descending probability (the top k, or every
  token when k is 0) with total mass S, a uniform u in (0, 1], and the first candidate whose cumulative mass reaches
  u × top_p × S. The token that crosses top_p keeps only its mass below the threshold: token i is drawn with
  probability (min(c_i, P·S) − min(c_{i−1}, P·S)) / (P·S), where c_i is the cumulative mass up to it.
"""

from __future__ import annotations

import numpy as np
import torch

from specdeploy.decoding.repetition_penalty import penalised, seen_after_drafts, seen_mask
from specdeploy.spec.sampling_params import SamplingParams

LOWEST_LOGIT = float(np.finfo(np.float32).min)  # softmax gives it 0 (the kernels mask with -FLT_MAX too)
TEMPERATURE_EPSILON = 1e-6  # penaltyKernels.cu: invTemperature = 1 / (T + 1e-6)
# The most top-k the executor's sampling runs: its layers clamp a larger one to it (clampTopK with TOP_K_MAX,
# externalDraftTokensLayer.cpp @ 1d263f15) and the top-k kernel's workspace is sized for it
# (medusaDecodingLayer.cpp @ 015884d6 allocates with TOP_K_MAX).
TOP_K_MAX = 1024


def padded_vocab_size(vocab_size: int, world_size: int) -> int:
    """The engine's logits width: the vocabulary rounded up to a multiple of the ranks (ModelConfig::
    getVocabSizePadded); draft_logits must have exactly this many columns."""
    return -(-vocab_size // world_size) * world_size


def executor_distribution(logits: torch.Tensor, params: SamplingParams,
                          seen: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """logits: [N, V] raw; seen: [N, V] bool, the context's tokens (repetition penalty). Returns the fp32
    probabilities [N, V] the executor's sampling layers draw a token from under `params`, and [N] bool: rows where
    that distribution depends on how the kernels order equal values, which nothing documents (see `order_matters`).
    Sampled requests only: a greedy one sends no q (top-k 1 token matching is exact)."""
    logits = penalised(logits, params, seen)
    probs = ((logits - logits.amax(-1, keepdim=True)) / (params.temperature + TEMPERATURE_EPSILON)).softmax(-1)
    vocab = probs.shape[-1]
    k = params.top_k if 0 < params.top_k < vocab else vocab
    if k == vocab and params.top_p >= 1.0:
        # the usual sampled request: nothing is cut and no tie can matter, so no sort of the whole vocabulary per
        # drafted row (seconds of CPU a second at a 128k vocabulary and 64 streams)
        return probs, torch.zeros(probs.shape[0], dtype=torch.bool)
    ranked, order = probs.topk(min(k + 1, vocab), dim=-1)  # [N, k (+1)] descending: one past the top k
    top, order = ranked[:, :k], order[:, :k]
    threshold = params.top_p * top.sum(-1, keepdim=True)  # [N, 1]
    cumulative = top.cumsum(-1)
    drawn = cumulative.clamp(max=threshold) - (cumulative - top).clamp(max=threshold)
    return torch.zeros_like(probs).scatter(-1, order, drawn / threshold), order_matters(ranked, k, cumulative,
                                                                                         threshold, params.top_p)


def order_matters(ranked: torch.Tensor, k: int, cumulative: torch.Tensor, threshold: torch.Tensor,
                  top_p: float) -> torch.Tensor:
    """ranked: [N, k or k + 1] probabilities in descending order. True where a tie decides the distribution: the
    k-th and (k+1)-th tie (which one top-k keeps), or the token crossing top_p ties with a neighbour (which one
    keeps only part of its mass). An engine's bf16 logits tie often (about one position in twenty at top-k 4 in a
    test here), and the kernels break ties by their reduction order, not torch's. [N] bool."""
    def tie(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
        return torch.isclose(a, b, rtol=1e-5, atol=0.0)

    matters = torch.zeros(ranked.shape[0], dtype=torch.bool)
    if ranked.shape[1] > k:
        matters |= tie(ranked[:, k - 1], ranked[:, k])
    if top_p < 1.0:
        crossing = (cumulative < threshold).sum(-1).clamp(max=k - 1)  # [N]: the first reaching the threshold
        mass = ranked.gather(-1, crossing[:, None])[:, 0]
        before = ranked.gather(-1, (crossing - 1).clamp(min=0)[:, None])[:, 0]
        after = ranked.gather(-1, (crossing + 1).clamp(max=ranked.shape[1] - 1)[:, None])[:, 0]
        matters |= ((crossing > 0) & tie(mass, before)) | ((crossing + 1 < ranked.shape[1]) & tie(mass, after))
    return matters


def as_logits(probs: torch.Tensor, width: int) -> np.ndarray:
    """[N, V] probabilities → [N, width] fp32 logits whose softmax gives them back (columns past V: never drawn)."""
    logits = np.full((probs.shape[0], width), LOWEST_LOGIT, dtype=np.float32)
    logs = torch.where(probs > 0, probs.log(), torch.full_like(probs, LOWEST_LOGIT))
    logits[:, :probs.shape[1]] = logs.numpy()
    return logits


def draft_logits(raw: np.ndarray, context: list[int], drafts: list[int], params: SamplingParams, vocab_size: int,
                 width: int) -> np.ndarray:
    """raw: [k, W'] the draft engine's generation logits of its k drafted tokens (W' its padded vocabulary);
    context: the sequence the draft continued. Returns [n, width] logits for the target (width: its padded
    vocabulary) whose softmax is the distribution each of the first n drafted tokens was drawn from: n stops before
    the first position whose distribution a tie decides. Cutting there is exact: it depends on the draft's logits
    at that position, not on the token drawn from them."""
    seen = seen_after_drafts(seen_mask(torch.tensor(context, dtype=torch.long), vocab_size),
                             torch.tensor(drafts, dtype=torch.long))[:len(drafts)]
    probs, ambiguous = executor_distribution(torch.from_numpy(np.asarray(raw[:, :vocab_size], dtype=np.float32)),
                                             params, seen)
    usable = int(ambiguous.long().cumsum(0).eq(0).sum())
    return as_logits(probs[:usable], width)


def point_mass_logits(drafts: list[int], width: int) -> np.ndarray:
    """[k, width] logits of proposals that are certain (n-gram): 0 on each drafted token, the lowest float
    elsewhere, so q is one-hot and the rule accepts x with probability p(x) and otherwise draws from p without x."""
    logits = np.full((len(drafts), width), LOWEST_LOGIT, dtype=np.float32)
    logits[np.arange(len(drafts)), drafts] = 0.0
    return logits
