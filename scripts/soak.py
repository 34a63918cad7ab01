"""Soak each pipeline over gRPC (issue 64; soak 5 in the reviews is what this repeats): `make soak`.

Per pipeline: build its engine if needed, package it and start `specdeploy serve` on free loopback ports. Then, for
--seconds, --clients threads each run a bounded loop of requests drawn at random from MIX: greedy and sampled streams
to `speculative`, greedy streams through the ensemble, streams that must run to max_tokens (end_id -1), streams
cancelled after 1-4 responses, clients that close their channel mid-stream, bursts of a request that ends at its
prefill (max_tokens 1) joining with three short ones while the others decode (soak 5's lookahead crash), and
malformed requests (MALFORMED), each of which must be refused naming what is wrong.

Then it checks that no valid request was lost, hung (no response within --timeout seconds) or failed; that every
finished one ended with a valid finish (text, 1 to max_tokens tokens, exactly max_tokens without an end token);
that every malformed one was refused; that specdeploy_requests_total moved by what the clients saw, per outcome;
that the batch, the queue and the KV reservations are back to idle; that the server's fds and threads did not grow
beyond a little slack; and finally that SIGTERM, with two streams live, drains and `serve` exits 0 in time.

Greedy text is compared with the same request served alone only where it must be equal: an fp32 target or
`serving.determinism: batch_invariant`. In bf16 a batch may change a near tie (docs/serving.md, "What a seed
guarantees"), so there a finished text must only be non-empty.

Prints a table and writes --json (default bench-results/soak.json); exits 1 when a pipeline failed a check.

Usage (from the repository root; `make soak` runs this over the shipped pipelines):
    .venv/bin/python scripts/soak.py PIPELINE.yaml ... [--seconds 600] [--clients 8] [--timeout 120]
"""

from __future__ import annotations

import argparse
import json
import os
import random
import threading
import time
from collections import Counter
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

import numpy as np
from rich.console import Console
from rich.table import Table

from specdeploy.bench.server_load import RequestResult, one_request
from specdeploy.serve.client import ENTRY_MODEL, NoResponse, ServerRefusal, build_inputs, infer_input, stream_inputs
from specdeploy.serve.metrics_scrape import is_idle, scrape, total, wait_for
from specdeploy.serve.serve_process import ServeProcess, alive, children
from specdeploy.spec.engine_paths import ENGINES_DIR
from specdeploy.spec.prompt_sets import load_prompts
from specdeploy.spec.request import NO_END_ID
from specdeploy.workflows import load_spec, package

# How often each kind of request is drawn (weights).
MIX = {"stream": 6, "sampled": 2, "ensemble": 2, "length": 2, "cancel": 2, "drop": 1, "burst": 1, "malformed": 2}
STREAM_TOKENS = 32
LONG_TOKENS = 256  # cancelled and dropped streams: long enough that the cancel always comes first
FD_SLACK = THREAD_SLACK = 10  # growth over the soak still counted as flat (gRPC and stub threads come and go)
OUTCOMES = ("stop", "length", "cancelled", "invalid", "error", "shutdown")  # specdeploy_requests_total{outcome}
FINISHED, CANCELLED, REFUSED, FAILED, HUNG = "finished", "cancelled", "refused", "failed", "hung"


@dataclass
class Record:
    """One request as its client saw it."""
    kind: str
    outcome: str  # FINISHED, CANCELLED, REFUSED, FAILED or HUNG
    problem: str | None = None  # what is wrong with it, if anything
    counted_invalid: bool = False  # a refusal the model counts as outcome="invalid" (Triton's own are not counted)


@dataclass
class Target:
    url: str
    prompts: list[str]
    timeout: float  # seconds without a response before a request counts as hung
    references: dict[str, str] | None  # greedy text of each prompt alone, where a batch must not change it


def finish_problem(result: RequestResult, max_tokens: int, runs_to_length: bool, reference: str | None) -> str | None:
    """What is wrong with a finished request: its token count, an empty text, or greedy text that must equal the
    request served alone and does not."""
    if not 1 <= result.generated_tokens <= max_tokens:
        return f"{result.generated_tokens} tokens for max_tokens {max_tokens}"
    if runs_to_length and result.generated_tokens != max_tokens:
        return f"ended after {result.generated_tokens} of {max_tokens} tokens without an end token"
    if max_tokens > 1 and not result.text:  # one token may be a character's first bytes, held back
        return "empty text"
    if reference is not None and result.text != reference:
        return "greedy text differs from the request alone"
    return None


