"""The upstream command-line flags the trtllm build plan may use, as TensorRT-LLM 1.2.x defines them. Tests check
every flag a plan emits against these tables, so a typo or a flag of another release fails here, not on a GPU.
Sources (NVIDIA/TensorRT-LLM; see docs/tensorrt-llm.md for the versions read): the values are each flag's
allowed values, None for a free value, "switch" for a flag that takes none."""

from __future__ import annotations

# tensorrt_llm/commands/build.py and tensorrt_llm/plugin/plugin.py (add_plugin_argument)
TRTLLM_BUILD_FLAGS: dict[str, tuple[str, ...] | str | None] = {
    "--checkpoint_dir": None, "--output_dir": None, "--max_batch_size": None, "--max_input_len": None,
    "--max_seq_len": None, "--max_num_tokens": None, "--max_beam_width": None, "--workers": None,
    "--gemm_plugin": ("auto", "float16", "float32", "bfloat16", "int32", "fp8", "nvfp4", "disable"),
    "--speculative_decoding_mode": ("draft_tokens_external", "lookahead_decoding", "medusa",
                                    "explicit_draft_tokens", "eagle"),
    "--max_draft_len": None, "--use_paged_context_fmha": ("enable", "disable"),
    "--gather_generation_logits": "switch", "--gather_context_logits": "switch",
    "--kv_cache_type": ("continuous", "paged", "disabled"),
}

# examples/medusa/convert_checkpoint.py (the weight-only flags @ b93e14ca)
MEDUSA_CONVERT_FLAGS: dict[str, tuple[str, ...] | str | None] = {
    "--model_dir": None, "--medusa_model_dir": None, "--output_dir": None,
    "--dtype": ("float32", "bfloat16", "float16"), "--num_medusa_heads": None, "--num_medusa_layers": None,
    "--max_medusa_token_len": None, "--tp_size": None, "--pp_size": None, "--workers": None,
    "--use_weight_only": "switch", "--weight_only_precision": ("int8", "int4", "int4_gptq"),
}

# examples/models/core/llama/convert_checkpoint.py, whose flags build/trtllm/convert.py keeps
LLAMA_CONVERT_FLAGS: dict[str, tuple[str, ...] | str | None] = {
    "--model_dir": None, "--output_dir": None, "--dtype": ("auto", "float16", "bfloat16", "float32"),
    "--tp_size": None, "--pp_size": None, "--moe_tp_size": None, "--moe_ep_size": None,
    "--use_weight_only": "switch",
    "--weight_only_precision": ("int8", "int4", "int8_gptq", "int4_gptq", "int4_awq"),
}

# triton_backend/all_models/inflight_batcher_llm/tensorrt_llm/config.pbtxt (TensorRT-LLM 1.2.x; parameter docs in
# tensorrtllm_backend r26.04 docs/model_config.md): the `parameters` keys of the tensorrtllm backend's model.
TENSORRTLLM_PARAMETER_KEYS = frozenset({
    "max_beam_width", "FORCE_CPU_ONLY_INPUT_TENSORS", "gpt_model_type", "gpt_model_path", "encoder_model_path",
    "max_tokens_in_paged_kv_cache", "max_attention_window_size", "sink_token_length", "batch_scheduler_policy",
    "kv_cache_free_gpu_mem_fraction", "cross_kv_cache_fraction", "kv_cache_host_memory_bytes",
    "kv_cache_onboard_blocks", "exclude_input_in_output", "cancellation_check_period_ms", "stats_check_period_ms",
    "iter_stats_max_iterations", "request_stats_max_iterations", "enable_kv_cache_reuse", "normalize_log_probs",
    "enable_chunked_context", "gpu_device_ids", "participant_ids", "num_nodes", "lora_cache_optimal_adapter_size",
    "lora_cache_max_adapter_size", "lora_cache_gpu_memory_fraction", "lora_cache_host_memory_bytes",
    "lora_prefetch_dir", "decoding_mode", "executor_worker_path", "lookahead_window_size", "lookahead_ngram_size",
    "lookahead_verification_set_size", "medusa_choices", "eagle_choices", "gpu_weights_percent",
    "enable_context_fmha_fp32_acc", "multi_block_mode", "cuda_graph_mode", "cuda_graph_cache_size",
    "speculative_decoding_fast_logits", "tokenizer_dir", "guided_decoding_backend", "xgrammar_tokenizer_info_path",
})
DECODING_MODES = ("top_k", "top_p", "top_k_top_p", "beam_search", "medusa", "redrafter", "lookahead", "eagle")

