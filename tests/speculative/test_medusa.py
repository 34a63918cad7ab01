"""Medusa heads: the heads file under TensorRT-LLM's keys (both ways), the build's checks, and the proposer in the
engine: greedy Medusa equals plain greedy token for token, alone and in a continuous batch (fp32), and sampled
Medusa emits each token as the target's (helpers/tree_calibration.py), a penalty without the tree's ancestry failing
the same check."""

from __future__ import annotations

import pytest
import torch
from helpers.batch import assert_continuous_batch_equals_alone, assert_greedy_equals_plain_alone
from helpers.pipelines import write_pipeline
from helpers.planted_bugs import PENALTY_BUGS, plant_penalty_bug
from helpers.prompts import PROMPTS
from helpers.tree_calibration import calibration
from safetensors.torch import load_file

from specdeploy.build.torch_engine import build
from specdeploy.errors import BuildError, PipelineError
from specdeploy.runtime.engine import Engine
from specdeploy.spec.pipeline import load_pipeline
from specdeploy.spec.request import NO_END_ID, GenerationRequest
from specdeploy.spec.sampling_params import SamplingParams
from specdeploy.speculative.medusa import MedusaHeads, export_trtllm
from specdeploy.workflows import build_torch_engine

HIDDEN, VOCAB = 64, 128  # the tiny checkpoints' sizes (helpers/tiny_models.py)


def random_heads(num_heads: int = 3, num_layers: int = 1, own: bool = False, seed: int = 0) -> MedusaHeads:
    generator = torch.Generator().manual_seed(seed)
    projections = torch.randn(num_heads, VOCAB, HIDDEN, generator=generator) if own else None
    heads = MedusaHeads(HIDDEN, num_heads, num_layers, projections)
    for head in heads.blocks:
        for block in head:
            block.weight.data = torch.randn(HIDDEN, HIDDEN, generator=generator) * 0.2
            block.bias.data = torch.randn(HIDDEN, generator=generator) * 0.1
    return heads


def medusa_pipeline(directory, target, heads_file, serving: dict | None = None, **medusa):
    extra = {"serving": serving} if serving else {}
    return write_pipeline(directory / "tiny-medusa.yaml", name="tiny-medusa", **extra,
                          target={"checkpoint": {"source": "hf_dir", "path": str(target)}, "dtype": "float32"},
                          speculation={"method": "medusa", "num_draft_tokens": 3,
                                       "medusa": {"heads": str(heads_file), "num_heads": 3,
                                                  "choices": [[0], [1], [0, 0], [0, 0, 0]], **medusa}},
                          limits={"max_batch_size": 4, "max_input_length": 64, "max_sequence_length": 256,
                                  "max_draft_tokens": 12})


@pytest.fixture(scope="module")
def medusa_engine(tiny_checkpoints, tmp_path_factory):
    root = tmp_path_factory.mktemp("medusa")
    random_heads().save(root / "heads.safetensors")
    choices = [[0], [1], [2], [0, 0], [0, 1], [1, 0], [0, 0, 0], [0, 1, 0]]
    path = medusa_pipeline(root, tiny_checkpoints["target"], root / "heads.safetensors", choices=choices)
    return build(load_pipeline(path), root / "engines", quiet=True).directory


@pytest.mark.parametrize("num_layers", [1, 2])
@pytest.mark.parametrize("own", [False, True])
def test_heads_file_round_trips_under_trtllm_keys(tmp_path, num_layers, own):
    heads = random_heads(num_layers=num_layers, own=own)
    heads.save(tmp_path / "heads.safetensors")
    keys = set(load_file(str(tmp_path / "heads.safetensors")))
    expected = {f"{k}.{j}.linear.{p}" for k in range(3) for j in range(num_layers) for p in ("weight", "bias")}
    if own:
        expected |= {f"{k}.{num_layers}.weight" for k in range(3)}
    assert keys == expected
    loaded = MedusaHeads.load(tmp_path / "heads.safetensors")
    h = torch.randn(5, HIDDEN)
    shared = torch.nn.Linear(HIDDEN, VOCAB, bias=False)
    torch.testing.assert_close(loaded.logits(h, shared), heads.logits(h, shared))
    # a shallow tree asks for its first heads only: the same logits, fewer rows
    torch.testing.assert_close(loaded.logits(h, shared, 2), heads.logits(h, shared)[:, :2])


