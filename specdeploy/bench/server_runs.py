"""What `specdeploy bench --url` runs against a server: the concurrency levels, speculative against plain (beside the
pipeline in-process when one is given), the stress test with cancellations, and one long streamed generation.
server_load.py sends the requests; server_printing.py and server_markdown.py show the results."""

from __future__ import annotations

import dataclasses
import statistics
import time

from specdeploy.bench.results import Cost
from specdeploy.bench.server_load import check_results, generate_at, one_request, run_level
from specdeploy.bench.server_results import ServerBenchReport, ServerLevel
from specdeploy.errors import SpecdeployError
from specdeploy.runtime.engine import Engine
from specdeploy.serve.metrics_scrape import is_idle, scrape, total, wait_for
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


def refused_plain(url: str, plain: list) -> None:
    """SpecdeployError when the server refused every plain request naming num_draft_tokens: its engine speculates
    on every request (TensorRT-LLM Medusa or lookahead), so it has no plain decoding, and a speedup against itself
    would be a tautology. The error says what to measure against instead."""
    errors = [r.error for r in plain if r.error is not None]
    if plain and len(errors) == len(plain) and all(e.startswith("num_draft_tokens:") for e in errors):
        raise SpecdeployError(f"the server at {url} cannot decode plainly on request ({errors[0]}); serve the same "
                              f"target without speculation and give its address as --plain-url HOST:PORT")


def run_server_bench(url: str, prompts: list[str], levels: list[int], max_tokens: int | None,
                     requests_per_level: int | None = None, in_process: float | None = None,
                     price_per_hour: float | None = None, plain_url: str | None = None) -> ServerBenchReport:
    """Per level: aggregate tokens/s with the server's speculation and plainly, same requests, and with
    price_per_hour (USD) what a million output tokens cost at each. Plainly: with num_draft_tokens = 0 on the same
    server, or, with plain_url, the server there (a twin without speculation) as it serves by default. A warm-up
    request runs first on each so neither mode pays first-call costs."""
    run_level(url, prompts[:1], 1, 1, 8)
    if plain_url is not None:
        run_level(plain_url, prompts[:1], 1, 1, 8)
    rows = []
    for concurrency in levels:
        requests = requests_per_level or max(4, 2 * concurrency)
        speculative = run_level(url, prompts, concurrency, requests, max_tokens)
        if plain_url is None:
            plain = run_level(url, prompts, concurrency, requests, max_tokens, num_draft_tokens=0)
            refused_plain(url, plain.results)
        else:
            plain = run_level(plain_url, prompts, concurrency, requests, max_tokens)
        drafted = sum(r.drafted for r in speculative.results)
        rows.append(ServerLevel(
            concurrency=concurrency, requests=requests,
            speculative_tokens_per_s=speculative.tokens_per_s, plain_tokens_per_s=plain.tokens_per_s,
            speedup=speculative.tokens_per_s / plain.tokens_per_s if plain.tokens_per_s else 0.0,
            acceptance_rate=sum(r.accepted for r in speculative.results) / drafted if drafted else 0.0,
            failed=sum(r.error is not None for r in speculative.results + plain.results),
            speculative_latency=speculative.latencies(), plain_latency=plain.latencies()))
        if price_per_hour is not None:
            cost = Cost.at(price_per_hour, plain.tokens_per_s, speculative.tokens_per_s)
            rows[-1].plain_usd_per_million_tokens = cost.plain_usd_per_million_tokens
            rows[-1].speculative_usd_per_million_tokens = cost.speculative_usd_per_million_tokens
    single = next((row.speculative_tokens_per_s for row in rows if row.concurrency == 1), None)
    for row in rows:
        row.vs_single_stream = row.speculative_tokens_per_s / single if single else None
    report = ServerBenchReport(url=url, max_tokens=max_tokens, price_per_hour=price_per_hour, levels=rows,
                               plain_url=plain_url)
    if in_process is not None and single is not None:
        report.in_process_tokens_per_s, report.single_stream_vs_in_process = in_process, single / in_process
    return report


def run_stress(url: str, prompts: list[str], requests: int, concurrency: int, max_tokens: int | None,
               cancel_fraction: float, seed: int = 0, metrics_url: str | None = None) -> dict:
    """Many requests at high concurrency, some cancelled at random mid-stream: every other one must come back
    complete and equal to its prompt's reference text (the same prompt served alone). That comparison holds where a
    batch cannot change greedy text, an fp32 server or `serving.determinism: batch_invariant` (what the stress run
    in docs/benchmarks.md served); in bf16 by default a batch may flip a near tie, and "corrupted" counts those too
    (docs/serving.md, "What a seed guarantees"; scripts/soak.py compares text only where it must be equal). With
    the server's metrics URL, also how many requests the server counted as cancelled and how long after the last
    response its batch and KV reservations were back to idle."""
    expected = {i: one_request(url, prompt, i, max_tokens, None, None).text for i, prompt in enumerate(prompts)}
    before = None if metrics_url is None else scrape(metrics_url)
    level = run_level(url, prompts, concurrency, requests, max_tokens, cancel_fraction=cancel_fraction, seed=seed)
    ended = time.perf_counter()
    report = {"requests": requests, "concurrency": concurrency, "cancel_fraction": cancel_fraction,
              "seconds": level.seconds, **check_results(level, expected)}
    if metrics_url is not None:
        free_kv = total(before, "specdeploy_free_kv_slots")
        now, _ = wait_for(metrics_url, lambda values: is_idle(values, free_kv), 30)
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
        list(generate_at(url, prompt, 8, temperature=0.0, num_draft_tokens=gamma))
        runs: dict[str, list[dict]] = {"in_process": [], "grpc_stream": []}
        for _ in range(repeats):
            started, samples = time.perf_counter(), []
            generation = engine.start(request)
            for _ in generation:
                samples.append((time.perf_counter() - started, len(generation.tokens)))
            runs["in_process"].append(stream_figures(samples))
            started, samples = time.perf_counter(), []
            for chunk in generate_at(url, prompt, tokens, stream=True, temperature=0.0, end_id=NO_END_ID,
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
