"""The CLI's verbs as library functions. Each one builds what it needs, runs, and returns what the CLI prints (a
result or a report); generated text arrives through an `on_text` callback, so a caller can stream it. The choices
a verb makes from the pipeline (which backend builds the engine) are made here, so the CLI only parses and prints.

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
from specdeploy.decoding.stats import decode_tokens, mean_accepted_length
from specdeploy.errors import SpecdeployError
from specdeploy.runtime.compile_engine import compile_engine, is_compiled
from specdeploy.runtime.engine import Engine
from specdeploy.runtime.step_programs import build_step_programs, not_built_reason, steps_mode
from specdeploy.runtime.step_programs import read_record as read_step_record
from specdeploy.spec.backend import Device
from specdeploy.spec.engine_paths import (
    MEASURED_POLICY_FILE,
    build_lock,
    measured_exit_layer,
    measured_gamma_cap,
    model_repositories_dir,
)
from specdeploy.spec.pipeline import PipelineSpec, load_pipeline
from specdeploy.spec.request import GenerationRequest
from specdeploy.spec.speculation import EXIT_ADAPTER
from specdeploy.training.eagle_options import EagleTrainingOptions
from specdeploy.training.exit_adapter_options import ExitAdapterTrainingOptions
from specdeploy.training.medusa_options import MedusaTrainingOptions

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
    backend.torch.steps (measured by default), compile each stepped model's program and keep it where it pays; for
    serving.policy.gamma_cap: measured, measure the cap on this machine (a fresh build never serves uncapped); for
    speculation.early_exit.exit_layer: measured, the exit layer (bench/exit_layer.py), before the cap."""
    result = build(pipeline, engines_dir, force=force, quiet=quiet)
    if pipeline.backend.compiles and (result.built or not is_compiled(result.directory)):
        compile_engine(pipeline, result.directory, quiet)
    record = read_step_record(result.directory)
    if not_built_reason(pipeline) is None and (result.built or record is None
                                                or record["steps"] != steps_mode(pipeline)):
        build_step_programs(pipeline, result.directory, quiet)
        # the steps' costs changed, and with them the best gamma: measured again below
        (result.directory / MEASURED_POLICY_FILE).unlink(missing_ok=True)
    if (getattr(pipeline.speculation.settings, "exit_layer", None) == "measured"
            and measured_exit_layer(result.directory) is None):
        from specdeploy.bench.exit_layer import measure_exit_layer

        if not quiet:
            print("measuring the early exit's layer (speculation.early_exit.exit_layer: measured) on calibration "
                  "prompts")
        message = measure_exit_layer(result.directory, quiet)
        if not quiet:
            print(message)
    if pipeline.serving.policy.gamma_cap == "measured" and measured_gamma_cap(result.directory) is None:
        from specdeploy.bench.gamma_cap import measure_gamma_cap

        if not quiet:
            print("measuring the gamma cap (serving.policy.gamma_cap: measured) on calibration prompts")
        message = measure_gamma_cap(result.directory, quiet)
        if not quiet:
            print(message)
    return result


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


class Distillation(NamedTuple):
    """What the train-* commands start from: the target's own engine, the prompts split into training and held-out
    ones, and the target's greedy answer to each (prompt text → ids)."""

    pipeline: PipelineSpec
    engine_dir: Path
    train_prompts: list[str]
    held_out: list[str]
    answers: dict[str, list[int]]
    answers_seconds: float


def distillation_answers(pipeline_path: str | Path, engines_dir: Path, work_dir: Path, prompts: int,
                         max_tokens: int, console) -> Distillation:
    """Build the pipeline's target alone, under its own name (the heads do not exist yet, so the pipeline's own
    engine cannot be built), and have it answer the training prompts, cached in work_dir/answers.jsonl."""
    from specdeploy.bench.prompts import load_prompts
    from specdeploy.spec.speculation import SpeculationSpec
    from specdeploy.training.medusa import generate_answers
    from specdeploy.training.prompts import training_prompts

    started = time.perf_counter()
    pipeline = load_pipeline(pipeline_path)
    target_only = dataclasses.replace(pipeline, name=f"{pipeline.name}-target", speculation=SpeculationSpec())
    engine_dir = build(target_only, engines_dir).directory
    work_dir.mkdir(parents=True, exist_ok=True)
    train_prompts, held_out = training_prompts(prompts, exclude=[p["prompt"] for p in load_prompts()])
    answers = generate_answers(engine_dir, train_prompts + held_out, max_tokens, work_dir / "answers.jsonl",
                               pipeline.limits.max_batch_size, console)
    return Distillation(pipeline, engine_dir, train_prompts, held_out, answers, time.perf_counter() - started)


