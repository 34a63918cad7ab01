"""Tiny random models built in milliseconds: Llama checkpoints with a character tokenizer, and an MoE layer."""

from __future__ import annotations

import string
from pathlib import Path

import torch

TINY = dict(vocab_size=128, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
            num_key_value_heads=2, max_position_embeddings=512, rms_norm_eps=1e-5, tie_word_embeddings=False,
            bos_token_id=1, eos_token_id=2)


def char_tokenizer(vocab_size: int = 128, shuffle_seed: int | None = None):
    """A character-level fast tokenizer: <unk>, <s>, </s>, printable ASCII, then fillers up to vocab_size.
    shuffle_seed permutes the ids of the ordinary tokens (same strings, other ids)."""
    from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    symbols = list(string.printable[:95])
    symbols += [f"<extra_{i}>" for i in range(vocab_size - 3 - len(symbols))]
    if shuffle_seed is not None:
        order = torch.randperm(len(symbols), generator=torch.Generator().manual_seed(shuffle_seed)).tolist()
        symbols = [symbols[i] for i in order]
    vocab = {token: i for i, token in enumerate(["<unk>", "<s>", "</s>"] + symbols)}
    backend = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    backend.pre_tokenizer = pre_tokenizers.Split(Regex("."), behavior="isolated")
    backend.decoder = decoders.Fuse()
    return PreTrainedTokenizerFast(tokenizer_object=backend, unk_token="<unk>", bos_token="<s>", eos_token="</s>")


def save_tiny_checkpoint(directory: Path, seed: int, base: Path | None = None, noise: float = 0.0,
                         tokenizer=None, **overrides) -> Path:
    """A random tiny Llama saved as a Hugging Face directory. With `base`, a copy of that checkpoint's weights
    plus Gaussian noise of relative size `noise` (a tiny draft that agrees with its target most of the time)."""
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(seed)
    config = LlamaConfig(**{**TINY, **overrides})
    model = LlamaForCausalLM(config)
    with torch.no_grad():
        for parameter in model.parameters():  # larger weights give peaked, less repetitive distributions
            parameter.mul_(4.0) if parameter.dim() == 2 else None
    if base is not None:
        model = LlamaForCausalLM.from_pretrained(base)
        with torch.no_grad():
            for parameter in model.parameters():
                parameter.add_(noise * parameter.std() * torch.randn_like(parameter))
    model.save_pretrained(directory)
    (tokenizer or char_tokenizer(config.vocab_size)).save_pretrained(directory)
    return directory


def tiny_moe_layer(device: str = "cpu"):
    """A random SparseMoE of 4 experts (2 per token) over 32 features, in fp32 on `device` (same weights on any)."""
    from specdeploy.models.config import ModelConfig
    from specdeploy.models.moe import SparseMoE

    generator = torch.Generator().manual_seed(0)
    config = ModelConfig(vocab_size=32, hidden_size=32, intermediate_size=48, num_layers=1, num_heads=4,
                         num_kv_heads=2, head_dim=8, architecture="mixtral", num_experts=4, experts_per_token=2)
    state = {"m.gate.weight": torch.randn(4, 32, generator=generator),
             "m.experts.gate_up_proj": torch.randn(4, 96, 32, generator=generator) / 6,
             "m.experts.down_proj": torch.randn(4, 32, 48, generator=generator) / 7}
    return SparseMoE(config, {key: value.to(device) for key, value in state.items()}, "m", torch.float32)


def save_tiny_eagle_head(directory: Path, feature_layers: tuple[int, ...] | None = (1, 2, 3), seed: int = 0) -> Path:
    """A random EAGLE-3 head for a TINY-sized target (a draft vocabulary of 32 tokens) in the folder layout
    speculation.eagle.head names; feature_layers None names no layers in config.json (the loaders' default
    capture then applies)."""
    import json

    from specdeploy.speculative.eagle_head import Eagle3Head, EagleConfig

    torch.manual_seed(seed)
    config = EagleConfig(hidden_size=TINY["hidden_size"], intermediate_size=TINY["intermediate_size"],
                         num_heads=TINY["num_attention_heads"], num_kv_heads=TINY["num_key_value_heads"],
                         head_dim=TINY["hidden_size"] // TINY["num_attention_heads"], vocab_size=TINY["vocab_size"],
                         draft_vocab_size=32, feature_layers=feature_layers or (1, 2, 3))
    Eagle3Head(config).save(directory)
    if feature_layers is None:
        data = json.loads((directory / "config.json").read_text())
        data.pop("eagle_aux_hidden_state_layer_ids", None)
        (directory / "config.json").write_text(json.dumps(data, indent=2) + "\n")
    return directory
