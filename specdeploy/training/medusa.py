"""Medusa self-distillation on the frozen target: the target answers a prompt set (batched through the scheduler),
one forward over each prompt + answer gives its final hidden states, and head k learns to predict, from the hidden
state at position t, the token the target produced at t + k + 2 (cross-entropy through the target's own LM head,
which stays frozen and shared).

Everything lands in a work directory, so an interrupted run resumes: the answers (answers.jsonl, appended as they
finish) and a checkpoint of the heads after every epoch (heads.epoch<N>.safetensors).
"""

from __future__ import annotations

import json
import queue
import time
from pathlib import Path

import torch
import torch.nn.functional as F
from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn, TimeRemainingColumn
from rich.table import Table
from safetensors.torch import load_file, save_file

from specdeploy.decoding.finish import Finish, finish_message
from specdeploy.decoding.stats import RequestStats
from specdeploy.errors import SpecdeployError
from specdeploy.runtime.engine import Engine
from specdeploy.runtime.scheduler import Scheduler
from specdeploy.spec.pipeline import ServingSpec
from specdeploy.spec.request import GenerationRequest
from specdeploy.spec.sampling_params import SamplingParams
from specdeploy.speculative.medusa import MedusaHeads
from specdeploy.speculative.medusa_accuracy import IGNORE, TOP_K, Features, hidden_features
from specdeploy.training.loop import LoopSettings, latest_checkpoint, run_epochs


def progress_bar(console: Console | None = None) -> Progress:
    return Progress(TextColumn("{task.description}"), BarColumn(), MofNCompleteColumn(), TimeElapsedColumn(),
                    TimeRemainingColumn(), console=console)


def generate_answers(engine_dir: Path, prompts: list[str], max_tokens: int, path: Path, batch_size: int = 8,
                     console: Console | None = None, description: str = "target answers") -> dict[str, list[int]]:
    """The target's greedy answer to every prompt (prompt text → answer ids), `batch_size` decoded together,
    appended to `path` (JSON lines) as they finish; prompts answered there before are not generated again, and a
    prompt longer than the pipeline's limits.max_input_length gets no answer (it is left out of the result)."""
    done = {}
    if path.exists():
        for line in path.read_text().splitlines():
            if line.strip():
                record = json.loads(line)
                done[record["prompt"]] = record["answer"]
    todo = [p for p in prompts if p not in done]
    if todo:
        engine = Engine(engine_dir, method="none", batch_size=batch_size)
        limits = engine.pipeline.limits
        encoded = [engine.encode_prompt(prompt) for prompt in todo]
        todo, encoded = zip(*[(p, ids) for p, ids in zip(todo, encoded) if len(ids) <= limits.max_input_length]) \
            if any(len(ids) <= limits.max_input_length for ids in encoded) else ((), ())
        # every row may hold a whole sequence: the batch is the rows, not the KV budget of the serving pipeline
        scheduler = Scheduler(engine, ServingSpec(kv_capacity_tokens=batch_size * limits.max_sequence_length))
        finished: queue.Queue = queue.Queue()  # (index, answer or the error), from the scheduler's thread
        try:
            for index, ids in enumerate(encoded):
                scheduler.submit(GenerationRequest(ids, max_tokens, SamplingParams(), 0),
                                 answer_collector(index, finished))
            started, tokens = time.perf_counter(), 0
            with path.open("a") as out, progress_bar(console) as progress:
                task = progress.add_task(description, total=len(todo))
                for _ in todo:
                    index, answer = finished.get()
                    if isinstance(answer, str):
                        raise SpecdeployError(f"generating the answer to prompt {index}: {answer}")
                    done[todo[index]] = answer
                    out.write(json.dumps({"prompt": todo[index], "answer": answer}) + "\n")
                    out.flush()
                    tokens += len(answer)
                    rate = tokens / max(time.perf_counter() - started, 1e-9)
                    progress.update(task, advance=1, description=f"{description} ({rate:.0f} tokens/s)")
        finally:
            scheduler.stop()
    return {p: done[p] for p in prompts if p in done}


