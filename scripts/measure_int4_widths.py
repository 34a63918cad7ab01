"""Time an int4 target's forwards at several widths, each kernel path side by side in one run (issue 46).

torch's CPU int4 kernel (`_weight_int4pack_mm_for_cpu`) unpacks its weights again for every block of rows, so a
verify's cost grows with its width. The paths timed, per layer (each distinct int4 shape of the first decoder layer,
and the int8 vocabulary head) and for the whole model (a forward over `width` positions after --context cached
tokens, with the logits of every position, as bench's verify-cost sweep times it):
  int4       the int4 kernel at every width (the engine before issue 46)
  bf16copy   a bf16 copy of the same int4 values, prepacked for oneDNN (Int4Linear.keep_bf16_copy), at every width
  +bf16head  (model only) bf16copy, and the int8 head also from a bf16 copy of its values
Each round times every (path, width) once, in an order rotated each round, so the machine's drift falls on all of
them alike; the figures are medians over rounds (--minimum: minimums, for a loaded machine), and the ratios are to
the int4 path's one-row time (a plain step).
It also prints the bf16 copies' bytes and the largest difference between each path's logits and the int4 ones.

Usage (from the repository root, after `specdeploy build pipelines/smollm2-ngram.yaml --engines-dir ENGINES`):
    .venv/bin/python scripts/measure_int4_widths.py ENGINES/smollm2-ngram [--widths 1 2 4 6 8 12] [--rounds 15]
        [--steps 5] [--context 128] [--threads 2]
"""

from __future__ import annotations

import argparse
import statistics
import time
from collections.abc import Callable
from pathlib import Path

import torch

from specdeploy.models.llama import DenseLinear, LlamaModel
from specdeploy.models.quantize import Int4Linear, Int8Linear
from specdeploy.models.registry import load_component

NEVER = 1 << 30  # a row count no forward reaches: the int4 kernel at every width


def int4_layers(model: LlamaModel) -> list[Int4Linear]:
    return [module for module in model.modules() if isinstance(module, Int4Linear)]


def keep_copies(model: LlamaModel) -> int:
    """Give every int4 layer its bf16 copy (used by no forward yet); returns their bytes."""
    return sum(layer.keep_bf16_copy(NEVER) for layer in int4_layers(model))


def use_copies_from(model: LlamaModel, rows: int) -> None:
    for layer in int4_layers(model):
        layer.wide_from_rows = rows


def bf16_head(head: Int8Linear) -> DenseLinear:
    """The int8 head's values (int8 × bf16 row scale, rounded to bf16) as a prepacked bf16 linear."""
    values = head.weight_int8.float() * head.row_scales.float()[:, None]
    linear = DenseLinear(values.to(torch.bfloat16))
    linear.prepack()
    return linear


def milliseconds(run: Callable[[], object], steps: int) -> float:
    start = time.perf_counter()
    for _ in range(steps):
        run()
    return (time.perf_counter() - start) / steps * 1000


def side_by_side(runs: dict[tuple[str, int], Callable[[], object]], rounds: int, steps: int, pick=statistics.median
                 ) -> dict[tuple[str, int], float]:
    """Each run's milliseconds over `rounds` (their median, or `pick`), every run once a round in a rotated
    order."""
    samples: dict[tuple[str, int], list[float]] = {key: [] for key in runs}
    keys = list(runs)
    with torch.inference_mode():
        for run in runs.values():
            run()
        for round_index in range(rounds):
            shift = round_index % len(keys)
            for key in keys[shift:] + keys[:shift]:
                samples[key].append(milliseconds(runs[key], steps))
    return {key: pick(values) for key, values in samples.items()}


def print_table(title: str, times: dict[tuple[str, int], float], paths: list[str], widths: list[int],
                plain: float) -> None:
    print(f"\n{title}: ms (ratio to the int4 path's one-row time, {plain:.3f} ms)")
    print(f"{'path':>10} " + " ".join(f"{width:>15}" for width in widths))
    for path in paths:
        cells = [f"{times[path, width]:7.3f} ({times[path, width] / plain:4.2f})" for width in widths]
        print(f"{path:>10} " + " ".join(f"{cell:>15}" for cell in cells))


