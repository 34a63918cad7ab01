"""A Mixtral-architecture MoE target derived from a dense Llama checkpoint, so an MoE target exists where no MoE
checkpoint can be downloaded. Two methods (target.moe.method):
- upcycle: every expert a copy of the whole dense MLP (build/moe_upcycle.py);
- neuron_split (MoEfication, build/moe_neuron_split.py): each MLP's neurons split into experts that fire together.

Both start from calibration: the dense model reads openly licensed text (text_corpus.py, calibration half) and each
layer's MLP input x (after the post-attention norm) is recorded.

The dense model runs one layer at a time (calibration_layers), so a layer's experts are derived from that layer's
weights alone: a dense Hugging Face checkpoint is read lazily and the MoE written layer by layer
(export_derived_target), holding about one layer, never the model.
"""

from __future__ import annotations

import dataclasses
import random
from collections.abc import Iterator, Mapping
from pathlib import Path

import torch

from specdeploy.build import text_corpus as corpus
from specdeploy.build.checkpoints import Checkpoint
from specdeploy.build.hf_export import export_layers
from specdeploy.build.hf_tensors import HFTensors
from specdeploy.build.moe_neuron_split import split_layer
from specdeploy.build.moe_upcycle import upcycle_layer
from specdeploy.errors import BuildError
from specdeploy.models.config import ModelConfig
from specdeploy.models.kv_cache import KVCache
from specdeploy.models.llama import DecoderLayer, GatedMLP, rotary_table
from specdeploy.spec.pipeline import MoESpec


def through_layer(layer: DecoderLayer, config: ModelConfig, x: torch.Tensor, rotations: torch.Tensor) -> torch.Tensor:
    """x [1, T, H] → [1, T, H]: one sequence through one decoder layer from an empty cache, as LlamaModel.forward
    runs it (causal mask by position, none for a single token). rotations: llama.rotary_table's [2, ≥T, D]."""
    length = x.shape[1]
    positions = torch.arange(length)[None]
    mask = None
    if length > 1:  # [1, T, S] → [1, 1, G*T, S], the grouped query layout of DecoderLayer
        group = config.num_heads // config.num_kv_heads
        mask = (torch.arange(length) <= positions[..., None])[:, None].expand(-1, group, -1, -1)
        mask = mask.reshape(1, 1, -1, length)
    cache = KVCache(1, 1, config.num_kv_heads, length, config.head_dim, torch.float32)
    return layer(x, rotations[:, positions, None], *cache.layer(0), positions, mask, length)


def calibration_layers(config: ModelConfig, tensors: Mapping[str, torch.Tensor],
                       sequences: list[list[int]]) -> Iterator[tuple[dict[str, torch.Tensor], torch.Tensor]]:
    """The dense model (canonical `tensors`, any dtype, read a layer at a time) run over the calibration sequences
    one layer after another, in fp32. Yields, per layer: its weights (fp32) and its MLP's input at every position
    ([P, H], the sequences' positions in order)."""
    embed = tensors["model.embed_tokens.weight"]
    hidden = [embed[torch.tensor(tokens)].float()[None] for tokens in sequences]  # [1, T, H] each
    del embed
    rotations = rotary_table(config, max(len(tokens) for tokens in sequences))
    for index in range(config.num_layers):
        prefix = f"model.layers.{index}"
        state = {name: tensors[name].float() for name in tensors if name.startswith(f"{prefix}.")}
        layer = DecoderLayer(config, state, prefix, torch.float32, GatedMLP(state, f"{prefix}.mlp", torch.float32))
        recorded: list[torch.Tensor] = []

        def record(_module, args: tuple[torch.Tensor], _recorded=recorded) -> None:
            _recorded.append(args[0].reshape(-1, args[0].shape[-1]).float())

        layer.feed_forward.register_forward_pre_hook(record)
        with torch.inference_mode():
            hidden = [through_layer(layer, config, x, rotations) for x in hidden]
        yield state, torch.cat(recorded)


def moe_config(config: ModelConfig, spec: MoESpec) -> ModelConfig:
    """The derived MoE's architecture: the dense model's with `spec.experts` experts per MLP, each the dense MLP's
    size (upcycle) or its share of the neurons (neuron_split)."""
    intermediate_size = config.intermediate_size
    if spec.method == "neuron_split":
        if intermediate_size % spec.experts:
            raise BuildError(f"target.moe.experts: intermediate_size {intermediate_size} does not split into "
                             f"{spec.experts} experts")
        intermediate_size //= spec.experts
    return dataclasses.replace(config, architecture="mixtral", num_experts=spec.experts,
                               intermediate_size=intermediate_size, experts_per_token=spec.experts_per_token)


