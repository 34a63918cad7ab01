"""`specdeploy bench ... --report DIR`: the in-process bench as a self-contained report a reader can look at.

DIR/report.md names the machine, threads, dtype, versions and pipelines and lists every figure; the PNG plots
beside it (matplotlib, the `report` extra) show:
- speedup.png: speedup against gamma per method. Points are measured; the solid line is the prediction from the
  measured acceptance by position, c and v (1 + sum of p_i for i <= gamma over gamma c + v), the dashed one the
  seed's formula with the overall acceptance alpha; a Medusa tree has its own prediction (one point).
- acceptance.png: acceptance by draft position (Medusa: by tree depth, which is the head).
- tokens_by_kind.png: plain and speculative tokens/s per prompt kind for each pipeline.
- moe.png (MoE pipelines): distinct experts touched and verify cost against verification length, beside the
  dense model's verify cost.
"""

from __future__ import annotations

import json
import platform
from dataclasses import asdict
from importlib import metadata
from itertools import accumulate
from pathlib import Path

from specdeploy.bench.bench_report import BenchReport, MoeCurve
from specdeploy.bench.peers import LLAMA_CPP, peer_ratios
from specdeploy.bench.printing import phases_text
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


def versions() -> dict[str, str]:
    found = {"python": platform.python_version()}
    for package in ("specdeploy", "torch", "transformers", "nvidia-pytriton", "llama-cpp-python"):
        try:
            found[package] = metadata.version(package)
        except metadata.PackageNotFoundError:
            found[package] = "not installed"
    return found


def figure_row(name: str, form: str, values: list) -> str:
    """A figures-table row: each report's value in `form`, – where it has none."""
    return f"| {name} | " + " | ".join("–" if value is None else form.format(value) for value in values) + " |"


def figures_table(reports: list[BenchReport]) -> list[str]:
    summaries, setups = [r.summary for r in reports], [r.setup for r in reports]
    return ["| figure | " + " | ".join(r.label for r in reports) + " |", "|---|" + "---|" * len(reports),
            figure_row("plain decode tokens/s", "{:.1f}", [s.baseline_tokens_per_s for s in summaries]),
            figure_row("speculative tokens/s", "{:.1f}", [s.speculative_tokens_per_s for s in summaries]),
            figure_row("speedup", "{:.2f}×", [s.speedup for s in summaries]),
            figure_row("predicted speedup", "{:.2f}×", [s.predicted_speedup for s in summaries]),
            figure_row("acceptance rate", "{:.2f}", [s.acceptance_rate for s in summaries]),
            figure_row("mean accepted length (tokens/step)", "{:.2f}", [s.mean_accepted_length for s in summaries]),
            figure_row("draft cost c", "{:.3f}", [s.draft_cost_ratio for s in summaries]),
            figure_row("verify cost v", "{:.2f}", [s.verify_cost_ratio for s in summaries]),
            figure_row("gamma", "{}", [s.num_draft_tokens for s in setups]),
            figure_row("gamma cap (serving.policy)", "{}", [s.gamma_cap for s in setups]),
            figure_row("dtype", "{}", [s.dtype for s in setups]),
            figure_row("temperature", "{}", [s.temperature for s in setups]),
            figure_row("max tokens", "{}", [s.max_tokens for s in setups]),
            figure_row("prompts", "{}", [s.prompts for s in setups]),
            figure_row("greedy output equal to plain", "{}", [r.greedy and r.greedy.greedy_match for r in reports]),
            figure_row("transformers generate tokens/s", "{:.1f}",
                [r.transformers and r.transformers.transformers_tokens_per_s for r in reports])] + cost_rows(reports)


def cost_rows(reports: list[BenchReport]) -> list[str]:
    """The figures table's cost rows (bench --price-per-hour), none when no report has a price."""
    if all(report.cost is None for report in reports):
        return []
    costs = [report.cost for report in reports]
    return [figure_row("machine price per hour", "${:.2f}", [cost and cost.price_per_hour for cost in costs]),
            figure_row("plain decode, per million output tokens", "${:.2f}",
                [cost and cost.plain_usd_per_million_tokens for cost in costs]),
            figure_row("speculative, per million output tokens", "${:.2f}",
                [cost and cost.speculative_usd_per_million_tokens for cost in costs])]


def peer_lines(reports: list[BenchReport]) -> list[str]:
    """The Peers section: each peer's tokens/s and ours over theirs, from the same run; where a peer is faster."""
    lines = []
    for report in reports:
        if report.peers is None:
            continue
        ratios = peer_ratios(report)
        lines += [f"## Peers: {report.label}", "", "Measured in the same run on the same weights and prompts, greedy.",
                  "", "| peer | configuration | tokens/s | ours plain ÷ peer | ours speculative ÷ peer |",
                  "|---|---|---|---|---|"]
        for name, peer in report.peers.items():
            if peer.skipped is not None:
                lines.append(f"| {name} | skipped: {peer.skipped} | – | – | – |")
                continue
            ratio = ratios[name]
            what = peer.what
            if peer.common_prefix_tokens is not None:
                what += f"; its greedy output follows ours for {peer.common_prefix_tokens:.1f} tokens on average"
            lines.append(f"| {name} | {what} | {peer.tokens_per_s:.1f} | {ratio.ours_plain:.2f}× | "
                         f"{ratio.ours_speculative:.2f}× |")
        faster = [name for name, ratio in ratios.items() if ratio.ours_speculative < 1]
        lines += ["", (f"Faster than our speculative decoding here: {', '.join(faster)}." if faster else
                       "No peer was faster than our speculative decoding here."), ""]
    return lines