def test_export_writes_the_shared_head_once_per_head_and_reads_back(tmp_path):
    """TensorRT-LLM's converter wants every head's projection: exported, a shared head gives the same logits as
    the heads sharing it."""
    heads = random_heads()
    lm_head = torch.randn(VOCAB, HIDDEN)
    export_trtllm(heads, lm_head, tmp_path / "medusa_lm_head.safetensors", torch.float32)
    tensors = load_file(str(tmp_path / "medusa_lm_head.safetensors"))
    # What TensorRT-LLM's loader reads (NVIDIA/TensorRT-LLM tensorrt_llm/models/medusa/weight.py, load_medusa_hf):
    # for every head h and layer l < num_medusa_layers, f"{h}.{l}.linear.weight" [H, H] and f"{h}.{l}.linear.bias"
    # [H], then f"{h}.{num_medusa_layers}.weight" [V, H], the head's LM head; nothing else is read.
    expected = {}
    for h in range(3):
        expected.update({f"{h}.0.linear.weight": (HIDDEN, HIDDEN), f"{h}.0.linear.bias": (HIDDEN,),
                         f"{h}.1.weight": (VOCAB, HIDDEN)})
    assert {name: tuple(t.shape) for name, t in tensors.items()} == expected
    for k in range(3):
        assert torch.equal(tensors[f"{k}.1.weight"], lm_head)
    exported = MedusaHeads.from_state(tensors)
    h = torch.randn(4, HIDDEN)
    torch.testing.assert_close(exported.logits(h, None), heads.logits(h, lambda x: x @ lm_head.T))


def test_a_file_that_is_not_heads_is_refused(tmp_path):
    from safetensors.torch import save_file

    from specdeploy.errors import SpecdeployError

    save_file({"model.embed_tokens.weight": torch.zeros(2, 2)}, str(tmp_path / "x.safetensors"))
    with pytest.raises(SpecdeployError, match="no Medusa heads"):
        MedusaHeads.load(tmp_path / "x.safetensors")


def test_greedy_medusa_equals_plain_alone(medusa_engine):
    drafted, _ = assert_greedy_equals_plain_alone(medusa_engine, 40)
    assert drafted > 0


def test_greedy_medusa_equals_plain_in_a_continuous_batch(medusa_engine):
    assert_continuous_batch_equals_alone(medusa_engine)


def test_sampled_medusa_is_seeded(medusa_engine):
    engine = Engine(medusa_engine)
    params = SamplingParams(temperature=0.9, top_p=0.9, repetition_penalty=1.1, seed=3)
    first, second = (engine.start(GenerationRequest(PROMPTS[0], 30, params, None)).run() for _ in range(2))
    assert first == second


# Token by token (helpers/tree_calibration.py): every emitted token against its exact conditional distribution,
# with the sibling and penalty calibrations (its setting: T 1, top-k 4, penalty 1.5; 300 generations of 30 steps);
# the repeated trigram (PROMPTS[1]) has trees accepted past the root.


def test_sampled_medusa_is_calibrated_token_by_token(medusa_engine):
    """The exact rule: no impossible token and every z within ±4 (~10,800 tokens decided at nodes with two or more
    children, ~3,300 below the root)."""
    result = calibration(medusa_engine, PROMPTS[1])
    assert result.at_siblings > 8000 and result.below_root > 2000, result
    assert result.ok, result


@pytest.mark.parametrize("bug", list(PENALTY_BUGS))
def test_a_penalty_without_tree_ancestry_is_caught(medusa_engine, bug, monkeypatch):
    """Negative controls: the verify's repetition penalty without the tree's ancestry, each node seeing every node
    before it as in a chain (penalty_as_a_chain), or none of its path's drafts (penalty_without_drafts). At penalty
    1.5 with top-k 4 the wrong penalty moves tokens in and out of the top 4: in our runs 35 and 60 emitted tokens
    had exact probability 0 (the exact rule: none; P(no such token) is below e^-35 at that rate), and z_elsewhere
    -2.6 and z_seen +3.97."""
    plant_penalty_bug(monkeypatch, bug)
    result = calibration(medusa_engine, PROMPTS[1])
    assert result.impossible > 0, result


def test_build_checks_the_heads_against_the_spec_and_the_target(tiny_checkpoints, tmp_path):
    heads = tmp_path / "heads.safetensors"
    random_heads(num_heads=2).save(heads)
    with pytest.raises(BuildError, match="num_heads is 3 but .* has 2"):
        build(load_pipeline(medusa_pipeline(tmp_path, tiny_checkpoints["target"], heads)), tmp_path / "e", quiet=True)
    MedusaHeads(32, 3).save(heads)
    with pytest.raises(BuildError, match="hidden size 32, the target's is 64"):
        build(load_pipeline(medusa_pipeline(tmp_path, tiny_checkpoints["target"], heads)), tmp_path / "e", quiet=True)
    with pytest.raises(BuildError, match="not found"):
        build(load_pipeline(medusa_pipeline(tmp_path, tiny_checkpoints["target"], tmp_path / "none.safetensors")),
              tmp_path / "e", quiet=True)


