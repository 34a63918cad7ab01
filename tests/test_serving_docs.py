"""What docs/serving.md promises, against the code's names: what a seed and each serving.determinism keep (the
behaviour behind each cell: tests/runtime/test_what_a_seed_guarantees.py), what changes greedy text, and which
counter sees each kind of refused request (tests/serve/test_refusal_metrics.py)."""

from __future__ import annotations

import re
from typing import get_args

from helpers.repo import REPO

from specdeploy.spec.pipeline import Determinism, ServingSpec
from specdeploy.spec.speculation import METHODS

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


def test_the_seed_section_says_what_each_determinism_mode_keeps():
    """A column per serving.determinism, the code's default marked; batch_dependent keeps nothing beyond the same
    request served alone again (soak 5: seeded plain text differed under load in 107 of 107), batch_invariant keeps
    plain decode's text in any batch; the chain and tree methods named are the code's."""
    text = section("What a seed guarantees")
    header, *rows = first_table(text)
    columns = {CODE.search(cell)[1]: cell for cell in header[1:]}
    assert set(columns) == set(get_args(Determinism))
    assert [mode for mode, cell in columns.items() if "(default)" in cell] == [ServingSpec().determinism]
    table = {row[0]: dict(zip(columns, row[1:])) for row in rows}
    assert table["served alone again"] == {mode: "same text" for mode in columns}
    for claim, cells in table.items():
        if claim != "served alone again":
            assert cells["batch_dependent"].startswith("may differ"), claim
    plain = next(cells for claim, cells in table.items() if claim.startswith("plain"))
    assert plain == {"batch_dependent": "may differ from alone", "batch_invariant": "same as alone"}
    greedy_alone = table["greedy, speculative, served alone"]["batch_invariant"]
    chain, tree = re.match(r"chain methods \(([^)]*)\): same as plain; tree methods \(([^)]*)\): may differ",
                           greedy_alone).groups()
    assert set(CODE.findall(chain)) == {name for name, traits in METHODS.items()
                                        if traits.shape == "chain" and name != "none"}
    assert set(CODE.findall(tree)) == {name for name, traits in METHODS.items() if traits.shape == "tree"}
    assert "`tests/runtime/test_what_a_seed_guarantees.py`" in text


def test_the_seed_section_names_each_cause_of_changed_greedy_text_and_what_avoids_it():
    """Speculation alone (a near tie, a request served alone) and the batch, where under load the policy turns
    drafting off, so greedy requests get plain decode's text in a batch; and, for who needs identical text, the
    batch-invariant mode and fp32."""
    text = section("What a seed guarantees")
    speculation = paragraph(text, "**Speculation.**")
    assert "near tie" in speculation and "served alone" in speculation
    batch = paragraph(text, "**The batch.**")
    assert "`serving.determinism: batch_dependent`" in batch and "Plain decode is no exception" in batch
    assert "turns drafting off" in batch and "plain decode's text *in a batch*" in batch
    assert paragraph(text, "**The step program.**")
    remedy = paragraph(text, "**Who needs identical text**")
    assert "`serving.determinism: batch_invariant`" in remedy and "fp32" in remedy


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
