"""What verification costs on an MoE target. One decode token reads the k experts it is routed to; verifying n
tokens reads the union of the experts they are routed to, so verification is no longer nearly free. Per
verification length n this measures, on the prompts' own text (their greedy answers): the distinct experts the n
tokens touch per layer, the expert weight bytes that reads, and the forward's time in plain decode steps."""

from __future__ import annotations

import time

import torch

from specdeploy.models.llama import ragged_forward_all
from specdeploy.models.moe import MixtralModel
from specdeploy.runtime.engine import Engine

STARTS_PER_SEQUENCE = 4  # verification windows per prompt, spread over its answer


def experts_touched(model: MixtralModel) -> list[int]:
    """Per MoE layer, the distinct experts the last forward routed any token to."""
    return [int((layer.expert_tokens > 0).sum()) for layer in model.moe_layers()]


def expert_union_curve(engine: Engine, sequences: list[tuple[list[int], int]], max_length: int,
                       repeats: int = 3) -> dict:
    """sequences: (prompt + answer ids, index of the answer's first token). For n = 1 .. max_length: the mean
    distinct experts per layer over verification windows of n real tokens, the expert bytes a forward over them
    reads, and its time relative to n = 1 (medians of `repeats`); n = 1 is a plain decode step."""
    model = engine.target
    per_length: dict[int, tuple[list[float], list[float]]] = {n: ([], []) for n in range(1, max_length + 1)}
    with torch.inference_mode():
        for ids, answer_start in sequences:
            room = len(ids) - answer_start - max_length
            if room < 0:
                continue
            cache = model.new_cache(1, len(ids) + 1)
            model(torch.tensor([ids]), torch.arange(len(ids))[None], cache)  # every position's entries, once
            for j in range(STARTS_PER_SEQUENCE):
                start = answer_start + room * j // max(STARTS_PER_SEQUENCE - 1, 1)
                for n in range(1, max_length + 1):
                    window = torch.tensor([ids[start:start + n]])
                    samples = []
                    for _ in range(repeats):
                        began = time.perf_counter()
                        model.logits(ragged_forward_all(model, cache, window, [start]))
                        samples.append(time.perf_counter() - began)
                    touched = experts_touched(model)
                    per_length[n][0].append(sum(touched) / len(touched))
                    per_length[n][1].append(sorted(samples)[repeats // 2])
    lengths = [n for n in per_length if per_length[n][0]]
    if not lengths:
        return {}
    distinct = [sum(per_length[n][0]) / len(per_length[n][0]) for n in lengths]
    seconds = [sum(per_length[n][1]) / len(per_length[n][1]) for n in lengths]
    layers = model.moe_layers()
    return {"verification_length": lengths, "num_experts": model.config.num_experts,
            "experts_per_token": model.config.experts_per_token,
            "distinct_experts_per_layer": distinct,
            "expert_bytes_read": [d * len(layers) * layers[0].expert_bytes for d in distinct],
            "verify_cost": [s / seconds[0] for s in seconds]}


def predicted_speedups(per_position_acceptance: list[float], draft_cost: float, verify_cost: list[float]
                       ) -> list[float]:
    """[gamma - 1]: the predicted speedup of drafting gamma tokens per step, for gamma = 1 .. len(verify_cost) - 1.
    per_position_acceptance[i]: the fraction of steps drafting position i + 1 that accepted it (a chain accepts a
    prefix, so that is the probability of accepting at least i + 1 tokens; measured, not assumed independent);
    draft_cost: plain steps per drafted token; verify_cost[n - 1]: plain steps for verifying n tokens (the MoE's
    union cost, measured). A step then emits 1 + sum(p[:gamma]) tokens for gamma * draft_cost + verify_cost[gamma]."""
    gammas = range(1, min(len(verify_cost) - 1, len(per_position_acceptance)) + 1)
    return [(1 + sum(per_position_acceptance[:gamma])) / (gamma * draft_cost + verify_cost[gamma]) for gamma in gammas]
