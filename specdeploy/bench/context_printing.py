"""The context sweep (context_sweep.py) on the terminal: one column per context length; context_markdown.py writes
the same rows into report.md."""

from __future__ import annotations

from rich.console import Console
from rich.table import Table

from specdeploy.bench.context_sweep import ContextSweep


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
