"""The Mixtral-architecture target: parity with transformers in both checkpoint layouts, grouped experts against a
per-token reference, the MoE derived from a dense model, and speculation on an MoE target."""

from __future__ import annotations

import dataclasses
import json
import types
from pathlib import Path

import pytest
import torch
import yaml
from helpers.cli import run_bench, run_cli
from helpers.collector import Collector
from helpers.pipelines import tiny_pipeline
from helpers.prompts import PROMPTS
from helpers.tiny_models import TINY, char_tokenizer, save_tiny_checkpoint
from safetensors.torch import load_file, save_file
from transformers import LlamaForCausalLM, MixtralConfig, MixtralForCausalLM

from specdeploy.bench.moe_curve import experts_touched
from specdeploy.bench.moe_quality import MoeQuality
from specdeploy.bench.quant_quality import QuantQuality
from specdeploy.bench.run import run_benches
from specdeploy.build.checkpoints import load_checkpoint
from specdeploy.build.hf_export import export_hf
from specdeploy.build.moe_derive import derive_moe
from specdeploy.build.moe_neuron_split import balanced_assignment
from specdeploy.build.torch_engine import build
from specdeploy.errors import BuildError, PipelineError, SpecdeployError
from specdeploy.models.config import ModelConfig
from specdeploy.models.llama import LlamaModel
from specdeploy.models.moe import MixtralModel, SparseMoE, route
from specdeploy.models.quantize import Int4Linear, Int8Linear
from specdeploy.runtime.engine import Engine
from specdeploy.runtime.scheduler import Scheduler
from specdeploy.spec.checkpoint import CheckpointSpec
from specdeploy.spec.pipeline import MoESpec, PipelineSpec, PolicySpec, ServingSpec, TargetSpec, load_pipeline
from specdeploy.spec.prompt_sets import load_prompts
from specdeploy.spec.request import GenerationRequest
from specdeploy.spec.sampling_params import SamplingParams
from specdeploy.tune.calibration import CALIBRATION_TOKENS, calibration_prompts
from specdeploy.tune.gamma_cap import lift_gamma_cap, sweep_gammas
from specdeploy.workflows import build_torch_engine

MOE = dict(TINY, intermediate_size=32, num_local_experts=4, num_experts_per_tok=2)


def save_tiny_mixtral(directory: Path, seed: int, layout: str) -> Path:
    """A random tiny Mixtral as a Hugging Face directory, its experts per expert (`block_sparse_moe.experts.N.w1`,
    as transformers writes them) or packed (transformers 5's `mlp.experts.gate_up_proj`)."""
    torch.manual_seed(seed)
    model = MixtralForCausalLM(MixtralConfig(**MOE))
    with torch.no_grad():
        for parameter in model.parameters():
            if parameter.dim() >= 2:
                parameter.mul_(4.0)
    model.save_pretrained(directory)
    char_tokenizer(MOE["vocab_size"]).save_pretrained(directory)
    if layout == "packed":
        save_file({name: tensor.contiguous() for name, tensor in model.state_dict().items()},
                  str(directory / "model.safetensors"))
    return directory


