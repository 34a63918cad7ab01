"""The OpenAI front under load, in one run against one server (issue 61): what it costs against gRPC direct, and what
a third-party load tool (NVIDIA's aiperf, in its own environment: `make openai-load`) measures beside bench --url.

1. Builds the pipeline's engine if needed, packages it and starts tritonserver and the OpenAI front beside it.
2. Runs `specdeploy bench --url` over gRPC (HOST:PORT) and over the OpenAI API (http://HOST:PORT/v1) in turn,
   --rounds times, the same requests at each concurrency level: the front's cost is the median ratio of their
   speculative tokens/s per level, and its addition to time to first token the median difference of the p50s.
3. Runs `aiperf profile` at each level on the same prompts, output lengths and request counts (streamed chat,
   token counts from the server's per-chunk usage), and sets its TTFT and ITL percentiles beside bench --url's
   over the OpenAI API.
Writes OUT/openai-load.json and OUT/openai-load.md (the tables), and leaves each tool's own output in OUT.

Usage (from the repository root; `make openai-load` installs aiperf and runs this):
    .venv/bin/python scripts/openai_load.py [PIPELINE.yaml] [--out bench-results/openai-load] [--max-tokens 64]
        [--concurrency 1,8] [--requests 16] [--rounds 2] [--aiperf .venv/tools/aiperf/bin/aiperf]
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import statistics
import subprocess
import sys
from pathlib import Path

from specdeploy.package.repository import write_repository
from specdeploy.serve.openai_api.front import OpenAIFront, served_name
from specdeploy.serve.tritonserver import TritonServer
from specdeploy.spec.prompt_sets import load_prompts
from specdeploy.workflows import prepare_engine

PERCENTILES = ("p50", "p90", "p99")
POLLS_PER_SECOND = 500


def cpu_seconds(pid: int | None = None) -> float:
    """User and system CPU seconds of process `pid` and its live descendants (tritonserver's Python backend stubs
    do the model's work), from /proc; without a pid, of this process's finished children."""
    if pid is None:
        children = resource.getrusage(resource.RUSAGE_CHILDREN)
        return children.ru_utime + children.ru_stime
    parents, ticks = {}, {}
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            fields = stat.read_text().rsplit(")", 1)[1].split()
        except OSError:
            continue  # a process that ended meanwhile
        process = int(stat.parent.name)
        parents[process], ticks[process] = int(fields[1]), int(fields[11]) + int(fields[12])
    tree, grown = {pid}, True
    while grown:
        grown = False
        for process, parent in parents.items():
            if parent in tree and process not in tree:
                tree.add(process)
                grown = True
    return sum(ticks.get(process, 0) for process in tree) / os.sysconf("SC_CLK_TCK")


def measured_bench(url: str, options: argparse.Namespace, out: Path, processes: dict[str, int]) -> dict:
    """bench(), and the CPU milliseconds per generated token that each process spent meanwhile: the server's, the
    front's and the client's (bench itself). With ignore_eos every request makes exactly max_tokens tokens, in plain
    and speculative runs at each level."""
    before = {name: cpu_seconds(pid) for name, pid in processes.items()} | {"client": cpu_seconds()}
    report = bench(url, options, out)
    after = {name: cpu_seconds(pid) for name, pid in processes.items()} | {"client": cpu_seconds()}
    tokens = 2 * len(report["levels"]) * options.requests * options.max_tokens
    report["cpu_ms_per_token"] = {name: (after[name] - before[name]) * 1000 / tokens for name in before}
    return report


def bench(url: str, options: argparse.Namespace, out: Path) -> dict:
    """One `specdeploy bench --url` run; its JSON report."""
    subprocess.run([sys.executable, "-m", "specdeploy.cli", "bench", "--url", url, "--concurrency", options.concurrency,
                    "--requests", str(options.requests), "--max-tokens", str(options.max_tokens), "--json", str(out)],
                   check=True)
    return json.loads(out.read_text())


def level(report: dict, concurrency: int) -> dict:
    return next(row for row in report["levels"] if row["concurrency"] == concurrency)


def tokenizer_cache(tokenizer_dir: Path, cache: Path) -> str:
    """The engine's tokenizer as a Hugging Face cache entry, and the name aiperf loads it by: aiperf 0.13 offline
    (HF_HUB_OFFLINE) looks tokenizers up in the hub's cache only, never in a local folder
    (aiperf/common/tokenizer.py, _from_pretrained_local), and its built-in one downloads its encoding."""
    name, revision = "specdeploy/served-tokenizer", "0" * 40
    snapshot = cache / "models--specdeploy--served-tokenizer" / "snapshots" / revision
    snapshot.mkdir(parents=True, exist_ok=True)
    for path in tokenizer_dir.iterdir():  # the model's config too: transformers' AutoTokenizer asks for it first
        if path.name.startswith("tokenizer") or path.name in ("chat_template.jinja", "config.json"):
            (snapshot / path.name).write_bytes(path.read_bytes())
    (snapshot.parent.parent / "refs").mkdir(exist_ok=True)
    (snapshot.parent.parent / "refs" / "main").write_text(revision)
    return name


def aiperf(binary: str, url: str, model: str, tokenizer: Path, dataset: Path, concurrency: int, requests: int,
           out: Path) -> dict:
    """One aiperf profile at `concurrency`; its TTFT and ITL percentiles in milliseconds and its output tokens/s.
    Greedy with ignore_eos, as bench sends. Token counts are the server's (per-chunk usage); aiperf's tokenizer (the
    served one) only reads the dataset."""
    cache = out.parent / "hf-cache"
    name = tokenizer_cache(tokenizer, cache)
    subprocess.run([binary, "profile", "--url", url.removesuffix("/v1"), "--endpoint-type", "chat", "--streaming",
                    "--model", model, "--tokenizer", name, "--input-file", str(dataset),
                    "--custom-dataset-type", "single_turn", "--dataset-sampling-strategy", "sequential",
                    "--concurrency", str(concurrency), "--request-count", str(requests),
                    # With a concurrency alone, aiperf's loop polls for a free slot without sleeping
                    # (timing/strategies/request_rate.py, CONCURRENCY_BURST) and takes a core from a CPU server: 64
                    # tokens took 57-94 s instead of 1.5 s here. A rate far above what the server can serve keeps the
                    # cap and checks for a free slot every 1/rate seconds instead; at 20 a second it also spread the
                    # first requests 50 ms apart where bench starts them together (its TTFT p50 at 8 streams: 77 ms
                    # against bench's 189), so the rate is high enough that the first 8 start within 16 ms.
                    "--request-rate", str(POLLS_PER_SECOND), "--arrival-pattern", "constant",
                    "--warmup-request-count", "1", "--extra-inputs", "temperature:0", "ignore_eos:true",
                    "--use-server-token-count", "--per-chunk-usage",
                    "--no-server-metrics", "--no-auto-plot", "--ui", "none", "--output-artifact-dir", str(out)],
                   check=True, env={**os.environ, "HF_HUB_OFFLINE": "1", "HF_HUB_CACHE": str(cache)})
    summary = json.loads(next(out.rglob("profile_export_aiperf.json")).read_text())
    return {"time_to_first_token_ms": {p: summary["time_to_first_token"][p] for p in PERCENTILES},
            "inter_token_latency_ms": {p: summary["inter_token_latency"][p] for p in PERCENTILES},
            "output_tokens_per_s": summary["output_token_throughput"]["avg"]}


def milliseconds(percentiles: dict) -> dict:
    return {p: None if percentiles[p] is None else percentiles[p] * 1000 for p in PERCENTILES}


def front_cost(runs: dict[str, list[dict]], levels: list[int]) -> list[dict]:
    """Per level: OpenAI over gRPC speculative tokens/s (median over rounds of each round's ratio) and the TTFT p50
    the front adds (median of the differences), plain tokens/s too."""
    rows = []
    for concurrency in levels:
        pairs = [(level(grpc, concurrency), level(http, concurrency))
                 for grpc, http in zip(runs["grpc"], runs["openai"])]
        rows.append({
            "concurrency": concurrency,
            "speculative_ratio": statistics.median(h["speculative_tokens_per_s"] / g["speculative_tokens_per_s"]
                                                   for g, h in pairs),
            "plain_ratio": statistics.median(h["plain_tokens_per_s"] / g["plain_tokens_per_s"] for g, h in pairs),
            "added_ttft_ms": statistics.median(
                (h["speculative_latency"]["time_to_first_token"]["p50"]
                 - g["speculative_latency"]["time_to_first_token"]["p50"]) * 1000 for g, h in pairs),
            "grpc_tokens_per_s": [g["speculative_tokens_per_s"] for g, _ in pairs],
            "openai_tokens_per_s": [h["speculative_tokens_per_s"] for _, h in pairs]})
    return rows


def markdown(result: dict) -> str:
    lines = ["| streams | OpenAI / gRPC tokens/s, speculative | plain | TTFT added (p50, ms) |", "|---|---|---|---|"]
    lines += [f"| {row['concurrency']} | {row['speculative_ratio']:.3f} | {row['plain_ratio']:.3f} | "
              f"{row['added_ttft_ms']:+.1f} |" for row in result["front_cost"]]
    if result.get("cpu_ms_per_token"):
        lines += ["", "| CPU ms per token | server | front | client |", "|---|---|---|---|"]
        lines += [f"| {protocol} | " + " | ".join(f"{cpu.get(name, 0.0):.2f}" for name in ("server", "front", "client"))
                  + " |" for protocol, cpu in result["cpu_ms_per_token"].items()]
    if result["tools"]:
        lines += ["", "| streams | tool | TTFT p50 / p90 / p99 (ms) | ITL p50 / p90 / p99 (ms) | tokens/s |",
                  "|---|---|---|---|---|"]
    for row in result["tools"]:
        for tool in ("bench", "aiperf"):
            figures = row[tool]
            ttft = " / ".join(f"{figures['time_to_first_token_ms'][p]:.0f}" for p in PERCENTILES)
            itl = " / ".join(f"{figures['inter_token_latency_ms'][p]:.1f}" for p in PERCENTILES)
            lines.append(f"| {row['concurrency']} | {tool} | {ttft} | {itl} | {figures['output_tokens_per_s']:.1f} |")
    return "\n".join(lines) + "\n"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("pipeline", nargs="?", default="pipelines/smollm2-draft-target.yaml")
    parser.add_argument("--engines-dir", type=Path, default=Path("engines"))
    parser.add_argument("--out", type=Path, default=Path("bench-results/openai-load"))
    parser.add_argument("--max-tokens", type=int, default=64)
    parser.add_argument("--concurrency", default="1,8")
    parser.add_argument("--requests", type=int, default=16)
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--aiperf", default=".venv/tools/aiperf/bin/aiperf", help="aiperf's command ('' to skip it)")
    options = parser.parse_args()
    levels = [int(c) for c in options.concurrency.split(",")]
    options.out.mkdir(parents=True, exist_ok=True)
    engine_dir = prepare_engine(options.pipeline, options.engines_dir).directory
    repository = write_repository(engine_dir, options.out / "repository")
    dataset = options.out / "prompts.jsonl"  # bench's shipped prompts, in bench's order, its output length each
    dataset.write_text("".join(json.dumps({"text": p["prompt"], "output_length": options.max_tokens}) + "\n"
                               for p in load_prompts()))
    with TritonServer(repository, log_file=options.out / "tritonserver.log") as server, \
            OpenAIFront(repository, server.grpc_url) as front:
        runs: dict[str, list[dict]] = {"grpc": [], "openai": []}
        processes = {"server": server.process.pid, "front": front.process.pid}
        for round_ in range(options.rounds):
            for protocol, url in (("grpc", server.grpc_url), ("openai", front.url)):
                runs[protocol].append(measured_bench(url, options, options.out / f"bench-{protocol}-{round_}.json",
                                                     processes))
        result = {"pipeline": options.pipeline, "max_tokens": options.max_tokens, "requests": options.requests,
                  "front_cost": front_cost(runs, levels), "tools": [],
                  "cpu_ms_per_token": {protocol: {name: statistics.median(run["cpu_ms_per_token"][name]
                                                                          for run in reports)
                                                  for name in reports[0]["cpu_ms_per_token"]}
                                       for protocol, reports in runs.items()}}
        if options.aiperf:
            model = served_name(repository)
            for concurrency in levels:
                ours = level(runs["openai"][-1], concurrency)
                result["tools"].append({"concurrency": concurrency, "bench": {
                    "time_to_first_token_ms": milliseconds(ours["speculative_latency"]["time_to_first_token"]),
                    "inter_token_latency_ms": milliseconds(ours["speculative_latency"]["inter_token_latency"]),
                    "output_tokens_per_s": ours["speculative_tokens_per_s"]},
                    "aiperf": aiperf(options.aiperf, front.url, model, engine_dir / "target", dataset, concurrency,
                                     options.requests, options.out / f"aiperf-c{concurrency}")})
    (options.out / "openai-load.json").write_text(json.dumps(result, indent=2))
    table = markdown(result)
    (options.out / "openai-load.md").write_text(table)
    print(table)


if __name__ == "__main__":
    main()
