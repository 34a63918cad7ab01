"""The strict YAML builder on a dataclass of its own: it knows nothing of pipelines.

Fast: plain data, no files but one.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Literal

import pytest

from specdeploy.errors import PipelineError
from specdeploy.spec.strict_yaml import NOT_IN_FILE, Problem, Section, build, plain_data, read_yaml


@dataclass(frozen=True)
class Inner(Section):
    size: int = 1

    def check(self) -> None:
        if self.size < 1:
            raise Problem("size", f"must be ≥ 1, got {self.size}")


@dataclass(frozen=True)
class Outer(Section):
    name: str
    mode: Literal["fast", "slow"] = "fast"
    ratio: float = 0.5
    sizes: tuple[int, ...] = ()
    inner: Inner | None = None
    origin: Path | None = field(default=None, metadata=NOT_IN_FILE)


def test_a_dataclass_round_trips_through_plain_data():
    built = build(Outer, {"name": "x", "ratio": 1, "sizes": [1, 2], "inner": {"size": 3}}, "<test>")
    assert built == Outer(name="x", ratio=1.0, sizes=(1, 2), inner=Inner(size=3))
    assert plain_data(built) == {"name": "x", "mode": "fast", "ratio": 1.0, "sizes": [1, 2], "inner": {"size": 3}}
    assert build(Outer, plain_data(built), "<test>") == built


@pytest.mark.parametrize(("data", "message"), [
    ({"name": "x", "origin": "/tmp"}, "<test>: top level: unknown key 'origin'"),
    ({}, "<test>: name: required key is missing (str)"),
    ({"name": "x", "mode": "quick"}, "<test>: mode: 'quick' is not allowed (allowed: 'fast', 'slow')"),
    ({"name": "x", "ratio": float("nan")}, "<test>: ratio: must be a finite number"),
    ({"name": "x", "ratio": True}, "<test>: ratio: expected float, got True"),
    ({"name": "x", "sizes": [1, "2"]}, "<test>: sizes[1]: expected int, got '2'"),
    ({"name": "x", "inner": {"size": 0}}, "<test>: inner.size: must be ≥ 1, got 0"),
])
def test_errors_name_the_key_path_and_the_value(data, message):
    with pytest.raises(PipelineError) as error:
        build(Outer, data, "<test>")
    assert str(error.value).startswith(message)


def test_the_file_is_read_without_aliases_or_duplicate_keys(tmp_path):
    path = tmp_path / "thing.yaml"
    path.write_text("a: &x 1\nb: *x\n")
    with pytest.raises(PipelineError, match="aliases"):
        read_yaml(path, "thing")
    path.write_text("a: 1\na: 2\n")
    with pytest.raises(PipelineError, match="duplicate key 'a'"):
        read_yaml(path, "thing")
    with pytest.raises(PipelineError, match="thing file not found"):
        read_yaml(tmp_path / "missing.yaml", "thing")
