"""The EAGLE-3 draft head: one decoder layer fed by the target's own hidden states.

At position t the head reads the target's hidden states entering three of its layers (low, middle, high: the
"features" f_t, [3H]) and the embedding of the token that follows, x_(t+1). `fc` maps the features to [H]; the
layer's attention takes [norm(embedding), norm(fc(features))] side by side ([2H]) and the fc output is the residual.
Its output after the final norm gives logits over a reduced draft vocabulary (draft id i is target id
i + d2t[i]); its output before that norm stands in for the features at the next drafting step, where the target
has not run yet.

Positions: the pair (f_t, x_(t+1)) sits at position t, and drafting depth k + 1 below it at position t + k, as the
official trainer (SafeAILab/EAGLE eagle/traineagle3/cnets.py@cb7e0841fe0c) and vLLM place them.

Files are what vLLM's and SGLang's EAGLE-3 loaders read (a folder with config.json and model.safetensors):
- vLLM vllm/model_executor/models/llama_eagle3.py (v0.11.0, and v0.34.0): `fc.weight` [H, 3H]; `midlayer.*`
  (renamed to layers.0: input_layernorm, hidden_norm, self_attn.{q,k,v,o}_proj with q/k/v over 2H inputs,
  post_attention_layernorm, mlp.{gate,up,down}_proj); `norm.weight`; `lm_head.weight` [draft_vocab, H]; `d2t`
  [draft_vocab] int64 offsets (target id = draft id + d2t[draft id]); `t2d` [vocab] bool, skipped by the loader.
  The embedding is the target's.
- SGLang python/sglang/srt/models/llama_eagle3.py (v0.5.3): the same names; d2t becomes its hot-token map.
- config.json: `architectures: ["LlamaForCausalLMEagle3"]`, Llama dimensions for the one layer, `draft_vocab_size`,
  `target_hidden_size`. Which target layers feed the head: without a key, vLLM and SGLang both take the hidden
  states entering layers 2, L // 2 and L - 3 (what train-eagle trains, so it writes no key). SGLang and SpecForge
  write `eagle_config.eagle_aux_hidden_state_layer_ids` as layer *outputs* (SGLang's llama.py adds 1 when it reads
  it); vLLM v0.34.0 reads a top-level `eagle_aux_hidden_state_layer_ids` as layer inputs, and v0.11.0 reads neither.
  So a head with other layers is written with the top-level key, and reading accepts all three forms.
- SGLang v0.5.3 wants a draft vocabulary that is a multiple of 64 (train-eagle's default, 3072, is).
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.nn.functional as F
from safetensors.torch import load_file, save_file
from torch import nn

from specdeploy.errors import SpecdeployError

WEIGHTS_FILE = "model.safetensors"
CONFIG_FILE = "config.json"
REPORT_FILE = "training.json"  # train-eagle's held-out report, copied by the build
ARCHITECTURE = "LlamaForCausalLMEagle3"


def default_feature_layers(num_layers: int) -> tuple[int, int, int]:
    """vLLM's and SGLang's default capture for a target of `num_layers` layers."""
    return (2, num_layers // 2, num_layers - 3)


@dataclass(frozen=True)
class EagleConfig:
    hidden_size: int
    intermediate_size: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    vocab_size: int  # the target's
    draft_vocab_size: int
    feature_layers: tuple[int, ...]  # the target layers whose input hidden states the head reads, low to high
    rms_norm_eps: float = 1e-5
    rope_theta: float = 10000.0
    max_position_embeddings: int = 2048
    target_num_layers: int | None = None  # the target's depth when known (not in the file): is the capture default?

    def __post_init__(self) -> None:
        object.__setattr__(self, "feature_layers", tuple(self.feature_layers))
        if len(self.feature_layers) != 3:
            raise SpecdeployError(f"an EAGLE-3 head reads three target layers, this config names "
                                  f"{list(self.feature_layers)}")
        if not 0 < self.draft_vocab_size <= self.vocab_size:
            raise SpecdeployError(f"draft_vocab_size must be in [1, vocab_size ({self.vocab_size})], got "
                                  f"{self.draft_vocab_size}")
        if self.num_heads % self.num_kv_heads:
            raise SpecdeployError(f"num_attention_heads ({self.num_heads}) must be a multiple of "
                                  f"num_key_value_heads ({self.num_kv_heads})")

    def to_hf(self) -> dict:
        """config.json as the ecosystem's EAGLE-3 loaders read it."""
        data = {"architectures": [ARCHITECTURE], "model_type": "llama", "hidden_size": self.hidden_size,
                "target_hidden_size": self.hidden_size,
                "intermediate_size": self.intermediate_size, "num_hidden_layers": 1,
                "num_attention_heads": self.num_heads, "num_key_value_heads": self.num_kv_heads,
                "head_dim": self.head_dim, "vocab_size": self.vocab_size, "draft_vocab_size": self.draft_vocab_size,
                "rms_norm_eps": self.rms_norm_eps, "rope_theta": self.rope_theta,
                "max_position_embeddings": self.max_position_embeddings, "hidden_act": "silu",
                "tie_word_embeddings": False, "torch_dtype": "bfloat16"}
        if self.target_num_layers is None or \
                self.feature_layers != default_feature_layers(self.target_num_layers):
            data["eagle_aux_hidden_state_layer_ids"] = list(self.feature_layers)  # inputs, as vLLM v0.34 reads it
        return data

    @staticmethod
    def from_hf(data: dict, target_layers: int | None = None, source: str = CONFIG_FILE) -> EagleConfig:
        """From config.json (a head trained here or a published one). target_layers: for vLLM's default capture
        when the file names none."""
        try:
            layers = named_feature_layers(data)
            if layers is None:
                if target_layers is None:
                    raise SpecdeployError(f"{source}: names no target layers to read, and the target's depth is "
                                          f"not known here for the default (2, L // 2, L - 3)")
                layers = default_feature_layers(target_layers)
            if data.get("num_hidden_layers", 1) != 1:
                raise SpecdeployError(f"{source}: an EAGLE-3 head has one decoder layer, this one has "
                                      f"{data['num_hidden_layers']}")
            heads = data["num_attention_heads"]
            return EagleConfig(hidden_size=data["hidden_size"], intermediate_size=data["intermediate_size"],
                               num_heads=heads, num_kv_heads=data.get("num_key_value_heads", heads),
                               head_dim=data.get("head_dim") or data["hidden_size"] // heads,
                               vocab_size=data["vocab_size"],
                               draft_vocab_size=data.get("draft_vocab_size") or data["vocab_size"],
                               feature_layers=tuple(layers), rms_norm_eps=data.get("rms_norm_eps", 1e-5),
                               rope_theta=data.get("rope_theta", 10000.0),
                               max_position_embeddings=data.get("max_position_embeddings", 2048),
                               target_num_layers=target_layers)
        except KeyError as exc:
            raise SpecdeployError(f"{source}: not an EAGLE-3 config, {exc.args[0]!r} is missing") from None


