"""The upstream command-line flags the trtllm build plan may use, as TensorRT-LLM 1.2.x defines them. Tests check
every flag a plan emits against these tables, so a typo or a flag of another release fails here, not on a GPU.
Sources (NVIDIA/TensorRT-LLM; see docs/trtllm-upstream.md for the versions read): the values are each flag's
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

# examples/medusa/convert_checkpoint.py
MEDUSA_CONVERT_FLAGS: dict[str, tuple[str, ...] | str | None] = {
    "--model_dir": None, "--medusa_model_dir": None, "--output_dir": None,
    "--dtype": ("float32", "bfloat16", "float16"), "--num_medusa_heads": None, "--num_medusa_layers": None,
    "--max_medusa_token_len": None, "--tp_size": None, "--pp_size": None, "--workers": None,
}

# examples/models/core/llama/convert_checkpoint.py, whose flags builders/trtllm_convert.py keeps
LLAMA_CONVERT_FLAGS: dict[str, tuple[str, ...] | str | None] = {
    "--model_dir": None, "--output_dir": None, "--dtype": ("auto", "float16", "bfloat16", "float32"),
    "--tp_size": None, "--pp_size": None, "--moe_tp_size": None, "--moe_ep_size": None,
    "--use_weight_only": "switch",
    "--weight_only_precision": ("int8", "int4", "int8_gptq", "int4_gptq", "int4_awq"),
}
