"""What both flavours' `speculative` models share: reading a request, answering it (text or ids, streamed or
once, with its statistics), the specdeploy_* metrics and the drain watch. `pb_utils` (triton_python_backend_utils)
is passed in, so this module imports without a server."""

from __future__ import annotations

import os
import threading
import time
from pathlib import Path
from typing import Protocol

import numpy as np

from specdeploy.decoding.detokenizer import IncrementalDetokenizer
from specdeploy.decoding.finish import Finish, finish_message
from specdeploy.decoding.serving_request import ServingCounters
from specdeploy.decoding.stats import RequestStats
from specdeploy.errors import RequestError
from specdeploy.serve.latency import ITL_BUCKETS, TOKENS_PER_RESPONSE_BUCKETS, TTFT_BUCKETS, RequestTiming
from specdeploy.serve.model_files import DRAIN_FILE_VARIABLE, drained_file
from specdeploy.serve.requests import (
    SCALAR_INPUTS,
    STATISTICS,
    encode_request,
    error_response,
    generation_request,
    scalar,
)
from specdeploy.spec.pipeline import PipelineSpec
from specdeploy.spec.request import GenerationRequest

INPUTS = ("input_ids", "stop_words_ids", "text_input", "stop_words", *SCALAR_INPUTS)


class Drainable(Protocol):
    def drain(self, deadline: float) -> None: ...

    @property
    def idle(self) -> bool: ...


class RequestQueue(Protocol):
    """What runs requests: the torch flavour's Scheduler or the trtllm flavour's Orchestrator."""

    def submit(self, request: GenerationRequest, on_tokens, is_cancelled) -> object: ...


class Metrics:
    """specdeploy_* counters and gauges through the Python backend's metric API, labelled by model and method.

    Counters follow the serving loop's ServingCounters: each update pushes the difference since the last one. The
    acceptance counters also carry `request_kind` (serving.request_kinds, or "unspecified"): a bounded label set.
    """

    COUNTERS = {
        "drafted": ("specdeploy_drafted_tokens_total", "Drafted tokens sent to verification"),
        "accepted": ("specdeploy_accepted_tokens_total", "Drafted tokens accepted"),
        "steps": ("specdeploy_verification_steps_total", "Target verification steps, summed over requests"),
        "per_position": ("specdeploy_accepted_tokens_per_position_total",
                         "Accepted drafted tokens by draft position (1-based; Medusa: tree depth = head)"),
        "requests": ("specdeploy_requests_total", "Finished requests by outcome"),
    }

    HISTOGRAMS = {  # serve/latency.py defines what each observes
        "ttft": ("specdeploy_time_to_first_token_seconds", "Time from a request's arrival to its first token",
                 TTFT_BUCKETS),
        "itl": ("specdeploy_inter_token_latency_seconds", "Per request, (last token - first token) / (tokens - 1): "
                "genai-perf's inter-token latency", ITL_BUCKETS),
        "tokens_per_response": ("specdeploy_tokens_per_response", "Tokens carried by each response sent (streamed: "
                                "one response per step, 1 to gamma + 1 tokens)", TOKENS_PER_RESPONSE_BUCKETS),
    }

    def __init__(self, pb_utils, labels: dict[str, str]) -> None:
        family = pb_utils.MetricFamily
        self.pb = pb_utils
        self.labels = labels
        # The backend deletes a metric when its family object goes away: keep every family referenced.
        self.families = {key: family(name=name, description=text, kind=family.COUNTER)
                         for key, (name, text) in self.COUNTERS.items()}
        self.families["batch_size"] = family(name="specdeploy_batch_size", description="Sequences in the current "
                                             "batch", kind=family.GAUGE)
        self.families["free_kv"] = family(name="specdeploy_free_kv_slots", description="KV slots not reserved by "
                                          "active sequences", kind=family.GAUGE)
        # Triton's queue time misses these: the decoupled model hands every request over at once
        self.families["waiting"] = family(name="specdeploy_waiting_requests", description="Requests accepted and "
                                          "queued for a batch row, not yet running", kind=family.GAUGE)
        self.histograms = {}
        for key, (name, text, buckets) in self.HISTOGRAMS.items():
            self.families[key] = family(name=name, description=text, kind=family.HISTOGRAM)
            self.histograms[key] = self.families[key].Metric(labels=labels, buckets=buckets)
        self.batch_size = self.families["batch_size"].Metric(labels=labels)
        self.free_kv = self.families["free_kv"].Metric(labels=labels)
        self.waiting = self.families["waiting"].Metric(labels=labels)
        self.gauges: dict[str, int] = {}
        self.series: dict[tuple, object] = {}
        self.pushed: dict[tuple, int] = {}
        self.invalid = 0
        self.lock = threading.Lock()

    def _advance(self, key: str, total: int, **extra_labels: str) -> None:
        """Bring one counter series up to `total`."""
        series = (key, tuple(sorted(extra_labels.items())))
        if series not in self.series:
            self.series[series] = self.families[key].Metric(labels={**self.labels, **extra_labels})
        delta = total - self.pushed.get(series, 0)
        if delta > 0:
            self.series[series].increment(delta)
            self.pushed[series] = total

    def observe(self, timing: RequestTiming) -> None:
        """A finished request's latencies and response sizes (each observation is a round trip to the backend
        process, so they are made once, when the request ends)."""
        with self.lock:
            if timing.time_to_first_token is not None:
                self.histograms["ttft"].observe(timing.time_to_first_token)
            if timing.inter_token_latency is not None:
                self.histograms["itl"].observe(timing.inter_token_latency)
            for tokens in timing.responses:
                self.histograms["tokens_per_response"].observe(tokens)

    def count_invalid(self) -> None:
        with self.lock:
            self.invalid += 1
            self._advance("requests", self.invalid, outcome="invalid")

    def update(self, counters: ServingCounters, batch_size: int, free_kv: int, waiting: int) -> None:
        """Bring the metrics up to the totals in `counters` and set the gauges."""
        with self.lock:
            for kind, totals in list(counters.by_kind.items()):  # a submitting thread may update, too
                for key in ("drafted", "accepted", "steps"):
                    self._advance(key, getattr(totals, key), request_kind=kind)
                for index, total in enumerate(totals.accepted_per_position):
                    self._advance("per_position", total, position=str(index + 1), request_kind=kind)
            for outcome, total in list(counters.outcomes.items()):
                self._advance("requests", total, outcome=outcome)
            self._set("batch_size", batch_size)
            self._set("free_kv", free_kv)
            self._set("waiting", waiting)

    def report_cpu_threads(self, threads: int, source: str) -> None:
        """The torch flavour's intra-op threads, and where the count came from (models/cpu_threads.py): set once, at
        load. `source` is one of four values, so the label set stays bounded."""
        family = self.pb.MetricFamily
        self.families["cpu_threads"] = family(name="specdeploy_cpu_threads", description="torch intra-op threads "
                                              "the engine runs (source: how the count was chosen)", kind=family.GAUGE)
        self.families["cpu_threads"].Metric(labels={**self.labels, "source": source}).set(threads)

    def _set(self, gauge: str, value: int) -> None:
        """Set a gauge when its value changed: each set is a round trip to the backend process, and the scheduler
        thread updates the metrics after every step (gauges change only when requests join or leave)."""
        if self.gauges.get(gauge) != value:
            getattr(self, gauge).set(value)
            self.gauges[gauge] = value


