"""EAGLE-3 drafting: the head of eagle_head.py grows a token tree per row from the target's own hidden states, and
the target verifies it in one forward with the exact tree rule (speculative/tree.py).

The head's own cache. Position t of a row pairs the target's features f_t (the hidden states entering three target
layers while it processed token x_t) with the embedding of x_(t+1). Once the target has committed x_0..x_n (x_n
pending, not in its cache yet), pairs t = 0..n-1 are known; the head's one-layer KV cache holds the pairs it has
run, and the features of newly committed positions wait in `pending` until the next `propose`, which runs every
row's pending pairs in one ragged forward. The output at the last pair gives the distribution of the first drafted
token (depth 1), and its pre-norm output stands in for the features below it.

Growing the tree (EAGLE-2's dynamic tree, as EAGLE-3 keeps it): the top_k tokens at depth 1 form the frontier;
each further level runs the head once on the frontier (each node attends to the committed pairs, its ancestors
and itself), takes the top_k children of each frontier node, and keeps the top_k of those k² children, by the
product of the draft probabilities along their path, as the next frontier. Of every node generated, the max_nodes
with the highest path probability (ancestors first on ties, so a chosen node's parent is always chosen) make the
row's tree, up to its gamma levels deep. Children are deterministic functions of the committed text, which is what
lets the rule of speculative/tree.py keep every emitted token distributed exactly as the target's.
"""

from __future__ import annotations

import json
from pathlib import Path

import torch

from specdeploy.decoding.sequence import Sequence
from specdeploy.models.device_transfer import from_host
from specdeploy.models.kv_cache import KVCache, write_entries
from specdeploy.models.registry import component_config
from specdeploy.spec.speculation import EAGLE_HEAD
from specdeploy.speculative.eagle_head import CONFIG_FILE, Eagle3Head, EagleConfig
from specdeploy.speculative.proposer import EngineParts, Proposal, Proposer
from specdeploy.speculative.row_trees import RowTrees

EAGLE_DIR = EAGLE_HEAD.folder  # the head's folder in an engine


