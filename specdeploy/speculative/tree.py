"""The exact acceptance rule for token trees of one-hot proposals (Medusa's fixed tree, EAGLE's grown one); the
trees' shapes, one per row, are speculative/row_trees.py.

Acceptance, exact at any temperature (`accept_tree`): at a node with target distribution p, its children are tried
in order, each as a one-hot proposal: child c is accepted with probability p'(c), where p' is p with the already
rejected siblings removed and renormalised; an accepted child is descended into; when every child is rejected the
token is sampled from p' (all children removed), and at a leaf from p. Each emitted token is therefore distributed
exactly as the target's distribution at its position. Every uniform a row may need is drawn up front (one per
node), so the walk runs on the device with no host sync.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from specdeploy.decoding.sampling import Randomness, sample, uniform
from specdeploy.spec.token_tree import TokenTree
from specdeploy.speculative.acceptance import AcceptanceResult
from specdeploy.speculative.row_trees import RowTrees, TreeTensors


@dataclass
class TreeAcceptance(AcceptanceResult):
    path: torch.Tensor  # [B, depth] long: verify indices of the accepted nodes, -1 after


TreeShape = TokenTree | TreeTensors  # one shape for every row, or each row's own


def tree_tensors(tree: TreeShape, batch: int, width: int, device: torch.device | str) -> TreeTensors:
    """The shape of each of `batch` rows with `width` node slots: a TokenTree's first `width` nodes in every row."""
    if isinstance(tree, TreeTensors):
        return tree
    one = RowTrees([list(tree.parents[:width])]).tensors(device)  # one row's, broadcast (trials: 10⁵ rows)
    return TreeTensors(one.parents.expand(batch, -1), one.depths.expand(batch, -1),
                       one.ancestry.expand(batch, -1, -1), one.max_depth)


def accept_tree(tree: TreeShape, node_tokens: torch.Tensor, target_probs: torch.Tensor, counts: torch.Tensor,
                randomness: Randomness) -> TreeAcceptance:
    """The exact rule over a batch of trees (the module docstring).

    tree: one shape for every row (a TokenTree of at least N nodes), or each row's (TreeTensors of N nodes).
    node_tokens: [B, N] long: row r proposes node i's token node_tokens[r, i] for i < counts[r].
    target_probs: [B, N + 1, V]: the target's sampling distribution at each verify index (root, then nodes).
    counts: [B] long. randomness: one generator, or one stream per row drawing counts[r] uniforms and one noise row.
    """
    batch, width = node_tokens.shape
    device = node_tokens.device
    shape = tree_tensors(tree, batch, width, device)
    parents = shape.parents  # [B, N]
    valid = torch.arange(width, device=device)[None, :] < counts[:, None]  # [B, N]
    tokens = torch.where(valid, node_tokens, 0)
    rows = torch.arange(batch, device=device)
    p_parent = target_probs[rows[:, None], parents]  # [B, N, V]: the distribution each node's token is judged by
    p_of_x = p_parent.gather(-1, tokens[..., None]).squeeze(-1)  # [B, N]
    earlier, repeated = _earlier_siblings(parents, tokens)  # [B, N, N], [B, N]
    first = valid & ~repeated  # a token's first proposal among its siblings
    removed = ((earlier & first[:, None, :]) * p_of_x[:, None, :]).sum(-1)  # [B, N]: mass rejected before
    r = uniform((batch, width), randomness, device)
    acceptable = first & (p_of_x > 0) & (r * (1 - removed).clamp(min=0) <= p_of_x)
    path, final_node = _walk(shape, acceptable)
    final_p = target_probs[rows, final_node]  # [B, V]
    # Every child of the final node was rejected (or it has none): sample from p with the children removed.
    children = valid & (parents == final_node[:, None])  # [B, N]
    removed_tokens = torch.zeros_like(final_p).scatter_add_(-1, tokens, children.to(final_p.dtype)) > 0
    residual = final_p.masked_fill(removed_tokens, 0.0)
    mass = residual.sum(-1, keepdim=True)
    residual = torch.where(mass > 0, residual / mass.clamp(min=1e-30), final_p)
    return _result(node_tokens, path, sample(residual, randomness))


