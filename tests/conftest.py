"""Shared fixtures: tiny random Llama checkpoints with a character tokenizer, built in milliseconds, and the
embedded SmolLM2 engine (fp32) built once per session."""

from __future__ import annotations

import importlib.util
import os
import string
import threading
from pathlib import Path

import pytest
import torch
import yaml

os.environ.setdefault("HF_HUB_OFFLINE", "1")
REPO = Path(__file__).resolve().parents[1]


def load_script(name: str):
    """scripts/NAME.py imported by path (scripts/ is not a package)."""
    spec = importlib.util.spec_from_file_location(name, REPO / "scripts" / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module

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


class Collector:
    """A scheduler callback that keeps a request's tokens and how it finished."""

    def __init__(self) -> None:
        self.tokens: list[int] = []
        self.reason: str | None = None
        self.stats = None  # the request's statistics at its end
        self.done = threading.Event()

    def __call__(self, tokens: list[int], finished: str | None, stats=None) -> None:
        assert not self.done.is_set(), "tokens after the final callback"
        self.tokens.extend(tokens)
        if finished is not None:
            self.reason, self.stats = finished, stats
            self.done.set()


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


# token-id prompts for the tiny models: plain text, a repeating pattern (n-gram drafts), a run
PROMPTS = [[5, 40, 41, 42, 43, 7, 9], [70, 71, 72, 70, 71, 72, 70, 71], [10, 11, 12, 13, 14, 15, 16, 17, 18, 19, 20]]


def write_pipeline(path: Path, **sections) -> Path:
    path.write_text(yaml.safe_dump(sections, sort_keys=False))
    return path


def tiny_pipeline(directory: Path, name: str, target: Path, method: str = "draft_target", draft: Path | None = None,
                  gamma: int = 3, dtype: str = "float32", schedule: str = "constant", derive: str = "int4",
                  target_weight_only: str | None = None, **extra) -> Path:
    speculation: dict = {"method": method, "num_draft_tokens": gamma, "schedule": schedule}
    if method == "draft_target":
        speculation["draft"] = ({"derive": "none", "checkpoint": {"source": "hf_dir", "path": str(draft)},
                                 "dtype": "float32"} if draft else {"derive": derive})
    if method == "ngram":
        speculation["ngram"] = {"min_n": 1, "max_n": 3}
    return write_pipeline(directory / f"{name}.yaml", name=name,
                          target={"checkpoint": {"source": "hf_dir", "path": str(target)}, "dtype": dtype,
                                  "weight_only": target_weight_only},
                          speculation=speculation,
                          limits={"max_batch_size": 8, "max_input_length": 64, "max_sequence_length": 256,
                                  "max_draft_tokens": 8}, **extra)


@pytest.fixture(scope="session")
def tiny_checkpoints(tmp_path_factory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("tiny")
    target = save_tiny_checkpoint(root / "target", seed=0)
    return {
        "target": target,
        "draft": save_tiny_checkpoint(root / "draft", seed=1, base=target, noise=0.3),
        "other_vocab": save_tiny_checkpoint(root / "other_vocab", seed=2, tokenizer=char_tokenizer(128, 7)),
        "smaller_vocab": save_tiny_checkpoint(root / "smaller_vocab", seed=3, vocab_size=112),
    }


@pytest.fixture(scope="session")
def tiny_engines(tiny_checkpoints, tmp_path_factory) -> dict[str, object]:
    """Loaded tiny engines: draft_target (noisy fp32 draft), int4 and int8 (derived drafts), ngram, int4_target (an
    int4 target with n-gram speculation), heuristic (noisy draft, adaptive proposal length)."""
    from specdeploy.build.torch_engine import build
    from specdeploy.runtime.engine import Engine
    from specdeploy.spec.pipeline import load_pipeline

    root = tmp_path_factory.mktemp("tiny-engines")
    specs = {
        "draft_target": tiny_pipeline(root, "tiny-dt", tiny_checkpoints["target"], draft=tiny_checkpoints["draft"]),
        "int4": tiny_pipeline(root, "tiny-int4", tiny_checkpoints["target"]),
        "int8": tiny_pipeline(root, "tiny-int8", tiny_checkpoints["target"], derive="int8"),
        "ngram": tiny_pipeline(root, "tiny-ngram", tiny_checkpoints["target"], method="ngram"),
        "int4_target": tiny_pipeline(root, "tiny-int4-target", tiny_checkpoints["target"], method="ngram",
                                     dtype="bfloat16", target_weight_only="int4"),
        "heuristic": tiny_pipeline(root, "tiny-heuristic", tiny_checkpoints["target"],
                                   draft=tiny_checkpoints["draft"], schedule="heuristic"),
    }
    return {key: Engine(build(load_pipeline(path), root / "engines", quiet=True).directory)
            for key, path in specs.items()}


@pytest.fixture(scope="session")
def smollm2_fp32_engines(tmp_path_factory) -> dict[str, object]:
    """SmolLM2-135M-Instruct in fp32 (for exactness), built once and loaded for both shipped methods."""
    from specdeploy.build.torch_engine import build
    from specdeploy.runtime.engine import Engine
    from specdeploy.spec.pipeline import load_pipeline

    root = tmp_path_factory.mktemp("smollm2")
    spec = yaml.safe_load((REPO / "pipelines" / "smollm2-draft-target.yaml").read_text())
    spec["name"] = "smollm2-fp32"
    spec["target"]["dtype"] = "float32"
    engine_dir = build(load_pipeline(write_pipeline(root / "fp32.yaml", **spec)), root / "engines",
                       quiet=True).directory
    return {"draft-target": Engine(engine_dir), "ngram": Engine(engine_dir, method="ngram")}
