"""The repository the tests run in, and its scripts/ (not a package) imported by path."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]


def load_script(name: str):
    """scripts/NAME.py imported by path (scripts/ is not a package)."""
    spec = importlib.util.spec_from_file_location(name, REPO / "scripts" / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module  # dataclasses look their module up there while the script runs
    spec.loader.exec_module(module)
    return module