@pytest.fixture(scope="module")
def medusa_vocab_engine(tiny_checkpoints, tmp_path_factory):
    """The fixture's heads proposing from the target head's rows of 32 corpus tokens of the 128."""
    root = tmp_path_factory.mktemp("medusa-vocab")
    random_heads().save(root / "heads.safetensors")
    path = medusa_pipeline(root, tiny_checkpoints["target"], root / "heads.safetensors", draft_vocab=32)
    return build(load_pipeline(path), root / "engines", quiet=True).directory


def test_heads_with_a_draft_vocabulary_propose_only_it_and_greedy_equals_plain(medusa_vocab_engine, medusa_engine):
    import json

    vocabulary = set(json.loads((medusa_vocab_engine / "medusa" / "draft_vocab.json").read_text())["draft_vocab"])
    assert len(vocabulary) == 32
    whole = json.loads((medusa_engine / "medusa" / "draft_vocab.json").read_text())["draft_vocab"]
    assert whole == list(range(VOCAB))  # draft_vocab 0: every id
    engine = Engine(medusa_vocab_engine)
    sequence = engine.new_sequence(GenerationRequest(PROMPTS[0], 30, SamplingParams(temperature=1.0, seed=3), 3,
                                                     end_id=NO_END_ID))
    engine.decoder.prefill(sequence, 0)
    proposed, whole_proposed = set(), set()
    full = Engine(medusa_engine).proposer
    with torch.inference_mode():
        for _ in range(6):
            proposed |= set(engine.proposer.propose([sequence], [3]).tokens[0].tolist())
            # the whole head, from the same states, proposes outside those 32 (else this check could not fail)
            full.last[:1] = engine.proposer.last[:1]
            whole_proposed |= set(full.propose([sequence], [3]).tokens[0].tolist())
            engine.decoder.step([sequence])
    assert proposed <= vocabulary and len(proposed) > 1
    assert not whole_proposed <= vocabulary
    drafted, accepted = assert_greedy_equals_plain_alone(medusa_vocab_engine, 40)
    assert drafted > 0 and accepted > 0


def test_sampled_medusa_with_a_draft_vocabulary_is_calibrated_token_by_token(medusa_vocab_engine):
    """A draft vocabulary changes what is proposed, never what is emitted: the exact rule's check still holds."""
    result = calibration(medusa_vocab_engine, PROMPTS[1])
    assert result.at_siblings > 2000, result
    assert result.ok, result


def test_a_penalty_without_tree_ancestry_is_caught_with_a_draft_vocabulary(medusa_vocab_engine, monkeypatch):
    """The negative control for the check above: the same wrong penalty that fails the whole-head engine's."""
    plant_penalty_bug(monkeypatch, "penalty_as_a_chain")
    assert calibration(medusa_vocab_engine, PROMPTS[1]).impossible > 0


def test_backend_trtllm_refuses_a_draft_vocabulary(tiny_checkpoints, tmp_path):
    from helpers.pipelines import trtllm_pipeline

    medusa = {"heads": str(tmp_path / "heads.safetensors"), "num_heads": 3, "choices": [[0], [0, 0]]}
    for draft_vocab, refused in ((0, False), (32, True)):
        path = trtllm_pipeline(tmp_path, tiny_checkpoints["target"], speculation={
            "method": "medusa", "num_draft_tokens": 2, "medusa": {**medusa, "draft_vocab": draft_vocab}})
        if not refused:
            assert load_pipeline(path).speculation.medusa.draft_vocab == 0
            continue
        with pytest.raises(PipelineError, match="speculation.medusa.draft_vocab: TensorRT-LLM's Medusa reads every "
                                                "head's whole vocabulary projection: set draft_vocab: 0"):
            load_pipeline(path)


def test_a_draft_vocabulary_needs_heads_that_share_the_target_head(tiny_checkpoints, tmp_path):
    heads = tmp_path / "heads.safetensors"
    random_heads(own=True).save(heads)
    with pytest.raises(BuildError, match="draft_vocab takes rows of the target's head, and .* their own projections: "
                                         "set draft_vocab: 0"):
        build(load_pipeline(medusa_pipeline(tmp_path, tiny_checkpoints["target"], heads, draft_vocab=32)),
              tmp_path / "e", quiet=True)


