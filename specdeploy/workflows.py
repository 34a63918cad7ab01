"""The CLI's verbs as library functions. Each one builds what it needs, runs, and returns what the CLI prints (a
result or a report); generated text arrives through an `on_text` callback, so a caller can stream it. The choices
a verb makes from the pipeline (which backend builds the engine) are made here, so the CLI only parses and prints.

Request fields a user leaves unset (None) take the pipeline's values: in-process the engine's pipeline, over gRPC
the served pipeline (the field is simply not sent).
"""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import NamedTuple

from specdeploy.build.torch_engine import BuildResult, build
from specdeploy.decoding.detokenizer import IncrementalDetokenizer
from specdeploy.decoding.stats import decode_tokens, mean_accepted_length
from specdeploy.errors import SpecdeployError
from specdeploy.runtime.engine import Engine
from specdeploy.spec.backend import Device
from specdeploy.spec.engine_paths import build_lock, check_engine, engine_path, model_repositories_dir
from specdeploy.spec.pipeline import PipelineSpec, load_pipeline
from specdeploy.spec.request import GenerationRequest
from specdeploy.tune.engine import tune_engine

TextCallback = Callable[[str], None]


@dataclass(frozen=True)
class RequestOptions:
    """A generation's fields as the user gave them; None: the pipeline's value."""

    max_tokens: int | None = None
    temperature: float | None = None
    top_k: int | None = None
    top_p: float | None = None
    repetition_penalty: float | None = None
    seed: int | None = None
    num_draft_tokens: int | None = None
    end_id: int | None = None
    kind: str | None = None  # request_kind: one of serving.request_kinds
    stop_strings: tuple[str, ...] | None = None  # the stop_words input: text that ends the output

    def request(self, engine: Engine, prompt_ids: list[int]) -> GenerationRequest:
        fields = dataclasses.asdict(self)
        fields["stop_strings"] = list(self.stop_strings or ())
        return GenerationRequest.with_defaults(engine.pipeline, prompt_ids, **fields)

    def grpc_fields(self) -> dict:
        """The ensemble's input names (tensorrtllm_backend's) for the fields that are set."""
        return {"max_tokens": self.max_tokens, "temperature": self.temperature, "top_k": self.top_k,
                "top_p": self.top_p, "repetition_penalty": self.repetition_penalty, "random_seed": self.seed,
                "num_draft_tokens": self.num_draft_tokens, "end_id": self.end_id, "request_kind": self.kind,
                "stop_words": None if self.stop_strings is None else list(self.stop_strings)}


def load_spec(pipeline_path: str | Path, device: Device | None = None) -> PipelineSpec:
    """The pipeline file, its torch backend run on `device` when one is given (the CLI's --device). The engine's
    saved pipeline records the device, so the engine, its repository and the server follow it without a rebuild."""
    pipeline = load_pipeline(pipeline_path)
    return pipeline if device is None else dataclasses.replace(pipeline, backend=pipeline.backend.with_device(device))


def build_torch_engine(pipeline: PipelineSpec, engines_dir: Path, force: bool = False,
                       quiet: bool = False) -> BuildResult:
    """Build the pipeline's torch engine if it is missing or stale, then measure on this machine what its pipeline
    asks to be measured and the engine does not hold yet (tune/engine.py: step programs, an exit layer, the gamma
    cap)."""
    result = build(pipeline, engines_dir, force=force, quiet=quiet)
    tune_engine(result.directory, quiet)
    return result


def retune_engine(pipeline: PipelineSpec, engines_dir: Path) -> list[str]:
    """Every measurement of the pipeline's built torch engine again (`specdeploy tune`): a build measured on a busy
    machine, or before the machine changed, is measured anew without rebuilding."""
    if pipeline.backend.kind != "torch":
        raise SpecdeployError(f"{pipeline.name}: specdeploy tune measures a torch engine on this machine; "
                              f"backend.kind is {pipeline.backend.kind}")
    return tune_engine(check_engine(engine_path(engines_dir, pipeline)), again=True)


def build_engine(pipeline: PipelineSpec, engines_dir: Path, force: bool = False, quiet: bool = False) -> BuildResult:
    """The pipeline's engine, built by its backend (TensorRT-LLM's conversions and engine builds for trtllm, this
    process for torch) if it is missing or stale (force: rebuilt anyway)."""
    if pipeline.backend.kind == "trtllm":
        from specdeploy.build.trtllm import engine_build as trtllm

        return trtllm.build(pipeline, engines_dir, force=force, quiet=quiet)
    return build_torch_engine(pipeline, engines_dir, force=force, quiet=quiet)


