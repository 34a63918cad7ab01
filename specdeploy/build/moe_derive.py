"""A Mixtral-architecture MoE derived from a dense Llama checkpoint (MoEfication), so an MoE target exists where
no MoE checkpoint can be downloaded.

1. Calibration: the dense model reads openly licensed text (text_corpus.py, calibration half) and each layer's MLP
   input x (after the post-attention norm) is recorded; its neurons' activations are a = silu(gate x) * (up x).
2. Experts: each layer's I neurons are split into E groups of I/E neurons that fire together (balanced k-means
   over the neurons' activation profiles |a| across the calibration positions), so a token's activation mass
   gathers in few experts. Expert e keeps its neurons' rows of gate (w1) and up (w3) and columns of down (w2).
3. Router: expert e's contribution to a token's output, ||w2_e a_e||, is fitted by least squares as a linear
   function of x (Mixtral's router has no bias); a token goes to the k experts with the highest scores.
4. Weights: the dense MLP sums every expert's output with weight one, while Mixtral renormalises the top k
   softmax weights to sum to one. So the router's scores are scaled down until its softmax is nearly uniform
   (the top-k weights stay within about 1% of 1/k; the ranking, and so the choice, is unchanged) and every w2 is
   multiplied by k. With k = E and a zero router every weight is exactly 1/E and the MoE computes the dense MLP.

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
import torch.nn.functional as F

from specdeploy.build import text_corpus as corpus
from specdeploy.build.checkpoints import Checkpoint
from specdeploy.build.hf_export import export_layers
from specdeploy.build.hf_tensors import HFTensors
from specdeploy.errors import BuildError
from specdeploy.models.config import ModelConfig
from specdeploy.models.kv_cache import KVCache
from specdeploy.models.llama import DecoderLayer, GatedMLP, rotary_table
from specdeploy.spec.pipeline import MoESpec

ROUTER_LOGIT_STD = 0.01  # the router's logits' spread after scaling: softmax weights within ~1% of uniform
KMEANS_ITERATIONS = 12


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


def balanced_assignment(similarity: torch.Tensor, group_size: int) -> torch.Tensor:
    """similarity [I, E] → group [I]: each item's group, every group exactly group_size items, taking the most
    similar (item, group) pairs first."""
    items, groups = similarity.shape
    group = [-1] * items  # plain lists: this loop visits up to items * groups pairs
    filled = [0] * groups
    placed = 0
    for flat in similarity.flatten().argsort(descending=True).tolist():
        item, g = divmod(flat, groups)
        if group[item] < 0 and filled[g] < group_size:
            group[item] = g
            filled[g] += 1
            placed += 1
            if placed == items:
                break
    return torch.tensor(group)


def cluster_neurons(activations: torch.Tensor, num_experts: int, seed: int = 0) -> list[torch.Tensor]:
    """activations: [P, I] → num_experts index tensors of I / num_experts neurons each, neurons with similar
    activation profiles together (balanced spherical k-means)."""
    profiles = F.normalize(activations.abs().T, dim=1)  # [I, P]
    size = profiles.shape[0] // num_experts
    generator = torch.Generator().manual_seed(seed)
    centroids = profiles[torch.randperm(profiles.shape[0], generator=generator)[:num_experts]]
    for _ in range(KMEANS_ITERATIONS):
        group = balanced_assignment(profiles @ centroids.T, size)
        centroids = F.normalize(torch.stack([profiles[group == g].mean(0) for g in range(num_experts)]), dim=1)
    return [torch.nonzero(group == g).flatten() for g in range(num_experts)]


def refit_down(activations: torch.Tensor, down: torch.Tensor, groups: list[torch.Tensor], chosen: torch.Tensor,
               ridge: float = 0.01) -> torch.Tensor:
    """down [H, I] refitted so that, on the calibration positions, the chosen experts' neurons alone (chosen
    [P, k] expert indices) reproduce the dense MLP's output as closely as possible (ridge least squares pulled
    toward the dense weights): the kept experts make up for the dropped ones' average contribution."""
    neuron_expert = torch.empty(down.shape[1], dtype=torch.long)
    for expert, neurons in enumerate(groups):
        neuron_expert[neurons] = expert
    kept = torch.zeros(activations.shape[0], len(groups), dtype=torch.bool).scatter_(1, chosen, True)
    sparse = activations * kept[:, neuron_expert]  # [P, I]
    gram = sparse.T @ sparse
    strength = ridge * gram.diagonal().mean()
    rhs = sparse.T @ (activations @ down.T) + strength * down.T  # [I, H]
    solved = torch.linalg.solve(gram + strength * torch.eye(gram.shape[0]), rhs)
    return solved.T.contiguous()