def layer_runs(model: LlamaModel, widths: list[int]) -> tuple[dict, list[tuple[str, int, int]]]:
    """Runs per (layer's shape and path, width): the first decoder layer's int4 layers and the head."""
    runs, shapes = {}, []
    generator = torch.Generator().manual_seed(0)
    head = model.lm_head
    layers = [*int4_layers(model.layers[0]), head]
    for layer in layers:
        in_features = layer.in_features
        out_features = layer.out_features
        name = f"{out_features}x{in_features}"
        shapes.append((name, out_features, in_features))
        x = torch.randn(max(widths), in_features, generator=generator).to(torch.bfloat16)
        if isinstance(layer, Int4Linear):
            paths = {"int4": NEVER, "bf16copy": 1}
            for path, from_rows in paths.items():
                for width in widths:
                    def run(layer=layer, from_rows=from_rows, rows=x[:width]) -> torch.Tensor:
                        layer.wide_from_rows = from_rows
                        return layer(rows)
                    runs[f"{name} {path}", width] = run
        else:
            copy = bf16_head(layer)
            for path, linear in (("int4", layer), ("bf16copy", copy)):  # "int4" here: the head as shipped, int8
                for width in widths:
                    runs[f"{name} {path}", width] = lambda linear=linear, rows=x[:width]: linear(rows)
    return runs, shapes


def model_runs(model: LlamaModel, widths: list[int], context: int) -> dict:
    """Runs per (path, width): a forward over `width` positions after `context` cached tokens, every position's
    logits."""
    generator = torch.Generator().manual_seed(0)
    prompt = torch.randint(100, model.config.vocab_size, (1, context + max(widths)), generator=generator)
    cache = model.new_cache(1, context + max(widths) + 1)
    with torch.inference_mode():
        model(prompt[:, :context], torch.arange(context)[None], cache)
    int8_head, copy_head = model.lm_head, bf16_head(model.lm_head)
    paths = {"int4": (NEVER, int8_head), "bf16copy": (1, int8_head), "+bf16head": (1, copy_head)}
    runs = {}
    for path, (from_rows, head) in paths.items():
        for width in widths:
            tokens = prompt[:, context:context + width]
            positions = torch.arange(context, context + width)[None]

            def run(from_rows=from_rows, head=head, tokens=tokens, positions=positions) -> torch.Tensor:
                use_copies_from(model, from_rows)
                model.lm_head = head
                cache.lengths = [context]
                return model.logits(model(tokens, positions, cache).hidden)

            runs[path, width] = run
    return runs


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("engine", type=Path)
    parser.add_argument("--widths", type=int, nargs="+", default=[1, 2, 4, 6, 8, 12])
    parser.add_argument("--rounds", type=int, default=15)
    parser.add_argument("--steps", type=int, default=5)
    parser.add_argument("--context", type=int, default=128)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--minimum", action="store_true", help="minimums over rounds, not medians (a loaded machine)")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)

    model = load_component(args.engine / "target")
    if not int4_layers(model):
        raise SystemExit(f"{args.engine}: the target holds no int4 layers (target.weight_only: int4)")
    copy_bytes = keep_copies(model)
    head_bytes = model.lm_head.weight_int8.numel() * 2 if isinstance(model.lm_head, Int8Linear) else 0
    int4_bytes = sum(layer.weight_bytes for layer in int4_layers(model))
    print(f"torch {torch.__version__}, {args.threads} threads, context {args.context}; int4 projections "
          f"{int4_bytes / 2**20:.1f} MiB, their bf16 copies {copy_bytes / 2**20:.1f} MiB, a bf16 head copy "
          f"{head_bytes / 2**20:.1f} MiB")

    pick = min if args.minimum else statistics.median
    print(f"figures: {pick.__name__} over {args.rounds} rounds")
    runs, shapes = layer_runs(model, args.widths)
    times = side_by_side(runs, args.rounds, args.steps * 4, pick)
    for name, _, _ in shapes:
        kind = "the head, int8 kernel in the int4 row" if name == shapes[-1][0] else "int4"
        print_table(f"layer {name} ({kind})", {(path.split()[1], width): ms for (path, width), ms in times.items()
                                      if path.split()[0] == name}, ["int4", "bf16copy"], args.widths,
                    times[f"{name} int4", 1])

    runs = model_runs(model, args.widths, args.context)
    times = side_by_side(runs, args.rounds, args.steps, pick)
    print_table("model step (forward + every position's logits)", times, ["int4", "bf16copy", "+bf16head"],
                args.widths, times["int4", 1])
    with torch.inference_mode():
        reference = runs["int4", max(args.widths)]().float()
        for path in ("bf16copy", "+bf16head"):
            logits = runs[path, max(args.widths)]().float()
            agree = (logits.argmax(-1) == reference.argmax(-1)).float().mean().item()
            print(f"{path}: logits at {max(args.widths)} positions differ from int4's by at most "
                  f"{(logits - reference).abs().max().item():.3f} (largest |logit| {reference.abs().max().item():.1f}),"
                  f" argmax agreement {agree:.2f}")


if __name__ == "__main__":
    main()
