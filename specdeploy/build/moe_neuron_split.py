"""Neuron splitting (MoEfication): a Mixtral-architecture MoE layer from a dense MLP whose neurons are split into
experts, from the MLP's inputs x [P, H] on calibration text (moe_derive.calibration_layers).

1. Experts: each layer's I neurons, with activations a = silu(gate x) * (up x), are split into E groups of I/E
   neurons that fire together (balanced k-means over the neurons' activation profiles |a| across the calibration
   positions), so a token's activation mass gathers in few experts. Expert e keeps its neurons' rows of gate (w1)
   and up (w3) and columns of down (w2).
2. Router: expert e's contribution to a token's output, ||w2_e a_e||, is fitted by least squares as a linear
   function of x (Mixtral's router has no bias); a token goes to the k experts with the highest scores.
3. Weights: the dense MLP sums every expert's output with weight one, while Mixtral renormalises the top k
   softmax weights to sum to one. So the router's scores are scaled down until its softmax is nearly uniform
   (the top-k weights stay within about 1% of 1/k; the ranking, and so the choice, is unchanged) and every w2 is
   multiplied by k. With k = E and a zero router every weight is exactly 1/E and the MoE computes the dense MLP.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

ROUTER_LOGIT_STD = 0.01  # the router's logits' spread after scaling: softmax weights within ~1% of uniform
KMEANS_ITERATIONS = 12


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


def split_layer(x: torch.Tensor, gate: torch.Tensor, up: torch.Tensor, down: torch.Tensor, num_experts: int,
                experts_per_token: int, router_scale: float | None) -> dict[str, torch.Tensor]:
    """One layer's neuron-split MoE tensors (under transformers 5's packed names, relative to `mlp.`) from its dense MLP
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
