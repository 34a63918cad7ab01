"""Load generator for a running server: concurrent streams, speculative and plain side by side, over Triton's gRPC
(HOST:PORT) or the OpenAI API (http://HOST:PORT/v1, chat completions), the same requests either way.

For each concurrency level, the same requests run twice, once with the server's speculation and once with
`num_draft_tokens = 0`, so the crossover (where speculation stops paying as the batch fills) shows in one table.
Optionally a fraction of requests is cancelled at random mid-stream, to check that nothing else is lost.
"""

from __future__ import annotations

import random
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass, field

import numpy as np

from specdeploy.bench.server_results import Percentiles, RequestLatencies
from specdeploy.errors import RequestError
from specdeploy.serve import openai_client
from specdeploy.serve.client import Chunk, NoResponse, generate
from specdeploy.serve.latency import RequestTiming


@dataclass
class RequestResult:
    prompt_index: int
    text: str = ""
    generated_tokens: int = 0
    drafted: int = 0
    accepted: int = 0
    seconds: float = 0.0
    error: str | None = None
    hung: bool = False  # no response within the client's timeout (error says so)
    cancelled: bool = False
    finished: bool = False
    timing: RequestTiming | None = None  # each streamed response's arrival and tokens (serve/latency.py)


PERCENTILES = (50, 90, 99)


def percentiles(values: list[float], which: tuple[int, ...] = PERCENTILES) -> Percentiles:
    """{"p50": ..., ...} of `values` (numpy's linear interpolation, as genai-perf reports them); None when empty."""
    if not values:
        return {f"p{p}": None for p in which}
    return {f"p{p}": float(v) for p, v in zip(which, np.percentile(values, which))}


@dataclass
class LevelResult:
    concurrency: int
    speculative: bool
    seconds: float
    results: list[RequestResult] = field(default_factory=list)

    @property
    def tokens_per_s(self) -> float:
        return sum(r.generated_tokens for r in self.results if r.finished) / self.seconds if self.seconds else 0.0

    def latencies(self) -> RequestLatencies:
        """Over the finished requests, in seconds: time to first token, inter-token latency (genai-perf's, per
        request) and request latency percentiles, each request's output tokens/s, and the streamed responses: the
        gaps between them and the tokens each carried (speculation's bursts)."""
        timings = [r.timing for r in self.results if r.finished and r.timing is not None and r.timing.bursts]
        bursts = [count for timing in timings for _, count in timing.bursts]
        itls = [t.inter_token_latency for t in timings if t.inter_token_latency is not None]
        gaps = [gap for t in timings for gap in t.gaps]  # burst to burst
        return RequestLatencies(
            time_to_first_token=percentiles([t.time_to_first_token for t in timings]),
            inter_token_latency=percentiles(itls),
            request_latency=percentiles([t.latency for t in timings], (50, 99)),
            tokens_per_s_per_request=percentiles([t.tokens / t.latency for t in timings if t.latency], (50,)),
            response_gap=percentiles(gaps),
            tokens_per_response={"mean": sum(bursts) / len(bursts) if bursts else None,
                                 **percentiles(bursts, (50, 99))},
            inter_token_latencies=itls, response_gaps=gaps)


def generate_at(url: str, prompt: str, max_tokens: int | None, stream: bool = True, **fields) -> Iterator[Chunk]:
    """serve/client.py's generate over the protocol the URL names (openai_client.is_openai_url)."""
    protocol = openai_client.generate if openai_client.is_openai_url(url) else generate
    return protocol(url, prompt, max_tokens, stream=stream, **fields)


def one_request(url: str, prompt: str, index: int, max_tokens: int, num_draft_tokens: int | None,
                cancel_after: int | None, **fields) -> RequestResult:
    """Stream one request; with cancel_after, drop the stream after that many responses. `fields`: more of
    generate_at's (model, timeout, request inputs)."""
    result = RequestResult(index)
    started = time.perf_counter()
    result.timing = RequestTiming(started)
    try:
        for count, chunk in enumerate(generate_at(url, prompt, max_tokens, stream=True,
                                               num_draft_tokens=num_draft_tokens, **fields), 1):
            result.text += chunk.text
            if chunk.statistics:
                generated = int(chunk.statistics["generated_tokens"])  # cumulative: this response's tokens
                result.timing.produced(generated - result.generated_tokens, time.perf_counter())
                result.generated_tokens = generated
                result.drafted = int(chunk.statistics["total_draft_tokens"])
                result.accepted = int(chunk.statistics["total_accepted_draft_tokens"])
            if chunk.final:
                result.finished = True
            elif cancel_after is not None and count >= cancel_after:
                result.cancelled = True
                break  # closing the generator cancels the stream
    except RequestError as exc:
        result.error = str(exc)
        result.hung = isinstance(exc, NoResponse)
    result.seconds = time.perf_counter() - started
    return result


def run_level(url: str, prompts: list[str], concurrency: int, requests: int, max_tokens: int,
              num_draft_tokens: int | None = None, cancel_fraction: float = 0.0, seed: int = 0) -> LevelResult:
    """`requests` requests (prompts in turn) with at most `concurrency` in flight."""
    chooser = random.Random(seed)
    plan = [(i % len(prompts), chooser.randint(1, 4) if chooser.random() < cancel_fraction else None)
            for i in range(requests)]
    results: list[RequestResult | None] = [None] * requests
    next_index = iter(range(requests))
    lock = threading.Lock()

    def worker() -> None:
        while True:
            with lock:
                index = next(next_index, None)
            if index is None:
                return
            prompt_index, cancel_after = plan[index]
            results[index] = one_request(url, prompts[prompt_index], prompt_index, max_tokens, num_draft_tokens,
                                         cancel_after)

    started = time.perf_counter()
    threads = [threading.Thread(target=worker) for _ in range(concurrency)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    return LevelResult(concurrency, num_draft_tokens != 0, time.perf_counter() - started, list(results))


def check_results(level: LevelResult, expected: dict[int, str]) -> dict[str, int]:
    """Counts of finished, cancelled, failed and corrupted requests (a finished text that differs from the
    prompt's reference text)."""
    counts = {"finished": 0, "cancelled": 0, "failed": 0, "lost": 0, "corrupted": 0}
    for result in level.results:
        if result.error is not None:
            counts["failed"] += 1
        elif result.cancelled:
            counts["cancelled"] += 1
        elif not result.finished:
            counts["lost"] += 1
        else:
            counts["finished"] += 1
            counts["corrupted"] += result.text != expected[result.prompt_index]
    return counts
