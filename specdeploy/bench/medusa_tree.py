"""A Medusa pipeline's part of the bench's results (results.MedusaTree): the tree served and its predicted speedup,
and the tree the builder would pick on this machine."""

from __future__ import annotations

import json

from specdeploy.bench.measure import measure_verify_costs
from specdeploy.bench.results import MedusaTree, Summary
from specdeploy.bench.summary import PromptRun
from specdeploy.runtime.engine import Engine
from specdeploy.spec.speculation import MEDUSA_HEADS
from specdeploy.speculative.speedup import speedup


def measure_medusa_tree(engine: Engine, runs: list[PromptRun], summary: Summary, encoded: list[list[int]]
                        ) -> MedusaTree:
    """The expected accepted tokens per step from the heads' accuracy by rank, measured here on the plain greedy
    answers to these prompts (and, for comparison, from the held-out answers train-medusa reported, which the build
    copies into the engine), over the head and verify costs of this run; and the tree the builder picks from the
    same accuracies and verify costs measured on this machine. The heads run once per step whatever the tree's
    size, so a step costs head cost + v."""
    from specdeploy.models.registry import load_projection
    from specdeploy.speculative.medusa import ACCURACY_FILE, engine_vocabulary
    from specdeploy.speculative.medusa_accuracy import accuracies, hidden_features
    from specdeploy.speculative.tree_builder import build_tree, expected_accepted

    proposer = engine.proposer
    tree, paths = proposer.tree, list(proposer.tree.paths)
    head_cost = summary.proposal_cost_per_step  # the heads are Medusa's proposal
    sequences = [(ids + r.plain_tokens, len(ids) - 1) for ids, r in zip(encoded, runs)]
    data = hidden_features(engine.target, sequences, proposer.heads.num_heads)
    heads_here = accuracies(proposer.heads, data, load_projection(engine.dir / "target"),
                            vocabulary=engine_vocabulary(engine.dir))
    by_rank = [head["by_rank"] for head in heads_here]
    expected = expected_accepted(paths, by_rank)
    costs = measure_verify_costs(engine, encoded[0], engine.pipeline.limits.max_draft_tokens)
    best = build_tree(by_rank, costs, head_cost)
    held_out = engine.dir / MEDUSA_HEADS.folder / ACCURACY_FILE
    expected_held_out = None
    if held_out.is_file():
        trained = [head["by_rank"] for head in json.loads(held_out.read_text())["held_out_accuracy"]]
        expected_held_out = expected_accepted(paths, trained)
    return MedusaTree(tree=[list(p) for p in paths], tree_size=tree.size, head_cost_ratio=head_cost,
                        head_top1_here=[head["top1"] for head in heads_here],
                        realized_accepted_per_step=summary.mean_accepted_length - 1,
                        expected_accepted_per_step=expected,
                        predicted_speedup=speedup(1 + expected, head_cost + summary.verify_cost_ratio),
                        verify_costs=costs, suggested_tree=best.choices,
                        suggested_expected_accepted=best.expected_accepted,
                        suggested_predicted_speedup=best.predicted_speedup,
                        expected_accepted_per_step_held_out=expected_held_out)
