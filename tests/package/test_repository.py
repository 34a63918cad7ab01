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
    assert sorted(p.name for p in output.iterdir()) == ["drain_hold", "ensemble", "preprocessing", "speculative"]
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


# Upstream's ensemble inputs (NVIDIA/TensorRT-LLM@2a9abd95 triton_backend/all_models/inflight_batcher_llm/ensemble/
# config.pbtxt), as read there
UPSTREAM_ENSEMBLE_INPUTS = {
    "text_input", "decoder_text_input", "max_tokens", "num_return_sequences", "bad_words", "stop_words",
    "exclude_input_in_output", "end_id", "pad_id", "top_k", "top_p", "temperature", "length_penalty",
    "repetition_penalty", "min_tokens", "presence_penalty", "frequency_penalty", "seed", "return_log_probs",
    "return_context_logits", "return_generation_logits", "return_perf_metrics", "return_num_input_tokens",
    "return_num_output_tokens", "beam_width", "stream", "prompt_embedding_table", "prompt_table_extra_id",
    "prompt_vocab_size", "embedding_bias_words", "embedding_bias_weights", "lora_task_id", "lora_weights",
    "lora_config", "guided_decoding_guide_type", "guided_decoding_guide",
}


def test_every_upstream_ensemble_input_is_taken_or_listed_as_not_taken(tiny_engines, tmp_path):
    """A client written for upstream's ensemble names: each name is declared by our ensemble and speculative model,
    or listed in UPSTREAM_INPUTS_NOT_TAKEN (which neither declares, so Triton refuses it naming it) and in
    docs/serving.md."""
    from helpers.repo import REPO

    from specdeploy.serve.requests import UPSTREAM_INPUTS_NOT_TAKEN

    output = write_repository(tiny_engines["ngram"].dir, tmp_path / "repo")
    not_taken = set(UPSTREAM_INPUTS_NOT_TAKEN)
    for name in ("ensemble", "speculative"):
        config = text_format.Parse((output / name / "config.pbtxt").read_text(), model_config_pb2.ModelConfig())
        declared = {tensor.name for tensor in config.input}
        assert not declared & not_taken, name
        assert UPSTREAM_ENSEMBLE_INPUTS - declared == not_taken, name
    serving = " ".join((REPO / "docs" / "serving.md").read_text().split())
    assert [name for name in UPSTREAM_INPUTS_NOT_TAKEN if f"`{name}`" not in serving] == []
    assert "unexpected inference input 'seed' for model 'speculative'" in serving
