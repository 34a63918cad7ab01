"""Statistical tests of the tree rule (Medusa): every emitted token is distributed as the target's distribution at
its node, for any tree and any proposed tokens - with power.

The harness fixes one target distribution per verify index (the root, then each node: what the target gives after
the path to that node) and runs `accept_tree` over N independent trials in one batched call. The first emitted
token must follow the root's distribution in every trial; among the trials whose accepted path went through node i,
the next emitted token must follow node i's distribution. Each is checked with test_acceptance_distribution's
goodness-of-fit test (tests/helpers/goodness_of_fit.py: chi-square, total-variation bound, zero-probability check).
The same harness must reject four broken rules: trying siblings against p instead of p with the rejected ones
removed, siblings sharing one uniform (both helpers/planted_bugs.py), sampling the fallback from p instead of p',
and Medusa's typical acceptance (lossy by design).
"""

from __future__ import annotations

import pytest
import torch
from helpers.goodness_of_fit import MIN_SAMPLES, PositionCheck, goodness_of_fit_counts
from helpers.planted_bugs import planted_tree_rule

from specdeploy.decoding.sampling import SamplingParams, sample, sampling_distribution
from specdeploy.spec.token_tree import TokenTree
from specdeploy.speculative.tree import (
    _result,
    accept_tree,
    accept_tree_greedy,
    accept_tree_typical,
)

N_TRIALS = 100_000
CHAIN = [[0], [0, 0], [0, 0, 0]]
WIDE = [[0], [1], [2], [3]]
MIXED = [[0], [1], [2], [0, 0], [0, 1], [1, 0], [0, 0, 0], [0, 0, 1], [0, 1, 0]]

pytestmark = pytest.mark.usefixtures("single_thread")


# ---------------------------------------------------------------------------------------------------------------
# Harness
# ---------------------------------------------------------------------------------------------------------------


def target_distributions(tree: TokenTree, vocab: int, seed: int, params: SamplingParams | None = None,
                         scale: float = 1.5) -> torch.Tensor:
    """[N + 1, V]: one random distribution per verify index, optionally through temperature / top-k / top-p."""
    logits = torch.randn(tree.size + 1, vocab, generator=torch.Generator().manual_seed(seed)) * scale
    if params is None:
        return torch.softmax(logits, -1)
    return sampling_distribution(logits, params)


def proposals(tree: TokenTree, p: torch.Tensor, kind: str, n: int, seed: int) -> torch.Tensor:
    """[n, N] proposed tokens. random: uniform, independently per node (siblings repeat each other at times);
    ranked: node [.., k] proposes its parent distribution's k-th likeliest token (distinct siblings, Medusa-like);
    unlikely: the parent's least likely tokens (zero-probability ones under top-k / top-p)."""
    generator = torch.Generator().manual_seed(seed + 1)
    vocab = p.shape[1]
    if kind == "random":
        return torch.randint(vocab, (n, tree.size), generator=generator)
    order = p.argsort(-1, descending=kind == "ranked")  # [N + 1, V]
    tokens = [int(order[parent, path[-1] % vocab]) for parent, path in zip(tree.parents, tree.paths)]
    return torch.tensor(tokens).expand(n, -1).clone()


def run(accept_fn, tree: TokenTree, p: torch.Tensor, node_tokens: torch.Tensor, seed: int = 0):
    n = node_tokens.shape[0]
    counts = torch.full((n,), tree.size, dtype=torch.long)
    return accept_fn(tree, node_tokens, p[None].expand(n, -1, -1), counts, torch.Generator().manual_seed(seed))


def checks(tree: TokenTree, p: torch.Tensor, result) -> list[PositionCheck]:
    """The first token against the root's distribution; after each node, the next token against the node's."""
    vocab = p.shape[1]
    found = [goodness_of_fit_counts(torch.bincount(result.tokens[:, 0], minlength=vocab), p[0], position=0)]
    for index, path in enumerate(tree.paths, start=1):
        depth = len(path)
        through = result.path[:, depth - 1] == index
        next_tokens = result.tokens[through, depth]
        if (next_tokens < 0).any():
            return [PositionCheck(index, int(through.sum()), -1, 0.0, 1.0, 0.0)]  # a token is missing
        found.append(goodness_of_fit_counts(torch.bincount(next_tokens, minlength=vocab), p[index], position=index))
    return found