def derive_layer(x: torch.Tensor, gate: torch.Tensor, up: torch.Tensor, down: torch.Tensor, num_experts: int,
                 experts_per_token: int, router_scale: float | None) -> dict[str, torch.Tensor]:
    """One layer's MoE tensors (under transformers 5's packed names, relative to `mlp.`) from its dense MLP
    (gate, up [I, H], down [H, I]) and calibration inputs x [P, H]. router_scale: None scales the fitted router
    to ROUTER_LOGIT_STD; 0 gives a zero (uniform) router."""
    activations = F.silu(x @ gate.T) * (x @ up.T)  # [P, I]
    groups = cluster_neurons(activations, num_experts)
    contribution = torch.stack([(activations[:, g] @ down[:, g].T).norm(dim=-1) for g in groups], dim=1)  # [P, E]
    router = torch.linalg.lstsq(x, contribution).solution.T  # [E, H]
    if experts_per_token < num_experts:
        down = refit_down(activations, down, groups, (x @ router.T).topk(experts_per_token, dim=-1).indices)
    if router_scale is None:
        router = router * (ROUTER_LOGIT_STD / (x @ router.T).std().clamp(min=1e-12))
    else:
        router = router * router_scale
    return {"gate.weight": router.contiguous(),
            "experts.gate_up_proj": torch.stack([torch.cat([gate[g], up[g]]) for g in groups]),
            "experts.down_proj": torch.stack([down[:, g] * experts_per_token for g in groups])}


def moe_config(config: ModelConfig, num_experts: int, experts_per_token: int) -> ModelConfig:
    """The derived MoE's architecture: the dense model's, each MLP split into num_experts experts."""
    if config.intermediate_size % num_experts:
        raise BuildError(f"target.moe.experts: intermediate_size {config.intermediate_size} does not split into "
                         f"{num_experts} experts")
    return dataclasses.replace(config, architecture="mixtral", num_experts=num_experts,
                               intermediate_size=config.intermediate_size // num_experts,
                               experts_per_token=experts_per_token)


def derive_layers(config: ModelConfig, tensors: Mapping[str, torch.Tensor], sequences: list[list[int]],
                  num_experts: int, experts_per_token: int,
                  router_scale: float | None = None) -> Iterator[dict[str, torch.Tensor]]:
    """Per layer, in order: its weights as the MoE's, canonical names, fp32 (the dense layer's attention and norms,
    and the experts and router in place of its MLP), each derived from that layer's dense weights alone."""
    for index, (state, x) in enumerate(calibration_layers(config, tensors, sequences)):
        mlp = f"model.layers.{index}.mlp"
        layer = derive_layer(x, state[f"{mlp}.gate_proj.weight"], state[f"{mlp}.up_proj.weight"],
                             state[f"{mlp}.down_proj.weight"], num_experts, experts_per_token, router_scale)
        kept = {name: tensor for name, tensor in state.items() if ".mlp." not in name}
        yield kept | {f"{mlp}.{name}": tensor for name, tensor in layer.items()}


def derive_moe(config: ModelConfig, state: dict[str, torch.Tensor], sequences: list[list[int]], num_experts: int,
               experts_per_token: int, router_scale: float | None = None) -> tuple[ModelConfig, dict]:
    """The MoE's config and canonical fp32 weights from a dense Llama's (see the module docstring)."""
    derived = moe_config(config, num_experts, experts_per_token)
    moe_state = {name: tensor for name, tensor in state.items() if not name.startswith("model.layers.")}
    for layer in derive_layers(config, state, sequences, num_experts, experts_per_token, router_scale):
        moe_state.update(layer)
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


def derive_target(spec: MoESpec, dense: Checkpoint, source: str) -> Checkpoint:
    """The pipeline's MoE target (target.moe) from its dense checkpoint, loaded whole (the torch builder, and GGUF
    or packaged sources, which transformers dequantizes whole; export_derived_target streams a Hugging Face one)."""
    check_dense(dense.config, source)
    sequences = calibration_sequences(dense.tokenizer, spec.calibration_tokens)
    config, state = derive_moe(dense.config, dense.state, sequences, spec.experts, spec.experts_per_token)
    return Checkpoint(config, state, dense.tokenizer, dense.files)


def export_derived_target(spec: MoESpec, directory: Path, output: Path, dtype: torch.dtype) -> Path:
    """The pipeline's MoE target derived from the dense Hugging Face checkpoint at `directory` and written to `output`
    as a Hugging Face directory in `dtype`, one shard per layer: the dense weights are read a layer at a time and
    each MoE layer is written as soon as it is derived, so memory holds about one layer (its dense and derived
    weights, calibration activations and the refit's [I, I] system), not the model."""
    from transformers import AutoConfig, AutoTokenizer

    config = ModelConfig.from_hf(AutoConfig.from_pretrained(directory))
    check_dense(config, str(directory))
    derived = moe_config(config, spec.experts, spec.experts_per_token)
    tokenizer = AutoTokenizer.from_pretrained(directory)
    tensors = HFTensors(directory)
    outside = tensors.read(["model.embed_tokens.weight", "model.norm.weight"] +
                           ([] if config.tie_word_embeddings else ["lm_head.weight"]))  # mapped, not copied
    layers = derive_layers(config, tensors, calibration_sequences(tokenizer, spec.calibration_tokens), spec.experts,
                           spec.experts_per_token)
    return export_layers(derived, layers, outside, tokenizer, output, dtype)
