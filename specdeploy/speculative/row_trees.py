"""Token trees per row of a batch: Medusa's fixed tree (the same shape in every row, capped per row by its depth),
or the tree EAGLE grows anew for each row at each step.

A row's tree hangs below its pending token (verify index 0); node i (verify index i + 1) follows its parent, and
parents come before children. Rows with fewer nodes are padded: a padded node hangs below the root and is never
valid (the rules mask everything past a row's count).
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from specdeploy.models.device_transfer import from_host
from specdeploy.spec.token_tree import TokenTree


@dataclass
class RowTrees:
    """parents[r][i]: the verify index of row r's node i's parent (host lists, one per row, each its own length)."""

    parents: list[list[int]]
    # `tensors`' result per device, kept: Medusa proposes the same few shapes at every step
    made: dict[str, TreeTensors] = field(default_factory=dict, repr=False, compare=False)

    @staticmethod
    def of(tree: TokenTree, counts: list[int]) -> RowTrees:
        """Every row's tree is `tree`'s first counts[r] nodes."""
        return RowTrees([list(tree.parents[:count]) for count in counts])

    @property
    def counts(self) -> list[int]:
        return [len(row) for row in self.parents]

    @property
    def width(self) -> int:
        """Verify positions of the widest row: its nodes and the root."""
        return max(self.counts, default=0) + 1

    def depths(self, row: int) -> list[int]:
        """Depth of each of row `row`'s verify indices (the root's is 0)."""
        depths = [0]
        for parent in self.parents[row]:
            depths.append(depths[parent] + 1)
        return depths

    def max_depth(self, row: int) -> int:
        return max(self.depths(row))

    def ancestry(self, row: int) -> list[list[bool]]:
        """[W][W] over row `row`'s verify indices (padded to the batch's width): [i][j] is True when j is i or one
        of its ancestors; a padded index sees only the root and itself."""
        width = self.width
        rows = [[i == j for j in range(width)] for i in range(width)]
        for i, parent in enumerate(self.parents[row], start=1):
            rows[i] = [own or inherited for own, inherited in zip(rows[i], rows[parent])]
        for i in range(len(self.parents[row]) + 1, width):
            rows[i][0] = True
        return rows

    def tensors(self, device: torch.device | str) -> TreeTensors:
        """The batch's shape as device tensors (one host-to-device copy each; made once per device)."""
        if str(device) in self.made:
            return self.made[str(device)]
        width = self.width
        parents = [row + [0] * (width - 1 - len(row)) for row in self.parents]
        depths = [self.depths(r) + [1] * (width - 1 - len(self.parents[r])) for r in range(len(self.parents))]
        made = self.made[str(device)] = TreeTensors(
            parents=from_host(parents, device, torch.long).view(len(parents), width - 1),
            depths=from_host(depths, device, torch.long).view(len(depths), width),
            ancestry=from_host([self.ancestry(r) for r in range(len(self.parents))], device,
                               torch.bool).view(len(parents), width, width),
            max_depth=max((self.max_depth(r) for r in range(len(self.parents))), default=0))
        return made


@dataclass
class TreeTensors:
    """parents [B, N] long (verify index of each node's parent); depths [B, N + 1] long; ancestry [B, N + 1, N + 1]
    bool (see RowTrees.ancestry); max_depth: the deepest node of any row."""

    parents: torch.Tensor
    depths: torch.Tensor
    ancestry: torch.Tensor
    max_depth: int

    def select(self, rows: torch.Tensor) -> TreeTensors:
        """The shapes of rows `rows` [R] (device indices) only."""
        return TreeTensors(self.parents[rows], self.depths[rows], self.ancestry[rows], self.max_depth)
