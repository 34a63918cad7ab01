"""`bench --url` on the terminal: the concurrency levels' table and their latencies (also report.md's latency table,
server_markdown.py), and the long stream's table."""

from __future__ import annotations

from rich.console import Console
from rich.table import Table

from specdeploy.bench.results import dollars
from specdeploy.bench.server_results import MODES, Mode, ServerBenchReport, ServerLevel, milliseconds


def print_server_bench(report: ServerBenchReport, console: Console | None = None) -> None:
    tokens = report.max_tokens or "the server's default"
    plain = "" if report.plain_url is None else f", plain at {report.plain_url}"
    table = Table(title=f"specdeploy bench --url {report.url}{plain} ({tokens} tokens per request)")
    for column in ("concurrency", "speculative tok/s", "plain tok/s", "speedup", "acceptance", "vs 1 stream",
                   "failed") + ("spec. $/M tok", "plain $/M tok") * report.priced:
        table.add_column(column, justify="right")
    for level in report.levels:
        ratio = level.vs_single_stream
        costs = [dollars(level.usd_per_million_tokens(mode)) for mode in MODES if report.priced]
        table.add_row(str(level.concurrency), f"{level.speculative_tokens_per_s:.1f}",
                      f"{level.plain_tokens_per_s:.1f}", f"{level.speedup:.2f}", f"{level.acceptance_rate:.2f}",
                      "-" if ratio is None else f"{ratio:.2f}", str(level.failed), *costs)
    console = console or Console()
    console.print(table)
    console.print(latency_table(report))
    if report.in_process_tokens_per_s is not None:
        console.print(f"one stream over gRPC is {report.single_stream_vs_in_process:.2f} of the same pipeline "
                      f"in-process ({report.in_process_tokens_per_s:.1f} tokens/s, prefill included)")


LATENCY_COLUMNS = ("streams", "mode", "TTFT p50", "TTFT p90", "TTFT p99", "ITL p50", "ITL p90", "ITL p99",
                   "latency p50", "latency p99", "tokens/s per request p50", "tokens per response",
                   "response gap p50", "response gap p99")


def milliseconds_cell(seconds: float | None) -> str:
    return "-" if seconds is None else f"{milliseconds(seconds):.0f}"


def latency_cells(level: ServerLevel, mode: Mode) -> list[str]:
    """One level's latency figures for `mode` under LATENCY_COLUMNS, times in ms."""
    latency = level.latency(mode)
    ttft, itl, whole, gap = (latency.time_to_first_token, latency.inter_token_latency, latency.request_latency,
                             latency.response_gap)
    rate, burst = latency.tokens_per_s_per_request["p50"], latency.tokens_per_response["mean"]
    return [str(level.concurrency), mode, *(milliseconds_cell(ttft[p]) for p in ("p50", "p90", "p99")),
            *(milliseconds_cell(itl[p]) for p in ("p50", "p90", "p99")), milliseconds_cell(whole["p50"]),
            milliseconds_cell(whole["p99"]), "-" if rate is None else f"{rate:.1f}",
            "-" if burst is None else f"{burst:.2f}", milliseconds_cell(gap["p50"]), milliseconds_cell(gap["p99"])]


def latency_table(report: ServerBenchReport) -> Table:
    """Per level and mode: time to first token, inter-token latency (genai-perf's), request latency (ms) and the
    streamed responses' tokens and gaps."""
    table = Table(title="latency per request, ms (ITL: (latency - TTFT) / (tokens - 1), genai-perf's)")
    for column in LATENCY_COLUMNS:
        table.add_column(column, justify="right")
    for level in report.levels:
        for mode in MODES:
            table.add_row(*latency_cells(level, mode))
    return table


def print_long_stream(report: dict, console: Console | None = None) -> None:
    """run_long_stream's figures (server_runs.py): speed, against in-process, and the slowdown, per mode and place."""
    table = Table(title=f"one streamed generation of {report['tokens']} tokens, {report['url']} vs in-process "
                        f"(medians of {report['repeats']})")
    for column in ("", "tokens/s", "vs in-process", "first quarter", "last fifth", "slowdown"):
        table.add_column(column, justify="right")
    for mode in ("speculative", "plain"):
        for name in ("in_process", "grpc_stream"):
            row = report[mode][name]
            ratio = f"{report[mode]['grpc_vs_in_process']:.2f}" if name == "grpc_stream" else ""
            table.add_row(f"{mode}, {name.replace('_', ' ')}", f"{row['tokens_per_s']:.1f}", ratio,
                          f"{row['first_quarter_tokens_per_s']:.1f}", f"{row['last_fifth_tokens_per_s']:.1f}",
                          f"{row['slowdown']:.1%}")
    (console or Console()).print(table)
