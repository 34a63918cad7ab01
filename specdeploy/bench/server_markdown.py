"""`bench --url --report DIR`: DIR/report.md, DIR/server.json and the plots of a server's concurrency levels:
throughput, time to first token and p99 inter-token latency against concurrency, and the inter-token latency's
distribution with and without speculation at the lowest and highest level."""

from __future__ import annotations

import json
from pathlib import Path

from specdeploy.bench.markdown import versions
from specdeploy.bench.plots import FIGURE_SIZE, WIDE_FIGURE, pyplot, save
from specdeploy.bench.results import dollars
from specdeploy.bench.server_printing import LATENCY_COLUMNS, latency_cells
from specdeploy.bench.server_results import MODES, ServerBenchReport, milliseconds
from specdeploy.spec.pipeline import PipelineSpec, PolicySpec

MODE_LABELS = {"speculative": "served speculation", "plain": "num_draft_tokens 0 (plain)"}


def plot_concurrency(plt, report: ServerBenchReport, policy: PolicySpec | None, path: Path) -> None:
    """Aggregate tokens/s against concurrent streams, with and without speculation; `policy` (full_up_to,
    off_above) shades where the batch-aware policy reduces gamma and marks where it turns speculation off."""
    levels = [level.concurrency for level in report.levels]
    figure, axes = plt.subplots(figsize=FIGURE_SIZE)
    axes.plot(levels, [level.speculative_tokens_per_s for level in report.levels], marker="o",
              label=MODE_LABELS["speculative"])
    axes.plot(levels, [level.plain_tokens_per_s for level in report.levels], marker="s", linestyle="--",
              label=MODE_LABELS["plain"])
    if policy is not None:
        axes.axvspan(policy.full_up_to, policy.off_above, color="grey", alpha=0.12,
                     label=f"policy reduces gamma ({policy.full_up_to} < batch ≤ {policy.off_above})")
        axes.axvline(policy.off_above, color="grey", linestyle=":",
                     label=f"policy turns speculation off above {policy.off_above}")
    axes.set_xscale("log", base=2)
    axes.set_xticks(levels, [str(level) for level in levels])
    axes.set_xlabel("concurrent gRPC streams")
    axes.set_ylabel("aggregate tokens/s")
    axes.set_title("Throughput against concurrency over gRPC")
    axes.legend(fontsize=8)
    save(plt, figure, path)


def write_server_report(report: ServerBenchReport, directory: Path, pipeline: PipelineSpec | None = None) -> Path:
    """DIR/report.md and its plots for `bench --url` (run_server_bench's report). `pipeline`: the served
    pipeline's spec, when given, for its policy."""
    plt = pyplot()
    directory = Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    policy = None if pipeline is None else pipeline.serving.policy
    plot_concurrency(plt, report, policy, directory / "concurrency.png")
    plot_latency(plt, report, directory / "latency.png")
    plot_itl_distribution(plt, report, directory / "itl_cdf.png")
    (directory / "server.json").write_text(json.dumps(report.to_json(), indent=2))
    tokens = report.max_tokens or "the server's default"
    priced_header = (f" speculative $ per million tokens (at ${report.price_per_hour:.2f}/h) | plain $ per million "
                     f"tokens |" if report.priced else "")
    lines = ["# specdeploy bench over gRPC", "", f"Server {report.url}, {tokens} tokens per request; each "
             "concurrency level runs the same requests with the served speculation and with num_draft_tokens 0.", "",
             *(f"- {package} {version}" for package, version in versions().items()), "",
             "| streams | speculative tokens/s | plain tokens/s | speedup | acceptance | failed |" + priced_header,
             "|---|---|---|---|---|---|" + "---|" * 2 * report.priced]
    for r in report.levels:
        costs = [dollars(r.usd_per_million_tokens(mode)) for mode in MODES if report.priced]
        lines.append(f"| {r.concurrency} | {r.speculative_tokens_per_s:.1f} | {r.plain_tokens_per_s:.1f} | "
                     f"{r.speedup:.2f}× | {r.acceptance_rate:.2f} | {r.failed} |"
                     + "".join(f" {cost} |" for cost in costs))
    if policy is not None:
        lines += ["", f"Policy of `{pipeline.name}`: the request's gamma up to a batch of {policy.full_up_to}, "
                      f"reduced up to {policy.off_above}, no drafting above."]
    lines += ["", "![Throughput against concurrency](concurrency.png)", "", *latency_lines(report),
              "![Time to first token and p99 inter-token latency against concurrency](latency.png)", "",
              "![Inter-token latency per request and gaps between responses](itl_cdf.png)", ""]
    path = directory / "report.md"
    path.write_text("\n".join(lines))
    return path


