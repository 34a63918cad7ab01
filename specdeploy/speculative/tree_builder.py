"""Choosing a Medusa tree for a model on a machine, from measured head accuracies and measured verify costs.

rank_accuracy[d][i]: the probability that head d's i-th most likely token is the target's token at depth d + 1
(from held-out answers: top-(i+1) minus top-i accuracy). Treating depths as independent, a node whose path is
(i_0, ..., i_{d-1}) is accepted with probability prod_j rank_accuracy[j][i_j], and the expected number of accepted
drafted tokens in a step is the sum of that over the tree's nodes (greedy acceptance walks one path). A step emits
one more token than it accepts and costs verify_cost[n] plain decode steps for n nodes (the cost of verifying
n + 1 positions, measured) plus head_cost. The tree is grown greedily, adding the candidate node (the next rank
below the root or below a node already in the tree) that most increases the expected tokens per unit of cost,
and the best tree seen while growing it is kept.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class TreeChoice:
    choices: list[list[int]]  # medusa_choices, ordered by depth then path
    expected_accepted: float  # expected accepted drafted tokens per step
    cost: float  # plain decode steps per step
    predicted_speedup: float  # (1 + expected_accepted) / cost


def node_probability(path: tuple[int, ...], rank_accuracy: list[list[float]]) -> float:
    probability = 1.0
    for depth, rank in enumerate(path):
        probability *= rank_accuracy[depth][rank] if rank < len(rank_accuracy[depth]) else 0.0
    return probability


def expected_accepted(paths: list[tuple[int, ...]], rank_accuracy: list[list[float]]) -> float:
    return sum(node_probability(path, rank_accuracy) for path in paths)


def build_tree(rank_accuracy: list[list[float]], verify_cost: list[float], head_cost: float = 0.0,
               max_nodes: int | None = None) -> TreeChoice:
    """The tree (see the module docstring). verify_cost[n]: plain steps for verifying n nodes plus the pending
    token (verify_cost[0] is a plain step, 1.0); max_nodes: at most this many nodes (default: what was measured)."""
    limit = len(verify_cost) - 1 if max_nodes is None else min(max_nodes, len(verify_cost) - 1)
    depth = len(rank_accuracy)

    def choice(paths: list[tuple[int, ...]]) -> TreeChoice:
        accepted = expected_accepted(paths, rank_accuracy)
        cost = verify_cost[len(paths)] + (head_cost if paths else 0.0)
        ordered = sorted(paths, key=lambda p: (len(p), p))
        return TreeChoice([list(p) for p in ordered], accepted, cost, (1 + accepted) / cost)

    paths: list[tuple[int, ...]] = []
    best = choice(paths)
    while len(paths) < limit:
        # candidates: the next unused rank below the root and below every node (deeper only while heads remain)
        parents = [()] + [p for p in paths if len(p) < depth]
        candidates = []
        for parent in parents:
            used = {p[-1] for p in paths if len(p) == len(parent) + 1 and p[:-1] == parent}
            rank = next(r for r in range(len(rank_accuracy[len(parent)]) + 1) if r not in used)
            if rank < len(rank_accuracy[len(parent)]):
                candidates.append(parent + (rank,))
        if not candidates:
            break
        gained = max(candidates, key=lambda c: node_probability(c, rank_accuracy))
        if node_probability(gained, rank_accuracy) <= 0:
            break
        paths.append(gained)
        current = choice(paths)
        if current.predicted_speedup > best.predicted_speedup:
            best = current
    return best
