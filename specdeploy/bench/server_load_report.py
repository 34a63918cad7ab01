"""`specdeploy bench --url`: the server's tokens/s per concurrency, speculative vs plain, as a table and JSON."""

from __future__ import annotations

import dataclasses
import statistics
import time

from rich.console import Console
from rich.table import Table

from specdeploy.bench.bench_report import Cost, dollars
from specdeploy.bench.server_load import run_level
from specdeploy.runtime.engine import Engine
from specdeploy.serve.client import generate
from specdeploy.serve.metrics_scrape import scrape, total
from specdeploy.spec.request import NO_END_ID, GenerationRequest


def in_process_tokens_per_s(engine: Engine, prompts: list[str], max_tokens: int | None) -> float:
    """End-to-end tokens/s (prefill included, as a client sees it) of the engine itself, one stream, over the
    prompts in the order a concurrency-1 level sends them, with the pipeline's sampling defaults."""
    defaults = GenerationRequest.with_defaults(engine.pipeline, [], max_tokens)
    params, max_tokens = defaults.sampling, defaults.max_tokens
    engine.generate(engine.encode_prompt(prompts[0]), params, 8).run()
    tokens = seconds = 0.0
    for prompt in prompts:
        generation = engine.generate(engine.encode_prompt(prompt), params, max_tokens)
        generation.run()
        tokens += generation.stats.generated_tokens
        seconds += generation.stats.total_seconds
    return tokens / seconds


def run_server_bench(url: str, prompts: list[str], levels: list[int], max_tokens: int | None,
                     requests_per_level: int | None = None, in_process: float | None = None,
                     price_per_hour: float | None = None) -> dict:
    """Per level: aggregate tokens/s with the server's speculation and with num_draft_tokens = 0, same requests,
    and with price_per_hour (USD) what a million output tokens cost at each. A warm-up request runs first so
    neither mode pays first-call costs."""
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
            "speculative_latency": speculative.latencies(), "plain_latency": plain.latencies(),
        })
        if price_per_hour is not None:
            cost = Cost.at(price_per_hour, plain.tokens_per_s, speculative.tokens_per_s)
            rows[-1].update(plain_usd_per_million_tokens=cost.plain_usd_per_million_tokens,
                            speculative_usd_per_million_tokens=cost.speculative_usd_per_million_tokens)
    single = next((row["speculative_tokens_per_s"] for row in rows if row["concurrency"] == 1), None)
    for row in rows:
        row["vs_single_stream"] = row["speculative_tokens_per_s"] / single if single else None
    report = {"url": url, "max_tokens": max_tokens, "price_per_hour": price_per_hour, "levels": rows}
    if in_process is not None and single is not None:
        report.update(in_process_tokens_per_s=in_process, single_stream_vs_in_process=single / in_process)
    return report


def print_server_report(report: dict, console: Console | None = None) -> None:
    tokens = report["max_tokens"] or "the server's default"
    table = Table(title=f"specdeploy bench --url {report['url']} ({tokens} tokens per request)")
    priced = report.get("price_per_hour") is not None
    for column in ("concurrency", "speculative tok/s", "plain tok/s", "speedup", "acceptance", "vs 1 stream",
                   "failed") + ("spec. $/M tok", "plain $/M tok") * priced:
        table.add_column(column, justify="right")
    for row in report["levels"]:
        ratio = row["vs_single_stream"]
        costs = [dollars(row[f"{mode}_usd_per_million_tokens"]) for mode in ("speculative", "plain") if priced]
        table.add_row(str(row["concurrency"]), f"{row['speculative_tokens_per_s']:.1f}",
                      f"{row['plain_tokens_per_s']:.1f}", f"{row['speedup']:.2f}", f"{row['acceptance_rate']:.2f}",
                      "-" if ratio is None else f"{ratio:.2f}", str(row["failed"]), *costs)
    console = console or Console()
    console.print(table)
    console.print(latency_table(report))
    if "in_process_tokens_per_s" in report:
        console.print(f"one stream over gRPC is {report['single_stream_vs_in_process']:.2f} of the same pipeline "
                      f"in-process ({report['in_process_tokens_per_s']:.1f} tokens/s, prefill included)")


def milliseconds(seconds: float | None) -> str:
    return "-" if seconds is None else f"{seconds * 1000:.0f}"


LATENCY_COLUMNS = ("streams", "mode", "TTFT p50", "TTFT p90", "TTFT p99", "ITL p50", "ITL p90", "ITL p99",
                   "latency p50", "latency p99", "tokens/s per request p50", "tokens per response",
                   "response gap p50", "response gap p99")


def latency_cells(row: dict, mode: str) -> list[str]:
    """One level's latency figures for `mode` (speculative or plain) under LATENCY_COLUMNS, times in ms."""
    latency = row[f"{mode}_latency"]
    ttft, itl, whole, gap = (latency[key] for key in ("time_to_first_token", "inter_token_latency",
                                                      "request_latency", "response_gap"))
    rate, burst = latency["tokens_per_s_per_request"]["p50"], latency["tokens_per_response"]["mean"]
    return [str(row["concurrency"]), mode, *(milliseconds(ttft[p]) for p in ("p50", "p90", "p99")),
            *(milliseconds(itl[p]) for p in ("p50", "p90", "p99")), milliseconds(whole["p50"]),
            milliseconds(whole["p99"]), "-" if rate is None else f"{rate:.1f}",
            "-" if burst is None else f"{burst:.2f}", milliseconds(gap["p50"]), milliseconds(gap["p99"])]


