"""Pipelines side by side from one bench run (bench.run.run_benches): each one's headline figures, and for every
prompt kind whose speculation was fastest."""

from __future__ import annotations

from rich.console import Console
from rich.table import Table

from specdeploy.bench.peers import llama_cpp_ratio
from specdeploy.bench.results import BenchReport
from specdeploy.spec.prompt_sets import OPEN_ENDED

LABELS = {  # figure → row label
    "speedup": "speedup (measured)",
    "predicted_speedup": "speedup (predicted)",
    "mean_accepted_length": "tokens per step",
    "acceptance_rate": "acceptance rate",
    "mean_draft_tokens_per_step": "tokens drafted per step (tree nodes)",
    "proposal_cost_per_step": "proposal cost per step (plain steps)",
    "verify_cost_ratio": "verify cost per step (plain steps)",
    "baseline_tokens_per_s": "plain tokens/s",
    "speculative_tokens_per_s": "speculative tokens/s",
    "plain_vs_llama_cpp": "plain ÷ llama.cpp plain",
    "speculative_vs_llama_cpp": "speculative ÷ llama.cpp plain",
    "open_speculative_vs_llama_cpp": "speculative ÷ llama.cpp plain (open-ended)",
}


def headline_figures(report: BenchReport) -> dict[str, float | None]:
    """The figures compared, named as in the report's JSON; against llama.cpp: None where bench --peers did not
    measure it."""
    summary, every, open_ended = report.summary, llama_cpp_ratio(report), llama_cpp_ratio(report, OPEN_ENDED)
    return {"speedup": summary.speedup, "predicted_speedup": summary.predicted_speedup,
            "mean_accepted_length": summary.mean_accepted_length, "acceptance_rate": summary.acceptance_rate,
            "mean_draft_tokens_per_step": summary.mean_draft_tokens_per_step,
            "proposal_cost_per_step": summary.proposal_cost_per_step,
            "verify_cost_ratio": summary.verify_cost_ratio, "baseline_tokens_per_s": summary.baseline_tokens_per_s,
            "speculative_tokens_per_s": summary.speculative_tokens_per_s,
            "plain_vs_llama_cpp": every and every.ours_plain,
            "speculative_vs_llama_cpp": every and every.ours_speculative,
            "open_speculative_vs_llama_cpp": open_ended and open_ended.ours_speculative}


def compare(reports: list[BenchReport]) -> dict:
    """{pipelines, figures: {figure: {pipeline: value}}, by_kind: {kind: {speedup: {pipeline: x}, winner}}, winner}:
    what `bench --json` writes for several pipelines, beside their reports."""
    names = [report.setup.pipeline for report in reports]
    each = [headline_figures(report) for report in reports]
    figures = {key: {name: values[key] for name, values in zip(names, each)} for key in LABELS}
    kinds = sorted({kind for report in reports for kind in report.summary.by_kind})
    by_kind = {}
    for kind in kinds:
        speedups = {name: report.summary.by_kind[kind].speedup for name, report in zip(names, reports)
                    if kind in report.summary.by_kind}
        by_kind[kind] = {"speedup": speedups, "winner": max(speedups, key=speedups.get)}
    overall = figures["speedup"]
    machine = reports[0].setup.machine
    return {"pipelines": names, "machine": f"{machine.cpu}, {machine.threads} threads", "figures": figures,
            "by_kind": by_kind, "winner": max(overall, key=overall.get)}


def print_comparison(comparison: dict, console: Console | None = None) -> None:
    names = comparison["pipelines"]
    table = Table(title=f"side by side, one run on {comparison.get('machine', 'this machine')} (speedups against "
                        f"each pipeline's own plain decode)")
    table.add_column("figure")
    for name in names:
        table.add_column(name, justify="right")
    table.add_column("faster")
    for key, label in LABELS.items():
        values = comparison["figures"][key]
        if all(value is None for value in values.values()):
            continue  # llama.cpp not measured
        cells = ["" if values[name] is None else f"{values[name]:.3f}" for name in names]
        table.add_row(label, *cells, comparison["winner"] if key == "speedup" else "")
    for kind, row in comparison["by_kind"].items():
        cells = [f"{row['speedup'][name]:.3f}" if name in row["speedup"] else "" for name in names]
        table.add_row(f"speedup ({kind})", *cells, row["winner"])
    (console or Console()).print(table)
