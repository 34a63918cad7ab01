"""Early-exit test material: a tiny target whose early exit often agrees with it, its pipelines, and exit adapters
with chosen weights."""

from __future__ import annotations

from pathlib import Path

import torch
from safetensors.torch import load_file, save_file

from helpers.pipelines import tiny_pipeline
from helpers.tiny_models import save_tiny_checkpoint
from specdeploy.speculative.exit_adapter import ExitAdapter, ExitAdapterConfig

LAYERS, EXIT = 4, 2


def save_shallow_tail(directory: Path) -> Path:
    """A tiny 4-layer target whose last two layers change its hidden state little, so its first two layers' exit
    often agrees with it (as a model trained for early exit would)."""
    save_tiny_checkpoint(directory, seed=4, num_hidden_layers=LAYERS)
    weights = directory / "model.safetensors"
    state = load_file(str(weights))
    for layer in range(EXIT, LAYERS):
        for name in ("self_attn.o_proj", "mlp.down_proj"):
            state[f"model.layers.{layer}.{name}.weight"] *= 0.3
    save_file(state, str(weights), metadata={"format": "pt"})
    return directory


def early_exit_pipeline(directory: Path, target: Path, name: str = "tiny-early-exit", **early_exit) -> Path:
    return tiny_pipeline(directory, name, target, method="early_exit", gamma=3,
                         speculation_extra={"early_exit": {"exit_layer": EXIT, "draft_vocab": 96, **early_exit}})


def save_adapter(folder: Path, target: Path, scale: float = 0.0, hidden_size: int = 64, exit_layer: int = EXIT,
                 seed: int = 0) -> Path:
    """An adapter for `target` (a tiny checkpoint folder) written to `folder`: untrained (scale 0), or with W_down
    seeded random weights of standard deviation `scale`, which changes the draft's distributions."""
    torch.manual_seed(seed)
    adapter = ExitAdapter(ExitAdapterConfig(hidden_size, 32, exit_layer, target.name, LAYERS))
    with torch.no_grad():
        adapter.down.weight.normal_(0.0, scale) if scale else None
    adapter.save(folder)
    return folder