def run_facts(train_prompts: list[str], held_out: list[str], options, answers_seconds: float,
              started: float) -> dict:
    """What a train-eagle or train-exit-adapter report records of its run: the prompt split, the optimiser's
    settings, the Python version (the written prompts quote its standard library) and the seconds it took."""
    return {"prompts": {"train": len(train_prompts), "held_out": len(held_out)}, "max_tokens": options.max_tokens,
            "lr": options.lr, "batch_size": options.batch_size, "seed": options.seed,
            "python": platform.python_version(),
            "seconds": {"answers": round(answers_seconds), "total": round(time.perf_counter() - started)}}


def train_eagle(pipeline_path: str | Path, engines_dir: Path, output: Path,
                options: EagleTrainingOptions = EagleTrainingOptions(), console=None) -> dict:
    """Self-distil an EAGLE-3 head for the pipeline's target (training-time test over num_draft_tokens steps) and
    write it to the folder `output` (config.json, model.safetensors), with training.json (losses, held-out
    agreement by depth) and training.png beside them."""
    import torch
    from rich.console import Console

    from specdeploy.models.registry import load_projection
    from specdeploy.speculative.eagle_head import REPORT_FILE, Eagle3Head, EagleConfig, default_feature_layers
    from specdeploy.training import eagle as training
    from specdeploy.training.medusa import progress_bar

    console = console or Console()
    started = time.perf_counter()
    torch.manual_seed(options.seed)
    work_dir = options.work_dir
    pipeline, engine_dir, train_prompts, held_out, answers, answers_seconds = distillation_answers(
        pipeline_path, engines_dir, work_dir, options.prompts, options.max_tokens, console)
    steps = pipeline.speculation.num_draft_tokens
    engine = Engine(engine_dir, method="none")
    target, config = engine.target, engine.target.config
    layers = default_feature_layers(config.num_layers)

    def sequences(prompts: list[str]) -> list[tuple[list[int], int]]:
        return [(engine.encode_prompt(p) + answers[p], len(engine.encode_prompt(p)) - 1) for p in prompts]

    with progress_bar(console) as progress:
        task = progress.add_task("target features", total=len(train_prompts) + len(held_out))
        train_samples = training.collect(target, sequences(train_prompts), layers, lambda: progress.advance(task))
        held_samples = training.collect(target, sequences(held_out), layers, lambda: progress.advance(task))
    ids = training.draft_vocabulary(train_samples, options.draft_vocab, config.vocab_size)
    head_config = EagleConfig(hidden_size=config.hidden_size, intermediate_size=options.intermediate_size,
                              num_heads=config.num_heads, num_kv_heads=config.num_kv_heads, head_dim=config.head_dim,
                              vocab_size=config.vocab_size, draft_vocab_size=len(ids), feature_layers=layers,
                              rms_norm_eps=config.rms_norm_eps, rope_theta=config.rope_theta,
                              max_position_embeddings=config.max_position_embeddings,
                              target_num_layers=config.num_layers)
    head = Eagle3Head(head_config)
    head.set_draft_vocabulary(ids)
    embed = target.embed.detach().float()
    draft_rows = load_projection(engine_dir / "target")[ids]  # [Vd, H]: the target's head on the draft vocabulary
    with progress_bar(console) as progress:
        task = progress.add_task("training the head", total=None)

        def on_step(done: int, total: int, loss: float) -> None:
            progress.update(task, completed=done, total=total, description=f"training the head (loss {loss:.3f})")

        head, losses = training.train(head, train_samples, embed, draft_rows, steps, options.epochs, work_dir,
                                      options.batch_size, options.lr, options.seed, on_step)
    held = training.chain_acceptance(head, held_samples, embed, draft_rows, steps)
    head.save(output)
    covered = sum(int(torch.isin(s.tokens[s.first + 1:], ids).sum()) for s in held_samples)
    answered = sum(len(s.tokens) - s.first - 1 for s in held_samples)
    report = {"head": str(output), "feature_layers": list(layers), "draft_vocab": len(ids),
              "intermediate_size": options.intermediate_size, "ttt_steps": steps, "epochs": options.epochs,
              "epoch_losses": [round(x, 4) for x in losses], "held_out": held,
              "held_out_tokens_in_draft_vocab": round(covered / max(answered, 1), 4),
              **run_facts(train_prompts, held_out, options, answers_seconds, started)}
    (output / REPORT_FILE).write_text(json.dumps(report, indent=2) + "\n")
    training.write_plot(report, output / "training.png")
    return report


