"""The speculation methods' descriptors: what each method is, and that the code asks them instead of its name.

Fast: nothing here loads a model (the registry check imports the proposers, not weights).
"""

from __future__ import annotations

import ast
import typing

import pytest
from helpers.repo import REPO

from specdeploy.errors import PipelineError
from specdeploy.spec.speculation import (
    METHODS,
    DraftSpec,
    EagleSpec,
    EarlyExitSpec,
    MedusaSpec,
    Method,
    SpeculationSpec,
)

PACKAGE = REPO / "specdeploy"
# Where a comparison may still name a method: the descriptors' table and the proposers' registry.
ALLOWED = {"spec/speculation.py", "speculative/registry.py"}

# method -> what its descriptor answers, written out by hand: speculates, drafts outside the target, a tree, its
# settings section, the keys of the trained parts it names (in these specs), the TensorRT-LLM lines it runs on
EXPECTED = {
    "none": (False, False, False, None, [], ("engine", "llm_api")),
    "draft_target": (True, True, False, "draft", [], ("engine", "llm_api")),
    "ngram": (True, True, False, "ngram", [], ("engine", "llm_api")),
    "medusa": (True, False, True, "medusa", ["speculation.medusa.heads"], ("engine",)),
    "eagle": (True, False, True, "eagle", ["speculation.eagle.head"], ("llm_api",)),
    "early_exit": (True, False, False, "early_exit", [], ()),
    "lookahead": (True, False, True, "lookahead", [], ("engine",)),
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
def test_what_each_methods_descriptor_answers(method: str):
    spec = speculation(method)
    answers = (spec.speculates, spec.drafts_outside_target, spec.drafts_tree, spec.traits.section,
               [source.key for source in spec.trained_sources], spec.traits.trtllm.lines)
    assert answers == EXPECTED[method]


def test_an_optional_trained_part_is_named_only_where_set():
    bare = SpeculationSpec(method="early_exit")
    adapted = SpeculationSpec(method="early_exit", early_exit=EarlyExitSpec(exit_layer=6, adapter="adapter"))
    assert bare.trained_sources == []
    assert [(s.key, s.part.folder, s.path) for s in adapted.trained_sources] == [
        ("speculation.early_exit.adapter", "exit_adapter", "adapter")]


def test_verify_nodes_come_from_the_methods_section():
    assert speculation("draft_target").verify_nodes()[0] == 4
    assert speculation("medusa").verify_nodes()[:2] == (len(MedusaSpec().choices), "choices")
    assert speculation("eagle").verify_nodes()[:2] == (EagleSpec().max_nodes, "max_nodes")
    assert speculation("lookahead").verify_nodes()[0] == SpeculationSpec().lookahead.nodes


def test_every_method_has_a_descriptor_and_a_proposer():
    from specdeploy.speculative.registry import PROPOSERS

    names = set(typing.get_args(Method))
    assert set(METHODS) == names
    assert set(PROPOSERS) == names
    assert set(EXPECTED) == names  # a new method gets its expected answers written here too


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
    with pytest.raises(PipelineError, match="num_draft_tokens: for medusa the tree depth cap"):
        SpeculationSpec(method="medusa", num_draft_tokens=5, medusa=MedusaSpec(heads="h.safetensors"))


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


def test_no_comparison_names_a_method_outside_the_descriptors():
    found = []
    for path in sorted(PACKAGE.rglob("*.py")):
        relative = path.relative_to(PACKAGE).as_posix()
        if relative in ALLOWED:
            continue
        found += [f"specdeploy/{relative}:{line}" for line in method_comparisons(path.read_text())]
    assert not found, "ask the method's descriptor (spec/speculation.py) instead: " + ", ".join(found)


# --------------------------------------------------------------------- no predicate stands for one method

def predicates() -> list[str]:
    """SpeculationSpec's properties that answer yes or no."""
    spec = SpeculationSpec()
    return [name for name, value in vars(SpeculationSpec).items()
            if isinstance(value, property) and isinstance(getattr(spec, name), bool)]


def one_method_predicates(methods: dict[str, SpeculationSpec]) -> list[str]:
    """Predicates true for exactly one method, or named after a method or its section: the method's name again."""
    names = set(METHODS) | {traits.section for traits in METHODS.values() if traits.section}
    found = []
    for name in predicates():
        words = name.split("_")
        spans = {"_".join(words[i:j]) for i in range(len(words)) for j in range(i + 1, len(words) + 1)}
        if sum(getattr(spec, name) for spec in methods.values()) == 1 or spans & names:
            found.append(name)
    return found


def test_no_predicate_stands_for_one_method():
    """A question only one method answers yes is that method's name under another: ask its descriptor's data."""
    assert predicates(), "the scan must see the predicates"
    assert one_method_predicates({method: speculation(method) for method in METHODS}) == []


def test_the_predicate_scan_finds_one_method_predicates(monkeypatch):
    monkeypatch.setattr(SpeculationSpec, "reads_guesses", property(lambda self: self.method == "lookahead"),
                        raising=False)
    monkeypatch.setattr(SpeculationSpec, "uses_medusa_heads", property(lambda self: self.speculates), raising=False)
    found = one_method_predicates({method: speculation(method) for method in METHODS})
    assert found == ["reads_guesses", "uses_medusa_heads"]
