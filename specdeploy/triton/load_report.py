"""`specdeploy bench --url`: the server's tokens/s per concurrency, speculative vs plain, as a table and JSON."""

from __future__ import annotations

from rich.console import Console
from rich.table import Table

from specdeploy.triton.load import run_level


def in_process_tokens_per_s(engine, prompts: list[str], max_tokens: int) -> float:
    """End-to-end tokens/s (prefill included, as a client sees it) of the engine itself, one stream, over the
    prompts in the order a concurrency-1 level sends them."""
    from specdeploy.sampling import SamplingParams

    engine.generate(engine.encode_prompt(prompts[0]), SamplingParams(), 8).run()
    tokens = seconds = 0.0
    for prompt in prompts:
        generation = engine.generate(engine.encode_prompt(prompt), SamplingParams(), max_tokens)
        generation.run()
        tokens += generation.stats.generated_tokens
        seconds += generation.stats.total_seconds
    return tokens / seconds


def run_server_bench(url: str, prompts: list[str], levels: list[int], max_tokens: int,
                     requests_per_level: int | None = None, in_process: float | None = None) -> dict:
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
    report = {"url": url, "max_tokens": max_tokens, "levels": rows}
    if in_process is not None and single is not None:
        report.update(in_process_tokens_per_s=in_process, single_stream_vs_in_process=single / in_process)
    return report


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
    console = console or Console()
    console.print(table)
    if "in_process_tokens_per_s" in report:
        console.print(f"one stream over gRPC is {report['single_stream_vs_in_process']:.2f} of the same pipeline "
                      f"in-process ({report['in_process_tokens_per_s']:.1f} tokens/s, prefill included)")


def run_stress(url: str, prompts: list[str], requests: int, concurrency: int, max_tokens: int,
               cancel_fraction: float, seed: int = 0) -> dict:
    """Many requests at high concurrency, some cancelled at random mid-stream: every other one must come back
    complete and equal to its prompt's reference text (the same prompt served alone)."""
    from specdeploy.triton.load import check_results, one_request

    expected = {i: one_request(url, prompt, i, max_tokens, None, None).text for i, prompt in enumerate(prompts)}
    level = run_level(url, prompts, concurrency, requests, max_tokens, cancel_fraction=cancel_fraction, seed=seed)
    counts = check_results(level, expected)
    return {"requests": requests, "concurrency": concurrency, "cancel_fraction": cancel_fraction,
            "seconds": level.seconds, **counts}
