"""Medusa self-distillation on the frozen target: the target answers a prompt set (batched through the scheduler),
one forward over each prompt + answer gives its final hidden states, and head k learns to predict, from the hidden
state at position t, the token the target produced at t + k + 2 (cross-entropy through the target's own LM head,
which stays frozen and shared).

Everything lands in a work directory, so an interrupted run resumes: the answers (answers.jsonl, appended as they
finish) and a checkpoint of the heads after every epoch (heads.epoch<N>.safetensors).
"""

from __future__ import annotations

import json
import math
import queue
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.nn.functional as F
from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn, TimeRemainingColumn
from rich.table import Table
from safetensors.torch import load_file, save_file

from specdeploy.errors import SpecdeployError
from specdeploy.request import GenerationRequest
from specdeploy.runtime.engine import Engine
from specdeploy.runtime.scheduler import Scheduler
from specdeploy.sampling_params import SamplingParams
from specdeploy.speculative.medusa import MedusaHeads

TOP_K = (1, 3, 5)  # accuracies reported per head
RANKS = 10  # ranks whose accuracy is recorded for the tree builder
IGNORE = -100  # a target past the end of an answer


def progress_bar(console: Console | None = None) -> Progress:
    return Progress(TextColumn("{task.description}"), BarColumn(), MofNCompleteColumn(), TimeElapsedColumn(),
                    TimeRemainingColumn(), console=console)


def generate_answers(engine_dir: Path, prompts: list[str], max_tokens: int, path: Path, batch_size: int = 8,
                     console: Console | None = None) -> dict[str, list[int]]:
    """The target's greedy answer to every prompt (prompt text → answer ids), appended to `path` (JSON lines) as
    they finish; prompts answered there before are not generated again."""
    done = {}
    if path.exists():
        for line in path.read_text().splitlines():
            if line.strip():
                record = json.loads(line)
                done[record["prompt"]] = record["answer"]
    todo = [p for p in prompts if p not in done]
    if todo:
        engine = Engine(engine_dir, method="none", batch_size=batch_size)
        scheduler = Scheduler(engine)
        finished: queue.Queue = queue.Queue()  # (index, answer or the error), from the scheduler's thread
        try:
            for index, prompt in enumerate(todo):
                request = GenerationRequest(engine.encode_prompt(prompt), max_tokens, SamplingParams(), 0)
                scheduler.submit(request, answer_collector(index, finished))
            with path.open("a") as out, progress_bar(console) as progress:
                task = progress.add_task("target answers", total=len(todo))
                for _ in todo:
                    index, answer = finished.get()
                    if isinstance(answer, str):
                        raise SpecdeployError(f"generating the answer to prompt {index}: {answer}")
                    done[todo[index]] = answer
                    out.write(json.dumps({"prompt": todo[index], "answer": answer}) + "\n")
                    out.flush()
                    progress.advance(task)
        finally:
            scheduler.stop()
    return {p: done[p] for p in prompts}


def answer_collector(index: int, finished: queue.Queue):
    """A scheduler callback that puts (index, the answer's ids) on `finished`, or (index, reason) on an error."""
    tokens: list[int] = []

    def on_tokens(new: list[int], reason: str | None, stats=None) -> None:
        tokens.extend(new)
        if reason is not None:
            finished.put((index, reason if reason.startswith(("error", "shutdown")) else tokens))
    return on_tokens


@dataclass
class Features:
    hidden: torch.Tensor  # [N, H] fp32: the target's final hidden state at each answer position t
    targets: torch.Tensor  # [N, K] long: the token at t + k + 2 for head k, IGNORE past the answer's end


def features(engine: Engine, answers: dict[str, list[int]], num_heads: int, console: Console | None = None
             ) -> Features:
    """One target forward per prompt + answer; positions from the prompt's last token to the answer's second to
    last (each has at least the next token; heads whose target lies past the end are ignored)."""
    hidden_rows, target_rows = [], []
    with progress_bar(console) as progress, torch.inference_mode():
        task = progress.add_task("hidden states", total=len(answers))
        for prompt, answer in answers.items():
            prompt_ids = engine.encode_prompt(prompt)
            tokens = prompt_ids + answer
            cache = engine.target.new_cache(1, len(tokens) + 1)
            hidden = engine.target(torch.tensor([tokens]), torch.arange(len(tokens))[None], cache)[0].float()
            first = len(prompt_ids) - 1
            positions = range(first, len(tokens) - 1)
            padded = torch.tensor(tokens + [IGNORE] * (num_heads + 1))
            targets = torch.stack([padded[t + 2:t + 2 + num_heads] for t in positions])
            hidden_rows.append(hidden[first:len(tokens) - 1])
            target_rows.append(targets)
            progress.advance(task)
    return Features(torch.cat(hidden_rows), torch.cat(target_rows))