def accept_tree_greedy(tree: TreeShape, node_tokens: torch.Tensor, target_tokens: torch.Tensor,
                       counts: torch.Tensor) -> TreeAcceptance:
    """`accept_tree` for point masses, from the target's token at each verify index (target_tokens [B, N + 1]):
    walk the children equal to the target's token, then emit the target's token at the last node reached."""
    batch, width = node_tokens.shape
    shape = tree_tensors(tree, batch, width, node_tokens.device)
    valid = torch.arange(width, device=node_tokens.device)[None, :] < counts[:, None]
    acceptable = valid & (node_tokens == target_tokens.gather(1, shape.parents))
    path, final_node = _walk(shape, acceptable)
    rows = torch.arange(node_tokens.shape[0], device=node_tokens.device)
    return _result(node_tokens, path, target_tokens[rows, final_node])


def _earlier_siblings(parents: torch.Tensor, tokens: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """parents, tokens: [B, N]. earlier [B, N, N]: j is a sibling tried before i. repeated [B, N]: node i's token
    was proposed by an earlier sibling (its mass is already removed, so it can only be rejected)."""
    width = parents.shape[1]
    order = torch.arange(width, device=parents.device)
    earlier = (parents[:, :, None] == parents[:, None, :]) & (order[None, :] < order[:, None])
    repeated = (earlier & (tokens[:, :, None] == tokens[:, None, :])).any(-1)
    return earlier, repeated


def _walk(shape: TreeTensors, acceptable: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """From the root, descend into each node's first acceptable child. Returns the path [B, depth] (verify
    indices, -1 after the last accepted node) and the verify index of the last node reached [B]."""
    batch, width = acceptable.shape
    device = acceptable.device
    parents, depth = shape.parents, shape.max_depth
    path = torch.full((batch, depth), -1, dtype=torch.long, device=device)
    node = torch.zeros(batch, dtype=torch.long, device=device)
    order = torch.arange(width, 0, -1, device=device)  # argmax of candidates * order picks the first candidate
    for level in range(depth):
        candidates = acceptable & (parents == node[:, None])
        found = candidates.any(-1)
        child = (candidates * order).argmax(-1) + 1
        node = torch.where(found, child, node)
        path[:, level] = torch.where(found, child, -1)
    return path, node


def _result(node_tokens: torch.Tensor, path: torch.Tensor, final_token: torch.Tensor) -> TreeAcceptance:
    """tokens [B, depth + 1]: the accepted nodes' tokens, the final token, then -1."""
    batch, depth = path.shape
    accepted = (path >= 0).long().sum(-1)
    padded = torch.cat([torch.zeros(batch, 1, dtype=node_tokens.dtype, device=node_tokens.device), node_tokens], 1)
    tokens = torch.full((batch, depth + 1), -1, dtype=torch.long, device=node_tokens.device)
    tokens[:, :depth] = torch.where(path >= 0, padded.gather(1, path.clamp(min=0)), -1)
    tokens[torch.arange(batch, device=node_tokens.device), accepted] = final_token
    return TreeAcceptance(tokens=tokens, num_accepted=accepted, path=path)


def accept_tree_typical(tree: TreeShape, node_tokens: torch.Tensor, target_probs: torch.Tensor,
                        counts: torch.Tensor, randomness: Randomness, threshold: float = 0.09,
                        alpha: float = 0.3) -> TreeAcceptance:
    """LOSSY: Medusa's typical acceptance, not exact. A child is accepted when the target gives its token more than
    min(threshold, alpha * exp(-entropy of p)); the first such child is descended into, and the last node's token is
    sampled from p. More tokens are accepted than under `accept_tree`, and the emitted text is no longer distributed
    as the target's (a test shows it). Off unless a pipeline asks for it."""
    batch, width = node_tokens.shape
    shape = tree_tensors(tree, batch, width, node_tokens.device)
    valid = torch.arange(width, device=node_tokens.device)[None, :] < counts[:, None]
    p_parent = target_probs[torch.arange(batch, device=node_tokens.device)[:, None], shape.parents]  # [B, N, V]
    p_of_x = p_parent.gather(-1, torch.where(valid, node_tokens, 0)[..., None]).squeeze(-1)
    entropy = -(p_parent * p_parent.clamp(min=1e-30).log()).sum(-1)
    acceptable = valid & (p_of_x > torch.minimum(torch.full_like(entropy, threshold), alpha * torch.exp(-entropy)))
    path, final_node = _walk(shape, acceptable)
    rows = torch.arange(node_tokens.shape[0], device=node_tokens.device)
    return _result(node_tokens, path, sample(target_probs[rows, final_node], randomness))
