"""Speculation over TensorRT-LLM engines: the loop our `speculative` model runs in a trtllm repository.

The engines run in Triton's `tensorrtllm` backend (in-flight batching, paged KV cache with block reuse); this loop
only decides what to ask them. One request, step by step:
1. prefill: the target generates the first token (its prompt blocks then stay in the reuse cache);
2. propose up to gamma tokens: the draft engine generates them (with its raw logits when sampling), or the n-gram
   proposer finds them in the text so far;
3. verify: the target gets the sequence plus `draft_input_ids` and, when sampling, `draft_logits` whose softmax is
   the distribution each drafted token was drawn from (trtllm_sampling.py: the executor applies nothing else to
   them), and returns the accepted drafted tokens plus one of its own; they are committed and sent to the client.
gamma comes from the request, the pipeline and the batch-aware policy (by how many requests are running now); when
the policy turns speculation off, the target decodes plain chunks and the policy is asked again after each.

Engine calls go through `EngineCalls` (Triton BLS in engine_calls.py; an in-process double in the tests), so the loop
is tested without a server. Nothing here reads a tensor name.
"""

from __future__ import annotations

import copy
import functools
import hashlib
import secrets
import threading
import time
import traceback
from collections import deque
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import NamedTuple, Protocol

import numpy as np

from specdeploy.decoding.draft_length import ProposalLength, step_gamma
from specdeploy.decoding.finish import Finish
from specdeploy.decoding.prompt_lookup import common_prefix_length, prompt_lookup
from specdeploy.decoding.sequence import Sequence
from specdeploy.decoding.serving_request import ServingCounters, ServingRequest, TokenCallback
from specdeploy.errors import RequestError, ShuttingDown
from specdeploy.serve.trtllm import sampling as trtllm_sampling
from specdeploy.spec.pipeline import PipelineSpec
from specdeploy.spec.request import GenerationRequest, check_request
from specdeploy.spec.sampling_params import SamplingParams
from specdeploy.spec.speculation import NgramSpec

# Tokens per streamed target call (plain decode, Medusa). A BLS stream cannot be cancelled, so this bounds what a
# cancelled request still waits for; each new call finds the sequence in the engine's KV reuse cache.
STREAM_CHUNK = 16
# The same for a lookahead engine, longer: each call starts its lookahead state afresh (a window drawn from the text,
# N - 2 warm-up steps before its rows are full, the n-gram pool seeded from the sequence again; LookaheadAlgorithm::
# setup, lookaheadAlgorithm.cpp @ 3585984b), so short calls would spend much of their steps warming up. A chosen
# bound, not a measured one: trtllm-check's lookahead slice measures the speed it gives.
LOOKAHEAD_CHUNK = 64


@dataclass(frozen=True)
class EngineSteps:
    """How a target engine that speculates by itself (Medusa's tree, lookahead's window and guesses) is counted:
    each streamed response is one engine step, its tokens the accepted drafts plus one. nodes: draft tokens one step
    verifies at most (the tree's nodes; lookahead's (N - 2) + (W - 1 + G)(N - 1)); depth: the most a step accepts;
    chunk: tokens per streamed call."""

    nodes: int
    depth: int
    chunk: int

    @classmethod
    def of(cls, pipeline: PipelineSpec) -> EngineSteps | None:
        """None when this loop proposes the drafts (or nothing)."""
        speculation = pipeline.speculation
        mode = speculation.traits.trtllm.engine_mode
        if mode not in ENGINE_MODES:
            return None
        return cls(speculation.verify_nodes()[0], speculation.settings.max_accepted, ENGINE_MODES[mode].chunk)


