"""Small pure pieces: sampling processors, n-gram lookup, int4 round trip, detokenisation, statistics."""

from __future__ import annotations

import pytest
import torch

from specdeploy.decoding.detokenizer import IncrementalDetokenizer
from specdeploy.decoding.draft_length import ProposalLength
from specdeploy.decoding.prompt_lookup import prompt_lookup
from specdeploy.decoding.repetition_penalty import seen_after_drafts, seen_mask
from specdeploy.decoding.sampling import greedy_tokens, sampling_distribution
from specdeploy.decoding.stats import RequestStats
from specdeploy.errors import RequestError
from specdeploy.models.quantize import (
    Int4Linear,
    Int8Linear,
    RescoredHead,
    dequantize_int4,
    quantize_int4,
    quantize_int8,
)
from specdeploy.spec.sampling_params import SamplingParams


def test_greedy_is_a_point_mass_on_the_argmax():
    logits = torch.tensor([[0.1, 2.0, -1.0, 1.9]])
    assert sampling_distribution(logits, SamplingParams()).tolist() == [[0.0, 1.0, 0.0, 0.0]]


def test_temperature_top_k_top_p():
    logits = torch.log(torch.tensor([[0.5, 0.25, 0.15, 0.1]]))
    plain = sampling_distribution(logits, SamplingParams(temperature=1.0))
    torch.testing.assert_close(plain, torch.tensor([[0.5, 0.25, 0.15, 0.1]]))
    top_k = sampling_distribution(logits, SamplingParams(temperature=1.0, top_k=2))
    torch.testing.assert_close(top_k, torch.tensor([[2 / 3, 1 / 3, 0.0, 0.0]]))
    # top_p 0.7: 0.5 alone is below 0.7, so 0.25 joins; 0.15 is not needed.
    top_p = sampling_distribution(logits, SamplingParams(temperature=1.0, top_p=0.7))
    torch.testing.assert_close(top_p, torch.tensor([[2 / 3, 1 / 3, 0.0, 0.0]]))
    hot = sampling_distribution(logits, SamplingParams(temperature=2.0))
    assert hot[0, 0] < 0.5 and hot[0, 3] > 0.1  # flatter


def test_repetition_penalty_follows_the_context():
    logits = torch.tensor([[2.0, 2.0, -1.0]])
    seen = seen_mask(torch.tensor([0, 2]), 3)
    probs = sampling_distribution(logits, SamplingParams(temperature=1.0, repetition_penalty=2.0), seen[None])
    expected = torch.tensor([[1.0, 2.0, -2.0]]).softmax(-1)  # positive divided, negative multiplied
    torch.testing.assert_close(probs, expected)
    steps = seen_after_drafts(seen_mask(torch.tensor([0]), 5), torch.tensor([3, 1]))
    assert steps.tolist() == [[True, False, False, False, False], [True, False, False, True, False],
                              [True, True, False, True, False]]


@pytest.mark.parametrize("kwargs, field", [({"temperature": -1}, "temperature"), ({"top_k": -2}, "top_k"),
                                           ({"top_p": 0.0}, "top_p"), ({"repetition_penalty": 0}, "repetition")])
def test_bad_sampling_params_name_the_field(kwargs, field):
    with pytest.raises(RequestError, match=field):
        SamplingParams(**kwargs)


def test_extreme_values_give_valid_distributions():
    """Allowed but extreme temperatures and penalties: probabilities stay finite and sum to one."""
    logits = torch.randn(3, 40) * 5
    seen = torch.rand(3, 40) < 0.5
    for params in (SamplingParams(temperature=1e-40), SamplingParams(temperature=1e4),
                   SamplingParams(temperature=1.0, repetition_penalty=1e-40),
                   SamplingParams(temperature=1e-40, repetition_penalty=1e30, top_k=3, top_p=0.5)):
        probs = sampling_distribution(logits, params, seen)
        assert torch.isfinite(probs).all() and torch.allclose(probs.sum(-1), torch.ones(3)), params


