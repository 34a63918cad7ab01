"""The documentation against the code, for README.md and docs/*.md:
- every `specdeploy VERB …` command (in fenced code blocks and inline code) names a verb the CLI has and only flags
  that `specdeploy VERB --help` lists; a command marked `# GPU only` (its flags need a GPU or TensorRT-LLM) is
  checked for its verb alone;
- every relative link points to a file (and heading) that exists;
- every repository path in inline code exists (a moved file, or a path of the old layout, fails).
The package's own comments and docstrings get the path check too: a module path (`build/trtllm/plan.py`,
`spec/pipeline.load_pipeline`) or a dotted module name (`specdeploy.serve.client`) there must exist.
Every problem is reported at once, as file:line."""

from __future__ import annotations

import ast
import functools
import io
import re
import tokenize
from pathlib import Path

from click.testing import CliRunner
from helpers.repo import REPO

from specdeploy.cli import cli

DOCS = [REPO / "README.md", *sorted((REPO / "docs").glob("*.md"))]
PACKAGE = REPO / "specdeploy"
MODULES = sorted(PACKAGE.rglob("*.py"))
GPU_ONLY = "# GPU only"

# `specdeploy` as the first word of a shell command (optionally as a path such as .venv/bin/specdeploy), then its verb
COMMAND = re.compile(r"(?:^|[;&|(]\s*)\s*(?:\$\s+)?(?:[\w.$()/-]*/)?specdeploy\s+(?P<rest>\S.*)$", re.DOTALL)
FLAG = re.compile(r"(?<![\w-])--[A-Za-z][\w-]*")
INLINE_CODE = re.compile(r"(?<!`)`([^`]+)`(?!`)")
LINK = re.compile(r"\[[^\]]*\]\(([^)\s]+)(?:\s+\"[^\"]*\")?\)")  # also images: ![alt](path)
FENCE = re.compile(r"^\s*(```|~~~)")
# A path in inline code: from the repository root, or inside the package (`runtime/batch.py`; also the folder names
# of the old layout, so that a stale one fails). Placeholders (`engines/<name>/`, `pipelines/gpu/*.yaml`) are skipped.
ROOT_PATH = re.compile(r"(?:specdeploy|tests|scripts|pipelines|k8s)/[^\s<>*…{}]*$")  # no placeholder characters
STAGES = sorted(path.parent.name for path in PACKAGE.glob("*/__init__.py"))
OLD_LAYOUT = ["builders", "triton"]
PACKAGE_PATH = re.compile(rf"(?:{'|'.join(STAGES + OLD_LAYOUT)})/[\w/]+\.py$")
# In the package's comments and docstrings, which name modules without backticks: a stage's module as a path, with an
# attribute after it or not (`build/trtllm/plan.py`, `builders/trtllm_plan.hf_dirs`; every part an identifier, so
# that a repository's `speculative/1/model.py` is no module), and a dotted name under specdeploy.
MODULE_PATH = re.compile(rf"(?:{'|'.join(STAGES + OLD_LAYOUT)})(?:/[A-Za-z_]\w*)+(?:\.\w+)+$")
DOTTED_NAME = re.compile(r"specdeploy(?:\.\w+)+$")
WORD_END = re.compile(r"(?:'s|:\d+(?:-\d+)?)?[`'\",;:.)\]]*$")  # punctuation, a possessive, a line number


@functools.cache
def help_flags(verb: str | None) -> frozenset[str] | None:
    """The --flags `specdeploy [VERB] --help` lists; None for a verb the CLI does not have."""
    if verb is not None and verb not in cli.commands:
        return None
    result = CliRunner().invoke(cli, ([verb] if verb else []) + ["--help"])
    assert result.exit_code == 0, result.output
    return frozenset(FLAG.findall(result.output))


