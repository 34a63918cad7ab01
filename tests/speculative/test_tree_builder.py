"""The Medusa tree builder: nodes join in order of their acceptance probability, the tree stops growing where
another node costs more than it brings, and the expected accepted length is what greedy tree acceptance yields
(checked by simulation)."""

from __future__ import annotations

import itertools
import random

from specdeploy.spec.token_tree import TokenTree
from specdeploy.speculative.tree_builder import build_tree, expected_accepted, node_probability

ACCURACY = [[0.6, 0.15, 0.05], [0.4, 0.1, 0.05], [0.3, 0.08], [0.2]]  # head d, rank i: P(correct)


def test_free_verification_takes_the_most_probable_nodes():
    tree = build_tree(ACCURACY, [1.0] * 30)  # 29 nodes of the 48 possible
    TokenTree.from_choices(tree.choices)  # a valid tree
    inside = {tuple(c) for c in tree.choices}
    assert len(inside) == 29 and tree.choices[0] == [0]
    everything = list(itertools.product(*[range(len(a)) for a in ACCURACY]))
    every_node = {path[:d] for path in everything for d in range(1, len(ACCURACY) + 1)}
    outside = every_node - inside
    assert min(node_probability(p, ACCURACY) for p in inside) >= max(node_probability(p, ACCURACY) for p in outside)
    assert abs(tree.expected_accepted - expected_accepted(list(inside), ACCURACY)) < 1e-12


def test_costly_verification_keeps_the_tree_small():
    cheap = build_tree(ACCURACY, [1.0 + 0.01 * n for n in range(30)])
    costly = build_tree(ACCURACY, [1.0 + 0.15 * n for n in range(30)])
    none = build_tree(ACCURACY, [1.0] + [3.0] * 29)
    assert len(costly.choices) < len(cheap.choices)
    assert none.choices == [] and none.predicted_speedup == 1.0
    assert costly.predicted_speedup == (1 + costly.expected_accepted) / costly.cost


def test_expected_accepted_matches_a_simulation_of_the_greedy_walk():
    """Each step draws, per depth, which rank (if any) holds the target's token; the walk descends while the tree
    has that child."""
    tree = build_tree(ACCURACY, [1.0 + 0.02 * n for n in range(20)])
    paths = {tuple(c) for c in tree.choices}
    chooser = random.Random(0)
    total, steps = 0, 40_000
    for _ in range(steps):
        path: tuple[int, ...] = ()
        for depth in range(len(ACCURACY)):
            r, rank = chooser.random(), None
            for i, p in enumerate(ACCURACY[depth]):
                if r < p:
                    rank = i
                    break
                r -= p
            if rank is None or path + (rank,) not in paths:
                break
            path += (rank,)
        total += len(path)
    assert abs(total / steps - tree.expected_accepted) < 0.02
