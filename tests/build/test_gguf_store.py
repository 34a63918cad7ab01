"""The GGUF conversion store (specdeploy/build/gguf_store.py): a checkpoint read from it is the GGUF's own load, bit
for bit; it is keyed by the file's bytes; concurrent and failed conversions leave no half-written entry; and a
configuration read alone is kept for later plans."""

from __future__ import annotations

import os
import threading
from pathlib import Path

import pytest
import torch
from helpers.repo import REPO

from specdeploy.build import gguf_store
from specdeploy.build.checkpoints import load_checkpoint, locate, target_hf_config
from specdeploy.spec.pipeline import load_pipeline

SMOLLM2 = REPO / "pipelines" / "smollm2-ngram.yaml"
TEXTS = ["Write a haiku about the sea.", "def f(x):\n    return x ** 2  # ünïcødé 🙂", "  two  spaces\n\n\ttabs"]


@pytest.mark.smollm2
def test_a_checkpoint_from_the_store_is_the_gguf_s_own_load(monkeypatch):
    """The store the run shares (tests/conftest.py) against transformers' load of the GGUF itself: the same
    configuration, every tensor equal in value and dtype, and a tokenizer that encodes, decodes and templates the
    same."""
    pipeline = load_pipeline(SMOLLM2)
    stored = load_checkpoint(pipeline.target.checkpoint, pipeline)
    assert gguf_store.store_dir(None) is not None
    assert (gguf_store.store_dir(None) / gguf_store.entry_name(locate(pipeline.target.checkpoint, pipeline))).is_dir()
    monkeypatch.delenv(gguf_store.STORE_VARIABLE)
    direct = load_checkpoint(pipeline.target.checkpoint, pipeline)  # no store: the GGUF parsed as before
    assert stored.config == direct.config
    assert stored.state.keys() == direct.state.keys()
    for name, tensor in direct.state.items():
        assert stored.state[name].dtype == tensor.dtype and torch.equal(stored.state[name], tensor), name
    ours, theirs = stored.tokenizer, direct.tokenizer
    assert ours.get_vocab() == theirs.get_vocab()
    assert ours.all_special_tokens == theirs.all_special_tokens and ours.eos_token == theirs.eos_token
    for text in TEXTS:
        assert ours.encode(text) == theirs.encode(text)
        assert ours.decode(ours.encode(text)) == theirs.decode(theirs.encode(text))
    chat = [{"role": "user", "content": TEXTS[0]}]
    assert ours.apply_chat_template(chat, add_generation_prompt=True, tokenize=False) == \
        theirs.apply_chat_template(chat, add_generation_prompt=True, tokenize=False)


@pytest.fixture
def fake_gguf(tmp_path, monkeypatch) -> Path:
    """A file standing for a GGUF, with a conversion that writes a marker instead of loading transformers."""
    gguf = tmp_path / "model.gguf"
    gguf.write_bytes(b"GGUF" + bytes(64))
    monkeypatch.setenv(gguf_store.STORE_VARIABLE, str(tmp_path / "store"))
    return gguf


def marker_conversion(calls: list, delay: threading.Event | None = None):
    def convert(gguf: Path, destination: Path) -> None:
        calls.append(destination)
        if delay is not None:
            delay.wait(5)
        destination.mkdir(parents=True)
        (destination / "config.json").write_text("{}")
    return convert


def test_a_conversion_is_made_once_and_keyed_by_the_files_bytes(fake_gguf, monkeypatch):
    calls: list = []
    monkeypatch.setattr(gguf_store, "convert", marker_conversion(calls))
    first = gguf_store.converted(fake_gguf, None)
    assert gguf_store.converted(fake_gguf, None) == first and len(calls) == 1
    fake_gguf.write_bytes(b"GGUF" + bytes(63) + b"\x01")  # the same size, other bytes
    os.utime(fake_gguf, ns=(1, 1))
    assert gguf_store.converted(fake_gguf, None) != first and len(calls) == 2
    assert not [path for path in first.parent.iterdir() if ".partial-" in path.name]


def test_concurrent_conversions_leave_one_whole_entry(fake_gguf, monkeypatch):
    calls: list = []
    release = threading.Event()
    monkeypatch.setattr(gguf_store, "convert", marker_conversion(calls, release))
    results: list = []
    threads = [threading.Thread(target=lambda: results.append(gguf_store.converted(fake_gguf, None)))
               for _ in range(2)]
    for thread in threads:
        thread.start()
    while len(calls) < 2:
        threading.Event().wait(0.01)
    release.set()
    for thread in threads:
        thread.join(10)
    assert len(results) == 2 and results[0] == results[1] and (results[0] / "config.json").is_file()
    assert [path.name for path in results[0].parent.iterdir()] == [results[0].name]  # no staging left behind


def test_a_store_that_cannot_be_written_falls_back_to_the_gguf(fake_gguf, monkeypatch, capsys):
    def failing(gguf: Path, destination: Path) -> None:
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(gguf_store, "convert", failing)
    assert gguf_store.converted(fake_gguf, None) is None
    assert "is not kept in" in capsys.readouterr().err  # said, and the GGUF is loaded itself
    monkeypatch.delenv(gguf_store.STORE_VARIABLE)
    assert gguf_store.converted(fake_gguf, None) is None  # no store named and no engines root: none
    monkeypatch.setattr(gguf_store, "convert", marker_conversion([]))
    beside = gguf_store.converted(fake_gguf, fake_gguf.parent / "engines")
    assert beside.parent == fake_gguf.parent / "engines" / gguf_store.STORE_FOLDER


@pytest.mark.smollm2
def test_a_configuration_read_alone_is_kept_for_later_plans(tmp_path, monkeypatch):
    monkeypatch.setenv(gguf_store.STORE_VARIABLE, str(tmp_path / "store"))
    pipeline = load_pipeline(SMOLLM2)
    first = target_hf_config(pipeline)
    kept = list((tmp_path / "store").iterdir())
    assert [path.name.endswith(gguf_store.CONFIG_SUFFIX) for path in kept] == [True]
    again = target_hf_config(pipeline)
    ignored = {"_name_or_path"}  # where transformers read it from
    assert {k: v for k, v in again.to_dict().items() if k not in ignored} == \
        {k: v for k, v in first.to_dict().items() if k not in ignored}
