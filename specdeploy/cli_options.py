"""What the CLI's commands share: the engines option and the parsing of comma-separated numbers."""

from __future__ import annotations

from pathlib import Path

import click

from specdeploy.spec.engine_paths import ENGINES_DIR

ENGINES_HELP = f"Directory holding <name>/ engines (default: ./{ENGINES_DIR}, or $SPECDEPLOY_ENGINES)."


def engines_option(function):
    return click.option("--engines-dir", type=click.Path(file_okay=False, path_type=Path),
                        envvar="SPECDEPLOY_ENGINES", default=ENGINES_DIR, show_default=True,
                        help=ENGINES_HELP)(function)


def integers(text: str, option: str) -> list[int]:
    """An option's comma-separated integers ("1,2,4"); a usage error naming the option otherwise."""
    return numbers(text, option, int)


def numbers(text: str, option: str, kind: type = float) -> list:
    """An option's comma-separated numbers of `kind` ("0,0.01"); a usage error naming the option otherwise."""
    try:
        return [kind(part) for part in text.split(",")]
    except ValueError:
        plural = "integers" if kind is int else "numbers"
        raise click.BadParameter(f"expected comma-separated {plural}, got {text!r}", param_hint=option) from None
