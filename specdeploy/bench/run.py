"""In-process benchmark: every prompt with and without speculation, same process, same engine, side by side.

Speeds are decode-phase tokens/s (prefill is identical in both modes and speculation does not touch it). The
report (results.BenchReport) also measures, in the same run, the memory bandwidth of a weight-streaming
mat-vec (the ceiling on plain decode) and transformers' `generate` on the same weights, dtype and threads.
"""

from __future__ import annotations

import time
from collections.abc import Iterator
from contextlib import contextmanager

import torch
from rich.progress import track

from specdeploy.bench.eagle_tree import measure_eagle_tree
from specdeploy.bench.footprint import measure_footprint
from specdeploy.bench.greedy_check import greedy_check
from specdeploy.bench.measure import (
    measure_bandwidth,
    measure_verify_costs,
    transformers_decode_tokens_per_s,
)
from specdeploy.bench.medusa_tree import measure_medusa_tree
from specdeploy.bench.moe_curve import dense_source, expert_union_curve, predict_by_gamma
from specdeploy.bench.peers import llama_cpp_peers, transformers_peers
from specdeploy.bench.results import BenchReport, Ceiling, Machine, Setup, TransformersBaseline
from specdeploy.bench.summary import PromptRun, summarize
from specdeploy.decoding.stats import RequestStats, decode_rate
from specdeploy.models import machine
from specdeploy.runtime.engine import Engine
from specdeploy.spec.request import GenerationRequest
from specdeploy.spec.speculation import EagleSpec, LookaheadSpec, MedusaSpec
from specdeploy.speculative.speedup import speedup, tokens_per_step_by_position


def run_bench(engine: Engine, prompts: list[dict], max_tokens: int | None, temperature: float | None, seed: int,
              with_transformers: bool, quiet: bool = False) -> BenchReport:
    """max_tokens, temperature: None for the pipeline's. The seed is the same for every prompt and mode."""
    return run_benches([engine], prompts, max_tokens, temperature, seed, with_transformers, quiet)[0]


def run_benches(engines: list[Engine], prompts: list[dict], max_tokens: int | None, temperature: float | None,
                seed: int, with_transformers: bool, quiet: bool = False, with_peers: bool = False,
                gammas: tuple[int, ...] = ()) -> list[BenchReport]:
    """One report per engine, measured in one run: for each prompt in turn every engine decodes it plain and with
    its speculation, so the machine's load drifts over all of them alike. transformers is measured once (first
    engine); with_peers: each engine's peers (bench/peers.py) on the same prompts, greedy, after its own runs, and
    its footprint beside llama.cpp's (bench/footprint.py: fresh processes, the first prompt);
    gammas: each prompt also decoded at these gammas (report.gamma_sweep: gamma → speedup; for a tree method the
    depths below its tree's, gamma being its depth cap; gammas above an engine's gamma_cap neither, which it serves
    at its cap)."""
    requests = [GenerationRequest.with_defaults(e.pipeline, [], max_tokens, temperature, seed=seed) for e in engines]
    encoded = [[e.encode_prompt(p["prompt"]) for p in prompts] for e in engines]
    for engine, request, ids in zip(engines, requests, encoded):
        engine.generate(ids[0], request.sampling, 8).run()  # warm-up: first calls allocate and page in weights
    runs: list[list[PromptRun]] = [[] for _ in engines]
    sweeps: list[dict[int, list[RequestStats]]] = [{} for _ in engines]  # per engine: gamma → its runs' stats
    spent = [PhaseSeconds() for _ in engines]
    for index, item in enumerate(track(prompts, description="bench", disable=quiet)):
        for engine, request, ids, done, sweep, clock in zip(engines, requests, encoded, runs, sweeps, spent):
            with clock("plain_and_speculative"):
                plain = engine.generate(ids[index], request.sampling, request.max_tokens,
                                        num_draft_tokens=0)
                plain_tokens = plain.run()
                speculative = engine.generate(ids[index], request.sampling, request.max_tokens)
                speculative_tokens = speculative.run()
            done.append(PromptRun(item["kind"], plain.stats, speculative.stats, plain_tokens,
                                  speculative_tokens))
            for gamma in swept_gammas(engine, gammas):
                with clock("gamma_sweep"):
                    swept = engine.generate(ids[index], request.sampling, request.max_tokens,
                                            num_draft_tokens=gamma)
                    swept.run()
                sweep.setdefault(gamma, []).append(swept.stats)
    reports = []
    for number, (engine, request, ids, done, clock) in enumerate(zip(engines, requests, encoded, runs, spent)):
        with clock("analysis"):
            reports.append(finish_report(engine, done, ids, request, with_transformers and number == 0))
    for report, sweep in zip(reports, sweeps):
        if sweep:
            report.gamma_sweep = {gamma: decode_rate(stats) / report.summary.baseline_tokens_per_s
                                  for gamma, stats in sorted(sweep.items())}
    if with_peers:
        for engine, request, ids, report, done, clock in zip(engines, requests, encoded, reports, runs, spent):
            with clock("peers"):
                report.peers = {**transformers_peers(engine, ids, request.max_tokens),
                                **llama_cpp_peers(engine, ids, request.max_tokens, [r.plain_tokens for r in done],
                                                  [p["kind"] for p in prompts])}
            with clock("footprint"):
                report.footprint = measure_footprint(engine, ids[0], request.max_tokens)
    for report, clock in zip(reports, spent):
        report.phase_seconds = clock.seconds
    return reports


