"""How big a pipeline's serving pod must be: weights and KV cache from the model's dimensions, GPUs from the
parallelism. Estimates for resource requests, not measurements: the overlay's comments name what each figure
came from, and `--weights-gib` replaces the weight estimate (needed where the checkpoint is not readable here).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from specdeploy.build.moe_derive import moe_config
from specdeploy.errors import SpecdeployError
from specdeploy.models.config import ModelConfig
from specdeploy.spec.pipeline import PipelineSpec
from specdeploy.spec.speculation import TrainedSource

GIB = 1 << 30
DTYPE_BYTES = {"float32": 4, "bfloat16": 2, "float16": 2}
INT4_BYTES = 0.5
RUNTIME_GIB = 1.5  # the interpreter, torch, Triton and its Python backend stubs
GPU_HOST_GIB_PER_GPU = 8  # host memory per GPU on the GPU overlays (Triton's TensorRT-LLM tutorials use 8 GiB per CPU)
LOAD_FLOOR_S = 1800  # the least a GPU server's startup probe allows for loading its engines
LOAD_MARGIN = 1.5  # deserialising the engines and copying them to the GPUs, on top of reading them


def parameters(config: ModelConfig) -> int:
    """Weights in a decoder with `config`'s dimensions (norms left out)."""
    attention = 2 * config.hidden_size * config.num_heads * config.head_dim \
        + 2 * config.hidden_size * config.num_kv_heads * config.head_dim
    mlp = 3 * config.hidden_size * config.intermediate_size * max(config.num_experts, 1)
    embeddings = config.vocab_size * config.hidden_size * (1 if config.tie_word_embeddings else 2)
    return embeddings + config.num_layers * (attention + mlp)


def kv_bytes_per_token(config: ModelConfig, dtype: str) -> int:
    return 2 * config.num_layers * config.num_kv_heads * config.head_dim * DTYPE_BYTES[dtype]


@dataclass(frozen=True)
class PodSize:
    gpus: int  # per pod
    nodes: int  # pods per serving group (1 unless the model spans nodes)
    weights_gib: float  # the whole model's
    kv_gib: float  # torch backend: the KV budget in host memory; 0 on GPUs (the cache lives there)
    memory_request_gib: int
    memory_limit_gib: int
    cpu_request: int
    cpu_limit: int
    shm_gib: int

    def comment(self) -> str:
        return (f"weights {self.weights_gib:.2f} GiB, KV {self.kv_gib:.2f} GiB, {self.gpus} GPU(s) per pod on "
                f"{self.nodes} node(s)")


def weight_only_bytes(config: ModelConfig, precision: str) -> float:
    """A model stored weight-only quantized: int4 projections with their group scales (or int8 rows), the bf16
    embedding table and an int8 vocabulary head (its own copy, tied or not)."""
    vocabulary = config.vocab_size * config.hidden_size
    embeddings = vocabulary * (1 if config.tie_word_embeddings else 2)
    projection_bytes = 1.0 if precision == "int8" else INT4_BYTES * 1.25
    return (parameters(config) - embeddings) * projection_bytes + vocabulary * 3


def estimate_weights_gib(pipeline: PipelineSpec, checkpoint: ModelConfig) -> float:
    """Target and draft (or the method's trained parts) weights as the engine stores them; `checkpoint`: the target
    checkpoint's dimensions (the dense source, where target.moe derives an MoE from it)."""
    moe = pipeline.target.moe
    target = checkpoint if moe is None else moe_config(checkpoint, moe)
    precision = pipeline.target.weight_only
    total = parameters(target) * DTYPE_BYTES[pipeline.target.dtype] if precision is None \
        else weight_only_bytes(target, precision)
    speculation = pipeline.speculation
    draft = speculation.draft
    if draft is not None and draft.weight_only is not None:
        source = checkpoint if draft.derive == "int4_dense" else target
        total += weight_only_bytes(source, draft.weight_only)
    for source in speculation.trained_sources:
        total += trained_part_bytes(pipeline, source, target)
    return total / GIB


