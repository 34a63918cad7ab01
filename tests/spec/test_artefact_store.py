"""The artefact store (spec/artefact_store.py) behind the GGUF conversions and the step programs: entries appear
whole or not at all, a second writer's entry is kept, a failed write leaves nothing, an unwritable store is skipped."""

from __future__ import annotations

from pathlib import Path

import pytest

from specdeploy.spec.artefact_store import ArtefactStore, content_key


def test_entries_are_found_once_added_whole(tmp_path):
    store = ArtefactStore(tmp_path / "store")
    assert store.find("a.bin") is None and store.find("folder", holds="config.json") is None
    assert store.add("a.bin", lambda staging: staging.write_bytes(b"program")) == tmp_path / "store" / "a.bin"

    def folder(staging: Path) -> None:
        staging.mkdir()
        (staging / "config.json").write_text("{}")

    assert store.add("folder", folder) == store.find("folder", holds="config.json")
    assert store.find("folder", holds="weights") is None  # a folder without what it must hold is not an entry
    assert sorted(path.name for path in (tmp_path / "store").iterdir()) == ["a.bin", "folder"]  # no staging left


def test_a_second_writers_folder_is_kept_and_a_failed_write_leaves_nothing(tmp_path):
    store = ArtefactStore(tmp_path)

    def folder(text: str):
        def write(staging: Path) -> None:
            staging.mkdir()
            (staging / "config.json").write_text(text)
        return write

    store.add("entry", folder("first"))
    assert (store.add("entry", folder("second")) / "config.json").read_text() == "first"

    def failing(staging: Path) -> None:
        staging.write_text("half")
        raise ValueError("interrupted")

    with pytest.raises(ValueError):
        store.add("broken", failing)
    assert sorted(path.name for path in tmp_path.iterdir()) == ["entry"]


def test_no_store_or_an_unwritable_one_keeps_nothing_and_says_why(tmp_path, capsys):
    assert ArtefactStore(None).add("x", lambda staging: staging.write_text("x")) is None
    blocked = tmp_path / "file"
    blocked.write_text("not a folder")
    assert ArtefactStore(blocked / "store").add("x", lambda staging: staging.write_text("x")) is None
    assert "x is not kept in" in capsys.readouterr().err


def test_keys_follow_what_they_describe():
    assert content_key({"a": 1, "b": [2]}) == content_key({"b": [2], "a": 1})
    assert content_key({"a": 1}) != content_key({"a": 2}) and len(content_key({})) == 32