def split_text(text: str) -> tuple[list[tuple[int, str]], list[tuple[int, str]]]:
    """The document's lines inside fenced code blocks (backslash continuations joined, numbered by their first
    line) and the prose outside them, as (first line number, text) pairs; prose is kept in paragraphs so that an
    inline code span broken across lines stays whole."""
    code: list[tuple[int, str]] = []
    prose: list[tuple[int, str]] = []
    in_fence = in_paragraph = False
    pending: tuple[int, str] | None = None  # a code line continued by a trailing backslash
    for number, line in enumerate(text.splitlines(), start=1):
        if FENCE.match(line):
            in_fence, in_paragraph = not in_fence, False
        elif in_fence:
            start, joined = (number, line) if pending is None else (pending[0], pending[1] + " " + line.strip())
            if joined.rstrip().endswith("\\"):
                pending = (start, joined.rstrip()[:-1])
            else:
                code.append((start, joined))
                pending = None
        elif not line.strip():
            in_paragraph = False
        elif in_paragraph:
            prose[-1] = (prose[-1][0], prose[-1][1] + "\n" + line)
        else:
            prose.append((number, line))
            in_paragraph = True
    if pending is not None:
        code.append(pending)
    return code, prose


def strip_comment(line: str) -> tuple[str, str]:
    """A shell line split into its command and its comment (a # that starts a word)."""
    match = re.search(r"(?:^|\s)#", line)
    return (line, "") if match is None else (line[:match.start()], line[match.start():])


def commands(text: str) -> list[tuple[int, str, bool]]:
    """(line number, command after `specdeploy`, marked GPU only) for every specdeploy command in a document."""
    code, prose = split_text(text)
    found = []
    for number, line in code:
        command, comment = strip_comment(line)
        for part in re.split(r"&&|\|\||;|\s\|\s+(?=[A-Za-z])", command):
            match = COMMAND.match(part)
            if match:
                found.append((number, match["rest"].strip(), GPU_ONLY in comment))
    for number, paragraph in prose:
        for span in INLINE_CODE.finditer(paragraph):
            command, comment = strip_comment(span[1].replace("\n", " "))
            match = COMMAND.match(command)
            if match:
                line = number + paragraph[:span.start()].count("\n")
                found.append((line, match["rest"].strip(), GPU_ONLY in comment))
    return sorted(found)


def command_problems(path: Path, text: str) -> list[str]:
    """One line per bad command: an unknown verb, or each flag its verb's --help does not list."""
    problems = []
    for number, rest, gpu_only in commands(text):
        word = re.match(r"[a-z][\w-]*", rest)  # a placeholder (`specdeploy VERB`, `<verb>`) is no command
        if not rest.startswith("-") and word is None:
            continue
        verb = None if rest.startswith("-") else word[0]
        known = help_flags(verb)
        if known is None:
            problems.append(f"{path}:{number}: unknown verb `specdeploy {verb}`")
            continue
        if gpu_only:
            continue
        for flag in FLAG.findall(rest):
            if flag not in known:
                problems.append(f"{path}:{number}: `specdeploy {verb or ''}` has no {flag}")
    return problems


def slug(heading: str) -> str:
    """A heading's anchor as GitHub writes it."""
    text = re.sub(r"[`*_]|\[([^\]]*)\]\([^)]*\)", r"\1", heading.strip().lower())
    return re.sub(r"[^\w\- ]", "", text).replace(" ", "-")


def anchors(path: Path) -> set[str]:
    """The anchors of a Markdown file's headings (a repeated heading gets -1, -2, … as on GitHub)."""
    _, prose = split_text(path.read_text())
    seen: dict[str, int] = {}
    result = set()
    for _, paragraph in prose:
        for line in paragraph.splitlines():
            match = re.match(r"#{1,6}\s+(.*?)\s*#*\s*$", line)
            if match:
                base = slug(match[1])
                count = seen.get(base, 0)
                seen[base] = count + 1
                result.add(base if count == 0 else f"{base}-{count}")
    return result