def swept_gammas(engine: Engine, gammas: tuple[int, ...]) -> tuple[int, ...]:
    """The gammas of a sweep the engine serves as asked and differently from its own: those within its gamma_cap,
    and for a tree method those below its depth (a deeper cap serves the whole tree)."""
    cap = engine.pipeline.serving.policy.gamma_cap
    served = tuple(g for g in gammas if not isinstance(cap, int) or g <= cap)
    if engine.speculation.drafts_tree:
        return tuple(g for g in served if g < engine.num_draft_tokens)
    return served


class PhaseSeconds:
    """Wall seconds a bench spent per phase (`with clock("peers"): ...`), so a report says where its time went.
    "analysis" is finish_report: the greedy check, the bandwidth and verify-cost measurements, an MoE's union curve
    or Medusa's or EAGLE's tree, and transformers' one-prompt baseline when it is on."""

    def __init__(self) -> None:
        self.seconds: dict[str, float] = {}

    @contextmanager
    def __call__(self, phase: str) -> Iterator[None]:
        started = time.perf_counter()
        try:
            yield
        finally:
            self.seconds[phase] = self.seconds.get(phase, 0.0) + time.perf_counter() - started


def finish_report(engine: Engine, runs: list[PromptRun], encoded: list[list[int]], request: GenerationRequest,
                  with_transformers: bool) -> BenchReport:
    """The report of one engine's runs: speeds, costs, prediction, greedy check, bandwidth ceiling."""
    params, max_tokens = request.sampling, request.max_tokens
    summary = summarize(engine, runs)
    greedy = None
    if params.greedy:
        greedy = greedy_check(engine, encoded, [r.plain_tokens for r in runs], [r.speculative_tokens for r in runs])
    bandwidth = measure_bandwidth(engine.target.dtype, engine.device)
    bytes_per_token = engine.target.weight_bytes_per_token()
    ceiling = bandwidth / bytes_per_token
    report = BenchReport(
        setup=Setup(pipeline=engine.pipeline.name, method=engine.method, num_draft_tokens=engine.num_draft_tokens,
                    gamma_cap=engine.pipeline.serving.policy.gamma_cap, schedule=engine.pipeline.speculation.schedule,
                    dtype=engine.dtype, temperature=params.temperature, max_tokens=max_tokens, prompts=len(runs),
                    threads=torch.get_num_threads(), machine=Machine.from_json(machine.describe()),
                    steps=engine.step_programs),
        summary=summary, greedy=greedy,
        ceiling=Ceiling(bandwidth_gb_per_s=bandwidth / 1e9, weight_bytes_per_token=bytes_per_token,
                        bandwidth_ceiling_tokens_per_s=ceiling,
                        fraction_of_ceiling=summary.baseline_tokens_per_s / ceiling))
    if engine.speculation.drafts_outside_target and engine.target.config.architecture == "llama":
        # v grows with the verified width where matmuls are not bandwidth bound: the report's predicted lines
        # take its shape from here (an MoE measures its own union curve, Medusa its tree's widths)
        widest = min(engine.pipeline.limits.max_draft_tokens, 2 * max(engine.num_draft_tokens, 1))
        report.verify_costs = measure_verify_costs(engine, encoded[0], widest)
    if with_transformers:
        hf = transformers_decode_tokens_per_s(engine, encoded[0], min(max_tokens, 64))
        report.transformers = TransformersBaseline(transformers_tokens_per_s=hf,
                                                   plain_vs_transformers=summary.baseline_tokens_per_s / hf)
    if engine.target.config.architecture == "mixtral":
        answers = [(ids + r.plain_tokens, len(ids)) for ids, r in zip(encoded, runs)]
        report.moe = curve = expert_union_curve(engine, answers, engine.num_draft_tokens + 1,
                                                dense=dense_source(engine))
        if curve is not None and summary.per_position_acceptance:
            # the pipeline's gamma within its gamma_cap
            predict_by_gamma(curve, summary.per_position_acceptance, summary.draft_cost_ratio,
                             request.gamma(engine.pipeline))
            summary.predicted_speedup = curve.predicted_speedup_by_gamma[-1]
    analyse_tree = TREE_ANALYSES.get(type(engine.speculation.settings))
    if analyse_tree is not None:
        # the linear rule's formula does not describe a tree: the tree's own prediction replaces it
        analyse_tree(engine, report, runs, encoded)
    return report


def analyse_medusa(engine: Engine, report: BenchReport, runs: list[PromptRun], encoded: list[list[int]]) -> None:
    report.medusa = measure_medusa_tree(engine, runs, report.summary, encoded)
    report.summary.predicted_speedup = report.medusa.predicted_speedup


def analyse_eagle(engine: Engine, report: BenchReport, runs: list[PromptRun], encoded: list[list[int]]) -> None:
    report.eagle = measure_eagle_tree(engine, report.summary, encoded)
    report.summary.predicted_speedup = report.eagle.predicted_speedup


def analyse_lookahead(engine: Engine, report: BenchReport, runs: list[PromptRun], encoded: list[list[int]]) -> None:
    """About ten nodes a step, most of them window guesses that are never meant to be accepted: the chain formula's
    acceptance over drafted nodes does not describe it; the accepted depth by position does."""
    summary = report.summary
    summary.predicted_speedup = speedup(
        tokens_per_step_by_position(summary.per_position_acceptance, engine.num_draft_tokens),
        summary.proposal_cost_per_step + summary.verify_cost_ratio)


# Each tree method's own analysis and prediction, by its settings section (spec/speculation.py)
TREE_ANALYSES = {MedusaSpec: analyse_medusa, EagleSpec: analyse_eagle, LookaheadSpec: analyse_lookahead}
