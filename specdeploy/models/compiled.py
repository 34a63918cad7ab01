"""Compiled decode and verify steps (backend.torch.compile: true): the torch counterpart of a built TensorRT engine.

A model's forward runs through `torch.compile` (inductor, every size and cache length symbolic) for calls of at
most `max_width` tokens a row, the decode and verify steps, and eagerly for longer ones, the prefills. Inductor
fuses the step's small operations (norms, rotary, activations, cache writes) into a few kernels a layer; the
matmuls stay torch's (the int4/int8 weight-only kernels, oneDNN bf16 or aten's).

Compiling takes minutes on a CPU, so it happens when the engine loads, in `warm_up`, never at a request: one call
per graph the steps use. Dynamo specializes sizes of 1, so those are four: one row or more, one token or more a row;
every other batch size, width and cache length reuses them. Inductor's cache lives in the engine directory
(`compiled/`): `specdeploy build` fills it, and each load works on a temporary copy of it, so it reads the compiled
kernels instead of generating them again (dynamo still traces the model at each load) and never writes into the
engine, which a server may mount read-only.

Not kept: inductor's freezing with static shapes (weights as constants, a graph per batch size and width). It
decoded the int4 target faster than these symbolic graphs, but every new shape compiled anew and reloading an engine
took minutes even from a full cache (figures: docs/benchmarks.md, "Compiled steps").
"""

from __future__ import annotations

import json
import os
import shutil
import tempfile
from pathlib import Path

import torch

from specdeploy.models.kv_cache import KVCache
from specdeploy.models.llama import Forward, LayerSpan, LlamaModel
from specdeploy.spec.engine_paths import directory_bytes

CACHE_DIR = "compiled"  # under the engine directory
RECORD = "build.json"  # in CACHE_DIR: what the build's warm-up took


class CompiledSteps:
    """Stands in for LlamaModel.forward (same arguments and result): compiled for calls of at most `max_width`
    tokens a row, eager for longer ones."""

    def __init__(self, model: LlamaModel, max_width: int) -> None:
        self.eager = model.forward
        self.compiled = torch.compile(model.forward, dynamic=True)
        self.max_width = max_width

    def __call__(self, tokens: torch.Tensor, positions: torch.Tensor, kv_cache: KVCache,
                 attention_mask: torch.Tensor | None = None, cache_slots: torch.Tensor | None = None,
                 row_lengths: list[int] | None = None, span: LayerSpan | None = None,
                 capture: tuple[int, ...] = ()) -> Forward:
        """row_lengths is not passed on: only a batch-invariant model reads it, and a compiled one never is (the
        pipeline check refuses serving.determinism batch_invariant with compile); nor is a span, which only an
        early exit asks for (refused with compile too)."""
        step = self.compiled if tokens.shape[1] <= self.max_width else self.eager
        return step(tokens, positions, kv_cache, attention_mask, cache_slots, capture=capture)


def compile_steps(model: LlamaModel, max_width: int) -> None:
    """Route the model's decode and verify calls (≤ max_width tokens a row) through torch.compile. The model must be
    built with prepack=False: oneDNN's prepacked linear is an eager-only op."""
    model.forward = CompiledSteps(model, max_width)


def warm_up(model: LlamaModel, cache: KVCache, max_width: int) -> None:
    """Compile every graph the engine's steps use (see the module docstring) by running them on `cache`'s first rows,
    whose lengths are reset afterwards (the entries written are past every length, so nothing reads them)."""
    device = cache.keys[0].device
    start = 4
    with torch.inference_mode():
        for rows in sorted({1, min(2, cache.batch_size)}):
            view = cache.rows(0, rows)
            for width in sorted({1, min(2, max_width)}):
                view.lengths = [start] * rows
                tokens = torch.zeros(rows, width, dtype=torch.long, device=device)
                positions = start + torch.arange(width, device=device)[None].expand(rows, -1)
                model(tokens, positions, view)
    cache.lengths = [0] * cache.batch_size


def use_cache_of(engine_dir: Path) -> Path:
    """Point inductor's cache at a temporary copy of the engine's (loading never writes into an engine, which may be
    a read-only volume); returns the copy. Process-wide: inductor reads TORCHINDUCTOR_CACHE_DIR whenever it looks
    something up."""
    stored = Path(engine_dir) / CACHE_DIR
    used = Path(tempfile.mkdtemp(prefix="specdeploy-compiled-"))
    if stored.is_dir():
        shutil.copytree(stored, used, dirs_exist_ok=True)
    os.environ["TORCHINDUCTOR_CACHE_DIR"] = str(used)
    return used


def keep_cache(engine_dir: Path) -> None:
    """Add what this process compiled (into use_cache_of's copy) to the engine's cache."""
    shutil.copytree(os.environ["TORCHINDUCTOR_CACHE_DIR"], Path(engine_dir) / CACHE_DIR, dirs_exist_ok=True)


def record_build(engine_dir: Path, seconds: float) -> dict:
    """Write what compiling the engine's steps at build took beside the cache; returns the record."""
    record = {"compile_seconds": round(seconds, 1), "torch": torch.__version__,
              "cache_bytes": directory_bytes(Path(engine_dir) / CACHE_DIR)}
    (Path(engine_dir) / CACHE_DIR / RECORD).write_text(json.dumps(record, indent=2))
    return record