def assert_exact(tree: TokenTree, p: torch.Tensor, result, min_tested: int = 2) -> None:
    found = checks(tree, p, result)
    report = "\n".join(str(check) for check in found)
    assert all(check.ok for check in found), f"emitted tokens are not distributed as the target's:\n{report}"
    assert sum(check.n >= MIN_SAMPLES for check in found) >= min_tested, report


def assert_well_formed(tree: TokenTree, node_tokens: torch.Tensor, result) -> None:
    """The accepted path descends parent to child, its tokens are the nodes' tokens, then one final token."""
    depth = result.path.shape[1]
    accepted = result.num_accepted
    for level in range(depth):
        on = result.path[:, level] >= 0
        assert torch.equal(on, accepted > level)
        nodes = result.path[on, level]
        parents = torch.tensor((0,) + tree.parents)[nodes]
        expected_parent = result.path[on, level - 1] if level else torch.zeros_like(nodes)
        assert torch.equal(parents, expected_parent)
        assert torch.equal(result.tokens[on, level], node_tokens[on].gather(1, (nodes - 1)[:, None]).squeeze(1))
    rows = torch.arange(len(accepted))
    assert bool((result.tokens[rows, accepted] >= 0).all())
    after = torch.arange(depth + 1)[None, :] > accepted[:, None]
    assert bool((result.tokens[after] == -1).all())


# ---------------------------------------------------------------------------------------------------------------
# The exact rule
# ---------------------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("choices", [CHAIN, WIDE, MIXED], ids=["chain", "wide", "mixed"])
@pytest.mark.parametrize("kind", ["random", "ranked", "unlikely"])
def test_tree_rule_preserves_the_target_distribution(choices, kind):
    tree = TokenTree.from_choices(choices)
    p = target_distributions(tree, vocab=8, seed=len(choices))
    node_tokens = proposals(tree, p, kind, N_TRIALS, seed=3)
    result = run(accept_tree, tree, p, node_tokens)
    assert_well_formed(tree, node_tokens, result)
    assert_exact(tree, p, result, min_tested=1 if kind == "unlikely" else 3)


@pytest.mark.parametrize("params", [SamplingParams(temperature=0.7, top_k=3), SamplingParams(temperature=1.3,
                                                                                             top_p=0.6)],
                         ids=["top_k", "top_p"])
@pytest.mark.parametrize("kind", ["random", "ranked"])
def test_tree_rule_with_top_k_and_top_p(params, kind):
    """Processed distributions have zeros: a proposed token the target cannot emit is never accepted."""
    tree = TokenTree.from_choices(MIXED)
    p = target_distributions(tree, vocab=10, seed=5, params=params, scale=2.0)
    node_tokens = proposals(tree, p, kind, N_TRIALS, seed=7)
    result = run(accept_tree, tree, p, node_tokens)
    assert_well_formed(tree, node_tokens, result)
    assert_exact(tree, p, result)


def test_adversarial_point_masses():
    """A root that is a point mass on its second child's token: the first child is always rejected, the second
    always accepted."""
    tree = TokenTree.from_choices(WIDE)
    p = target_distributions(tree, vocab=6, seed=1)
    p[0] = torch.nn.functional.one_hot(torch.tensor(4), 6).float()
    node_tokens = torch.tensor([[1, 4, 4, 2]]).expand(20_000, -1).clone()
    result = run(accept_tree, tree, p, node_tokens)
    assert bool((result.path[:, 0] == 2).all())
    assert_exact(tree, p, result)


