"""A built engine directory loaded for generation: prefill, then speculative (or plain) decode steps.

Everything the engine is run with comes from the pipeline saved in the engine directory; the proposer is the one
the pipeline's speculation method registers (speculative/registry.py). One decode step feeds the pending token
plus the drafted tokens to the target in a single forward, applies the exact acceptance rule and commits
accepted + 1 tokens (batch.py); a plain decode step is the same step with nothing drafted.
"""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path

import torch

from specdeploy.decoding import chat_template, detokenizer
from specdeploy.decoding.draft_length import ProposalLength
from specdeploy.decoding.sequence import Sequence
from specdeploy.decoding.stats import RequestStats
from specdeploy.errors import SpecdeployError
from specdeploy.models.batch_invariant import make_batch_invariant
from specdeploy.models.cpu_threads import apply_once
from specdeploy.models.registry import load_component
from specdeploy.runtime.batch import BatchDecoder
from specdeploy.runtime.step_programs import usable_programs, use_program
from specdeploy.spec.engine_paths import engine_pipeline
from specdeploy.spec.manifest import check_outputs
from specdeploy.spec.pipeline import Determinism, PipelineSpec
from specdeploy.spec.request import GenerationRequest, check_request
from specdeploy.spec.sampling_params import SamplingParams
from specdeploy.spec.speculation import METHODS, Method, SpeculationSpec
from specdeploy.speculative.proposer import EngineParts
from specdeploy.speculative.registry import create_proposer


@dataclass
class Generation:
    """Iterate to receive the tokens committed by each step; `stats` and `tokens` fill in as it runs."""

    steps: Iterator[list[int]]
    stats: RequestStats
    tokens: list[int] = field(default_factory=list)

    def __iter__(self) -> Iterator[list[int]]:
        for emitted in self.steps:
            self.tokens.extend(emitted)
            yield emitted

    def run(self) -> list[int]:
        for _ in self:
            pass
        return self.tokens


def components(speculation: SpeculationSpec) -> list[str]:
    """The engine's folders a method reads: the target's, a draft model's, and its trained parts'."""
    return ["target", *(["draft"] if speculation.draft is not None else []),
            *(source.part.folder for source in speculation.trained_sources)]


def with_method(pipeline: PipelineSpec, method: Method) -> PipelineSpec:
    """The pipeline run with another speculation method (with exact acceptance); a draft engine is only needed by
    a method that uses a draft model, heads only by one that uses heads."""
    speculation = pipeline.speculation
    if method not in METHODS:
        raise SpecdeployError(f"speculation method {method!r} is not supported (allowed: {', '.join(METHODS)})")
    uses_draft_model = METHODS[method].draft_model  # asked of the method asked for, before its spec exists
    if uses_draft_model and speculation.draft is None:
        raise SpecdeployError(f"method {method!r} needs a draft engine, and none was built")
    draft = speculation.draft if uses_draft_model else None
    acceptance = speculation.acceptance if method == speculation.method else "exact"
    return dataclasses.replace(pipeline, speculation=dataclasses.replace(speculation, method=method, draft=draft,
                                                                         acceptance=acceptance))


def with_sequence_length(pipeline: PipelineSpec, length: int | None) -> PipelineSpec:
    """The pipeline with limits that admit sequences of `length` tokens (prompts up to one less), when its own are
    shorter."""
    limits = pipeline.limits
    if length is None or length <= limits.max_sequence_length:
        return pipeline
    return dataclasses.replace(pipeline, limits=dataclasses.replace(limits, max_sequence_length=length,
                                                                    max_input_length=length - 1))


def with_determinism(pipeline: PipelineSpec, determinism: Determinism | None) -> PipelineSpec:
    """The pipeline served with `determinism` (None: its own), checked as the pipeline file would be."""
    if determinism is None or determinism == pipeline.serving.determinism:
        return pipeline
    changed = dataclasses.replace(pipeline, serving=dataclasses.replace(pipeline.serving, determinism=determinism))
    changed.check()
    return changed


