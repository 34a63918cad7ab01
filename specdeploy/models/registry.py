"""Architectures by the name an engine's config.json records, and loading one engine component.

A new model family is one module exposing a class built as `Model(config, state, dtype)` with the interface of
`LlamaModel` (forward with positions, cache and mask; logits; new_cache), plus one line in ARCHITECTURES.
"""

from __future__ import annotations

import json
from collections.abc import Iterator, Mapping
from pathlib import Path

import torch
from safetensors import safe_open

from specdeploy.errors import SpecdeployError
from specdeploy.models.config import ModelConfig
from specdeploy.models.llama import LlamaModel
from specdeploy.models.moe import MixtralModel

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
ARCHITECTURES: dict[str, type[LlamaModel]] = {"llama": LlamaModel, "mixtral": MixtralModel}


def model_class(architecture: str) -> type[LlamaModel]:
    if architecture not in ARCHITECTURES:
        raise SpecdeployError(f"architecture {architecture!r} is not supported "
                              f"(allowed: {', '.join(ARCHITECTURES)})")
    return ARCHITECTURES[architecture]


def component_config(directory: Path) -> tuple[ModelConfig, str]:
    """The architecture and the dtype name recorded in `<engine>/<component>/config.json`."""
    meta = json.loads((Path(directory) / "config.json").read_text())
    return ModelConfig.from_dict(meta["model"]), meta["dtype"]


def load_component(directory: Path, device: str = "cpu", prepack: bool = True,
                   row_invariant: bool = False) -> LlamaModel:
    """A model from `<engine>/<component>/` (config.json + model.safetensors), checked on one token: weights that
    hold NaN or inf are an error here, not empty text later. prepack=False for a model to be compiled.
    row_invariant: attend row by row (batch invariance: LlamaModel)."""
    config, dtype = component_config(directory)
    state = TensorsOnAccess(Path(directory) / "model.safetensors", device)
    model = model_class(config.architecture)(config, state, DTYPES[dtype], prepack=prepack,
                                             row_invariant=row_invariant).to(device).eval()
    with torch.inference_mode():
        token = torch.zeros(1, 1, dtype=torch.long, device=device)
        logits = model.logits(model(token, token, model.new_cache(1, 1)).hidden)
    if not torch.isfinite(logits).all():
        raise SpecdeployError(f"{directory}: the model's logits are not finite (its weights hold NaN or inf); "
                              f"rebuild the engine (specdeploy build --force)")
    return model


class TensorsOnAccess(Mapping[str, torch.Tensor]):
    """A safetensors file's tensors, each read when it is looked up and not kept: a model built from it holds a
    weight's stored form only while it converts it (fuses, quantizes, prepacks), so a load's resident peak stays
    near the model's own size instead of the file's plus the model's. Each lookup maps the file and unmaps it again,
    so the file's pages do not stay resident either. It lowers a load's peak RSS for a little more load time (one
    open per tensor); plain reads at each offset peaked higher (measured on SmolLM2:
    docs/benchmarks.md, "Figures behind the code")."""

    def __init__(self, path: Path, device: str = "cpu") -> None:
        self.path, self.device = str(path), device
        with safe_open(self.path, framework="pt") as weights:
            self.names = list(weights.keys())
        self.known = set(self.names)

    def __getitem__(self, name: str) -> torch.Tensor:
        if name not in self.known:
            raise KeyError(name)
        with safe_open(self.path, framework="pt", device=self.device) as weights:
            return weights.get_tensor(name)

    def __contains__(self, name: object) -> bool:
        return name in self.known

    def __iter__(self) -> Iterator[str]:
        return iter(self.names)

    def __len__(self) -> int:
        return len(self.names)


def projection_key(names) -> str:
    """The vocabulary projection's tensor among `names`: lm_head.weight, or the embedding table when they are tied."""
    return "lm_head.weight" if "lm_head.weight" in names else "model.embed_tokens.weight"


def load_projection(directory: Path) -> torch.Tensor:
    """A dense component's vocabulary projection [V, H] in fp32, read alone from its model.safetensors (what Medusa
    heads are trained and measured through)."""
    with safe_open(str(Path(directory) / "model.safetensors"), framework="pt") as weights:
        return weights.get_tensor(projection_key(set(weights.keys()))).float()
