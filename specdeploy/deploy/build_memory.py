"""The build Job's memory (request = limit): the peak of `specdeploy build`, whose steps run one after another, so
the largest step sets it. Our steps are measured; TensorRT-LLM's (its converter and trtllm-build, which need a GPU
and its image) are estimated from upstream's code. The Job gets the larger, with MARGIN.

Our steps take one of four paths (our_path; build/trtllm/plan.py decides which exports a pipeline needs):
- torch: the torch backend loads the target whole in fp32 (transformers dequantizes a GGUF whole) and writes the
  engine's copies;
- whole: on trtllm, a GGUF or packaged source (the small CPU models) is loaded the same way, then exported through a
  transformers model (build/hf_export.export_model), or, for a derived MoE, derived and written a layer at a time;
- streamed: on trtllm, an MoE derived from a Hugging Face checkpoint, read and written a layer at a time; its peak
  follows one layer (at most weights / FEWEST_LAYERS) and the calibration activations, not the model;
- read: on trtllm, Hugging Face checkpoints that need no derivation are read where they are by TensorRT-LLM's
  converter; we read at most the target's vocabulary projection (Medusa heads).

Our steps' lines (peak = runtime + k x weights, per path) are fitted to peaks that
scripts/measure_build_memory.py measures, each build in a fresh process; the constants below are the envelope of its
runs. The figures, the machine and the run history: docs/benchmarks.md, "Build memory".

TensorRT-LLM's steps (NVIDIA/TensorRT-LLM of the 1.1/1.2 era, the copies docs/tensorrt-llm.md reads; an estimate,
nothing here runs them):
- the converter (build/trtllm/convert.py, one rank after another): `from_hugging_face` reads each tensor's share
  for the rank through safe_open (tensorrt_llm/models/model_weights_loader.py: `load_tensor` slices, `fill`
  assigns), and `save_checkpoint` hands them to safetensors' save_file (tensorrt_llm/models/modeling_utils.py), whose
  releases before 0.6 copy every tensor to bytes first: CONVERT_COPIES of a rank's share, plus its runtime.
- the Medusa converter (examples/medusa/convert_checkpoint.py) loads the base model with transformers
  `from_pretrained(dtype="auto", device_map="auto")`: on the GPU where it sees one, on the host at worst, so the
  model once more.
- trtllm-build --workers N (tensorrt_llm/commands/build.py `parallel_build`: a ProcessPoolExecutor of N spawned
  processes) builds N ranks at once; each loads its rank file whole (`from_checkpoint`: safetensors load_file), builds
  the network on those weights and serialises an engine that embeds them (builder.py), then saves it: two copies of
  the rank's share, and a third allowed for TensorRT's own copies while it builds (ENGINE_COPIES), plus a runtime per
  worker.
  With N = tp x pp (build/trtllm/plan.build_workers) that is about 3 x the component's weights at once.
Page cache of the files read and written is charged to the Job too, but the kernel reclaims it before it kills.
"""

from __future__ import annotations

import math
from pathlib import Path

from specdeploy.build.trtllm.plan import EXPORTS, build_workers, export_steps, streams_target
from specdeploy.spec.pipeline import PipelineSpec

# Measured lines (figures: docs/benchmarks.md, "Build memory"): runtime in GiB, k in GiB per GiB of weights.
TORCH_RUNTIME_GIB, TORCH_K = 0.88, 2.29  # the runtime: the GGUF load and neuron split of the MoE shipped then
WHOLE_RUNTIME_GIB, WHOLE_K = 0.72, 3.05  # k: the bf16 target's fp32 state and the model's fp32 copy, ~4 x its size
STREAMED_RUNTIME_GIB, STREAMED_LAYER_K = 0.60, 22.0  # k per GiB of one layer: its copies, the calibration activations
READ_RUNTIME_GIB = 0.37  # flat: a draft-target or n-gram build holds nothing of the model (the same at both sizes)
MEDUSA_K = 0.22  # the read path's slope with Medusa heads: the heads and the target's projection
FEWEST_LAYERS = 16  # a Llama-family checkpoint of 1B or more has at least 16 layers: a layer is <= 1/16 of it

# Estimated from upstream (see the module docstring).
# one process with tensorrt_llm, TensorRT and torch imported and a CUDA context: TensorRT's builder library alone
# logs "Init builder kernel library: CPU +1799 MiB" (NVIDIA/TensorRT-LLM issue 538)
TRTLLM_RUNTIME_GIB = 4.0
CONVERT_COPIES = 2
ENGINE_COPIES = 3

MARGIN = 1.1  # allocator fragmentation, and what a peak measured on small models does not show


def our_path(pipeline: PipelineSpec) -> str:
    """torch, whole (an export loads its source whole), streamed (a derived MoE target is the only export) or read
    (nothing exported but Medusa heads)."""
    if pipeline.backend.kind == "torch":
        return "torch"
    actions = {step.action for step in export_steps(pipeline, Path("."))}
    if not actions:
        return "read"
    return "streamed" if streams_target(pipeline) and actions == {EXPORTS["target"][1]} else "whole"


def our_steps_gib(pipeline: PipelineSpec, weights_gib: float) -> float:
    """The peak of our steps by the measured line of the pipeline's path."""
    path = our_path(pipeline)
    if path == "streamed":
        return STREAMED_RUNTIME_GIB + STREAMED_LAYER_K * weights_gib / FEWEST_LAYERS
    medusa = pipeline.speculation.traits.trtllm.converts_heads
    runtime, k = {"torch": (TORCH_RUNTIME_GIB, TORCH_K), "whole": (WHOLE_RUNTIME_GIB, WHOLE_K),
                  "read": (READ_RUNTIME_GIB, MEDUSA_K if medusa else 0.0)}[path]
    return runtime + k * weights_gib


def upstream_steps_gib(pipeline: PipelineSpec, weights_gib: float) -> float:
    """TensorRT-LLM's largest step; 0 where the build runs none (torch, and the llm_api line, whose LLM converts when
    it serves). `weights_gib` stands for the largest component: conversions and engine builds run one at a time."""
    if pipeline.backend.kind == "torch" or pipeline.backend.settings.line != "engine":
        return 0.0
    spec = pipeline.backend.settings
    share = weights_gib / (spec.tp_size * spec.pp_size)
    convert = TRTLLM_RUNTIME_GIB + CONVERT_COPIES * share
    if pipeline.speculation.traits.trtllm.converts_heads:
        convert += weights_gib
    engines = build_workers(spec) * (TRTLLM_RUNTIME_GIB + ENGINE_COPIES * share)
    return max(convert, engines)


def build_memory_gib(pipeline: PipelineSpec, weights_gib: float) -> int:
    """The build Job's memory in GiB, its request and its limit, for a pipeline whose weights (target plus draft or
    heads, as sizing.estimate_weights_gib counts them) are `weights_gib`: the larger of our steps and TensorRT-LLM's,
    times MARGIN."""
    return math.ceil(max(our_steps_gib(pipeline, weights_gib), upstream_steps_gib(pipeline, weights_gib)) * MARGIN)