def link_problems(path: Path, text: str) -> list[str]:
    """One line per relative link whose file, or heading within a Markdown file, does not exist."""
    problems = []
    _, prose = split_text(text)
    for number, paragraph in prose:
        for link in LINK.finditer(paragraph):
            target = link[1]
            if re.match(r"[a-z][a-z+.-]*:", target):
                continue
            line = number + paragraph[:link.start()].count("\n")
            file_part, _, anchor = target.partition("#")
            resolved = (path.parent / file_part).resolve() if file_part else path
            if not resolved.exists():
                problems.append(f"{path}:{line}: link to a missing file: {target}")
            elif anchor and resolved.suffix == ".md" and anchor not in anchors(resolved):
                problems.append(f"{path}:{line}: link to a missing heading: {target}")
    return problems


def path_problems(path: Path, text: str) -> list[str]:
    """One line per repository path named in inline code that does not exist (a file moved, or the old layout)."""
    problems = []
    _, prose = split_text(text)
    for number, paragraph in prose:
        for span in INLINE_CODE.finditer(paragraph):
            line = number + paragraph[:span.start()].count("\n")
            for word in span[1].split():
                word = word.strip(",;:()")
                if ROOT_PATH.match(word):
                    candidates = [REPO / word]
                elif PACKAGE_PATH.match(word):
                    candidates = [REPO / "specdeploy" / word, REPO / word]
                else:
                    continue
                if not any(candidate.exists() for candidate in candidates):
                    problems.append(f"{path}:{line}: no such path: {word}")
    return problems


def problems_in(paths: list[Path]) -> list[str]:
    problems = []
    for path in paths:
        text = path.read_text()
        problems += command_problems(path, text) + link_problems(path, text) + path_problems(path, text)
    return problems


def code_prose(source: str) -> list[tuple[int, str]]:
    """A Python module's comments and docstrings, as (first line number, text) pairs."""
    prose = [(token.start[0], token.string) for token in tokenize.generate_tokens(io.StringIO(source).readline)
             if token.type == tokenize.COMMENT]
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Module | ast.ClassDef | ast.FunctionDef | ast.AsyncFunctionDef):
            docstring = ast.get_docstring(node, clean=False)
            if docstring is not None:
                prose.append((node.body[0].lineno, docstring))
    return sorted(prose)


def module_path_exists(word: str) -> bool:
    """`stage/module.py`, `stage/module.attribute` or `stage/folder/file.ext`, inside the package or at the root."""
    path, _, suffix = word.partition(".")
    extension = "." + suffix.split(".")[0]
    return any((base / path).with_suffix(".py").is_file() or (base / path).with_suffix(extension).exists()
               for base in (PACKAGE, REPO))


def dotted_name_exists(word: str) -> bool:
    """`specdeploy.stage.module[.attribute…]`: folders down to a module (a name right after a folder may be its
    __init__'s), any attributes after it."""
    folder = REPO
    for part in word.split("."):
        if (folder / part).is_dir():
            folder = folder / part
        else:
            init = folder / "__init__.py"
            return (folder / f"{part}.py").is_file() or (init.is_file() and part in init.read_text())
    return True


def code_path_problems(path: Path) -> list[str]:
    """One line per module path or dotted name in a module's comments and docstrings that does not exist."""
    problems = []
    for first_line, text in code_prose(path.read_text()):
        for offset, line_text in enumerate(text.splitlines()):
            for word in line_text.split():
                word = WORD_END.sub("", word.lstrip("`'\"(["))
                if ROOT_PATH.match(word) and not (REPO / word).exists():
                    problems.append(f"{path}:{first_line + offset}: no such path: {word}")
                elif MODULE_PATH.match(word) and not module_path_exists(word):
                    problems.append(f"{path}:{first_line + offset}: no such module: {word}")
                elif DOTTED_NAME.match(word) and not dotted_name_exists(word):
                    problems.append(f"{path}:{first_line + offset}: no such module: {word}")
    return problems


def test_the_readme_is_short_and_the_rest_is_in_docs():
    readme = (REPO / "README.md").read_text()
    assert len(readme.splitlines()) <= 200, "a newcomer reads the README in five minutes: move details to docs/"
    assert len(commands(readme)) >= 5, "the README's tour runs specdeploy commands"
    linked = {Path(target.partition("#")[0]).name for target in LINK.findall(readme) if target.startswith("docs/")}
    assert linked == {path.name for path in DOCS[1:]}, "the README links every docs page"