def named_feature_layers(data: dict) -> list[int] | None:
    """The target layers whose input hidden states a head's config.json names (the module docstring: vLLM v0.34's
    top-level key names inputs, SGLang's eagle_config key names outputs), or None when it names none."""
    layers = data.get("eagle_aux_hidden_state_layer_ids")
    if layers is not None:
        return list(layers)
    outputs = (data.get("eagle_config") or {}).get("eagle_aux_hidden_state_layer_ids")
    return None if outputs is None else [layer + 1 for layer in outputs]


# Tensor name → shape, from the config (what `from_state` checks a file against).
def expected_shapes(c: EagleConfig) -> dict[str, tuple[int, ...]]:
    h, q, kv = c.hidden_size, c.num_heads * c.head_dim, c.num_kv_heads * c.head_dim
    return {"fc.weight": (h, 3 * h), "midlayer.input_layernorm.weight": (h,), "midlayer.hidden_norm.weight": (h,),
            "midlayer.self_attn.q_proj.weight": (q, 2 * h), "midlayer.self_attn.k_proj.weight": (kv, 2 * h),
            "midlayer.self_attn.v_proj.weight": (kv, 2 * h), "midlayer.self_attn.o_proj.weight": (h, q),
            "midlayer.post_attention_layernorm.weight": (h,),
            "midlayer.mlp.gate_proj.weight": (c.intermediate_size, h),
            "midlayer.mlp.up_proj.weight": (c.intermediate_size, h),
            "midlayer.mlp.down_proj.weight": (h, c.intermediate_size), "norm.weight": (h,),
            "lm_head.weight": (c.draft_vocab_size, h)}


@dataclass
class Projected:
    """One drafting step's attention inputs: q [B, T, heads, D], k and v [B, kv_heads, T, D] (rotated), and the
    residual stream [B, T, H]."""

    q: torch.Tensor
    k: torch.Tensor
    v: torch.Tensor
    residual: torch.Tensor


