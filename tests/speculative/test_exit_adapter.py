"""The early exit's adapter: untrained it is exactly the plain early exit; trained (here: random, non-zero) it changes
the draft's distribution q and never the target's p, so greedy output is plain decode's and the verify resumes from
the target's own states; an adapter for another target or exit layer is refused, naming its file."""

from __future__ import annotations

import pytest
import torch
from helpers.early_exit import EXIT, LAYERS, early_exit_pipeline, save_adapter, save_shallow_tail
from helpers.prompts import PROMPTS

from specdeploy.build.torch_engine import build
from specdeploy.errors import BuildError, PipelineError, SpecdeployError
from specdeploy.runtime.engine import Engine
from specdeploy.spec.pipeline import load_pipeline
from specdeploy.spec.request import NO_END_ID, GenerationRequest
from specdeploy.spec.sampling_params import SamplingParams
from specdeploy.speculative.early_exit import EarlyExitDraft
from specdeploy.speculative.exit_adapter import ADAPTER_DIR, ExitAdapter


@pytest.fixture(scope="module")
def target(tmp_path_factory):
    return save_shallow_tail(tmp_path_factory.mktemp("exit-adapter") / "target")


@pytest.fixture(scope="module")
def engines(target, tmp_path_factory):
    """Engines of the same target: the plain early exit, and with a random adapter (W_down's spread 0.5)."""
    root = tmp_path_factory.mktemp("exit-adapter-engines")
    save_adapter(root / "adapter", target, scale=0.5)  # named relative to the pipeline file below
    plain = build(load_pipeline(early_exit_pipeline(root, target)), root / "engines", quiet=True).directory
    adapted = build(load_pipeline(early_exit_pipeline(root, target, "tiny-adapted", adapter="adapter")),
                    root / "engines", quiet=True).directory
    return {"plain": plain, "adapted": adapted}


def greedy(prompt, gamma=None, tokens=40):
    return GenerationRequest(prompt, tokens, SamplingParams(), gamma, end_id=NO_END_ID)


def test_an_untrained_adapter_is_exactly_the_plain_early_exit(engines, target, tmp_path):
    engine = Engine(engines["plain"])
    folder = save_adapter(tmp_path / "untrained", target)
    untrained = ExitAdapter.load(folder, target.name, LAYERS, 64, EXIT)
    ids = torch.arange(engine.vocab_size)
    plain, adapted = EarlyExitDraft(engine.target, EXIT, ids), EarlyExitDraft(engine.target, EXIT, ids, untrained)
    tokens = torch.tensor([PROMPTS[0]])
    positions = torch.arange(len(PROMPTS[0]))[None]
    with torch.inference_mode():
        outputs = [draft.logits(draft(tokens, positions, engine.target.new_cache(1, 64)).hidden)
                   for draft in (plain, adapted)]
    assert torch.equal(*outputs)


def test_greedy_with_an_adapter_equals_plain(engines):
    engine = Engine(engines["adapted"])
    assert engine.proposer.model.adapter is not None
    accepted = rejected = 0
    for prompt in PROMPTS:
        plain = engine.start(greedy(prompt, 0)).run()
        generation = engine.start(greedy(prompt))
        assert generation.run() == plain
        accepted += generation.stats.accepted
        rejected += generation.stats.drafted - generation.stats.accepted
    assert accepted > 0 and rejected > 0


def test_the_adapter_changes_q_and_the_verify_resumes_from_the_targets_own_states(engines):
    """The drafts' distributions differ from the plain early exit's, while the states handed to the verify are the
    target's raw states entering the exit layer at the pending token and each drafted token."""
    plain, adapted = Engine(engines["plain"]), Engine(engines["adapted"])
    sequences = []
    for engine in (plain, adapted):
        sequences.append(engine.new_sequence(GenerationRequest(PROMPTS[1], 20, SamplingParams(temperature=1.0, seed=3),
                                                               3, end_id=NO_END_ID)))
        engine.decoder.prefill(sequences[-1], 0)
    proposals = [engine.proposer.propose([s], [3]) for engine, s in zip((plain, adapted), sequences)]
    assert not torch.allclose(proposals[0].q[0, 0], proposals[1].q[0, 0], atol=1e-3)  # the first draft's q

    sequence, proposal = sequences[1], proposals[1]
    layer, states = proposal.resume.start, proposal.resume.entering
    assert layer == EXIT and states.shape[1] == 4  # the pending token and three drafts
    tokens = sequence.committed + proposal.tokens[0, :3].tolist()
    target = adapted.target
    with torch.inference_mode():
        own = target(torch.tensor([tokens]), torch.arange(len(tokens))[None], target.new_cache(1, len(tokens) + 1),
                     capture=(EXIT,)).captured[0, sequence.cache_length:]
    torch.testing.assert_close(states[0], own, atol=1e-5, rtol=1e-5)
    with torch.inference_mode():
        assert not torch.allclose(adapted.proposer.model.adapter(states), states, atol=1e-3)  # the test could fail


def test_the_build_copies_the_adapter_into_the_engine(engines, target):
    folder = engines["adapted"] / ADAPTER_DIR
    assert sorted(path.name for path in folder.iterdir()) == ["config.json", "model.safetensors"]
    loaded = ExitAdapter.load(folder, target.name, LAYERS, 64, EXIT)
    assert float(loaded.down.weight.detach().abs().sum()) > 0


