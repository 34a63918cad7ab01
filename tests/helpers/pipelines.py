"""Pipeline files written for a test: any sections, a tiny torch pipeline, and the same on backend trtllm."""

from __future__ import annotations

import os
import threading
from pathlib import Path

import yaml


def write_pipeline(path: Path, **sections) -> Path:
    """Written whole or not at all: session fixtures of several xdist workers write the same file in a shared
    folder (conftest.shared_root), and one reading it while another truncated it read an empty pipeline."""
    staging = path.with_name(f".{path.name}.{os.getpid()}.{threading.get_ident()}")
    staging.write_text(yaml.safe_dump(sections, sort_keys=False))
    os.replace(staging, path)
    return path


def tiny_pipeline(directory: Path, name: str, target: Path, method: str = "draft_target", draft: Path | None = None,
                  gamma: int = 3, dtype: str = "float32", schedule: str = "constant", derive: str = "int4",
                  target_weight_only: str | None = None, max_batch_size: int = 8,
                  speculation_extra: dict | None = None, **extra) -> Path:
    speculation: dict = {"method": method, "num_draft_tokens": gamma, "schedule": schedule,
                         **(speculation_extra or {})}
    if method == "draft_target":
        speculation["draft"] = ({"derive": "none", "checkpoint": {"source": "hf_dir", "path": str(draft)},
                                 "dtype": "float32"} if draft else {"derive": derive})
    if method == "ngram":
        speculation["ngram"] = {"min_n": 1, "max_n": 3}
    return write_pipeline(directory / f"{name}.yaml", name=name,
                          target={"checkpoint": {"source": "hf_dir", "path": str(target)}, "dtype": dtype,
                                  "weight_only": target_weight_only},
                          speculation=speculation,
                          limits={"max_batch_size": max_batch_size, "max_input_length": 64, "max_sequence_length": 256,
                                  "max_draft_tokens": 8}, **extra)


def trtllm_pipeline(tmp_path: Path, checkpoint: Path, name: str = "t", **changes) -> Path:
    """A tiny pipeline on backend trtllm; changes: top-level sections merged into it."""
    path = tiny_pipeline(tmp_path, name, checkpoint, dtype="bfloat16")
    spec = yaml.safe_load(path.read_text())
    spec["backend"] = {"kind": "trtllm", "trtllm": {}}
    for section, values in changes.items():
        spec[section] = {**spec.get(section, {}), **values}
    if spec["speculation"]["method"] != "draft_target":
        spec["speculation"].pop("draft", None)
    path.write_text(yaml.safe_dump(spec))
    return path