class DrainWatcher:
    """Watches for the drain file `specdeploy serve` writes when a shutdown begins (its path is in the environment,
    its content the deadline) and tells the scheduler; once the scheduler is idle, writes the drained file, on which
    the launcher lets Triton unload the models (serve/drain_hold.py). Triton gives a model no notice of its own."""

    INTERVAL = 0.2  # seconds between looks

    def __init__(self, scheduler: Drainable) -> None:
        self.path = os.environ.get(DRAIN_FILE_VARIABLE)
        self.scheduler = scheduler
        self.stopped = threading.Event()
        self.thread = threading.Thread(target=self._run, name="specdeploy-drain-watch", daemon=True)
        if self.path:
            self.thread.start()

    def _run(self) -> None:
        while not self.stopped.wait(self.INTERVAL):
            try:
                deadline = float(Path(self.path).read_text())
            except (OSError, ValueError):
                continue  # not there (yet)
            self.scheduler.drain(deadline)
            break
        while not self.stopped.wait(self.INTERVAL):
            if self.scheduler.idle:
                drained_file(self.path).write_text("")
                return

    def stop(self) -> None:
        self.stopped.set()


def read_request(pb, request, encoder, pipeline: PipelineSpec) -> tuple[GenerationRequest, bool, bool]:
    """One Triton request as (GenerationRequest, stream, as_ids): token ids (from the ensemble's preprocessing) or
    text (a client calling the speculative model directly), answered in text, or in ids when it asks for output_ids
    and not text_output; stop_words with either. RequestError names a bad field."""
    inputs = {name: tensor.as_numpy() for name in INPUTS
              if (tensor := pb.get_input_tensor_by_name(request, name)) is not None}
    text_input = inputs.pop("text_input", None)
    if text_input is not None:
        if "input_ids" in inputs:
            raise RequestError("text_input: give text_input or input_ids, not both")
        inputs["input_ids"] = np.array([encode_request(encoder, text_input)], dtype=np.int32)
    elif "input_ids" not in inputs:
        raise RequestError("text_input: required input is missing (or input_ids, as the ensemble sends)")
    wanted = set(request.requested_output_names())
    as_ids = "output_ids" in wanted and "text_output" not in wanted
    return generation_request(inputs, pipeline), bool(scalar(inputs, "stream")), as_ids