def llama_cpp_lines(report: BenchReport) -> list[str]:
    """Ours against llama.cpp's plain decode by prompt kind, in the same run (none without that peer)."""
    peer = (report.peers or {}).get(LLAMA_CPP)
    if peer is None or not peer.tokens_per_s:
        return []
    summary = report.summary
    rows = [(kind, v.plain_tokens_per_s, v.speculative_tokens_per_s, (peer.by_kind or {}).get(kind))
            for kind, v in summary.by_kind.items()]
    rows.append(("all", summary.baseline_tokens_per_s, summary.speculative_tokens_per_s, peer.tokens_per_s))
    lines = [f"## Against llama.cpp's plain decode: {report.label}", "",
             "| prompt kind | ours plain | ours speculative | llama.cpp plain | plain ÷ llama.cpp | speculative ÷ "
             "llama.cpp | speculative ÷ our plain |", "|---|---|---|---|---|---|---|"]
    for kind, plain, speculative, theirs in rows:
        against = ("–", "–") if not theirs else (f"{plain / theirs:.2f}×", f"{speculative / theirs:.2f}×")
        lines.append(f"| {kind} | {plain:.1f} | {speculative:.1f} | {'–' if not theirs else f'{theirs:.1f}'} | "
                     f"{against[0]} | {against[1]} | {speculative / plain:.2f}× |")
    return lines + [""]


def footprint_lines(report: BenchReport) -> list[str]:
    """What the engine costs beside its speed: size, build, load, first request and memory (bench/footprint.py)."""
    footprint = report.footprint
    if footprint is None:
        return []

    def seconds(value: float | None) -> str:
        return "–" if value is None else f"{value:.1f} s"

    theirs = (f"{footprint.llama_cpp_peak_rss_bytes / 2**20:.0f} MiB" if footprint.llama_cpp_peak_rss_bytes
              else f"skipped: {footprint.llama_cpp_skipped}")
    ratio = footprint.rss_vs_llama_cpp
    return [f"## Footprint: {report.label}", "",
            "Build figures are what the build recorded; the rest ran in fresh processes (the first prompt).", "",
            "| engine size | build | compiling steps | measuring the gamma cap | load | first token | first request | "
            "peak resident memory | llama.cpp's | ours ÷ llama.cpp's |", "|---|---|---|---|---|---|---|---|---|---|",
            f"| {footprint.engine_bytes / 2**20:.0f} MiB | {seconds(footprint.build_seconds)} | "
            f"{seconds(footprint.compile_seconds)} | {seconds(footprint.gamma_cap_seconds)} | "
            f"{seconds(footprint.load_seconds)} | {seconds(footprint.first_token_seconds)} | "
            f"{seconds(footprint.first_request_seconds)} | {footprint.peak_rss_bytes / 2**20:.0f} MiB | {theirs} | "
            f"{'–' if ratio is None else f'{ratio:.2f}×'} |", ""]


def write_report(reports: list[BenchReport], directory: Path, pipelines: list[str]) -> Path:
    """Write DIR/report.md, the plots and DIR/reports.json for the in-process bench `reports` (one per pipeline,
    measured in one run). Returns the report.md path."""
    plt = pyplot()
    directory = Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    machine = reports[0].setup.machine
    plots = {"speedup.png": "Speedup against gamma", "acceptance.png": "Acceptance by draft position",
             "tokens_by_kind.png": "Tokens per second by prompt kind"}
    plot_speedup(plt, reports, directory / "speedup.png")
    plot_acceptance(plt, reports, directory / "acceptance.png")
    plot_kinds(plt, reports, directory / "tokens_by_kind.png")
    for report in reports:
        if report.moe is not None:
            name = f"moe-{report.setup.pipeline}.png"
            plot_moe(plt, report.moe, directory / name)
            plots[name] = f"MoE: experts touched and verify cost ({report.setup.pipeline})"
    (directory / "reports.json").write_text(json.dumps([r.to_json() for r in reports], indent=2))
    lines = ["# specdeploy bench report", "",
             f"Pipelines: {', '.join(f'`{p}`' for p in pipelines)}, measured in one run, prompt by prompt, each "
             f"decoded plain and with speculation.", "",
             "## Machine", "",
             *(f"- {key}: {value}" for key, value in asdict(machine).items()),
             f"- torch threads: {reports[0].setup.threads}",
             *(f"- {package} {version}" for package, version in versions().items()), "",
             "## Time spent (seconds)", "",
             *(f"- {r.label}: {phases_text(r.phase_seconds)}" for r in reports if r.phase_seconds), "",
             "## Figures", "", *figures_table(reports), ""]
    for report in reports:
        lines += [f"### {report.label} by prompt kind", "", "| kind | prompts | plain tokens/s | speculative "
                  "tokens/s | speedup |", "|---|---|---|---|---|"]
        lines += [f"| {kind} | {v.prompts} | {v.plain_tokens_per_s:.1f} | {v.speculative_tokens_per_s:.1f} "
                  f"| {v.speedup:.2f}× |" for kind, v in report.summary.by_kind.items()]
        positions = report.summary.per_position_acceptance
        lines += ["", "Acceptance by position: " + ", ".join(f"{p:.2f}" for p in positions), ""]
    lines += peer_lines(reports)
    for report in reports:
        lines += llama_cpp_lines(report) + footprint_lines(report)
    lines += ["## Plots", ""] + [f"### {title}\n\n![{title}]({name})\n" for name, title in plots.items()]
    path = directory / "report.md"
    path.write_text("\n".join(lines))
    return path
