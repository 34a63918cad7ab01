"""Prompts to distil a draft head on at scale (issue 59): tens of thousands of requests of every kind a user sends,
all openly licensed or made here, none of them the bench's.

Sources, each deterministic for a seed:
- training/prompts.py's: HumanEval's problems and the written families (code edits, text fixes and edits,
  summaries, JSON, messages, open-ended);
- the standard library's documented public functions and classes (PSF licence), each turned into one task (an
  example, an explanation, a test, a comparison, a docstring to write);
- Python's language reference topics (`pydoc_data.topics`, PSF licence), cut into passages, each turned into a task;
- self-instruct: the target's own requests (`self_instruct_requests`), which it writes when asked for a request of a
  given kind about a given topic (SEED_KINDS × seed_topics()), cleaned and deduplicated.
"""

from __future__ import annotations

import importlib
import inspect
import random
import re
import sys
import warnings

from specdeploy.build.text_corpus import first_sentences
from specdeploy.training import prompts as written

# Modules never imported for their documentation: they act on import, start a GUI, or are Python's test suite.
SKIPPED_MODULES = {"antigravity", "this", "idlelib", "tkinter", "turtle", "turtledemo", "test", "lib2to3", "pydoc",
                   "webbrowser", "__main__", "__phello__", "_pyrepl", "ensurepip", "venv", "pip", "msvcrt", "winreg",
                   "winsound", "_winapi", "nt", "crypt", "nis", "spwd", "ossaudiodev", "curses", "readline",
                   "xxlimited"}
FUNCTION_TASKS = [
    "Write a short Python example that uses `{name}`{signature} and say what it prints.",
    "What does `{name}` do in Python? Its documentation begins: \"{doc}\" Explain it with an example.",
    "Write a unit test with pytest for `{name}`{signature}.",
    "When would you use `{name}` instead of writing the code yourself? Give an example.",
    "Explain the parameters of `{name}`{signature} to a beginner.",
    "Show a common mistake people make with `{name}` and how to fix it.",
]
CLASS_TASKS = [
    "Write a short Python example that creates and uses a `{name}` object.",
    "What is `{name}` in Python? Its documentation begins: \"{doc}\" Explain it with an example.",
    "Write a small program that uses `{name}`, and explain each line.",
]
REFERENCE_TASKS = [
    "Explain this part of the Python language reference in simple words:\n\n{d}",
    "Write a code example that illustrates this passage of the Python reference:\n\n{d}",
    "Summarise this passage of the Python reference in three sentences:\n\n{d}",
    "Ask two questions a learner might have about this text, and answer them:\n\n{d}",
]
SEED_KINDS = [
    "a how-to question", "a request for a short story", "a question comparing two things",
    "a request for a list of ideas", "a request to explain a concept simply", "a request for practical advice",
    "a request to write a short email", "a small Python programming task", "a question about its history",
    "a request for a step-by-step plan", "a request to write a short poem", "a question asking for pros and cons",
]
GENERAL_TOPICS = [
    "cooking pasta", "growing tomatoes", "learning a language", "saving money", "running a marathon", "sleep",
    "the solar system", "volcanoes", "the Roman empire", "photosynthesis", "electric cars", "job interviews",
    "writing a CV", "birthday parties", "camping", "first aid", "time management", "public speaking", "chess",
    "climate change", "the water cycle", "bees", "coffee", "bread baking", "home workouts", "painting a room",
    "adopting a dog", "caring for a cat", "moving house", "budget travel", "the stock market", "renewable energy",
    "smartphones", "password security", "spreadsheets", "team meetings", "a small business", "recycling",
    "the ocean", "rainforests", "earthquakes", "the moon landing", "ancient Egypt", "the printing press",
    "jazz music", "football", "basketball", "cycling to work", "meditation", "healthy breakfasts", "vegetables",
    "board games", "photography", "writing a novel", "poetry", "museums", "libraries", "volunteering",
    "friendship", "negotiation", "customer service", "remote work", "online courses", "math homework",
    "fractions", "algebra", "probability", "geometry", "statistics", "machine learning", "the internet",
    "databases", "web pages", "sorting algorithms", "linked lists", "unit tests", "git", "Linux", "SQL",
]


def seed_topics() -> list[str]:
    """What the target writes requests about: everyday and school topics, the written prompts' subjects and
    concepts, and the modules of the standard library that training/prompts.py quotes."""
    from specdeploy.build.text_corpus import CODE_MODULES

    modules = [f"Python's {name} module" for name in CODE_MODULES]
    return list(dict.fromkeys(GENERAL_TOPICS + written.SUBJECTS + written.CONCEPTS + modules))


def self_instruct_requests(seed: int = 0) -> list[str]:
    """What the target is asked to write its own requests with: one per (kind, topic), in a seeded order (a prefix
    covers every kind and many topics)."""
    requests = [f"Write {kind} that someone might ask an AI assistant about {topic}. Reply with the request only, "
                f"in one or two sentences." for topic in seed_topics() for kind in SEED_KINDS]
    random.Random(seed).shuffle(requests)
    return requests