def latency_lines(report: ServerBenchReport) -> list[str]:
    """report.md's latency table: per level and mode, in milliseconds."""
    return ["## Latency per request", "",
            "Inter-token latency (ITL) is genai-perf's: per request, (request latency − time to first token) / "
            "(output tokens − 1), so a burst of accepted tokens counts as several tokens arriving at once. The gap "
            "between streamed responses and the tokens each carried show the bursts themselves. Times in ms.", "",
            "| " + " | ".join(LATENCY_COLUMNS) + " |", "|" + "---|" * len(LATENCY_COLUMNS),
            *("| " + " | ".join(latency_cells(level, mode)) + " |" for level in report.levels for mode in MODES), ""]


def plot_latency(plt, report: ServerBenchReport, path: Path) -> None:
    """Time to first token (p50 and p99) and p99 inter-token latency against concurrency, both modes."""
    levels = [level.concurrency for level in report.levels]
    figure, (first, between) = plt.subplots(1, 2, figsize=WIDE_FIGURE)
    for mode, label in MODE_LABELS.items():
        style = "-" if mode == "speculative" else "--"
        for quantile in ("p50", "p99"):
            first.plot(levels, [milliseconds(level.latency(mode).time_to_first_token[quantile])
                                for level in report.levels],
                       linestyle=style, marker="o" if quantile == "p50" else "^", label=f"{label}, {quantile}")
        between.plot(levels, [milliseconds(level.latency(mode).inter_token_latency["p99"]) for level in report.levels],
                     linestyle=style, marker="o", label=label)
    for axes, title in ((first, "time to first token"), (between, "p99 inter-token latency (genai-perf)")):
        axes.set_xscale("log", base=2)
        axes.set_xticks(levels, [str(level) for level in levels])
        axes.set_xlabel("concurrent gRPC streams")
        axes.set_ylabel("ms")
        axes.set_title(title)
        axes.legend(fontsize=7)
    save(plt, figure, path)


def plot_itl_distribution(plt, report: ServerBenchReport, path: Path) -> None:
    """Empirical CDFs, speculative against plain, at the lowest and the highest concurrency level: of each
    request's inter-token latency (genai-perf's, a mean over the request) and of the gaps between streamed
    responses (what a reader waits between updates: speculation's bursts make them longer and more spread)."""
    levels = report.levels
    chosen = [levels[0]] if len(levels) == 1 else [levels[0], levels[-1]]
    figure, (per_request, gaps) = plt.subplots(1, 2, figsize=WIDE_FIGURE)
    samples = ((per_request, lambda latency: latency.inter_token_latencies),
               (gaps, lambda latency: latency.response_gaps))
    for axes, sampled in samples:
        for level in chosen:
            for mode, label in MODE_LABELS.items():
                values = sorted(milliseconds(value) for value in sampled(level.latency(mode)))
                if values:
                    axes.step(values, [(i + 1) / len(values) for i in range(len(values))], where="post",
                              linestyle="-" if mode == "speculative" else "--",
                              label=f"{label}, {level.concurrency} stream(s)")
        axes.set_ylabel("fraction")
        axes.legend(fontsize=7)
    per_request.set_xlabel("inter-token latency per request (ms, genai-perf's)")
    per_request.set_title("Inter-token latency, per request")
    gaps.set_xlabel("gap between streamed responses (ms)")
    gaps.set_title("Gaps between responses")
    save(plt, figure, path)