# Lookahead decoding on the engine line (docs/tensorrt-llm.md, "Lookahead decoding"). The model's parameters, read
# with GetParameter<uint32_t> only when decoding_mode is "lookahead" (getExecutorConfigFromParams,
# triton_backend/inflight_batcher_llm/src/model_instance_state.cc @ 0c8de69a): W, N, G in that order.
LOOKAHEAD_PARAMETERS = ("lookahead_window_size", "lookahead_ngram_size", "lookahead_verification_set_size")
# ... and a load that finds decoding_mode lookahead without all three (same function):
LOOKAHEAD_PARAMETERS_MISSING = ("Decoding mode is set to lookahead but lookahead parameters are not specified. "
                                "Please set parameters lookahead_window_size, lookahead_ngram_size, and "
                                "lookahead_verification_set_size.")
# The template's optional per-request inputs of the same names (TYPE_INT32, dims [1]; the names in utils.h @
# 14c3afec, InputFieldsNames::requestLookaheadDecoding*). Our tensorrt_llm models do not declare them, so Triton
# itself refuses a request that carries one: the backend would not check w ≤ W, n ≤ N, g ≤ G at enqueue, and a
# larger value fails inside the executor's step (lookaheadAlgorithm.cpp @ 3585984b, LookaheadAlgorithm::setup).
LOOKAHEAD_REQUEST_INPUTS = LOOKAHEAD_PARAMETERS
# trtllm-build's mode for it (tensorrt_llm/commands/build.py @ 008b2b8d); --max_draft_len must then be the draft-token
# count of the serving (W, N, G) (LookaheadSpec.nodes).
LOOKAHEAD_BUILD_MODE = "lookahead_decoding"


# The parameters the model instance reads with GetParameter<std::string> outside any try: a config without one fails
# to load with "unexpected error when creating modelInstanceState: Cannot find parameter with name: <name>". Derived
# from every GetParameter call of NVIDIA/TensorRT-LLM triton_backend/inflight_batcher_llm/src/model_instance_state.cc
# @ c8c6df08 (the same in @ 0c8de69a and tensorrtllm_backend v0.19.0 inflight_batcher_llm/src); model_state.cc
# @ 5cdd6921 reads only gpu_device_ids and participant_ids, both with a fallback. Every other parameter falls back to
# a default (docs/tensorrt-llm.md lists them). name → the function that reads it.
TENSORRTLLM_REQUIRED_PARAMETERS = {
    "gpt_model_type": "ModelInstanceState::getBatchingTypeFromParams",
    "tokenizer_dir": "ModelInstanceState::getGuidedDecodingConfigFromParams",
    "xgrammar_tokenizer_info_path": "ModelInstanceState::getGuidedDecodingConfigFromParams",
    "guided_decoding_backend": "ModelInstanceState::getGuidedDecodingConfigFromParams",
}
MISSING_PARAMETER = "Cannot find parameter with name: {name}"  # ModelState::GetParameter<std::string>, model_state.cc
INSTANCE_ERROR = "unexpected error when creating modelInstanceState: {error}"  # ModelInstanceState::Create
# Values the same code accepts. gpt_model_type: anything else fails the load. Booleans (GetParameter<bool>): only
# these spellings; any other value is caught and the parameter silently takes its default. batch_scheduler_policy
# and decoding_mode: anything else falls back to the default with a warning.
GPT_MODEL_TYPES = ("V1", "v1", "inflight_batching", "inflight_fused_batching")
BOOLEAN_VALUES = {"True": True, "true": True, "TRUE": True, "1": True,
                  "False": False, "false": False, "FALSE": False, "0": False}
BATCH_SCHEDULER_POLICIES = ("max_utilization", "guaranteed_no_evict")

