"""EAGLE-3: the head's files as vLLM and SGLang load them, the build's checks, the trees the proposer grows, and
the engine: greedy EAGLE equals plain greedy token for token (alone and in a continuous batch, fp32), and sampled
EAGLE emits every token distributed as the target's, with a deliberately wrong rule failing the same test."""

from __future__ import annotations

import json

import pytest
import torch
from helpers.batch import assert_continuous_batch_equals_alone, assert_greedy_equals_plain_alone
from helpers.eagle_heads import DRAFT_VOCAB, HIDDEN, VOCAB, tiny_config, trained_tiny_head
from helpers.marginals import exact_marginals, sampled_checks
from helpers.pipelines import write_pipeline
from helpers.planted_bugs import PENALTY_BUGS, plant_penalty_bug
from helpers.prompts import PROMPTS
from helpers.tree_calibration import calibration
from safetensors.torch import load_file, save_file

from specdeploy.build.torch_engine import build
from specdeploy.errors import BuildError, PipelineError, SpecdeployError
from specdeploy.runtime.engine import Engine
from specdeploy.spec.pipeline import load_pipeline
from specdeploy.spec.request import NO_END_ID, GenerationRequest
from specdeploy.spec.sampling_params import SamplingParams
from specdeploy.speculative.eagle_head import Eagle3Head, EagleConfig, expected_shapes
from specdeploy.speculative.tree import accept_tree_typical


def random_head(seed: int = 0, feature_layers=(0, 1, 1)) -> Eagle3Head:
    """A random head over a reduced vocabulary (a random subset of the target's ids)."""
    torch.manual_seed(seed)
    head = Eagle3Head(tiny_config(feature_layers))
    ids = torch.randperm(VOCAB, generator=torch.Generator().manual_seed(seed))[:DRAFT_VOCAB].sort().values
    head.set_draft_vocabulary(ids)
    return head


def eagle_pipeline(directory, target, head_dir, gamma: int = 3, **eagle):
    return write_pipeline(directory / "tiny-eagle.yaml", name="tiny-eagle",
                          target={"checkpoint": {"source": "hf_dir", "path": str(target)}, "dtype": "float32"},
                          speculation={"method": "eagle", "num_draft_tokens": gamma,
                                       "eagle": {"head": str(head_dir), "top_k": 3, "max_nodes": 8, **eagle}},
                          limits={"max_batch_size": 4, "max_input_length": 64, "max_sequence_length": 256,
                                  "max_draft_tokens": 12})


@pytest.fixture(scope="module")
def eagle_engine(tiny_checkpoints, tiny_engines, tmp_path_factory):
    root = tmp_path_factory.mktemp("eagle")
    trained_tiny_head(tiny_engines["ngram"], root / "head")
    return build(load_pipeline(eagle_pipeline(root, tiny_checkpoints["target"], root / "head")), root / "engines",
                 quiet=True).directory


def test_head_files_are_what_the_ecosystem_loads(tmp_path):
    head = random_head()
    head.save(tmp_path)
    tensors = load_file(str(tmp_path / "model.safetensors"))
    # vLLM llama_eagle3.py and SGLang llama_eagle3.py read these names (speculative/eagle_head.py cites both)
    assert set(tensors) == {*expected_shapes(head.config), "d2t", "t2d"}
    assert tensors["midlayer.self_attn.q_proj.weight"].shape == (64, 2 * HIDDEN)
    assert tensors["fc.weight"].shape == (HIDDEN, 3 * HIDDEN)
    assert tensors["d2t"].dtype == torch.int64 and tensors["t2d"].dtype == torch.bool
    # draft id i is target id i + d2t[i]; t2d marks exactly those target ids
    targets = torch.arange(DRAFT_VOCAB) + tensors["d2t"]
    assert torch.equal(tensors["t2d"].nonzero().flatten(), targets)
    config = json.loads((tmp_path / "config.json").read_text())
    assert config["architectures"] == ["LlamaForCausalLMEagle3"] and config["draft_vocab_size"] == DRAFT_VOCAB
    # not vLLM's and SGLang's default layers: named with vLLM v0.34's top-level key, as layer inputs
    assert config["eagle_aux_hidden_state_layer_ids"] == [0, 1, 1] and "eagle_config" not in config
    loaded = Eagle3Head.load(tmp_path)
    assert torch.equal(loaded.draft_to_target, head.draft_to_target)
    for name in expected_shapes(head.config):
        torch.testing.assert_close(loaded.w(name), head.w(name).to(torch.bfloat16).float())


