"""How a step's drafts are laid out for the verify: a chain, or a token tree per row. One verify (runtime/batch.py)
asks its shape for the forward and the rules, so a chain is the tree whose node i follows node i - 1, verified
with a causal forward (and, for an early exit, resumed after the draft's layers) and by speculative sampling's rule,
whose drafts may carry their distributions q; a tree's nodes are deterministic proposals, verified under the tree
mask by the tree rules."""

from __future__ import annotations

from collections.abc import Callable

import torch

from specdeploy.models.kv_cache import KVCache
from specdeploy.models.llama import Forward, LlamaModel, ragged_forward_all, tree_forward_all
from specdeploy.speculative.acceptance import AcceptanceResult, accept, accept_greedy
from specdeploy.speculative.proposer import Proposal
from specdeploy.speculative.row_trees import TreeTensors
from specdeploy.speculative.tree import accept_tree_greedy


class ChainShape:
    """Row r's drafts are a chain: each position sees the context and the drafts before it."""

    ancestry = None  # the causal mask says it; nothing for the repetition penalty to walk

    def __init__(self, proposal: Proposal) -> None:
        self.proposal = proposal

    def forward(self, target: LlamaModel, cache: KVCache, tokens: torch.Tensor, starts: list[int],
                lengths: list[int], capture: tuple[int, ...]) -> Forward:
        return ragged_forward_all(target, cache, tokens, starts, lengths, self.proposal.resume, capture)

    def accept_greedy(self, rows: torch.Tensor, drafted: torch.Tensor, target_tokens: torch.Tensor,
                      num_drafted: torch.Tensor) -> AcceptanceResult:
        return accept_greedy(drafted, target_tokens, num_drafted)

    def accept_sampled(self, rows: torch.Tensor, drafted: torch.Tensor, target_probs: torch.Tensor,
                       num_drafted: torch.Tensor, streams) -> AcceptanceResult:
        q = self.proposal.q
        draft_probs = None if q is None else q[rows, :target_probs.shape[1] - 1]
        return accept(drafted, draft_probs, target_probs, num_drafted, streams)

    @staticmethod
    def paths(read: list[list[int]]) -> None:
        """A chain keeps its first positions: Verdict.kept says so without a path."""
        return None


class TreeShape:
    """Row r's drafts are the nodes of its token tree (Proposal.tree): each node sees the context and its
    ancestors. sampled_rule: the tree rule for sampled rows (exact, or Medusa's typical acceptance)."""

    def __init__(self, tree: TreeTensors, sampled_rule: Callable[..., AcceptanceResult]) -> None:
        self.tree, self.sampled_rule = tree, sampled_rule
        self.ancestry = tree.ancestry

    def forward(self, target: LlamaModel, cache: KVCache, tokens: torch.Tensor, starts: list[int],
                lengths: list[int], capture: tuple[int, ...]) -> Forward:
        return tree_forward_all(target, cache, tokens, starts, self.tree.depths, self.tree.ancestry, lengths,
                                capture)

    def accept_greedy(self, rows: torch.Tensor, drafted: torch.Tensor, target_tokens: torch.Tensor,
                      num_drafted: torch.Tensor) -> AcceptanceResult:
        return accept_tree_greedy(self.tree.select(rows), drafted, target_tokens, num_drafted)

    def accept_sampled(self, rows: torch.Tensor, drafted: torch.Tensor, target_probs: torch.Tensor,
                       num_drafted: torch.Tensor, streams) -> AcceptanceResult:
        return self.sampled_rule(self.tree.select(rows), drafted, target_probs, num_drafted, streams)

    @staticmethod
    def paths(read: list[list[int]]) -> list[list[int]]:
        """Each row's kept verify indices: the root, then its accepted nodes'. A row reads [accepted count, D + 1
        tokens, D path indices]."""
        depth = (len(read[0]) - 2) // 2
        return [[0] + row[depth + 2:depth + 2 + row[0]] for row in read]
