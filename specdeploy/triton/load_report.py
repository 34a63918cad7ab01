"""`specdeploy bench --url`: the server's tokens/s per concurrency, speculative vs plain, as a table and JSON."""

from __future__ import annotations

from rich.console import Console
from rich.table import Table

from specdeploy.triton.load import run_level


def run_server_bench(url: str, prompts: list[str], levels: list[int], max_tokens: int,
                     requests_per_level: int | None = None) -> dict:
    """Per level: aggregate tokens/s with the server's speculation and with num_draft_tokens = 0, same requests.
    A warm-up request runs first so neither mode pays first-call costs."""
    run_level(url, prompts[:1], 1, 1, 8)
    rows = []
    for concurrency in levels:
        requests = requests_per_level or max(4, 2 * concurrency)
        speculative = run_level(url, prompts, concurrency, requests, max_tokens)
        plain = run_level(url, prompts, concurrency, requests, max_tokens, num_draft_tokens=0)
        drafted = sum(r.drafted for r in speculative.results)
        rows.append({
            "concurrency": concurrency, "requests": requests,
            "speculative_tokens_per_s": speculative.tokens_per_s, "plain_tokens_per_s": plain.tokens_per_s,
            "speedup": speculative.tokens_per_s / plain.tokens_per_s if plain.tokens_per_s else 0.0,
            "acceptance_rate": sum(r.accepted for r in speculative.results) / drafted if drafted else 0.0,
            "failed": sum(r.error is not None for r in speculative.results + plain.results),
        })
    single = next((row["speculative_tokens_per_s"] for row in rows if row["concurrency"] == 1), None)
    for row in rows:
        row["vs_single_stream"] = row["speculative_tokens_per_s"] / single if single else None
    return {"url": url, "max_tokens": max_tokens, "levels": rows}


def print_server_report(report: dict, console: Console | None = None) -> None:
    table = Table(title=f"specdeploy bench --url {report['url']} ({report['max_tokens']} tokens per request)")
    for column in ("concurrency", "speculative tok/s", "plain tok/s", "speedup", "acceptance", "vs 1 stream",
                   "failed"):
        table.add_column(column, justify="right")
    for row in report["levels"]:
        ratio = row["vs_single_stream"]
        table.add_row(str(row["concurrency"]), f"{row['speculative_tokens_per_s']:.1f}",
                      f"{row['plain_tokens_per_s']:.1f}", f"{row['speedup']:.2f}", f"{row['acceptance_rate']:.2f}",
                      "-" if ratio is None else f"{ratio:.2f}", str(row["failed"]))
    (console or Console()).print(table)