def build_plan(pipeline: PipelineSpec, engines_dir: Path) -> str | None:
    """Every step a trtllm build would run, with its arguments and paths (it needs no TensorRT-LLM); None for a
    torch build, which runs in-process and has no steps to show."""
    if pipeline.backend.kind != "trtllm":
        return None
    from specdeploy.build.trtllm import engine_build as trtllm

    return trtllm.format_plan(pipeline, *trtllm.plan(pipeline, engines_dir))


def prepare_engine(pipeline_path: str | Path, engines_dir: Path, quiet: bool = False,
                   device: Device | None = None) -> BuildResult:
    """Build the pipeline's engine if it is missing or stale."""
    return build_torch_engine(load_spec(pipeline_path, device), engines_dir, quiet=quiet)


def load_engine(pipeline_path: str | Path, engines_dir: Path, quiet: bool = False,
                device: Device | None = None, max_sequence_length: int | None = None) -> Engine:
    """The pipeline's engine, built if needed; max_sequence_length: room for longer sequences than its limits."""
    return Engine(prepare_engine(pipeline_path, engines_dir, quiet, device).directory,
                  max_sequence_length=max_sequence_length)


class PackageResult(NamedTuple):
    directory: Path
    written: bool  # False: the repository was already packaged from the same inputs


def package(pipeline_path: str | Path, engines_dir: Path, output: Path | None = None,
            served_at: Path | None = None, trtllm_source: Path | None = None, force: bool = False,
            device: Device | None = None) -> PackageResult:
    """Build the pipeline's engine if needed (TensorRT-LLM engines for a trtllm pipeline) and write its model
    repository (default model_repository/<name>), unless it was packaged from the same inputs already (force:
    write it anyway). served_at: where a trtllm repository will be mounted on the server, which its engine paths
    name (default: where it is written); trtllm_source: a TensorRT-LLM checkout (the llm_api line's model code)."""
    from specdeploy.package.package_stamp import is_current, package_stamp, write_stamp
    from specdeploy.package.repository import write_repository

    pipeline = load_spec(pipeline_path, device)
    engine_dir = build_engine(pipeline, engines_dir).directory
    output = Path(output or model_repositories_dir() / pipeline.name)
    stamp = package_stamp(pipeline_path, engine_dir, served_at or output.resolve(), trtllm_source)
    with build_lock(output):  # checked under the lock: a package run that held it before us may have just written it
        if not force and is_current(output, stamp):
            return PackageResult(output, False)
        write_repository(engine_dir, output, served_at, trtllm_source)
        write_stamp(output, stamp)
    return PackageResult(output, True)


def export_component(pipeline_path: str | Path, engines_dir: Path, component: str, output: Path,
                     dtype: str = "bfloat16") -> Path:
    """Build the pipeline's engine if needed and write one component (target or draft) as a Hugging Face checkpoint
    directory at `output` (an MoE target as a per-expert Mixtral)."""
    from specdeploy.build.hf_export import export_hf
    from specdeploy.models.registry import DTYPES

    engine_dir = prepare_engine(pipeline_path, engines_dir).directory
    source = engine_dir / component
    if not source.is_dir():
        raise SpecdeployError(f"{engine_dir}: has no {component} component (it has "
                              f"{', '.join(sorted(p.name for p in engine_dir.iterdir() if p.is_dir()))})")
    output = Path(output)
    if output.exists() and any(output.iterdir()) and not (output / "config.json").is_file():
        raise SpecdeployError(f"{output}: exists and is not a Hugging Face checkpoint (choose another --output)")
    return export_hf(source, output, DTYPES[dtype])


@dataclass(frozen=True)
class GenerationReport:
    """One generation's text and statistics, the same type from either path, so the CLI prints one thing.

    The counts mean the same on both paths; the rate does not. In-process it is the decode phase's (the prefill,
    which speculation never touches, left out); over gRPC it is the whole request as the client saw it, `seconds`
    long. `details` is what --json writes beside the text, under the names each path has always used: every
    RequestStats field with the method and gamma in-process, the response's statistics over gRPC."""

    text: str
    label: str  # what ran it: "<method>, gamma <n>" in-process, the server's HOST:PORT over gRPC
    generated_tokens: int
    acceptance_rate: float  # as the engine or the server computed it
    mean_accepted_length: float  # decoding/stats.py's, from the generated tokens and the target steps
    tokens_per_s: float
    details: dict
    seconds: float | None = None  # over gRPC: the request end to end
    plain_tokens_per_s: float | None = None  # the same request in plain decode (compare)

    @property
    def speedup(self) -> float | None:
        return None if self.plain_tokens_per_s is None else self.tokens_per_s / self.plain_tokens_per_s

    def to_json(self) -> dict:
        compared = {} if self.plain_tokens_per_s is None else {"plain_tokens_per_s": self.plain_tokens_per_s,
                                                               "speedup": self.speedup}
        return {"text": self.text, **self.details, **compared}


