"""The architecture: a layered import graph without cycles, a torch-free pipeline at the bottom, and registries
through which a new proposer or model family is one module plus one line."""

from __future__ import annotations

import subprocess
import sys
import typing
from pathlib import Path

from helpers.repo import REPO

from specdeploy.models.registry import ARCHITECTURES
from specdeploy.spec.pipeline import Method
from specdeploy.speculative.proposer import Proposer
from specdeploy.speculative.registry import PROPOSERS


def test_import_contracts_hold():
    """lint-imports checks the contracts in pyproject.toml: layers (no upward import), no cycle among sibling
    modules, a torch-free bottom (pipeline, request, engine paths), a trtllm serving model without the torch engine,
    and a serve stage that imports neither build nor package (what runs inside tritonserver writes no repository)."""
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


ENGINE_CODE = ("specdeploy.runtime", "specdeploy.models", "specdeploy.speculative")


def engine_modules_loaded_by(model_file: str) -> list[str]:
    """The torch engine's modules (runtime, models, speculative) that loading serve/model_repo/<model_file> in a
    fresh interpreter imports, as tritonserver's Python backend loads it (pb_utils stubbed: there is no server)."""
    path = REPO / "specdeploy" / "serve" / "model_repo" / model_file
    code = ("import runpy, sys, types; "
            "sys.modules['triton_python_backend_utils'] = types.ModuleType('triton_python_backend_utils'); "
            f"runpy.run_path({str(path)!r}); "
            f"print(' '.join(sorted(m for m in sys.modules if m.startswith({ENGINE_CODE!r}))))")
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stderr
    return result.stdout.split()


def test_the_trtllm_serving_model_imports_no_torch_engine_code():
    """The trtllm flavour's `speculative` model loads no weights: it imports no runtime, models or speculative
    module (the torch flavour's model, which runs our engine, imports them: the check sees them when they load)."""
    assert engine_modules_loaded_by("speculative_trtllm/model.py") == []
    torch_flavour = engine_modules_loaded_by("speculative_torch/model.py")
    assert {"specdeploy.runtime.engine", "specdeploy.models.llama"} <= set(torch_flavour)


def test_every_method_has_exactly_one_proposer():
    assert set(PROPOSERS) == set(typing.get_args(Method))
    assert all(issubclass(proposer, Proposer) for proposer in PROPOSERS.values())


def test_every_architecture_is_registered_by_its_config_name():
    from specdeploy.models.config import ModelConfig

    assert ModelConfig.__dataclass_fields__["architecture"].default in ARCHITECTURES
