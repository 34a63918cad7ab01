"""The model compiles whole (torch.compile, inductor, no graph break) and a compiled step equals the eager one:
its logits and the cache entries it writes, decoding over a cache it shares with eager prefill (issue 27)."""

from __future__ import annotations

import pytest
import torch

from specdeploy.models.config import ModelConfig
from specdeploy.models.llama import LlamaModel


@pytest.mark.slow
def test_a_compiled_decode_step_equals_eager_and_writes_the_same_cache_entries():
    from transformers import LlamaConfig, LlamaForCausalLM

    hf_config = LlamaConfig(vocab_size=64, hidden_size=32, intermediate_size=48, num_hidden_layers=2,
                            num_attention_heads=4, num_key_value_heads=2, tie_word_embeddings=True)
    torch.manual_seed(7)
    model = LlamaModel(ModelConfig.from_hf(hf_config), LlamaForCausalLM(hf_config).state_dict(), prepack=False)
    compiled = torch.compile(model, fullgraph=True, dynamic=False)  # fullgraph: a graph break is an error
    prompt = torch.randint(0, 64, (1, 9))
    caches = {"eager": model.new_cache(1, 16), "compiled": model.new_cache(1, 16)}
    with torch.inference_mode():
        for cache in caches.values():
            model(prompt[:, :8], torch.arange(8)[None], cache)
            cache.lengths = [8]
        step = prompt[:, 8:9], torch.tensor([[8]])
        eager = model.logits(model(*step, caches["eager"]).hidden)
        ours = model.logits(compiled(*step, caches["compiled"]).hidden)
    torch.testing.assert_close(ours, eager, rtol=1e-5, atol=1e-5)
    for written, expected in zip(caches["compiled"].stacked(), caches["eager"].stacked()):  # keys, then values
        assert written[..., 8, :].abs().sum() > 0  # the compiled step wrote its entries into the cache it was given
        torch.testing.assert_close(written[..., :9, :], expected[..., :9, :], rtol=1e-5, atol=1e-5)