def generate_in_process(engine: Engine, prompt: str, options: RequestOptions, compare: bool,
                        on_text: TextCallback) -> GenerationReport:
    """One request through the engine, streamed to on_text; with compare, the same request in plain decode
    afterwards (both paths warmed up first, so neither pays first-call costs)."""
    prompt_ids = engine.encode_prompt(prompt)
    request = options.request(engine, prompt_ids)
    engine.check(request)
    if compare:
        for gamma in (0, request.num_draft_tokens):
            engine.start(dataclasses.replace(request, max_tokens=min(4, request.max_tokens),
                                             num_draft_tokens=gamma)).run()
    generation = engine.start(request)
    detokenizer = IncrementalDetokenizer(engine.tokenizer, request.stop_strings)
    for emitted in generation:
        on_text(detokenizer.add(emitted))
    on_text(detokenizer.flush())
    stats, gamma = generation.stats, request.gamma(engine.pipeline)
    plain_rate = None
    if compare:
        plain = engine.start(dataclasses.replace(request, num_draft_tokens=0))
        plain.run()
        plain_rate = plain.stats.decode_tokens_per_s
    details = {"tokens": generation.tokens, "method": engine.method, "num_draft_tokens": gamma, **stats.to_dict()}
    return GenerationReport(detokenizer.text, f"{engine.method}, gamma {gamma}", stats.generated_tokens,
                            stats.acceptance_rate, stats.mean_accepted_length, stats.decode_tokens_per_s, details,
                            plain_tokens_per_s=plain_rate)


def generate_over_grpc(url: str, prompt: str, options: RequestOptions, stream: bool, compare: bool,
                       on_text: TextCallback) -> GenerationReport:
    """One request through a running server's ensemble; with compare, the same request with num_draft_tokens 0
    afterwards. Speeds are end to end, as the client sees them."""
    from specdeploy.serve.client import generate
    from specdeploy.serve.requests import STATISTICS

    def run(fields: dict, show: TextCallback | None) -> tuple[str, dict, float]:
        started, text, statistics = time.perf_counter(), "", {}
        max_tokens = fields.pop("max_tokens")
        for chunk in generate(url, prompt, max_tokens, stream=stream, **fields):
            text += chunk.text
            statistics = chunk.statistics or statistics
            if show is not None and chunk.text:
                show(chunk.text)
        return text, statistics, time.perf_counter() - started

    def counted(statistics: dict) -> dict:
        """Every statistic, 0 where the server sent none (a request answered with no output at all)."""
        return {**{name: 0 for name, *_ in STATISTICS}, **statistics}

    text, statistics, seconds = run(options.grpc_fields(), on_text)
    counts = counted(statistics)
    generated, rate = counts["generated_tokens"], counts["generated_tokens"] / seconds
    mean_length = mean_accepted_length(decode_tokens(generated), counts["verification_steps"])
    plain_rate = None
    if compare:
        _, plain, plain_seconds = run({**options.grpc_fields(), "num_draft_tokens": 0}, None)
        plain_rate = counted(plain)["generated_tokens"] / plain_seconds
    details = {**statistics, "seconds": seconds, "tokens_per_s": rate, "mean_accepted_length": mean_length}
    return GenerationReport(text, url, generated, counts["acceptance_rate"], mean_length, rate, details,
                            seconds=seconds, plain_tokens_per_s=plain_rate)


def openai_curl(base_url: str, model: str, prompt: str, max_tokens: int) -> tuple[str, str]:
    """A curl command for one chat completion from the OpenAI endpoint at `base_url`, and what it answered (the
    reply's text and usage, as curl would print them, in one line)."""
    import json
    import shlex
    import urllib.request

    body = json.dumps({"model": model, "messages": [{"role": "user", "content": prompt}], "max_tokens": max_tokens})
    command = (f"curl -s {base_url}/chat/completions -H 'Content-Type: application/json' -d "
               f"{shlex.quote(body)}")
    request = urllib.request.Request(f"{base_url}/chat/completions", body.encode(), method="POST",
                                     headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(request, timeout=300) as response:
        reply = json.loads(response.read())
    return command, json.dumps({"content": reply["choices"][0]["message"]["content"], "usage": reply["usage"]})