def test_a_measured_gamma_cap_cuts_the_tree_at_its_depth_or_turns_drafting_off(tiny_checkpoints, tmp_path):
    """serving.policy.gamma_cap: measured on a tree method: the build decodes at every depth below the tree's, and
    the engine serves the cap it wrote, a tree cut to its first levels, or plain decode at 0."""
    import json

    heads = tmp_path / "heads.safetensors"
    random_heads().save(heads)
    path = medusa_pipeline(tmp_path, tiny_checkpoints["target"], heads, serving={"policy": {"gamma_cap": "measured"}})
    directory = build_torch_engine(load_pipeline(path), tmp_path / "engines", quiet=True).directory
    policy = directory / "measured_policy.json"
    record = json.loads(policy.read_text())
    assert set(record["realized_speedup_by_gamma"]) == {"1", "2", "3"}  # the tree [[0], [1], [0, 0], [0, 0, 0]]
    plain = Engine(directory).start(GenerationRequest(PROMPTS[1], 30, SamplingParams(), 0, end_id=NO_END_ID)).run()
    for cap, depth_one_nodes in ((3, 2), (1, 2), (0, 0)):
        policy.write_text(json.dumps(record | {"gamma_cap": cap}))
        generation = Engine(directory).start(GenerationRequest(PROMPTS[1], 30, SamplingParams(), None,
                                                               end_id=NO_END_ID))
        assert generation.run() == plain
        stats = generation.stats
        assert len(stats.drafted_per_position) == cap  # the deepest level any step proposed
        assert stats.drafted <= stats.steps * (depth_one_nodes if cap < 3 else 4)
        assert (stats.drafted > 0) == (cap > 0)


def test_bench_sweeps_a_tree_by_depth_and_measures_its_cap_again(tiny_checkpoints, tmp_path):
    """bench --measure-gamma-cap on a tree method: every depth below the tree's decoded (a deeper gamma serves the
    whole tree, so 4 is not), the cap picked from them written into the engine, and the report names what it now
    serves."""
    import json

    from helpers.cli import run_bench

    heads = tmp_path / "heads.safetensors"
    random_heads().save(heads)
    path = medusa_pipeline(tmp_path, tiny_checkpoints["target"], heads, serving={"policy": {"gamma_cap": "measured"}})
    engines = tmp_path / "engines"
    directory = build(load_pipeline(path), engines, quiet=True).directory
    result, report = run_bench(path, engines, {"abcabcabc": "open", "hello": "open"}, "--max-tokens", "16",
                               "--no-transformers", "--gammas", "1,2,4", "--measure-gamma-cap")
    assert result.returncode == 0, result.stderr
    assert list(report["gamma_sweep"]) == ["1", "2"]  # the tree [[0], [1], [0, 0], [0, 0, 0]] is 3 deep
    measured = json.loads((directory / "measured_policy.json").read_text())
    assert measured["realized_speedup_by_gamma"] == {**report["gamma_sweep"], "3": report["speedup"]}
    assert report["gamma_cap"] == measured["gamma_cap"] == Engine(directory).pipeline.serving.policy.gamma_cap


@pytest.mark.parametrize(("medusa", "message"), [
    ({"choices": [[0], [0, 0], [0, 0, 0], [0, 0, 0, 0]]}, "4 deep but there are 3 heads"),
    ({"draft_vocab": -1}, r"medusa.draft_vocab: must be ≥ 0 \(0: the whole head\), got -1"),
    ({"choices": [[0, 1]]}, r"\[0, 1\] has no parent"),
    ({"heads": ""}, "medusa.heads: required"),
])
def test_medusa_section_is_validated(tiny_checkpoints, tmp_path, medusa, message):
    with pytest.raises(PipelineError, match=message):
        load_pipeline(medusa_pipeline(tmp_path, tiny_checkpoints["target"], tmp_path / "h", **medusa))