def record(kind: str, result: RequestResult, max_tokens: int, runs_to_length: bool = False,
           reference: str | None = None) -> Record:
    if result.hung:
        return Record(kind, HUNG, result.error)
    if result.error is not None:
        return Record(kind, FAILED, result.error)
    if result.cancelled:
        return Record(kind, CANCELLED)
    if not result.finished:
        return Record(kind, FAILED, "the stream ended without a final response")
    return Record(kind, FINISHED, finish_problem(result, max_tokens, runs_to_length, reference))


def greedy(target: Target, rng: random.Random, model: str) -> list[Record]:
    prompt = rng.choice(target.prompts)
    result = one_request(target.url, prompt, 0, STREAM_TOKENS, None, None, model=model, timeout=target.timeout,
                         temperature=0.0)
    reference = target.references[prompt] if target.references else None
    return [record("ensemble" if model == "ensemble" else "stream", result, STREAM_TOKENS, reference=reference)]


def sampled(target: Target, rng: random.Random) -> list[Record]:
    result = one_request(target.url, rng.choice(target.prompts), 0, STREAM_TOKENS, None, None, timeout=target.timeout,
                         temperature=0.8, top_p=0.95, random_seed=rng.randrange(2**32))
    return [record("sampled", result, STREAM_TOKENS)]


def to_length(target: Target, rng: random.Random) -> list[Record]:
    tokens = rng.randint(8, 48)
    result = one_request(target.url, rng.choice(target.prompts), 0, tokens, None, None, timeout=target.timeout,
                         end_id=NO_END_ID)
    return [record("length", result, tokens, runs_to_length=True)]


def cancelled(target: Target, rng: random.Random) -> list[Record]:
    result = one_request(target.url, rng.choice(target.prompts), 0, LONG_TOKENS, None, rng.randint(1, 4),
                         timeout=target.timeout, end_id=NO_END_ID)
    return [record("cancel", result, LONG_TOKENS, runs_to_length=True)]


def dropped(target: Target, rng: random.Random) -> list[Record]:
    """A client that goes away mid-stream without cancelling: its channel closed after the first response."""
    import queue

    import tritonclient.grpc as grpcclient

    client = grpcclient.InferenceServerClient(target.url)
    responses: queue.Queue = queue.Queue()
    client.start_stream(callback=lambda result, error: responses.put((result, error)))
    client.async_stream_infer(ENTRY_MODEL, build_inputs(rng.choice(target.prompts), LONG_TOKENS, True,
                                                        end_id=NO_END_ID), enable_empty_final_response=True)
    try:
        result, error = responses.get(timeout=target.timeout)
    except queue.Empty:
        result, error = None, None
    # tritonclient has no call that drops a connection: close() and stop_stream() wait for the stream to end
    client._channel.close()
    client.stop_stream()  # joins its reader thread, which the closed channel has ended
    if error is not None:
        return [Record("drop", FAILED, str(error))]
    if result is None:
        return [Record("drop", HUNG, f"no response within {target.timeout:g} s")]
    return [Record("drop", CANCELLED)]


def burst(target: Target, rng: random.Random) -> list[Record]:
    """A request that ends at its prefill (max_tokens 1) and three short ones, sent at once while other clients'
    streams decode: soak 5's lookahead crash moved a row admitted but not prefilled yet in such a step."""
    plan = [("prefill_end", 1), *(("short", rng.randint(2, 6)) for _ in range(3))]

    def send(kind_tokens: tuple[str, int]) -> Record:
        kind, tokens = kind_tokens
        result = one_request(target.url, rng.choice(target.prompts), 0, tokens, None, None, timeout=target.timeout)
        return record(kind, result, tokens)

    with ThreadPoolExecutor(len(plan)) as pool:
        return list(pool.map(send, plan))


@dataclass(frozen=True)
class Malformed:
    names: str  # what the refusal must name
    # the models whose refusal is counted as outcome="invalid": the speculative model's own refusals, also through
    # the ensemble; Triton refuses some before any model sees them, and the ensemble's preprocessing a batch of two
    counted_through: tuple[str, ...]
    inputs: Callable[[str], list]


