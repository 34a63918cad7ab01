"""Pipelines side by side from one bench run (bench.run_benches): each one's headline figures, and for every prompt
kind whose speculation was fastest."""

from __future__ import annotations

from rich.console import Console
from rich.table import Table

FIGURES = {  # report key → row label
    "speedup": "speedup (measured)",
    "predicted_speedup": "speedup (predicted)",
    "mean_accepted_length": "tokens per step",
    "acceptance_rate": "acceptance rate",
    "mean_draft_tokens_per_step": "tokens drafted per step (tree nodes)",
    "proposal_cost_per_step": "proposal cost per step (plain steps)",
    "verify_cost_ratio": "verify cost per step (plain steps)",
    "baseline_tokens_per_s": "plain tokens/s",
    "speculative_tokens_per_s": "speculative tokens/s",
}


def compare(reports: list[dict]) -> dict:
    """{pipelines, figures: {key: {pipeline: value}}, by_kind: {kind: {speedup: {pipeline: x}, winner}}, winner}."""
    names = [report["pipeline"] for report in reports]
    figures = {key: {name: report.get(key) for name, report in zip(names, reports)} for key in FIGURES}
    kinds = sorted({kind for report in reports for kind in report["by_kind"]})
    by_kind = {}
    for kind in kinds:
        speedups = {name: report["by_kind"][kind]["speedup"] for name, report in zip(names, reports)
                    if kind in report["by_kind"]}
        by_kind[kind] = {"speedup": speedups, "winner": max(speedups, key=speedups.get)}
    overall = figures["speedup"]
    return {"pipelines": names, "figures": figures, "by_kind": by_kind, "winner": max(overall, key=overall.get)}


def print_comparison(comparison: dict, console: Console | None = None) -> None:
    names = comparison["pipelines"]
    table = Table(title="side by side, one run (ratios against each pipeline's own plain decode)")
    table.add_column("figure")
    for name in names:
        table.add_column(name, justify="right")
    table.add_column("faster")
    for key, label in FIGURES.items():
        values = comparison["figures"][key]
        cells = ["" if values[name] is None else f"{values[name]:.3f}" for name in names]
        table.add_row(label, *cells, comparison["winner"] if key == "speedup" else "")
    for kind, row in comparison["by_kind"].items():
        cells = [f"{row['speedup'][name]:.3f}" if name in row["speedup"] else "" for name in names]
        table.add_row(f"speedup ({kind})", *cells, row["winner"])
    (console or Console()).print(table)