def check_device(device: str) -> None:
    """SpecdeployError when torch cannot run on `device` here."""
    if torch.device(device).type == "cuda" and not torch.cuda.is_available():
        raise SpecdeployError(f"device {device!r} (backend.torch.device or --device) needs an NVIDIA GPU, and torch "
                              f"sees none (torch {torch.__version__}, CUDA build: {torch.version.cuda or 'no'}); "
                              f"use device cpu")


class Engine:
    def __init__(self, engine_dir: str | Path, device: str | None = None, method: Method | None = None,
                 batch_size: int = 1, max_sequence_length: int | None = None,
                 determinism: Determinism | None = None, exit_layer: int | None = None) -> None:
        """device: "cpu", "cuda" or "cuda:N" (None: the pipeline's backend.torch.device). method: run with another
        speculation method than the one built ("ngram" and "none" need no draft). batch_size: cache rows, i.e. how
        many sequences `decoder` can step together (a server uses limits.max_batch_size; one in-process generation
        needs one). max_sequence_length: room for longer sequences than the pipeline's limits (bench --context);
        the weights do not depend on it, only the cache's size and what requests may ask. determinism: instead of
        the pipeline's serving.determinism (bench compares both). exit_layer: an early-exit engine's draft layers
        instead of its own (the build's sweep, tune/exit_layer.py)."""
        from transformers import AutoTokenizer

        self.dir = Path(engine_dir)
        pipeline = engine_pipeline(self.dir)
        if exit_layer is not None:
            pipeline = pipeline.with_exit_layer(exit_layer)
        self.pipeline = with_determinism(with_sequence_length(
            pipeline if method is None else with_method(pipeline, method), max_sequence_length), determinism)
        check_outputs(self.dir, components(self.speculation))
        self.device = device or self.pipeline.backend.device
        check_device(self.device)
        # torch's intra-op threads from the CPU time this process may use (models/cpu_threads.py), set by the
        # process's first engine, on the thread that runs its steps (a served model's scheduler thread)
        self.cpu_threads = apply_once()
        if torch.device(self.device).type == "cuda":
            # the thread that loads the engine runs its steps (a Triton instance's scheduler thread): its current
            # GPU must be the engine's, or streams, events and contexts land on GPU 0
            chosen = torch.device(self.device)
            if chosen.index is not None:  # plain "cuda" is the current GPU already (torch 2.11 refuses it here)
                torch.cuda.set_device(chosen)
        # compiled step programs (runtime/step_programs.py): the component → program to load, and why the others
        # run eagerly; a model a program runs keeps its weights unpacked (the program reads them)
        programs, self.eager_steps = usable_programs(self.pipeline, self.dir)
        unpacked = set(programs)
        self.target = load_component(self.dir / "target", self.device, prepack="target" not in unpacked,
                                     row_invariant=self.batch_invariant)
        self.tokenizer = AutoTokenizer.from_pretrained(self.dir / "target")
        limits = self.pipeline.limits
        # Headroom past the limit: ragged batches pad short rows by up to max_draft_tokens + 1 positions.
        self.cache = self.target.new_cache(batch_size, limits.max_sequence_length + limits.max_draft_tokens + 1)
        self.proposer = create_proposer(self.method, EngineParts(self.dir, self.pipeline, self.target, self.cache,
                                                                 self.device, frozenset(unpacked)))
        # component → seconds its program took to load (the rest: eager_steps says why)
        self.program_load_seconds = self._load_programs(programs)
        self.end_ids = chat_template.end_of_sequence_ids(self.tokenizer, self.target.config.eos_token_ids)
        # layers computed in blocks of fewer rows (name → rows) because this machine's kernels change a row with
        # its company above that many
        self.row_blocks = self._make_batch_invariant(batch_size) if self.batch_invariant else {}
        self.decoder = BatchDecoder(self.target, self.cache, self.proposer, limits.max_sequence_length,
                                    self.pipeline.speculation.acceptance)

    def _load_programs(self, programs: dict[str, Path]) -> dict[str, float]:
        stepped = self.proposer.stepped_models()  # a draft model, or none
        models = {"target": self.target} | ({"draft": stepped[0][0]} if stepped else {})
        captures = {"target": self.proposer.capture}  # what the target's program returns beside its states
        return {component: use_program(models[component], path, captures.get(component, ()))
                for component, path in programs.items() if component in models}

    @property
    def step_programs(self) -> dict[str, str]:
        """Each stepped model's step: "compiled" or "eager: <why>" (reports and logs say which ran)."""
        return {**{component: "compiled" for component in self.program_load_seconds},
                **{component: f"eager: {why}" for component, why in self.eager_steps.items()}}

    @property
    def batch_invariant(self) -> bool:
        return self.pipeline.serving.determinism == "batch_invariant"

    def _make_batch_invariant(self, batch_size: int) -> dict[str, int]:
        """Every model a step runs (the target, a draft model) computes each row as it would alone."""
        max_rows = batch_size * (self.pipeline.limits.max_draft_tokens + 1)
        models = [("target", self.target), *(("draft", model) for model, _ in self.proposer.stepped_models())]
        return {f"{label}.{name}": rows for label, model in models
                for name, rows in make_batch_invariant(model, max_rows).items()}

    @property
    def method(self) -> Method:
        """The method's name, for reports, metrics and logs; what it does is asked of `speculation`'s predicates."""
        return self.pipeline.speculation.method

    @property
    def speculation(self) -> SpeculationSpec:
        return self.pipeline.speculation

    @property
    def num_draft_tokens(self) -> int:
        return self.pipeline.speculation.num_draft_tokens

    @property
    def vocab_size(self) -> int:
        return self.target.config.vocab_size

    @property
    def dtype(self) -> str:
        return self.pipeline.target.dtype

    @property
    def max_length(self) -> int:
        return self.pipeline.limits.max_sequence_length

    def encode_prompt(self, prompt: str) -> list[int]:
        return chat_template.encode_prompt(self.tokenizer, prompt)

    def decode(self, tokens: list[int]) -> str:
        return detokenizer.decode(self.tokenizer, tokens)

    def check(self, request: GenerationRequest, kv_capacity: int | None = None) -> None:
        """RequestError when the request cannot be served (kv_capacity: the budget, default the pipeline's)."""
        check_request(request, self.pipeline, self.vocab_size,
                      self.pipeline.kv_capacity_tokens if kv_capacity is None else kv_capacity)

    def new_sequence(self, request: GenerationRequest, kv_capacity: int | None = None) -> Sequence:
        """A checked request, ready for `decoder.prefill`."""
        self.check(request, kv_capacity)
        return self.decoder.new_sequence(request, ProposalLength.for_request(request, self.pipeline), self.end_ids,
                                         self.tokenizer)

    def start(self, request: GenerationRequest) -> Generation:
        """Start generating one request alone (cache row 0)."""
        sequence = self.new_sequence(request)
        return Generation(self._steps(sequence), sequence.stats)

    def generate(self, prompt_ids: list[int], params: SamplingParams, max_tokens: int,
                 num_draft_tokens: int | None = None) -> Generation:
        """`start` for a request of these fields (num_draft_tokens None: the pipeline's gamma; 0: plain)."""
        return self.start(GenerationRequest(prompt_ids, max_tokens, params, num_draft_tokens))

    def _steps(self, sequence: Sequence) -> Iterator[list[int]]:
        started = time.perf_counter()
        forwards_before = self.proposer.forwards
        yield self.decoder.prefill(sequence, 0)
        while sequence.finish_reason is None:
            yield self.decoder.step([sequence])[0]
        sequence.stats.draft_forwards = self.proposer.forwards - forwards_before
        sequence.stats.total_seconds = time.perf_counter() - started