def scalar(name: str, kind: str, value: float) -> object:
    return infer_input(name, kind, np.array([[value]], dtype=np.float32 if kind == "FP32" else np.int32))


BOTH = (ENTRY_MODEL, "ensemble")
MALFORMED = {
    "wrong dtype": Malformed("max_tokens", (), lambda p: [*build_inputs(p, None, True),
                                                          scalar("max_tokens", "FP32", 8.0)]),
    "batch of two": Malformed("text_input", (ENTRY_MODEL,), lambda p: [
        infer_input("text_input", "BYTES", np.array([[p.encode()], [p.encode()]], dtype=object))]),
    "unknown input": Malformed("no_such_input", (), lambda p: [*build_inputs(p, 8, True),
                                                               scalar("no_such_input", "INT32", 1)]),
    "negative temperature": Malformed("temperature", BOTH, lambda p: build_inputs(p, 8, True, temperature=-0.5)),
    "top_p above 1": Malformed("top_p", BOTH, lambda p: build_inputs(p, 8, True, top_p=1.5)),
    "max_tokens 0": Malformed("max_tokens", BOTH, lambda p: build_inputs(p, 0, True)),
    "unknown request_kind": Malformed("request_kind", BOTH, lambda p: build_inputs(p, 8, True, request_kind="poetry")),
}


def malformed(target: Target, rng: random.Random) -> list[Record]:
    """One malformed request, to `speculative` or through the ensemble: it must be refused naming what is wrong."""
    name, model = rng.choice(sorted(MALFORMED)), rng.choice(BOTH)
    case = MALFORMED[name]
    kind = f"malformed: {name}"
    try:
        list(stream_inputs(target.url, case.inputs(rng.choice(target.prompts)), model, target.timeout))
    except ServerRefusal as exc:
        problem = None if case.names in str(exc) else f"refused without naming {case.names}: {exc}"
        return [Record(kind, REFUSED, problem, counted_invalid=model in case.counted_through)]
    except NoResponse as exc:
        return [Record(kind, HUNG, str(exc))]
    return [Record(kind, FINISHED, "served, not refused")]


ACTIONS: dict[str, Callable[[Target, random.Random], list[Record]]] = {
    "stream": lambda target, rng: greedy(target, rng, ENTRY_MODEL),
    "ensemble": lambda target, rng: greedy(target, rng, "ensemble"),
    "sampled": sampled, "length": to_length, "cancel": cancelled, "drop": dropped, "burst": burst,
    "malformed": malformed}


def client_loop(target: Target, seed: int, deadline: float, records: list[Record]) -> None:
    rng = random.Random(seed)
    kinds, weights = list(MIX), list(MIX.values())
    while time.monotonic() < deadline:
        kind = rng.choices(kinds, weights)[0]
        try:
            records.extend(ACTIONS[kind](target, rng))  # list.extend is atomic: no lock needed
        except Exception as exc:  # noqa: BLE001 - anything unexpected is a failed request, and the loop goes on
            records.append(Record(kind, FAILED, f"{type(exc).__name__}: {exc}"))


def process_figures(pid: int) -> dict[str, float]:
    """Open fds, threads and resident MB of tritonserver and its Python backend stubs."""
    fds = threads = rss_kb = 0
    for process in (pid, *children(pid)):
        try:
            fds += len(os.listdir(f"/proc/{process}/fd"))
            status = dict(line.split(":", 1) for line in Path(f"/proc/{process}/status").read_text().splitlines())
        except OSError:
            continue  # a process that ended meanwhile
        threads += int(status["Threads"])
        rss_kb += int(status["VmRSS"].split()[0])
    return {"fds": fds, "threads": threads, "rss_mb": round(rss_kb / 1024)}


