"""Planted bugs in a tree engine's sampled steps, for the negative controls of the exactness tests: tree rules
that break the sibling rule (same signature as speculative/tree.py's `accept_tree`, set as an engine's
`decoder.tree_rule`), and repetition penalties that ignore the tree's ancestry (patched into runtime/batch.py)."""

from __future__ import annotations

from collections.abc import Callable

import pytest
import torch

import specdeploy.runtime.batch as batch_module
from specdeploy.decoding.repetition_penalty import seen_after_drafts
from specdeploy.decoding.sampling import Randomness, sample, uniform
from specdeploy.speculative.tree import TreeAcceptance, TreeShape, _earlier_siblings, _result, _walk, tree_tensors

TreeRule = Callable[[TreeShape, torch.Tensor, torch.Tensor, torch.Tensor, Randomness], TreeAcceptance]


def planted_tree_rule(renormalise: bool = True, one_uniform: bool = False) -> TreeRule:
    """`accept_tree` with a planted bug. renormalise False: child c is accepted with p(c), not with p(c) over
    1 - the mass of its rejected siblings. one_uniform: the children of a node share one uniform instead of one
    each. Both (True, False) is the exact rule."""

    def rule(tree: TreeShape, node_tokens: torch.Tensor, target_probs: torch.Tensor, counts: torch.Tensor,
             randomness: Randomness) -> TreeAcceptance:
        batch, width = node_tokens.shape
        device = node_tokens.device
        shape = tree_tensors(tree, batch, width, device)
        parents = shape.parents
        valid = torch.arange(width, device=device)[None, :] < counts[:, None]
        tokens = torch.where(valid, node_tokens, 0)
        rows = torch.arange(batch, device=device)
        p_of_x = target_probs[rows[:, None], parents].gather(-1, tokens[..., None]).squeeze(-1)
        earlier, repeated = _earlier_siblings(parents, tokens)
        first = valid & ~repeated
        removed = ((earlier & first[:, None, :]) * p_of_x[:, None, :]).sum(-1)
        if not renormalise:
            removed = torch.zeros_like(removed)
        r = uniform((batch, width), randomness, device)
        if one_uniform:  # every node takes its eldest sibling's uniform
            eldest = (parents[:, :, None] == parents[:, None, :]).float().argmax(-1)
            r = r.gather(1, eldest)
        acceptable = first & (p_of_x > 0) & (r * (1 - removed).clamp(min=0) <= p_of_x)
        path, final_node = _walk(shape, acceptable)
        final_p = target_probs[rows, final_node]
        children = valid & (parents == final_node[:, None])
        residual = final_p.masked_fill(torch.zeros_like(final_p).scatter_add_(-1, tokens, children.float()) > 0, 0)
        mass = residual.sum(-1, keepdim=True)
        residual = torch.where(mass > 0, residual / mass.clamp(min=1e-30), final_p)
        return _result(node_tokens, path, sample(residual, randomness))

    return rule


def penalty_as_a_chain(seen: torch.Tensor, drafted: torch.Tensor, ancestry: torch.Tensor | None = None):
    """Planted: the tree's ancestry dropped, so node i's penalty sees every node before it in verify order
    (siblings and other branches too), as if the tree were a chain."""
    return seen_after_drafts(seen, drafted, None)


def penalty_without_drafts(seen: torch.Tensor, drafted: torch.Tensor, ancestry: torch.Tensor | None = None):
    """Planted: every verified position is penalised over the committed context only, not its path's drafts."""
    return seen[None].expand(drafted.shape[0] + 1, -1)


PENALTY_BUGS = {"penalty_as_a_chain": penalty_as_a_chain, "penalty_without_drafts": penalty_without_drafts}


def plant_penalty_bug(monkeypatch: pytest.MonkeyPatch, name: str) -> None:
    """Make the verify's repetition penalty (runtime/batch.py) one of PENALTY_BUGS for the rest of the test."""
    monkeypatch.setattr(batch_module, "seen_after_drafts", PENALTY_BUGS[name])
