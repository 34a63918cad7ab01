"""Medusa: K heads on the target's last hidden state guess the tokens after the pending one, and a tree of their top
candidates is verified in one target forward (runtime/batch.py, with the exact rule of speculative/tree.py).

Head k (0-based) maps the hidden state h_t, whose logits chose the pending token t+1, to a guess for token t+k+2:
num_layers residual blocks x + SiLU(W x + b) (W starts at zero, so an untrained head repeats the target's own
prediction), then a vocabulary projection: the target's LM head, shared (on a CPU a second 49k x 576 projection per
head would cost almost a target forward), or the head's own. A shared head may be cut to the rows of a draft
vocabulary (speculation.medusa.draft_vocab; speculative/draft_vocabulary.py), which only changes what is proposed.

The heads file uses the keys TensorRT-LLM's Medusa converter reads from `medusa_lm_head.safetensors`:
`{head}.{layer}.linear.weight|bias` for the blocks and `{head}.{num_layers}.weight` for a head's own projection; a
file without the projection keys shares the target's. `export_trtllm` writes every head with its projection.
"""

from __future__ import annotations

import json
from pathlib import Path

import torch
import torch.nn.functional as F
from safetensors.torch import load_file, save_file
from torch import nn

from specdeploy.decoding.sequence import Sequence
from specdeploy.errors import SpecdeployError
from specdeploy.models.device_transfer import from_host
from specdeploy.models.reductions import topk_indices
from specdeploy.spec.speculation import MEDUSA_HEADS
from specdeploy.spec.token_tree import TokenTree
from specdeploy.speculative.draft_vocabulary import VocabularyHead, read_vocabulary_file
from specdeploy.speculative.proposer import EngineParts, Proposal, Proposer
from specdeploy.speculative.row_trees import RowTrees

HEADS_FILE = "heads.safetensors"
CONFIG_FILE = "config.json"
ACCURACY_FILE = "accuracy.json"  # train-medusa's held-out report, copied by the build
DRAFT_VOCAB_FILE = "draft_vocab.json"  # the ids the heads may propose (speculation.medusa.draft_vocab)


class MedusaHeads(nn.Module):
    """blocks[k][j]: head k's j-th residual block; projections: [K, V, H] own projections, or None (shared)."""

    def __init__(self, hidden_size: int, num_heads: int, num_layers: int = 1,
                 projections: torch.Tensor | None = None) -> None:
        super().__init__()
        self.hidden_size, self.num_heads, self.num_layers = hidden_size, num_heads, num_layers
        self.blocks = nn.ModuleList(
            nn.ModuleList(nn.Linear(hidden_size, hidden_size) for _ in range(num_layers)) for _ in range(num_heads))
        for head in self.blocks:
            for block in head:
                nn.init.zeros_(block.weight)
                nn.init.zeros_(block.bias)
        self.projections = None if projections is None else nn.Parameter(projections)

    def hidden(self, h: torch.Tensor, count: int | None = None) -> torch.Tensor:
        """h: [..., H] (the target's final hidden state, after its norm) → [..., K, H], each head's block output
        (the first `count` heads' only, when given)."""
        outputs = []
        for head in self.blocks[:count]:
            x = h
            for block in head:
                x = x + F.silu(block(x))
            outputs.append(x)
        return torch.stack(outputs, dim=-2)

    def logits(self, h: torch.Tensor, shared_head, count: int | None = None) -> torch.Tensor:
        """h: [..., H] → fp32 logits [..., K, V] (K = count when given: the first heads only). shared_head: the
        target's projection (hidden → fp32 logits), used when the heads have none of their own."""
        x = self.hidden(h, count)
        if self.projections is None:
            return shared_head(x)
        return torch.einsum("...kh,kvh->...kv", x, self.projections[:count]).float()

    # ---- files ---------------------------------------------------------------------------------------------
    def state(self, projection: torch.Tensor | None = None) -> dict[str, torch.Tensor]:
        """Tensors under TensorRT-LLM's keys. projection [V, H]: write it as every head's projection (a shared head
        exported for a converter that wants one per head)."""
        tensors = {}
        for k, head in enumerate(self.blocks):
            for j, block in enumerate(head):
                tensors[f"{k}.{j}.linear.weight"] = block.weight.detach()
                tensors[f"{k}.{j}.linear.bias"] = block.bias.detach()
            if self.projections is not None:
                own = self.projections[k].detach()
            else:  # a copy per head: safetensors stores no tensors that share memory
                own = None if projection is None else projection.clone()
            if own is not None:
                tensors[f"{k}.{self.num_layers}.weight"] = own
        return {name: tensor.contiguous() for name, tensor in tensors.items()}

    def save(self, path: Path) -> None:
        save_file(self.state(), str(path))

    @staticmethod
    def from_state(tensors: dict[str, torch.Tensor], source: str = "heads") -> MedusaHeads:
        """Heads from tensors under TensorRT-LLM's keys; SpecdeployError names what is missing or misshapen."""
        heads = sorted({int(name.split(".")[0]) for name in tensors if name.split(".")[0].isdigit()})
        if not heads or heads != list(range(len(heads))):
            raise SpecdeployError(f"{source}: no Medusa heads numbered 0..K-1 (keys like '0.0.linear.weight')")
        layers = sorted({int(name.split(".")[1]) for name in tensors if name.endswith(".linear.weight")
                         and name.startswith("0.")})
        num_layers = len(layers)
        try:
            hidden = tensors["0.0.linear.weight"].shape[1]
            own = [tensors.get(f"{k}.{num_layers}.weight") for k in heads]
            if any(p is not None for p in own) and any(p is None for p in own):
                raise SpecdeployError(f"{source}: some heads have their own projection and some do not")
            projections = None if own[0] is None else torch.stack(own).float()
            module = MedusaHeads(hidden, len(heads), num_layers, projections)
            for k, head in enumerate(module.blocks):
                for j, block in enumerate(head):
                    block.weight.data.copy_(tensors[f"{k}.{j}.linear.weight"])
                    block.bias.data.copy_(tensors[f"{k}.{j}.linear.bias"])
        except (KeyError, RuntimeError) as exc:
            raise SpecdeployError(f"{source}: not a Medusa heads file: {exc}") from None
        return module

    @staticmethod
    def load(path: Path) -> MedusaHeads:
        if not path.is_file():
            raise SpecdeployError(f"{path}: Medusa heads file not found (train them with specdeploy train-medusa)")
        return MedusaHeads.from_state(load_file(str(path)), str(path))