def latency_table(report: dict) -> Table:
    """Per level and mode: time to first token, inter-token latency (genai-perf's), request latency (ms) and the
    streamed responses' tokens and gaps."""
    table = Table(title="latency per request, ms (ITL: (latency - TTFT) / (tokens - 1), genai-perf's)")
    for column in LATENCY_COLUMNS:
        table.add_column(column, justify="right")
    for row in report["levels"]:
        for mode in ("speculative", "plain"):
            table.add_row(*latency_cells(row, mode))
    return table


def run_stress(url: str, prompts: list[str], requests: int, concurrency: int, max_tokens: int | None,
               cancel_fraction: float, seed: int = 0, metrics_url: str | None = None) -> dict:
    """Many requests at high concurrency, some cancelled at random mid-stream: every other one must come back
    complete and equal to its prompt's reference text (the same prompt served alone). With the server's metrics
    URL, also how many requests the server counted as cancelled and how long after the last response its batch
    and KV reservations were back to idle."""
    from specdeploy.bench.server_load import check_results, one_request

    expected = {i: one_request(url, prompt, i, max_tokens, None, None).text for i, prompt in enumerate(prompts)}
    before = None if metrics_url is None else scrape(metrics_url)
    level = run_level(url, prompts, concurrency, requests, max_tokens, cancel_fraction=cancel_fraction, seed=seed)
    ended = time.perf_counter()
    report = {"requests": requests, "concurrency": concurrency, "cancel_fraction": cancel_fraction,
              "seconds": level.seconds, **check_results(level, expected)}
    if metrics_url is not None:
        idle = total(before, "specdeploy_free_kv_slots")
        while True:
            now = scrape(metrics_url)
            if total(now, "specdeploy_batch_size") == 0 and total(now, "specdeploy_free_kv_slots") == idle:
                break
            if time.perf_counter() - ended > 30:
                break
            time.sleep(0.05)
        report.update(idle_after_s=time.perf_counter() - ended,
                      server_cancelled=total(now, "specdeploy_requests_total", outcome="cancelled")
                      - total(before, "specdeploy_requests_total", outcome="cancelled"))
    return report


def segment_rate(samples: list[tuple[float, int]], start: float, end: float) -> float:
    """Tokens/s between the first samples (seconds, tokens so far) that reach `start` and `end` of the total."""
    total = samples[-1][1]
    t0, n0 = next(sample for sample in samples if sample[1] >= start * total)
    t1, n1 = next(sample for sample in samples if sample[1] >= end * total)
    return (n1 - n0) / (t1 - t0) if t1 > t0 else 0.0


def stream_figures(samples: list[tuple[float, int]]) -> dict:
    """Overall tokens/s and the slowdown from the first quarter of the tokens to the last fifth."""
    first, last = segment_rate(samples, 0.0, 0.25), segment_rate(samples, 0.8, 1.0)
    return {"tokens": samples[-1][1], "seconds": samples[-1][0], "tokens_per_s": samples[-1][1] / samples[-1][0],
            "first_quarter_tokens_per_s": first, "last_fifth_tokens_per_s": last,
            "slowdown": 1 - last / first if first else 0.0}


def run_long_stream(url: str, engine: Engine, prompt: str, tokens: int, repeats: int = 3) -> dict:
    """One greedy generation of exactly `tokens` tokens (end_id -1: no end token), speculative and plain, each
    streamed over gRPC and run in-process, recorded as (time, tokens so far) per step: their speeds and how much
    each slows down as the context grows (attention over a longer context costs both; the stream must not add to
    it). The two run alternately `repeats` times and each figure is the median, since one 30 s run on a shared
    machine moves by several percent. `engine` is the served pipeline's engine, loaded here."""
    ids = engine.encode_prompt(prompt)
    report = {"url": url, "tokens": tokens, "repeats": repeats}
    for mode, gamma in (("speculative", None), ("plain", 0)):
        request = GenerationRequest(ids, tokens, engine.pipeline.sampling.params(temperature=0.0), gamma,
                                    end_id=NO_END_ID)
        engine.start(dataclasses.replace(request, max_tokens=8)).run()  # warm-up
        list(generate(url, prompt, 8, temperature=0.0, num_draft_tokens=gamma))
        runs: dict[str, list[dict]] = {"in_process": [], "grpc_stream": []}
        for _ in range(repeats):
            started, samples = time.perf_counter(), []
            generation = engine.start(request)
            for _ in generation:
                samples.append((time.perf_counter() - started, len(generation.tokens)))
            runs["in_process"].append(stream_figures(samples))
            started, samples = time.perf_counter(), []
            for chunk in generate(url, prompt, tokens, stream=True, temperature=0.0, end_id=NO_END_ID,
                                  num_draft_tokens=gamma):
                if chunk.statistics:
                    samples.append((time.perf_counter() - started, int(chunk.statistics["generated_tokens"])))
            runs["grpc_stream"].append(stream_figures(samples))
        figures = {where: {key: statistics.median(run[key] for run in found) for key in found[0]}
                   for where, found in runs.items()}
        figures["grpc_vs_in_process"] = statistics.median(
            grpc["tokens_per_s"] / local["tokens_per_s"] for grpc, local in zip(runs["grpc_stream"],
                                                                              runs["in_process"]))
        figures["runs"] = runs
        report[mode] = figures
    return report


def print_long_stream(report: dict, console: Console | None = None) -> None:
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
