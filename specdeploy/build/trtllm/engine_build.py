"""TensorRT-LLM builder (backend.kind: trtllm). It checks the pipeline against the target model, then runs the
plan in build/trtllm/plan.py: our own exports first, then TensorRT-LLM's converters and trtllm-build, each
logged to trtllm/logs/. Where TensorRT-LLM, trtllm-build or an NVIDIA GPU is missing it stops before doing anything
and names what is missing; `specdeploy build --dry-run` prints the plan anywhere. As with the torch builder, the
build happens in a hidden sibling directory moved into place when complete, and unchanged inputs skip the work."""

from __future__ import annotations

import importlib.util
import json
import shutil
import subprocess
import time
from pathlib import Path

import yaml
from rich.progress import Progress, SpinnerColumn, TextColumn, TimeElapsedColumn

import specdeploy
from specdeploy.build.checkpoints import Checkpoint, load_checkpoint, pipeline_sources, target_hf_config
from specdeploy.build.hf_export import export_model
from specdeploy.build.hf_tensors import read_projection
from specdeploy.build.moe_derive import export_derived_target
from specdeploy.build.torch_engine import BuildResult
from specdeploy.build.trtllm.plan import (
    TRITON_IMAGE,
    TRTLLM_VERSION,
    Step,
    build_plan,
    check_model_fits,
    llm_api_config,
    readable_checkpoint,
    streams_target,
)
from specdeploy.errors import BuildError
from specdeploy.models.config import ModelConfig, rope_scaling
from specdeploy.models.registry import DTYPES
from specdeploy.spec.engine_paths import engine_path, save_engine_pipeline, staging_dir
from specdeploy.spec.manifest import build_unless_current, fingerprint, write_manifest
from specdeploy.spec.pipeline import PipelineSpec

MEDUSA_HEADS_FILE = "medusa_lm_head.safetensors"  # the name TensorRT-LLM's Medusa converter reads


def missing_requirements(pipeline: PipelineSpec) -> list[str]:
    """What this machine lacks for the pipeline's TensorRT-LLM build, in words (empty: nothing)."""
    missing = []
    converter = pipeline.backend.settings.medusa_converter
    if pipeline.speculation.traits.trtllm.converts_heads and not Path(converter).is_file():
        missing.append(f"TensorRT-LLM's Medusa converter at {converter} (backend.trtllm.medusa_converter: the "
                       f"path of examples/medusa/convert_checkpoint.py from a TensorRT-LLM {TRTLLM_VERSION} "
                       f"checkout)")
    if importlib.util.find_spec("tensorrt_llm") is None:
        missing.append(f"the tensorrt_llm package (TensorRT-LLM {TRTLLM_VERSION}; it ships in {TRITON_IMAGE})")
    if shutil.which("trtllm-build") is None:
        missing.append("trtllm-build on PATH (installed with TensorRT-LLM)")
    import torch

    if not torch.cuda.is_available():
        missing.append("an NVIDIA GPU (torch sees no CUDA device)")
    else:
        missing += weight_only_refusals(pipeline, torch.cuda.get_device_capability(0), torch.cuda.get_device_name(0))
    return missing


def weight_only_components(pipeline: PipelineSpec) -> dict[str, str]:
    """{component: int4 | int8} for each engine TensorRT-LLM converts to weight-only (plan.weight_only_flags)."""
    if pipeline.backend.settings.line != "engine":  # the llm_api line runs no trtllm-build
        return {}
    found = {"target": pipeline.target.weight_only}
    if pipeline.speculation.draft is not None:
        found["draft"] = pipeline.speculation.draft.weight_only
    return {component: precision for component, precision in found.items() if precision is not None}


def weight_only_refusals(pipeline: PipelineSpec, capability: tuple[int, int], gpu: str) -> list[str]:
    """What trtllm-build would refuse on this GPU, in the words of missing_requirements: TensorRT-LLM's builder
    raises "INT8/INT4 quantization is not supported on SM>=100" for weight-only models on SM 100 to 119 (B200, GB200,
    B300; tensorrt_llm/builder.py @ 008b2b8d, build()), after the conversion has run."""
    sm = capability[0] * 10 + capability[1]
    if not 100 <= sm < 120:
        return []
    return [f"a GPU where TensorRT-LLM builds INT4/INT8 weight-only engines: {gpu} is SM {sm}, where trtllm-build "
            f"refuses them (\"INT8/INT4 quantization is not supported on SM>=100\"); the {component} is "
            f"{precision} ({'target.weight_only' if component == 'target' else 'speculation.draft.derive'}): use "
            f"{'no weight_only' if component == 'target' else 'a bf16 draft checkpoint (derive: none)'} on this GPU"
            for component, precision in weight_only_components(pipeline).items()]


