"""The plots of `bench ... --report DIR` (matplotlib, the `report` extra), and the figure set-up every report's plots
share (the server's in server_markdown.py, the context sweep's in context_markdown.py).

The in-process bench's PNGs, which markdown.py puts in DIR/report.md:
- speedup.png: speedup against gamma per method. Points are measured; the solid line is the prediction from the
  measured acceptance by position, c and v (1 + sum of p_i for i <= gamma over gamma c + v), the dashed one the
  seed's formula with the overall acceptance alpha; a Medusa tree has its own prediction (one point).
- acceptance.png: acceptance by draft position (Medusa: by tree depth, which is the head).
- tokens_by_kind.png: plain and speculative tokens/s per prompt kind for each pipeline.
- moe-PIPELINE.png (MoE pipelines): distinct experts touched and verify cost against verification length, beside the
  dense model's verify cost.
"""

from __future__ import annotations

from itertools import accumulate
from pathlib import Path

from specdeploy.bench.results import BenchReport, MoeCurve
from specdeploy.errors import SpecdeployError
from specdeploy.speculative.speedup import predicted_speedup, predicted_speedups

FIGURE_SIZE = (7.5, 4.5)
WIDE_FIGURE = (11.5, 4.8)  # room for a legend beside the axes
DPI = 120


def pyplot():
    """matplotlib's pyplot on the file-only Agg backend; a clear error when the extra is not installed."""
    try:
        import matplotlib
    except ImportError:
        raise SpecdeployError("--report draws its plots with matplotlib: pip install 'specdeploy[report]'") from None
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def gamma_curves(report: BenchReport) -> dict[str, dict[int, float]]:
    """Predicted speedup by gamma, as the lines of the speedup plot.
    - by_position: from the measured acceptance by position, c and v, up to the measured gamma (a constant
      schedule drafts every position each step; an MoE's verify cost is its measured union curve).
    - formula: the seed's formula with the overall alpha up to twice the gamma (not for an MoE, whose verify cost
      grows with the verification length).
    With the report's verify_costs (a forward over n + 1 positions, in plain steps), v at each gamma follows that
    curve, scaled to pass through the v measured at the served gamma; without them v is the same at every gamma."""
    summary, setup = report.summary, report.setup
    c, v = summary.draft_cost_ratio, summary.verify_cost_ratio
    positions = summary.per_position_acceptance
    curves: dict[str, dict[int, float]] = {"by_position": {}, "formula": {}}
    if report.moe is not None:
        curves["by_position"] = dict(enumerate(report.moe.predicted_speedup_by_gamma or [], start=1))
        return curves
    top = max(2 * max(setup.num_draft_tokens, 1), 8)
    widths = [v] * (top + 1)
    if report.verify_costs:
        # a wider forward never costs less: the running maximum keeps timing noise from bending the lines down
        costs = list(accumulate(report.verify_costs, max))
        served = round(measured_gamma(report))
        if isinstance(setup.gamma_cap, int):  # v was measured at the capped gamma
            served = min(served, setup.gamma_cap)
        served = min(max(served, 0), len(costs) - 1)
        widths = [v * cost / costs[served] for cost in costs]
        top = len(costs) - 1
    if setup.schedule == "constant" and positions:
        curves["by_position"] = dict(enumerate(predicted_speedups(positions, c, widths[:len(positions) + 1]),
                                               start=1))
    curves["formula"] = {g: predicted_speedup(summary.acceptance_rate, g, c, widths[g]) for g in range(1, top + 1)}
    return curves


def measured_gamma(report: BenchReport) -> float:
    """Where the measured point sits: the gamma, or the mean proposal length under an adaptive schedule."""
    if report.setup.schedule != "constant":
        return report.summary.mean_draft_tokens_per_step
    return report.setup.num_draft_tokens


def plot_speedup(plt, reports: list[BenchReport], path: Path) -> None:
    figure, axes = plt.subplots(figsize=WIDE_FIGURE)
    for index, report in enumerate(reports):
        color, label, summary = f"C{index}", report.label, report.summary
        if report.medusa is not None:  # a tree: one point, not a line over gamma
            size = report.medusa.tree_size
            axes.scatter([size], [summary.predicted_speedup], marker="x", color=color,
                         label=f"{label}: predicted, tree of {size} nodes")
            axes.scatter([size], [summary.speedup], color=color, zorder=3, label=f"{label}: measured")
            continue
        curves = gamma_curves(report)
        if curves["by_position"]:
            axes.plot(list(curves["by_position"]), list(curves["by_position"].values()), color=color,
                      label=f"{label}: predicted from acceptance by position")
        if curves["formula"]:
            axes.plot(list(curves["formula"]), list(curves["formula"].values()), color=color, linestyle="--",
                      alpha=0.6, label=f"{label}: seed formula, alpha {summary.acceptance_rate:.2f}")
        if report.gamma_sweep:
            axes.scatter(list(report.gamma_sweep), list(report.gamma_sweep.values()), color=color, marker="^",
                         zorder=3, label=f"{label}: measured at other gammas")
        schedule = "" if report.setup.schedule == "constant" else " (mean proposal length)"
        axes.scatter([measured_gamma(report)], [summary.speedup], color=color, zorder=3,
                     label=f"{label}: measured{schedule}")
    axes.axhline(1.0, color="grey", linewidth=0.8)
    whole_number_ticks(axes.xaxis)
    axes.set_xlabel("gamma (drafted tokens per step; Medusa: tree nodes)")
    axes.set_ylabel("speedup over plain decode (×)")
    axes.set_title("Speedup against gamma: measured points, predicted lines (above 1: speculation pays)")
    axes.legend(fontsize=7, loc="upper left", bbox_to_anchor=(1.01, 1.0))
    save(plt, figure, path)


