"""The `tensorrtllm` backend's models in a trtllm repository: `tensorrt_llm` (the target engine) and, for
draft-target, `tensorrt_llm_draft`, each built as Triton's ModelConfig message with the tensors and parameter keys
of the pinned release's template (build/trtllm/upstream.py; tests check every key against it)."""

from __future__ import annotations

from tritonclient.grpc import model_config_pb2 as pb

from specdeploy.build.trtllm.upstream import (
    LOOKAHEAD_PARAMETERS,
    REQUIRED_INPUTS,
    TENSORRTLLM_INPUTS,
    TENSORRTLLM_OUTPUTS,
)
from specdeploy.spec.pipeline import PipelineSpec


def medusa_choices(paths: tuple[tuple[int, ...], ...]) -> str:
    """A tree's paths as the backend's medusa_choices string: "{0}, {0, 0}, {1}"."""
    return ", ".join("{" + ", ".join(str(i) for i in path) + "}" for path in paths)


def decoding_parameters(pipeline: PipelineSpec, draft: bool) -> dict[str, str]:
    """The model's decoding_mode and what goes with it. A draft engine decodes plainly. The target: medusa with its
    tree for a Medusa pipeline; lookahead with its W, N and G for a lookahead one (the backend reads the three
    lookahead_* parameters only under decoding_mode lookahead and silently ignores them otherwise: the executor
    then runs its default (4, 3, 4), which fails to load on an engine built for other sizes; model_instance_state.cc
    @ 0c8de69a, getExecutorConfigFromParams); top-k/top-p sampling otherwise (drafts then arrive as
    draft_input_ids)."""
    speculation = pipeline.speculation
    mode = speculation.traits.trtllm.engine_mode
    if draft or not speculation.traits.trtllm.engine_speculates:
        return {"decoding_mode": "top_k_top_p"}
    if mode == "medusa":
        return {"decoding_mode": "medusa", "medusa_choices": medusa_choices(speculation.medusa.choices)}
    lookahead = speculation.lookahead
    sizes = (lookahead.window, lookahead.ngram, lookahead.verification_set)
    return {"decoding_mode": "lookahead", **{key: str(size) for key, size in zip(LOOKAHEAD_PARAMETERS, sizes)}}


def tensorrtllm_model(name: str, pipeline: PipelineSpec, engine_path: str, draft: bool = False) -> pb.ModelConfig:
    """engine_path: the engine directory as the server will see it (gpt_model_path). The decoding mode and its
    parameters: decoding_parameters. Of the template's inputs only those the orchestration sends are declared
    (TENSORRTLLM_INPUTS), so Triton refuses any other, the per-request lookahead_* sizes among them."""
    settings = pipeline.backend.settings
    config = pb.ModelConfig(name=name, backend="tensorrtllm", max_batch_size=pipeline.limits.max_batch_size)
    config.model_transaction_policy.decoupled = True
    config.dynamic_batching.SetInParent()
    config.instance_group.add(count=1, kind=pb.ModelInstanceGroup.KIND_CPU)  # the backend schedules GPUs itself
    for tensor_name, (kind, dims) in TENSORRTLLM_INPUTS.items():
        tensor = config.input.add(name=tensor_name, data_type=pb.DataType.Value(kind), dims=dims)
        tensor.optional = tensor_name not in REQUIRED_INPUTS
        if dims == [1]:
            tensor.reshape.SetInParent()  # a scalar per request, as upstream reshapes it
        if tensor_name in ("input_ids", "draft_input_ids", "draft_logits", "stop_words_list"):
            tensor.allow_ragged_batch = True
    for tensor_name, (kind, dims) in TENSORRTLLM_OUTPUTS.items():
        config.output.add(name=tensor_name, data_type=pb.DataType.Value(kind), dims=dims)
    parameters = {
        "gpt_model_type": "inflight_fused_batching", "gpt_model_path": engine_path, "max_beam_width": "1",
        "batch_scheduler_policy": "guaranteed_no_evict",
        "kv_cache_free_gpu_mem_fraction": str(settings.kv_cache_free_gpu_mem_fraction),
        "enable_kv_cache_reuse": "true" if settings.enable_kv_cache_reuse else "false",
        "exclude_input_in_output": "true", **decoding_parameters(pipeline, draft),
        # Each call brings the whole sequence, mostly from the reuse cache: a long one is prefilled in chunks.
        "enable_chunked_context": "true",
        # Read without a fallback (a missing one fails the load); empty: guided decoding off, tokenizer unused.
        "tokenizer_dir": "", "xgrammar_tokenizer_info_path": "", "guided_decoding_backend": "",
    }
    if draft:
        # Both executors share the GPU and take their fraction of the memory free when each loads, in no fixed
        # order: a draft loading first would take the target's KV space. Its KV cache is capped in tokens instead
        # at what it can ever hold (every row at full length); the backend uses the smaller of the two limits.
        limits = pipeline.limits
        parameters["max_tokens_in_paged_kv_cache"] = str(limits.max_batch_size * limits.max_sequence_length)
    for key, value in parameters.items():
        config.parameters[key].string_value = value
    return config
