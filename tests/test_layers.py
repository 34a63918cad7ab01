"""The architecture: a layered import graph without cycles, a torch-free pipeline at the bottom, and registries
through which a new proposer or model family is one module plus one line."""

from __future__ import annotations

import subprocess
import sys
import typing
from pathlib import Path

from conftest import REPO

from specdeploy.models.registry import ARCHITECTURES
from specdeploy.spec.pipeline import Method
from specdeploy.speculative.proposer import Proposer
from specdeploy.speculative.registry import PROPOSERS


def test_import_contracts_hold():
    """lint-imports checks the contracts in pyproject.toml: layers (no upward import), no cycle among sibling
    modules, and a torch-free bottom (pipeline, request, layout)."""
    lint = Path(sys.executable).parent / "lint-imports"
    result = subprocess.run([str(lint), "--no-cache"], cwd=REPO, capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stdout + result.stderr
    assert "0 broken" in result.stdout and "kept" in result.stdout


def test_loading_a_pipeline_imports_no_torch():
    code = ("import sys; from specdeploy.spec.pipeline import load_pipeline; "
            f"load_pipeline({str(REPO / 'pipelines' / 'smollm2-draft-target.yaml')!r}); "
            "import specdeploy.spec.request, specdeploy.spec.engine_paths; print('torch' in sys.modules)")
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip() == "False"


def test_every_method_has_exactly_one_proposer():
    assert set(PROPOSERS) == set(typing.get_args(Method))
    assert all(issubclass(proposer, Proposer) for proposer in PROPOSERS.values())


def test_every_architecture_is_registered_by_its_config_name():
    from specdeploy.models.config import ModelConfig

    assert ModelConfig.__dataclass_fields__["architecture"].default in ARCHITECTURES