def export_trtllm(heads: MedusaHeads, lm_head: torch.Tensor, path: Path, dtype: torch.dtype) -> None:
    """`medusa_lm_head.safetensors` as TensorRT-LLM's Medusa converter reads it: every head with its projection
    (the target's LM head [V, H] written once per head when they share it)."""
    save_file({name: tensor.to(dtype) for name, tensor in heads.state(lm_head).items()}, str(path))


class MedusaProposer(Proposer):
    """Proposes the tree's nodes from each row's last hidden state: node [.., i] at depth d is head d-1's i-th most
    likely token. A row's gamma caps the tree's depth."""

    def __init__(self, heads: MedusaHeads, tree: TokenTree, shared_head, batch_size: int,
                 device: torch.device | str) -> None:
        if tree.depth > heads.num_heads:
            raise SpecdeployError(f"the Medusa tree is {tree.depth} deep but there are {heads.num_heads} heads")
        self.heads, self.tree, self.shared_head, self.device = heads, tree, shared_head, device
        self.last = torch.zeros(batch_size, heads.hidden_size, device=device)  # [rows, H]
        self.head_of_node = from_host([len(path) - 1 for path in tree.paths], device)
        self.rank_of_node = from_host([path[-1] for path in tree.paths], device)
        self.top = max(path[-1] for path in tree.paths) + 1
        self.shapes: dict[tuple[int, ...], RowTrees] = {}  # counts per row → the batch's tree shapes

    @classmethod
    def from_engine(cls, parts: EngineParts) -> MedusaProposer:
        directory = parts.directory / MEDUSA_HEADS.folder
        # The blocks run in fp32 (a few hundred thousand multiply-adds per head): in bf16 their small residual
        # updates to a large hidden state are rounded away. The shared projection runs in the target's dtype.
        heads = MedusaHeads.load(directory / HEADS_FILE).to(parts.device, torch.float32)
        target = parts.target
        tree = TokenTree.from_choices([list(path) for path in parts.pipeline.speculation.medusa.choices])
        head = VocabularyHead(target, from_host(engine_vocabulary(parts.directory), parts.device, torch.long),
                              "speculation.medusa.draft_vocab")
        return cls(heads, tree, lambda x: head(x.to(target.dtype)), parts.cache.batch_size, parts.device)

    def prefill(self, row: int, sequence: Sequence, hidden: torch.Tensor) -> None:
        self.last[row] = hidden[-1]

    def on_commit(self, row: int, sequence: Sequence, hidden: torch.Tensor) -> None:
        self.last[row] = hidden[-1]

    def move_row(self, source: int, destination: int) -> None:
        self.last[destination] = self.last[source]

    def propose(self, sequences: list[Sequence], gammas: list[int]) -> Proposal:
        batch, depth = len(sequences), self.tree.depth
        # only the heads the tree reaches: a shallow tree pays for fewer rows of the vocabulary projection
        logits = self.heads.logits(self.last[:batch], self.shared_head, depth).flatten(0, 1)  # [B * depth, V]
        candidates = topk_indices(logits, self.top)  # unordered
        ranks = logits.gather(1, candidates).argsort(dim=-1, descending=True)
        top = candidates.gather(1, ranks).view(batch, depth, self.top)  # [B, depth, top], best first
        tokens = top[:, self.head_of_node, self.rank_of_node]  # [B, N]
        counts = [self.tree.nodes_up_to(gamma) for gamma in gammas]
        key = tuple(counts)
        if key not in self.shapes:  # a few shapes recur: their masks are built once, not at every step
            self.shapes[key] = RowTrees.of(self.tree, counts)
        return Proposal(tokens, None, counts, self.shapes[key])


def engine_vocabulary(engine_dir: Path) -> list[int]:
    """The ids the engine's heads may propose (every id where the pipeline's draft_vocab is 0)."""
    return read_vocabulary_file(Path(engine_dir) / MEDUSA_HEADS.folder / DRAFT_VOCAB_FILE, "a medusa build")


def write_heads_config(directory: Path, heads: MedusaHeads) -> None:
    (directory / CONFIG_FILE).write_text(json.dumps({"num_heads": heads.num_heads, "num_layers": heads.num_layers,
                                                     "hidden_size": heads.hidden_size,
                                                     "own_projections": heads.projections is not None}, indent=2))
