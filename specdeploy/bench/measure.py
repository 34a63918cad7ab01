"""Measurements beside the decode runs: the memory-bandwidth ceiling on plain decode (the bytes a token reads are the
model's own weight_bytes_per_token), transformers' `generate` on the same weights, and the time of a target forward
by width (the verify cost of n drafted tokens)."""

from __future__ import annotations

import time

import torch

from specdeploy.bench.peers import hf_model
from specdeploy.models.device_transfer import finish
from specdeploy.models.kv_cache import KVCache
from specdeploy.models.llama import LlamaModel, ragged_forward_all
from specdeploy.runtime.engine import Engine


def measure_bandwidth(dtype: torch.dtype, device: torch.device | str = "cpu", megabytes: int = 256,
                      repeats: int = 10) -> float:
    """Bytes/s streamed by a mat-vec over a matrix far larger than the caches (what plain decode does)."""
    columns = 1024
    rows = megabytes * 2**20 // (columns * torch.finfo(dtype).bits // 8)
    matrix = torch.randn(rows, columns, device=device).to(dtype)
    vector = torch.randn(1, columns, device=device).to(dtype)
    torch.nn.functional.linear(vector, matrix)
    finish(device)
    started = time.perf_counter()
    for _ in range(repeats):
        torch.nn.functional.linear(vector, matrix)
    finish(device)
    elapsed = (time.perf_counter() - started) / repeats
    return matrix.numel() * matrix.element_size() / elapsed


def kv_bytes_per_position(model: LlamaModel, cache: KVCache) -> int:
    """Bytes of keys and values one position holds for `model`'s layers in `cache` (what attention reads per
    position of context)."""
    keys = cache.keys[0]  # [batch, kv_heads, max_length, head_dim]
    return 2 * model.config.num_layers * keys.shape[1] * keys.shape[3] * keys.element_size()


def transformers_decode_tokens_per_s(engine: Engine, prompt_ids: list[int], max_tokens: int) -> float:
    """transformers' greedy `generate` on the same weights, dtype and threads, decode phase only:
    (N - 1) / (time(N tokens) - time(1 token))."""
    model = hf_model(engine.dir / "target", engine.target.dtype, engine.device)
    ids = torch.tensor([prompt_ids], device=engine.device)

    def timed(n: int) -> float:
        started = time.perf_counter()
        with torch.inference_mode():
            model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=n, min_new_tokens=n,
                           do_sample=False, pad_token_id=0)
        finish(engine.device)
        return time.perf_counter() - started

    timed(4)  # warm-up
    return (max_tokens - 1) / max(timed(max_tokens) - timed(1), 1e-9)


def timed_forward(model: LlamaModel, cache, window: torch.Tensor, start: int, repeats: int) -> float:
    """The median seconds of one forward (with logits) over `window` [1, n] at position `start`."""
    samples = []
    for _ in range(repeats):
        began = time.perf_counter()
        model.logits(ragged_forward_all(model, cache, window, [start]).hidden)
        finish(window.device)
        samples.append(time.perf_counter() - began)
    return sorted(samples)[repeats // 2]


def measure_verify_costs(engine: Engine, prompt_ids: list[int], max_nodes: int, repeats: int = 5) -> list[float]:
    """[n]: the time of one target forward over n + 1 positions after the prompt, in plain decode steps (n = 0),
    medians of `repeats`."""
    cache = engine.target.new_cache(1, len(prompt_ids) + max_nodes + 2)
    tokens = torch.tensor([prompt_ids], device=engine.device)
    with torch.inference_mode():
        engine.target(tokens, torch.arange(len(prompt_ids), device=engine.device)[None], cache)
        times = [timed_forward(engine.target, cache, tokens[:, -1:].expand(1, width), len(prompt_ids) - 1, repeats)
                 for width in range(1, max_nodes + 2)]
    return [t / times[0] for t in times]
