"""The torch engine: model parity with transformers, arbitrary masks, greedy equivalence, KV invariants."""

from __future__ import annotations

import pytest
import torch
from helpers.engines import assert_greedy_speculation_equals_plain, fresh_prefill
from helpers.prompts import PROMPTS, SMOLLM2_PROMPTS
from transformers import LlamaForCausalLM

from specdeploy.models.config import ModelConfig
from specdeploy.models.llama import LlamaModel
from specdeploy.spec.sampling_params import SamplingParams


def our_model(checkpoint_dir) -> tuple[LlamaForCausalLM, LlamaModel]:
    reference = LlamaForCausalLM.from_pretrained(checkpoint_dir).eval()
    state = {k: v for k, v in reference.state_dict().items()}
    return reference, LlamaModel(ModelConfig.from_hf(reference.config), state)


def test_prefill_and_incremental_match_transformers(tiny_checkpoints):
    reference, model = our_model(tiny_checkpoints["target"])
    tokens = torch.randint(3, 128, (1, 24), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        expected = reference(tokens).logits
    cache = model.new_cache(1, 64)
    full = model.logits(model(tokens, torch.arange(24)[None], cache).hidden)
    torch.testing.assert_close(full, expected, atol=1e-5, rtol=1e-5)

    cache = model.new_cache(1, 64)
    pieces = [model.logits(model(tokens[:, :10], torch.arange(10)[None], cache).hidden)]
    cache.rewind(0, 10)
    for position in range(10, 24):
        pieces.append(model.logits(model(tokens[:, position:position + 1], torch.tensor([[position]]), cache).hidden))
        cache.rewind(0, position + 1)
    torch.testing.assert_close(torch.cat(pieces, 1), expected, atol=1e-5, rtol=1e-5)


def test_batched_rows_with_different_lengths(tiny_checkpoints):
    _, model = our_model(tiny_checkpoints["target"])
    short, long = [5, 6, 7], [8, 9, 10, 11, 12, 13]
    singles = []
    for prompt in (short, long):
        cache = model.new_cache(1, 16)
        hidden = model(torch.tensor([prompt]), torch.arange(len(prompt))[None], cache).hidden
        singles.append(model.logits(hidden)[0, -1])
    # Prefill both rows separately into a two-row cache, then decode one token per row in a single call.
    cache = model.new_cache(2, 16)
    for row, prompt in enumerate((short, long)):
        row_cache = model.new_cache(1, 16)
        model(torch.tensor([prompt[:-1]]), torch.arange(len(prompt) - 1)[None], row_cache)
        for entries, row_entries in zip(cache.keys + cache.values, row_cache.keys + row_cache.values):
            entries[row] = row_entries[0]
        cache.lengths[row] = len(prompt) - 1
    tokens = torch.tensor([[short[-1]], [long[-1]]])
    positions = torch.tensor([[len(short) - 1], [len(long) - 1]])
    batched = model.logits(model(tokens, positions, cache).hidden)[:, 0]
    torch.testing.assert_close(batched, torch.stack(singles), atol=1e-5, rtol=1e-5)


def test_tree_mask_and_positions(tiny_checkpoints):
    """Two sibling candidates at the same position, written to different cache slots, each attending only to the
    prefix and itself, give the same logits as two separate chain forwards (what tree verification needs)."""
    _, model = our_model(tiny_checkpoints["target"])
    prefix, left, right = [5, 6, 7, 8], 20, 30
    chains = []
    for candidate in (left, right):
        cache = model.new_cache(1, 16)
        tokens = torch.tensor([prefix + [candidate]])
        chains.append(model.logits(model(tokens, torch.arange(5)[None], cache).hidden)[0, -1])
    cache = model.new_cache(1, 16)
    model(torch.tensor([prefix]), torch.arange(4)[None], cache)
    cache.rewind(0, 4)
    mask = torch.zeros(1, 2, 6, dtype=torch.bool)
    mask[0, :, :4] = True
    mask[0, 0, 4] = mask[0, 1, 5] = True
    tree = model.logits(model(torch.tensor([[left, right]]), torch.tensor([[4, 4]]), cache, attention_mask=mask,
                              cache_slots=torch.tensor([[4, 5]])).hidden)[0]
    torch.testing.assert_close(tree, torch.stack(chains), atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("kind", ["draft_target", "int4", "int8", "ngram", "int4_target", "heuristic"])
@pytest.mark.parametrize("gamma", [1, 3, 5])
def test_greedy_speculative_equals_plain(tiny_engines, kind, gamma):
    engine = tiny_engines[kind]
    drafted = 0
    for prompt in PROMPTS:
        plain = engine.generate(prompt, SamplingParams(), 40, num_draft_tokens=0).run()
        generation = engine.generate(prompt, SamplingParams(), 40, num_draft_tokens=gamma)
        assert generation.run() == plain
        drafted += generation.stats.drafted
    assert drafted > 0  # speculation really happened


def test_heuristic_schedule_varies_the_proposal_length(tiny_engines):
    """Under the heuristic schedule steps draft different lengths, within the request's gamma."""
    generation = tiny_engines["heuristic"].generate(PROMPTS[0], SamplingParams(), 80, num_draft_tokens=6)
    per_step, drafted_before = [], 0
    for _ in generation:
        per_step.append(generation.stats.drafted - drafted_before)
        drafted_before = generation.stats.drafted
    drafted = [n for n in per_step[1:-1] if n]  # the first chunk is prefill; the last step may be cut short
    assert max(drafted) <= 6
    assert len(set(drafted)) >= 3


def test_draft_target_rejects_sometimes(tiny_engines):
    """The noisy tiny draft must disagree now and then, or the equivalence tests prove little about rejection."""
    generation = tiny_engines["draft_target"].generate(PROMPTS[0], SamplingParams(), 60, num_draft_tokens=4)
    generation.run()
    assert 0 < generation.stats.accepted < generation.stats.drafted


@pytest.mark.parametrize("threshold", [0.05, 0.2])
def test_early_stop_drafts_fewer_tokens_without_wasted_forwards(tiny_engines, threshold):
    engine = tiny_engines["draft_target"]
    proposer = engine.proposer
    plain = engine.generate(PROMPTS[0], SamplingParams(), 40, num_draft_tokens=0).run()
    proposer.early_stop_threshold = threshold
    try:
        forwards_before = proposer.forwards
        generation = engine.generate(PROMPTS[0], SamplingParams(), 40, num_draft_tokens=6)
        assert generation.run() == plain
    finally:
        proposer.early_stop_threshold = 0.0
    stats = generation.stats
    assert 0 < stats.drafted < 6 * stats.speculative_steps  # some steps stopped early
    # One row: each forward drafts one proposed token; an unsure token is proposed, not thrown away.
    assert proposer.forwards - forwards_before == stats.drafted


@pytest.mark.parametrize("kind", ["draft_target", "int4", "int8"])
@pytest.mark.parametrize("temperature", [0.0, 1.0])
def test_caches_hold_exactly_the_committed_prefix(tiny_engines, kind, temperature):
    engine = tiny_engines[kind]
    params = SamplingParams(temperature=temperature, seed=11)
    generation = engine.generate(PROMPTS[2], params, 48, num_draft_tokens=4)
    committed = list(PROMPTS[2])
    rejections, drafted_before = 0, 0
    for emitted in generation:
        drafted_now, drafted_before = generation.stats.drafted - drafted_before, generation.stats.drafted
        committed.extend(emitted)
        target_length = engine.cache.lengths[0]
        if len(committed) == len(PROMPTS[2]) + 1:
            continue  # right after prefill the draft has not run yet
        rejections += len(emitted) <= 4
        assert target_length == len(committed) - 1  # everything but the pending token
        fresh = fresh_prefill(engine.target, committed[:target_length], 256)
        for ours, expected in zip(engine.cache.stacked(), fresh.stacked()):  # keys, then values
            torch.testing.assert_close(ours[..., :target_length, :], expected[..., :target_length, :],
                                       atol=1e-4, rtol=1e-4)
        draft = engine.proposer
        if kind in ("int4", "int8"):  # a derived draft reads the target's entries: the check above covers them
            assert draft.shared and draft.cache is engine.cache
            continue
        assert not draft.shared
        draft_length = draft.cache.lengths[0]
        if drafted_now == 0:  # a step that drafted nothing (the last one) leaves the draft a committed prefix
            assert draft_length <= len(committed) - 1
        elif len(emitted) <= drafted_now:  # a rejection: the draft keeps the accepted drafts, not the tail
            assert draft_length == len(committed) - 1
        else:  # full acceptance: the last drafted token was never fed to the draft
            assert draft_length == len(committed) - 2
        fresh = fresh_prefill(draft.model, committed[:draft_length], 256)
        tolerance = 1e-4 if draft.model.dtype == torch.float32 else 5e-2
        keys, fresh_keys = draft.cache.stacked()[0], fresh.stacked()[0]
        torch.testing.assert_close(keys[..., :draft_length, :], fresh_keys[..., :draft_length, :],
                                   atol=tolerance, rtol=tolerance)
    assert rejections > 0


def test_sampled_generation_is_seeded(tiny_engines):
    engine = tiny_engines["draft_target"]
    params = SamplingParams(temperature=0.9, top_k=20, top_p=0.9, repetition_penalty=1.2, seed=5)
    first = engine.generate(PROMPTS[0], params, 30).run()
    assert engine.generate(PROMPTS[0], params, 30).run() == first
    other = engine.generate(PROMPTS[0], SamplingParams(temperature=0.9, top_k=20, top_p=0.9,
                                                       repetition_penalty=1.2, seed=6), 30).run()
    assert other != first


def test_max_tokens_and_statistics(tiny_engines):
    engine = tiny_engines["draft_target"]
    generation = engine.generate(PROMPTS[1], SamplingParams(), 17, num_draft_tokens=3)
    chunks = list(generation)
    tokens = generation.tokens
    stats = generation.stats
    assert len(tokens) == stats.generated_tokens
    assert len(tokens) == 17 or tokens[-1] in engine.end_ids
    assert stats.accepted == sum(stats.accepted_per_position)
    assert stats.drafted == sum(stats.drafted_per_position)
    assert 1.0 <= stats.mean_accepted_length <= 4.0
    assert stats.draft_seconds > 0 and stats.verify_seconds > 0
    # The first chunk comes from prefill; each later one is one step: its accepted drafts plus one token.
    assert stats.steps == len(chunks) - 1
    assert all(1 <= len(chunk) <= 4 for chunk in chunks[1:])
    emitted_beyond_one = sum(len(chunk) - 1 for chunk in chunks[1:])
    if tokens[-1] in engine.end_ids:  # a stop token may cut the last step short
        assert emitted_beyond_one <= stats.accepted
    else:
        assert emitted_beyond_one == stats.accepted


@pytest.mark.smollm2
def test_smollm2_matches_transformers(smollm2_fp32_engines):
    from safetensors.torch import load_file

    engine = smollm2_fp32_engines["draft-target"]
    reference = LlamaForCausalLM(engine.target.config.to_hf())
    reference.load_state_dict(load_file(str(engine.dir / "target" / "model.safetensors")), strict=False)
    reference.tie_weights()
    ids = engine.encode_prompt("Name three primary colors.")
    with torch.no_grad():
        expected = reference.eval()(torch.tensor([ids])).logits
    cache = engine.target.new_cache(1, 128)
    ours = engine.target.logits(engine.target(torch.tensor([ids]), torch.arange(len(ids))[None], cache).hidden)
    torch.testing.assert_close(ours, expected, atol=2e-3, rtol=1e-4)
    assert torch.equal(ours.argmax(-1), expected.argmax(-1))


@pytest.mark.smollm2
@pytest.mark.parametrize("method", ["draft-target", "ngram"])
def test_smollm2_greedy_speculative_equals_plain(smollm2_fp32_engines, method):
    assert_greedy_speculation_equals_plain(smollm2_fp32_engines[method], SMOLLM2_PROMPTS)


def test_an_int8_draft_is_int8_rows_and_closer_to_the_target_than_int4(tiny_engines):
    """derive: int8 quantizes every projection and the head to int8 rows (torch's weight-only int8 kernel); it reads
    1.6× int4's bytes (with int4's group scales) and tracks the target more closely."""
    import json

    from specdeploy.models.quantize import Int4Linear, Int8Linear

    int8, int4 = tiny_engines["int8"], tiny_engines["int4"]
    linears = [m for m in int8.proposer.model.modules() if isinstance(m, (Int4Linear, Int8Linear))]
    assert linears and all(isinstance(m, Int8Linear) for m in linears)
    assert json.loads((int8.dir / "draft" / "config.json").read_text())["model"]["quantization"]["method"] == "int8"
    tokens = torch.tensor([PROMPTS[0] + PROMPTS[1]])
    positions = torch.arange(tokens.shape[1])[None]

    def logits(model: LlamaModel) -> torch.Tensor:
        with torch.inference_mode():
            return model.logits(model(tokens, positions, model.new_cache(1, tokens.shape[1])).hidden)

    target = logits(int8.target)
    error = {name: (logits(e.proposer.model) - target).abs().mean() for name, e in (("int8", int8), ("int4", int4))}
    assert error["int8"] < error["int4"] / 2, error


def test_a_weight_only_target_stores_int4_groups_and_an_int8_head_and_computes_what_they_hold(tiny_engines):
    """target.weight_only: int4 quantizes the target's projections to int4 groups and its head to int8 rows alone
    (no int4 head: the target's whole distribution matters, not only its top tokens); config.json records it; the
    engine's kernels compute the model its stored codes define (a bf16 model of the dequantized weights), which is
    not the bf16 target. (How far it is from the bf16 target on real text: `specdeploy quant-quality`.)"""
    import json

    from safetensors.torch import load_file

    from specdeploy.models.quantize import Int4Linear, Int8Linear, RescoredHead, dequantize_int4
    from specdeploy.models.registry import component_config

    engine = tiny_engines["int4_target"]
    quantization = json.loads((engine.dir / "target" / "config.json").read_text())["model"]["quantization"]
    assert quantization == {"method": "int4", "group_size": 32, "lm_head": "int8"}
    modules = list(engine.target.modules())
    assert sum(isinstance(m, Int4Linear) for m in modules) == 4 * engine.target.config.num_layers
    assert isinstance(engine.target.lm_head, Int8Linear) and not any(isinstance(m, RescoredHead) for m in modules)
    stored = load_file(str(engine.dir / "target" / "model.safetensors"))
    dequantized = {name: tensor for name, tensor in stored.items() if name.endswith(".weight")}
    for name in [n.removesuffix(".codes") for n in stored if n.endswith(".codes")]:
        parts = {part: stored[f"{name}.{part}"] for part in ("codes", "scales", "minimums")}
        dequantized[f"{name}.weight"] = dequantize_int4(**parts)
    dequantized["lm_head.weight"] = stored["lm_head.int8"].float() * stored["lm_head.row_scales"][:, None]
    config = component_config(engine.dir / "target")[0]
    dense_dir = tiny_engines["ngram"].dir / "target"
    tokens = torch.tensor([PROMPTS[0] + PROMPTS[1]])
    positions = torch.arange(tokens.shape[1])[None]

    def logits(state: dict[str, torch.Tensor] | None) -> torch.Tensor:
        model = engine.target if state is None else LlamaModel(config, state, torch.bfloat16).eval()
        with torch.inference_mode():
            return model.logits(model(tokens, positions, model.new_cache(1, tokens.shape[1])).hidden)

    quantized, of_codes = logits(None), logits(dequantized)
    bf16 = logits(load_file(str(dense_dir / "model.safetensors")))
    scale = bf16.abs().mean()
    assert (quantized - of_codes).abs().mean() < 0.02 * scale  # bf16 rounding apart, the same function
    assert (quantized - bf16).abs().mean() > 5 * (quantized - of_codes).abs().mean()  # and not the bf16 target


def test_int8_rows_work_from_an_unaligned_buffer():
    """An MoE draft's experts are views into one loaded safetensors buffer, 8-byte aligned; torch's CPU int8 kernel
    crashed on such a view with 4 input rows until Int8Linear copied its weight. Run apart: a crash is a segfault."""
    import subprocess
    import sys

    code = """
import torch
from specdeploy.models.quantize import Int8Linear, quantize_int8
torch.manual_seed(0)
rows = quantize_int8(torch.randn(64, 64))
buffer = torch.zeros(8 + 64 * 64, dtype=torch.int8)
view = buffer[8:].view(64, 64)
view.copy_(rows["int8"])
assert view.data_ptr() % 64 != 0
x = torch.randn(4, 64)
expected = x @ (rows["int8"].float() * rows["row_scales"][:, None]).T
torch.testing.assert_close(Int8Linear(view, rows["row_scales"])(x), expected, rtol=0.03, atol=0.3)
"""
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stderr[-2000:]
