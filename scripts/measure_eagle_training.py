"""Token-epochs per second of EAGLE-3 head training, setting against setting in one run (issue 59).

The settings train-eagle could use, each timed over the same training steps of a run's feature shards:
- fp32 matmuls against bf16 autocast (`--no-autocast` / `--autocast`), at batch 8 and 16;
- where the target's features come from: read back from the shards (what train-eagle does) or computed again by a
  target forward over the batch (what a trainer without shards would pay every epoch); the second's training step
  is the first's, so it is timed as the target forward alone and added.
Each round times every line once, so the machine's drift falls on all of them alike; the figures are medians over
rounds. The head is the pipeline's shipped one (what it was initialised from does not change a step's cost).

Usage (from the repository root, after a train-eagle run wrote W/runs/<prompts>/train):
    OMP_NUM_THREADS=2 .venv/bin/python scripts/measure_eagle_training.py pipelines/smollm2-eagle.yaml \
        --engine ENGINES/smollm2-eagle-target --shards W/runs/1600/train [--steps 6] [--rounds 3]
        [--json bench-results/eagle-training.json]
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path

import torch

from specdeploy.models.registry import load_component, load_projection
from specdeploy.spec.pipeline import load_pipeline
from specdeploy.speculative.eagle_head import Eagle3Head
from specdeploy.training.eagle import padded_batch, ttt_forward
from specdeploy.training.eagle_data import ShardedSamples

SETTINGS = [("fp32", 8, False), ("bf16 autocast", 8, True), ("fp32", 16, False), ("bf16 autocast", 16, True)]


def batches_of(samples: ShardedSamples, size: int, steps: int, seed: int = 0) -> list[list[int]]:
    """`steps` batches of `size` samples of similar lengths (as train-eagle groups them), the same for every line."""
    chosen = torch.randperm(len(samples), generator=torch.Generator().manual_seed(seed))[:size * steps].tolist()
    lengths = samples.lengths()
    chosen.sort(key=lambda i: lengths[i])
    return [chosen[start:start + size] for start in range(0, len(chosen), size)]


def train_steps(head: Eagle3Head, samples: ShardedSamples, batches: list[list[int]], embed: torch.Tensor,
                draft_rows: torch.Tensor, depth: int, autocast: bool) -> tuple[float, int]:
    """(seconds, tokens) of AdamW steps over `batches`: read, forward over `depth` training-time-test steps,
    backward, update."""
    optimizer = torch.optim.AdamW(head.parameters(), lr=1e-4, weight_decay=0.0)
    tokens = 0
    started = time.perf_counter()
    for batch in batches:
        chosen = [samples[i] for i in batch]
        tokens += sum(len(s.tokens) for s in chosen)
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=autocast):
            loss = ttt_forward(head, padded_batch(chosen), embed, draft_rows, depth)[0]
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
    return time.perf_counter() - started, tokens


def feature_forwards(target, samples: ShardedSamples, batches: list[list[int]], layers: tuple[int, ...]) -> float:
    """Seconds of the target forwards that would compute the batches' features again (one per sequence, as the
    shards were written)."""
    started = time.perf_counter()
    with torch.inference_mode():
        for batch in batches:
            for i in batch:
                ids = samples.tokens(i)[None]
                target(ids, torch.arange(ids.shape[1])[None], target.new_cache(1, ids.shape[1] + 1), capture=layers)
    return time.perf_counter() - started


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("pipeline", type=Path)
    parser.add_argument("--engine", type=Path, required=True, help="the pipeline's target built alone")
    parser.add_argument("--shards", type=Path, required=True, help="a train-eagle run's train/ folder")
    parser.add_argument("--steps", type=int, default=6, help="training steps a line times per round")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--json", type=Path)
    args = parser.parse_args()

    pipeline = load_pipeline(args.pipeline)
    head_dir = args.pipeline.parent / pipeline.speculation.eagle.head
    target = load_component(args.engine / "target")
    head = Eagle3Head.load(head_dir, target.config.num_layers).float()  # train-eagle's weights are fp32
    layers = tuple(head.config.feature_layers)
    embed = target.embed.detach().float()
    draft_rows = load_projection(args.engine / "target")[head.draft_to_target]
    depth = pipeline.speculation.num_draft_tokens
    samples = ShardedSamples(args.shards)
    rates: dict[str, list[float]] = {}
    for round_number in range(args.rounds):
        for name, size, autocast in SETTINGS:
            batches = batches_of(samples, size, args.steps, seed=round_number)
            seconds, tokens = train_steps(head, samples, batches, embed, draft_rows, depth, autocast)
            rates.setdefault(f"{name}, batch {size}, features from shards", []).append(tokens / seconds)
            if size == 8 and autocast:
                recompute = feature_forwards(target, samples, batches, layers)
                rates.setdefault(f"{name}, batch {size}, features recomputed", []).append(
                    tokens / (seconds + recompute))
        print(f"round {round_number + 1}/{args.rounds}: " +
              ", ".join(f"{line}: {values[-1]:.0f}" for line, values in rates.items()), flush=True)
    table = {line: round(statistics.median(values), 1) for line, values in rates.items()}
    baseline = table["fp32, batch 8, features from shards"]
    print(f"\n| setting | token-epochs/s (median of {args.rounds}) | against fp32, batch 8, shards |\n|---|---|---|")
    for line, rate in table.items():
        print(f"| {line} | {rate:,.0f} | {rate / baseline:.2f}x |")
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps({"threads": torch.get_num_threads(), "steps": args.steps,
                                         "rounds": args.rounds, "token_epochs_per_second": table}, indent=2) + "\n")


if __name__ == "__main__":
    main()