def train_medusa(pipeline_path: str | Path, engines_dir: Path, output: Path,
                 options: MedusaTrainingOptions = MedusaTrainingOptions(), console=None) -> dict:
    """Self-distil the pipeline's Medusa heads (speculation.medusa: num_heads, num_layers) on its frozen target and
    write them to `output`, with a report of each head's held-out accuracy beside it (<output>.json)."""
    from rich.console import Console

    from specdeploy.models.registry import load_projection
    from specdeploy.speculative.medusa import MedusaHeads
    from specdeploy.speculative.medusa_accuracy import accuracies
    from specdeploy.training import medusa as training

    console = console or Console()
    started = time.perf_counter()
    work_dir = options.work_dir
    pipeline, engine_dir, train_prompts, held_out, answers, answers_seconds = distillation_answers(
        pipeline_path, engines_dir, work_dir, options.prompts, options.max_tokens, console)
    spec = pipeline.speculation.medusa
    engine = Engine(engine_dir, method="none")
    train_data = training.features(engine, {p: answers[p] for p in train_prompts}, spec.num_heads, console)
    held_data = training.features(engine, {p: answers[p] for p in held_out}, spec.num_heads, console)
    lm_head = load_projection(engine_dir / "target")
    heads = MedusaHeads(train_data.hidden.shape[1], spec.num_heads, spec.num_layers)
    heads = training.train(heads, train_data, lm_head, options.epochs, work_dir, console=console)
    report = accuracies(heads, held_data, lm_head)
    training.print_accuracies(report, console)
    output.parent.mkdir(parents=True, exist_ok=True)
    heads.save(output)
    summary = {"heads": str(output), "num_heads": spec.num_heads, "num_layers": spec.num_layers,
               "prompts": {"train": len(train_prompts), "held_out": len(held_out)},
               "positions": {"train": len(train_data.hidden), "held_out": len(held_data.hidden)},
               "max_tokens": options.max_tokens, "epochs": options.epochs, "held_out_accuracy": report,
               # the written prompts quote the standard library, which changes between Python versions
               "python": platform.python_version(),
               "seconds": {"answers": round(answers_seconds), "total": round(time.perf_counter() - started)}}
    output.with_suffix(".json").write_text(json.dumps(summary, indent=2) + "\n")
    return summary


def exit_layers_to_train(pipeline: PipelineSpec, options: ExitAdapterTrainingOptions, num_layers: int) -> list[int]:
    """--layers, or the pipeline's early_exit sweep and its exit layer when that is a number, with --layer; an
    error naming the layers that are not below the target's."""
    spec = pipeline.speculation.early_exit
    layers = set(options.layers or (*spec.sweep, *([spec.exit_layer] if spec.exit_layer != "measured" else [])))
    layers |= {options.layer} if options.layer is not None else set()
    outside = sorted(layer for layer in layers if not 1 <= layer < num_layers)
    if outside:
        raise SpecdeployError(f"exit layers {outside} are not layer counts below the target's {num_layers} layers "
                              f"(--layers, --layer or speculation.early_exit.sweep)")
    return sorted(layers)