def derive_layers(config: ModelConfig, tensors: Mapping[str, torch.Tensor], sequences: list[list[int]],
                  spec: MoESpec, router_scale: float | None = None) -> Iterator[dict[str, torch.Tensor]]:
    """Per layer, in order: its weights as the MoE's, canonical names, fp32 (the dense layer's attention and norms,
    and the experts and router in place of its MLP), each derived from that layer's dense weights alone.
    router_scale: None for the method's router; 0 for a zero (uniform) one."""
    for index, (state, x) in enumerate(calibration_layers(config, tensors, sequences)):
        mlp = f"model.layers.{index}.mlp"
        dense = [state[f"{mlp}.{name}_proj.weight"] for name in ("gate", "up", "down")]
        if spec.method == "upcycle":
            layer = upcycle_layer(x, *dense, spec.experts, spec.expert_noise, spec.seed * config.num_layers + index,
                                  router_scale)
        else:
            layer = split_layer(x, *dense, spec.experts, spec.experts_per_token, router_scale)
        kept = {name: tensor for name, tensor in state.items() if ".mlp." not in name}
        yield kept | {f"{mlp}.{name}": tensor for name, tensor in layer.items()}


def derive_moe(config: ModelConfig, state: dict[str, torch.Tensor], sequences: list[list[int]], spec: MoESpec,
               router_scale: float | None = None, dtype: torch.dtype = torch.float32) -> tuple[ModelConfig, dict]:
    """The MoE's config and canonical weights, in `dtype` (each layer cast as it is derived), from a dense Llama's
    (see the module docstring)."""
    derived = moe_config(config, spec)  # first: it refuses a split the dense sizes do not allow
    moe_state = {name: tensor for name, tensor in state.items() if not name.startswith("model.layers.")}
    for layer in derive_layers(config, state, sequences, spec, router_scale):
        moe_state.update({name: tensor.to(dtype) for name, tensor in layer.items()})
    return derived, moe_state


def calibration_sequences(tokenizer, budget: int, max_length: int = 512, seed: int = 0) -> list[list[int]]:
    """Token ids of calibration texts (text_corpus.py's calibration half, in a seeded order) up to `budget` tokens."""
    texts, _ = corpus.calibration_split()
    random.Random(seed).shuffle(texts)
    sequences, total = [], 0
    for text in texts:
        ids = tokenizer.encode(text)[:max_length]
        sequences.append(ids[:budget - total])
        total += len(sequences[-1])
        if total >= budget:
            break
    return sequences


def check_dense(config: ModelConfig, source: str) -> None:
    if config.architecture != "llama":
        raise BuildError(f"target.moe derives an MoE from a dense llama checkpoint, but {source} is a "
                         f"{config.architecture}: remove target.moe to use it as it is")


def derive_target(spec: MoESpec, dense: Checkpoint, source: str, dtype: torch.dtype = torch.float32) -> Checkpoint:
    """The pipeline's MoE target (target.moe) from its dense checkpoint, loaded whole (the torch builder, and GGUF
    or packaged sources, which transformers dequantizes whole; export_derived_target streams a Hugging Face one).
    Its layers are held in `dtype`: an upcycled MoE is E times the dense MLPs."""
    check_dense(dense.config, source)
    sequences = calibration_sequences(dense.tokenizer, spec.calibration_tokens)
    config, state = derive_moe(dense.config, dense.state, sequences, spec, dtype=dtype)
    return Checkpoint(config, state, dense.tokenizer, dense.files)


def export_derived_target(spec: MoESpec, dense: Path | Checkpoint, output: Path, dtype: torch.dtype) -> Path:
    """The pipeline's MoE target derived from its dense checkpoint and written to `output` as a Hugging Face
    directory in `dtype`, one shard per layer, each MoE layer written as soon as it is derived. `dense`: a Hugging Face
    directory, whose weights are read a layer at a time, so memory holds about one layer (its dense and derived
    weights, calibration activations and, for the neuron split, the refit's [I, I] system), not the model; or a
    checkpoint already loaded whole (GGUF and packaged sources), to which the MoE adds about one layer."""
    from transformers import AutoConfig, AutoTokenizer

    if isinstance(dense, Checkpoint):
        config, tokenizer, tensors, source = dense.config, dense.tokenizer, dense.state, "the target checkpoint"
    else:
        config, tokenizer = ModelConfig.from_hf(AutoConfig.from_pretrained(dense)), AutoTokenizer.from_pretrained(dense)
        tensors, source = HFTensors(dense), str(dense)
    check_dense(config, source)
    outside = {name: tensors[name] for name in ["model.embed_tokens.weight", "model.norm.weight"] +
               ([] if config.tie_word_embeddings else ["lm_head.weight"])}  # mapped, not copied
    layers = derive_layers(config, tensors, calibration_sequences(tokenizer, spec.calibration_tokens), spec)
    return export_layers(moe_config(config, spec), layers, outside, tokenizer, output, dtype)