def test_rows_with_fewer_nodes_use_only_theirs():
    """A row verifying the first nodes_up_to(1) nodes (its proposal capped at depth 1) never walks deeper; rows
    without a tree sample the root's distribution."""
    tree = TokenTree.from_choices(MIXED)
    p = target_distributions(tree, vocab=8, seed=2)
    n = 60_000
    node_tokens = proposals(tree, p, "ranked", n, seed=1)
    counts = torch.tensor([0, tree.nodes_up_to(1), tree.size]).repeat(n // 3)
    result = accept_tree(tree, node_tokens, p[None].expand(n, -1, -1), counts, torch.Generator().manual_seed(0))
    assert bool((result.num_accepted[0::3] == 0).all()) and bool((result.num_accepted[1::3] <= 1).all())
    assert int(result.num_accepted[2::3].max()) == 3
    for start in range(3):
        rows = slice(start, None, 3)
        part = type(result)(tokens=result.tokens[rows], num_accepted=result.num_accepted[rows],
                            path=result.path[rows])
        assert_exact(tree, p, part, min_tested=1)


def test_greedy_walk_keeps_the_argmax_child():
    tree = TokenTree.from_choices(MIXED)
    # verify indices: 0 root, 1 [0], 2 [1], 3 [2], 4 [0,0], 5 [0,1], 6 [1,0], 7 [0,0,0], 8 [0,0,1], 9 [0,1,0]
    node_tokens = torch.tensor([[5, 6, 7, 10, 11, 12, 13, 14, 15]])
    target = torch.tensor([[6, 20, 12, 30, 40, 50, 60, 70, 80, 90]])  # root → [1] (6) → [1,0] (12) → leaf: 60
    result = accept_tree_greedy(tree, node_tokens, target, torch.tensor([tree.size]))
    assert result.path.tolist() == [[2, 6, -1]] and result.tokens.tolist() == [[6, 12, 60, -1]]
    target = torch.tensor([[5, 11, 12, 30, 40, 99, 60, 70, 80, 90]])  # root → [0] (5) → [0,1] (11) → 99, not 15
    result = accept_tree_greedy(tree, node_tokens, target, torch.tensor([tree.size]))
    assert result.path.tolist() == [[1, 5, -1]] and result.tokens.tolist() == [[5, 11, 99, -1]]


def test_greedy_equals_the_exact_rule_on_point_masses():
    tree = TokenTree.from_choices(MIXED)
    generator = torch.Generator().manual_seed(4)
    node_tokens = torch.randint(4, (500, tree.size), generator=generator)
    target_tokens = torch.randint(4, (500, tree.size + 1), generator=generator)
    probs = torch.nn.functional.one_hot(target_tokens, 4).float()
    counts = torch.full((500,), tree.size)
    exact = accept_tree(tree, node_tokens, probs, counts, torch.Generator().manual_seed(0))
    greedy = accept_tree_greedy(tree, node_tokens, target_tokens, counts)
    assert torch.equal(exact.tokens, greedy.tokens) and torch.equal(exact.path, greedy.path)


def test_seeded_draws_repeat():
    tree = TokenTree.from_choices(MIXED)
    p = target_distributions(tree, vocab=8, seed=9)
    node_tokens = proposals(tree, p, "random", 1000, seed=2)
    first, second = (run(accept_tree, tree, p, node_tokens, seed=11) for _ in range(2))
    assert torch.equal(first.tokens, second.tokens)


def test_choices_are_validated_and_ordered():
    tree = TokenTree.from_choices([[1, 0], [0], [1], [0, 0]])
    assert tree.paths == ((0,), (1,), (0, 0), (1, 0)) and tree.parents == (0, 0, 1, 2)
    assert tree.nodes_up_to(1) == 2 and tree.depth == 2 and tree.depths() == [0, 1, 1, 2, 2]
    ancestry = tree.ancestry
    assert ancestry[4] == (True, False, True, False, True)  # [1, 0] sees the root, [1] and itself
    for bad, message in [([[0], [0]], "twice"), ([[0, 1]], "no parent"), ([[]], "non-empty"), ([[-1]], "≥ 0")]:
        with pytest.raises(ValueError, match=message):
            TokenTree.from_choices(bad)


# ---------------------------------------------------------------------------------------------------------------
# Power: broken rules the same harness must reject
# ---------------------------------------------------------------------------------------------------------------


def fallback_from_p(tree, node_tokens, target_probs, counts, generator):
    """Broken: the exact walk, but the token after rejecting every child is sampled from p, not p'."""
    exact = accept_tree(tree, node_tokens, target_probs, counts, generator)
    final_node = torch.cat([torch.zeros(len(counts), 1, dtype=torch.long), exact.path], 1).max(-1).values
    final = sample(target_probs[torch.arange(len(counts)), final_node], generator)
    return _result(node_tokens, exact.path, final)


@pytest.mark.parametrize("broken", [planted_tree_rule(renormalise=False), planted_tree_rule(one_uniform=True),
                                    fallback_from_p, accept_tree_typical],
                         ids=["siblings_against_p", "siblings_share_one_uniform", "fallback_from_p",
                              "typical_acceptance"])
def test_broken_rules_are_detected(broken):
    tree = TokenTree.from_choices(MIXED)
    p = target_distributions(tree, vocab=8, seed=len(MIXED))
    node_tokens = proposals(tree, p, "ranked", N_TRIALS, seed=3)
    assert all(check.ok for check in checks(tree, p, run(accept_tree, tree, p, node_tokens)))
    found = checks(tree, p, run(broken, tree, p, node_tokens))
    assert not all(check.ok for check in found), "\n".join(str(check) for check in found)