def test_every_documented_command_link_and_path_exists():
    problems = problems_in(DOCS)
    assert not problems, "\n" + "\n".join(problems)


def test_every_path_the_package_comments_name_exists():
    problems = [problem for module in MODULES for problem in code_path_problems(module)]
    assert not problems, "\n" + "\n".join(problems)


def test_the_check_reports_every_bad_line(tmp_path):
    """The same check on a document with known faults finds each of them, and nothing else."""
    (tmp_path / "other.md").write_text("# Other page\n\n## A section\n")
    doc = tmp_path / "bad.md"
    doc.write_text("""# Bad

Run `specdeploy build PIPELINE.yaml --force` (fine), then `specdeploy build PIPELINE.yaml --bogus`, and
`specdeploy bench A.yaml
--no-such-flag` (a span broken across lines). Not a command: `kubectl -n specdeploy wait --nope`.

```bash
specdeploy generate PIPELINE.yaml "prompt" --max-tokens 8 --stream/--no-stream  # comment --ignored
.venv/bin/specdeploy serve PIPELINE.yaml --grpc-port 8001 \\
    --made-up 3
specdeploy frobnicate PIPELINE.yaml
specdeploy build gpu.yaml --tensor-parallel 4   # GPU only
specdeploy frobnicate gpu.yaml --anything       # GPU only
cd somewhere && specdeploy package PIPELINE.yaml --output DIR --wrong
```

[fine](other.md), [fine too](other.md#a-section), [here](#bad), [missing](nowhere.md),
[no heading](other.md#no-such-section), [web](https://example.com/x.md).

Paths: `runtime/batch.py`, `specdeploy/runtime/batch.py`, `engines/<name>/`, `pipelines/gpu/*.yaml` (fine);
`specdeploy/triton/server.py` and `builders/torch.py` (the old layout), `tests/test_nothing.py`.
""")
    assert problems_in([doc]) == [
        f"{doc}:3: `specdeploy build` has no --bogus",
        f"{doc}:4: `specdeploy bench` has no --no-such-flag",
        f"{doc}:9: `specdeploy serve` has no --made-up",
        f"{doc}:11: unknown verb `specdeploy frobnicate`",
        f"{doc}:13: unknown verb `specdeploy frobnicate`",
        f"{doc}:14: `specdeploy package` has no --wrong",
        f"{doc}:17: link to a missing file: nowhere.md",
        f"{doc}:18: link to a missing heading: other.md#no-such-section",
        f"{doc}:21: no such path: specdeploy/triton/server.py",
        f"{doc}:21: no such path: builders/torch.py",
        f"{doc}:21: no such path: tests/test_nothing.py",
    ]


def test_the_package_check_reports_every_stale_name(tmp_path):
    """The same check on a module with known stale names finds each of them, and nothing else."""
    module = tmp_path / "module.py"
    module.write_text('''"""Fine: build/trtllm/plan.py's hf_dirs, (spec/pipeline.load_pipeline), specdeploy.__version__,
specdeploy.serve.client.generate, serve/model_repo/README.md, a repository's speculative/1/model.py, upstream's
tensorrt_llm/models/x.py. Moved or gone: serve/repository.py, builders/trtllm_plan.hf_dirs."""

VALUE = 1  # stale: deploy/nothing.py:9, specdeploy.serve.repository.write_repository, tests/test_nothing.py)


def function():
    """specdeploy.triton."""
''')
    assert code_path_problems(module) == [
        f"{module}:3: no such module: serve/repository.py",
        f"{module}:3: no such module: builders/trtllm_plan.hf_dirs",
        f"{module}:5: no such module: deploy/nothing.py",
        f"{module}:5: no such module: specdeploy.serve.repository.write_repository",
        f"{module}:5: no such path: tests/test_nothing.py",
        f"{module}:9: no such module: specdeploy.triton",
    ]
