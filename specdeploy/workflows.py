"""The CLI's verbs as library functions. Each one builds what it needs, runs, and returns a report (a dict) for
the CLI to print; generated text arrives through an `on_text` callback, so a caller can stream it.

Request fields a user leaves unset (None) take the pipeline's values: in-process the engine's pipeline, over gRPC
the served pipeline (the field is simply not sent).
"""

from __future__ import annotations

import dataclasses
import json
import platform
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import NamedTuple

from specdeploy.build.torch_engine import BuildResult, build
from specdeploy.decoding.detokenizer import IncrementalDetokenizer
from specdeploy.errors import SpecdeployError
from specdeploy.runtime.compile_engine import compile_engine, is_compiled
from specdeploy.runtime.engine import Engine
from specdeploy.spec.engine_paths import MODEL_REPOSITORIES_DIR, build_lock, measured_gamma_cap
from specdeploy.spec.pipeline import Device, PipelineSpec, load_pipeline
from specdeploy.spec.request import GenerationRequest

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
    """Build the pipeline's torch engine if it is missing or stale, then finish what the pipeline asks of a build
    unless an earlier build did: for backend.torch.compile, compile its steps into the engine's cache; for
    serving.policy.gamma_cap: measured, measure the cap on this machine (a fresh build never serves uncapped)."""
    result = build(pipeline, engines_dir, force=force, quiet=quiet)
    if pipeline.backend.compiles and (result.built or not is_compiled(result.directory)):
        compile_engine(pipeline, result.directory, quiet)
    if pipeline.serving.policy.gamma_cap == "measured" and measured_gamma_cap(result.directory) is None:
        from specdeploy.bench.gamma_cap import measure_gamma_cap

        if not quiet:
            print("measuring the gamma cap (serving.policy.gamma_cap: measured) on calibration prompts")
        message = measure_gamma_cap(result.directory, quiet)
        if not quiet:
            print(message)
    return result


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
    from specdeploy.build.trtllm import engine_build as trtllm
    from specdeploy.package.package_stamp import is_current, package_stamp, write_stamp
    from specdeploy.package.repository import write_repository

    pipeline = load_spec(pipeline_path, device)
    builder = trtllm.build if pipeline.backend.kind == "trtllm" else build_torch_engine
    engine_dir = builder(pipeline, engines_dir).directory
    output = Path(output or MODEL_REPOSITORIES_DIR / pipeline.name)
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


def generate_in_process(engine: Engine, prompt: str, options: RequestOptions, compare: bool,
                        on_text: TextCallback) -> dict:
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
    stats = generation.stats
    report = {"text": detokenizer.text, "tokens": generation.tokens, "method": engine.method,
              "num_draft_tokens": request.gamma(engine.pipeline), **stats.to_dict()}
    if compare:
        plain = engine.start(dataclasses.replace(request, num_draft_tokens=0))
        plain.run()
        report.update(plain_tokens_per_s=plain.stats.decode_tokens_per_s,
                      speedup=stats.decode_tokens_per_s / plain.stats.decode_tokens_per_s)
    return report


def generate_over_grpc(url: str, prompt: str, options: RequestOptions, stream: bool, compare: bool,
                       on_text: TextCallback) -> dict:
    """One request through a running server's ensemble; with compare, the same request with num_draft_tokens 0
    afterwards. Speeds are end to end, as the client sees them."""
    from specdeploy.serve.client import generate

    def run(fields: dict, show: TextCallback | None) -> tuple[str, dict, float]:
        started, text, statistics = time.perf_counter(), "", {}
        max_tokens = fields.pop("max_tokens")
        for chunk in generate(url, prompt, max_tokens, stream=stream, **fields):
            text += chunk.text
            statistics = chunk.statistics or statistics
            if show is not None and chunk.text:
                show(chunk.text)
        return text, statistics, time.perf_counter() - started

    text, statistics, seconds = run(options.grpc_fields(), on_text)
    steps = statistics.get("verification_steps", 0)
    report = {"text": text, **statistics, "seconds": seconds,
              "tokens_per_s": statistics.get("generated_tokens", 0) / seconds,
              "mean_accepted_length": (statistics.get("generated_tokens", 1) - 1) / steps if steps else 0.0}
    if compare:
        _, plain, plain_seconds = run({**options.grpc_fields(), "num_draft_tokens": 0}, None)
        report["plain_tokens_per_s"] = plain.get("generated_tokens", 0) / plain_seconds
        report["speedup"] = report["tokens_per_s"] / report["plain_tokens_per_s"]
    return report


def train_medusa(pipeline_path: str | Path, engines_dir: Path, output: Path, work_dir: Path, prompts: int = 1000,
                 max_tokens: int = 128, epochs: int = 4, console=None) -> dict:
    """Self-distil the pipeline's Medusa heads (speculation.medusa: num_heads, num_layers) on its frozen target and
    write them to `output`, with a report of each head's held-out accuracy beside it (<output>.json)."""
    from rich.console import Console

    from specdeploy.bench.prompts import load_prompts
    from specdeploy.models.registry import load_projection
    from specdeploy.spec.pipeline import SpeculationSpec
    from specdeploy.speculative.medusa import MedusaHeads
    from specdeploy.speculative.medusa_accuracy import accuracies
    from specdeploy.training import medusa as training
    from specdeploy.training.prompts import training_prompts

    console = console or Console()
    started = time.perf_counter()
    pipeline = load_pipeline(pipeline_path)
    spec = pipeline.speculation.medusa
    # The target alone, under its own name: the heads do not exist yet, so the Medusa engine cannot be built.
    target_only = dataclasses.replace(pipeline, name=f"{pipeline.name}-target", speculation=SpeculationSpec())
    engine_dir = build(target_only, engines_dir).directory
    work_dir.mkdir(parents=True, exist_ok=True)
    train_prompts, held_out = training_prompts(prompts, exclude=[p["prompt"] for p in load_prompts()])
    answers = training.generate_answers(engine_dir, train_prompts + held_out, max_tokens,
                                        work_dir / "answers.jsonl", pipeline.limits.max_batch_size, console)
    generated = time.perf_counter()
    engine = Engine(engine_dir, method="none")
    train_data = training.features(engine, {p: answers[p] for p in train_prompts}, spec.num_heads, console)
    held_data = training.features(engine, {p: answers[p] for p in held_out}, spec.num_heads, console)
    lm_head = load_projection(engine_dir / "target")
    heads = MedusaHeads(train_data.hidden.shape[1], spec.num_heads, spec.num_layers)
    heads = training.train(heads, train_data, lm_head, epochs, work_dir, console=console)
    report = accuracies(heads, held_data, lm_head)
    training.print_accuracies(report, console)
    output.parent.mkdir(parents=True, exist_ok=True)
    heads.save(output)
    summary = {"heads": str(output), "num_heads": spec.num_heads, "num_layers": spec.num_layers,
               "prompts": {"train": len(train_prompts), "held_out": len(held_out)},
               "positions": {"train": len(train_data.hidden), "held_out": len(held_data.hidden)},
               "max_tokens": max_tokens, "epochs": epochs, "held_out_accuracy": report,
               # the written prompts quote the standard library, which changes between Python versions
               "python": platform.python_version(),
               "seconds": {"answers": round(generated - started), "total": round(time.perf_counter() - started)}}
    output.with_suffix(".json").write_text(json.dumps(summary, indent=2) + "\n")
    return summary