class EagleProposer(Proposer):
    def __init__(self, head: Eagle3Head, embed: torch.Tensor, depth: int, top_k: int, max_nodes: int,
                 batch_size: int, max_length: int, dtype: torch.dtype, device: torch.device | str) -> None:
        """embed: the target's embedding table [V, H]. depth: levels grown (num_draft_tokens). max_length: the
        target cache's length (the head's cache adds room for the tree's scratch entries)."""
        self.head, self.embed, self.depth, self.top_k, self.max_nodes = head, embed, depth, top_k, max_nodes
        self.capture = head.config.feature_layers  # the target's states entering these layers feed the head
        self.dtype, self.device = dtype, device
        c = head.config
        length = max_length + depth * top_k + 1
        self.cache = KVCache(1, batch_size, c.num_kv_heads, length, c.head_dim, dtype, device)
        head.cover_positions(length)
        self.draft_to_target = head.draft_to_target.to(device)
        self.pending: list[list[torch.Tensor]] = [[] for _ in range(batch_size)]  # per row: [n, 3H] features
        # per row, the outputs at its last pair run (normed, prenorm): where its next tree starts
        self.root = torch.zeros(batch_size, 2, c.hidden_size, dtype=dtype, device=device)
        # What smaller trees would have accepted (bench/eagle_tree.py): per row, the last tree's tokens, parents and
        # each node's rank by path probability; over all steps, accepted nodes of rank < n (budget_hits[n]).
        self.last_tree: list[tuple[list[int], list[int], list[int]] | None] = [None] * batch_size
        self.budget_hits = [0] * (max_nodes + 1)
        self.trees = 0

    @classmethod
    def from_engine(cls, parts: EngineParts) -> EagleProposer:
        target, spec = parts.target, parts.pipeline.speculation
        head = Eagle3Head.load(parts.directory / EAGLE_DIR, target.config.num_layers).to(parts.device)
        head.for_drafting(target.dtype)
        return cls(head, target.embed, spec.num_draft_tokens, spec.eagle.top_k, spec.eagle.max_nodes,
                   parts.cache.batch_size, parts.cache.max_length, target.dtype, parts.device)

    @classmethod
    def captured_layers(cls, directory: Path) -> tuple[int, ...]:
        head = Path(directory) / EAGLE_DIR / CONFIG_FILE
        target_layers = component_config(Path(directory) / "target")[0].num_layers
        return EagleConfig.from_hf(json.loads(head.read_text()), target_layers, str(head)).feature_layers

    # ---- the decoder's hooks --------------------------------------------------------------------------------
    def prefill(self, row: int, sequence: Sequence, hidden: torch.Tensor) -> None:
        """Run the prompt's pairs but the last alone (a long prompt would pad everyone's next catch-up); the last
        waits for `propose`, so every row has at least one pending pair there."""
        self.cache.lengths[row] = 0
        count = hidden.shape[0] - 1
        if count > 0:
            tokens = from_host([sequence.committed[1:count + 1]], self.device)
            positions = torch.arange(count, device=self.device)[None]
            self._run([row], tokens, hidden[None, :count], positions, positions, self._causal(positions, count))
            self.forwards += 1
        self.cache.lengths[row] = count
        self.pending[row] = [hidden[count:]]

    def on_commit(self, row: int, sequence: Sequence, hidden: torch.Tensor) -> None:
        self.pending[row].append(hidden)
        if self.last_tree[row] is not None:
            self._count_budgets(self.last_tree[row], sequence.committed[len(sequence.committed) - len(hidden):-1])
            self.last_tree[row] = None

    def _count_budgets(self, tree: tuple[list[int], list[int], list[int]], accepted: list[int]) -> None:
        """Walk the last tree along the accepted tokens; a tree of the n best nodes would have kept the path's
        nodes of rank < n (ranks grow along a path: a node is chosen only after its parent)."""
        tokens, parents, ranks = tree
        node, path = 0, []
        for token in accepted:
            node = next((i + 1 for i, (t, p) in enumerate(zip(tokens, parents)) if p == node and t == token), None)
            if node is None:
                break
            path.append(ranks[node - 1])
        self.trees += 1
        for budget in range(1, len(self.budget_hits)):
            self.budget_hits[budget] += sum(rank < budget for rank in path)

    def move_row(self, source: int, destination: int) -> None:
        self.cache.move_row(source, destination)
        self.pending[destination] = self.pending[source]
        self.pending[source] = []
        self.root[destination] = self.root[source]
        self.last_tree[destination], self.last_tree[source] = self.last_tree[source], None

    # ---- drafting -------------------------------------------------------------------------------------------
    def propose(self, sequences: list[Sequence], gammas: list[int]) -> Proposal:
        batch, k = len(sequences), self.top_k
        rows = list(range(batch))
        normed, prenorm = self._catch_up(sequences)  # [B, H] each: the last pair's outputs
        starts = list(self.cache.lengths[:batch])  # committed pairs per row; the tree's scratch follows
        log_probs = self.head.logits(normed).log_softmax(-1)  # [B, Vd]
        frontier_paths, draft_ids = log_probs.topk(k, dim=-1)  # [B, k]: depth 1
        frontier_tokens = self.draft_to_target[draft_ids]  # [B, k]
        frontier_hidden = prenorm[:, None].expand(-1, k, -1)  # [B, k, H]: each frontier node's input state
        frontier_ids = torch.arange(k, device=self.device).expand(batch, k)  # each frontier node's candidate index
        ancestors = torch.zeros(batch, k, 0, dtype=torch.bool, device=self.device)  # [B, k, scratch slots]
        # every node generated: its token, its path's log-probability, its parent's candidate index (-1: the root)
        tokens, paths = [frontier_tokens], [frontier_paths]
        parents = [torch.full((batch, k), -1, dtype=torch.long, device=self.device)]
        start = from_host(starts, self.device)[:, None]  # [B, 1]
        for level in range(1, min(self.depth, max(gammas))):
            # the frontier (depth `level`) runs through the head at position start + level - 1, its entries
            # written at scratch slots (level - 1) * k.. after the row's committed pairs
            seen = torch.cat([ancestors, torch.eye(k, dtype=torch.bool, device=self.device).expand(batch, k, k)],
                             dim=-1)  # [B, k, level * k]: what each frontier node attends to in the scratch
            slots = start + (level - 1) * k + torch.arange(k, device=self.device)
            normed, prenorm = self._run(rows, frontier_tokens, frontier_hidden, (start + level - 1).expand(batch, k),
                                        slots, self._tree_mask(starts, seen), fused=True)
            self.forwards += 1
            child_scores, child_ids = self.head.logits(normed).log_softmax(-1).topk(k, dim=-1)  # [B, k, k]
            child_paths = (frontier_paths[:, :, None] + child_scores).flatten(1)  # [B, k²]
            tokens.append(self.draft_to_target[child_ids].flatten(1))
            paths.append(child_paths)
            parents.append(frontier_ids.repeat_interleave(k, dim=1))
            # the next frontier: the k best children
            frontier_paths, best = child_paths.topk(k, dim=-1)  # [B, k]
            parent = (best // k)[..., None]  # [B, k, 1]: which frontier node each is a child of
            frontier_tokens = tokens[-1].gather(1, best)
            frontier_hidden = prenorm.gather(1, parent.expand(-1, -1, prenorm.shape[-1]))
            ancestors = seen.gather(1, parent.expand(-1, -1, seen.shape[-1]))
            frontier_ids = k + (level - 1) * k * k + best
        return self._select(torch.cat(tokens, 1), torch.cat(paths, 1), torch.cat(parents, 1), gammas)

    def _select(self, tokens: torch.Tensor, paths: torch.Tensor, parents: torch.Tensor,
                gammas: list[int]) -> Proposal:
        """Each row's tree: its max_nodes candidates of highest path probability within gamma levels (one host
        read of every candidate). tokens, paths, parents: [B, C] over the candidates, depth by depth."""
        k = self.top_k
        # one host read of all three (ids below 2^53 are exact in float64)
        width = tokens.shape[1]
        read = torch.cat([tokens.double(), paths.double(), parents.double()], dim=1).tolist()
        host_tokens = [[int(x) for x in row[:width]] for row in read]
        host_paths = [row[width:2 * width] for row in read]
        host_parents = [[int(x) for x in row[2 * width:]] for row in read]
        depth_of = [1] * k + [level + 2 for level in range((tokens.shape[1] - k) // (k * k)) for _ in range(k * k)]
        rows_tokens, rows_parents = [], []
        for row, gamma in enumerate(gammas):
            order = sorted((c for c in range(len(depth_of)) if depth_of[c] <= gamma),
                           key=lambda c: (-host_paths[row][c], depth_of[c], c))
            chosen: dict[int, None] = {}  # insertion-ordered
            for candidate in order:
                if len(chosen) == self.max_nodes:
                    break
                parent = host_parents[row][candidate]
                if parent == -1 or parent in chosen:
                    chosen[candidate] = None
            rank = {c: i for i, c in enumerate(chosen)}  # chosen in order of path probability
            nodes = sorted(chosen, key=lambda c: (depth_of[c], -host_paths[row][c], c))  # ancestors first
            verify_index = {c: i + 1 for i, c in enumerate(nodes)}
            rows_tokens.append([host_tokens[row][c] for c in nodes])
            rows_parents.append([0 if host_parents[row][c] == -1 else verify_index[host_parents[row][c]]
                                 for c in nodes])
            self.last_tree[row] = (rows_tokens[-1], rows_parents[-1], [rank[c] for c in nodes]) if nodes else None
        proposal = Proposal.from_lists(rows_tokens, self.device)
        proposal.tree = RowTrees(rows_parents)
        return proposal

    def _catch_up(self, sequences: list[Sequence]) -> tuple[torch.Tensor, torch.Tensor]:
        """Run every row's pending pairs in one ragged forward; returns each row's last outputs (normed,
        prenorm): [B, H] each (a row with nothing pending keeps the last ones it had)."""
        batch = len(sequences)
        features = [torch.cat(self.pending[row]) if self.pending[row] else None for row in range(batch)]
        counts = [0 if f is None else len(f) for f in features]
        if max(counts) > 0:
            width = max(counts)
            starts = list(self.cache.lengths[:batch])
            tokens = [s.committed[start + 1:start + 1 + count] for s, start, count in zip(sequences, starts, counts)]
            padded_tokens = from_host([t + [0] * (width - len(t)) for t in tokens], self.device, torch.long)
            size = self.head.config.hidden_size * 3
            padded = torch.stack([torch.cat([f, f.new_zeros(width - len(f), size)]) if f is not None
                                  else torch.zeros(width, size, dtype=self.dtype, device=self.device)
                                  for f in features])
            positions = from_host(starts, self.device)[:, None] + torch.arange(width, device=self.device)
            normed, prenorm = self._run(list(range(batch)), padded_tokens.view(batch, width), padded, positions,
                                        positions, self._causal(positions, max(starts) + width))
            self.forwards += 1
            last = from_host([max(count - 1, 0) for count in counts], self.device)
            rows = torch.arange(batch, device=self.device)
            fresh = from_host([count > 0 for count in counts], self.device, torch.bool)[:, None, None]
            outputs = torch.stack([normed[rows, last], prenorm[rows, last]], dim=1)  # [B, 2, H]
            self.root[:batch] = torch.where(fresh, outputs, self.root[:batch])
            for row in range(batch):
                self.cache.lengths[row] = starts[row] + counts[row]
                self.pending[row] = []
        return self.root[:batch, 0], self.root[:batch, 1]

    def _causal(self, positions: torch.Tensor, length: int) -> torch.Tensor:
        """[B, T, S]: a pair sees the slots up to its own position."""
        return torch.arange(length, device=self.device)[None, None, :] <= positions[..., None]

    def _tree_mask(self, starts: list[int], seen: torch.Tensor) -> torch.Tensor:
        """[B, k, S]: a frontier node sees its row's committed pairs and, of the tree's scratch slots after them,
        the ones `seen` [B, k, n] marks (its ancestors and itself)."""
        batch, k, scratch = seen.shape
        length = max(starts) + scratch
        start = from_host(starts, self.device)[:, None]
        relative = torch.arange(length, device=self.device)[None, :] - start  # [B, S]
        in_scratch = (relative >= 0) & (relative < scratch)
        part = seen.gather(2, relative.clamp(0, scratch - 1)[:, None, :].expand(batch, k, -1))
        return (relative < 0)[:, None, :] | (in_scratch[:, None, :] & part)

    def _run(self, rows: list[int], tokens: torch.Tensor, hidden: torch.Tensor, positions: torch.Tensor,
             slots: torch.Tensor, mask: torch.Tensor, fused: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
        """One head forward for cache rows `rows` (0..R-1 or a single row): tokens [R, T] (target ids), hidden
        [R, T, 3H] features (or [R, T, H] already-fused states with fused=True), positions and slots [R, T], mask
        [R, T, S]. Writes the pairs' keys and values at `slots`. Returns (normed, prenorm), [R, T, H] each."""
        head = self.head
        hidden = hidden.to(self.dtype)
        if not fused:
            hidden = head.fuse_features(hidden)
        projected = head.project(self.embed[tokens], hidden, positions)
        view = self.cache.rows(rows[0], rows[-1] + 1)
        keys, values = view.layer(0)
        write_entries(keys, values, slots, projected.k, projected.v)
        length = mask.shape[-1]
        attended = head.attend(projected.q, keys[:, :, :length], values[:, :, :length], mask)
        return head.finish(attended, projected.residual)