def test_the_captured_layers_read_in_each_convention():
    config = random_head().config.to_hf()
    del config["eagle_aux_hidden_state_layer_ids"]
    # no key: vLLM's and SGLang's default, the inputs of layers 2, L // 2 and L - 3
    assert EagleConfig.from_hf(config, target_layers=32).feature_layers == (2, 16, 29)
    with pytest.raises(SpecdeployError, match="names no target layers"):
        EagleConfig.from_hf(config)
    # SGLang and SpecForge name layer outputs: the inputs of the layers after them
    outputs = {**config, "eagle_config": {"eagle_aux_hidden_state_layer_ids": [1, 15, 28]}}
    assert EagleConfig.from_hf(outputs, target_layers=32).feature_layers == (2, 16, 29)
    # a head of the default layers is written without a key, so both engines capture what it was trained on
    default = EagleConfig.from_hf(config, target_layers=32)
    assert "eagle_aux_hidden_state_layer_ids" not in default.to_hf() and "eagle_config" not in default.to_hf()


def test_bad_head_files_are_named(tmp_path):
    head = random_head()
    head.save(tmp_path)
    tensors = load_file(str(tmp_path / "model.safetensors"))
    del tensors["midlayer.mlp.up_proj.weight"]
    save_file(tensors, str(tmp_path / "model.safetensors"))
    with pytest.raises(SpecdeployError, match="no tensor 'midlayer.mlp.up_proj.weight'"):
        Eagle3Head.load(tmp_path)
    tensors["midlayer.mlp.up_proj.weight"] = torch.zeros(3, 3)
    save_file(tensors, str(tmp_path / "model.safetensors"))
    with pytest.raises(SpecdeployError, match=r"up_proj.weight is \[3, 3\], the config makes it \[128, 64\]"):
        Eagle3Head.load(tmp_path)
    with pytest.raises(SpecdeployError, match="no EAGLE-3 head"):
        Eagle3Head.load(tmp_path / "missing")


def test_build_checks_the_head_against_the_target(tiny_checkpoints, tmp_path):
    random_head(feature_layers=(0, 1, 5)).save(tmp_path / "deep")
    with pytest.raises(BuildError, match=r"reads target layers \[0, 1, 5\]; the target has 2"):
        build(load_pipeline(eagle_pipeline(tmp_path, tiny_checkpoints["target"], tmp_path / "deep")), tmp_path / "e",
              quiet=True)
    with pytest.raises(BuildError, match="speculation.eagle.head: .* holds no EAGLE-3 head"):
        build(load_pipeline(eagle_pipeline(tmp_path, tiny_checkpoints["target"], tmp_path / "none")),
              tmp_path / "e", quiet=True)


@pytest.mark.parametrize(("eagle", "message"), [
    ({"head": ""}, "eagle.head: required"),
    ({"top_k": 0}, "top_k: must be ≥ 1"),
    ({"max_nodes": 13}, "max_nodes: 13 nodes are above limits.max_draft_tokens"),
])
def test_eagle_section_is_validated(tiny_checkpoints, tmp_path, eagle, message):
    with pytest.raises(PipelineError, match=message):
        load_pipeline(eagle_pipeline(tmp_path, tiny_checkpoints["target"], tmp_path / "h", **eagle))


def test_trees_are_well_formed_and_follow_the_budget(eagle_engine):
    """Each row's tree: parents before children, at most max_nodes nodes, no deeper than the row's gamma, distinct
    tokens among siblings, and every token in the draft vocabulary."""
    engine = Engine(eagle_engine, batch_size=3)
    sequences = []
    for row, prompt in enumerate(PROMPTS[:3]):
        sequences.append(engine.new_sequence(GenerationRequest(prompt, 20, SamplingParams(), None,
                                                               end_id=NO_END_ID)))
        engine.decoder.prefill(sequences[-1], row)
    allowed = set(engine.proposer.draft_to_target.tolist())
    for gammas in ([3, 3, 3], [1, 2, 3], [0, 3, 2]):
        proposal = engine.proposer.propose(sequences, gammas)
        for row, gamma in enumerate(gammas):
            parents, count = proposal.tree.parents[row], proposal.counts[row]
            assert count == len(parents) <= 8 and (count > 0) == (gamma > 0)
            assert all(parent <= index for index, parent in enumerate(parents))  # verify index i + 1 > parent
            assert proposal.tree.max_depth(row) <= gamma
            tokens = proposal.tokens[row, :count].tolist()
            assert set(tokens) <= allowed
            for parent in set(parents):
                siblings = [t for t, p in zip(tokens, parents) if p == parent]
                assert len(siblings) == len(set(siblings))
        engine.decoder.step(sequences)  # the proposer's state moves on with the committed tokens


