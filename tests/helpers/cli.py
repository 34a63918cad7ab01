"""Command lines: ours run in-process, and any argv read as its --flag value pairs."""

from __future__ import annotations

import json
from pathlib import Path

from click.testing import CliRunner

from specdeploy.cli import cli


class Result:
    def __init__(self, returncode: int, stdout: str, stderr: str) -> None:
        self.returncode, self.stdout, self.stderr = returncode, stdout, stderr


def run_cli(*args: str) -> Result:
    """The CLI in-process (importing torch per test would dominate the suite's time)."""
    result = CliRunner().invoke(cli, list(args))
    if result.exception is not None and not isinstance(result.exception, SystemExit):
        raise result.exception
    return Result(result.exit_code, result.stdout, result.stderr)


def run_bench(pipeline: Path, engines: Path, prompts: dict[str, str], *options: str) -> tuple[Result, dict]:
    """`specdeploy bench` in-process on `prompts` (text → kind, written as JSON Lines beside the engines), with its
    JSON report read back ({} when it failed)."""
    prompt_file, out = engines.parent / "prompts.jsonl", engines.parent / "report.json"
    prompt_file.write_text("".join(json.dumps({"prompt": text, "kind": kind}) + "\n" for text, kind in prompts.items()))
    result = run_cli("bench", str(pipeline), "--engines-dir", str(engines), "--prompts", str(prompt_file), "--json",
                     str(out), *options)
    return result, json.loads(out.read_text()) if result.returncode == 0 else {}


def flags(command: tuple[str, ...]) -> dict[str, str | None]:
    """--flag value pairs of an argv (a flag followed by another flag, or last, is a switch: None)."""
    found = {}
    for index, word in enumerate(command):
        if word.startswith("--"):
            following = command[index + 1] if index + 1 < len(command) else None
            found[word] = None if following is None or following.startswith("--") else following
    return found