# The same template's tensors that our models use: name → (data type, dims). `${logits_datatype}` is TYPE_FP32.
TENSORRTLLM_INPUTS = {
    "input_ids": ("TYPE_INT32", [-1]), "input_lengths": ("TYPE_INT32", [1]),
    "request_output_len": ("TYPE_INT32", [1]), "draft_input_ids": ("TYPE_INT32", [-1]),
    "draft_logits": ("TYPE_FP32", [-1, -1]), "draft_acceptance_threshold": ("TYPE_FP32", [1]),
    "end_id": ("TYPE_INT32", [1]), "pad_id": ("TYPE_INT32", [1]), "stop_words_list": ("TYPE_INT32", [2, -1]),
    "temperature": ("TYPE_FP32", [1]), "runtime_top_k": ("TYPE_INT32", [1]), "runtime_top_p": ("TYPE_FP32", [1]),
    "repetition_penalty": ("TYPE_FP32", [1]), "seed": ("TYPE_UINT64", [1]),
    "return_generation_logits": ("TYPE_BOOL", [1]), "streaming": ("TYPE_BOOL", [1]),
}
TENSORRTLLM_OUTPUTS = {
    "output_ids": ("TYPE_INT32", [-1, -1]), "sequence_length": ("TYPE_INT32", [-1]),
    "generation_logits": ("TYPE_FP32", [-1, -1, -1]), "cum_log_probs": ("TYPE_FP32", [-1]),
}
REQUIRED_INPUTS = frozenset({"input_lengths", "request_output_len"})  # the rest are optional upstream

# triton_backend/all_models/llmapi/tensorrt_llm/config.pbtxt (Triton's LLM-API model, PyTorch backend): the tensors
# our llm_api repository declares, name → (data type, dims), all inputs but text_input optional. Its 1/model.py and
# 1/helpers.py come from the same directory of a TensorRT-LLM checkout at the served release's tag.
LLMAPI_INPUTS = {
    "text_input": ("TYPE_STRING", [-1]), "streaming": ("TYPE_BOOL", [1]),
    "sampling_param_temperature": ("TYPE_FP32", [1]), "sampling_param_top_k": ("TYPE_INT32", [1]),
    "sampling_param_top_p": ("TYPE_FP32", [1]), "sampling_param_max_tokens": ("TYPE_INT32", [1]),
    "sampling_param_stop": ("TYPE_STRING", [-1]), "sampling_param_seed": ("TYPE_UINT64", [1]),
    "sampling_param_exclude_input_from_output": ("TYPE_BOOL", [1]),
    "sampling_param_return_perf_metrics": ("TYPE_BOOL", [1]), "return_finish_reason": ("TYPE_BOOL", [1]),
}
# The inputs upstream's LLM-API config declares and ours does not (NVIDIA/TensorRT-LLM@0a710573 triton_backend/
# all_models/llmapi/tensorrt_llm/config.pbtxt), so Triton refuses a request carrying one before the model sees it:
# "unexpected inference input '<name>' for model 'tensorrt_llm'". Not declared because nothing checks what the served
# release's model.py does with them under speculation: best_of (several sequences), the occurrence penalties, the
# stop reason and cumulative logprob outputs (undeclared outputs), `stop` (cancel by request), LoRA adapters, images.
LLMAPI_INPUTS_NOT_DECLARED = (
    "image_url", "sampling_param_best_of", "sampling_param_frequency_penalty", "sampling_param_presence_penalty",
    "return_stop_reason", "return_cumulative_logprob", "stop", "lora_id", "lora_name", "lora_path",
    "lora_ckpt_source",
)
LLMAPI_OUTPUTS = {
    "text_output": ("TYPE_STRING", [-1]), "finish_reason": ("TYPE_STRING", [-1]),
    "acceptance_rate": ("TYPE_FP32", [1]), "total_accepted_draft_tokens": ("TYPE_INT32", [1]),
    "total_draft_tokens": ("TYPE_INT32", [1]),
}
LLMAPI_MODEL_CODE = "triton_backend/all_models/llmapi/tensorrt_llm/1"  # in a TensorRT-LLM checkout
# The same folder in the pinned image, whose /app holds the checkout's triton_backend/all_models as all_models
# (tensorrtllm_backend r26.04 dockerfile/Dockerfile.triton.trt_llm_backend: WORKDIR /app, COPY .../all_models)
LLMAPI_IMAGE_MODEL_CODE = "all_models/llmapi/tensorrt_llm/1"
IMAGE_APP_DIR = "/app"  # that WORKDIR: the image's copy of the checkout's examples, scripts and all_models
LLMAPI_CODE_FILES = ("model.py", "helpers.py")
