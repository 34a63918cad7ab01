"""What verification costs on an MoE target. One decode token reads the k experts it is routed to; verifying n
tokens reads the union of the experts they are routed to, so verification is no longer nearly free. Per
verification length n this measures, on the prompts' own text (their greedy answers): the distinct experts the n
tokens touch per layer, the expert weight bytes that reads, and the forward's time in plain decode steps."""

from __future__ import annotations

import statistics

import torch

from specdeploy.bench.measure import timed_forward
from specdeploy.bench.results import MoeCurve
from specdeploy.build.checkpoints import load_checkpoint
from specdeploy.models.llama import LlamaModel
from specdeploy.models.moe import MixtralModel
from specdeploy.runtime.engine import Engine
from specdeploy.speculative.speedup import predicted_speedups

STARTS_PER_SEQUENCE = 2  # verification windows per prompt (its answer's first and last): up to 30 on 15 prompts


def experts_touched(model: MixtralModel) -> list[int]:
    """Per MoE layer, the distinct experts the last forward routed any token to."""
    return [int((layer.expert_tokens > 0).sum()) for layer in model.moe_layers()]


def dense_source(engine: Engine) -> LlamaModel | None:
    """The dense model a derived MoE target was split from, in the target's dtype (None for an MoE checkpoint)."""
    pipeline = engine.pipeline
    if pipeline.target.moe is None:
        return None
    dense = load_checkpoint(pipeline.target.checkpoint, pipeline)
    # built on the engine's device: a CPU build may prepack bf16 weights for oneDNN, which a GPU cannot run
    state = {key: value.to(engine.device) for key, value in dense.state.items()}
    return LlamaModel(dense.config, state, engine.target.dtype).eval()


def expert_union_curve(engine: Engine, sequences: list[tuple[list[int], int]], max_length: int,
                       repeats: int = 1, dense: LlamaModel | None = None) -> MoeCurve | None:
    """sequences: (prompt + answer ids, index of the answer's first token). For n = 1 .. max_length: the mean
    distinct experts per layer over verification windows of n real tokens, the expert bytes a forward over them
    reads, and its time relative to n = 1; n = 1 is a plain decode step. Each window is timed `repeats` times (its
    median) and the median across windows drops the outliers, at a third of the cost of three timings per window.
    With `dense`, the same windows timed on it, interleaved with the MoE's: the dense verify curve beside the
    union's, and how fast the MoE's plain step is against the dense one's. None when no window fits the answers."""
    model, device = engine.target, engine.device
    models = [model] if dense is None else [model, dense]
    distinct_at: dict[int, list[float]] = {n: [] for n in range(1, max_length + 1)}
    seconds_at = [{n: [] for n in range(1, max_length + 1)} for _ in models]
    with torch.inference_mode():
        for ids, answer_start in sequences:
            room = len(ids) - answer_start - max_length
            if room < 0:
                continue
            caches = [m.new_cache(1, len(ids) + 1) for m in models]
            for m, cache in zip(models, caches):
                m(torch.tensor([ids], device=device), torch.arange(len(ids), device=device)[None], cache)  # once
            for j in range(STARTS_PER_SEQUENCE):
                start = answer_start + room * j // max(STARTS_PER_SEQUENCE - 1, 1)
                for n in range(1, max_length + 1):
                    window = torch.tensor([ids[start:start + n]], device=device)
                    for m, cache, seconds in zip(models, caches, seconds_at):
                        seconds[n].append(timed_forward(m, cache, window, start, repeats))
                        if m is model:
                            touched = experts_touched(model)
                            distinct_at[n].append(sum(touched) / len(touched))
    lengths = [n for n in distinct_at if distinct_at[n]]
    if not lengths:
        return None
    distinct = [sum(distinct_at[n]) / len(distinct_at[n]) for n in lengths]
    medians = [[statistics.median(seconds[n]) for n in lengths] for seconds in seconds_at]
    costs = [[s / median[0] for s in median] for median in medians]
    layers = model.moe_layers()
    curve = MoeCurve(verification_length=lengths, num_experts=model.config.num_experts,
                     experts_per_token=model.config.experts_per_token, distinct_experts_per_layer=distinct,
                     expert_bytes_read=[d * len(layers) * layers[0].expert_bytes for d in distinct],
                     verify_cost=costs[0])
    if dense is not None:
        curve.dense_verify_cost = costs[1]
        # above 1: a plain decode step of the MoE is faster than the dense model's (same windows, interleaved)
        curve.plain_step_speed_vs_dense = medians[1][0] / medians[0][0]
    return curve


def predict_by_gamma(curve: MoeCurve, per_position_acceptance: list[float], draft_cost: float,
                     served_gamma: int) -> None:
    """Fill the curve's predicted speedup by gamma and its best gamma. The linear formula assumes a dense model's
    verify cost and independent acceptance: on an MoE the prediction comes from the union curve and the measured
    acceptance by position, up to the served gamma (positions past it were never drafted: their acceptance is
    unknown, not zero)."""
    by_gamma = predicted_speedups(per_position_acceptance[:served_gamma], draft_cost, curve.verify_cost)
    curve.predicted_speedup_by_gamma = by_gamma
    curve.best_gamma = 1 + max(range(len(by_gamma)), key=by_gamma.__getitem__)