def plot_acceptance(plt, reports: list[BenchReport], path: Path) -> None:
    figure, axes = plt.subplots(figsize=FIGURE_SIZE)
    width = 0.8 / max(len(reports), 1)
    for index, report in enumerate(reports):
        positions = report.summary.per_position_acceptance
        xs = [p + 1 + (index - (len(reports) - 1) / 2) * width for p in range(len(positions))]
        axes.bar(xs, positions, width=width, label=report.label, color=f"C{index}")
    whole_number_ticks(axes.xaxis)
    axes.set_xlabel("draft position (Medusa: tree depth = head)")
    axes.set_ylabel("fraction of steps accepting it")
    axes.set_ylim(0, 1)
    axes.set_title("Acceptance by draft position")
    axes.legend(fontsize=8)
    save(plt, figure, path)


def plot_kinds(plt, reports: list[BenchReport], path: Path) -> None:
    kinds = sorted({kind for report in reports for kind in report.summary.by_kind})
    figure, axes = plt.subplots(figsize=WIDE_FIGURE)
    bars = [(number, report, mode) for number, report in enumerate(reports) for mode in ("plain", "speculative")]
    width = 0.8 / max(len(bars), 1)
    for index, (number, report, mode) in enumerate(bars):
        by_kind = report.summary.by_kind
        values = [0.0 if kind not in by_kind else
                  by_kind[kind].plain_tokens_per_s if mode == "plain" else by_kind[kind].speculative_tokens_per_s
                  for kind in kinds]
        xs = [k + (index - (len(bars) - 1) / 2) * width for k in range(len(kinds))]
        axes.bar(xs, values, width=width, color=f"C{number}", alpha=0.45 if mode == "plain" else 1.0,
                 label=f"{report.label}, {mode}")
    axes.set_xticks(range(len(kinds)), kinds)
    axes.set_xlabel("prompt kind")
    axes.set_ylabel("decode tokens/s")
    axes.set_title("Tokens per second by prompt kind (light: plain decode)")
    axes.legend(fontsize=7, loc="upper left", bbox_to_anchor=(1.01, 1.0))
    save(plt, figure, path)


def plot_moe(plt, curve: MoeCurve, path: Path) -> None:
    figure, (experts, cost) = plt.subplots(1, 2, figsize=(FIGURE_SIZE[0] * 1.4, FIGURE_SIZE[1]))
    lengths = curve.verification_length
    experts.plot(lengths, curve.distinct_experts_per_layer, marker="o")
    experts.axhline(curve.num_experts, color="grey", linestyle=":", label=f"all {curve.num_experts} experts")
    experts.set_xlabel("verification length (tokens)")
    experts.set_ylabel("distinct experts per layer")
    experts.set_ylim(0, curve.num_experts * 1.08)
    experts.set_title(f"Experts touched ({curve.experts_per_token} per token)")
    experts.legend(fontsize=8)
    cost.plot(lengths, curve.verify_cost, marker="o", label="MoE target")
    if curve.dense_verify_cost is not None:
        cost.plot(lengths, curve.dense_verify_cost, marker="s", linestyle="--", label="dense model it came from")
    for axes in (experts, cost):
        whole_number_ticks(axes.xaxis)
    cost.set_xlabel("verification length (tokens)")
    cost.set_ylabel("forward time / plain decode step")
    cost.set_title("Verify cost")
    cost.legend(fontsize=8)
    save(plt, figure, path)


def whole_number_ticks(axis) -> None:
    """Ticks only at whole numbers: gammas, positions and lengths have no 1.5."""
    from matplotlib.ticker import MaxNLocator

    axis.set_major_locator(MaxNLocator(integer=True))


def save(plt, figure, path: Path) -> None:
    figure.tight_layout()
    figure.savefig(path, dpi=DPI)
    plt.close(figure)
