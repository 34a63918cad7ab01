"""Sparse upcycling: a Mixtral-architecture MoE layer whose every expert starts as the dense layer's whole MLP, the
way Mixtral-style MoEs are commonly initialised from a dense model (Komatsuzaki et al., "Sparse Upcycling", 2022).

- Experts: E copies of the dense gate (w1), up (w3) and down (w2) projections. Each token reads k of them, each as
  large as the dense MLP: the bytes and FLOPs of a real top-k MoE, k times the dense model's MLP per token.
- Router: a seeded random linear map (Mixtral's router has no bias), scaled so its logits spread with standard
  deviation ROUTER_LOGIT_STD over the calibration positions: tokens spread over the experts, neighbouring tokens
  (whose hidden states are alike) more often on the same ones.
- Exactness at initialisation: Mixtral renormalises the top k softmax weights to sum to one, so with identical
  experts the layer computes the dense MLP whatever the routing.
- `expert_noise`: each expert's matrices get seeded Gaussian noise of that fraction of the matrix's own standard
  deviation, a different draw per expert, so the experts differ and the routing decides the output: a mis-routed
  verification changes the text, which an exactness test can then catch. Upcycled MoEs are then trained, which
  makes the experts diverge; this build does not train, and `specdeploy moe-quality` measures what the noise costs.
"""

from __future__ import annotations

import torch

ROUTER_LOGIT_STD = 1.0


def noisy_copies(weight: torch.Tensor, copies: int, noise: float, generator: torch.Generator) -> torch.Tensor:
    """weight [N, K] → [copies, N, K]: the weight, plus per copy Gaussian noise of `noise` × its standard deviation."""
    stacked = weight.expand(copies, *weight.shape).clone()
    if noise > 0:
        scale = noise * weight.std()
        stacked += torch.randn(stacked.shape, generator=generator, dtype=weight.dtype) * scale
    return stacked


def upcycle_layer(x: torch.Tensor, gate: torch.Tensor, up: torch.Tensor, down: torch.Tensor, num_experts: int,
                  expert_noise: float, seed: int, router_scale: float | None) -> dict[str, torch.Tensor]:
    """One layer's MoE tensors (transformers 5's packed names, relative to `mlp.`) from its dense MLP (gate, up
    [I, H], down [H, I], fp32) and calibration inputs x [P, H]. `seed` draws this layer's router and noise.
    router_scale: None scales the router's logits to ROUTER_LOGIT_STD on x; 0 gives a zero (uniform) router."""
    generator = torch.Generator().manual_seed(seed)
    router = torch.randn(num_experts, x.shape[1], generator=generator)  # [E, H]
    if router_scale is None:
        router *= ROUTER_LOGIT_STD / (x @ router.T).std().clamp(min=1e-12)
    else:
        router *= router_scale
    gate_up = torch.cat([noisy_copies(gate, num_experts, expert_noise, generator),  # each by its own spread
                         noisy_copies(up, num_experts, expert_noise, generator)], dim=1)
    return {"gate.weight": router.contiguous(), "experts.gate_up_proj": gate_up,
            "experts.down_proj": noisy_copies(down, num_experts, expert_noise, generator)}