def check_plain_request(request: GenerationRequest, method: str) -> None:
    """RequestError naming num_draft_tokens for a request that asks a target engine which speculates by itself
    (Medusa, lookahead) to decode plainly: the engine cannot. Its speculation is fixed when Triton loads the model
    (medusa_choices and the lookahead sizes are model parameters; executor DecodingConfig::setMedusaChoices,
    decodingConfig.cpp @ 97e36d0b), and the tensorrt_llm model takes no per-request Medusa input (config.pbtxt @
    0c8de69a); lookahead's per-request sizes exist upstream but we refuse them (docs/tensorrt-llm.md). Served, such
    a request would come back speculative under a plain label, and every plain-vs-speculative comparison made with
    it (a check, a benchmark's speedup) would compare the engine with itself."""
    if request.num_draft_tokens == 0:
        raise RequestError(f"num_draft_tokens: this pipeline runs TensorRT-LLM's {method} decoding inside its target "
                           f"engine, which speculates on every request (set when the model loads); 0 cannot turn it "
                           f"off. For plain decoding serve the same target without speculation; leave "
                           f"num_draft_tokens out here")


def check_top_k(request: GenerationRequest) -> None:
    """RequestError naming top_k for a sampled request whose top-k the executor would not run as asked: its layers
    clamp a top-k above trtllm_sampling.TOP_K_MAX to it (clampTopK, externalDraftTokensLayer.cpp @ 1d263f15), so
    the target would sample from the top 1,024 while the q sent with the drafts (draft_logits) was computed with
    the requested k: acceptance would no longer follow the target's distribution. Greedy requests ignore top_k."""
    params = request.sampling
    if not params.greedy and params.top_k > trtllm_sampling.TOP_K_MAX:
        raise RequestError(f"top_k: TensorRT-LLM samples with a top-k of at most {trtllm_sampling.TOP_K_MAX} (its "
                           f"layers clamp a larger one); send 0 (no limit) or 1 to {trtllm_sampling.TOP_K_MAX}, got "
                           f"{params.top_k}")


def check_lookahead_request(request: GenerationRequest) -> None:
    """RequestError naming the field for a request a TensorRT-LLM lookahead engine would answer as something else,
    without a word: its lookahead layer takes the top token at every position (invokeBatchTopKSampling with top-k
    1) and its decoding mode has no temperature, penalty or banned-words bit (lookaheadDecodingLayer.cpp @
    3585984b; DecodingMode::Lookahead in cpp/include/tensorrt_llm/executor/types.h). So a sampled or penalised
    request is refused rather than returned greedy and unpenalised. top_k and top_p do nothing at temperature 0."""
    params = request.sampling
    if not params.greedy:
        raise RequestError(f"temperature: this pipeline runs TensorRT-LLM's lookahead decoding, which decodes "
                           f"greedily whatever a request asks (temperature, top_k and top_p are ignored upstream); "
                           f"send temperature 0, got {params.temperature}")
    if params.repetition_penalty != 1:
        raise RequestError(f"repetition_penalty: this pipeline runs TensorRT-LLM's lookahead decoding, which applies "
                           f"no penalties; send 1, got {params.repetition_penalty}")


# Set to 1 in the server's environment, it lets sampled requests reach a Medusa engine (check_medusa_request). For
# trtllm-check's Medusa distribution arm alone, the evidence that would lift the refusal; never for serving.
UNCHECKED_MEDUSA_SAMPLING = "SPECDEPLOY_UNCHECKED_MEDUSA_SAMPLING"