class Eagle3Head(nn.Module):
    """The head's weights under the files' names ('midlayer.' dropped from attribute paths) and its math, in pieces
    that training (several drafting steps over whole sequences) and drafting (one step over a tree's frontier with
    a KV cache) share: `project`, attention by the caller, then `finish`."""

    def __init__(self, config: EagleConfig, tensors: dict[str, torch.Tensor] | None = None) -> None:
        super().__init__()
        self.config = config
        shapes = expected_shapes(config)
        self.weights = nn.ParameterDict()
        for name, shape in shapes.items():
            if tensors is not None:
                value = tensors[name].float()
            elif name.endswith("norm.weight"):
                value = torch.ones(shape)
            else:
                value = torch.empty(shape)
                nn.init.normal_(value, std=0.02)
            self.weights[name.replace(".", "__")] = nn.Parameter(value)
        d2t = tensors["d2t"] if tensors is not None else torch.zeros(config.draft_vocab_size, dtype=torch.long)
        self.register_buffer("d2t", d2t.long().clone())
        self.fused: nn.ModuleDict | None = None  # for_drafting's fused matrices
        self.register_buffer("rotations", _rotary(config, config.max_position_embeddings), persistent=False)

    def cover_positions(self, length: int) -> None:
        """Rotary angles for positions up to `length` (a cache longer than the config's max positions)."""
        if length > self.rotations.shape[1]:
            self.rotations = _rotary(self.config, length).to(self.rotations.device)

    def w(self, name: str) -> torch.Tensor:
        return self.weights[name.replace(".", "__")]

    def for_drafting(self, dtype: torch.dtype) -> Eagle3Head:
        """Frozen in `dtype`, with the drafting forward's matrices fused (q, k and v; gate and up) and, for bf16 on a
        CPU, prepacked for oneDNN as the target's are (models/llama.DenseLinear): a drafting step is a few one-row
        matmuls, where launch counts and packing matter."""
        from specdeploy.models.llama import DenseLinear

        self.to(dtype).requires_grad_(False)
        groups = {"fc": ["fc"], "qkv": ["midlayer.self_attn.q_proj", "midlayer.self_attn.k_proj",
                                        "midlayer.self_attn.v_proj"],
                  "o": ["midlayer.self_attn.o_proj"], "gate_up": ["midlayer.mlp.gate_proj", "midlayer.mlp.up_proj"],
                  "down": ["midlayer.mlp.down_proj"], "lm_head": ["lm_head"]}
        self.fused = nn.ModuleDict({key: DenseLinear(torch.cat([self.w(f"{name}.weight") for name in names]).detach())
                                    for key, names in groups.items()})
        for linear in self.fused.values():
            linear.prepack()
        return self

    def linear(self, key: str, names: list[str], x: torch.Tensor) -> torch.Tensor:
        """x through the matrices `names` side by side: the fused drafting copy `key` when there is one."""
        if self.fused is not None:
            return self.fused[key].forward(x)
        return torch.cat([F.linear(x, self.w(f"{name}.weight").to(x.dtype)) for name in names], dim=-1)

    @property
    def draft_to_target(self) -> torch.Tensor:
        """[draft_vocab] long: the target id of each draft id."""
        return torch.arange(len(self.d2t), device=self.d2t.device) + self.d2t

    def set_draft_vocabulary(self, target_ids: torch.Tensor) -> None:
        """Use these target ids [draft_vocab] (ascending) as the draft vocabulary."""
        self.d2t.copy_(target_ids.long() - torch.arange(len(target_ids)))

    def norm(self, x: torch.Tensor, name: str) -> torch.Tensor:
        return F.rms_norm(x, (x.shape[-1],), self.w(name).to(x.dtype), self.config.rms_norm_eps)

    def fuse_features(self, features: torch.Tensor) -> torch.Tensor:
        """features: [..., 3H], the target's three captured hidden states → [..., H]."""
        return self.linear("fc", ["fc"], features)

    def project(self, embeds: torch.Tensor, hidden: torch.Tensor, positions: torch.Tensor) -> Projected:
        """embeds: [B, T, H] (the next tokens' target embeddings); hidden: [B, T, H] (fused features, or the
        previous step's `finish` prenorm output); positions: [B, T] long."""
        c = self.config
        x = torch.cat([self.norm(embeds, "midlayer.input_layernorm.weight"),
                       self.norm(hidden, "midlayer.hidden_norm.weight")], dim=-1)
        batch, length, _ = x.shape
        dtype = x.dtype
        qkv = self.linear("qkv", [f"midlayer.self_attn.{n}_proj" for n in "qkv"], x)
        qkv = qkv.view(batch, length, c.num_heads + 2 * c.num_kv_heads, c.head_dim)
        q, k, v = qkv.split([c.num_heads, c.num_kv_heads, c.num_kv_heads], dim=2)
        cos, sin = self.rotations[:, positions, None].to(dtype)  # [B, T, 1, D] each
        q = q * cos + _rotate_half(q) * sin
        k = k * cos + _rotate_half(k) * sin
        return Projected(q, k.transpose(1, 2), v.transpose(1, 2), hidden)

    def attend(self, q: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
        """q: [B, T, heads, D]; keys, values: [B, kv_heads, S, D]; mask: [B, T, S] bool → [B, T, heads * D]."""
        out = F.scaled_dot_product_attention(q.transpose(1, 2), keys, values, attn_mask=mask[:, None], enable_gqa=True)
        return out.transpose(1, 2).flatten(2)

    def finish(self, attended: torch.Tensor, residual: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """attended: [B, T, heads * D] → (normed [B, T, H] for `logits`, prenorm [B, T, H] for the next step)."""
        x = residual + self.linear("o", ["midlayer.self_attn.o_proj"], attended)
        h = self.norm(x, "midlayer.post_attention_layernorm.weight")
        gate, up = self.linear("gate_up", ["midlayer.mlp.gate_proj", "midlayer.mlp.up_proj"], h).chunk(2, dim=-1)
        x = x + self.linear("down", ["midlayer.mlp.down_proj"], F.silu(gate) * up)
        return self.norm(x, "norm.weight"), x

    def logits(self, normed: torch.Tensor) -> torch.Tensor:
        """normed: [..., H] → fp32 logits over the draft vocabulary [..., draft_vocab]."""
        return self.linear("lm_head", ["lm_head"], normed).float()

    # ---- files ---------------------------------------------------------------------------------------------
    def state(self, dtype: torch.dtype = torch.bfloat16) -> dict[str, torch.Tensor]:
        """The tensors under the files' names; t2d as the loaders expect it beside d2t."""
        tensors = {name: self.w(name).detach().to(dtype).contiguous() for name in expected_shapes(self.config)}
        tensors["d2t"] = self.d2t.clone()
        t2d = torch.zeros(self.config.vocab_size, dtype=torch.bool)
        t2d[self.draft_to_target.cpu()] = True
        tensors["t2d"] = t2d
        return tensors

    def save(self, directory: Path, dtype: torch.dtype = torch.bfloat16) -> None:
        directory.mkdir(parents=True, exist_ok=True)
        save_file(self.state(dtype), str(directory / WEIGHTS_FILE))
        (directory / CONFIG_FILE).write_text(json.dumps(self.config.to_hf(), indent=2) + "\n")

    @staticmethod
    def from_state(config: EagleConfig, tensors: dict[str, torch.Tensor], source: str = "head") -> Eagle3Head:
        """SpecdeployError names a missing or misshapen tensor."""
        for name, shape in {**expected_shapes(config), "d2t": (config.draft_vocab_size,)}.items():
            if name not in tensors:
                raise SpecdeployError(f"{source}: no tensor {name!r} (an EAGLE-3 head as vLLM and SGLang load it)")
            if tuple(tensors[name].shape) != shape:
                raise SpecdeployError(f"{source}: {name} is {list(tensors[name].shape)}, the config makes it "
                                      f"{list(shape)}")
        head = Eagle3Head(config, tensors)
        targets = head.draft_to_target
        if targets.min() < 0 or targets.max() >= config.vocab_size:
            raise SpecdeployError(f"{source}: d2t maps draft ids outside the target's {config.vocab_size} tokens")
        return head

    @staticmethod
    def load(directory: Path, target_layers: int | None = None) -> Eagle3Head:
        if not (directory / WEIGHTS_FILE).is_file() or not (directory / CONFIG_FILE).is_file():
            raise SpecdeployError(f"{directory}: no EAGLE-3 head ({CONFIG_FILE} and {WEIGHTS_FILE}; train one with "
                                  f"specdeploy train-eagle)")
        config = EagleConfig.from_hf(json.loads((directory / CONFIG_FILE).read_text()), target_layers,
                                     str(directory / CONFIG_FILE))
        return Eagle3Head.from_state(config, load_file(str(directory / WEIGHTS_FILE)), str(directory))


def _rotary(config: EagleConfig, length: int) -> torch.Tensor:
    """[2, length, head_dim] fp32: cos and sin for the rotate-half layout of Hugging Face Llama."""
    inv_freq = 1.0 / config.rope_theta ** (torch.arange(0, config.head_dim, 2).float() / config.head_dim)
    angles = torch.outer(torch.arange(length).float(), inv_freq).repeat(1, 2)
    return torch.stack([angles.cos(), angles.sin()])


def _rotate_half(x: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    return torch.cat([-x[..., half:], x[..., :half]], dim=-1)
