"""What docs/serving.md promises, against the code's names: which counter sees each kind of refused request
(tests/serve/test_refusal_metrics.py)."""

from __future__ import annotations

import re

from helpers.repo import REPO

SERVING = REPO / "docs" / "serving.md"
HEADING = re.compile(r"^(#+) (.*)$")
CODE = re.compile(r"`([^`]+)`")


def section(heading: str) -> str:
    """The text under `heading` up to the next heading of its level or above."""
    lines = SERVING.read_text().splitlines()
    start = next(i for i, line in enumerate(lines) if (match := HEADING.match(line)) and match[2] == heading)
    level = len(HEADING.match(lines[start])[1])
    end = next((i for i in range(start + 1, len(lines))
                if (match := HEADING.match(lines[i])) and len(match[1]) <= level), len(lines))
    return "\n".join(lines[start + 1:end])


def first_table(text: str) -> list[list[str]]:
    """The first table's rows (the header first, the separator left out), each a list of its cells."""
    lines = text.splitlines()
    start = next((i for i, line in enumerate(lines) if line.startswith("|")), None)
    assert start is not None, "no table"
    end = next((i for i in range(start, len(lines)) if not lines[i].startswith("|")), len(lines))
    rows = lines[start:end]
    cells = [[cell.strip() for cell in row.strip("|").split("|")] for row in rows]
    return [cells[0]] + [row for row in cells[1:] if not set("".join(row)) <= {"-", ":", " "}]


def paragraph(text: str, lead: str) -> str:
    """The paragraph or list item of `text` that starts with `lead`, joined into one line."""
    blocks = re.split(r"\n(?=\s*\n|- )", text)
    found = [block for block in blocks if block.strip().removeprefix("- ").startswith(lead)]
    assert found, f"nothing starts with {lead!r}"
    return " ".join(found[0].split())


def test_the_metrics_table_names_the_counter_of_each_refusal():
    """Ours counts the speculative model's refusals; Triton's failure counter of the ensemble the preprocessing
    model's; and the table says that nothing counts Triton's own refusals."""
    metrics = section("Metrics")
    rows = {row[0]: row[1] for row in first_table(metrics)[1:]}
    assert "`invalid`" in rows["`specdeploy_requests_total{outcome}`"]
    assert "`preprocessing`" in rows['`nv_inference_request_failure{model="ensemble",reason="OTHER"}` (Triton\'s)']
    assert "before any model runs" in rows["none"]
    refusals = section("Refusals and the counters that see them")
    assert "`tests/serve/test_refusal_metrics.py`" in refusals
    for place in ("**by Triton, before any model runs**", "**by the `preprocessing` model**",
                  "**by the `speculative` model**"):
        assert paragraph(refusals, place)
