"""TensorRT-LLM builder (backend.kind: trtllm). It checks the pipeline against the target model, then runs the
plan in builders/trtllm_plan.py. Where TensorRT-LLM, trtllm-build or an NVIDIA GPU is missing, it stops before
doing anything and names what is missing; `specdeploy build --dry-run` prints the plan anywhere."""

from __future__ import annotations

import importlib.util
import shutil
from pathlib import Path

from specdeploy.builders.checkpoints import target_config
from specdeploy.builders.trtllm_plan import TRITON_IMAGE, TRTLLM_VERSION, Step, build_plan, check_model_fits
from specdeploy.errors import BuildError
from specdeploy.layout import engine_path
from specdeploy.pipeline import PipelineSpec


def missing_requirements() -> list[str]:
    """What this machine lacks for a TensorRT-LLM build, in words (empty: nothing)."""
    missing = []
    if importlib.util.find_spec("tensorrt_llm") is None:
        missing.append(f"the tensorrt_llm package (TensorRT-LLM {TRTLLM_VERSION}; it ships in {TRITON_IMAGE})")
    if shutil.which("trtllm-build") is None:
        missing.append("trtllm-build on PATH (installed with TensorRT-LLM)")
    import torch

    if not torch.cuda.is_available():
        missing.append("an NVIDIA GPU (torch sees no CUDA device)")
    return missing


def plan(pipeline: PipelineSpec, engines_root: Path) -> tuple[list[Step], list[str]]:
    """The build's steps and notes on what was checked. Checks that need the target's config run when its
    checkpoint is here; a checkpoint that is not (a GPU example planned on another machine) is a note."""
    notes = []
    try:
        config = target_config(pipeline)
    except BuildError as exc:
        notes.append(f"head and expert divisibility not checked: {exc}")
    else:
        check_model_fits(pipeline, config)
        notes.append(f"target: {config.architecture}, {config.num_heads} attention heads, {config.num_kv_heads} "
                     f"key/value heads" + (f", {config.num_experts} experts" if config.num_experts else ""))
    return build_plan(pipeline, engine_path(engines_root, pipeline)), notes


def format_plan(pipeline: PipelineSpec, steps: list[Step], notes: list[str]) -> str:
    settings = pipeline.backend.settings
    lines = [f"{pipeline.name}: TensorRT-LLM {TRTLLM_VERSION}, line {settings.line}, served by {settings.server} "
             f"({TRITON_IMAGE}); tp {settings.tp_size} x pp {settings.pp_size}, {settings.dtype}"]
    lines += [f"  note: {note}" for note in notes]
    lines += [f"[{number}/{len(steps)}] {step.describe()}" for number, step in enumerate(steps, 1)]
    return "\n".join(lines)


def build(pipeline: PipelineSpec, engines_root: Path) -> None:
    """Stops with the list of what is missing; the steps themselves run only where nothing is."""
    steps, _ = plan(pipeline, engines_root)
    missing = missing_requirements()
    if missing:
        raise BuildError(f"{pipeline.name}: backend trtllm cannot build on this machine; missing: "
                         f"{'; '.join(missing)}. Nothing was written. `specdeploy build --dry-run` prints the "
                         f"{len(steps)} steps it would run.")
    raise BuildError(f"{pipeline.name}: running the TensorRT-LLM plan is not implemented yet (issue 12); "
                     f"`specdeploy build --dry-run` prints the {len(steps)} steps to run by hand")
