"""BenchReport's JSON: the flat keys `bench --json` has always written, read back into the same report."""

from __future__ import annotations

import json

import pytest
from helpers.made_reports import made_report

from specdeploy.bench.results import BenchReport, MedusaTree, MoeCurve, Peer, TransformersBaseline
from specdeploy.errors import SpecdeployError

# A report as bench wrote it before BenchReport existed (keys and nesting; the values are made up).
EARLIER = {
    "baseline_tokens_per_s": 41.5, "speculative_tokens_per_s": 60.2, "speedup": 1.45, "acceptance_rate": 0.62,
    "mean_accepted_length": 2.4, "draft_cost_ratio": 0.12, "verify_cost_ratio": 1.08, "predicted_speedup": 1.51,
    "mean_draft_tokens_per_step": 4.0, "proposal_cost_per_step": 0.48, "per_position_acceptance": [0.8, 0.6, 0.4],
    "by_kind": {"code": {"speedup": 1.6, "prompts": 3, "plain_tokens_per_s": 40.0, "speculative_tokens_per_s": 64.0}},
    "greedy_match": True, "greedy_exact_prompts": 2, "greedy_near_tie_prompts": 1, "greedy_mismatch_prompts": 0,
    "bandwidth_gb_per_s": 12.5, "weight_bytes_per_token": 270000000, "bandwidth_ceiling_tokens_per_s": 46.3,
    "fraction_of_ceiling": 0.9, "verify_costs": [1.0, 1.04, 1.1],
    "transformers_tokens_per_s": 30.1, "plain_vs_transformers": 1.38,
    "moe": {"verification_length": [1, 2], "num_experts": 8, "experts_per_token": 2,
            "distinct_experts_per_layer": [2.0, 3.5], "expert_bytes_read": [1e6, 1.75e6], "verify_cost": [1.0, 1.4],
            "predicted_speedup_by_gamma": [1.2], "best_gamma": 1},
    "medusa": {"tree": [[0], [0, 0]], "tree_size": 2, "head_cost_ratio": 0.05, "head_top1_here": [0.5, 0.3],
               "realized_accepted_per_step": 0.7, "expected_accepted_per_step": 0.65, "predicted_speedup": 1.5,
               "verify_costs": [1.0, 1.02, 1.05], "suggested_tree": [[0]], "suggested_expected_accepted": 0.5,
               "suggested_predicted_speedup": 1.4},
    "pipeline": "smollm2-draft-target", "method": "draft_target", "num_draft_tokens": 4, "gamma_cap": None,
    "schedule": "constant", "dtype": "bfloat16", "temperature": 0.0, "max_tokens": 64, "prompts": 3, "threads": 2,
    "machine": {"cpu": "AMD EPYC", "cores": 2, "threads": 2, "matmul_flags": ["avx2", "fma"],
                "bf16_matmul": "generic (time grows with rows)", "torch": "2.5.1"},
    "gamma_sweep": {"1": 1.2, "2": 1.35},
    "peers": {"transformers generate": {"tokens_per_s": 30.0, "what": "greedy generate"},
              "llama.cpp": {"skipped": "llama-cpp-python is not installed"}},
    "phase_seconds": {"plain_and_speculative": 20.0, "analysis": 3.0},
}


def test_an_earlier_report_loads_and_writes_back_the_same_json():
    report = BenchReport.from_json(EARLIER)
    assert report.summary.speedup == 1.45 and report.setup.machine.bf16_matmul.startswith("generic")
    assert report.greedy.greedy_near_tie_prompts == 1 and report.transformers.plain_vs_transformers == 1.38
    assert report.moe.best_gamma == 1 and report.moe.dense_verify_cost is None
    assert report.medusa.expected_accepted_per_step_held_out is None and report.medusa.tree_size == 2
    assert report.gamma_sweep == {1: 1.2, 2: 1.35} and report.summary.by_kind["code"].prompts == 3
    assert report.peers["llama.cpp"] == Peer(skipped="llama-cpp-python is not installed")
    assert report.to_json() == EARLIER


def test_a_sampled_report_has_no_greedy_check_and_leaves_out_what_was_not_measured():
    sampled = made_report(setup={"temperature": 0.7})
    data = sampled.to_json()
    assert data["greedy_match"] is None and "greedy_exact_prompts" not in data
    for key in ("verify_costs", "transformers_tokens_per_s", "moe", "medusa", "gamma_sweep", "peers"):
        assert key not in data, key
    assert data["gamma_cap"] is None  # a setting: written even when unset
    assert BenchReport.from_json(json.loads(json.dumps(data))) == sampled


def test_every_part_survives_a_round_trip_through_json_text():
    report = made_report(verify_costs=[1.0, 1.1], transformers=TransformersBaseline(20.0, 5.0),
                         moe=MoeCurve([1, 2], 8, 2, [2.0, 3.0], [1.0, 1.5], [1.0, 1.3], dense_verify_cost=[1.0, 1.1]),
                         medusa=MedusaTree([[0]], 1, 0.1, [0.4], 0.3, 0.4, 1.2, [1.0, 1.1], [[0]], 0.4, 1.2, 0.35),
                         gamma_sweep={2: 1.1}, peers={"x": Peer(tokens_per_s=9.0, what="x", common_prefix_tokens=3.0)},
                         phase_seconds={"analysis": 1.5})
    assert BenchReport.from_json(json.loads(json.dumps(report.to_json()))) == report


def test_a_file_that_is_not_a_bench_report_is_refused():
    with pytest.raises(SpecdeployError, match="not a bench report"):
        BenchReport.from_json({"levels": []})  # a --url report
