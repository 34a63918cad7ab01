"""Llama-architecture decoder in plain torch.

The model receives the KV cache, it does not own it. `forward` takes arbitrary positions, cache slots and an
attention mask, so one call can verify a chain or a tree of drafted tokens; it returns the final hidden states and
`logits` projects them, so callers pay the vocabulary projection only where they need it.

Weights use the canonical (Hugging Face Llama) names. A linear layer is stored either dense (`<name>.weight`) or
as int4 groups (`<name>.codes`, `<name>.scales`, `<name>.minimums`) or int8 rows (`<name>.int8`,
`<name>.row_scales`) or, for a draft's vocabulary head, both (int4 read, int8 rescoring), see quantize.py.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import NamedTuple

import torch
import torch.nn.functional as F
from torch import nn

from specdeploy.models.config import ModelConfig
from specdeploy.models.device_transfer import from_host
from specdeploy.models.kv_cache import KVCache, write_entries
from specdeploy.models.machine import onednn_bf16
from specdeploy.models.quantize import Int4Linear, Int8Linear, RescoredHead
from specdeploy.models.row_invariance import attend_rows


def packs_for_cpu(weight: torch.Tensor) -> bool:
    """Whether `DenseLinear.prepack` packs this weight: bf16 on a CPU where oneDNN's bf16 kernels run."""
    return weight.dtype == torch.bfloat16 and weight.device.type == "cpu" and onednn_bf16()


class DenseLinear(nn.Module):
    """x: [..., K] → [..., N]: F.linear, or after `prepack` oneDNN's prepacked bf16 matmul (eager only)."""

    def __init__(self, weight: torch.Tensor) -> None:
        super().__init__()
        self.in_features = weight.shape[1]
        self.weight: nn.Parameter | None = nn.Parameter(weight, requires_grad=False)
        self.register_buffer("packed", None)

    def prepack(self) -> None:
        """Replace a bf16 CPU weight by oneDNN's prepacked layout (no-op for any other): one-row matmuls, and so an
        eager bf16 decode step, run faster from it than from F.linear (scripts/measure_model_forms.py; figures:
        docs/benchmarks.md, "Figures behind the code"). The ops are private and torch.compile does not lower them, so a
        model to be compiled is built with prepack=False (inductor's freezing packs the plain weights itself)."""
        if self.weight is not None and packs_for_cpu(self.weight):
            self.packed = torch.ops.mkldnn._reorder_linear_weight(self.weight.data, 1)
            self.weight = None

    @property
    def weight_bytes(self) -> int:
        """Bytes of the matrix a forward reads: the weight, or its prepacked copy."""
        matrix = self.weight if self.packed is None else self.packed
        return matrix.numel() * matrix.element_size()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.packed is not None:
            return torch.ops.mkldnn._linear_pointwise(x, self.packed, None, "none", [], "")
        return F.linear(x, self.weight)


# The linear layers whose forward reads their whole matrix, each saying how many bytes that is (weight_bytes). A
# RescoredHead is not one: it reads its int4 pass whole (an Int4Linear inside it) and only a few int8 rows.
WHOLE_MATRIX_LINEARS = (DenseLinear, Int4Linear, Int8Linear)


def fused_linear(state: dict[str, torch.Tensor], names: list[str], dtype: torch.dtype) -> nn.Module:
    """One linear layer computing the given layers' outputs side by side (rows are independent, so they
    concatenate)."""

    def stacked(key: str) -> torch.Tensor:
        return torch.cat([state[f"{name}.{key}"] for name in names])

    if f"{names[0]}.weight" in state:
        return DenseLinear(stacked("weight").to(dtype))
    int4 = None
    if f"{names[0]}.codes" in state:
        int4 = Int4Linear(stacked("codes"), stacked("scales").float(), stacked("minimums").float())
    if f"{names[0]}.int8" in state:
        int8 = stacked("int8"), stacked("row_scales")
        return Int8Linear(*int8) if int4 is None else RescoredHead(int4, *int8)
    return int4


