"""A model as a Hugging Face checkpoint directory, the input TensorRT-LLM's converters read: a LlamaForCausalLM, or
for an MoE a MixtralForCausalLM written per expert (`block_sparse_moe.gate`, `block_sparse_moe.experts.N.w1|w2|w3`),
which is the layout transformers 5 saves Mixtral in and the one TensorRT-LLM 1.2's Mixtral conversion reads."""

from __future__ import annotations

from pathlib import Path

import torch
from safetensors.torch import load_file

from specdeploy.errors import SpecdeployError
from specdeploy.models.config import ModelConfig
from specdeploy.models.registry import component_config


def hf_model_class(config: ModelConfig) -> type:
    """The transformers class of a component's architecture: MixtralForCausalLM or LlamaForCausalLM."""
    from transformers import LlamaForCausalLM, MixtralForCausalLM

    return MixtralForCausalLM if config.architecture == "mixtral" else LlamaForCausalLM


def export_model(config: ModelConfig, state: dict[str, torch.Tensor], tokenizer, output: Path,
                 dtype: torch.dtype = torch.bfloat16, source: str = "model") -> Path:
    """Write weights under our canonical names (`state`, with `config`) and the tokenizer to `output` as a Hugging
    Face directory in `dtype`; `source` names them in errors."""
    family = hf_model_class(config)
    model = family(config.to_hf())
    missing, unexpected = model.load_state_dict(state, strict=False)
    expected_missing = ["lm_head.weight"] if config.tie_word_embeddings else []
    if sorted(missing) != expected_missing or unexpected:
        raise SpecdeployError(f"{source}: weights do not match a {family.__name__} (missing {missing[:3]}, "
                              f"unexpected {unexpected[:3]})")
    if config.tie_word_embeddings:
        model.tie_weights()
    model.to(dtype).save_pretrained(output)
    tokenizer.save_pretrained(output)
    return output


def export_hf(component: Path, output: Path, dtype: torch.dtype = torch.bfloat16) -> Path:
    """Write `component` (an engine's target/ or draft/) to `output` as a Hugging Face directory in `dtype`."""
    from transformers import AutoTokenizer

    config, _ = component_config(component)
    if config.quantization is not None:
        raise SpecdeployError(f"{component}: a quantized component ({config.quantization['method']}); export the "
                              f"model it was quantized from")
    state = load_file(str(component / "model.safetensors"))
    return export_model(config, state, AutoTokenizer.from_pretrained(component), output, dtype, str(component))