def test_seed_must_fit_the_request_field():
    assert SamplingParams(seed=2**64 - 1).seed == 2**64 - 1
    for seed in (-1, 2**64):
        with pytest.raises(RequestError, match=r"random_seed: must be in \[0, 2\*\*64\)"):
            SamplingParams(seed=seed)


def test_ngram_prefers_the_longest_most_recent_match():
    def lookup(tokens, gamma, min_n=1, max_n=3):
        return prompt_lookup(tokens, gamma, min_n, max_n)

    tokens = [1, 2, 3, 9, 1, 2, 3, 7, 8, 5, 2, 3]
    assert lookup(tokens, 3) == [7]  # "2 3" last seen before "7 8 5", earlier before "9": cut to one
    tokens = [4, 2, 3, 7, 8, 1, 1, 2, 3, 7, 8, 5, 6, 0, 2, 3]
    assert lookup(tokens, 4) == [7, 8]  # both earlier "2 3" continue "7 8", then differ
    assert lookup([6, 2, 3, 7, 8, 5, 1, 2, 3], 4) == [7, 8, 5, 1]  # one occurrence: all of it
    assert lookup([4, 5, 6], 3) == []
    assert lookup(tokens, 0) == []
    assert lookup([1, 2, 3, 1, 2], 5, min_n=2, max_n=2) == [3, 1, 2]


def test_heuristic_proposal_length_grows_on_full_acceptance_and_shrinks_on_rejection():
    length = ProposalLength("heuristic", gamma=9)
    assert length.current == 4
    length.update(4, 4)
    assert length.current == 6
    length.update(6, 6)
    length.update(8, 8)
    assert length.current == 9  # capped at gamma
    length.update(9, 2)
    assert length.current == 8
    length.update(0, 0)  # nothing drafted (no n-gram match): no evidence either way
    assert length.current == 8
    for _ in range(20):
        length.update(length.current, 0)
    assert length.current == 1  # never below one
    constant = ProposalLength("constant", gamma=5)
    constant.update(5, 0)
    assert constant.current == 5
    assert ProposalLength("heuristic", gamma=2).current == 2


def test_int4_round_trip_and_kernel():
    weight = torch.randn(64, 96, generator=torch.Generator().manual_seed(0))
    parts = quantize_int4(weight)
    restored = dequantize_int4(**parts)
    group_range = weight.reshape(64, 3, 32).amax(-1) - weight.reshape(64, 3, 32).amin(-1)
    assert ((restored - weight).abs().reshape(64, 3, 32).amax(-1) <= group_range / 30 + 1e-6).all()
    x = torch.randn(5, 96, generator=torch.Generator().manual_seed(1))
    expected = x.bfloat16().float() @ restored.t()
    torch.testing.assert_close(Int4Linear(**parts)(x), expected, atol=0.1, rtol=0.02)


def test_rescored_head_keeps_the_int8_winner_and_int4_elsewhere():
    generator = torch.Generator().manual_seed(2)
    weight = torch.randn(512, 64, generator=generator)
    coarse, fine = Int4Linear(**quantize_int4(weight)), Int8Linear(**quantize_int8(weight))
    head = RescoredHead(coarse, **quantize_int8(weight), rescored=4)
    x = torch.randn(3, 7, 64, generator=generator).bfloat16()
    logits, int4_logits, int8_logits = head(x), coarse(x).float(), fine(x).float()
    assert logits.shape == (3, 7, 512) and logits.dtype == torch.float32
    # At most 4 entries per row differ from the int4 logits, all among the int4 top 4 (ties included) ...
    rescored = logits != int4_logits
    assert (rescored.sum(-1) <= 4).all() and rescored.sum() > 3 * 7 * 2
    fourth = int4_logits.topk(4, dim=-1).values[..., -1:]
    assert (int4_logits[rescored] >= fourth.expand_as(logits)[rescored]).all()
    # ... and they are the int8 logits up to the kernels' accumulation order, rounded to bf16.
    torch.testing.assert_close(logits[rescored], int8_logits[rescored], atol=0.07, rtol=0.01)
    assert torch.equal(logits.argmax(-1), int8_logits.argmax(-1))