def tally(records: list[Record]) -> dict:
    """Counts by kind and outcome, what the server should have counted, and the problems (each with its count)."""
    by_kind: dict[str, Counter] = {}
    for item in records:
        by_kind.setdefault(item.kind, Counter())[item.outcome] += 1
    outcomes = Counter(item.outcome for item in records)
    problems = Counter(f"{item.kind}: {item.outcome}: {item.problem or ''}".rstrip(": ") for item in records
                       if item.problem is not None or item.outcome in (FAILED, HUNG))
    return {"requests": len(records), "outcomes": dict(outcomes),
            "by_kind": {kind: dict(counts) for kind, counts in sorted(by_kind.items())},
            # a hung request is cancelled by its client; a refusal reaches the model only when it is the model's
            "expected_server": {"finished": outcomes[FINISHED], "cancelled": outcomes[CANCELLED] + outcomes[HUNG],
                                "invalid": sum(r.outcome == REFUSED and r.counted_invalid for r in records)},
            "problems": dict(problems.most_common())}


def verdict(report: dict) -> list[str]:
    """Every check a pipeline's soak failed (none: it passed)."""
    found = [f"{count} × {problem}" for problem, count in report["tally"]["problems"].items()]
    expected, server = report["tally"]["expected_server"], report["server"]
    for name, moved in (("finished", server["stop"] + server["length"]), ("cancelled", server["cancelled"]),
                        ("invalid", server["invalid"])):
        if moved != expected[name]:
            found.append(f"the server counted {moved:g} {name}, the clients saw {expected[name]}")
    for outcome in ("error", "shutdown"):
        if server[outcome]:
            found.append(f"the server counted {server[outcome]:g} requests as {outcome}")
    if not report["idle"]:
        found.append("batch, queue or KV reservations not back to idle within 30 s")
    process = report["process"]
    if process["end"]["fds"] - process["start"]["fds"] > FD_SLACK:
        found.append(f"fds grew {process['start']['fds']} → {process['end']['fds']}")
    if process["end"]["threads"] - process["start"]["threads"] > THREAD_SLACK:
        found.append(f"threads grew {process['start']['threads']} → {process['end']['threads']}")
    if report["stuck_clients"]:
        found.append(f"{report['stuck_clients']} client threads still waiting after the soak")
    drain = report["drain"]
    if drain["exit_status"] != 0:
        found.append(f"serve exited {drain['exit_status']} after SIGTERM (None: killed after its timeout)")
    found += [f"during the drain: {problem}" for problem in drain["problems"]]
    return found


def drain(server: ServeProcess, target: Target) -> dict:
    """SIGTERM with two streams running: each must finish (or end saying the server stops, past the drain
    timeout); serve must exit 0."""
    with ThreadPoolExecutor(2) as pool:
        streams = [pool.submit(one_request, target.url, prompt, 0, 24, None, None, timeout=target.timeout,
                               end_id=NO_END_ID) for prompt in target.prompts[:2]]
        # in the batch, not queued: a drain ends queued requests at once
        wait_for(server.metrics_url, lambda values: total(values, "specdeploy_batch_size") >= 2
                 or all(stream.done() for stream in streams), target.timeout)
        started = time.monotonic()
        status = server.stop()
        seconds = time.monotonic() - started
        results = [stream.result() for stream in streams]
    problems = [f"a running stream ended with {result.error}" for result in results
                if result.error is not None and "did not finish within the drain timeout" not in result.error]
    problems += ["a stream neither finished nor failed" for result in results
                 if result.error is None and not result.finished]
    if alive(server.triton):
        problems.append("tritonserver still running")
    return {"exit_status": status, "seconds": round(seconds, 1), "problems": problems,
            "streams": ["finished" if r.finished else r.error for r in results]}


