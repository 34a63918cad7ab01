"""One request's token timing as the server sees it, and what the latency histograms observe.

Speculation emits tokens in bursts of 1 to gamma + 1 per step, so "inter-token latency" needs a definition. We use
genai-perf's (triton-inference-server/perf_analyzer, genai-perf/genai_perf/profile_data_parser/
llm_profile_data_parser.py @ f7f17bf): per request, ITL = (request latency - time to first token) / (output tokens
- 1), i.e. the time from the first token to the last spread evenly over the tokens after the first. A burst then
counts as several tokens arriving at once, which lowers a request's ITL; what bursts do to smoothness shows in the
tokens per response (the burst sizes) instead, and, client side, in the gaps between streamed responses.

- time to first token: from the request's arrival at the model (queueing included) to its first token;
- inter-token latency: as above, one observation per request of at least two tokens;
- tokens per response: the tokens each response carried (streamed: one per step; otherwise the whole answer).

The Python backend's histograms (triton-inference-server/server, qa/python_models/custom_metrics/model.py
@ ebec81a): MetricFamily(kind=HISTOGRAM), then family.Metric(labels=..., buckets=[...]) with buckets required and
strictly increasing (anything else raises TritonModelException), and metric.observe(value); the server exports
_bucket (one per bucket and +Inf), _sum and _count. tests/serve/test_triton.py reads them from a real server.
"""

from __future__ import annotations

from dataclasses import dataclass, field

# Buckets that resolve a 2-core CPU (steps of 20-200 ms, first tokens up to seconds under load) and a GPU (steps
# of a few ms) alike; Triton requires them strictly increasing.
TTFT_BUCKETS = [0.005, 0.01, 0.02, 0.05, 0.1, 0.2, 0.5, 1.0, 2.0, 5.0, 10.0, 20.0, 60.0]
ITL_BUCKETS = [0.001, 0.002, 0.005, 0.01, 0.015, 0.02, 0.03, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.5, 1.0]
TOKENS_PER_RESPONSE_BUCKETS = [1, 2, 3, 4, 5, 6, 8, 12, 16, 32, 64, 128]


@dataclass
class RequestTiming:
    """Times on one clock (time.perf_counter), seconds. Server side, a burst is a step's tokens; client side, a
    streamed response's."""

    arrived: float
    bursts: list[tuple[float, int]] = field(default_factory=list)  # (when, tokens) of each burst of tokens
    responses: list[int] = field(default_factory=list)  # server side: tokens per response sent

    def produced(self, count: int, now: float) -> None:
        """`count` more tokens were ready (or arrived) at `now`."""
        if count > 0:
            self.bursts.append((now, count))

    @property
    def tokens(self) -> int:
        return sum(count for _, count in self.bursts)

    @property
    def time_to_first_token(self) -> float | None:
        return self.bursts[0][0] - self.arrived if self.bursts else None

    @property
    def latency(self) -> float | None:
        """From arrival to the last token."""
        return self.bursts[-1][0] - self.arrived if self.bursts else None

    @property
    def inter_token_latency(self) -> float | None:
        """genai-perf's per-request ITL (see the module docstring); None under two tokens."""
        tokens = self.tokens
        if tokens < 2:
            return None
        return (self.bursts[-1][0] - self.bursts[0][0]) / (tokens - 1)

    @property
    def gaps(self) -> list[float]:
        """The time between consecutive bursts."""
        return [later[0] - earlier[0] for earlier, later in zip(self.bursts, self.bursts[1:])]
