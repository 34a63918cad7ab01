"""ServerBenchReport: what `bench --url` measured of a running server at each concurrency level, typed, and its JSON
form (`bench --url --json`, DIR/server.json of `--report`).

The JSON is one object with the url, max_tokens, price_per_hour and the levels, one object per level whose keys are
ServerLevel's fields. The dollar figures are written only when a price was given, and the in-process comparison only
when a pipeline was given, as `bench --url` has always written them, so earlier files load.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass
from typing import Any, Literal

from specdeploy.bench.results import known_fields
from specdeploy.errors import SpecdeployError

Mode = Literal["speculative", "plain"]
MODES: tuple[Mode, ...] = ("speculative", "plain")  # each level runs the same requests both ways
Percentiles = dict[str, float | None]  # {"p50": ..., "p99": ...}: numpy's, as genai-perf reports them; None: no samples


def milliseconds(seconds: float | None) -> float:
    """A latency in milliseconds; NaN where a level had no sample, which a plot leaves out."""
    return float("nan") if seconds is None else seconds * 1000


@dataclass
class RequestLatencies:
    """One level's latencies in one mode, in seconds, over its finished requests (server_load.py)."""

    time_to_first_token: Percentiles
    inter_token_latency: Percentiles  # genai-perf's: per request, (latency - time to first token) / (tokens - 1)
    request_latency: Percentiles
    tokens_per_s_per_request: Percentiles
    response_gap: Percentiles  # between streamed responses
    tokens_per_response: dict[str, float | None]  # the mean and percentiles: speculation's bursts
    inter_token_latencies: list[float]  # the samples behind the distributions the report plots
    response_gaps: list[float]


@dataclass
class ServerLevel:
    """One concurrency level: the same requests with the server's speculation and with num_draft_tokens 0."""

    concurrency: int
    requests: int
    speculative_tokens_per_s: float  # aggregate, over the level's wall time
    plain_tokens_per_s: float
    speedup: float
    acceptance_rate: float
    failed: int  # requests of either mode that ended in an error
    speculative_latency: RequestLatencies
    plain_latency: RequestLatencies
    plain_usd_per_million_tokens: float | None = None  # with a price per hour; None also at no tokens/s
    speculative_usd_per_million_tokens: float | None = None
    vs_single_stream: float | None = None  # speculative tokens/s over the one-stream level's (None: no such level)

    def latency(self, mode: Mode) -> RequestLatencies:
        return self.speculative_latency if mode == "speculative" else self.plain_latency

    def usd_per_million_tokens(self, mode: Mode) -> float | None:
        return self.speculative_usd_per_million_tokens if mode == "speculative" else self.plain_usd_per_million_tokens

    def to_json(self, priced: bool) -> dict[str, Any]:
        data = asdict(self)
        if not priced:
            del data["plain_usd_per_million_tokens"], data["speculative_usd_per_million_tokens"]
        return data

    @classmethod
    def from_json(cls, data: dict) -> ServerLevel:
        return cls(**{**known_fields(cls, data),
                      **{f"{mode}_latency": RequestLatencies(**data[f"{mode}_latency"]) for mode in MODES}})


@dataclass
class ServerBenchReport:
    url: str
    max_tokens: int | None  # None: the server's default
    price_per_hour: float | None  # USD, bench --price-per-hour
    levels: list[ServerLevel]
    in_process_tokens_per_s: float | None = None  # the pipeline in-process, one stream, prefill included
    single_stream_vs_in_process: float | None = None
    plain_url: str | None = None  # the plain twin the plain rates came from (bench --plain-url); None: `url` itself

    @property
    def priced(self) -> bool:
        return self.price_per_hour is not None

    def to_json(self) -> dict[str, Any]:
        data: dict[str, Any] = {"url": self.url, "max_tokens": self.max_tokens, "price_per_hour": self.price_per_hour,
                                "levels": [level.to_json(self.priced) for level in self.levels]}
        if self.plain_url is not None:
            data["plain_url"] = self.plain_url
        if self.in_process_tokens_per_s is not None:
            data.update(in_process_tokens_per_s=self.in_process_tokens_per_s,
                        single_stream_vs_in_process=self.single_stream_vs_in_process)
        return data

    @classmethod
    def from_json(cls, data: dict) -> ServerBenchReport:
        try:
            return cls(url=data["url"], plain_url=data.get("plain_url"), max_tokens=data["max_tokens"],
                       price_per_hour=data.get("price_per_hour"),
                       levels=[ServerLevel.from_json(level) for level in data["levels"]],
                       in_process_tokens_per_s=data.get("in_process_tokens_per_s"),
                       single_stream_vs_in_process=data.get("single_stream_vs_in_process"))
        except (KeyError, TypeError) as error:
            raise SpecdeployError(f"not a bench --url report ({type(error).__name__}: {error})") from None