def test_greedy_tokens_are_where_the_greedy_distribution_sits():
    logits = torch.randn(6, 50, generator=torch.Generator().manual_seed(3))
    for params, seen in [(SamplingParams(), None),
                         (SamplingParams(repetition_penalty=3.0), torch.rand(6, 50) < 0.3)]:
        expected = sampling_distribution(logits, params, seen).argmax(-1)
        assert torch.equal(greedy_tokens(logits, params, seen), expected)


def test_detokenizer_never_emits_broken_utf8(tiny_engines):
    from transformers import AutoTokenizer

    engine = tiny_engines["ngram"]
    tokenizer = AutoTokenizer.from_pretrained(engine.dir / "target")
    detokenizer = IncrementalDetokenizer(tokenizer)
    pieces = [detokenizer.add([t]) for t in tokenizer("hello, world")["input_ids"]]
    assert "".join(pieces) + detokenizer.flush() == "hello, world"


def test_detokenizer_holds_back_partial_characters():
    class ByteTokenizer:  # ids are UTF-8 bytes; a multi-byte character spans several ids
        def decode(self, ids, skip_special_tokens=True):
            return bytes(ids).decode("utf-8", errors="replace")

    detokenizer = IncrementalDetokenizer(ByteTokenizer())
    out = [detokenizer.add([b]) for b in "añ€".encode()]
    assert out == ["a", "", "ñ", "", "", "€"]


def test_stats_per_position_and_mean_accepted_length():
    stats = RequestStats(generated_tokens=1)
    stats.record_step(drafted=3, accepted=3)
    stats.record_step(drafted=3, accepted=1)
    stats.record_step(drafted=0, accepted=0)
    stats.generated_tokens += 4 + 2 + 1
    assert stats.drafted_per_position == [2, 2, 2] and stats.accepted_per_position == [2, 1, 1]
    assert stats.acceptance_rate == pytest.approx(4 / 6)
    assert stats.mean_accepted_length == pytest.approx(7 / 3)
    assert stats.per_position_acceptance == [1.0, 0.5, 0.5]


def test_dense_linear_prepacked_bf16_matches_f_linear():
    from specdeploy.models.llama import DenseLinear, packs_for_cpu

    weight = torch.randn(96, 64, generator=torch.Generator().manual_seed(2)).bfloat16()
    layer = DenseLinear(weight)
    layer.prepack()
    assert (layer.packed is not None) == packs_for_cpu(weight) and (layer.weight is None) == packs_for_cpu(weight)
    for shape in ((1, 64), (7, 64), (2, 3, 64)):
        x = torch.randn(*shape, generator=torch.Generator().manual_seed(3)).bfloat16()
        torch.testing.assert_close(layer(x), torch.nn.functional.linear(x, weight), atol=1e-2, rtol=1e-2)
    fp32 = DenseLinear(weight.float())
    fp32.prepack()
    assert fp32.packed is None  # fp32 keeps the plain path (exactness tests use it)


