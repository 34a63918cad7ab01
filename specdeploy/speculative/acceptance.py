"""Exact speculative acceptance (rejection sampling), vectorised over the batch and the drafted positions.

Glossary
- drafted tokens x_1..x_gamma: proposed by a draft model (sampled from q_i) or a draft-free proposer (one-hot q).
- accepted tokens: the drafted prefix that survives the rule `r_i <= p_i(x_i) / q_i(x_i)`, r_i ~ U(0, 1).
- recovered token: emitted at the first rejection, sampled from normalize(max(0, p_i - q_i)); the drafted tail
  after it is discarded.
- bonus token: emitted from p_(gamma+1) when every drafted token survived.
Every step therefore emits accepted + 1 tokens, and each emitted token is distributed exactly as the target's
sampling distribution p at its position, whatever q is. At temperature 0, p and q are point masses and the rule
reduces to "accept while the draft token equals the target's argmax".

Nothing here syncs with the host; the caller reads `num_accepted` once per step.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from specdeploy.decoding.sampling import Randomness, sample, uniform


@dataclass
class AcceptanceResult:
    tokens: torch.Tensor  # [B, gamma + 1] long: accepted drafts then the recovered/bonus token, -1 after
    num_accepted: torch.Tensor  # [B] long: accepted drafted tokens (tokens emitted = num_accepted + 1)


def accept(draft_tokens: torch.Tensor, draft_probs: torch.Tensor | None, target_probs: torch.Tensor,
           num_drafted: torch.Tensor, generator: Randomness) -> AcceptanceResult:
    """Apply the exact rule to one verification step.

    draft_tokens: [B, gamma] long (entries at or past num_drafted are ignored).
    draft_probs: [B, gamma, V] q_i, or None for draft-free proposers (q is one-hot on the drafted token).
    target_probs: [B, gamma + 1, V] p_1..p_(gamma+1), the target's sampling distributions.
    num_drafted: [B] long, how many drafted tokens each row proposed (0..gamma).
    generator: randomness for r_i and the final sample (one generator, or one stream per row); None only when every
    p and q is a point mass (greedy).
    """
    batch, gamma = draft_tokens.shape
    device = target_probs.device
    positions = torch.arange(gamma, device=device)
    valid = positions[None, :] < num_drafted[:, None]  # [B, gamma]
    safe_tokens = torch.where(valid, draft_tokens, 0)
    p_of_x = target_probs[:, :gamma].gather(-1, safe_tokens[..., None]).squeeze(-1)  # [B, gamma]
    if draft_probs is None:
        q_of_x = torch.ones_like(p_of_x)
    else:
        q_of_x = draft_probs.gather(-1, safe_tokens[..., None]).squeeze(-1)
    # r in (0, 1] (r = 0 would accept a token the target gives p = 0); all ones for point masses, where p(x) / q(x)
    # is exactly 0 or 1.
    r = uniform(p_of_x.shape, generator, device)
    # r <= p/q without dividing by q; a token the target gives p = 0 never survives, even with a q(x) of 0 (a caller
    # whose drafts were not drawn from the q it passes).
    survives = (r * q_of_x <= p_of_x) & (p_of_x > 0) & valid
    num_accepted = survives.long().cumprod(-1).sum(-1)  # [B]

    # The distribution of the emitted token at index num_accepted: residual after a rejection, p for the bonus.
    rows = torch.arange(batch, device=device)
    final_p = target_probs[rows, num_accepted]  # [B, V]
    rejected = num_accepted < num_drafted  # [B]
    at_reject = num_accepted.clamp(max=gamma - 1) if gamma else num_accepted
    if draft_probs is None:
        final_q = torch.zeros_like(final_p)
        if gamma:
            final_q[rows, safe_tokens[rows, at_reject]] = 1.0
    else:
        final_q = draft_probs[rows, at_reject] if gamma else torch.zeros_like(final_p)
    residual = (final_p - final_q).clamp(min=0)
    mass = residual.sum(-1, keepdim=True)
    # p == q up to rounding can still reject with vanishing probability; p itself is then the right fallback.
    residual = torch.where(mass > 0, residual / mass.clamp(min=1e-30), final_p)
    final_dist = torch.where(rejected[:, None], residual, final_p)
    return emitted(draft_tokens, num_accepted, sample(final_dist, generator))


def accept_greedy(draft_tokens: torch.Tensor, target_tokens: torch.Tensor, num_drafted: torch.Tensor
                  ) -> AcceptanceResult:
    """`accept` when p and q are all point masses, from the tokens they sit on: the rule keeps drafted tokens while
    they equal the target's, then emits the target's token (the residual of two point masses is p's).

    draft_tokens: [B, gamma] long; target_tokens: [B, gamma + 1] long, the target's token at each position;
    num_drafted: [B] long.
    """
    gamma = draft_tokens.shape[1]
    valid = torch.arange(gamma, device=draft_tokens.device)[None, :] < num_drafted[:, None]
    num_accepted = ((draft_tokens == target_tokens[:, :gamma]) & valid).long().cumprod(-1).sum(-1)
    rows = torch.arange(draft_tokens.shape[0], device=draft_tokens.device)
    return emitted(draft_tokens, num_accepted, target_tokens[rows, num_accepted])


def emitted(draft_tokens: torch.Tensor, num_accepted: torch.Tensor, final_token: torch.Tensor) -> AcceptanceResult:
    """The step's tokens: the accepted drafted prefix [B, gamma], then final_token [B], then -1."""
    batch, gamma = draft_tokens.shape
    positions = torch.arange(gamma, device=draft_tokens.device)
    tokens = torch.full((batch, gamma + 1), -1, dtype=torch.long, device=draft_tokens.device)
    keep = positions[None, :] < num_accepted[:, None]
    tokens[:, :gamma] = torch.where(keep, draft_tokens, -1)
    tokens[torch.arange(batch, device=draft_tokens.device), num_accepted] = final_token
    return AcceptanceResult(tokens=tokens, num_accepted=num_accepted)
