"""The speculation method's predicates: what each method is, and that the code asks them instead of its name.

Fast: nothing here loads a model (the registry check imports the proposers, not weights).
"""

from __future__ import annotations

import ast
import typing

import pytest
from helpers.repo import REPO

from specdeploy.errors import PipelineError
from specdeploy.spec.pipeline import METHODS, DraftSpec, EagleSpec, MedusaSpec, Method, SpeculationSpec

PACKAGE = REPO / "specdeploy"
# Where a comparison may still name a method: the predicates' definitions and the proposers' registry.
ALLOWED = {"spec/pipeline.py", "speculative/registry.py"}

PREDICATES = ("speculates", "uses_draft_model", "uses_heads", "uses_features", "drafts_with_own_layers",
              "drafts_by_lookahead", "drafts_from_context", "drafts_outside_target", "drafts_tree")
# method -> the predicates above, in order, written out by hand
EXPECTED = {
    "none": (False, False, False, False, False, False, False, False, False),
    "draft_target": (True, True, False, False, False, False, False, True, False),
    "ngram": (True, False, False, False, False, False, True, True, False),
    "medusa": (True, False, True, False, False, False, False, False, True),
    "eagle": (True, False, False, True, False, False, False, False, True),
    "early_exit": (True, False, False, False, True, False, False, False, False),
    "lookahead": (True, False, False, False, False, True, False, False, True),
}


def speculation(method: str) -> SpeculationSpec:
    """A valid SpeculationSpec of `method`, with the sections it requires."""
    if method == "draft_target":
        return SpeculationSpec(method=method, draft=DraftSpec())
    if method == "medusa":
        return SpeculationSpec(method=method, num_draft_tokens=2, medusa=MedusaSpec(heads="heads.safetensors"))
    if method == "eagle":
        return SpeculationSpec(method=method, eagle=EagleSpec(head="head"))
    return SpeculationSpec(method=method)


@pytest.mark.parametrize("method", EXPECTED)
def test_predicates_of_each_method(method: str):
    spec = speculation(method)
    assert {name: getattr(spec, name) for name in PREDICATES} == dict(zip(PREDICATES, EXPECTED[method]))


def test_every_method_has_predicates_and_a_proposer():
    from specdeploy.speculative.registry import PROPOSERS

    names = set(typing.get_args(Method))
    assert set(METHODS) == names
    assert set(PROPOSERS) == names
    assert set(EXPECTED) == names  # a new method gets its expected predicates written here too


def test_the_sections_follow_the_predicates():
    with pytest.raises(PipelineError, match="draft: required when method is 'draft_target'"):
        SpeculationSpec(method="draft_target")
    with pytest.raises(PipelineError, match="draft: only allowed when method is 'draft_target', not 'ngram'"):
        SpeculationSpec(method="ngram", draft=DraftSpec())
    with pytest.raises(PipelineError, match="acceptance: 'typical' .* not 'draft_target'"):
        SpeculationSpec(method="draft_target", draft=DraftSpec(), acceptance="typical")
    with pytest.raises(PipelineError, match="medusa.heads: required when method is 'medusa'"):
        SpeculationSpec(method="medusa")
    with pytest.raises(PipelineError, match="eagle.head: required when method is 'eagle'"):
        SpeculationSpec(method="eagle")
    with pytest.raises(PipelineError, match="acceptance: 'typical' .* not 'eagle'"):
        SpeculationSpec(method="eagle", acceptance="typical", eagle=EagleSpec(head="h"))
    assert SpeculationSpec(method="medusa", num_draft_tokens=2, acceptance="typical",
                           medusa=MedusaSpec(heads="h.safetensors")).drafts_tree


def test_an_unknown_method_built_in_code_is_refused():
    with pytest.raises(PipelineError, match="method: must be one of none, draft_target, ngram, medusa, eagle, "
                                            "early_exit, lookahead, got 'jacobi'"):
        SpeculationSpec(method="jacobi")  # type: ignore[arg-type]


# ------------------------------------------------------------------------------- no comparison names a method

def names_method(node: ast.expr) -> bool:
    """The expression reads a method: `method`, `x.method`, `x["method"]`."""
    if isinstance(node, ast.Subscript):
        return isinstance(node.slice, ast.Constant) and node.slice.value == "method"
    return (isinstance(node, ast.Name) and node.id == "method") or (isinstance(node, ast.Attribute)
                                                                     and node.attr == "method")


def method_literals(nodes: list[ast.expr | None]) -> set[str]:
    """The method names written as literals among `nodes`, or among the items of a tuple, list or set there."""
    items = []
    for node in nodes:
        items += node.elts if isinstance(node, (ast.Tuple, ast.List, ast.Set)) else [node]
    return {item.value for item in items if isinstance(item, ast.Constant) and item.value in METHODS}


def method_comparisons(source: str) -> list[int]:
    """Lines where a method is compared with a method's name, or a dict is keyed by methods' names (dispatch)."""
    lines = []
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Compare):
            sides = [node.left, *node.comparators]
            if method_literals(sides) and any(names_method(side) for side in sides):
                lines.append(node.lineno)
        elif isinstance(node, ast.Dict) and len(method_literals(node.keys)) > 1:
            lines.append(node.lineno)
    return sorted(lines)


def test_the_detector_finds_comparisons():
    source = ('a = x.method == "medusa"\nb = spec["method"] in ("draft_target", "ngram")\nc = "ngram" != spec.method\n'
              'd = self.method != "none"\ne = {"draft_target": 1, "medusa": 2}\n'
              'f = draft.derive != "none"\ng = method == other.method\nh = mode == "draft_tokens_external"\n'
              'i = key in ("method", "medusa")\n')
    assert method_comparisons(source) == [1, 2, 3, 4, 5]


def test_no_comparison_names_a_method_outside_the_predicates():
    found = []
    for path in sorted(PACKAGE.rglob("*.py")):
        relative = path.relative_to(PACKAGE).as_posix()
        if relative in ALLOWED:
            continue
        found += [f"specdeploy/{relative}:{line}" for line in method_comparisons(path.read_text())]
    assert not found, "ask SpeculationSpec's predicates (spec/pipeline.py) instead: " + ", ".join(found)