def plan(pipeline: PipelineSpec, engines_root: Path) -> tuple[list[Step], list[str]]:
    """The build's steps and notes on what was checked. Checks that need the target's config run when its
    checkpoint is here; a checkpoint that is not (a GPU example planned on another machine) is a note."""
    notes = []
    try:
        hf_config = target_hf_config(pipeline)
    except BuildError as exc:
        heads = pipeline.speculation.traits.trtllm.converts_heads
        checks = "head and expert divisibility" + (" and rope scaling" if heads else "")
        notes.append(f"{checks} not checked: {exc}")
    else:
        config = ModelConfig.from_hf(hf_config, torch_engine=False)
        check_model_fits(pipeline, config)
        check_medusa_rope(pipeline, rope_scaling(hf_config))
        notes.append(f"target: {config.architecture}, {config.num_heads} attention heads, {config.num_kv_heads} "
                     f"key/value heads" + (f", {config.num_experts} experts" if config.num_experts else ""))
    return build_plan(pipeline, engine_path(engines_root, pipeline)), notes


def check_medusa_rope(pipeline: PipelineSpec, scaling: dict | None) -> None:
    """BuildError for Medusa on a target with rope scaling (Llama-3.1's llama3 type): TensorRT-LLM's Medusa
    converter keeps only the type and drops its factors (rotary_scaling = {"type": rope_type},
    examples/medusa/convert_checkpoint.py @ b93e14ca), so the engine would not compute the model's RoPE."""
    if pipeline.speculation.traits.trtllm.converts_heads and scaling is not None:
        factors = ", ".join(f"{key} {value}" for key, value in scaling.items()
                            if key not in ("rope_type", "rope_theta"))
        raise BuildError(f"speculation.method: medusa: the target's config.json has rope scaling "
                         f"{scaling['rope_type']!r} ({factors}), whose factors TensorRT-LLM's Medusa converter drops "
                         f"(it keeps only the type), so the engine's RoPE would not be the model's; use a target "
                         f"without rope scaling (Llama-3-8B, Vicuna) for Medusa, or method draft_target")


def format_plan(pipeline: PipelineSpec, steps: list[Step], notes: list[str]) -> str:
    settings = pipeline.backend.settings
    lines = [f"{pipeline.name}: TensorRT-LLM {TRTLLM_VERSION}, line {settings.line}, served by {settings.server} "
             f"({TRITON_IMAGE}); tp {settings.tp_size} x pp {settings.pp_size}, {settings.dtype}"]
    lines += [f"  note: {note}" for note in notes]
    lines += [f"[{number}/{len(steps)}] {step.describe()}" for number, step in enumerate(steps, 1)]
    return "\n".join(lines)


class Sources:
    """The pipeline's models, each loaded whole once when an export first needs it: only sources TensorRT-LLM cannot
    read as they are (GGUF and packaged files, which transformers dequantizes whole; the small CPU models), since a
    Hugging Face checkpoint is read where it is or streamed (build/trtllm/plan.hf_dirs)."""

    def __init__(self, pipeline: PipelineSpec, engines_root: Path | None = None) -> None:
        self.pipeline, self.engines_root = pipeline, engines_root  # the GGUF store's place (build/gguf_store.py)
        self.loaded: dict[str, Checkpoint] = {}

    def get(self, name: str) -> Checkpoint:
        if name not in self.loaded:
            pipeline = self.pipeline
            if name == "target":  # a derived MoE's dense source too (export_derived_target derives the MoE)
                self.loaded[name] = load_checkpoint(pipeline.target.checkpoint, pipeline, self.engines_root)
            else:
                self.loaded[name] = load_checkpoint(pipeline.speculation.draft.checkpoint, pipeline,
                                                    self.engines_root)
        return self.loaded[name]