def soak(path: str, options: argparse.Namespace) -> dict:
    pipeline = load_spec(path)
    repository = package(path, options.engines_dir).directory
    options.logs.mkdir(parents=True, exist_ok=True)
    server = ServeProcess(repository, options.logs / f"{pipeline.name}.serve.log")
    try:
        prompts = [item["prompt"] for item in load_prompts()]
        exact = pipeline.target.dtype == "float32" or pipeline.serving.determinism == "batch_invariant"
        target = Target(server.url, prompts, options.timeout, None)
        # each prompt alone first (the warm-up too): the references where a batch must not change greedy text
        alone = {p: one_request(server.url, p, 0, STREAM_TOKENS, None, None, temperature=0.0).text
                 for p in (prompts if exact else prompts[:1])}
        target.references = alone if exact else None
        before = scrape(server.metrics_url)
        free_kv = total(before, "specdeploy_free_kv_slots")
        start = process_figures(server.triton)
        records: list[Record] = []
        deadline = time.monotonic() + options.seconds
        clients = [threading.Thread(target=client_loop, args=(target, options.seed + i, deadline, records),
                                    daemon=True) for i in range(options.clients)]
        for client in clients:
            client.start()
        peak = dict(start)
        while time.monotonic() < deadline:
            time.sleep(min(10.0, max(0.0, deadline - time.monotonic())))
            peak = {key: max(value, peak[key]) for key, value in process_figures(server.triton).items()}
        for client in clients:  # each ends its last request; a hung one ends at its timeout
            client.join(max(0.0, deadline + 2 * options.timeout + 60 - time.monotonic()))
        counts = tally(records)
        reached_model = sum(counts["expected_server"].values())

        def settled(values: dict[str, float]) -> bool:  # idle, and every request that reached the model counted
            moved = sum(total(values, "specdeploy_requests_total", outcome=o)
                        - total(before, "specdeploy_requests_total", outcome=o) for o in OUTCOMES)
            return is_idle(values, free_kv) and moved >= reached_model

        ended = time.monotonic()
        after, idle = wait_for(server.metrics_url, settled, 30)
        report = {"pipeline": path, "seconds": options.seconds, "clients": options.clients, "exact_text": exact,
                  "tally": counts, "idle": idle, "idle_after_s": round(time.monotonic() - ended, 2),
                  "server": {o: total(after, "specdeploy_requests_total", outcome=o)
                             - total(before, "specdeploy_requests_total", outcome=o) for o in OUTCOMES},
                  "process": {"start": start, "peak": peak, "end": process_figures(server.triton)},
                  "stuck_clients": sum(client.is_alive() for client in clients)}
        report["drain"] = drain(server, target)
    finally:
        server.close()
    report["problems"] = verdict(report)
    return report


def print_table(reports: list[dict]) -> None:
    table = Table(title="Soak over gRPC")
    for column in ("pipeline", "requests", "finished", "cancelled", "refused", "failed / hung", "server s+l / c / i",
                   "idle", "fds", "threads", "RSS MB", "SIGTERM", "verdict"):
        table.add_column(column, justify="left" if column in ("pipeline", "verdict") else "right")
    for report in reports:
        outcomes, server, process = report["tally"]["outcomes"], report["server"], report["process"]
        table.add_row(
            Path(report["pipeline"]).stem, str(report["tally"]["requests"]), str(outcomes.get(FINISHED, 0)),
            str(outcomes.get(CANCELLED, 0)), str(outcomes.get(REFUSED, 0)),
            f"{outcomes.get(FAILED, 0)} / {outcomes.get(HUNG, 0)}",
            f"{server['stop'] + server['length']:g} / {server['cancelled']:g} / {server['invalid']:g}",
            f"{report['idle_after_s']} s" if report["idle"] else "no",
            *(f"{process['start'][key]} → {process['end'][key]}" for key in ("fds", "threads", "rss_mb")),
            f"exit {report['drain']['exit_status']}, {report['drain']['seconds']} s",
            "pass" if not report["problems"] else "FAIL: " + "; ".join(report["problems"][:5]))
    Console(width=max(Console().width, 150)).print(table)  # wide enough for the table in a log, too


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("pipelines", nargs="+", metavar="PIPELINE.yaml")
    parser.add_argument("--seconds", type=float, default=600, help="load per pipeline")
    parser.add_argument("--clients", type=int, default=8, help="client threads, each one request at a time")
    parser.add_argument("--timeout", type=float, default=120, help="seconds without a response: the request hung")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--engines-dir", type=Path, default=Path(os.environ.get("SPECDEPLOY_ENGINES", ENGINES_DIR)))
    parser.add_argument("--logs", type=Path, default=Path("bench-results/soak-logs"), help="serve's logs")
    parser.add_argument("--json", type=Path, default=Path("bench-results/soak.json"))
    options = parser.parse_args()
    reports = []
    for path in options.pipelines:
        reports.append(soak(path, options))
        options.json.parent.mkdir(parents=True, exist_ok=True)
        options.json.write_text(json.dumps(reports, indent=2) + "\n")  # kept after each pipeline
    print_table(reports)
    raise SystemExit(1 if any(report["problems"] for report in reports) else 0)


if __name__ == "__main__":
    main()
