"""An EAGLE pipeline's part of the bench's results (results.EagleTree): the tree budget served, the accepted tokens
a smaller budget would have kept, the verify costs measured here, and the budget they make best on this machine.

The proposer counts, for every tree it proposed, the accepted path's nodes by their rank in path probability
(speculative/eagle.py): a tree of the n best nodes would have kept the path's nodes of rank < n, so E[accepted](n)
is measured for every budget up to the one served (for greedy rows exactly; sampled rows' walks also depend on the
siblings tried first). A step costs the head's drafting (measured, independent of n) plus v(n), a target forward
over n + 1 positions in plain steps; the budget with the best (1 + E[accepted](n)) / (draft + v(n)) is the one to
serve. The held-out prediction reads train-eagle's per-depth agreement from the engine (a chain's
sum_d prod_{j<=d} top1_j, a floor for a tree, which also tries siblings)."""

from __future__ import annotations

import json

from specdeploy.bench.measure import measure_verify_costs
from specdeploy.bench.results import EagleTree, Summary
from specdeploy.runtime.engine import Engine
from specdeploy.speculative.speedup import speedup


def measure_eagle_tree(engine: Engine, summary: Summary, encoded: list[list[int]]) -> EagleTree:
    from specdeploy.speculative.eagle import EAGLE_DIR
    from specdeploy.speculative.eagle_head import REPORT_FILE

    proposer = engine.proposer
    spec = engine.pipeline.speculation.eagle
    trees = max(proposer.trees, 1)
    accepted_by_budget = [hits / trees for hits in proposer.budget_hits[1:]]  # budgets 1..max_nodes
    costs = measure_verify_costs(engine, encoded[0], engine.pipeline.limits.max_draft_tokens)
    draft = summary.proposal_cost_per_step
    predicted = [speedup(1 + accepted, draft + costs[n]) for n, accepted in enumerate(accepted_by_budget, start=1)]
    best = max(range(len(predicted)), key=predicted.__getitem__)
    held_out, chain = None, None
    report = engine.dir / EAGLE_DIR / REPORT_FILE
    if report.is_file():
        agreement = [depth["top1"] for depth in json.loads(report.read_text())["held_out"]]
        held_out, running = [], 1.0
        for top1 in agreement[:engine.num_draft_tokens]:
            running *= top1
            held_out.append(round(running, 4))
        chain = speedup(1 + sum(held_out), draft + costs[spec.max_nodes])
    return EagleTree(depth=engine.num_draft_tokens, top_k=spec.top_k, max_nodes=spec.max_nodes,
                     draft_cost_ratio=draft, verify_cost_ratio=costs[spec.max_nodes],
                     realized_accepted_per_step=summary.mean_accepted_length - 1,
                     accepted_by_budget=[round(a, 4) for a in accepted_by_budget],
                     predicted_speedup=predicted[-1], verify_costs=costs,
                     suggested_max_nodes=best + 1, suggested_predicted_speedup=predicted[best],
                     held_out_chain_acceptance=held_out, held_out_predicted_speedup=chain)