def test_a_changed_adapter_rebuilds_the_engine(target, tmp_path):
    save_adapter(tmp_path / "adapter", target, scale=0.5)
    pipeline = load_pipeline(early_exit_pipeline(tmp_path, target, adapter="adapter"))
    first = build(pipeline, tmp_path / "engines", quiet=True)
    assert first.built and not build(pipeline, tmp_path / "engines", quiet=True).built
    save_adapter(tmp_path / "adapter", target, scale=0.5, seed=1)
    assert build(pipeline, tmp_path / "engines", quiet=True).built


@pytest.mark.parametrize(("changes", "message"), [
    ({"exit_layer": 1}, "config.json: this exit adapter does not fit: it was trained at exit layer 1, "
                        "speculation.early_exit.exit_layer is 2"),
    ({"hidden_size": 32}, "config.json: this exit adapter does not fit: it is for hidden size 32, the target's is 64"),
])
def test_a_mismatched_adapter_is_refused_naming_its_file(target, tmp_path, changes, message):
    folder = save_adapter(tmp_path / "adapter", target, **changes)
    pipeline = load_pipeline(early_exit_pipeline(tmp_path, target, adapter=str(folder)))
    with pytest.raises(BuildError, match=rf"{tmp_path / 'adapter' / 'config.json'}: .*") as raised:
        build(pipeline, tmp_path / "engines", quiet=True)
    assert message in str(raised.value)


def test_an_adapter_for_another_target_is_refused(target, tmp_path):
    folder = save_adapter(tmp_path / "adapter", target)
    with pytest.raises(SpecdeployError, match="trained for target \\(4 layers\\), the target is other.gguf"):
        ExitAdapter.load(folder, "other.gguf", LAYERS, 64, EXIT)


def test_bad_adapter_settings_are_named(target, tmp_path):
    with pytest.raises(PipelineError, match="exit_layer: an adapter was trained at one exit layer"):
        load_pipeline(early_exit_pipeline(tmp_path, target, adapter="adapter", exit_layer="measured"))
    pipeline = load_pipeline(early_exit_pipeline(tmp_path, target, adapter="missing"))
    with pytest.raises(BuildError, match=f"adapter: {tmp_path / 'missing'} holds no exit adapter"):
        build(pipeline, tmp_path / "engines", quiet=True)


@pytest.mark.smollm2
def test_the_shipped_adapter_fits_its_shipped_pipeline():
    """pipelines/experimental/smollm2-exit-adapter.yaml's adapter folder loads for that pipeline's target at its exit
    layer, and it is trained (not the zero-initialised block, which would be the plain early exit)."""
    from helpers.repo import REPO

    from specdeploy.build.checkpoints import target_config
    from specdeploy.speculative.exit_adapter import target_name

    pipeline = load_pipeline(REPO / "pipelines" / "experimental" / "smollm2-exit-adapter.yaml").resolved()
    config, spec = target_config(pipeline), pipeline.speculation.early_exit
    adapter = ExitAdapter.load(spec.adapter, target_name(pipeline.target.checkpoint), config.num_layers,
                               config.hidden_size, spec.exit_layer)
    assert adapter.down.weight.abs().max() > 0


ADAPTED_SAMPLING = SamplingParams(temperature=1.0, top_k=4, top_p=0.95, repetition_penalty=1.2)
GENERATIONS, LENGTH = 2000, 3


@pytest.fixture(scope="module")
def adapted_marginals(engines):
    from helpers.marginals import exact_marginals

    return exact_marginals(Engine(engines["adapted"]), PROMPTS[1], ADAPTED_SAMPLING, LENGTH)


def test_sampled_with_an_adapter_emits_the_targets_distribution(engines, adapted_marginals):
    """The adapter changes q only: at T 1 with top-k, top-p and a penalty, the emitted tokens still follow the
    target's exact marginals."""
    from helpers.marginals import sampled_checks

    checks, accepted = sampled_checks(Engine(engines["adapted"]), PROMPTS[1], ADAPTED_SAMPLING, GENERATIONS,
                                      adapted_marginals)
    # the random adapter (spread 0.5) pulls q away from p: about 170 of 2000 generations take an accepted draft,
    # enough for the wrong rule below to fail this same test
    assert accepted > GENERATIONS // 20
    assert all(check.ok for check in checks), "\n".join(map(str, checks))


def test_with_an_adapter_a_wrong_rule_fails_the_same_test(engines, adapted_marginals, monkeypatch):
    """Negative control: the chain rule handed the target's distribution as the draft's accepts every adapted
    draft, and the emitted tokens then follow the adapter's q."""
    from helpers.marginals import sampled_checks

    from specdeploy.runtime import verify_shape
    from specdeploy.speculative.acceptance import accept

    monkeypatch.setattr(verify_shape, "accept",
                        lambda tokens, q, p, drafted, streams: accept(tokens, p[:, :-1], p, drafted, streams))
    checks, _ = sampled_checks(Engine(engines["adapted"]), PROMPTS[1], ADAPTED_SAMPLING, GENERATIONS,
                               adapted_marginals)
    assert not all(check.ok for check in checks), "\n".join(map(str, checks))
