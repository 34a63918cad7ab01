"""Where a model's weights come from: the checkpoint section shared by the target and a draft model."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

from specdeploy.spec.strict_yaml import Problem, Section, quoted

SourceKind = Literal["package", "gguf", "hf_dir"]
DType = Literal["float32", "bfloat16"]


@dataclass(frozen=True)
class CheckpointSpec(Section):
    """Where weights come from. package: '<python package>/<file inside it>'; gguf: a .gguf file; hf_dir: a
    directory with config.json, *.safetensors and tokenizer files. Relative paths are relative to the YAML file."""

    source: SourceKind
    path: str

    def check(self) -> None:
        if not self.path.strip():
            raise Problem("path", "must not be empty")
        if self.source == "package" and "/" not in self.path:
            raise Problem("path", f"package paths look like '<package>/<file>', got {quoted(self.path)}")
