"""A BenchReport made by hand, for the tests that need chosen figures rather than measured ones."""

from __future__ import annotations

from dataclasses import replace

from specdeploy.bench.results import BenchReport, Ceiling, KindSpeeds, Machine, Setup, Summary


def made_report(summary: dict | None = None, setup: dict | None = None, **parts) -> BenchReport:
    """A plausible report; summary and setup: the fields to change in those parts; parts: BenchReport's others."""
    base = BenchReport(
        setup=Setup(pipeline="made", method="draft_target", num_draft_tokens=3, gamma_cap=None, schedule="constant",
                    dtype="float32", temperature=0.0, max_tokens=16, prompts=2, threads=2,
                    machine=Machine(cpu="test cpu", threads=2, bf16_matmul="oneDNN", matmul_flags=["avx2"],
                                    cores=2, torch="2.0")),
        summary=Summary(baseline_tokens_per_s=100.0, speculative_tokens_per_s=150.0, speedup=1.5,
                        acceptance_rate=0.7, mean_accepted_length=2.2, draft_cost_ratio=0.1, verify_cost_ratio=1.05,
                        predicted_speedup=1.6, mean_draft_tokens_per_step=3.0, proposal_cost_per_step=0.3,
                        per_position_acceptance=[0.7, 0.49, 0.343],
                        by_kind={"copy": KindSpeeds(speedup=1.5, prompts=2, plain_tokens_per_s=100.0,
                                                    speculative_tokens_per_s=150.0)}),
        ceiling=Ceiling(bandwidth_gb_per_s=10.0, weight_bytes_per_token=10**8, bandwidth_ceiling_tokens_per_s=100.0,
                        fraction_of_ceiling=1.0))
    return replace(base, summary=replace(base.summary, **(summary or {})),
                   setup=replace(base.setup, **(setup or {})), **parts)
