"""`bench --url --report DIR`: DIR/report.md, DIR/server.json and the plots of a server's concurrency levels:
throughput, time to first token and p99 inter-token latency against concurrency, and the inter-token latency's
distribution with and without speculation at the lowest and highest level."""

from __future__ import annotations

import json
from pathlib import Path

from specdeploy.bench.bench_report import dollars
from specdeploy.bench.report import FIGURE_SIZE, WIDE_FIGURE, pyplot, save, versions
from specdeploy.bench.server_load_report import LATENCY_COLUMNS, latency_cells

MODES = {"speculative": "served speculation", "plain": "num_draft_tokens 0 (plain)"}


def plot_concurrency(plt, server: dict, policy: dict | None, path: Path) -> None:
    """Aggregate tokens/s against concurrent streams, with and without speculation; `policy` (full_up_to,
    off_above) shades where the batch-aware policy reduces gamma and marks where it turns speculation off."""
    rows = server["levels"]
    levels = [row["concurrency"] for row in rows]
    figure, axes = plt.subplots(figsize=FIGURE_SIZE)
    axes.plot(levels, [row["speculative_tokens_per_s"] for row in rows], marker="o", label="served speculation")
    axes.plot(levels, [row["plain_tokens_per_s"] for row in rows], marker="s", linestyle="--",
              label="num_draft_tokens 0 (plain)")
    if policy is not None:
        axes.axvspan(policy["full_up_to"], policy["off_above"], color="grey", alpha=0.12,
                     label=f"policy reduces gamma ({policy['full_up_to']} < batch ≤ {policy['off_above']})")
        axes.axvline(policy["off_above"], color="grey", linestyle=":",
                     label=f"policy turns speculation off above {policy['off_above']}")
    axes.set_xscale("log", base=2)
    axes.set_xticks(levels, [str(level) for level in levels])
    axes.set_xlabel("concurrent gRPC streams")
    axes.set_ylabel("aggregate tokens/s")
    axes.set_title("Throughput against concurrency over gRPC")
    axes.legend(fontsize=8)
    save(plt, figure, path)


def write_server_report(server: dict, directory: Path, pipeline=None) -> Path:
    """DIR/report.md and DIR/concurrency.png for `bench --url` (run_server_bench's report). `pipeline`: the served
    pipeline's spec, when given, for its policy."""
    plt = pyplot()
    directory = Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    policy = None
    if pipeline is not None:
        policy = {"full_up_to": pipeline.serving.policy.full_up_to, "off_above": pipeline.serving.policy.off_above}
    plot_concurrency(plt, server, policy, directory / "concurrency.png")
    plot_latency(plt, server, directory / "latency.png")
    plot_itl_distribution(plt, server, directory / "itl_cdf.png")
    (directory / "server.json").write_text(json.dumps(server, indent=2))
    tokens = server["max_tokens"] or "the server's default"
    priced = server.get("price_per_hour") is not None
    priced_header = (f" speculative $ per million tokens (at ${server['price_per_hour']:.2f}/h) | plain $ per million "
                     f"tokens |" if priced else "")
    lines = ["# specdeploy bench over gRPC", "", f"Server {server['url']}, {tokens} tokens per request; each "
             "concurrency level runs the same requests with the served speculation and with num_draft_tokens 0.", "",
             *(f"- {package} {version}" for package, version in versions().items()), "",
             "| streams | speculative tokens/s | plain tokens/s | speedup | acceptance | failed |" + priced_header,
             "|---|---|---|---|---|---|" + "---|" * 2 * priced]
    for r in server["levels"]:
        costs = [dollars(r[f"{mode}_usd_per_million_tokens"]) for mode in ("speculative", "plain") if priced]
        lines.append(f"| {r['concurrency']} | {r['speculative_tokens_per_s']:.1f} | {r['plain_tokens_per_s']:.1f} | "
                     f"{r['speedup']:.2f}× | {r['acceptance_rate']:.2f} | {r['failed']} |"
                     + "".join(f" {cost} |" for cost in costs))
    if policy is not None:
        lines += ["", f"Policy of `{pipeline.name}`: the request's gamma up to a batch of {policy['full_up_to']}, "
                      f"reduced up to {policy['off_above']}, no drafting above."]
    lines += ["", "![Throughput against concurrency](concurrency.png)", "", *latency_lines(server),
              "![Time to first token and p99 inter-token latency against concurrency](latency.png)", "",
              "![Inter-token latency per request and gaps between responses](itl_cdf.png)", ""]
    path = directory / "report.md"
    path.write_text("\n".join(lines))
    return path