def train_exit_adapter(pipeline_path: str | Path, engines_dir: Path, output: Path,
                       options: ExitAdapterTrainingOptions = ExitAdapterTrainingOptions(), console=None) -> dict:
    """Self-distil an early exit's adapter at each candidate exit layer on the pipeline's frozen target, measure on
    held-out positions how often the early exit's top token is the target's without and with it, and write the
    chosen layer's adapter to the folder `output` (config.json, model.safetensors) with training.json and
    training.png beside them."""
    import torch
    from rich.console import Console

    from specdeploy.build.checkpoints import target_config
    from specdeploy.build.torch_engine import early_exit_vocabulary
    from specdeploy.models.registry import load_projection
    from specdeploy.speculative.exit_adapter import REPORT_FILE, ExitAdapter, ExitAdapterConfig, target_name
    from specdeploy.training import exit_adapter as training
    from specdeploy.training.medusa import progress_bar

    console = console or Console()
    started = time.perf_counter()
    pipeline = load_pipeline(pipeline_path)
    if EXIT_ADAPTER not in pipeline.speculation.traits.trained:
        raise SpecdeployError(f"{pipeline_path}: train-exit-adapter trains an early exit's adapter, and this "
                              f"pipeline's method is not early_exit")
    # checked before the answers, which take minutes
    layers = exit_layers_to_train(pipeline, options, target_config(pipeline).num_layers)
    pipeline, engine_dir, train_prompts, held_out, answers, answers_seconds = distillation_answers(
        pipeline_path, engines_dir, options.work_dir, options.prompts, options.max_tokens, console)
    engine = Engine(engine_dir, method="none")
    config = engine.target.config

    def sequences(prompts: list[str]) -> list[tuple[list[int], int]]:
        return [(engine.encode_prompt(p) + answers[p], len(engine.encode_prompt(p)) - 1) for p in prompts]

    with progress_bar(console) as progress:
        task = progress.add_task("target states", total=len(train_prompts) + len(held_out))
        train_data = training.collect(engine.target, sequences(train_prompts), layers, lambda: progress.advance(task))
        held_data = training.collect(engine.target, sequences(held_out), layers, lambda: progress.advance(task))
    ids, _ = early_exit_vocabulary(engine.tokenizer, pipeline.speculation.early_exit.draft_vocab, config.vocab_size)
    ids = torch.tensor(ids)
    head = training.ExitHead(engine.target.norm.weight.detach().float().cpu(), config.rms_norm_eps,
                             load_projection(engine_dir / "target")[ids], ids, config.vocab_size)
    labels = head.labels(train_data.next_tokens)
    gamma = pipeline.speculation.num_draft_tokens
    rows, adapters = [], {}
    for layer in layers:
        torch.manual_seed(options.seed)
        adapter = ExitAdapter(ExitAdapterConfig(config.hidden_size, options.inner_size, layer,
                                                target_name(pipeline.target.checkpoint), config.num_layers,
                                                config.rms_norm_eps))
        adapters[layer], losses = training.train_with_progress(adapter, train_data.states[layer], labels, head,
                                                               options, console)
        measured = {name: training.agreement(candidate, held_data.states[layer], held_data.next_tokens, head)
                    for name, candidate in (("without_adapter", None), ("with_adapter", adapters[layer]))}
        rows.append({"exit_layer": layer, **measured, "epoch_losses": losses,
                     **{f"modeled_speedup_{name}": training.modeled_speedup(measured[name]["top1"], layer,
                                                                            config.num_layers, gamma)
                        for name in measured}})
    chosen = options.layer or max(rows, key=lambda row: row["modeled_speedup_with_adapter"])["exit_layer"]
    training.print_agreement(rows, chosen, console)
    adapters[chosen].save(output)
    report = {"adapter": str(output), "exit_layer": chosen,
              "chosen_by": "--layer" if options.layer else f"the best modeled speedup at gamma {gamma}",
              "layers": rows, "target": target_name(pipeline.target.checkpoint), "target_layers": config.num_layers,
              "draft_vocab": len(ids), "inner_size": options.inner_size, "epochs": options.epochs,
              "held_out_next_tokens_in_draft_vocab": round(float(torch.isin(held_data.next_tokens, ids).float()
                                                                 .mean()), 4),
              "positions": {"train": len(train_data.next_tokens), "held_out": len(held_data.next_tokens)},
              **run_facts(train_prompts, held_out, options, answers_seconds, started)}
    (output / REPORT_FILE).write_text(json.dumps(report, indent=2) + "\n")
    training.write_plot(report, output / "training.png")
    return report
