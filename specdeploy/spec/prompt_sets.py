"""Prompt sets: JSON Lines of {"prompt": ..., "kind": optional}, or the shipped mixed set the bench decodes (which
training and calibration leave out)."""

from __future__ import annotations

import json
from importlib import resources
from pathlib import Path

from specdeploy.errors import SpecdeployError

OPEN_ENDED = "open"  # the shipped set's kind of open-ended prompts (no text to copy), where speculation pays least


def load_prompts(path: str | Path | None = None) -> list[dict]:
    """[{"prompt", "kind"}] from JSON Lines of {"prompt": ..., "kind": optional}; the shipped mixed set when path
    is None. A prompt without a kind is "other"."""
    text = (Path(path).read_text() if path else
            resources.files("specdeploy").joinpath("data/prompts.jsonl").read_text())
    prompts = []
    for number, line in enumerate(text.splitlines(), 1):
        if not line.strip():
            continue
        try:
            item = json.loads(line)
        except json.JSONDecodeError as exc:
            raise SpecdeployError(f"{path}:{number}: not valid JSON: {exc}") from None
        if not isinstance(item, dict) or not isinstance(item.get("prompt"), str) or not item["prompt"].strip():
            raise SpecdeployError(f"{path}:{number}: expected an object with a non-empty string 'prompt'")
        prompts.append({"prompt": item["prompt"], "kind": str(item.get("kind", "other"))})
    if not prompts:
        raise SpecdeployError(f"{path}: no prompts")
    return prompts