class RMSNorm(nn.Module):
    """x / sqrt(mean(x²) + eps) * weight over the last dimension. x: [..., H] → [..., H] in x's dtype.

    Compiled (torch.compile), the plain form: in fp32, rounded once, which inductor fuses into one kernel. Eager,
    layer norm of [x, -x] (zero mean, so its variance is mean(x²): the same function), one fused kernel where the
    plain form is eight, and a decode step runs 61 norms (timed: docs/benchmarks.md, "Figures behind the code"). It
    rounds the weight product to x's dtype as Hugging Face's LlamaRMSNorm does; in fp32 a model's logits agree to 1e-5
    either way (tests/models/test_llama.py)."""

    def __init__(self, weight: torch.Tensor, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(weight.float(), requires_grad=False)
        self.doubled_weight = nn.Parameter(torch.cat([weight, weight]), requires_grad=False)
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if torch.compiler.is_compiling():
            wide = x.float()
            return (wide * torch.rsqrt(wide.square().mean(-1, keepdim=True) + self.eps) * self.weight).to(x.dtype)
        width = x.shape[-1]
        doubled = torch.cat([x, -x], dim=-1)
        return F.layer_norm(doubled, (2 * width,), self.doubled_weight, None, self.eps)[..., :width]


def rotary_table(config: ModelConfig, length: int) -> torch.Tensor:
    """[2, length, head_dim] fp32: each position's cos, and its sin negated on the first half, for the rotate-half
    layout of Hugging Face Llama weights (dimension i pairs with i + D/2, both at angle i)."""
    inv_freq = 1.0 / config.rope_theta ** (torch.arange(0, config.head_dim, 2).float() / config.head_dim)
    angles = torch.outer(torch.arange(length).float(), inv_freq)  # [length, D/2]
    return torch.stack([angles.cos().repeat(1, 2), torch.cat([-angles.sin(), angles.sin()], dim=-1)])


def rotate(x: torch.Tensor, rotation: torch.Tensor) -> torch.Tensor:
    """Rotary embedding in x's dtype, as Hugging Face Llama computes it, rotate-half layout: x * cos + [-x2, x1] * sin,
    with [-x2, x1] * sin written as [x2, x1] * [-sin, sin] (one roll and one fused multiply-add instead of a
    negation, a concatenation and two casts to fp32; timed: docs/benchmarks.md, "Figures behind the code").
    x: [B, T, heads, D]; rotation: [2, B, T, 1, D] (rotary_table's rows at each position, any float dtype)."""
    cos, signed_sin = rotation.to(x.dtype)
    return torch.addcmul(x * cos, x.roll(x.shape[-1] // 2, dims=-1), signed_sin)


class GatedMLP(nn.Module):
    """x: [..., H] → down(silu(gate x) * up x): [..., H], gate and up fused into one matmul."""

    def __init__(self, state: dict[str, torch.Tensor], prefix: str, dtype: torch.dtype) -> None:
        super().__init__()
        self.gate_up = fused_linear(state, [f"{prefix}.gate_proj", f"{prefix}.up_proj"], dtype)
        self.down = fused_linear(state, [f"{prefix}.down_proj"], dtype)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gate, up = self.gate_up.forward(x).chunk(2, dim=-1)
        return self.down.forward(F.silu(gate) * up)


class DecoderLayer(nn.Module):
    def __init__(self, config: ModelConfig, state: dict[str, torch.Tensor], prefix: str, dtype: torch.dtype,
                 feed_forward: nn.Module) -> None:
        super().__init__()
        self.num_heads, self.num_kv_heads, self.head_dim = config.num_heads, config.num_kv_heads, config.head_dim
        attn = f"{prefix}.self_attn"
        self.input_norm = RMSNorm(state[f"{prefix}.input_layernorm.weight"].to(dtype), config.rms_norm_eps)
        self.qkv = fused_linear(state, [f"{attn}.q_proj", f"{attn}.k_proj", f"{attn}.v_proj"], dtype)
        self.out = fused_linear(state, [f"{attn}.o_proj"], dtype)
        self.post_attention_norm = RMSNorm(state[f"{prefix}.post_attention_layernorm.weight"].to(dtype),
                                           config.rms_norm_eps)
        self.feed_forward = feed_forward

    def forward(self, x: torch.Tensor, rotation: torch.Tensor, keys_cache: torch.Tensor, values_cache: torch.Tensor,
                slots: torch.Tensor, mask: torch.Tensor | None, kv_len: int,
                spans: list[tuple[int, int]] | None = None) -> torch.Tensor:
        """x: [B, T, hidden] → [B, T, hidden]; writes this layer's keys and values at `slots` [B, T] of
        keys_cache/values_cache [B, kv_heads, max_length, D] and attends to their first kv_len slots.
        rotation: [2, B, T, 1, D], rotary_table's rows at each position (LlamaModel.rotation_at).
        mask: [B, 1, G*T, S] bool or None, G = query heads per kv head (queries are grouped by kv head).
        spans: attend row by row, row r's first t queries within its first s slots (spans[r] = (t, s))."""
        batch, length, _ = x.shape
        heads, kv_heads, dim = self.num_heads, self.num_kv_heads, self.head_dim
        # Submodules are called through .forward: nn.Module.__call__'s hook checks cost time on each of a step's 120
        # calls (docs/benchmarks.md, "Figures behind the code"). The feed-forward block keeps __call__:
        # build/moe_derive.py hooks it to record its inputs.
        qkv = self.qkv.forward(self.input_norm.forward(x)).unflatten(-1, (heads + 2 * kv_heads, dim))
        qk = rotate(qkv[:, :, :heads + kv_heads], rotation)
        k = qk[:, :, heads:].transpose(1, 2)  # [B, kv_heads, T, D]
        v = qkv[:, :, heads + kv_heads:].transpose(1, 2)
        write_entries(keys_cache, values_cache, slots, k, v)
        keys, values = keys_cache[:, :, :kv_len], values_cache[:, :, :kv_len]
        # Group query heads by their kv head, so the cache is attended without being repeated per query head.
        q = qk[:, :, :heads].transpose(1, 2).reshape(batch, kv_heads, (heads // kv_heads) * length, dim)
        if spans is None:
            attended = F.scaled_dot_product_attention(q, keys, values, attn_mask=mask)
        else:
            attended = attend_rows(q, keys, values, mask, spans, heads // kv_heads)
        attended = attended.view(batch, kv_heads, heads // kv_heads, length, dim).permute(0, 3, 1, 2, 4)
        x = x + self.out.forward(attended.reshape(batch, length, heads * dim))
        return x + self.feed_forward(self.post_attention_norm.forward(x))


class Forward(NamedTuple):
    """What one forward returns. hidden: [B, T, hidden] after the final norm (the raw states entering layer `stop`
    of a forward cut short by LayerSpan). captured: [B, T, len(capture) * hidden], the states entering each layer
    the call asked to capture, side by side in the order asked (EAGLE-3's draft reads three); None when none was."""

    hidden: torch.Tensor
    captured: torch.Tensor | None = None


@dataclass(frozen=True)
class LayerSpan:
    """Part of the decoder stack: layers start..stop - 1 (stop None: through the last, then the final norm), fed
    `entering` [B, T, hidden], the states entering layer `start` (None: the tokens' embeddings, with start 0). An
    early exit's draft runs the first layers and its verify resumes after them (speculative/early_exit.py)."""

    start: int = 0
    stop: int | None = None
    entering: torch.Tensor | None = None


class LlamaModel(nn.Module):
    """Decoder stack + final norm + vocabulary projection, built from canonical weights. A family that differs
    only in its feed-forward block (models/moe.py) overrides make_feed_forward. prepack: pack bf16 CPU weights
    for oneDNN (DenseLinear.prepack), the eager engine's fast path; False for a model that will be compiled.
    row_invariant: batch invariance (models/row_invariance.py): a step's attention runs row by row over each row's
    own keys, so a row's hidden states do not depend on the rows beside it (its linear layers are made invariant
    after loading, by models/batch_invariant.py, which probes this machine's kernels)."""

    def __init__(self, config: ModelConfig, state: dict[str, torch.Tensor], dtype: torch.dtype = torch.float32,
                 prepack: bool = True, row_invariant: bool = False) -> None:
        super().__init__()
        self.config, self.dtype, self.row_invariant = config, dtype, row_invariant
        self.embed = nn.Parameter(state["model.embed_tokens.weight"].to(dtype), requires_grad=False)
        self.layers = nn.ModuleList(
            DecoderLayer(config, state, f"model.layers.{i}", dtype,
                         self.make_feed_forward(config, state, f"model.layers.{i}.mlp", dtype))
            for i in range(config.num_layers))
        self.norm = RMSNorm(state["model.norm.weight"].to(dtype), config.rms_norm_eps)
        if any(f"lm_head.{key}" in state for key in ("weight", "codes", "int8")):
            self.lm_head = fused_linear(state, ["lm_head"], dtype)
        else:
            # Tied embeddings (SmolLM2's checkpoint has no lm_head): the head wraps the embedding matrix without
            # copying it, unless prepack packs it, which makes a second, packed copy (V x H, 56 MB in bf16 for
            # SmolLM2) because the embedding lookup still needs the plain rows.
            self.lm_head = DenseLinear(self.embed.data)
        self.register_buffer("rotations", rotary_table(config, config.max_position_embeddings).to(dtype),
                             persistent=False)
        if prepack:
            for module in self.modules():
                if isinstance(module, DenseLinear):
                    module.prepack()

    @staticmethod
    def make_feed_forward(config: ModelConfig, state: dict[str, torch.Tensor], prefix: str,
                          dtype: torch.dtype) -> nn.Module:
        return GatedMLP(state, prefix, dtype)

    def rotation_at(self, positions: torch.Tensor) -> torch.Tensor:
        """positions: [B, T] → [2, B, T, 1, D], what DecoderLayer.forward takes as `rotation`."""
        return self.rotations[:, positions, None]

    def new_cache(self, batch_size: int, max_length: int) -> KVCache:
        c = self.config
        return KVCache(c.num_layers, batch_size, c.num_kv_heads, max_length, c.head_dim, self.dtype,
                       self.embed.device)

    def forward(self, tokens: torch.Tensor, positions: torch.Tensor, kv_cache: KVCache,
                attention_mask: torch.Tensor | None = None, cache_slots: torch.Tensor | None = None,
                row_lengths: list[int] | None = None, span: LayerSpan | None = None,
                capture: tuple[int, ...] = ()) -> Forward:
        """The hidden states after the final norm, and the states entering the layers in `capture`.

        tokens, positions: [B, T] long. attention_mask: [B, T, S] bool (True = may attend) over the first S cache
        slots; by default causal by position over the cache rows' committed lengths plus T. cache_slots: [B, T]
        where this call's keys/values are written (default: the positions; a row's slots follow its committed
        length). row_lengths: a decode step's real tokens per row (the rest is padding at its end), which a
        row-invariant model attends with (models/row_invariance.py); None for a call of one row's own tokens (a
        prefill), which no other row changes. span: run only part of the stack, writing only its layers' cache
        entries (LayerSpan). capture: layer indices whose entering states to return (Forward.captured).
        """
        length = tokens.shape[1]
        spans = None
        if self.row_invariant and row_lengths is not None:  # a step's rows (a one-row prefill gives none)
            spans = [(t, committed + t) for t, committed in zip(row_lengths, kv_cache.lengths)]
        if attention_mask is None:
            kv_len = max(kv_cache.lengths) + length
            if spans is not None or (tokens.shape[0] == 1 and length == 1 and kv_cache.lengths[0] + 1 == kv_len):
                # causal rows of a row-invariant step (attend_rows gives each query exactly the keys it sees), or
                # one new token that attends to every committed slot: no mask needed
                mask = None
            else:
                mask = causal_mask(kv_cache, positions)
        else:
            kv_len = attention_mask.shape[-1]
            mask = attention_mask
        if mask is not None:  # [B, T, S] → [B, 1, G*T, S], the grouped query layout of DecoderLayer
            group = self.config.num_heads // self.config.num_kv_heads
            mask = mask[:, None].expand(-1, group, -1, -1).reshape(mask.shape[0], 1, -1, kv_len)
        slots = positions if cache_slots is None else cache_slots
        rotation = self.rotation_at(positions)
        span = span or LayerSpan()
        stop = len(self.layers) if span.stop is None else span.stop
        x = self.embed[tokens] if span.entering is None else span.entering
        entering = {}
        for index in range(span.start, stop):
            if index in capture:
                entering[index] = x
            # skip __call__
            x = self.layers[index].forward(x, rotation, *kv_cache.layer(index), slots, mask, kv_len, spans)
        captured = torch.cat([entering[index] for index in capture], dim=-1) if capture else None
        return Forward(self.norm(x) if stop == len(self.layers) else x, captured)

    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """hidden: [..., hidden] → fp32 logits [..., vocab]."""
        return self.lm_head(hidden).float()

    def weight_bytes_per_token(self) -> int:
        """Bytes of weight matrices one token's forward reads: every projection and the vocabulary head, each in the
        form it is held (dense, prepacked, int4 codes, int8 rows; a rescored head's int4 pass, since it reads only a
        few int8 rows). The embedding lookup reads one row, so the embedding counts only as the tied head. Bench
        divides a bandwidth by it for the ceiling on plain decode, and the context sweep's bytes model calls it W."""
        return sum(module.weight_bytes for module in self.modules() if isinstance(module, WHOLE_MATRIX_LINEARS))


def causal_mask(kv_cache: KVCache, positions: torch.Tensor) -> torch.Tensor:
    """[B, T, S] bool, S = the longest committed length plus T: each query may attend to the slots at or before its
    position (LlamaModel.forward's default mask). positions: [B, T]."""
    kv_len = max(kv_cache.lengths) + positions.shape[1]
    return torch.arange(kv_len, device=positions.device) <= positions[..., None]


def pad_rows(rows: list[list[int]], device: torch.device | str) -> torch.Tensor:
    """Token lists of different lengths → [B, W] long, each padded at its end with token 0."""
    width = max(len(row) for row in rows)
    return from_host([row + [0] * (width - len(row)) for row in rows], device, torch.long)


def ragged_forward_all(model: LlamaModel, cache: KVCache, tokens: torch.Tensor, starts: list[int],
                       lengths: list[int] | None = None, resume: LayerSpan | None = None,
                       capture: tuple[int, ...] = ()) -> Forward:
    """One forward over rows fed at different positions: row r feeds tokens[r] [B, W] at positions starts[r]..
    into cache row r, attending causally to the row's first starts[r] entries and to itself.

    A row with fewer real tokens than W (lengths[r]; None: all W) carries padding at its end; the padding is written
    past the row's real tokens, where the next write overwrites it before anything attends to it (the cache has
    headroom for it). resume: run only the layers from its start on, from the states entering it (the layers before
    it already ran over these positions and wrote their cache entries). Returns every position's hidden state
    [B, W, hidden] (padding positions included), and what `capture` asked (LlamaModel.forward).
    """
    width = tokens.shape[1]
    positions = from_host(starts, tokens.device)[:, None] + torch.arange(width, device=tokens.device)
    cache.lengths = list(starts)
    return model(tokens, positions, cache, row_lengths=lengths, span=resume, capture=capture)


def ragged_forward(model: LlamaModel, cache: KVCache, tokens: torch.Tensor, starts: list[int],
                   lengths: list[int]) -> torch.Tensor:
    """As ragged_forward_all, returning the hidden state of each row's last real token (row r has lengths[r]):
    [B, hidden]."""
    hidden = ragged_forward_all(model, cache, tokens, starts, lengths).hidden
    last = from_host([length - 1 for length in lengths], hidden.device)
    return hidden[torch.arange(len(lengths), device=hidden.device), last]


def tree_forward_all(model: LlamaModel, cache: KVCache, tokens: torch.Tensor, starts: list[int],
                     depths: torch.Tensor, ancestry: torch.Tensor, lengths: list[int] | None = None,
                     capture: tuple[int, ...] = ()) -> Forward:
    """One forward over a token tree per row: row r feeds tokens[r] [B, W] (the pending token, then the tree's nodes)
    into cache slots starts[r].. in order, at positions starts[r] + depths[r] ([B, W] or, for one shape in every
    row, [W]); each attends to the row's first starts[r] entries and to its own ancestors in the tree and itself
    (ancestry [B, W, W] or [W, W], entry [.., i, j]: j is i or an ancestor). A row with fewer real nodes than W-1
    pads at its end, as in `ragged_forward_all` (lengths[r]: row r's real tokens, the pending one included).
    Returns [B, W, hidden], and what `capture` asked (LlamaModel.forward)."""
    batch, width = tokens.shape
    device = tokens.device
    depths = depths[..., :width].expand(batch, width)
    ancestry = ancestry[..., :width, :width].expand(batch, width, width)
    start = from_host(starts, device)[:, None]  # [B, 1]
    positions = start + depths
    slots = start + torch.arange(width, device=device)[None, :]
    relative = torch.arange(max(starts) + width, device=device)[None, :] - start  # [B, S]: key slot - start
    in_tree = (relative >= 0) & (relative < width)
    index = relative.clamp(0, width - 1)[:, None, :].expand(batch, width, -1)  # [B, W, S]
    tree_part = ancestry.gather(2, index)  # [B, W, S]: may query i see the tree position at key slot s
    mask = (relative < 0)[:, None, :] | (in_tree[:, None, :] & tree_part)
    cache.lengths = list(starts)
    return model(tokens, positions, cache, attention_mask=mask, cache_slots=slots, row_lengths=lengths,
                 capture=capture)
