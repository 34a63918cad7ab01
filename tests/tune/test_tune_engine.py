"""tune_engine (tune/engine.py): the steps a pipeline asks for run in order, each only when its record is missing,
and every step after one that ran runs again; `specdeploy tune` measures anew without rebuilding."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from helpers.cli import run_cli
from helpers.pipelines import tiny_pipeline

from specdeploy.spec.manifest import MANIFEST_FILE
from specdeploy.spec.pipeline import load_pipeline
from specdeploy.tune import engine as tuning
from specdeploy.tune.engine import TuneStep, tune_engine
from specdeploy.workflows import build_torch_engine


def recording_steps(ran: list[str], held: set[str], asked: set[str]) -> tuple[TuneStep, ...]:
    """Three steps that record when they run; `held`: those whose record the engine holds, `asked`: those the
    pipeline asks for."""
    def step(name: str) -> TuneStep:
        return TuneStep(name, lambda pipeline: None if name in asked else "not asked",
                        lambda pipeline, directory: name in held,
                        lambda pipeline, directory, quiet: ran.append(name) or f"{name} measured")
    return tuple(step(name) for name in ("first", "second", "third"))


@pytest.fixture
def engine_dir(tiny_checkpoints, tmp_path) -> Path:
    path = tiny_pipeline(tmp_path, "tiny-tune", tiny_checkpoints["target"], method="ngram")
    return build_torch_engine(load_pipeline(path), tmp_path / "engines", quiet=True).directory


@pytest.mark.parametrize(("held", "asked", "expected"), [
    ({"first", "second", "third"}, {"first", "second", "third"}, []),  # every record held: nothing runs
    ({"first", "third"}, {"first", "second", "third"}, ["second", "third"]),  # a later step follows one that ran
    ({"second", "third"}, {"first", "second", "third"}, ["first", "second", "third"]),
    (set(), {"third"}, ["third"]),  # steps the pipeline does not ask for never run
])
def test_a_step_runs_when_its_record_is_missing_and_every_later_step_with_it(engine_dir, monkeypatch, held, asked,
                                                                               expected):
    ran = []
    monkeypatch.setattr(tuning, "STEPS", recording_steps(ran, held, asked))
    assert tune_engine(engine_dir, quiet=True) == [f"{name} measured" for name in expected]
    assert ran == expected


def test_again_runs_every_step_the_pipeline_asks_for(engine_dir, monkeypatch):
    ran = []
    monkeypatch.setattr(tuning, "STEPS", recording_steps(ran, {"first", "second", "third"}, {"first", "third"}))
    tune_engine(engine_dir, quiet=True, again=True)
    assert ran == ["first", "third"]


def test_specdeploy_tune_measures_the_gamma_cap_again_without_a_rebuild(tiny_checkpoints, tmp_path):
    path = tiny_pipeline(tmp_path, "tiny-retune", tiny_checkpoints["target"], method="ngram",
                         serving={"policy": {"gamma_cap": "measured"}})
    engines = tmp_path / "engines"
    directory = build_torch_engine(load_pipeline(path), engines, quiet=True).directory
    policy = directory / "measured_policy.json"
    first, written = json.loads(policy.read_text()), policy.stat().st_mtime_ns
    manifest = (directory / MANIFEST_FILE).stat().st_mtime_ns
    result = run_cli("tune", str(path), "--engines-dir", str(engines))
    assert result.returncode == 0, result.stderr
    again = json.loads(policy.read_text())
    assert policy.stat().st_mtime_ns != written and "gamma cap" in result.stdout and str(policy) in result.stdout
    assert set(again["realized_speedup_by_gamma"]) == set(first["realized_speedup_by_gamma"])
    assert (directory / MANIFEST_FILE).stat().st_mtime_ns == manifest  # not rebuilt


def test_specdeploy_tune_needs_a_built_engine(tiny_checkpoints, tmp_path):
    path = tiny_pipeline(tmp_path, "tiny-unbuilt", tiny_checkpoints["target"], method="ngram")
    result = run_cli("tune", str(path), "--engines-dir", str(tmp_path / "none"))
    assert result.returncode != 0 and "specdeploy build" in result.stderr