@pytest.fixture(scope="module")
def mixtral_dirs(tmp_path_factory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("mixtral")
    return {layout: save_tiny_mixtral(root / layout, seed=0, layout=layout) for layout in ("per_expert", "packed")}


def test_the_two_layouts_hold_the_keys_they_claim(mixtral_dirs):
    per_expert = load_file(str(mixtral_dirs["per_expert"] / "model.safetensors"))
    packed = load_file(str(mixtral_dirs["packed"] / "model.safetensors"))
    assert "model.layers.0.block_sparse_moe.experts.3.w2.weight" in per_expert
    assert "model.layers.0.block_sparse_moe.gate.weight" in per_expert
    assert packed["model.layers.1.mlp.experts.gate_up_proj"].shape == (4, 64, 64)
    assert not any("block_sparse_moe" in name for name in packed)


@pytest.mark.parametrize("layout", ["per_expert", "packed"])
def test_mixtral_matches_transformers_in_both_layouts(mixtral_dirs, layout, tmp_path):
    reference = MixtralForCausalLM.from_pretrained(mixtral_dirs["packed"]).eval()
    spec = CheckpointSpec(source="hf_dir", path=str(mixtral_dirs[layout]))
    pipeline = PipelineSpec(name="moe", target=TargetSpec(checkpoint=spec))
    checkpoint = load_checkpoint(spec, pipeline)
    assert checkpoint.config.architecture == "mixtral" and checkpoint.config.num_experts == 4
    model = MixtralModel(checkpoint.config, checkpoint.state)
    tokens = torch.randint(3, 128, (1, 24), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        expected = reference(tokens).logits
    full = model.logits(model(tokens, torch.arange(24)[None], model.new_cache(1, 64)).hidden)
    torch.testing.assert_close(full, expected, atol=1e-5, rtol=1e-5)
    cache = model.new_cache(1, 64)  # prefill then one token at a time, as decode runs
    pieces = [model.logits(model(tokens[:, :10], torch.arange(10)[None], cache).hidden)]
    for position in range(10, 24):
        cache.rewind(0, position)
        pieces.append(model.logits(model(tokens[:, position:position + 1], torch.tensor([[position]]), cache).hidden))
    torch.testing.assert_close(torch.cat(pieces, 1), expected, atol=1e-5, rtol=1e-5)
    prompt = tokens[:, :8]
    greedy = reference.generate(prompt, max_new_tokens=12, do_sample=False)[0, 8:].tolist()
    ours, cache, ids = [], model.new_cache(1, 64), prompt[0].tolist()
    hidden = model(prompt, torch.arange(8)[None], cache).hidden
    for step in range(12):
        ours.append(int(model.logits(hidden[:, -1]).argmax()))
        cache.rewind(0, 8 + step)
        hidden = model(torch.tensor([[ours[-1]]]), torch.tensor([[8 + step]]), cache).hidden
    assert ours == greedy and ids == prompt[0].tolist()


def naive_moe(layer: SparseMoE, x: torch.Tensor) -> torch.Tensor:
    """Token by token, expert by expert: the reference the grouped computation must equal."""
    out = torch.zeros_like(x)
    weights, experts = route(layer.router(x), layer.experts_per_token)
    for token in range(x.shape[0]):
        for weight, expert in zip(weights[token], experts[token]):
            gate, up = layer.gate_up[expert](x[token]).chunk(2)
            out[token] += weight * layer.down[expert](torch.nn.functional.silu(gate) * up)
    return out


def test_grouped_experts_equal_a_per_token_reference():
    config = ModelConfig(vocab_size=16, hidden_size=32, intermediate_size=16, num_layers=1, num_heads=2,
                         num_kv_heads=2, head_dim=16, architecture="mixtral", num_experts=6, experts_per_token=2)
    generator = torch.Generator().manual_seed(3)
    state = {"mlp.gate.weight": torch.randn(6, 32, generator=generator),
             "mlp.experts.gate_up_proj": torch.randn(6, 32, 32, generator=generator),
             "mlp.experts.down_proj": torch.randn(6, 32, 16, generator=generator)}
    layer = SparseMoE(config, state, "mlp", torch.float32)
    x = torch.randn(2, 7, 32, generator=generator)
    grouped = layer(x)
    torch.testing.assert_close(grouped, naive_moe(layer, x.reshape(-1, 32)).view(2, 7, 32), atol=1e-4, rtol=1e-5)
    assert layer.expert_tokens.sum() == 14 * 2 and (layer.expert_tokens > 0).sum() > 2


def test_balanced_assignment_fills_every_group_exactly():
    similarity = torch.randn(24, 4, generator=torch.Generator().manual_seed(0))
    similarity[:, 0] += 5  # every item prefers group 0: only 6 may have it
    group = balanced_assignment(similarity, 6)
    assert torch.bincount(group, minlength=4).tolist() == [6, 6, 6, 6]
    assert set(similarity[:, 0].argsort(descending=True)[:6].tolist()) == set(torch.nonzero(group == 0)[:, 0].tolist())


@pytest.fixture(scope="module")
def dense(tmp_path_factory) -> tuple[ModelConfig, dict]:
    directory = save_tiny_checkpoint(tmp_path_factory.mktemp("dense") / "dense", seed=0)
    reference = LlamaForCausalLM.from_pretrained(directory)
    return ModelConfig.from_hf(reference.config), dict(reference.state_dict())


CALIBRATION = [[(7 * i + j) % 120 + 3 for j in range(40)] for i in range(6)]


def split(experts_per_token: int) -> MoESpec:
    return MoESpec(method="neuron_split", experts=4, experts_per_token=experts_per_token, calibration_tokens=256)


def test_all_experts_with_a_uniform_router_reproduce_the_dense_model(dense):
    config, state = dense
    moe_config, moe_state = derive_moe(config, state, CALIBRATION, split(4), router_scale=0.0)
    assert moe_config.architecture == "mixtral" and moe_config.intermediate_size == config.intermediate_size // 4
    tokens = torch.randint(3, 128, (2, 30), generator=torch.Generator().manual_seed(1))
    positions = torch.arange(30).expand(2, 30)
    dense_model, moe_model = LlamaModel(config, state), MixtralModel(moe_config, moe_state)
    expected = dense_model.logits(dense_model(tokens, positions, dense_model.new_cache(2, 30)).hidden)
    derived = moe_model.logits(moe_model(tokens, positions, moe_model.new_cache(2, 30)).hidden)
    torch.testing.assert_close(derived, expected, atol=1e-5, rtol=1e-5)
    assert torch.equal(derived.argmax(-1), expected.argmax(-1))


def test_a_sparse_derivation_routes_and_keeps_most_of_the_model(dense):
    config, state = dense
    tokens = torch.tensor([CALIBRATION[0]])
    positions = torch.arange(tokens.shape[1])[None]
    dense_model = LlamaModel(config, state)
    expected = dense_model.logits(dense_model(tokens, positions, dense_model.new_cache(1, 64)).hidden)
    agreement = {}
    for k in (1, 2, 4):
        moe_config, moe_state = derive_moe(config, state, CALIBRATION, split(k))
        model = MixtralModel(moe_config, moe_state)
        logits = model.logits(model(tokens, positions, model.new_cache(1, 64)).hidden)
        agreement[k] = (logits.argmax(-1) == expected.argmax(-1)).float().mean().item()
        touched = [(layer.expert_tokens > 0).sum().item() for layer in model.moe_layers()]
        assert all(count <= 4 for count in touched) and sum(layer.expert_tokens.sum() for layer in
                                                                model.moe_layers()) == k * 40 * config.num_layers
    assert agreement[4] > 0.9  # a near-uniform router with all experts is close to the dense model
    assert agreement[1] < 1.0  # one expert of four really drops computation


def upcycle(noise: float, seed: int = 0) -> MoESpec:
    return MoESpec(method="upcycle", experts=4, experts_per_token=2, calibration_tokens=256, expert_noise=noise,
                   seed=seed)


def test_upcycled_experts_compute_the_dense_model_until_noise_makes_the_routing_decide(dense):
    config, state = dense
    tokens = torch.tensor(CALIBRATION[:2])
    positions = torch.arange(tokens.shape[1]).expand(2, -1)
    dense_model = LlamaModel(config, state)
    expected = dense_model.logits(dense_model(tokens, positions, dense_model.new_cache(2, 64)).hidden)

    def logits(moe_config: ModelConfig, moe_state: dict) -> tuple[torch.Tensor, MixtralModel]:
        model = MixtralModel(moe_config, moe_state)
        return model.logits(model(tokens, positions, model.new_cache(2, 64)).hidden), model

    moe_config, exact = derive_moe(config, state, CALIBRATION, upcycle(0.0))
    assert (moe_config.num_experts, moe_config.experts_per_token) == (4, 2)
    assert moe_config.intermediate_size == config.intermediate_size  # every expert is the whole dense MLP
    derived, model = logits(moe_config, exact)
    torch.testing.assert_close(derived, expected, atol=1e-5, rtol=1e-5)
    touched = [(layer.expert_tokens > 0).sum().item() for layer in model.moe_layers()]
    assert min(touched) >= 3  # the random router spreads 80 tokens over the experts

    _, noisy = derive_moe(config, state, CALIBRATION, upcycle(0.2))
    experts = noisy["model.layers.0.mlp.experts.gate_up_proj"]
    assert not torch.equal(experts[0], experts[1])
    assert torch.equal(noisy["model.layers.0.mlp.gate.weight"], exact["model.layers.0.mlp.gate.weight"])
    with_router, _ = logits(moe_config, noisy)
    rerouted = dict(noisy)  # the same experts, each layer's router rows rotated: other experts for every token
    for index in range(config.num_layers):
        name = f"model.layers.{index}.mlp.gate.weight"
        rerouted[name] = noisy[name].roll(1, dims=0)
    assert (logits(moe_config, rerouted)[0] - with_router).abs().max() > 1e-2  # the routing decides the output
    # noise costs some agreement, on a random model whose logits are flat, yet far above chance (1 in 128)
    assert (with_router.argmax(-1) == expected.argmax(-1)).float().mean() > 0.5
    _, again = derive_moe(config, state, CALIBRATION, upcycle(0.2))
    _, reseeded = derive_moe(config, state, CALIBRATION, upcycle(0.2, seed=1))
    assert all(torch.equal(noisy[name], again[name]) for name in noisy)  # seeded
    assert not torch.equal(noisy["model.layers.0.mlp.gate.weight"], reseeded["model.layers.0.mlp.gate.weight"])


def test_the_engine_config_records_the_experts(mixtral_dirs, tmp_path):
    spec = CheckpointSpec(source="hf_dir", path=str(mixtral_dirs["per_expert"]))
    checkpoint = load_checkpoint(spec, PipelineSpec(name="moe", target=TargetSpec(checkpoint=spec)))
    saved = json.loads(json.dumps(checkpoint.config.to_dict()))
    assert ModelConfig.from_dict(saved) == checkpoint.config
    assert checkpoint.config.to_hf().num_local_experts == 4
    with pytest.raises(Exception, match="experts_per_token"):
        ModelConfig.from_dict(saved | {"experts_per_token": 5})


def moe_pipeline(directory: Path, name: str, checkpoint: Path, moe: dict, method: str = "ngram") -> Path:
    """A tiny pipeline whose target carries a `moe` section."""
    path = tiny_pipeline(directory, name, checkpoint, method=method)
    spec = yaml.safe_load(path.read_text())
    spec["target"]["moe"] = moe
    path.write_text(yaml.safe_dump(spec))
    return path


@pytest.fixture(scope="module")
def moe_engines(tiny_checkpoints, tmp_path_factory) -> dict[str, Engine]:
    """MoE targets derived from the tiny dense target (4 experts, 2 per token), batch size 4. Split by neurons: with
    an int4 copy of the MoE as draft ("draft_target"), with an int8 copy ("draft_target_int8"), with the int4 dense
    source as draft ("draft_target_dense") and with n-gram speculation. Upcycled, with experts perturbed enough that
    the routing decides the output: with the int4 dense source ("upcycle_draft_target_dense") and with n-gram
    speculation ("upcycle_ngram")."""
    root = tmp_path_factory.mktemp("moe-engines")
    split = {"method": "neuron_split", "experts": 4, "experts_per_token": 2, "calibration_tokens": 256}
    upcycle = {"method": "upcycle", "experts": 4, "experts_per_token": 2, "calibration_tokens": 256,
               "expert_noise": 0.2}
    engines = {}
    derives = {"draft_target_dense": "int4_dense", "draft_target_int8": "int8",
               "upcycle_draft_target_dense": "int4_dense"}
    for name, method in (("draft_target", "draft_target"), ("draft_target_dense", "draft_target"),
                         ("draft_target_int8", "draft_target"), ("ngram", "ngram"),
                         ("upcycle_draft_target_dense", "draft_target"), ("upcycle_ngram", "ngram")):
        moe = upcycle if name.startswith("upcycle") else split
        path = moe_pipeline(root, f"tiny-moe-{name}", tiny_checkpoints["target"], moe, method)
        if name in derives:
            spec = yaml.safe_load(path.read_text())
            spec["speculation"]["draft"]["derive"] = derives[name]
            path.write_text(yaml.safe_dump(spec))
        engines[name] = Engine(build(load_pipeline(path), root / "engines", quiet=True).directory, batch_size=4)
    return engines


def test_a_derived_moe_target_gets_an_int4_moe_draft_or_its_dense_source_in_int4(moe_engines):
    for name, architecture in (("draft_target", "mixtral"), ("draft_target_dense", "llama")):
        engine = moe_engines[name]
        assert isinstance(engine.target, MixtralModel) and engine.target.config.num_experts == 4
        draft = engine.proposer.model
        assert draft.config.architecture == architecture and draft.config.quantization["method"] == "int4"
        assert engine.proposer.shared  # same attention weights: the draft reads the target's cache
    experts = moe_engines["draft_target"].proposer.model.moe_layers()[0]
    assert isinstance(experts.gate_up[0], Int4Linear) and isinstance(experts.down[3], Int4Linear)
    target_experts = moe_engines["draft_target"].target.moe_layers()[0]
    assert experts.expert_bytes < target_experts.expert_bytes / 3  # 4-bit codes against fp32 weights
    x = torch.randn(5, 64)
    exact, quantized = target_experts(x), experts(x)
    assert float((quantized - exact).norm() / exact.norm()) < 0.2  # int4 groups of 32 on random weights: ~0.13


def test_an_int8_draft_of_an_moe_is_int8_experts_closer_than_int4(moe_engines):
    int8 = moe_engines["draft_target_int8"].proposer.model
    assert isinstance(int8, MixtralModel) and int8.config.quantization["method"] == "int8"
    experts = int8.moe_layers()[0]
    assert isinstance(experts.gate_up[0], Int8Linear) and isinstance(experts.down[3], Int8Linear)
    int4 = moe_engines["draft_target"].proposer.model.moe_layers()[0]
    target_experts = moe_engines["draft_target"].target.moe_layers()[0]
    assert int4.expert_bytes < experts.expert_bytes < target_experts.expert_bytes / 3  # 1 byte against fp32's 4
    x = torch.randn(5, 64)
    exact = target_experts(x)
    errors = [float((layer(x) - exact).norm() / exact.norm()) for layer in (experts, int4)]
    assert errors[0] < errors[1] / 4, errors  # per-row int8 against int4 groups of 32


@pytest.mark.parametrize("method", ["draft_target", "draft_target_dense", "draft_target_int8", "ngram",
                                    "upcycle_draft_target_dense", "upcycle_ngram"])
def test_greedy_speculation_on_the_moe_target_equals_plain(moe_engines, method):
    engine = moe_engines[method]
    drafted = 0
    for prompt in PROMPTS:
        plain = engine.generate(prompt, SamplingParams(), 32, num_draft_tokens=0).run()
        generation = engine.generate(prompt, SamplingParams(), 32, num_draft_tokens=4)
        assert generation.run() == plain
        drafted += generation.stats.drafted
    assert drafted > 0


@pytest.mark.parametrize("method", ["draft_target", "draft_target_dense", "ngram", "upcycle_draft_target_dense"])
def test_batched_speculation_on_the_moe_target_equals_each_alone(moe_engines, method):
    engine = moe_engines[method]
    alone = [engine.generate(p, SamplingParams(), 24, num_draft_tokens=0).run() for p in PROMPTS]
    scheduler = Scheduler(engine, ServingSpec(PolicySpec(full_up_to=4, off_above=4)))
    try:
        collectors = [Collector() for _ in PROMPTS]
        for prompt, collector in zip(PROMPTS, collectors):
            scheduler.submit(GenerationRequest(prompt, 24, SamplingParams(), 3), collector)
        for collector in collectors:
            assert collector.done.wait(120)
    finally:
        scheduler.stop()
    assert [c.tokens for c in collectors] == alone


def test_the_moe_cache_after_rejections_is_a_fresh_prefill(moe_engines):
    engine = moe_engines["draft_target"]
    generation = engine.generate(PROMPTS[2], SamplingParams(), 40, num_draft_tokens=4)
    committed, rejections = list(PROMPTS[2]), 0
    for emitted in generation:
        committed.extend(emitted)
        if len(committed) == len(PROMPTS[2]) + 1:
            continue
        rejections += len(emitted) <= 4
        length = engine.cache.lengths[0]
        assert length == len(committed) - 1
        fresh = engine.target.new_cache(1, 256)
        engine.target(torch.tensor([committed[:length]]), torch.arange(length)[None], fresh)
        torch.testing.assert_close(engine.cache.stacked()[0][:, :1, :, :length], fresh.stacked()[0][:, :, :, :length],
                                   atol=1e-4, rtol=1e-4)
    assert rejections > 0


def test_an_int4_draft_of_a_mixtral_checkpoint_speculates_exactly(mixtral_dirs, tmp_path):
    path = tiny_pipeline(tmp_path, "int4-of-mixtral", mixtral_dirs["per_expert"])
    engine = Engine(build(load_pipeline(path), tmp_path / "engines", quiet=True).directory)
    assert isinstance(engine.proposer.model, MixtralModel) and engine.proposer.shared
    drafted = accepted = 0
    for prompt in PROMPTS:
        plain = engine.generate(prompt, SamplingParams(), 24, num_draft_tokens=0).run()
        generation = engine.generate(prompt, SamplingParams(), 24, num_draft_tokens=3)
        assert generation.run() == plain
        drafted, accepted = drafted + generation.stats.drafted, accepted + generation.stats.accepted
    assert accepted > drafted / 5  # far above chance (1 in 128), on a random model with sharpened weights


def test_moe_derivation_is_refused_where_it_cannot_apply(mixtral_dirs, tiny_checkpoints, tmp_path):
    path = moe_pipeline(tmp_path, "moe-of-moe", mixtral_dirs["packed"], {"experts": 2, "experts_per_token": 1})
    with pytest.raises(BuildError, match="target.moe derives an MoE from a dense llama checkpoint"):
        build(load_pipeline(path), tmp_path / "engines", quiet=True)
    dense_of_mixtral = tiny_pipeline(tmp_path, "int4-dense-of-moe", mixtral_dirs["packed"])
    spec = yaml.safe_load(dense_of_mixtral.read_text())
    spec["speculation"]["draft"]["derive"] = "int4_dense"
    dense_of_mixtral.write_text(yaml.safe_dump(spec))
    with pytest.raises(PipelineError, match="speculation.draft.derive: int4_dense .* no target.moe"):
        load_pipeline(dense_of_mixtral)
    odd_experts = dict(MOE, intermediate_size=48)
    odd = tmp_path / "odd-mixtral"
    MixtralForCausalLM(MixtralConfig(**odd_experts)).save_pretrained(odd)
    char_tokenizer().save_pretrained(odd)
    unquantizable = tiny_pipeline(tmp_path, "int4-of-odd-moe", odd)
    with pytest.raises(BuildError, match="int4 needs intermediate_size divisible by 32, got 48 in the mixtral"):
        build(load_pipeline(unquantizable), tmp_path / "engines", quiet=True)
    # the dense model's sizes suit int4 groups, its 8 experts' (128 / 8 = 16 neurons each) do not
    fine_split = moe_pipeline(tmp_path, "int4-target-of-fine-split", tiny_checkpoints["target"],
                              {"method": "neuron_split", "experts": 8, "experts_per_token": 2,
                               "calibration_tokens": 256})
    spec = yaml.safe_load(fine_split.read_text())
    spec["target"].update(dtype="bfloat16", weight_only="int4")
    fine_split.write_text(yaml.safe_dump(spec))
    with pytest.raises(BuildError, match="target.weight_only int4 needs intermediate_size divisible by 32, got 16 in "
                                         "the mixtral"):
        build(load_pipeline(fine_split), tmp_path / "engines", quiet=True)
    odd = moe_pipeline(tmp_path, "odd-split", tiny_checkpoints["target"],
                       {"method": "neuron_split", "experts": 3, "experts_per_token": 1})
    with pytest.raises(BuildError, match="does not split into 3 experts"):
        build(load_pipeline(odd), tmp_path / "engines", quiet=True)
    noisy_split = moe_pipeline(tmp_path, "noisy-split", tiny_checkpoints["target"],
                               {"method": "neuron_split", "expert_noise": 0.01})
    with pytest.raises(PipelineError, match="target.moe.expert_noise: only perturbs upcycled experts"):
        load_pipeline(noisy_split)
    too_many = moe_pipeline(tmp_path, "too-many", tiny_checkpoints["target"], {"experts": 4, "experts_per_token": 5})
    with pytest.raises(PipelineError, match="experts_per_token"):
        load_pipeline(too_many)


def test_expert_union_counts_a_hand_computed_case():
    """Router = the first four hidden dimensions, k = 2: token a goes to experts {0, 1}, b to {2, 3}, c to {0, 2}."""
    config = ModelConfig(vocab_size=8, hidden_size=8, intermediate_size=4, num_layers=1, num_heads=2, num_kv_heads=2,
                         head_dim=4, architecture="mixtral", num_experts=4, experts_per_token=2)
    state = {"mlp.gate.weight": torch.eye(4, 8), "mlp.experts.gate_up_proj": torch.ones(4, 8, 8),
             "mlp.experts.down_proj": torch.ones(4, 8, 4)}
    layer = SparseMoE(config, state, "mlp", torch.float32)
    a, b, c = (torch.tensor([1.0, 0.5, 0, 0, 0, 0, 0, 0]), torch.tensor([0, 0, 1.0, 0.5, 0, 0, 0, 0]),
               torch.tensor([1.0, 0, 0.5, 0, 0, 0, 0, 0]))
    model = types.SimpleNamespace(moe_layers=lambda: [layer])
    for tokens, union in (([a], 2), ([a, a], 2), ([a, c], 3), ([a, b], 4), ([b, c], 3)):
        layer(torch.stack(tokens)[None])
        assert experts_touched(model) == [union]
    assert layer.expert_bytes == (8 * 8 + 8 * 4) * 4


def test_bench_reports_the_expert_union_by_verification_length(moe_engines):
    engine = moe_engines["draft_target"]
    prompts = [{"prompt": "abcabcabc", "kind": "copy"}, {"prompt": "hello world", "kind": "open"}]
    report = run_benches([engine], prompts, 24, 0.0, 0, with_transformers=True, quiet=True)[0]
    assert report.transformers.transformers_tokens_per_s > 0  # transformers' Mixtral on the same weights
    curve = report.moe
    gamma = engine.num_draft_tokens
    assert curve.verification_length == list(range(1, gamma + 2))
    distinct = curve.distinct_experts_per_layer
    assert distinct[0] == 2  # one token: exactly its k experts
    assert all(a <= b for a, b in zip(distinct, distinct[1:])) and distinct[-1] <= 4  # a union only grows
    layer = engine.target.moe_layers()[0]
    assert curve.expert_bytes_read[0] == 2 * len(engine.target.moe_layers()) * layer.expert_bytes
    assert curve.verify_cost[0] == 1.0 and len(curve.verify_cost) == gamma + 1
    # the dense model the MoE was derived from, timed on the same windows
    assert curve.dense_verify_cost[0] == 1.0 and len(curve.dense_verify_cost) == gamma + 1
    assert curve.plain_step_speed_vs_dense > 0
    by_gamma = curve.predicted_speedup_by_gamma
    assert len(by_gamma) == gamma and by_gamma[curve.best_gamma - 1] == max(by_gamma)
    assert report.summary.predicted_speedup == by_gamma[gamma - 1]
    capped = dataclasses.replace(engine.pipeline, serving=ServingSpec(PolicySpec(gamma_cap=2)))
    engine.pipeline, original = capped, engine.pipeline
    try:  # positions past the cap are never drafted: no prediction is made for them
        report = run_benches([engine], prompts, 24, 0.0, 0, with_transformers=False, quiet=True)[0]
    finally:
        engine.pipeline = original
    assert len(report.moe.predicted_speedup_by_gamma) == 2
    assert report.summary.predicted_speedup == report.moe.predicted_speedup_by_gamma[1]


def test_moe_quality_scores_each_k_against_the_dense_model(tiny_checkpoints, tmp_path):
    path = moe_pipeline(tmp_path, "tiny-moe-quality", tiny_checkpoints["target"],
                        {"method": "neuron_split", "experts": 4, "experts_per_token": 2, "calibration_tokens": 256})
    out = tmp_path / "quality.json"
    result = run_cli("moe-quality", str(path), "--experts-per-token", "1,4", "--json", str(out))
    assert result.returncode == 0, result.stderr
    report = json.loads(out.read_text())
    one, four = report["by_experts_per_token"]
    assert (one["experts_per_token"], four["experts_per_token"]) == (1, 4)
    assert four["greedy_agreement"] > one["greedy_agreement"] and four["kl_from_dense"] < one["kl_from_dense"]
    assert four["greedy_agreement"] > 0.9 and abs(four["perplexity"] / report["dense_perplexity"] - 1) < 0.1
    assert "greedy agreement" in result.stdout
    assert MoeQuality.from_json(report).to_json() == report  # the typed result writes the keys it reads
    assert run_cli("moe-quality", str(path), "--experts-per-token", "9").returncode != 0


def test_moe_quality_measures_what_the_upcycled_experts_noise_costs(tiny_checkpoints, tmp_path):
    """Unperturbed copies compute the dense model whatever the routing; noise costs quality, less with more experts
    per token (their noise averages out)."""
    path = moe_pipeline(tmp_path, "tiny-upcycle-quality", tiny_checkpoints["target"],
                        {"method": "upcycle", "experts": 4, "experts_per_token": 2, "calibration_tokens": 256})
    out = tmp_path / "quality.json"
    result = run_cli("moe-quality", str(path), "--experts-per-token", "1,4", "--expert-noise", "0,0.3",
                     "--json", str(out))
    assert result.returncode == 0, result.stderr
    report = json.loads(out.read_text())
    rows = {(row["experts_per_token"], row["expert_noise"]): row for row in report["by_experts_per_token"]}
    assert report["method"] == "upcycle" and sorted(rows) == [(1, 0.0), (1, 0.3), (4, 0.0), (4, 0.3)]
    for k in (1, 4):
        assert rows[k, 0.0]["greedy_agreement"] == 1.0 and rows[k, 0.0]["kl_from_dense"] < 1e-6
        assert rows[k, 0.0]["perplexity"] == pytest.approx(report["dense_perplexity"], rel=1e-4)
        assert rows[k, 0.3]["kl_from_dense"] > 1e-3
    assert rows[4, 0.3]["kl_from_dense"] < rows[1, 0.3]["kl_from_dense"]
    refused = run_cli("moe-quality", str(path), "--expert-noise", "1.5")
    assert refused.returncode != 0 and "target.moe.expert_noise: must be in [0, 1)" in refused.stderr


def test_the_moe_target_exports_as_a_per_expert_mixtral_that_transformers_reads(moe_engines, tmp_path):
    engine = moe_engines["ngram"]
    out = export_hf(engine.dir / "target", tmp_path / "hf", dtype=torch.float32)
    names = set(load_file(str(out / "model.safetensors")))
    assert "model.layers.1.block_sparse_moe.experts.3.w1.weight" in names
    assert "model.layers.1.block_sparse_moe.experts.0.w2.weight" in names
    assert "model.layers.0.block_sparse_moe.gate.weight" in names
    assert not any("gate_up_proj" in name for name in names)
    reference = MixtralForCausalLM.from_pretrained(out).eval()
    assert reference.config.num_local_experts == 4 and reference.config.num_experts_per_tok == 2
    tokens = torch.tensor([PROMPTS[0] + PROMPTS[1]])
    with torch.no_grad():
        expected = reference(tokens).logits
    ours = engine.target.logits(engine.target(tokens, torch.arange(tokens.shape[1])[None],
                                              engine.target.new_cache(1, 64)).hidden)
    torch.testing.assert_close(ours, expected, atol=1e-4, rtol=1e-4)
    with pytest.raises(SpecdeployError, match="quantized"):
        export_hf(moe_engines["draft_target"].dir / "draft", tmp_path / "draft")


def test_export_hf_writes_the_pipelines_moe_target_from_the_cli(tiny_checkpoints, tmp_path):
    path = moe_pipeline(tmp_path, "tiny-moe-export", tiny_checkpoints["target"],
                        {"experts": 4, "experts_per_token": 2, "calibration_tokens": 256})
    engines, out = tmp_path / "engines", tmp_path / "hf"
    result = run_cli("export-hf", str(path), "--engines-dir", str(engines), "--output", str(out), "--dtype",
                     "float32")
    assert result.returncode == 0, result.stderr
    exported = MixtralForCausalLM.from_pretrained(out).eval()
    engine = Engine(engines / "tiny-moe-export")
    tokens = torch.tensor([PROMPTS[0]])
    with torch.no_grad():
        expected = exported(tokens).logits
    ours = engine.target.logits(engine.target(tokens, torch.arange(tokens.shape[1])[None],
                                              engine.target.new_cache(1, 32)).hidden)
    torch.testing.assert_close(ours, expected, atol=1e-4, rtol=1e-4)
    assert run_cli("export-hf", str(path), "--engines-dir", str(engines), "--output", str(out)).returncode == 0
    refused = run_cli("export-hf", str(path), "--engines-dir", str(engines), "--output", str(out), "--component",
                      "draft")
    assert refused.returncode == 2 and "no draft component" in refused.stderr
    (tmp_path / "occupied").mkdir()
    (tmp_path / "occupied" / "notes.txt").write_text("mine")
    refused = run_cli("export-hf", str(path), "--engines-dir", str(engines), "--output", str(tmp_path / "occupied"))
    assert refused.returncode == 2 and "not a Hugging Face checkpoint" in refused.stderr
    assert (tmp_path / "occupied" / "notes.txt").read_text() == "mine"


def test_gamma_cap_limits_every_request(moe_engines, tmp_path):
    engine = moe_engines["ngram"]
    capped = dataclasses.replace(engine.pipeline, serving=ServingSpec(PolicySpec(gamma_cap=2)))
    request = GenerationRequest(PROMPTS[1], 24, SamplingParams(), 6)
    assert request.gamma(engine.pipeline) == 6 and request.gamma(capped) == 2
    assert GenerationRequest(PROMPTS[1], 24, SamplingParams()).gamma(capped) == 2
    engine.pipeline, original = capped, engine.pipeline
    try:
        generation = engine.generate(PROMPTS[1] * 3, SamplingParams(), 24, num_draft_tokens=6)
        generation.run()
    finally:
        engine.pipeline = original
    assert generation.stats.drafted_per_position and len(generation.stats.drafted_per_position) <= 2
    with pytest.raises(PipelineError, match="gamma_cap"):
        PolicySpec(gamma_cap=-1)
    off = dataclasses.replace(engine.pipeline, serving=ServingSpec(PolicySpec(gamma_cap=0)))
    assert GenerationRequest(PROMPTS[1], 24, SamplingParams(), 5).gamma(off) == 0  # 0: plain decode


def test_gamma_cap_accepts_measured_and_names_what_is_allowed(tmp_path, tiny_checkpoints):
    path = tiny_pipeline(tmp_path, "cap", tiny_checkpoints["target"], serving={"policy": {"gamma_cap": "measured"}})
    assert load_pipeline(path).serving.policy.gamma_cap == "measured"
    assert load_pipeline(path).with_gamma_cap(3).serving.policy.gamma_cap == 3
    for bad in ("sometimes", -1, 2.5, True):
        spec = yaml.safe_load(path.read_text())
        spec["serving"]["policy"]["gamma_cap"] = bad
        path.write_text(yaml.safe_dump(spec))
        with pytest.raises(PipelineError, match=r"serving\.policy\.gamma_cap.*'measured'"):
            load_pipeline(path)
    # a request against a pipeline whose measured cap is not resolved yet drafts its gamma
    uncapped = load_pipeline(tiny_pipeline(tmp_path, "cap2", tiny_checkpoints["target"],
                                           serving={"policy": {"gamma_cap": "measured"}}))
    assert GenerationRequest(PROMPTS[1], 8, SamplingParams(), 5).gamma(uncapped) == 5


def measured_cap_moe_pipeline(directory: Path, name: str, checkpoint: Path) -> tuple[Path, dict]:
    """A tiny MoE draft-target pipeline with serving.policy.gamma_cap: measured, and its spec."""
    path = moe_pipeline(directory, name, checkpoint, {"experts": 4, "experts_per_token": 2, "calibration_tokens": 256},
                        "draft_target")
    spec = yaml.safe_load(path.read_text())
    spec["serving"] = {"policy": {"gamma_cap": "measured"}}
    path.write_text(yaml.safe_dump(spec))
    return path, spec


def test_bench_measures_a_gamma_cap_that_the_engine_then_serves_with(tiny_checkpoints, tmp_path):
    path, spec = measured_cap_moe_pipeline(tmp_path, "tiny-moe-measured", tiny_checkpoints["target"])
    engines = tmp_path / "engines"
    engine_dir = build(load_pipeline(path), engines, quiet=True).directory
    assert Engine(engine_dir).pipeline.serving.policy.gamma_cap is None  # nothing measured yet: no cap
    policy_file = engine_dir / "measured_policy.json"
    policy_file.write_text(json.dumps({"gamma_cap": 1}))  # an earlier measurement: bench must lift it
    prompts = {"abcabcabc": "copy", "hello": "copy"}
    result, report = run_bench(path, engines, prompts, "--max-tokens", "24", "--temperature", "0",
                               "--no-transformers", "--measure-gamma-cap")
    assert result.returncode == 0, result.stderr
    gamma = spec["speculation"]["num_draft_tokens"]
    assert report["num_draft_tokens"] == gamma and list(report["gamma_sweep"]) == [str(g) for g in range(1, gamma)]
    measured = json.loads(policy_file.read_text())
    realized = {**report["gamma_sweep"], str(gamma): report["speedup"]}
    assert measured["realized_speedup_by_gamma"] == realized
    assert measured["gamma_cap"] in {0, *map(int, realized)}  # the rule itself: tests/tune/test_gamma_cap.py
    assert measured["moe_predicted_speedup_by_gamma"] == report["moe"]["predicted_speedup_by_gamma"]
    assert f"gamma cap {measured['gamma_cap']}" in result.stdout and str(policy_file) in result.stdout
    assert Engine(engine_dir).pipeline.serving.policy.gamma_cap == measured["gamma_cap"]
    assert report["gamma_cap"] == measured["gamma_cap"]  # the report names the cap the engine now serves
    served, capped = run_bench(path, engines, prompts, "--max-tokens", "24", "--temperature", "0",
                               "--no-transformers", "--gammas", "1,2,3,4")
    assert served.returncode == 0 and f"capped at {measured['gamma_cap']}" in served.stdout
    # a sweep skips the gammas the cap would serve at the cap
    assert list(capped.get("gamma_sweep", {})) == [str(g) for g in range(1, 5) if g <= measured["gamma_cap"]]
    assert capped["gamma_cap"] == measured["gamma_cap"]
    assert len(capped["per_position_acceptance"]) == measured["gamma_cap"]  # only drafted positions
    policy_file.write_text(json.dumps({"gamma_cap": "two"}))
    with pytest.raises(SpecdeployError, match="measured_policy.json.*gamma_cap"):
        Engine(engine_dir)
    with pytest.raises(SpecdeployError, match="needs speculation, and the pipeline's method is none"):
        lift_gamma_cap(Engine(tiny_engine_dir(tmp_path, tiny_checkpoints), method="none"))


def test_quant_quality_scores_each_stored_form_against_bf16_and_refuses_an_moe(tiny_checkpoints, tmp_path):
    """Each form runs through the engine's own kernels: fp32 stays closest to bf16; int8 rows of these gaussian
    weights beat int4 groups; the derived draft's int4 head adds divergence to int4's (it is exact only in its top
    logits). An MoE target is moe-quality's to score, and says so."""
    path = tiny_pipeline(tmp_path, "tiny-quant-quality", tiny_checkpoints["target"], method="ngram",
                         dtype="bfloat16", target_weight_only="int4")
    out = tmp_path / "quality.json"
    result = run_cli("quant-quality", str(path), "--json", str(out))
    assert result.returncode == 0, result.stderr
    report = json.loads(out.read_text())
    rows = {row["form"].split(",")[0] if "draft" not in row["form"] else "draft": row for row in report["by_form"]}
    assert set(rows) == {"float32", "int8", "int4", "draft"}
    kl = {name: row["kl_from_dense"] for name, row in rows.items()}
    assert kl["float32"] < kl["int8"] < kl["int4"] < kl["draft"], kl
    assert rows["float32"]["greedy_agreement"] > 0.95 and report["bfloat16_perplexity"] > 1
    assert "greedy agreement" in result.stdout
    assert QuantQuality.from_json(report).to_json() == report
    moe = moe_pipeline(tmp_path, "tiny-moe-quant", tiny_checkpoints["target"],
                       {"experts": 4, "experts_per_token": 2, "calibration_tokens": 256})
    refused = run_cli("quant-quality", str(moe))
    assert refused.returncode != 0 and "moe-quality" in refused.stderr


def test_build_measures_a_gamma_cap_the_pipeline_asks_for_on_prompts_the_bench_never_uses(tiny_checkpoints, tmp_path):
    path, spec = measured_cap_moe_pipeline(tmp_path, "tiny-moe-built-cap", tiny_checkpoints["target"])
    engines = tmp_path / "engines"
    engine_dir = build_torch_engine(load_pipeline(path), engines, quiet=True).directory
    policy_file = engine_dir / "measured_policy.json"
    measured = json.loads(policy_file.read_text())
    realized = measured["realized_speedup_by_gamma"]  # at every gamma up to the full one
    assert list(realized) == [str(g) for g in range(1, spec["speculation"]["num_draft_tokens"] + 1)]
    assert measured["gamma_cap"] in {0, *map(int, realized)}
    assert measured["max_tokens"] == CALIBRATION_TOKENS and measured["seconds"] > 0
    bench_prompts = {p["prompt"] for p in load_prompts()}
    calibration = calibration_prompts(Engine(engine_dir))
    assert measured["prompts"] == len(calibration) > 0 and not bench_prompts & {p["prompt"] for p in calibration}
    assert Engine(engine_dir).pipeline.serving.policy.gamma_cap == measured["gamma_cap"]  # a fresh build serves capped
    written = policy_file.stat().st_mtime_ns
    build_torch_engine(load_pipeline(path), engines, quiet=True)  # up to date: measured already, not again
    assert policy_file.stat().st_mtime_ns == written
    dense = yaml.safe_load(tiny_pipeline(tmp_path, "tiny-dense-cap", tiny_checkpoints["target"], method="ngram",
                                         dtype="bfloat16", target_weight_only="int4").read_text())
    dense["serving"] = {"policy": {"gamma_cap": "measured"}}  # an int4 target's verify cost grows with its width
    (tmp_path / "dense.yaml").write_text(yaml.safe_dump(dense))
    dense_dir = build_torch_engine(load_pipeline(tmp_path / "dense.yaml"), engines, quiet=True).directory
    realized = json.loads((dense_dir / "measured_policy.json").read_text())["realized_speedup_by_gamma"]
    gamma = dense["speculation"]["num_draft_tokens"]
    assert list(realized) == [str(g) for g in (*sweep_gammas(gamma), gamma)] and all(v > 0 for v in realized.values())


def tiny_engine_dir(tmp_path: Path, tiny_checkpoints: dict) -> Path:
    """A tiny dense draft-target engine."""
    path = tiny_pipeline(tmp_path, "tiny-plain-dt", tiny_checkpoints["target"])
    return build(load_pipeline(path), tmp_path / "engines", quiet=True).directory
