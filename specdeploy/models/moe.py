"""Mixtral-architecture decoder: the Llama decoder with each MLP replaced by a sparse mixture of experts.

Per layer a router (linear, no bias) scores the E experts; softmax over them in fp32, the top k kept and
renormalised to sum to one (Mixtral's rule); expert e computes w2(silu(w1 x) * w3 x), and a token's output is the
weighted sum of its k experts' outputs. The experts run grouped: the tokens routed to an expert are gathered and
pass through it in one matmul per active expert, so a step costs one matmul pair per distinct expert its tokens
touch, which is what makes verifying several tokens dearer on an MoE than on a dense model.

Weights use transformers 5's packed names: `mlp.gate.weight` [E, H] (the router), `mlp.experts.gate_up_proj`
[E, 2I, H] (w1's rows, then w3's) and `mlp.experts.down_proj` [E, H, I] (w2); an int4 draft of an MoE stores each
expert's int4 groups stacked the same way.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from specdeploy.models.config import ModelConfig
from specdeploy.models.llama import DenseLinear, LlamaModel
from specdeploy.models.quantize import Int4Linear, Int8Linear


def route(router_logits: torch.Tensor, experts_per_token: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Mixtral's rule. router_logits: [N, E] → (weights [N, k] fp32 summing to 1 per token, experts [N, k] long)."""
    probabilities = router_logits.float().softmax(dim=-1)
    weights, experts = probabilities.topk(experts_per_token, dim=-1)
    return weights / weights.sum(dim=-1, keepdim=True), experts


def expert_linears(state: dict[str, torch.Tensor], key: str, dtype: torch.dtype) -> tuple[nn.ModuleList, int]:
    """One linear per expert from the experts' stacked weights at `key` ([E, N, K]; or, as a derived draft stores
    them, int4 groups stacked the same way under `key`.codes / .scales / .minimums, or int8 rows under `key`.int8 /
    .row_scales), and the bytes one expert's linear reads."""
    if key in state:
        weights = state[key]
        return (nn.ModuleList(DenseLinear(w.to(dtype)) for w in weights),
                weights[0].numel() * torch.finfo(dtype).bits // 8)
    if f"{key}.int8" in state:
        rows, scales = state[f"{key}.int8"], state[f"{key}.row_scales"]
        return (nn.ModuleList(Int8Linear(r, s) for r, s in zip(rows, scales)),
                rows[0].numel() + scales[0].numel() * 2)  # int8 weights, bf16 row scales
    codes, scales, minimums = (state[f"{key}.{part}"] for part in ("codes", "scales", "minimums"))
    linears = nn.ModuleList(Int4Linear(c, s.float(), m.float()) for c, s, m in zip(codes, scales, minimums))
    return linears, codes[0].numel() + 2 * scales[0].numel() * 2  # 4-bit codes, bf16 scales and zeros


class SparseMoE(nn.Module):
    """x: [..., H] → [..., H]. After each call, `expert_tokens` [E] holds how many of its tokens each expert took
    (what bench counts distinct experts and expert bytes from)."""

    def __init__(self, config: ModelConfig, state: dict[str, torch.Tensor], prefix: str, dtype: torch.dtype) -> None:
        super().__init__()
        self.num_experts, self.experts_per_token = config.num_experts, config.experts_per_token
        self.router = DenseLinear(state[f"{prefix}.gate.weight"].to(dtype))
        self.gate_up, gate_up_bytes = expert_linears(state, f"{prefix}.experts.gate_up_proj", dtype)
        self.down, down_bytes = expert_linears(state, f"{prefix}.experts.down_proj", dtype)
        self.expert_bytes = gate_up_bytes + down_bytes
        self.expert_tokens = torch.zeros(self.num_experts, dtype=torch.long)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        flat = x.reshape(-1, x.shape[-1])  # [N, H]
        weights, experts = route(self.router.forward(flat), self.experts_per_token)  # [N, k] each
        assignments = experts.flatten()  # [N * k]: token n's j-th expert at n * k + j
        if flat.device.type != "cpu":  # bincount reads the assignments' range on the host: count by index_add
            self.expert_tokens = torch.zeros(self.num_experts, dtype=torch.long, device=flat.device).index_add_(
                0, assignments, torch.ones_like(assignments))
            return self.every_expert(flat, weights, experts).view_as(x)
        counts = torch.bincount(assignments, minlength=self.num_experts)
        self.expert_tokens = counts
        order = assignments.argsort(stable=True)  # assignments grouped by expert
        tokens_in_order = order // self.experts_per_token
        routed = flat[tokens_in_order]  # [N * k, H]: each token once per expert it goes to, grouped by expert
        outputs, start = [], 0
        for expert, count in enumerate(counts.tolist()):
            if count == 0:
                continue
            gate, up = self.gate_up[expert].forward(routed[start:start + count]).chunk(2, dim=-1)
            outputs.append(self.down[expert].forward(F.silu(gate) * up))
            start += count
        # one weighting and one scatter for all experts: per-expert small ops cost more than the matmuls here
        weighted = (torch.cat(outputs) * weights.flatten()[order, None]).to(flat.dtype)
        out = torch.zeros_like(flat).index_add_(0, tokens_in_order, weighted)
        return out.view_as(x)

    def every_expert(self, flat: torch.Tensor, weights: torch.Tensor, experts: torch.Tensor) -> torch.Tensor:
        """flat: [N, H], weights and experts: [N, k] → [N, H]. Every expert over every token, each output weighted by
        its routing weight (0 where the token is not routed to it). Skipping the idle experts needs their token counts
        on the host, a sync per layer on a GPU; a verification's few tokens touch most experts anyway."""
        dense = torch.zeros(flat.shape[0], self.num_experts, dtype=weights.dtype, device=flat.device)
        dense.scatter_(1, experts, weights)  # [N, E]
        out = torch.zeros(flat.shape, dtype=torch.float32, device=flat.device)
        for expert in range(self.num_experts):
            gate, up = self.gate_up[expert].forward(flat).chunk(2, dim=-1)
            out += self.down[expert].forward(F.silu(gate) * up).float() * dense[:, expert, None]
        return out.to(flat.dtype)


class MixtralModel(LlamaModel):
    """LlamaModel with a SparseMoE in place of every MLP."""

    @staticmethod
    def make_feed_forward(config: ModelConfig, state: dict[str, torch.Tensor], prefix: str,
                          dtype: torch.dtype) -> nn.Module:
        return SparseMoE(config, state, prefix, dtype)

    def moe_layers(self) -> list[SparseMoE]:
        return [layer.feed_forward for layer in self.layers]

    def weight_bytes_per_token(self) -> int:
        """LlamaModel's, less the experts a token is not routed to: it reads experts_per_token of each layer's."""
        unread = sum((moe.num_experts - moe.experts_per_token) * moe.expert_bytes for moe in self.moe_layers())
        return super().weight_bytes_per_token() - unread