def test_bench_reports_the_tree_its_prediction_and_a_suggested_tree(tiny_checkpoints, tmp_path):
    """Bench measures the heads' accuracy on its own prompts' answers, predicts the speedup of the served tree from
    it and the costs it measured, compares the held-out accuracy train-medusa wrote beside the heads, and suggests
    the tree the builder picks for this machine."""
    import json

    from specdeploy.bench.run import run_bench
    from specdeploy.spec.token_tree import TokenTree
    from specdeploy.speculative.tree_builder import expected_accepted

    heads = tmp_path / "heads.safetensors"
    random_heads().save(heads)
    accuracy = [{"by_rank": [0.5, 0.2, 0.1]}, {"by_rank": [0.3, 0.1]}, {"by_rank": [0.2]}]
    heads.with_suffix(".json").write_text(json.dumps({"held_out_accuracy": accuracy}))
    engine = Engine(build(load_pipeline(medusa_pipeline(tmp_path, tiny_checkpoints["target"], heads)),
                          tmp_path / "engines", quiet=True).directory)
    prompts = [{"prompt": "Say hello.", "kind": "open"}, {"prompt": "Count to five.", "kind": "open"}]
    report = run_bench(engine, prompts, 16, 0.0, 0, with_transformers=False, quiet=True).medusa
    paths = [(0,), (1,), (0, 0), (0, 0, 0)]
    assert report.tree == [list(p) for p in paths] and report.tree_size == 4
    assert report.expected_accepted_per_step_held_out == pytest.approx(expected_accepted(paths, [
        a["by_rank"] for a in accuracy]))
    assert 0 <= report.expected_accepted_per_step <= 4 and len(report.head_top1_here) == 3
    assert report.predicted_speedup > 0 and len(report.verify_costs) == 13 and report.verify_costs[0] == 1
    TokenTree.from_choices(report.suggested_tree)


def test_typical_acceptance_is_wired_and_accepts_more_than_the_exact_rule(tiny_checkpoints, tmp_path):
    """acceptance: typical (lossy) makes sampled rows accept any candidate the target finds plausible; on the tiny
    model's flat distributions that is far more than the exact rule accepts. Greedy rows stay exact."""
    heads = tmp_path / "heads.safetensors"
    random_heads().save(heads)
    engines = {}
    for acceptance in ("exact", "typical"):
        path = medusa_pipeline(tmp_path, tiny_checkpoints["target"], heads)
        text = path.read_text().replace("method: medusa", f"method: medusa\n  acceptance: {acceptance}")
        path.write_text(text.replace("name: tiny-medusa", f"name: tiny-medusa-{acceptance}"))
        engines[acceptance] = Engine(build(load_pipeline(path), tmp_path / "engines", quiet=True).directory)
    accepted = {}
    for acceptance, engine in engines.items():
        params = SamplingParams(temperature=1.0, seed=4)
        accepted[acceptance] = sum(run_accepted(engine, p, params) for p in PROMPTS)
    assert accepted["typical"] > 3 * max(accepted["exact"], 1)
    greedy = [run_tokens(engines[a], PROMPTS[0]) for a in ("exact", "typical")]
    assert greedy[0] == greedy[1]


def run_accepted(engine: Engine, prompt: list[int], params: SamplingParams) -> int:
    generation = engine.start(GenerationRequest(prompt, 40, params, None, end_id=NO_END_ID))
    generation.run()
    return generation.stats.accepted


def run_tokens(engine: Engine, prompt: list[int]) -> list[int]:
    return engine.start(GenerationRequest(prompt, 30, SamplingParams(), None, end_id=NO_END_ID)).run()


@pytest.mark.smollm2
@pytest.mark.slow
def test_medusa_serves_through_triton_with_per_head_metrics(tmp_path):
    """The shipped Medusa pipeline in fp32 behind the real tritonserver: greedy text over gRPC equals plain greedy
    in-process (both entry points), and the accepted tokens are counted per head (position)."""
    import yaml
    from helpers.repo import REPO

    from specdeploy.package.repository import write_repository
    from specdeploy.serve.client import generate
    from specdeploy.serve.metrics_scrape import scrape, total
    from specdeploy.serve.tritonserver import TritonServer

    spec = yaml.safe_load((REPO / "pipelines" / "smollm2-medusa.yaml").read_text())
    spec["target"]["dtype"] = "float32"
    spec["target"].pop("weight_only")  # the int4 kernels take bf16 activations
    spec["speculation"]["medusa"]["heads"] = str(REPO / "pipelines" / spec["speculation"]["medusa"]["heads"])
    engine_dir = build(load_pipeline(write_pipeline(tmp_path / "medusa-fp32.yaml", **spec)), tmp_path / "engines",
                       quiet=True).directory
    engine = Engine(engine_dir)
    prompt = "Write a Python function that returns the square of a number."
    expected = engine.decode(engine.start(GenerationRequest(engine.encode_prompt(prompt), 40, SamplingParams(), 0))
                             .run())
    repository = write_repository(engine_dir, tmp_path / "repository")
    with TritonServer(repository, log_file=tmp_path / "tritonserver.log") as server:
        for model in ("speculative", "ensemble"):
            chunks = list(generate(server.grpc_url, prompt, 40, model=model))
            assert "".join(c.text for c in chunks) == expected, model
            assert chunks[-1].statistics["total_accepted_draft_tokens"] > 0
        values = scrape(server.metrics_url)
        assert total(values, "specdeploy_accepted_tokens_per_position_total", position="1", method="medusa") > 0
