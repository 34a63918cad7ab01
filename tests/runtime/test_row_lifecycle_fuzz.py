"""Every proposer under one row-lifecycle fuzz (issue 64 point 3; helpers/row_fuzz.py drives it): for each method,
a seeded run of random request lifecycles through a 3-row scheduler, where after each event every active row's
target cache and proposer state are its own sequence's, and every request ends with its fp32 solo greedy tokens, or
cancelled with a prefix of them.

The suite runs one fixed seed and a small budget per method; `make fuzz` runs more seeds and requests
(ROW_FUZZ_SEEDS, ROW_FUZZ_REQUESTS). The fuzz has power: with lookahead's row move as it was before e3d4dd8
(`self.states[destination] = self.states.pop(source)`, a KeyError for a row admitted but not prefilled yet) it
fails (test_the_fuzz_finds_the_old_lookahead_row_move)."""

from __future__ import annotations

import os

import pytest
import yaml
from helpers.eagle_heads import DRAFT_VOCAB, VOCAB, tiny_config
from helpers.early_exit import early_exit_pipeline, save_shallow_tail
from helpers.pipelines import tiny_pipeline, write_pipeline
from helpers.row_fuzz import RowFuzz

from specdeploy.build.torch_engine import build
from specdeploy.spec.pipeline import load_pipeline
from specdeploy.speculative.lookahead import LookaheadProposer

SEEDS = [int(seed) for seed in os.environ.get("ROW_FUZZ_SEEDS", "0").split(",")]
REQUESTS = int(os.environ.get("ROW_FUZZ_REQUESTS", "30"))
METHODS = ["draft_target", "ngram", "medusa", "eagle", "lookahead", "early_exit", "moe"]


def method_pipeline(method: str, root, target) -> object:
    """A tiny fp32 pipeline of `method` on the tiny target (early exit: on a target made for it)."""
    import torch

    if method in ("draft_target", "ngram"):
        return tiny_pipeline(root, f"fuzz-{method}", target, method=method)
    if method == "lookahead":
        return tiny_pipeline(root, "fuzz-lookahead", target, method="lookahead", gamma=4,
                             speculation_extra={"lookahead": {"window": 2, "ngram": 3, "verification_set": 2}})
    if method == "early_exit":
        return early_exit_pipeline(root, save_shallow_tail(root / "shallow"))
    if method == "moe":  # an MoE target split from the tiny dense one, an int4 copy of it drafting
        path = tiny_pipeline(root, "fuzz-moe", target)
        spec = yaml.safe_load(path.read_text())
        spec["target"]["moe"] = {"method": "neuron_split", "experts": 4, "experts_per_token": 2,
                                 "calibration_tokens": 256}
        path.write_text(yaml.safe_dump(spec))
        return path
    limits = {"max_batch_size": 4, "max_input_length": 64, "max_sequence_length": 256, "max_draft_tokens": 12}
    checkpoint = {"checkpoint": {"source": "hf_dir", "path": str(target)}, "dtype": "float32"}
    if method == "medusa":
        from specdeploy.speculative.medusa import MedusaHeads

        torch.manual_seed(0)
        MedusaHeads(64, 3, 1, None).save(root / "heads.safetensors")
        return write_pipeline(root / "fuzz-medusa.yaml", name="fuzz-medusa", target=checkpoint, limits=limits,
                              speculation={"method": "medusa", "num_draft_tokens": 3, "medusa": {
                                  "heads": str(root / "heads.safetensors"), "num_heads": 3,
                                  "choices": [[0], [1], [0, 0], [0, 1], [0, 0, 0]]}})
    from specdeploy.speculative.eagle_head import Eagle3Head

    torch.manual_seed(0)
    head = Eagle3Head(tiny_config())
    head.set_draft_vocabulary(torch.randperm(VOCAB, generator=torch.Generator().manual_seed(0))[:DRAFT_VOCAB].sort()
                              .values)
    head.save(root / "head")
    return write_pipeline(root / "fuzz-eagle.yaml", name="fuzz-eagle", target=checkpoint, limits=limits,
                          speculation={"method": "eagle", "num_draft_tokens": 3,
                                       "eagle": {"head": str(root / "head"), "top_k": 3, "max_nodes": 8}})


@pytest.fixture(scope="module")
def engine_dirs(tiny_checkpoints, tmp_path_factory) -> dict:
    built = {}

    def engine_dir(method: str):
        if method not in built:
            root = tmp_path_factory.mktemp(f"fuzz-{method}")
            path = method_pipeline(method, root, tiny_checkpoints["target"])
            built[method] = build(load_pipeline(path), root / "engines", quiet=True).directory
        return built[method]

    return engine_dir


@pytest.mark.parametrize("seed", SEEDS)
@pytest.mark.parametrize("method", METHODS)
def test_every_row_keeps_its_own_state_and_every_request_its_solo_tokens(engine_dirs, method, seed):
    coverage = RowFuzz(engine_dirs(method), seed, REQUESTS).run()
    # the events the fuzz is for happened (the fixed seed and budget reach each of them)
    assert coverage.ended_at_prefill and coverage.moves and coverage.full_batches and coverage.joined_mid_iteration
    assert coverage.cancelled_before_first_step + coverage.cancelled_in_burst > 0, coverage


def test_the_fuzz_finds_the_old_lookahead_row_move(engine_dirs, monkeypatch):
    """Power: lookahead's move_row as it was before e3d4dd8 raises KeyError for a row admitted but not prefilled
    yet; the scheduler fails (every request ends with that error) and the fuzz says so."""

    def old_move_row(self, source: int, destination: int) -> None:
        self.states[destination] = self.states.pop(source)

    monkeypatch.setattr(LookaheadProposer, "move_row", old_move_row)
    with pytest.raises(AssertionError, match="KeyError"):
        RowFuzz(engine_dirs("lookahead"), SEEDS[0], REQUESTS).run()