def submit_request(pb, request, encoder, pipeline: PipelineSpec, tokenizer, queue: RequestQueue,
                   metrics: Metrics) -> None:
    """Read one Triton request and queue it; a bad request (or a bug) gets one error response, never a traceback."""
    sender = request.get_response_sender()
    try:
        generation, stream, as_ids = read_request(pb, request, encoder, pipeline)
        queue.submit(generation, Responder(pb, sender, stream, None if as_ids else tokenizer, metrics,
                                           generation.stop_strings),
                     is_cancelled=sender.is_cancelled)
    except Exception as exc:
        if isinstance(exc, RequestError):
            metrics.count_invalid()
        sender.send(error_response(pb, exc), flags=pb.TRITONSERVER_RESPONSE_COMPLETE_FINAL)


def stats_response(pb, stats, text: str | None = None, ids: list[int] | None = None,
                   finished: Finish | None = None) -> object:
    """A response: text_output (or output_ids) and the request's statistics so far; the final one also names how the
    request ended (finish_reason)."""
    if text is not None:
        outputs = [pb.Tensor("text_output", np.array([[text.encode("utf-8")]], dtype=object))]
    else:
        outputs = [pb.Tensor("output_ids", np.array([ids], dtype=np.int32))]
    for name, kind, field_name in STATISTICS:
        dtype = np.int32 if kind == "TYPE_INT32" else np.float32
        outputs.append(pb.Tensor(name, np.array([[getattr(stats, field_name)]], dtype=dtype)))
    if finished is not None:
        outputs.append(pb.Tensor("finish_reason", np.array([[finished.value.encode("utf-8")]], dtype=object)))
    return pb.InferenceResponse(outputs)


class Responder:
    """The callback for one request's tokens: streamed, each step's tokens go out as the text they complete (never
    broken UTF-8, and ending with the first of `stops`), or as token ids when `tokenizer` is None; otherwise
    everything goes out once at the end. With `metrics`, the request's latencies are observed when it ends
    (serve/latency.py)."""

    def __init__(self, pb, sender, stream: bool, tokenizer, metrics: Metrics | None = None,
                 stops: list[str] | None = None) -> None:
        self.pb, self.sender, self.stream = pb, sender, stream
        self.detokenizer = None if tokenizer is None else IncrementalDetokenizer(tokenizer, stops or ())
        self.ids: list[int] = []
        self.sent = 0
        self.metrics = metrics
        self.timing = RequestTiming(time.perf_counter())

    def __call__(self, tokens: list[int], finished: Finish | None, stats: RequestStats) -> None:
        self.timing.produced(len(tokens), time.perf_counter())
        pb = self.pb
        self.ids.extend(tokens)
        if finished is Finish.CANCELLED:
            self._send_final(None)
            return
        if finished is not None and finished.is_failure:
            code = pb.TritonError.UNAVAILABLE if finished is Finish.SHUTDOWN else pb.TritonError.INTERNAL
            message = finish_message(finished, stats.finish_detail)
            self._send_final(pb.InferenceResponse(error=pb.TritonError(message, code)))
            return
        if not self.stream and finished is None:
            return
        new = self.ids[self.sent:]
        if self.detokenizer is not None:
            response = stats_response(pb, stats, text=self.detokenizer.add(new), finished=finished)
        else:
            response = stats_response(pb, stats, ids=new, finished=finished)
        if new:  # a final response may carry no token
            self.timing.responses.append(len(new))
        self.sent = len(self.ids)
        if finished is None:
            self.sender.send(response, flags=0)
        else:
            self._send_final(response)

    def _send_final(self, response) -> None:
        """Observe the request's latencies, then end it: a client that reads the metrics once its stream has ended
        finds this request counted."""
        try:
            if self.metrics is not None:
                self.metrics.observe(self.timing)
        finally:
            if response is None:
                self.sender.send(flags=self.pb.TRITONSERVER_RESPONSE_COMPLETE_FINAL)
            else:
                self.sender.send(response, flags=self.pb.TRITONSERVER_RESPONSE_COMPLETE_FINAL)


class ServedModel:
    """The Triton Python model's request loop, shared by both flavours' model files: `initialize` sets
    `self.server` (whose submit answers each request on its own time, the model being decoupled) and this does the
    rest."""

    server = None

    def execute(self, requests):
        for request in requests:
            self.server.submit(request)
        return None

    def finalize(self):
        self.server.stop()
