"""`specdeploy bench ... --report DIR`: the in-process bench as a self-contained report a reader can look at.

DIR/report.md names the machine, threads, dtype, versions and pipelines and lists every figure, with the plots
beside it (plots.py) and every report's JSON in DIR/reports.json.
"""

from __future__ import annotations

import json
import platform
from dataclasses import asdict
from importlib import metadata
from pathlib import Path

from specdeploy.bench.comparison import headline_figures
from specdeploy.bench.peers import LLAMA_CPP, llama_cpp_ratio, peer_ratios
from specdeploy.bench.plots import plot_acceptance, plot_kinds, plot_moe, plot_speedup, pyplot
from specdeploy.bench.printing import phases_text, why_below_target
from specdeploy.bench.results import BenchReport


def versions() -> dict[str, str]:
    """Python's and the measured packages' versions, which every report.md lists (server_markdown.py and
    context_markdown.py too), so that two reports can be told apart by what they ran."""
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
                [r.transformers and r.transformers.transformers_tokens_per_s for r in reports]),
            *llama_cpp_rows(reports)] + cost_rows(reports)


def llama_cpp_rows(reports: list[BenchReport]) -> list[str]:
    """Every pipeline against llama.cpp's plain decode of its GGUF (bench --peers), on every prompt and on the
    open-ended ones: the comparison's figures (comparison.headline_figures); none where no report measured it."""
    figures = [headline_figures(r) for r in reports]
    rows = {"plain_vs_llama_cpp": "plain ÷ llama.cpp plain",
            "speculative_vs_llama_cpp": "speculative ÷ llama.cpp plain",
            "open_speculative_vs_llama_cpp": "speculative ÷ llama.cpp plain, open-ended prompts"}
    if all(f["plain_vs_llama_cpp"] is None for f in figures):
        return []
    return [figure_row(label, "{:.2f}×", [f[key] for f in figures]) for key, label in rows.items()]


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
    overall = llama_cpp_ratio(report)
    if overall is None:
        return []
    peer, summary = report.peers[LLAMA_CPP], report.summary
    rows = [(kind, v.plain_tokens_per_s, v.speculative_tokens_per_s, (peer.by_kind or {}).get(kind),
             llama_cpp_ratio(report, kind)) for kind, v in summary.by_kind.items()]
    rows.append(("all", summary.baseline_tokens_per_s, summary.speculative_tokens_per_s, peer.tokens_per_s, overall))
    lines = [f"## Against llama.cpp's plain decode: {report.label}", "",
             "| prompt kind | ours plain | ours speculative | llama.cpp plain | plain ÷ llama.cpp | speculative ÷ "
             "llama.cpp | speculative ÷ our plain |", "|---|---|---|---|---|---|---|"]
    for kind, plain, speculative, theirs, ratio in rows:
        against = ("–", "–") if ratio is None else (f"{ratio.ours_plain:.2f}×", f"{ratio.ours_speculative:.2f}×")
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
        limits = why_below_target(report)
        if limits:
            lines += [f"What limits it: {limits}", ""]
    lines += peer_lines(reports)
    for report in reports:
        lines += llama_cpp_lines(report) + footprint_lines(report)
    lines += ["## Plots", ""] + [f"### {title}\n\n![{title}]({name})\n" for name, title in plots.items()]
    path = directory / "report.md"
    path.write_text("\n".join(lines))
    return path