def latency_lines(server: dict) -> list[str]:
    """report.md's latency table: per level and mode, in milliseconds."""
    return ["## Latency per request", "",
            "Inter-token latency (ITL) is genai-perf's: per request, (request latency − time to first token) / "
            "(output tokens − 1), so a burst of accepted tokens counts as several tokens arriving at once. The gap "
            "between streamed responses and the tokens each carried show the bursts themselves. Times in ms.", "",
            "| " + " | ".join(LATENCY_COLUMNS) + " |", "|" + "---|" * len(LATENCY_COLUMNS),
            *("| " + " | ".join(latency_cells(row, mode)) + " |" for row in server["levels"] for mode in MODES), ""]


def plot_latency(plt, server: dict, path: Path) -> None:
    """Time to first token (p50 and p99) and p99 inter-token latency against concurrency, both modes."""
    rows = server["levels"]
    levels = [row["concurrency"] for row in rows]
    figure, (first, between) = plt.subplots(1, 2, figsize=WIDE_FIGURE)
    for mode, label in MODES.items():
        style = "-" if mode == "speculative" else "--"
        for quantile in ("p50", "p99"):
            first.plot(levels, [ms(row[f"{mode}_latency"]["time_to_first_token"][quantile]) for row in rows],
                       linestyle=style, marker="o" if quantile == "p50" else "^", label=f"{label}, {quantile}")
        between.plot(levels, [ms(row[f"{mode}_latency"]["inter_token_latency"]["p99"]) for row in rows],
                     linestyle=style, marker="o", label=label)
    for axes, title in ((first, "time to first token"), (between, "p99 inter-token latency (genai-perf)")):
        axes.set_xscale("log", base=2)
        axes.set_xticks(levels, [str(level) for level in levels])
        axes.set_xlabel("concurrent gRPC streams")
        axes.set_ylabel("ms")
        axes.set_title(title)
        axes.legend(fontsize=7)
    save(plt, figure, path)


def ms(seconds: float | None) -> float:
    return float("nan") if seconds is None else seconds * 1000


def plot_itl_distribution(plt, server: dict, path: Path) -> None:
    """Empirical CDFs, speculative against plain, at the lowest and the highest concurrency level: of each
    request's inter-token latency (genai-perf's, a mean over the request) and of the gaps between streamed
    responses (what a reader waits between updates: speculation's bursts make them longer and more spread)."""
    rows = server["levels"]
    chosen = [rows[0]] if len(rows) == 1 else [rows[0], rows[-1]]
    figure, (per_request, gaps) = plt.subplots(1, 2, figsize=WIDE_FIGURE)
    for axes, key in ((per_request, "inter_token_latencies"), (gaps, "response_gaps")):
        for row in chosen:
            for mode, label in MODES.items():
                values = sorted(ms(value) for value in row[f"{mode}_latency"][key])
                if values:
                    axes.step(values, [(i + 1) / len(values) for i in range(len(values))], where="post",
                              linestyle="-" if mode == "speculative" else "--",
                              label=f"{label}, {row['concurrency']} stream(s)")
        axes.set_ylabel("fraction")
        axes.legend(fontsize=7)
    per_request.set_xlabel("inter-token latency per request (ms, genai-perf's)")
    per_request.set_title("Inter-token latency, per request")
    gaps.set_xlabel("gap between streamed responses (ms)")
    gaps.set_title("Gaps between responses")
    save(plt, figure, path)
