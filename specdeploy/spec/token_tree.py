"""The shape of a token tree (Medusa), torch-free so the pipeline can validate one.

A tree hangs below the pending token (the root, verify index 0). Node i (verify index i + 1) is named by its path
of top-k indices, TensorRT-LLM's `medusa_choices` format: [0] is the first head's best token, [0, 1] the second
head's second-best token below it. Nodes are ordered by depth, then path, so ancestors come before descendants,
and the nodes of depth <= d are a prefix: a row whose proposal is capped at depth d verifies the first
`nodes_up_to(d)` nodes.
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import cached_property


@dataclass(frozen=True)
class TokenTree:
    paths: tuple[tuple[int, ...], ...]  # node i's path of top-k indices; depth = len(path)
    parents: tuple[int, ...]  # node i's parent's verify index (0: the root)

    @staticmethod
    def from_choices(choices: list[list[int]]) -> TokenTree:
        """A tree from `medusa_choices`; ValueError names a path that is empty, negative, repeated or whose parent
        is missing."""
        paths = sorted({tuple(path) for path in choices}, key=lambda path: (len(path), path))
        if len(paths) != len(choices):
            raise ValueError("medusa_choices: a path is listed twice")
        index = {path: i for i, path in enumerate(paths)}
        parents = []
        for path in paths:
            if not path or min(path) < 0:
                raise ValueError(f"medusa_choices: {list(path)}: a path is a non-empty list of top-k indices ≥ 0")
            if len(path) > 1 and path[:-1] not in index:
                raise ValueError(f"medusa_choices: {list(path)} has no parent {list(path[:-1])} in the tree")
            parents.append(0 if len(path) == 1 else index[path[:-1]] + 1)
        return TokenTree(tuple(paths), tuple(parents))

    @property
    def size(self) -> int:
        return len(self.paths)

    @property
    def depth(self) -> int:
        return max((len(path) for path in self.paths), default=0)

    def nodes_up_to(self, depth: int) -> int:
        """How many nodes have depth <= depth (they are the first ones)."""
        return sum(len(path) <= depth for path in self.paths)

    def depths(self) -> list[int]:
        """Depth of each verify index: 0 for the root, then each node's."""
        return [0] + [len(path) for path in self.paths]

    @cached_property
    def ancestry(self) -> tuple[tuple[bool, ...], ...]:
        """[N + 1][N + 1] over verify indices: entry [i][j] is True when j is i or one of its ancestors (what
        position i may attend to among the tree's positions)."""
        rows = [[j == i for j in range(self.size + 1)] for i in range(self.size + 1)]
        for i, parent in enumerate(self.parents, start=1):
            rows[i] = [own or inherited for own, inherited in zip(rows[i], rows[parent])]
        return tuple(tuple(row) for row in rows)