def clean_request(text: str) -> str | None:
    """A request the target wrote, as a prompt: its first paragraph, quotes and labels stripped; None when it is too
    short, too long or not a request."""
    text = text.strip().split("\n\n")[0].strip()
    text = re.sub(r"^(request|question|prompt|user)\s*:\s*", "", text, flags=re.I).strip().strip("\"'“”").strip()
    if not 20 <= len(text) <= 400 or text.lower().startswith(("sure", "here is", "here's", "i ", "as an")):
        return None
    return text


def documented_objects() -> list[tuple[str, str, str, bool]]:
    """(qualified name, signature, documentation's first sentences, is a class) of every public documented function
    and class the importable standard library defines, in a fixed order."""
    found = []
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        for module_name in sorted(sys.stdlib_module_names):
            if module_name.startswith("_") or module_name in SKIPPED_MODULES:
                continue
            try:
                module = importlib.import_module(module_name)
            except Exception:  # noqa: BLE001 - a platform's missing module, or one that fails here
                continue
            for name, item in sorted(vars(module).items()):
                if name.startswith("_") or not (inspect.isfunction(item) or inspect.isclass(item)
                                                or inspect.isbuiltin(item)):
                    continue
                if getattr(item, "__module__", module_name) != module_name:
                    continue  # imported from elsewhere: documented where it is defined
                doc = first_sentences(inspect.getdoc(item) or "", 240)
                if len(doc) < 30:
                    continue
                signature = "" if inspect.isclass(item) else printed_signature(item)
                found.append((f"{module_name}.{name}", signature if len(signature) <= 80 else "", doc,
                              inspect.isclass(item)))
                if inspect.isclass(item):
                    found += documented_methods(f"{module_name}.{name}", item)
    return found


def documented_methods(qualified: str, cls: type) -> list[tuple[str, str, str, bool]]:
    """(name, signature, documentation's first sentences, False) of a class's own public documented methods."""
    methods = []
    for name, member in sorted(vars(cls).items()):
        if name.startswith("_") or not callable(member):
            continue
        doc = first_sentences(inspect.getdoc(member) or "", 240)
        if len(doc) < 30:
            continue
        signature = printed_signature(member)
        methods.append((f"{qualified}.{name}", signature if len(signature) <= 80 else "", doc, False))
    return methods


def printed_signature(item) -> str:
    """The signature as written, or "" where it has none or prints a default by its memory address (`<function
    copy2 at 0x7f…>`): that text differs in every process, and so would the prompt."""
    try:
        signature = str(inspect.signature(item))
    except (TypeError, ValueError):
        return ""
    return "" if re.search(r" at 0x[0-9a-f]+", signature) else signature


def library_prompts(chooser: random.Random) -> list[str]:
    """One task per documented standard-library function or class."""
    prompts = []
    for name, signature, doc, is_class in documented_objects():
        template = chooser.choice(CLASS_TASKS if is_class else FUNCTION_TASKS)
        prompts.append(template.format(name=name, signature=signature, doc=doc.replace('"', "'")))
    return prompts


def reference_passages(limit: int = 700, min_chars: int = 200) -> list[str]:
    """Python's language reference topics (pydoc_data.topics), cut at paragraphs into passages of about `limit`
    characters."""
    from pydoc_data.topics import topics

    passages = []
    for _, text in sorted(topics.items()):
        current = ""
        for paragraph in re.split(r"\n\s*\n", text):
            paragraph = paragraph.strip()
            if current and len(current) + len(paragraph) > limit:
                if len(current) >= min_chars:
                    passages.append(current)
                current = ""
            current = f"{current}\n\n{paragraph}".strip() if len(paragraph) <= limit else current
        if len(current) >= min_chars:
            passages.append(current)
    return list(dict.fromkeys(passages))


def reference_prompts(chooser: random.Random) -> list[str]:
    return [chooser.choice(REFERENCE_TASKS).format(d=passage) for passage in reference_passages()]


def distillation_prompts(self_written: list[str], seed: int = 0, exclude: list[str] | None = None) -> list[str]:
    """Every source's prompts (self_written: the target's own requests, cleaned), deduplicated, those in `exclude`
    (the bench's) left out, in a seeded order that mixes the sources."""
    chooser = random.Random(seed)
    excluded = set(exclude or [])
    sources = [written.human_eval_prompts(), written.written_prompts(seed), library_prompts(chooser),
               reference_prompts(chooser), self_written]
    for source in sources:
        chooser.shuffle(source)
    mixed = [source[i] for i in range(max(map(len, sources))) for source in sources if i < len(source)]
    return [prompt for prompt in dict.fromkeys(mixed) if prompt not in excluded]


def split_held_out(prompts: list[str], held_out: int, seed: int = 0) -> tuple[list[str], list[str]]:
    """(training prompts, `held_out` held-out prompts), a seeded choice."""
    chosen = list(prompts)
    random.Random(seed + 1).shuffle(chosen)
    return chosen[held_out:], chosen[:held_out]
