"""The layout's ceilings, which the review measured and which grow back when nothing measures them: no package file
over FILE_CEILING lines; every package module named in docs/architecture.md's folder map; the method walk-through's
files exist and are the only ones that name a method's settings section; the README's Measured section one table."""

from __future__ import annotations

import ast
import re
from pathlib import Path

from helpers.repo import REPO

from specdeploy.spec.speculation import METHODS

PACKAGE = REPO / "specdeploy"
ARCHITECTURE = REPO / "docs" / "architecture.md"
FILE_CEILING = 600
MEASURED_CEILING = 30  # lines of README's Measured section
SECTIONS = {traits.section for traits in METHODS.values() if traits.section and traits.section != "draft"}


def modules() -> list[Path]:
    return sorted(path for path in PACKAGE.rglob("*.py") if path.name != "__init__.py")


def test_no_package_file_is_over_the_ceiling():
    long = {str(path.relative_to(REPO)): n for path in modules() if (n := len(path.read_text().splitlines()))
            > FILE_CEILING}
    assert not long, f"split these by concept (over {FILE_CEILING} lines): {long}"


def folder_map(text: str) -> dict[str, str]:
    """docs/architecture.md's folder map: top folder (or "" for the package root) → the text naming its modules."""
    block = text.split("## Folders", 1)[1].split("```", 2)[1]
    sections: dict[str, str] = {}
    folder = None
    for line in block.splitlines():
        start = re.match(r"^(specdeploy/|  (\w+)/)\s", line)
        if start:
            folder = start.group(2) or ""
        elif not line.startswith(" "):
            folder = None  # tests/ and what follows
        if folder is not None:
            sections[folder] = sections.get(folder, "") + " " + line
    return sections


def unnamed_modules(text: str) -> list[str]:
    sections = folder_map(text)
    missing = []
    for path in modules():
        parts = path.relative_to(PACKAGE).parts
        folder = parts[0] if len(parts) > 1 else ""
        stem = path.parent.name if path.stem == "model" else path.stem  # a Triton model's model.py: its folder
        if not re.search(rf"(?<![\w/]){re.escape(stem)}\b", sections.get(folder, "")):
            missing.append(str(path.relative_to(PACKAGE)))
    return missing


def test_every_package_module_is_in_the_architecture_map():
    missing = unnamed_modules(ARCHITECTURE.read_text())
    assert not missing, f"docs/architecture.md's Folders map names none of: {missing}"


def test_the_map_check_finds_an_unnamed_module():
    text = ARCHITECTURE.read_text()
    assert unnamed_modules(text.replace("verify_shape.py", "verify_order.py")) == ["runtime/verify_shape.py"]


def walk_through(text: str) -> list[str]:
    """The package paths the walk-through names (`speculative/<method>.py` stays a pattern)."""
    section = text.split("## Adding a speculation method", 1)[1].split("\n## ", 1)[0]
    return [path for path in re.findall(r"`([\w/<>]+\.py)`", section) if not path.startswith("tests/")]


def reads_a_method_section(source: str) -> bool:
    """The code reads a method's settings section from a pipeline's speculation (`…speculation.medusa`)."""
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Attribute) and node.attr in SECTIONS:
            owner = node.value
            if (isinstance(owner, ast.Attribute) and owner.attr == "speculation") or \
                    (isinstance(owner, ast.Name) and owner.id == "speculation"):
                return True
    return False


def outside_the_walk_through(listed: list[str]) -> list[str]:
    patterns = [re.compile(re.escape(path).replace(re.escape("<method>"), r"\w+").replace(re.escape("<setting>"),
                                                                                            r"\w+") + "$")
                for path in listed]
    found = []
    for path in modules():
        relative = str(path.relative_to(PACKAGE))
        if reads_a_method_section(path.read_text()) and not any(p.match(relative) for p in patterns):
            found.append(relative)
    return found


def test_the_walk_through_names_every_file_a_method_reaches_and_they_exist():
    listed = walk_through(ARCHITECTURE.read_text())
    assert "spec/speculation.py" in listed and "speculative/registry.py" in listed
    missing = [path for path in listed if "<" not in path and not (PACKAGE / path).is_file()]
    assert not missing, f"the walk-through names files that do not exist: {missing}"
    stray = outside_the_walk_through(listed)
    assert not stray, f"these read a method's settings section but the walk-through does not list them: {stray}"


def test_the_walk_through_check_finds_a_stray_reader():
    listed = walk_through(ARCHITECTURE.read_text())
    assert outside_the_walk_through([p for p in listed if p != "build/torch_engine.py"]) == ["build/torch_engine.py"]
    assert reads_a_method_section("x = pipeline.speculation.medusa.heads\n")
    assert not reads_a_method_section("x = spec.ngram\ny = pipeline.speculation.draft\n")


def test_the_readmes_measured_section_is_one_short_table():
    readme = (REPO / "README.md").read_text()
    section = readme.split("## Measured", 1)[1].split("\n## ", 1)[0]
    tables = re.findall(r"^\|---", section, re.M)
    assert len(tables) == 1, "README's Measured keeps one table; the rest goes to docs/benchmarks.md"
    assert len(section.strip().splitlines()) <= MEASURED_CEILING
