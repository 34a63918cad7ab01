"""The repository writer: built from the engine's own pipeline, replaced as a whole, never over something else."""

from __future__ import annotations

import pytest
from google.protobuf import text_format
from tritonclient.grpc import model_config_pb2

from specdeploy.errors import SpecdeployError
from specdeploy.triton.repository import write_repository


def test_a_rewrite_replaces_the_whole_repository(tiny_engines, tmp_path):
    output = write_repository(tiny_engines["ngram"].dir, tmp_path / "repo")
    (output / "postprocessing" / "1").mkdir(parents=True)  # a model an older layout had
    write_repository(tiny_engines["ngram"].dir, output)
    assert sorted(p.name for p in output.iterdir()) == ["ensemble", "preprocessing", "speculative"]
    for name in ("ensemble", "preprocessing", "speculative"):
        config = text_format.Parse((output / name / "config.pbtxt").read_text(), model_config_pb2.ModelConfig())
        assert config.name == name and config.max_batch_size == 8


def test_a_directory_that_is_not_a_repository_is_never_replaced(tiny_engines, tmp_path):
    (tmp_path / "mine").mkdir()
    (tmp_path / "mine" / "notes.txt").write_text("keep me")
    with pytest.raises(SpecdeployError, match="is not a model repository"):
        write_repository(tiny_engines["ngram"].dir, tmp_path / "mine")
    assert (tmp_path / "mine" / "notes.txt").read_text() == "keep me"


def test_weights_are_linked_and_everything_else_copied(tiny_engines, tmp_path):
    engine = tiny_engines["ngram"].dir
    output = write_repository(engine, tmp_path / "repo")
    copied = output / "speculative" / "1" / "engine"

    def inode(path):
        return path.stat().st_ino

    assert inode(copied / "target" / "model.safetensors") == inode(engine / "target" / "model.safetensors")
    assert inode(copied / "pipeline.json") != inode(engine / "pipeline.json")
