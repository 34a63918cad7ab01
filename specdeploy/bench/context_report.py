"""The context sweep (bench/context_sweep.py) as a terminal table and, with --report DIR, DIR/report.md,
DIR/context.json and DIR/context.png: speedup against context length, measured and predicted, beside the plain
step's slowdown, measured and predicted by the bytes it reads."""

from __future__ import annotations

import json
from pathlib import Path

from rich.console import Console
from rich.table import Table

from specdeploy.bench.context_sweep import ContextSweep
from specdeploy.bench.report import WIDE_FIGURE, pyplot, save, versions


def rows(sweep: ContextSweep) -> list[tuple[str, list[str]]]:
    """(figure, its value at each context length): the table's rows, one column per length."""
    figures = [
        ("prompt tokens", "{:.0f}", "prompt_tokens"), ("plain tokens/s", "{:.1f}", "plain_tokens_per_s"),
        ("speculative tokens/s", "{:.1f}", "speculative_tokens_per_s"), ("speedup", "{:.2f}×", "speedup"),
        ("predicted (bytes model)", "{:.2f}×", "predicted_speedup"),
        ("tokens per step / measured costs", "{:.2f}×", "speedup_from_measured_costs"),
        ("acceptance", "{:.2f}", "acceptance_rate"), ("tokens per step", "{:.2f}", "tokens_per_step"),
        ("proposal cost per step", "{:.2f}", "proposal_cost_per_step"), ("verify cost", "{:.2f}", "verify_cost_ratio"),
        ("KV share of a plain step", "{:.0%}", "kv_share_of_plain_step"),
        ("plain step slowdown", "{:.2f}×", "plain_slowdown"),
        ("predicted plain slowdown", "{:.2f}×", "predicted_plain_slowdown")]
    return [(name, [form.format(getattr(point, key)) for point in sweep.points]) for name, form, key in figures]


def bytes_line(sweep: ContextSweep) -> str:
    draft = ("a draft-free proposer" if sweep.draft_weight_bytes is None else
             f"draft W_d {sweep.draft_weight_bytes / 1e6:.1f} MB, K_d {sweep.draft_kv_bytes_per_position / 1e3:.1f} kB")
    return (f"bytes model: target W {sweep.target_weight_bytes / 1e6:.1f} MB, K "
            f"{sweep.target_kv_bytes_per_position / 1e3:.1f} kB per position; {draft}")


def print_context_sweep(sweep: ContextSweep, console: Console | None = None) -> None:
    table = Table(title=f"specdeploy bench --context — {sweep.pipeline}: {sweep.method}, gamma="
                        f"{sweep.num_draft_tokens}, {sweep.dtype}, {sweep.prompts} prompts, {sweep.max_tokens} tokens")
    table.add_column("context")
    for point in sweep.points:
        table.add_column(str(point.context), justify="right")
    for name, values in rows(sweep):
        table.add_row(name, *values)
    console = console or Console()
    console.print(table)
    console.print(bytes_line(sweep) + f"; {sweep.machine['cpu']}, {sweep.machine['threads']} threads")


def plot_context(plt, sweep: ContextSweep, path: Path) -> None:
    points = sweep.points
    lengths = [p.prompt_tokens for p in points]
    figure, (speedups, slowdowns) = plt.subplots(1, 2, figsize=WIDE_FIGURE)
    speedups.plot(lengths, [p.speedup for p in points], marker="o", linestyle="", label="measured")
    speedups.plot(lengths, [p.predicted_speedup for p in points], label="predicted (bytes model)")
    speedups.plot(lengths, [p.speedup_from_measured_costs for p in points], linestyle="--",
                  label="tokens per step / measured costs")
    speedups.axhline(1.0, color="grey", linestyle=":")
    speedups.set_ylabel("speedup over plain decode")
    speedups.set_title(f"{sweep.pipeline}: speedup against context")
    slowdowns.plot(lengths, [p.plain_slowdown for p in points], marker="o", linestyle="", label="measured")
    slowdowns.plot(lengths, [p.predicted_plain_slowdown for p in points], label="predicted: (W + m K) / (W + m0 K)")
    slowdowns.set_ylabel("plain step time / the shortest context's")
    slowdowns.set_title("Plain decode step against context")
    for axes in (speedups, slowdowns):
        axes.set_xlabel("prompt tokens (padded with held-out text)")
        axes.legend(fontsize=8)
    save(plt, figure, path)


def write_context_report(sweep: ContextSweep, directory: Path) -> Path:
    plt = pyplot()
    directory = Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    plot_context(plt, sweep, directory / "context.png")
    (directory / "context.json").write_text(json.dumps(sweep.to_json(), indent=2))
    machine = sweep.machine
    lines = [f"# specdeploy bench --context: {sweep.pipeline}", "",
             f"{sweep.method}, gamma {sweep.num_draft_tokens}, {sweep.dtype}; {sweep.prompts} prompts, each padded "
             f"with held-out text to every length, {sweep.max_tokens} tokens per answer; {machine['cpu']}, "
             f"{machine['threads']} torch threads.", "",
             *(f"- {package} {version}" for package, version in versions().items()), "",
             "| context | " + " | ".join(str(point.context) for point in sweep.points) + " |",
             "|---|" + "---|" * len(sweep.points),
             *(f"| {name} | " + " | ".join(values) + " |" for name, values in rows(sweep)), "",
             f"{bytes_line(sweep)}. Costs are in plain steps at each length; the prediction carries the shortest "
             "length's costs to the others by the bytes each step reads (bench/context_sweep.py).", "",
             "![Speedup and plain step against context](context.png)", ""]
    path = directory / "report.md"
    path.write_text("\n".join(lines))
    return path