def check_medusa_request(request: GenerationRequest, unchecked_sampling: bool = False) -> None:
    """RequestError naming the field for a request a TensorRT-LLM Medusa engine would answer as something else,
    without a word. DecodingMode::Medusa has no occurrence-penalty bit (cpp/include/tensorrt_llm/executor/types.h;
    the penalty layer applies each only under its bit, penaltyLayer.cpp): a penalty is refused at any temperature.
    Greedy (temperature 0, sent as top-k 1) is exact and served.
    A sampled request is refused: the engine draws every tree node of a step from the request's one random state
    (one curand state per request, MedusaDecodingLayer; all nodes sampled in one call, samplePrimeHeadTokens; the
    top-k kernel's block of each (request, node) calls curand_uniform on that state: NVIDIA/TensorRT-LLM@1a43c7d6
    cpp/tensorrt_llm/layers/medusaDecodingLayer.cpp and the 1.x samplingTopKKernels.cu), so the nodes' uniforms are
    not independent and a child's token given its accepted parent is biased (the backend double does the same, and
    test_orchestration's distribution test fails on it).
    unchecked_sampling (trtllm-check's distribution arm only, UNCHECKED_MEDUSA_SAMPLING) lets sampling through as
    the engine runs it, refusing only what it would ignore: no temperature bit (temperature must be 1), top-k alone
    (top_p 1), and a top_k of 1 to trtllm_sampling.TOP_K_MAX, since a top-k of 0 makes the kernel write nothing
    (samplingTopKKernels.cu @ 03961722)."""
    params = request.sampling
    medusa = "this pipeline runs TensorRT-LLM's Medusa decoding, which"
    if params.repetition_penalty != 1:
        raise RequestError(f"repetition_penalty: {medusa} applies no penalties (its decoding mode has no penalty); "
                           f"send 1, got {params.repetition_penalty}")
    if params.greedy:
        return
    if not unchecked_sampling:
        raise RequestError(f"temperature: {medusa} decodes exactly only greedily: at temperature > 0 its engine "
                           f"draws all tree nodes of a step from one random state, so sampled text would not follow "
                           f"the model's distribution. Send temperature 0 (or top_k 1) here, or serve the pipeline "
                           f"on the torch backend, whose Medusa samples exactly; got temperature "
                           f"{params.temperature}")
    if params.temperature != 1:
        raise RequestError(f"temperature: {medusa} samples the unscaled logits (its decoding mode has no "
                           f"temperature); send 1 or 0 (greedy), got {params.temperature}")
    if params.top_p != 1:
        raise RequestError(f"top_p: {medusa} samples with top-k alone and ignores top-p; send 1, got {params.top_p}")
    if not 1 <= params.top_k <= trtllm_sampling.TOP_K_MAX:
        raise RequestError(f"top_k: {medusa} samples with top-k alone, and its kernel takes 1 to "
                           f"{trtllm_sampling.TOP_K_MAX} (0, no limit, makes it write no token); got {params.top_k}")


@dataclass(frozen=True)
class Sampling:
    """What an engine call samples with: the request's processing and this call's own seed. Engines get no end
    token: the executor stops at one without returning it, so this loop, which must see every token to stop at the
    request's end tokens and stop sequences, ends requests itself."""

    params: SamplingParams
    seed: int


def call_seed(base: int, call: int) -> int:
    """Call `call`'s seed of a request whose base seed is `base`: a hash, so no two calls (of this request or of
    another, whatever their bases) share a random stream, which the exact rule's independent draws need. The
    executor seeds a call that brings no seed with 0, so every call brings one."""
    digest = hashlib.blake2b(f"{base}:{call}".encode(), digest_size=8).digest()
    return int.from_bytes(digest, "little")


class EngineCalls(Protocol):
    """The two engines as the loop uses them. `tokens` is the whole sequence so far (the engine reuses its cached
    prefix); every call returns only new tokens."""

    def draft(self, tokens: list[int], count: int, sampling: Sampling, with_logits: bool
              ) -> tuple[list[int], np.ndarray | None]:
        """Up to `count` tokens from the draft engine, and their logits [n, V] when asked."""

    def target(self, tokens: list[int], count: int, sampling: Sampling, draft_ids: list[int] | None = None,
               draft_logits: np.ndarray | None = None) -> Iterator[list[int]]:
        """The target engine's tokens as it produces them (streamed). With draft_ids: one verification step, whose
        tokens are the accepted drafted prefix and one more (the executor ends a request that brought drafts after
        that step, whatever `count` says; an engine that decoded on would send more, each a plain target sample).
        draft_logits: [k, padded vocabulary], q's logits (softmax only)."""


@dataclass(eq=False, kw_only=True)
class Job(ServingRequest):
    """A request as both serving loops keep it, plus what the orchestration adds: the seed its engine calls'
    own seeds derive from, how many calls it made, and the tokens its final callback carries."""

    seed: int  # the request's seed, or a random one: every engine call's seed derives from it
    calls: int = 0
    pending: list[int] = field(default_factory=list)  # the last tokens, sent with the final callback

    def sampling(self) -> Sampling:
        """The sampling of this request's next engine call, with that call's own seed."""
        self.calls += 1
        return Sampling(self.sequence.params, call_seed(self.seed, self.calls))