def trained_part_bytes(pipeline: PipelineSpec, source: TrainedSource, target: ModelConfig) -> float:
    """A trained part as it is loaded: its safetensors' size where it is readable here, else its section's count of
    its parameters at the target's dimensions in the target's dtype (0 for a part without one: a small adapter)."""
    path = pipeline.resolve(source.path)
    files = [path] if path.is_file() else sorted(path.glob("*.safetensors")) if path.is_dir() else []
    if files:
        return float(sum(file.stat().st_size for file in files))
    count = getattr(pipeline.speculation.settings, "trained_parameters", None)
    return 0.0 if count is None else count(target) * DTYPE_BYTES[pipeline.target.dtype]


def pod_size(pipeline: PipelineSpec, target: ModelConfig | None, weights_gib: float | None,
             gpus_per_node: int) -> PodSize:
    """`target`: the target's dimensions (None when its checkpoint is not readable here; then `weights_gib` must be
    given). A torch pipeline runs on CPUs with its KV budget in host memory; a trtllm pipeline gets tp × pp GPUs,
    on ceil(tp × pp / gpus_per_node) nodes."""
    if weights_gib is None:
        weights_gib = estimate_weights_gib(pipeline, target)
    if pipeline.backend.kind == "torch":
        kv_gib = pipeline.kv_capacity_tokens * kv_bytes_per_token(target, pipeline.target.dtype) / GIB \
            if target is not None else 0.0
        request = math.ceil(weights_gib + kv_gib + RUNTIME_GIB)
        return PodSize(gpus=0, nodes=1, weights_gib=weights_gib, kv_gib=kv_gib, memory_request_gib=request,
                       memory_limit_gib=math.ceil(request * 1.5), cpu_request=2, cpu_limit=4, shm_gib=1)
    settings = pipeline.backend.settings
    world = settings.tp_size * settings.pp_size
    nodes = math.ceil(world / gpus_per_node)
    gpus = world // nodes
    # Engines load through host memory: each pod's share of the weights, plus the per-GPU baseline
    request = math.ceil(weights_gib / nodes + GPU_HOST_GIB_PER_GPU * gpus)
    return PodSize(gpus=gpus, nodes=nodes, weights_gib=weights_gib, kv_gib=0.0, memory_request_gib=request,
                   memory_limit_gib=math.ceil(request * 1.25), cpu_request=max(4, gpus), cpu_limit=max(8, 2 * gpus),
                   shm_gib=max(2, 2 * gpus))


def engine_load_seconds(size: PodSize, read_gibps: float) -> int:
    """How long a GPU server's startup may take to load its engines: every engine byte read from the data volume at
    `read_gibps`, with LOAD_MARGIN, and at least LOAD_FLOOR_S. The whole model's bytes, not one pod's share: the
    pods of a group read one shared volume at once, whose server bounds the rate they share. A 405B model's
    755 GiB at 0.25 GiB/s takes 50 minutes to read, past the 30 minutes once allowed (kubernetes review B7)."""
    return max(LOAD_FLOOR_S, math.ceil(size.weights_gib / read_gibps * LOAD_MARGIN))


def check_node_span(pipeline: PipelineSpec, size: PodSize, gpus_per_node: int, where: object) -> None:
    """Refuse a serving group across nodes that TensorRT-LLM cannot run: its ranks must fill whole nodes, and two
    engines (target and draft) run in orchestrator mode, which stays on one node. `where` names the pipeline."""
    if size.nodes == 1:
        return
    from specdeploy.package.repository import trtllm_engines

    settings = pipeline.backend.settings
    world = settings.tp_size * settings.pp_size
    if world % gpus_per_node:
        raise SpecdeployError(f"{where}: tp_size × pp_size = {world} spans nodes but is not a multiple of "
                              f"--gpus-per-node {gpus_per_node}")
    if len(trtllm_engines(pipeline)) > 1:
        raise SpecdeployError(f"{where}: a draft-target pipeline on TensorRT-LLM runs its two engines in "
                              f"orchestrator mode, which is single-node; tp_size × pp_size = {world} exceeds "
                              f"--gpus-per-node {gpus_per_node} (use Medusa or n-gram speculation across nodes)")
