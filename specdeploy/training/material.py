"""Openly licensed raw material for Medusa training prompts, all of it shipped with Python itself (PSF licence):
small functions of the standard library (their source) and documentation passages (module and function
docstrings); and seeded generators for the edits a user asks of a model: misspelt text to correct, records to turn
into JSON, JSON to rewrite, blunt messages to make polite."""

from __future__ import annotations

import importlib
import inspect
import json
import random

CODE_MODULES = [
    "textwrap", "shlex", "fnmatch", "glob", "posixpath", "genericpath", "ntpath", "calendar", "colorsys",
    "statistics", "fractions", "difflib", "heapq", "base64", "quopri", "string", "random", "html", "urllib.parse",
    "email.utils", "ipaddress", "gettext", "tokenize", "os", "shutil", "tempfile", "copy", "functools", "csv",
    "pprint", "reprlib", "dataclasses", "enum", "contextlib", "argparse", "configparser", "zipfile", "tarfile",
    "mimetypes", "plistlib", "graphlib", "secrets", "uuid", "locale", "datetime", "decimal", "bisect", "linecache",
    "filecmp", "fileinput", "getopt", "ast", "inspect", "types", "typing", "warnings", "traceback", "timeit",
    "logging", "queue", "threading", "pathlib", "gzip", "hmac", "collections", "re", "json", "itertools",
]


def stdlib_functions(min_lines: int = 4, max_lines: int = 22, max_chars: int = 800) -> list[str]:
    """The source of the standard library's small public module-level functions, in a fixed order."""
    sources = []
    for module in map(importlib.import_module, CODE_MODULES):
        for name, function in inspect.getmembers(module, inspect.isfunction):
            if function.__module__ != module.__name__ or name.startswith("_"):
                continue
            try:
                source = inspect.getsource(function)
            except (OSError, TypeError):
                continue
            if (min_lines <= len(source.splitlines()) <= max_lines and len(source) <= max_chars
                    and source.startswith("def ")):
                sources.append(source.rstrip())
    return list(dict.fromkeys(sources))


def first_sentences(text: str, limit: int) -> str:
    """Whitespace collapsed, cut at the last sentence end within `limit` characters."""
    text = " ".join(text.split())[:limit]
    return text[:text.rfind(". ") + 1] or text


def documentation_passages(limit: int = 600, min_chars: int = 150) -> list[str]:
    """The beginnings of the docstrings of the modules in CODE_MODULES and of their public functions."""
    passages = []
    for module in map(importlib.import_module, CODE_MODULES):
        documented = [module] + [f for name, f in inspect.getmembers(module, inspect.isfunction)
                                 if f.__module__ == module.__name__ and not name.startswith("_")]
        for item in documented:
            text = first_sentences(inspect.getdoc(item) or "", limit)
            if len(text) >= min_chars:
                passages.append(text)
    return list(dict.fromkeys(passages))


def misspell(text: str, chooser: random.Random, rate: float = 0.12) -> str:
    """`text` with about `rate` of its longer words misspelt (two letters swapped, one dropped or one doubled)."""
    words = text.split(" ")
    for i, word in enumerate(words):
        if len(word) < 4 or not word.isalpha() or chooser.random() >= rate:
            continue
        at = chooser.randrange(1, len(word) - 1)
        edit = chooser.choice(("swap", "drop", "double"))
        if edit == "swap":
            word = word[:at] + word[at + 1] + word[at] + word[at + 2:]
        elif edit == "drop":
            word = word[:at] + word[at + 1:]
        else:
            word = word[:at] + word[at] + word[at:]
        words[i] = word
    return " ".join(words)


FIRST_NAMES = ["Ada", "Bjorn", "Chen", "Dalia", "Emeka", "Farah", "Goran", "Hana", "Ivan", "Jia", "Kofi", "Lena",
               "Mateo", "Noor", "Olga", "Pedro", "Quinn", "Rosa", "Sanjay", "Tariq", "Uma", "Viktor", "Wen", "Yara"]
LAST_NAMES = ["Okafor", "Lindqvist", "Moreau", "Tanaka", "Kowalski", "Haddad", "Silva", "Novak", "Patel",
              "Schmidt", "Rossi", "Nguyen", "Dubois", "Ivanova", "Mensah", "Garcia"]
CITIES = ["Lisbon", "Nairobi", "Oslo", "Osaka", "Krakow", "Lyon", "Porto", "Quito", "Tallinn", "Accra", "Hanoi",
          "Bergen", "Turin", "Leeds", "Cusco", "Gdansk"]
LANGUAGES = ["English", "French", "Spanish", "Portuguese", "Japanese", "Polish", "Swahili", "German", "Italian",
             "Vietnamese", "Arabic", "Hindi"]
JOBS = ["nurse", "carpenter", "pilot", "chemist", "librarian", "baker", "architect", "teacher", "plumber", "editor"]


def person(chooser: random.Random) -> dict:
    return {"firstName": chooser.choice(FIRST_NAMES), "lastName": chooser.choice(LAST_NAMES),
            "age": chooser.randrange(19, 80), "homeCity": chooser.choice(CITIES),
            "jobTitle": chooser.choice(JOBS), "spokenLanguages": chooser.sample(LANGUAGES, chooser.randrange(1, 4))}


def person_as_text(record: dict) -> str:
    return (f"Name: {record['firstName']} {record['lastName']}. Age: {record['age']}. City: {record['homeCity']}. "
            f"Job: {record['jobTitle']}. Languages: {', '.join(record['spokenLanguages'])}.")


def json_records(chooser: random.Random, count: int) -> list[tuple[str, str]]:
    """(record as text, record as compact JSON) pairs of invented people."""
    records = [person(chooser) for _ in range(count)]
    return [(person_as_text(r), json.dumps(r)) for r in records]


REQUESTS = ["Send me the {thing} by {day}", "I want the {thing} on my desk before {day}",
            "Fix the {thing} before {day}", "Call me about the {thing} on {day}", "Finish the {thing} by {day}"]
THINGS = ["report", "invoice", "slides", "budget", "contract", "schedule", "test results", "design draft",
          "shipping list", "meeting notes"]
DAYS = ["Monday", "Tuesday", "Wednesday", "Thursday", "Friday", "the weekend", "noon", "the end of the month"]
COMPLAINTS = ["The last one was late and full of mistakes.", "Nobody answered my emails last week.",
              "The numbers you sent were wrong again.", "I had to redo half of it myself.",
              "This is the third time I have asked.", "The customer complained about the delay."]
NEEDS = ["the sales figures for {a} and {b}", "a list of the new customers in {a}", "the costs for {a} and {b}",
         "the names of everyone who worked on it in {a}", "a short summary for {a}"]
MONTHS = ["January", "February", "March", "April", "May", "June", "July", "August", "September", "October"]


def blunt_messages(chooser: random.Random, count: int) -> list[str]:
    messages = []
    for _ in range(count):
        a, b = chooser.sample(MONTHS, 2)
        request = chooser.choice(REQUESTS).format(thing=chooser.choice(THINGS), day=chooser.choice(DAYS))
        need = chooser.choice(NEEDS).format(a=a, b=b)
        messages.append(f"{request}. {chooser.choice(COMPLAINTS)} I need {need}.")
    return messages