def test_rotary_and_norm_are_transformers_llamas_and_a_tied_head_is_the_embedding_itself():
    from transformers import LlamaConfig, LlamaForCausalLM
    from transformers.models.llama.modeling_llama import LlamaRMSNorm, LlamaRotaryEmbedding, apply_rotary_pos_emb

    from specdeploy.models.config import ModelConfig
    from specdeploy.models.llama import LlamaModel, RMSNorm, rotary_table, rotate

    hf_config = LlamaConfig(vocab_size=64, hidden_size=32, intermediate_size=48, num_hidden_layers=1,
                            num_attention_heads=4, num_key_value_heads=2, tie_word_embeddings=True)
    config = ModelConfig.from_hf(hf_config)
    generator = torch.Generator().manual_seed(4)
    q = torch.randn(1, 5, 4, 8, generator=generator)  # [B, T, heads, D], as DecoderLayer rotates it
    positions = torch.tensor([[0, 3, 7, 100, 101]])
    cos, sin = LlamaRotaryEmbedding(hf_config)(q, positions)
    expected, _ = apply_rotary_pos_emb(q.transpose(1, 2), q.transpose(1, 2), cos, sin)
    rotation = rotary_table(config, 128)[:, positions, None]
    torch.testing.assert_close(rotate(q, rotation), expected.transpose(1, 2), rtol=1e-6, atol=1e-6)
    # bf16 rotates in bf16, as transformers does (its cos/sin cast to q's dtype). Its fused multiply-add rounds
    # once where transformers rounds each product too: they differ by the products' roundings, under two bf16 units
    # in the last place of the largest of the pair's inputs and the result.
    q16 = q.bfloat16()
    cos16, sin16 = LlamaRotaryEmbedding(hf_config)(q16, positions)
    expected16, _ = apply_rotary_pos_emb(q16.transpose(1, 2), q16.transpose(1, 2), cos16, sin16)
    assert cos16.dtype == torch.bfloat16
    rotated16 = rotate(q16, rotation.bfloat16())
    assert rotated16.dtype == torch.bfloat16
    ours, theirs = rotated16.float(), expected16.transpose(1, 2).float()
    largest = torch.stack([q16.abs(), q16.roll(4, dims=-1).abs(), rotated16.abs()]).amax(0).float()
    last_place = torch.exp2(torch.floor(torch.log2(largest)) - 7)  # bf16 keeps 8 significant bits
    assert ((ours - theirs).abs() <= 2 * last_place).all()
    assert torch.equal(rotate(q16, rotation), rotated16)  # an fp32 table is cast to q's dtype first

    weight = torch.randn(32, generator=generator)
    x = torch.randn(3, 32, generator=generator)
    hf_norm = LlamaRMSNorm(32, eps=1e-5)
    hf_norm.weight.data.copy_(weight)
    torch.testing.assert_close(RMSNorm(weight, 1e-5)(x), hf_norm(x), rtol=1e-6, atol=1e-6)

    state = {name: tensor for name, tensor in LlamaForCausalLM(hf_config).state_dict().items()
             if name != "lm_head.weight"}
    model = LlamaModel(config, state)
    assert model.lm_head.weight.data_ptr() == model.embed.data_ptr()  # one matrix, not a copy
    unpacked = LlamaModel(config, state, torch.bfloat16, prepack=False)  # what a compiled engine is built from
    assert unpacked.lm_head.weight.data_ptr() == unpacked.embed.data_ptr()
    assert all(layer.qkv.packed is None for layer in unpacked.layers)


def test_the_eager_norm_is_the_compiled_models_norm(monkeypatch):
    """RMSNorm runs layer norm of [x, -x] eagerly and the fp32 form under torch.compile: one function. In fp32 a
    whole model's logits agree either way; in bf16 both stay within bf16's rounding of transformers' norm."""
    from transformers import LlamaConfig, LlamaForCausalLM
    from transformers.models.llama.modeling_llama import LlamaRMSNorm

    from specdeploy.models.config import ModelConfig
    from specdeploy.models.llama import LlamaModel, RMSNorm

    hf_config = LlamaConfig(vocab_size=64, hidden_size=32, intermediate_size=48, num_hidden_layers=2,
                            num_attention_heads=4, num_key_value_heads=2, tie_word_embeddings=True)
    torch.manual_seed(5)
    model = LlamaModel(ModelConfig.from_hf(hf_config), LlamaForCausalLM(hf_config).state_dict())
    tokens = torch.randint(0, 64, (2, 7))
    positions = torch.arange(7).repeat(2, 1)

    def logits() -> torch.Tensor:
        return model.logits(model(tokens, positions, model.new_cache(2, 8)))

    eager = logits()
    monkeypatch.setattr(torch.compiler, "is_compiling", lambda: True)
    compiled_form = logits()
    torch.testing.assert_close(eager, compiled_form, rtol=1e-5, atol=1e-5)
    monkeypatch.undo()

    weight, x = torch.randn(32).bfloat16(), (torch.randn(5, 32) * 3).bfloat16()
    hf_norm = LlamaRMSNorm(32, eps=1e-5).bfloat16()
    hf_norm.weight.data.copy_(weight)
    torch.testing.assert_close(RMSNorm(weight, 1e-5)(x), hf_norm(x))