def run_action(step: Step, pipeline: PipelineSpec, final: Path, output: Path, sources: Sources) -> None:
    """The steps specdeploy does itself: exports and the LLM-API configuration."""
    from specdeploy.models.registry import projection_key
    from specdeploy.speculative.medusa import MedusaHeads, export_trtllm

    dtype = DTYPES[pipeline.backend.settings.dtype]
    exports = {"export target": "target", "export draft": "draft", "export dense source": "target"}
    if step.action == "export target" and pipeline.target.moe is not None:  # derived and written layer by layer
        dense = readable_checkpoint(pipeline, "dense_source") if streams_target(pipeline) else sources.get("target")
        export_derived_target(pipeline.target.moe, dense, output, dtype)
    elif step.action in exports:
        model = sources.get(exports[step.action])
        # plan.ties_embeddings
        untie = step.action == "export target" and pipeline.speculation.traits.trtllm.converts_heads
        export_model(model.config, model.state, model.tokenizer, output, dtype, step.action.removeprefix("export "),
                     untie=untie)
    elif step.action == "export medusa heads":
        heads = MedusaHeads.load(pipeline.resolve(pipeline.speculation.medusa.heads))
        target_dir = readable_checkpoint(pipeline, "target")
        if target_dir is not None:  # the heads need the target's projection only: read it alone
            projection = read_projection(target_dir)
        else:
            target = sources.get("target")
            projection = target.state[projection_key(target.state)]
        output.mkdir(parents=True)
        export_trtllm(heads, projection, output / MEDUSA_HEADS_FILE, dtype)
        (output / "config.json").write_text(json.dumps({"medusa_num_heads": heads.num_heads,
                                                        "medusa_num_layers": heads.num_layers}, indent=2))
    elif step.action == "write llm_api.yaml":
        output.parent.mkdir(parents=True, exist_ok=True)
        output.write_text(yaml.safe_dump(llm_api_config(pipeline, final / "trtllm"), sort_keys=False))
    else:
        raise AssertionError(f"unknown build action {step.action!r}")


def run_command(step: Step, log: Path) -> None:
    """An external step, its output in `log`; a failure names the step, the exit status and the log."""
    log.parent.mkdir(parents=True, exist_ok=True)
    with log.open("w") as sink:
        sink.write(f"$ {' '.join(step.command)}\n")
        sink.flush()
        status = subprocess.run(step.command, stdout=sink, stderr=subprocess.STDOUT).returncode
    if status != 0:
        tail = log.read_text().splitlines()[-5:]
        raise BuildError(f"{step.title} failed (exit status {status}); its log: {log}\n" + "\n".join(tail))


def build_inputs(pipeline: PipelineSpec, final: Path) -> dict:
    return fingerprint(pipeline, pipeline_sources(pipeline), {"specdeploy": specdeploy.__version__,
                                                              **installed_toolchain()}, final)


def installed_toolchain() -> dict:
    """What a built engine is valid for, as installed here: TensorRT-LLM's and TensorRT's versions (an engine
    deserializes only under the TensorRT that built it) and the GPU (engines are not portable across GPU
    architectures). An image rebuilt on a newer Triton base, or a build on another GPU, then rebuilds instead of
    reusing engines its runtime cannot load. None where a part is not installed (a package's metadata missing)."""
    import importlib.metadata

    import torch

    def version(distribution: str) -> str | None:
        try:
            return importlib.metadata.version(distribution)
        except importlib.metadata.PackageNotFoundError:
            return None

    gpu = None
    if torch.cuda.is_available():
        major, minor = torch.cuda.get_device_capability(0)
        gpu = f"{torch.cuda.get_device_name(0)} (SM {major}{minor})"
    return {"tensorrt_llm": version("tensorrt_llm"), "tensorrt": version("tensorrt"), "gpu": gpu}


def build(pipeline: PipelineSpec, engines_root: Path, force: bool = False, quiet: bool = False) -> BuildResult:
    """Run the plan into engines_root/<name>/trtllm, unless it is up to date; stops first, writing nothing, when
    this machine lacks what a TensorRT-LLM build needs."""
    steps, _ = plan(pipeline, engines_root)
    missing = missing_requirements(pipeline)
    if missing:
        raise BuildError(f"{pipeline.name}: backend trtllm cannot build on this machine; missing: "
                         f"{'; '.join(missing)}. Nothing was written. `specdeploy build --dry-run` prints the "
                         f"{len(steps)} steps it would run.")
    final = engine_path(engines_root, pipeline)
    inputs = build_inputs(pipeline, final)
    built = build_unless_current(final, inputs, pipeline, force,
                                 lambda: run_plan(pipeline, final, inputs, steps, quiet))
    return BuildResult(final, built)


def run_plan(pipeline: PipelineSpec, final: Path, inputs: dict, steps: list[Step], quiet: bool) -> None:
    """Run the plan's steps into a staging directory that becomes `final` (the caller holds build_lock(final))."""
    started = time.perf_counter()
    columns = (SpinnerColumn(), TextColumn("{task.description}"), TimeElapsedColumn())
    with Progress(*columns, disable=quiet) as progress, staging_dir(final) as staging:
        task = progress.add_task(f"[{pipeline.name}]", total=None)
        save_engine_pipeline(staging, pipeline)
        sources = Sources(pipeline, final.parent)
        for number, step in enumerate(build_plan(pipeline, staging), 1):
            progress.update(task, description=f"[{pipeline.name}] {number}/{len(steps)}: {step.title}")
            if step.command is None:
                run_action(step, pipeline, final, step.output, sources)
            else:
                run_command(step, staging / "trtllm" / "logs" / f"{number}-{step.output.name}.log")
        write_manifest(staging, inputs, started)