def head_losses(heads: MedusaHeads, hidden: torch.Tensor, targets: torch.Tensor, lm_head: torch.Tensor
                ) -> torch.Tensor:
    """[K] mean cross-entropy of each head on a batch (hidden [N, H], targets [N, K], lm_head [V, H])."""
    logits = F.linear(heads.hidden(hidden), lm_head)  # [N, K, V]
    return torch.stack([F.cross_entropy(logits[:, k], targets[:, k], ignore_index=IGNORE)
                        for k in range(heads.num_heads)])


def train(heads: MedusaHeads, data: Features, lm_head: torch.Tensor, epochs: int, work_dir: Path,
          batch_size: int = 256, lr: float = 1e-3, seed: int = 0, console: Console | None = None) -> MedusaHeads:
    """AdamW with a cosine schedule; a checkpoint after each epoch, resumed from the latest one."""
    start = 0
    for epoch in range(epochs, 0, -1):
        checkpoint = work_dir / f"heads.epoch{epoch}.safetensors"
        if checkpoint.exists():
            heads = MedusaHeads.from_state(load_file(str(checkpoint)), str(checkpoint))
            start = epoch
            break
    optimizer = torch.optim.AdamW(heads.parameters(), lr=lr, weight_decay=0.0)
    steps_per_epoch = math.ceil(len(data.hidden) / batch_size)
    total = steps_per_epoch * epochs
    schedule = torch.optim.lr_scheduler.LambdaLR(
        optimizer, lambda step: 0.5 * (1 + math.cos(math.pi * min(step + start * steps_per_epoch, total) / total)))
    generator = torch.Generator().manual_seed(seed)
    with progress_bar(console) as progress:
        task = progress.add_task("training heads", total=total, completed=start * steps_per_epoch)
        for epoch in range(start, epochs):
            order = torch.randperm(len(data.hidden), generator=generator)
            for batch in order.split(batch_size):
                loss = head_losses(heads, data.hidden[batch], data.targets[batch], lm_head).sum()
                optimizer.zero_grad()
                loss.backward()
                optimizer.step()
                schedule.step()
                progress.update(task, advance=1, description=f"training heads (epoch {epoch + 1}, loss "
                                                             f"{loss.item() / heads.num_heads:.3f})")
            save_file(heads.state(), str(work_dir / f"heads.epoch{epoch + 1}.safetensors"))
    return heads


def accuracies(heads: MedusaHeads, data: Features, lm_head: torch.Tensor, batch_size: int = 512
               ) -> list[dict]:
    """Per head, over `data`: top-k accuracy (k in TOP_K) of its guess for the token at t + k + 2, and by_rank[i],
    how often its i-th most likely token is that token (what the tree builder needs), for i < RANKS."""
    hits = torch.zeros(heads.num_heads, RANKS)
    counts = torch.zeros(heads.num_heads)
    with torch.inference_mode():
        for batch in torch.arange(len(data.hidden)).split(batch_size):
            logits = F.linear(heads.hidden(data.hidden[batch]), lm_head)  # [n, K, V]
            top = logits.topk(RANKS, dim=-1).indices  # [n, K, RANKS], best first
            targets = data.targets[batch]
            valid = targets != IGNORE
            hits += ((top == targets[..., None]) & valid[..., None]).sum(0)
            counts += valid.sum(0)
    by_rank = hits / counts[:, None].clamp(min=1)
    return [{f"top{k}": float(by_rank[h, :k].sum()) for k in TOP_K}
            | {"by_rank": [round(float(x), 5) for x in by_rank[h]], "positions": int(counts[h])}
            for h in range(heads.num_heads)]


def print_accuracies(report: list[dict[str, float]], console: Console) -> None:
    table = Table(title="Medusa heads on held-out answers (the target's own tokens)")
    table.add_column("head (token)")
    for k in TOP_K:
        table.add_column(f"top-{k}", justify="right")
    table.add_column("positions", justify="right")
    for index, row in enumerate(report):
        table.add_row(f"{index} (t+{index + 2})", *(f"{row[f'top{k}']:.3f}" for k in TOP_K), str(row["positions"]))
    console.print(table)
