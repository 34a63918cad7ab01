"""EAGLE-3 self-distillation on the frozen target, with training-time test.

Data: the target's greedy answers to the training prompts (training/medusa.generate_answers, cached in the work
directory), then one target forward over each prompt + answer keeping the hidden states entering the head's three
layers (the features, [T, 3H]) and the final normed hidden states ([T, H], whose product with the LM head's rows
of the draft vocabulary gives the target's distribution the head learns).

Training-time test (as EAGLE-3 trains): step 0 feeds the head the target's features; step j > 0 feeds it its own
previous output (the pre-norm state) with the next true token, exactly as drafting depth j + 1 sees it. At step j
the pair at index t sits at position t + j and attends to the step-0 pairs at indices ≤ t (the committed text) and
to the pairs of steps 1..j at index t only (its ancestors in a drafted chain). Step j's loss is the cross-entropy
against the target's distribution over the draft vocabulary (renormalised there) for the token at t + j + 2,
weighted 0.8^j, on answer positions only.

The draft vocabulary: the `size` target tokens most frequent in the training answers (and prompts), as EAGLE-3 picks
its own from its data.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from pathlib import Path

import torch
import torch.nn.functional as F
from safetensors.torch import load_file, save_file

from specdeploy.speculative.eagle_head import Eagle3Head
from specdeploy.training.eagle_data import Sample, ShardedSamples
from specdeploy.training.loop import LoopSettings, latest_checkpoint, run_epochs
from specdeploy.training.plots import optional_pyplot

STEP_WEIGHT = 0.8  # EAGLE-3's decay of the loss over training-time-test steps


def collect(target, sequences: list[tuple[list[int], int]], feature_layers: tuple[int, ...],
            on_progress: Callable[[], None] | None = None) -> list[Sample]:
    """sequences: (prompt + answer ids, index of the prompt's last token). One target forward each."""
    samples = []
    with torch.inference_mode():
        for tokens, first in sequences:
            cache = target.new_cache(1, len(tokens) + 1)
            forward = target(torch.tensor([tokens]), torch.arange(len(tokens))[None], cache,
                             capture=tuple(feature_layers))
            samples.append(Sample(torch.tensor(tokens), forward.captured[0].to(torch.bfloat16).clone(),
                                  forward.hidden[0].to(torch.bfloat16), first))
            if on_progress is not None:
                on_progress()
    return samples


def padded_batch(samples: list[Sample]) -> dict[str, torch.Tensor]:
    """Samples padded to the longest: tokens [b, L]; features [b, L, 3H]; final [b, L, H]; answer [b, L] bool (the
    token at that index is an answer token the target produced)."""
    length = max(len(s.tokens) for s in samples)
    tokens = torch.zeros(len(samples), length, dtype=torch.long)
    features = torch.zeros(len(samples), length, samples[0].features.shape[1], dtype=torch.bfloat16)
    final = torch.zeros(len(samples), length, samples[0].final.shape[1], dtype=torch.bfloat16)
    answer = torch.zeros(len(samples), length, dtype=torch.bool)
    for i, s in enumerate(samples):
        n = len(s.tokens)
        tokens[i, :n], features[i, :n], final[i, :n] = s.tokens, s.features, s.final
        answer[i, s.first + 1:n] = True
    return {"tokens": tokens, "features": features, "final": final, "answer": answer}


def ttt_forward(head: Eagle3Head, batch: dict[str, torch.Tensor], embed: torch.Tensor, draft_rows: torch.Tensor,
                steps: int) -> tuple[torch.Tensor, list[dict[str, float]]]:
    """The weighted loss over `steps` training-time-test steps, and per step: loss, how often the head's top token
    is the target's own (the answer's next token) and the count of positions (a dict per step). draft_rows: the
    target LM head's rows of the draft vocabulary [Vd, H]; embed: the target's embedding table [V, H]."""
    tokens, answer = batch["tokens"], batch["answer"]
    b, length = tokens.shape
    with torch.no_grad():  # the target's distributions over the draft vocabulary at every position, [b, L, Vd]
        target_p = F.linear(batch["final"].float(), draft_rows.float()).softmax(-1)
    draft_to_target = head.draft_to_target
    index = torch.arange(length)
    causal = index[None, :] <= index[:, None]  # [L, L]
    hidden = head.fuse_features(batch["features"].float())  # [b, L, H]
    keys, values = [], []  # per step: [b, kv_heads, L, D]
    total = torch.zeros(())
    report = []
    c = head.config
    group = c.num_heads // c.num_kv_heads
    scale = 1.0 / math.sqrt(c.head_dim)
    for step in range(steps):
        # index t: the pair (state, x_(t+step+1)) at position t + step, predicting x_(t+step+2)
        next_tokens = torch.cat([tokens[:, step + 1:], tokens.new_zeros(b, step + 1)], dim=1)
        positions = (index + step).clamp(max=head.rotations.shape[1] - 1)[None].expand(b, -1)
        projected = head.project(embed[next_tokens].float(), hidden, positions)
        keys.append(projected.k.repeat_interleave(group, dim=1))
        values.append(projected.v.repeat_interleave(group, dim=1))
        q = projected.q.transpose(1, 2)  # [b, heads, L, D]
        committed = (q @ keys[0].transpose(-1, -2)) * scale  # [b, heads, L, L]
        committed = committed.masked_fill(~causal, float("-inf"))
        own = [(q * k).sum(-1, keepdim=True) * scale for k in keys[1:]]  # [b, heads, L, 1] each: the diagonal
        weights = torch.cat([committed, *own], dim=-1).softmax(-1)
        attended = weights[..., :length] @ values[0]
        for j, v in enumerate(values[1:]):
            attended = attended + weights[..., length + j:length + j + 1] * v
        normed, prenorm = head.finish(attended.transpose(1, 2).flatten(2), projected.residual)
        logits = head.logits(normed)  # [b, L, Vd]
        # the prediction at index t is of token t + step + 2, the target's distribution at position t + step + 1
        shift = step + 1
        valid = torch.zeros(b, length, dtype=torch.bool)
        valid[:, :length - shift - 1] = answer[:, shift + 1:]
        target = torch.zeros_like(target_p)
        target[:, :length - shift] = target_p[:, shift:]
        log_q = logits.log_softmax(-1)
        per_position = -(target * log_q).sum(-1)  # [b, L]
        count = int(valid.sum())
        loss = (per_position * valid).sum() / max(count, 1)
        total = total + STEP_WEIGHT ** step * loss
        # agreement with the token the target chose (its greedy answer): a token outside the draft vocabulary is a
        # miss, as it is when drafting
        agree = torch.zeros(b, length, dtype=torch.bool)
        drafted = draft_to_target[logits.argmax(-1)[:, :length - shift - 1]]
        agree[:, :length - shift - 1] = drafted == tokens[:, shift + 1:]
        report.append({"loss": float(loss.detach()), "top1": float((agree & valid).sum()) / max(count, 1),
                       "positions": count})
        hidden = prenorm
    return total, report


def chain_acceptance(head: Eagle3Head, samples: Sequence[Sample], embed: torch.Tensor, draft_rows: torch.Tensor,
                     steps: int, batch_size: int = 8, autocast: bool = False) -> list[dict[str, float]]:
    """On held-out samples, per drafting depth j + 1: how often the head's top-1 equals the target's top token
    (given the true tokens before it), and the loss."""
    totals = [{"loss": 0.0, "top1": 0.0, "positions": 0} for _ in range(steps)]
    with torch.no_grad():
        for start in range(0, len(samples), batch_size):
            batch = [samples[i] for i in range(start, min(start + batch_size, len(samples)))]
            with torch.autocast("cpu", dtype=torch.bfloat16, enabled=autocast):
                _, report = ttt_forward(head, padded_batch(batch), embed, draft_rows, steps)
            for total, step in zip(totals, report):
                total["loss"] += step["loss"] * step["positions"]
                total["top1"] += step["top1"] * step["positions"]
                total["positions"] += step["positions"]
    return [{"depth": j + 1, "loss": round(t["loss"] / max(t["positions"], 1), 4),
             "top1": round(t["top1"] / max(t["positions"], 1), 4), "positions": t["positions"]}
            for j, t in enumerate(totals)]


def train(head: Eagle3Head, samples: Sequence[Sample], embed: torch.Tensor, draft_rows: torch.Tensor, steps: int,
          epochs: int, work_dir: Path, batch_size: int = 8, lr: float = 3e-4, seed: int = 0,
          on_step: Callable[[int, int, float], None] | None = None,
          autocast: bool = False) -> tuple[Eagle3Head, list[float]]:
    """training/loop.py with a warm-up over the first 5 % of steps and gradients clipped to 0.5; a checkpoint after
    each epoch (head.epoch<N>.safetensors in work_dir), resumed from the latest. on_step(done, total, loss) reports
    progress. autocast: the head's matmuls in bf16 (fp32 weights and losses). Returns the head and the mean loss of
    each epoch run here."""
    checkpoint, start = latest_checkpoint(lambda epoch: work_dir / f"head.epoch{epoch}.safetensors", epochs)
    if checkpoint is not None:
        head = Eagle3Head.from_state(head.config, load_file(str(checkpoint)), str(checkpoint))

    def batch_loss(batch: torch.Tensor) -> torch.Tensor:
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=autocast):
            return ttt_forward(head, padded_batch([samples[i] for i in batch.tolist()]), embed, draft_rows, steps)[0]

    def after_epoch(epoch: int, loss: float) -> None:
        work_dir.mkdir(parents=True, exist_ok=True)
        save_file(head.state(torch.float32), str(work_dir / f"head.epoch{epoch}.safetensors"))

    settings = LoopSettings(epochs, batch_size, lr, seed, warmup_fraction=0.05, clip=0.5)
    lengths = samples.lengths() if isinstance(samples, ShardedSamples) else [len(s.tokens) for s in samples]
    return head, run_epochs(head, len(samples), settings, batch_loss, after_epoch, start, on_step, lengths)


def write_plot(report: dict, path: Path) -> bool:
    """training.png: loss by epoch and held-out top-1 agreement by drafting depth; False without matplotlib."""
    plt = optional_pyplot()
    if plt is None:
        return False
    figure, (left, right) = plt.subplots(1, 2, figsize=(10, 4))
    epochs = report["epoch_losses"]
    left.plot(range(1, len(epochs) + 1), epochs, marker="o")
    left.set(xlabel="epoch", ylabel="weighted TTT loss", title="training loss")
    depths = report["held_out"]
    right.bar([d["depth"] for d in depths], [d["top1"] for d in depths])
    right.set(xlabel="drafting depth", ylabel="top-1 = target's token", ylim=(0, 1),
              title="held-out agreement by depth")
    figure.tight_layout()
    figure.savefig(path, dpi=120)
    plt.close(figure)
    return True
