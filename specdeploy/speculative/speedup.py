"""The cost model of speculation: what a step yields, what it costs, and the speedup that follows.

One speculative step drafts gamma tokens and verifies them with one target forward. Costs are in plain decode
steps (one target forward over one token):
- draft_cost c: one draft forward (a draft model) or one drafted token (a draft-free proposer, c ≈ 0);
- verify_cost v: the target forward over the gamma drafted tokens plus the pending one (≈ 1 while that forward is
  bandwidth bound; more on an MoE or where matmul time grows with rows).
A step then costs gamma c + v and emits the accepted drafts plus one token (the correction or the bonus), so the
predicted speedup over plain decode is tokens per step / (gamma c + v). With an acceptance rate alpha and
independent positions a step emits (1 - alpha^(gamma+1)) / (1 - alpha) tokens (the seed's geometric sum); with
acceptance measured by position, 1 + sum of p_i for i <= gamma. Below a speedup of 1 speculation costs time: the
break-even is a mean of gamma c + v tokens per step, which the Kubernetes alert watches.
"""

from __future__ import annotations

STEP_COST_IN_WORDS = "gamma × draft cost + verify cost"  # step_cost, as alerts and reports say it


def expected_tokens_per_step(alpha: float, gamma: float) -> float:
    """Tokens one step emits when each drafted token survives with probability alpha, independently:
    (1 - alpha^(gamma+1)) / (1 - alpha), never below 1; gamma + 1 when every draft survives."""
    if alpha >= 1:
        return gamma + 1
    return (1 - alpha ** (gamma + 1)) / (1 - alpha)


def tokens_per_step_by_position(per_position_acceptance: list[float], gamma: int) -> float:
    """Tokens one step emits drafting gamma tokens, from the measured acceptance by position: 1 + sum(p[:gamma]).
    p[i] is the fraction of steps drafting position i + 1 that accepted it (a chain accepts a prefix, so that is
    the probability of accepting at least i + 1 tokens; measured, not assumed independent)."""
    return 1 + sum(per_position_acceptance[:gamma])


def step_cost(gamma: float, draft_cost: float, verify_cost: float) -> float:
    """gamma c + v: one speculative step in plain decode steps."""
    return gamma * draft_cost + verify_cost


def speedup(tokens_per_step: float, cost: float) -> float:
    """Tokens per step over the step's cost in plain decode steps (a plain step: 1 token for 1)."""
    return tokens_per_step / cost


def predicted_speedup(alpha: float, gamma: float, draft_cost: float, verify_cost: float) -> float:
    """The seed's formula: (1 - alpha^(gamma+1)) / ((1 - alpha)(gamma c + v))."""
    return speedup(expected_tokens_per_step(alpha, gamma), step_cost(gamma, draft_cost, verify_cost))


def predicted_speedups(per_position_acceptance: list[float], draft_cost: float, verify_cost: list[float]
                       ) -> list[float]:
    """[gamma - 1]: the predicted speedup of drafting gamma tokens per step, for gamma = 1 .. len(verify_cost) - 1
    (and no further than the positions measured). verify_cost[n]: plain steps for verifying n drafted tokens plus
    the pending one (an MoE's union cost, or a dense model's cost by width)."""
    gammas = range(1, min(len(verify_cost) - 1, len(per_position_acceptance)) + 1)
    return [speedup(tokens_per_step_by_position(per_position_acceptance, gamma),
                    step_cost(gamma, draft_cost, verify_cost[gamma])) for gamma in gammas]


def break_even_tokens_per_step(gamma: float, draft_cost: float, verify_cost: float) -> float:
    """The mean tokens per step below which speculation is slower than plain decode (a speedup of 1): gamma c + v."""
    return step_cost(gamma, draft_cost, verify_cost)
