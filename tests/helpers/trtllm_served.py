"""A trtllm repository served by a real tritonserver with the tensorrtllm backend's Python double in place of its
engine models (tests/trtllm_double/backend/): the build double's tools on PATH for a module-scoped build, and the
swap of each tensorrtllm model for the double."""

from __future__ import annotations

import shutil
import sys
from pathlib import Path

from google.protobuf import text_format
from tritonclient.grpc import model_config_pb2 as pb

from helpers.repo import REPO

DOUBLE = REPO / "tests" / "trtllm_double"


def tensorrtllm_double_bin(directory: Path) -> Path:
    """trtllm-build and python3 as the build double's (test_trtllm_build.double, for a module-scoped build)."""
    directory.mkdir()
    for name, target in (("trtllm-build", f"{sys.executable} {DOUBLE / 'trtllm_build.py'}"),
                         ("python3", sys.executable)):
        (directory / name).write_text(f'#!/bin/sh\nexec {target} "$@"\n')
        (directory / name).chmod(0o755)
    return directory


def swap_in_the_double(repository: Path, components: dict[str, Path]) -> None:
    """Each tensorrtllm model becomes the Python double: same tensors and parameters, backend python, plus
    `double_component` (the torch engine component it runs) and the double's files in its version directory."""
    for name, component in components.items():
        path = repository / name / "config.pbtxt"
        config = text_format.Parse(path.read_text(), pb.ModelConfig())
        assert config.backend == "tensorrtllm"
        config.backend = "python"
        config.parameters["double_component"].string_value = str(component)
        path.write_text(text_format.MessageToString(config))
        for file in ("model.py", "tensorrtllm_double.py"):
            shutil.copy2(DOUBLE / "backend" / file, repository / name / "1" / file)
