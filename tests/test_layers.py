"""The architecture: a layered import graph without cycles, a torch-free pipeline at the bottom, and registries
through which a new proposer or model family is one module plus one line."""

from __future__ import annotations

import ast
import shutil
import subprocess
import sys
import tomllib
import typing
from pathlib import Path

from helpers.repo import REPO

from specdeploy.models.registry import ARCHITECTURES
from specdeploy.spec.speculation import Method
from specdeploy.speculative.proposer import Proposer
from specdeploy.speculative.registry import PROPOSERS


def test_import_contracts_hold():
    """lint-imports checks the contracts in pyproject.toml: layers (no upward import), no cycle among sibling
    modules, a torch-free bottom (pipeline, request, engine paths), a trtllm serving model without the torch engine,
    a serve stage that imports neither build nor package (what runs inside tritonserver writes no repository), and
    pods/ (what runs inside the Kubernetes pods) on the standard library and the package stamp alone."""
    result = lint_imports(REPO)
    assert result.returncode == 0, result.stdout + result.stderr
    assert "0 broken" in result.stdout and "kept" in result.stdout


def lint_imports(root: Path) -> subprocess.CompletedProcess:
    """lint-imports on the package and pyproject.toml under `root` (it imports the package from its working
    directory)."""
    lint = Path(sys.executable).parent / "lint-imports"
    return subprocess.run([str(lint), "--no-cache"], cwd=root, capture_output=True, text=True, timeout=300)


PODS = REPO / "specdeploy" / "pods"
STAMP = "specdeploy.package.package_stamp"  # what the serving pods' wait compares (pods/build_journal.py)


def pods_contract() -> dict:
    contracts = tomllib.loads((REPO / "pyproject.toml").read_text())["tool"]["importlinter"]["contracts"]
    [contract] = [c for c in contracts if c.get("source_modules") == ["specdeploy.pods"]]
    return contract


def imported_modules(path: Path) -> list[tuple[int, str]]:
    """Every module the package's file `path` imports, at any depth (a function's import runs in the pod too), by
    line; relative imports made absolute."""
    package = path.relative_to(REPO).parent.parts
    found = []
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            found += [(node.lineno, alias.name) for alias in node.names]
        elif isinstance(node, ast.ImportFrom) and node.module != "__future__":
            base = package[:len(package) - node.level + 1] if node.level else ()
            found.append((node.lineno, ".".join((*base, *([node.module] if node.module else [])))))
    return found


def test_pods_import_only_the_standard_library_and_the_package_stamp():
    """What the contract cannot say generically: no third-party package at all, whatever its name, in any module
    under pods/ (they run in the pods through `python3 -m`, before anything else there)."""
    allowed = {"specdeploy.pods", STAMP}
    outside = [f"{path.relative_to(REPO)}:{line}: {module}"
               for path in sorted(PODS.glob("*.py"))
               for line, module in imported_modules(path)
               if module.split(".")[0] not in sys.stdlib_module_names
               and not any(module == name or module.startswith(f"{name}.") for name in allowed)]
    assert outside == []


def test_the_pods_contract_names_every_third_party_package_specdeploy_imports():
    """The pods contract lists third-party packages by name (import-linter's graph holds the standard library too,
    so no wildcard means "not the standard library"): a new dependency must join the list."""
    third_party = {module.split(".")[0]
                   for path in (REPO / "specdeploy").rglob("*.py")
                   for _, module in imported_modules(path)} - set(sys.stdlib_module_names) - {"specdeploy"}
    assert "torch" in third_party
    assert third_party <= set(pods_contract()["forbidden_modules"]), sorted(third_party)


def test_the_pods_contract_breaks_on_a_pods_module_importing_torch_or_a_stage(tmp_path):
    """The contract bites: lint-imports on a copy where pods/ imports torch and the spec stage fails, naming both;
    the stamp alone (and what it brings) is allowed."""
    shutil.copytree(REPO / "specdeploy", tmp_path / "specdeploy",
                    ignore=shutil.ignore_patterns("__pycache__", "*.jsonl"))
    shutil.copy(REPO / "pyproject.toml", tmp_path / "pyproject.toml")
    assert "specdeploy.*" in pods_contract()["forbidden_modules"]
    assert lint_imports(tmp_path).returncode == 0  # the copy as it is
    with (tmp_path / "specdeploy" / "pods" / "launch.py").open("a") as launch:
        launch.write("\nimport torch  # noqa: E402\n")
    with (tmp_path / "specdeploy" / "pods" / "job_status.py").open("a") as job_status:
        job_status.write("\nfrom specdeploy.spec import request  # noqa: E402\n")
    result = lint_imports(tmp_path)
    assert result.returncode != 0, result.stdout
    assert "specdeploy.pods is not allowed to import torch" in result.stdout, result.stdout
    assert "specdeploy.pods is not allowed to import specdeploy.spec" in result.stdout, result.stdout
    assert "specdeploy.pods.build_journal -> specdeploy.package" not in result.stdout  # the stamp stays allowed


def test_the_pods_programs_load_no_heavy_package():
    """What `python3 -m specdeploy.pods.…` loads in a fresh interpreter, the stamp's own imports included (which
    the contract leaves to package/): no torch, transformers, click, rich or numpy."""
    code = ("import sys, specdeploy.pods.launch, specdeploy.pods.build_journal, specdeploy.pods.job_status; "
            "print(' '.join(sorted(m for m in ('torch', 'transformers', 'click', 'rich', 'numpy') "
            "if m in sys.modules)))")
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stderr
    assert result.stdout.split() == []


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
