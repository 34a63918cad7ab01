"""Openly licensed text shipped with Python itself (PSF licence): the source of the standard library's small
functions and the beginnings of its docstrings. Medusa training builds prompts from it and the MoE derivation
calibrates its routers on it."""

from __future__ import annotations

import importlib
import inspect

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


def calibration_split(held_out_every: int = 5) -> tuple[list[str], list[str]]:
    """The passages and functions, split in a fixed way: (calibration texts, held-out texts), every
    `held_out_every`-th text held out."""
    texts = documentation_passages() + stdlib_functions()
    held_out = texts[held_out_every - 1::held_out_every]
    return [t for i, t in enumerate(texts) if (i + 1) % held_out_every], held_out
