"""A model as a Hugging Face checkpoint directory, the input TensorRT-LLM's converters read: a LlamaForCausalLM, or
for an MoE a MixtralForCausalLM written per expert (`block_sparse_moe.gate`, `block_sparse_moe.experts.N.w1|w2|w3`),
which is the layout transformers 5 saves Mixtral in and the one TensorRT-LLM 1.2's Mixtral conversion reads.

Two writers: export_model from weights held whole (a GGUF or packaged source, which transformers dequantizes whole,
or an engine's component), through a transformers model; export_layers from weights that come a layer at a time
(an MoE derived from a Hugging Face checkpoint), one shard per layer, never holding the model.
"""

from __future__ import annotations

import json
from collections.abc import Iterable
from dataclasses import replace
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file

from specdeploy.build.hf_tensors import INDEX_FILE
from specdeploy.errors import SpecdeployError
from specdeploy.models.config import ModelConfig
from specdeploy.models.registry import component_config

EMBEDDINGS = "model.embed_tokens.weight"  # the Hugging Face name of a Llama's (and Mixtral's) input embeddings


def hf_model_class(config: ModelConfig) -> type:
    """The transformers class of a component's architecture: MixtralForCausalLM or LlamaForCausalLM."""
    from transformers import LlamaForCausalLM, MixtralForCausalLM

    return MixtralForCausalLM if config.architecture == "mixtral" else LlamaForCausalLM


def untied(config: ModelConfig, state: dict[str, torch.Tensor]) -> tuple[ModelConfig, dict[str, torch.Tensor]]:
    """A tied model as an untied one: `lm_head.weight` a copy of the embeddings, `tie_word_embeddings` false. The
    same function, for readers that look the head up by name among a model's parameters, where transformers lists a
    tied head only once, under the embeddings (TensorRT-LLM's Medusa converter: build/trtllm/plan.py)."""
    if not config.tie_word_embeddings:
        return config, state
    return replace(config, tie_word_embeddings=False), {**state, "lm_head.weight": state[EMBEDDINGS].clone()}


def export_model(config: ModelConfig, state: dict[str, torch.Tensor], tokenizer, output: Path,
                 dtype: torch.dtype = torch.bfloat16, source: str = "model", untie: bool = False) -> Path:
    """Write weights under our canonical names (`state`, with `config`) and the tokenizer to `output` as a Hugging
    Face directory in `dtype`; `source` names them in errors; `untie` writes a tied model untied (`untied`). It
    builds a transformers model of them, so memory holds the fp32 state and the model's own fp32 copy before it is
    cast: about four times the model's bf16 size (measured by scripts/measure_build_memory.py: docs/benchmarks.md,
    "Build memory"), which is why only sources loaded whole anyway come here."""
    if untie:
        config, state = untied(config, state)
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


def hf_names(name: str, tensor: torch.Tensor) -> dict[str, torch.Tensor]:
    """A canonical tensor under the names a Hugging Face checkpoint stores it, as transformers saves a Mixtral: the
    router `mlp.gate` as `block_sparse_moe.gate`, expert e's rows of the packed `gate_up_proj` [E, 2I, H] as w1 (gate)
    and w3 (up), its `down_proj` [E, H, I] as w2; every other tensor as it is."""
    prefix, dot, rest = name.partition(".mlp.")
    if not dot or rest not in ("gate.weight", "experts.gate_up_proj", "experts.down_proj"):
        return {name: tensor}
    moe = f"{prefix}.block_sparse_moe"
    if rest == "gate.weight":
        return {f"{moe}.gate.weight": tensor}
    if rest == "experts.down_proj":
        return {f"{moe}.experts.{e}.w2.weight": expert for e, expert in enumerate(tensor)}
    named = {}
    for e, expert in enumerate(tensor):
        gate, up = expert.chunk(2)
        named |= {f"{moe}.experts.{e}.w1.weight": gate, f"{moe}.experts.{e}.w3.weight": up}
    return named


def export_layers(config: ModelConfig, layers: Iterable[dict[str, torch.Tensor]], outside: dict[str, torch.Tensor],
                  tokenizer, output: Path, dtype: torch.dtype = torch.bfloat16) -> Path:
    """Write a Hugging Face directory shard by shard: each of `layers` (config.num_layers dicts of canonical weights,
    one decoder layer each, consumed as they come) to its own safetensors file, then `outside` (the embeddings, final
    norm and head), with model.safetensors.index.json, config.json and the tokenizer. Memory holds one layer's
    tensors at a time (plus their `dtype` copy while written)."""
    from transformers import GenerationConfig

    output = Path(output)
    output.mkdir(parents=True)
    count = config.num_layers + 1
    weight_map, total = {}, 0

    def write(number: int, tensors: dict[str, torch.Tensor]) -> None:
        nonlocal total
        shard = {hf: tensor.to(dtype).contiguous() for name, canonical in tensors.items()
                 for hf, tensor in hf_names(name, canonical).items()}
        file = f"model-{number:05d}-of-{count:05d}.safetensors"
        save_file(shard, str(output / file), metadata={"format": "pt"})
        weight_map.update(dict.fromkeys(shard, file))
        total += sum(tensor.numel() * tensor.element_size() for tensor in shard.values())

    written = 0
    for written, layer in enumerate(layers, 1):
        write(written, layer)
    if written != config.num_layers:
        raise SpecdeployError(f"{output}: {written} layers came for a model of {config.num_layers}")
    write(count, outside)
    (output / INDEX_FILE).write_text(json.dumps({"metadata": {"total_size": total},
                                                 "weight_map": dict(sorted(weight_map.items()))}, indent=2))
    hf_config = config.to_hf()
    hf_config.architectures = [hf_model_class(config).__name__]
    hf_config.dtype = dtype
    hf_config.save_pretrained(output)
    GenerationConfig.from_model_config(hf_config).save_pretrained(output)  # as a model's save_pretrained writes it
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