class EngineMode(NamedTuple):
    """A target engine that speculates by itself, by its decoding mode: the name its messages give, what it needs
    of each request, and the tokens per streamed call."""

    name: str
    check: Callable[[GenerationRequest], None]
    chunk: int


# keyed by the recipes' engine_mode (spec/speculation.py: trtllm-build's --speculative_decoding_mode)
ENGINE_MODES = {"medusa": EngineMode("Medusa", check_medusa_request, STREAM_CHUNK),
                "lookahead_decoding": EngineMode("lookahead", check_lookahead_request, LOOKAHEAD_CHUNK)}


class Orchestrator:
    def __init__(self, pipeline: PipelineSpec, calls: EngineCalls, vocab_size: int, end_ids: frozenset[int],
                 on_change: Callable[[Orchestrator], None] | None = None, tokenizer=None,
                 unchecked_medusa_sampling: bool = False) -> None:
        """pipeline: the served pipeline (limits, sampling defaults, speculation, policy). end_ids: the model's
        end-of-sequence tokens. on_change: called when a request joins or leaves (metrics). tokenizer: the
        target's, for requests' stop strings (the executor matches token ids only: this loop matches the text).
        unchecked_medusa_sampling: let sampled requests reach a Medusa engine (check_medusa_request; trtllm-check
        only)."""
        self.pipeline, self.calls, self.vocab_size, self.end_ids = pipeline, calls, vocab_size, end_ids
        mode = pipeline.speculation.traits.trtllm.engine_mode
        self.engine_mode = ENGINE_MODES.get(mode)
        # only the engine mode whose check has the setting honours it (Medusa's)
        self.unchecked_sampling = unchecked_medusa_sampling and self.engine_mode is ENGINE_MODES.get("medusa")
        if self.unchecked_sampling:
            self.engine_mode = self.engine_mode._replace(
                check=functools.partial(check_medusa_request, unchecked_sampling=True))
        self.tokenizer = tokenizer
        self.on_change = on_change
        self.policy = pipeline.serving.policy
        self.kv_capacity = pipeline.kv_capacity_tokens
        self.counters = ServingCounters()
        self.ngram = pipeline.speculation.settings if isinstance(pipeline.speculation.settings, NgramSpec) else None
        self.engine_steps = EngineSteps.of(pipeline)
        settings = pipeline.backend.settings
        self.logits_width = trtllm_sampling.padded_vocab_size(vocab_size, settings.tp_size * settings.pp_size)
        self.active: list[Job] = []
        self.waiting: deque[Job] = deque()
        self.lock = threading.Lock()
        self.drain_deadline: float | None = None
        # One thread per running request: each waits on its engine calls, which the engines batch in flight.
        self.workers = ThreadPoolExecutor(pipeline.limits.max_batch_size, thread_name_prefix="specdeploy-orch")

    # ---- requests -------------------------------------------------------------------------------------------
    def submit(self, request: GenerationRequest, on_tokens: TokenCallback,
               is_cancelled: Callable[[], bool] = lambda: False) -> None:
        """Queue a request (RequestError if invalid, ShuttingDown while draining); `on_tokens` gets its tokens."""
        if self.drain_deadline is not None:
            raise ShuttingDown("server is shutting down: not accepting new requests")
        check_request(request, self.pipeline, self.vocab_size, self.kv_capacity)
        engine_mode = self.engine_mode
        if engine_mode is not None:
            check_plain_request(request, engine_mode.name)
            engine_mode.check(request)
        check_top_k(request)  # after Medusa's, whose message says why its engine needs a top-k
        sequence = Sequence.for_request(request, ProposalLength.for_request(request, self.pipeline), self.end_ids,
                                        tokenizer=self.tokenizer)
        seed = request.sampling.seed if request.sampling.seed is not None else secrets.randbits(64)
        job = Job(sequence=sequence, on_tokens=on_tokens, is_cancelled=is_cancelled,
                  kind=request.kind_label, reserved=request.kv_slots(self.pipeline), seed=seed)
        with self.lock:
            self.waiting.append(job)
        self._changed()  # the queued-requests gauge
        self.workers.submit(self._run, job)

    def drain(self, deadline: float) -> None:
        """Take no new requests, end the queued ones now and the running ones at `deadline` (time.time()) if they
        have not finished by then, each with Finish.SHUTDOWN (as the torch flavour's scheduler)."""
        self.drain_deadline = deadline
        with self.lock:
            queued = list(self.waiting)
            self.waiting.clear()
            for job in queued:
                job.sequence.end(Finish.SHUTDOWN, "the server is shutting down before this request started")
                self.counters.count_outcome(Finish.SHUTDOWN)
        for job in queued:
            job.on_tokens([], job.sequence.finish_reason, job.sequence.stats)

    def stop(self) -> None:
        self.drain(time.time())
        self.workers.shutdown(wait=True, cancel_futures=False)

    @property
    def idle(self) -> bool:
        """No request running or queued (a drain is over once it is)."""
        return not self.active and not self.waiting

    @property
    def free_kv_slots(self) -> int:
        return self.kv_capacity - sum(job.reserved for job in self.active)

    # ---- one request --------------------------------------------------------------------------------------------
    def _run(self, job: Job) -> None:
        with self.lock:
            if job not in self.waiting:
                return  # ended by a drain while it waited
            self.waiting.remove(job)
            self.active.append(job)
        self._changed()
        sequence = job.sequence
        try:
            if not self._interrupted(job):  # cancelled while it waited: no engine call at all
                self._emit(job, self._target(job, 1))  # prefill: the first token
            while sequence.finish_reason is None:
                if self._interrupted(job):
                    break
                if self.engine_steps is not None:
                    self._engine_steps(job)  # the engine speculates itself, every step: the policy has nothing to turn
                elif (gamma := self._gamma(job)) == 0:
                    self._plain(job)
                else:
                    self._speculate(job, gamma)
        except Exception as exc:  # an engine error ends this request only
            if sequence.finish_reason is None:
                sequence.end(Finish.ERROR, str(exc))
            else:  # finished, then failed sending: its outcome stands
                traceback.print_exc()
        self._finish(job)

    def _interrupted(self, job: Job) -> bool:
        sequence = job.sequence
        if job.cancelled:
            sequence.end(Finish.CANCELLED)
        elif self.drain_deadline is not None and time.time() >= self.drain_deadline:
            sequence.end(Finish.SHUTDOWN, "the server stopped before the request finished")
        return sequence.finish_reason is not None

    def _gamma(self, job: Job) -> int:
        """This step's proposal length (`step_gamma`), the batch being the requests running now."""
        sequence = job.sequence
        with self.lock:
            running = len(self.active)
        return step_gamma(sequence.proposal, self.policy, running, sequence.remaining,
                          self.pipeline.limits.max_sequence_length - len(sequence.committed))

    def _target(self, job: Job, count: int, draft_ids: list[int] | None = None,
                draft_logits: np.ndarray | None = None) -> list[int]:
        """One target call's tokens, all of them (prefill or verification)."""
        tokens: list[int] = []
        for new in self.calls.target(list(job.sequence.committed), count, job.sampling(),
                                     draft_ids, draft_logits):
            tokens.extend(new)
        if not tokens:
            raise RuntimeError("the target engine returned no tokens")
        return tokens

    def _stream(self, job: Job, count: int, record: Callable[[list[int]], None]) -> None:
        """A streamed target call of up to `count` tokens: each response's tokens committed, recorded as what was kept
        of them (an end token, a stop sequence or max_tokens may cut it) and sent. A stream that ends short of
        `count` ended at a limit of the engine's, and so does the request."""
        sequence = job.sequence
        started, received, ended = time.perf_counter(), 0, False
        for new in self.calls.target(list(sequence.committed), count, job.sampling()):
            if ended or not new:
                continue  # read to its end: a BLS stream cannot be cancelled, and an abandoned one corrupts the stub
            received += len(new)
            kept = self._commit(job, new)
            record(kept)
            self._send(job, kept)
            ended = sequence.finish_reason is not None or self._interrupted(job)
        if not ended and received < count:
            sequence.end(Finish.STOP)
        sequence.stats.verify_seconds += time.perf_counter() - started

    def _plain(self, job: Job) -> None:
        """Plain decode, a chunk at a time (the policy is asked again after each, and a cancelled request waits for
        at most one chunk). Each token is one engine step."""
        sequence = job.sequence
        self._stream(job, min(sequence.remaining, STREAM_CHUNK),
                     lambda kept: [sequence.stats.record_step(0, 0) for _ in kept])

    def _engine_steps(self, job: Job) -> None:
        """Medusa or lookahead runs inside the target engine: streamed calls of a chunk each, each response one
        engine step (the accepted drafts plus one token; drafted per step: the most a step verifies)."""
        sequence, steps = job.sequence, self.engine_steps
        self._stream(job, min(sequence.remaining, steps.chunk),
                     lambda kept: sequence.stats.record_step(steps.nodes, len(kept) - 1, positions=steps.depth)
                     if kept else None)

    def _speculate(self, job: Job, gamma: int) -> None:
        sequence = job.sequence
        params, context = sequence.params, list(sequence.committed)
        started = time.perf_counter()
        logits = None  # greedy: the target's top-k 1 token matching is exact, and needs no q
        if self.ngram is not None:
            drafts = prompt_lookup(context, gamma, self.ngram.min_n, self.ngram.max_n)
            if drafts and not params.greedy:
                logits = trtllm_sampling.point_mass_logits(drafts, self.logits_width)
        else:
            drafts, raw = self.calls.draft(context, gamma, job.sampling(), not params.greedy)
            sequence.stats.draft_forwards += len(drafts)
            if drafts and not params.greedy:
                if raw is None or raw.shape[0] < len(drafts):  # token matching would bias the output
                    raise RuntimeError("the draft engine returned no generation logits for its sampled drafts")
                logits = trtllm_sampling.draft_logits(raw, context, drafts, params, self.vocab_size,
                                                      self.logits_width)
                drafts = drafts[:logits.shape[0]]  # up to the first position a tie decides
        drafted_at = time.perf_counter()
        sequence.stats.draft_seconds += drafted_at - started
        if not drafts:
            tokens = self._target(job, 1)
            sequence.stats.record_step(0, 0)
        else:
            tokens = self._target(job, len(drafts) + 1, drafts, logits)
            accepted = min(common_prefix_length(drafts, tokens), len(tokens) - 1)
            sequence.stats.record_step(len(drafts), accepted)
            for _ in tokens[accepted + 1:]:  # an engine that decoded on past the verification step (1.2 does not)
                sequence.stats.record_step(0, 0)
            sequence.proposal.update(len(drafts), accepted)
        sequence.stats.verify_seconds += time.perf_counter() - drafted_at
        self._emit(job, tokens)

    def _emit(self, job: Job, tokens: list[int]) -> None:
        self._send(job, self._commit(job, tokens))

    @staticmethod
    def _commit(job: Job, tokens: list[int]) -> list[int]:
        """Commit tokens up to an end token, a stop sequence or max_tokens; returns those kept."""
        kept = job.sequence.append(tokens)
        job.sequence.stats.generated_tokens = job.sequence.generated
        return kept

    @staticmethod
    def _send(job: Job, tokens: list[int]) -> None:
        """Send committed tokens, unless the request is finished: _finish sends those with the final callback."""
        if job.sequence.finish_reason is None:
            job.on_tokens(tokens, None, job.sequence.stats)
        else:
            job.pending = tokens

    def _finish(self, job: Job) -> None:
        stats = job.sequence.stats
        stats.total_seconds = time.perf_counter() - job.submitted
        with self.lock:
            self.active.remove(job)
            self.counters.add(stats, job.sequence.finish_reason, job.kind)
        try:
            job.on_tokens(job.pending, job.sequence.finish_reason, stats)  # the client's answer comes first
        finally:
            self._changed()

    def _changed(self) -> None:
        """Tell the metrics; a failure there is logged, never allowed to strand a request."""
        if self.on_change is None:
            return
        try:
            self.on_change(self)
        except Exception:
            traceback.print_exc()

    def snapshot(self) -> tuple[ServingCounters, int, int, int]:
        """(a copy of the counters, running requests, free KV slots, queued requests), read together under the
        lock."""
        with self.lock:
            return copy.deepcopy(self.counters), len(self.active), self.free_kv_slots, len(self.waiting)
