"""The Llama model's parts: prepacked bf16 linears, rotary embedding and RMSNorm against transformers', a tied
head, and the eager and compiled forms of the norm."""

from __future__ import annotations

import torch


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
        return model.logits(model(tokens, positions, model.new_cache(2, 8)).hidden)

    eager = logits()
    monkeypatch.setattr(torch.compiler, "is_compiling", lambda: True)
    compiled_form = logits()
    torch.testing.assert_close(eager, compiled_form, rtol=1e-5, atol=1e-5)
    monkeypatch.undo()

    weight, x = torch.randn(32).bfloat16(), (torch.randn(5, 32) * 3).bfloat16()
    hf_norm = LlamaRMSNorm(32, eps=1e-5).bfloat16()
    hf_norm.weight.data.copy_(weight)
    torch.testing.assert_close(RMSNorm(weight, 1e-5)(x), hf_norm(x))