def test_greedy_eagle_equals_plain_alone(eagle_engine):
    _, accepted = assert_greedy_equals_plain_alone(eagle_engine, 40)
    assert accepted > 0  # the trees were not all rejected: the walk past the root was exercised


def test_greedy_eagle_equals_plain_in_a_continuous_batch(eagle_engine):
    assert_continuous_batch_equals_alone(eagle_engine)


# ---------------------------------------------------------------------------------------------------------------
# Exact at T > 0: the marginal of each of the first emitted tokens, against the target's, computed exactly
# ---------------------------------------------------------------------------------------------------------------

SAMPLED = SamplingParams(temperature=1.0, top_k=4, repetition_penalty=1.2)
GENERATIONS, LENGTH = 3000, 3


@pytest.fixture(scope="module")
def marginals(eagle_engine):
    engine = Engine(eagle_engine)
    return exact_marginals(engine, PROMPTS[1], SAMPLED, LENGTH)


def test_sampled_eagle_emits_the_targets_distribution(eagle_engine, marginals):
    engine = Engine(eagle_engine)
    checks, accepted = sampled_checks(engine, PROMPTS[1], SAMPLED, GENERATIONS, marginals)
    assert accepted > GENERATIONS // 4  # the later positions were often emitted from accepted tree nodes
    assert all(check.ok for check in checks), "\n".join(map(str, checks))


def test_a_wrong_rule_fails_the_same_test(eagle_engine, marginals):
    """Negative control: Medusa's lossy typical acceptance in place of the exact rule is caught."""
    engine = Engine(eagle_engine)
    engine.decoder.tree_rule = accept_tree_typical
    checks, _ = sampled_checks(engine, PROMPTS[1], SAMPLED, GENERATIONS, marginals)
    assert not all(check.ok for check in checks), "\n".join(map(str, checks))


# Token by token (helpers/tree_calibration.py): every emitted token against its exact conditional distribution,
# with the sibling and penalty calibrations (its setting: T 1, top-k 4, penalty 1.5; 300 generations of 30 steps);
# the repeated trigram (PROMPTS[1]) has trees accepted past the root.


def test_sampled_eagle_is_calibrated_token_by_token(eagle_engine):
    """The exact rule: no impossible token and every z within ±4 (~11,000 tokens decided at nodes with two or more
    children, ~4,800 below the root)."""
    result = calibration(eagle_engine, PROMPTS[1])
    assert result.at_siblings > 8000 and result.below_root > 3000, result
    assert result.ok, result


@pytest.mark.parametrize("bug", list(PENALTY_BUGS))
def test_a_penalty_without_tree_ancestry_is_caught(eagle_engine, bug, monkeypatch):
    """Negative controls: the verify's repetition penalty without the tree's ancestry, each node seeing every node
    before it as in a chain (penalty_as_a_chain), or none of its path's drafts (penalty_without_drafts). At penalty
    1.5 with top-k 4 the wrong penalty moves tokens in and out of the top 4: in our runs 78 and 91 emitted tokens
    had exact probability 0 (the exact rule: none; P(no such token) is below e^-35 at that rate), and z_elsewhere
    -7.7 and z_seen +4.5."""
    plant_penalty_bug(monkeypatch, bug)
    result = calibration(eagle_engine, PROMPTS[1])
    assert result.impossible > 0, result


def test_bench_reports_the_budget_curve_its_prediction_and_a_suggested_budget(eagle_engine):
    """Bench counts what each smaller node budget would have accepted, predicts the served budget's speedup from it
    and the verify costs it measured, and suggests the budget they make best; the report survives its JSON."""
    from specdeploy.bench.results import BenchReport
    from specdeploy.bench.run import run_bench

    engine = Engine(eagle_engine)
    prompts = [{"prompt": "Say hello.", "kind": "open"}, {"prompt": "Count to five.", "kind": "open"}]
    report = run_bench(engine, prompts, 24, 0.0, 0, with_transformers=False, quiet=True)
    eagle = report.eagle
    assert eagle.depth == 3 and eagle.top_k == 3 and eagle.max_nodes == 8
    curve = eagle.accepted_by_budget
    assert len(curve) == 8 and curve == sorted(curve) and curve[-1] > 0  # more nodes never keep less
    assert eagle.verify_costs[0] == 1 and len(eagle.verify_costs) == 13
    assert 1 <= eagle.suggested_max_nodes <= 8
    assert eagle.suggested_predicted_speedup >= eagle.predicted_speedup > 0
    assert report.summary.predicted_speedup == eagle.predicted_speedup
    assert BenchReport.from_json(report.to_json()).eagle == eagle