def answer_collector(index: int, finished: queue.Queue):
    """A scheduler callback that puts (index, the answer's ids) on `finished`, or (index, what failed) when the
    request failed."""
    tokens: list[int] = []

    def on_tokens(new: list[int], reason: Finish | None, stats: RequestStats) -> None:
        tokens.extend(new)
        if reason is not None:
            finished.put((index, finish_message(reason, stats.finish_detail) if reason.is_failure else tokens))
    return on_tokens


def features(engine: Engine, answers: dict[str, list[int]], num_heads: int, console: Console | None = None
             ) -> Features:
    """Hidden states and head targets over each prompt's answer (see medusa_accuracy.hidden_features)."""
    sequences = []
    for prompt, answer in answers.items():
        prompt_ids = engine.encode_prompt(prompt)
        sequences.append((prompt_ids + answer, len(prompt_ids) - 1))
    with progress_bar(console) as progress:
        task = progress.add_task("hidden states", total=len(sequences))
        return hidden_features(engine.target, sequences, num_heads, lambda: progress.advance(task))


def head_losses(heads: MedusaHeads, hidden: torch.Tensor, targets: torch.Tensor, lm_head: torch.Tensor
                ) -> torch.Tensor:
    """[K] mean cross-entropy of each head on a batch (hidden [N, H], targets [N, K], lm_head [V, H])."""
    logits = F.linear(heads.hidden(hidden), lm_head)  # [N, K, V]
    return torch.stack([F.cross_entropy(logits[:, k], targets[:, k], ignore_index=IGNORE)
                        for k in range(heads.num_heads)])


def train(heads: MedusaHeads, data: Features, lm_head: torch.Tensor, epochs: int, work_dir: Path,
          batch_size: int = 256, lr: float = 1e-3, seed: int = 0, console: Console | None = None) -> MedusaHeads:
    """training/loop.py; a checkpoint after each epoch, resumed from the latest one."""
    checkpoint, start = latest_checkpoint(lambda epoch: work_dir / f"heads.epoch{epoch}.safetensors", epochs)
    if checkpoint is not None:
        heads = MedusaHeads.from_state(load_file(str(checkpoint)), str(checkpoint))

    def batch_loss(batch: torch.Tensor) -> torch.Tensor:
        # bf16 logits (AMX on a CPU) make the step cheaper (docs/benchmarks.md, "Figures behind the code"); the
        # loss itself is computed in fp32
        with torch.autocast(data.hidden.device.type, dtype=torch.bfloat16):
            return head_losses(heads, data.hidden[batch], data.targets[batch], lm_head).sum()

    def after_epoch(epoch: int, loss: float) -> None:
        save_file(heads.state(), str(work_dir / f"heads.epoch{epoch}.safetensors"))

    with progress_bar(console) as progress:
        task = progress.add_task("training heads", total=None)

        def on_step(done: int, total: int, loss: float) -> None:
            progress.update(task, completed=done, total=total,
                            description=f"training heads (loss {loss / heads.num_heads:.3f})")

        run_epochs(heads, len(data.hidden), LoopSettings(epochs, batch_size, lr, seed), batch_loss, after_epoch,
                   start, on_step)
    return heads


def print_accuracies(report: list[dict[str, float]], console: Console) -> None:
    table = Table(title="Medusa heads on held-out answers (the target's own tokens)")
    table.add_column("head (token)")
    for k in TOP_K:
        table.add_column(f"top-{k}", justify="right")
    table.add_column("positions", justify="right")
    for index, row in enumerate(report):
        table.add_row(f"{index} (t+{index + 2})", *(f"{row[f'top{k}']:.3f}" for k in TOP_K), str(row["positions"]))
    console.print(table)
