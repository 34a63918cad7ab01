"""What a Triton Python model finds on disk: the files its parameters name, relative to its version directory.

A repository written by `specdeploy package` keeps each model's files inside the model (`speculative/1/engine/`,
`preprocessing/1/tokenizer/`, ...) and names them by relative paths, so it serves from wherever it is copied or
mounted. An absolute path in a parameter (an engine on another volume) is used as it is.
"""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path

from specdeploy.decoding.light_tokenizer import load_tokenizer_files

# The Triton Python models' code, which `specdeploy package` copies into each repository it writes.
MODEL_CODE = Path(__file__).resolve().parent / "model_repo"
DRAIN_FILE_VARIABLE = "SPECDEPLOY_DRAIN_FILE"  # set by the launcher: where a shutdown's deadline is written
# set by the launcher: where the model writes why its scheduler failed, before it has the server stop (the launcher
# then exits non-zero with that text)
FAILURE_FILE_VARIABLE = "SPECDEPLOY_FAILURE_FILE"
ENGINE_PARAMETER = "engine_dir"
TOKENIZER_PARAMETER = "tokenizer_dir"
WEIGHTS = "model.safetensors"
# The trtllm flavour's orchestration: the served pipeline's file, and the tensorrtllm models it calls (upstream's BLS
# names its parameters the same way).
PIPELINE_PARAMETER = "pipeline_file"
TARGET_MODEL_PARAMETER, DRAFT_MODEL_PARAMETER = "tensorrt_llm_model_name", "tensorrt_llm_draft_model_name"


def drained_file(drain_file: str | Path) -> Path:
    """Where the `speculative` model says, once draining, that it has no request left (serve/drain_hold.py)."""
    return Path(f"{drain_file}.done")


def parameter_path(args: dict, name: str) -> Path:
    """The path parameter `name` of the model whose initialize() received `args`. Triton passes the model's
    directory as `model_repository` and its version as `model_version`."""
    parameters = json.loads(args["model_config"])["parameters"]
    path = Path(parameters[name]["string_value"])
    return path if path.is_absolute() else Path(args["model_repository"]) / args["model_version"] / path


def load_tokenizer(args: dict):
    """The tokenizer of the model whose initialize() received `args`, without importing transformers where the
    files allow (decoding/light_tokenizer.py): about 2.5 s less of every server start on a 2-core CPU."""
    return load_tokenizer_files(parameter_path(args, TOKENIZER_PARAMETER))


def model_vocabulary(directory: Path) -> tuple[int, int | list[int] | None]:
    """A Hugging Face config.json's vocab_size and eos_token_id (one id, several or none); through transformers'
    AutoConfig, whose model classes have defaults for both, where the file leaves either out."""
    config = json.loads((Path(directory) / "config.json").read_text(encoding="utf-8"))
    if "vocab_size" in config and "eos_token_id" in config:
        return config["vocab_size"], config["eos_token_id"]
    from transformers import AutoConfig

    config = AutoConfig.from_pretrained(directory)
    return config.vocab_size, config.eos_token_id


SAFETENSORS = ("*.safetensors", "*.safetensors.index.json")
OTHER_WEIGHTS = ("*.bin", "*.bin.index.json", "*.pth", "*.pt", "*.gguf", "*.h5", "*.msgpack", "*.onnx")


def hf_dir_files(weights: bool, *leave_out: str):
    """A copytree `ignore` for a Hugging Face directory, which may be a checkpoint as downloaded: it keeps the top
    level's configuration and tokenizer files and, with `weights`, the safetensors a loader reads. It drops other
    weight formats, the names in `leave_out`, and every subdirectory (a hub download's original/ holds the weights
    again in another format)."""
    patterns = OTHER_WEIGHTS + (() if weights else SAFETENSORS) + leave_out

    def ignore(directory: str, names: list[str]) -> set[str]:
        folders = {name for name in names if os.path.isdir(os.path.join(directory, name))}
        return set(shutil.ignore_patterns(*patterns)(directory, names)) | folders

    return ignore


def link_or_copy(source: str, destination: str) -> None:
    """Weights (safetensors, TensorRT engines) as hard links (no second copy on disk; a build never rewrites a
    file in place, it renames a new engine over the old one) where the file system allows it; every other file as
    a copy, so editing the repository's pipeline.json cannot change the engine's."""
    if Path(source).suffix in (".safetensors", ".engine"):
        try:
            os.link(source, destination)
            return
        except OSError:
            pass
    shutil.copy2(source, destination)
