"""Time a built engine's models step by step, eager against torch.compile (inductor, freezing), in one run (issue 27).

For each component of the engine (the bf16 target: eager from oneDNN's prepacked weights, compiled from the plain
ones, which inductor's freezing packs itself; the int4 draft, which is the target's weights as int4 groups; and, when
llama-cpp-python is installed (`make peers`), llama.cpp's decode step on the GGUF the target came from) and each
width (1: a decode step; N: a verify of N positions), the forward plus the vocabulary projection of its last
position, over a cache holding --context tokens. Each round times every line once, so the machine's drift falls on
all of them alike; the figures are the median and minimum over rounds. Compilation is at a fixed shape (one graph
per width and cache length), which is what this measures; it is not yet how the engine runs.

Usage (from the repository root, after `specdeploy build pipelines/smollm2-draft-target.yaml`):
    .venv/bin/python scripts/measure_compiled_steps.py engines/smollm2-draft-target [--widths 1 6] [--context 128]
        [--rounds 7] [--steps 10] [--threads 2] [--cache-slots 2048] [--cache-writes]
"""

from __future__ import annotations

import argparse
import statistics
import time
from pathlib import Path

import torch
from safetensors.torch import load_file

from specdeploy.models.registry import DTYPES, component_config, load_component, model_class


def plain_model(directory: Path) -> torch.nn.Module:
    """The component as a model to compile: no oneDNN prepacking (torch.compile does not lower those ops)."""
    config, dtype = component_config(directory)
    state = load_file(str(directory / "model.safetensors"))
    return model_class(config.architecture)(config, state, DTYPES[dtype], prepack=False).eval()


def step_runner(model, prompt: torch.Tensor, context: int, width: int, cache_slots: int, compiled=None):
    """A function running one step of `width` positions after `context` cached tokens (prefilled once, eagerly)."""
    cache = model.new_cache(1, cache_slots)
    with torch.inference_mode():
        model(prompt[:, :context], torch.arange(context)[None], cache)
    forward = model if compiled is None else compiled
    tokens = prompt[:, context:context + width]
    positions = torch.arange(context, context + width)[None]

    def run() -> torch.Tensor:
        cache.lengths = [context]
        return model.logits(forward(tokens, positions, cache)[:, -1])

    return run


def llama_cpp_runner(engine: Path, prompt: torch.Tensor, context: int):
    """llama.cpp's decode step (llama-cpp-python, `make peers`) on the GGUF the engine's target was built from, at
    the same position after the same context; None where it is not installed or the target has no GGUF."""
    try:
        import llama_cpp
    except ImportError:
        return None
    from specdeploy.build.checkpoints import locate
    from specdeploy.spec.engine_paths import engine_pipeline

    pipeline = engine_pipeline(engine)
    gguf = locate(pipeline.target.checkpoint, pipeline)
    if gguf.suffix != ".gguf" or pipeline.target.moe is not None:
        return None
    threads = torch.get_num_threads()
    llm = llama_cpp.Llama(model_path=str(gguf), n_ctx=context + 16, n_threads=threads, n_threads_batch=threads,
                          verbose=False)
    llm.eval(prompt[0, :context].tolist())
    token = int(prompt[0, context])

    def run() -> None:
        llm.n_tokens = context  # eval drops the cache entries past n_tokens: a decode step at the same position
        llm.eval([token])

    return run


def milliseconds(run, steps: int) -> float:
    with torch.inference_mode():
        run()
        start = time.perf_counter()
        for _ in range(steps):
            run()
    return (time.perf_counter() - start) / steps * 1000


def cache_write_cost(layers: int, slots: int, steps: int) -> None:
    """Compiled, one new entry written into every layer's keys (then read) per step: a stacked [layers, ...] cache
    against one tensor per layer (models/kv_cache.py keeps the latter: the former is copied whole at each write)."""

    def stacked_step(cache: torch.Tensor, slot: torch.Tensor, entry: torch.Tensor) -> torch.Tensor:
        for layer in range(layers):
            cache[layer][:, :, slot] = entry
        return cache[:, :, :, :8].sum()

    def per_layer_step(cache: list[torch.Tensor], slot: torch.Tensor, entry: torch.Tensor) -> torch.Tensor:
        for layer in range(layers):
            cache[layer][:, :, slot] = entry
        return torch.stack([keys[:, :, :8].sum() for keys in cache]).sum()

    shape = (1, 3, slots, 64)
    entry, slot = torch.randn(1, 3, 1, 64).bfloat16(), torch.tensor([100])
    stacked = torch.zeros(layers, *shape, dtype=torch.bfloat16)
    per_layer = [torch.zeros(shape, dtype=torch.bfloat16) for _ in range(layers)]
    for name, step, cache in (("stacked", stacked_step, stacked), ("per layer", per_layer_step, per_layer)):
        compiled = torch.compile(step, dynamic=False)
        cost = milliseconds(lambda compiled=compiled, cache=cache: compiled(cache, slot, entry), steps)
        print(f"  cache writes, {layers} layers x {slots} slots, {name:9}: {cost:7.3f} ms per step")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("engine", type=Path)
    parser.add_argument("--widths", type=int, nargs="+", default=[1, 6])
    parser.add_argument("--context", type=int, default=128)
    parser.add_argument("--rounds", type=int, default=7)
    parser.add_argument("--steps", type=int, default=10)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--cache-slots", type=int, default=2048)
    parser.add_argument("--cache-writes", action="store_true",
                        help="also time compiled cache writes, a stacked cache against one tensor per layer")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    import torch._inductor.config as inductor_config

    inductor_config.freezing = True
    components = [name for name in ("target", "draft") if (args.engine / name / "config.json").is_file()]
    if not components:
        parser.error(f"{args.engine}: no target/ or draft/ with a config.json (build the pipeline first)")
    config, _ = component_config(args.engine / components[0])  # the target's and a derived draft's are alike
    prompt = torch.randint(0, config.vocab_size, (1, args.context + max(args.widths)),
                           generator=torch.Generator().manual_seed(0))
    runs = {}
    for name in components:
        eager, plain = load_component(args.engine / name), plain_model(args.engine / name)
        for width in args.widths:
            runs[f"{name} eager w{width}"] = step_runner(eager, prompt, args.context, width, args.cache_slots)
            start = time.perf_counter()
            run = step_runner(plain, prompt, args.context, width, args.cache_slots,
                              torch.compile(plain, dynamic=False))
            milliseconds(run, 1)
            print(f"{name} w{width}: compiled in {time.perf_counter() - start:.0f} s", flush=True)
            runs[f"{name} compiled w{width}"] = run
    llama_cpp_step = llama_cpp_runner(args.engine, prompt, args.context)
    if llama_cpp_step is not None:
        runs["llama.cpp w1"] = llama_cpp_step
    times: dict[str, list[float]] = {line: [] for line in runs}
    for _ in range(args.rounds):
        for line, run in runs.items():
            times[line].append(milliseconds(run, args.steps))
    print(f"\n{torch.get_num_threads()} threads, {args.context} cached tokens of {args.cache_slots} slots, "
          f"{args.rounds} rounds (wall ms per step)")
    for line, values in times.items():
        print(f"  {line:24} median {statistics.median(values):7.2f}   min {min(values):7.2f}")
    if args.cache_writes:
        cache_write_cost(config.num_layers, args.cache_slots, args.steps * 5)


if __name__ == "__main__":
    main()
