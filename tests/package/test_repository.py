"""The repository writer: built from the engine's own pipeline, replaced as a whole, never over something else."""

from __future__ import annotations

import pytest
from google.protobuf import text_format
from tritonclient.grpc import model_config_pb2

from specdeploy.errors import SpecdeployError
from specdeploy.package.repository import write_repository


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


def test_an_installed_specdeploy_carries_the_model_code(tmp_path):
    """`specdeploy package` copies the Triton model files from the installed package: the wheel must hold them."""
    import shutil
    import subprocess
    import sys
    import zipfile

    from helpers.repo import REPO

    source = tmp_path / "source"  # a copy: setuptools writes build/ beside the sources, and ours holds Dockerfiles
    shutil.copytree(REPO / "specdeploy", source / "specdeploy", ignore=shutil.ignore_patterns("__pycache__"))
    for name in ("setup.cfg", "pyproject.toml", "README.md"):
        shutil.copy2(REPO / name, source / name)
    result = subprocess.run([sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation", "-q",
                             "-w", str(tmp_path / "wheel"), str(source)], capture_output=True, text=True)
    assert result.returncode == 0, result.stderr
    (wheel,) = (tmp_path / "wheel").glob("specdeploy-*.whl")
    names = set(zipfile.ZipFile(wheel).namelist())
    for model in ("preprocessing", "speculative_torch", "speculative_trtllm"):
        assert f"specdeploy/serve/model_repo/{model}/model.py" in names


def test_package_skips_unchanged_inputs_and_repackages_a_change(tiny_checkpoints, tmp_path):
    """What the Kubernetes build Job relies on: a second `package` with the same inputs writes nothing; a change in
    the pipeline (here a serving setting, which does not rebuild the engine) or --force writes it again."""
    from helpers.pipelines import tiny_pipeline

    from specdeploy.workflows import package

    path = tiny_pipeline(tmp_path, "tiny-package", tiny_checkpoints["target"], method="ngram")
    output = tmp_path / "repository"
    assert package(path, tmp_path / "engines", output) == (output, True)
    marker = output / "speculative" / "config.pbtxt"
    written = marker.stat().st_mtime_ns
    assert package(path, tmp_path / "engines", output) == (output, False)
    assert marker.stat().st_mtime_ns == written
    assert package(path, tmp_path / "engines", output, force=True).written
    path.write_text(path.read_text() + "serving: {kv_capacity_tokens: 1000}\n")
    assert package(path, tmp_path / "engines", output).written
    assert package(path, tmp_path / "engines", output, served_at=tmp_path / "elsewhere").written
