"""Strict YAML into frozen dataclasses: the loader and converter behind PipelineSpec, written for any dataclass.

A file is read without aliases or duplicate keys, then walked against the dataclass's type hints, so unknown keys,
wrong types and values outside a Literal are errors naming the file, the key path, the bad value and what is
allowed. Each dataclass validates itself when it is constructed (`Section.check`), so one built in code is checked
exactly like one loaded from a file; its `Problem` names a key relative to itself, and `build` adds the path.
"""

from __future__ import annotations

import dataclasses
import math
import reprlib
import types
import typing
from pathlib import Path
from typing import Literal, TypeVar

import yaml

from specdeploy.errors import PipelineError

T = TypeVar("T")
QUOTE_LIMIT = 60  # characters of a bad value an error message shows
# A field's metadata for state the code sets, never a file (where the file was): `build` neither reads nor allows it
NOT_IN_FILE = {"strict_yaml": "not in file"}


def in_file(field: dataclasses.Field) -> bool:
    """Whether a file may set `field` (it is not marked NOT_IN_FILE)."""
    return field.metadata.get("strict_yaml") != NOT_IN_FILE["strict_yaml"]


def quoted(value: object) -> str:
    """A short repr of value: a message must stay short (and quick to write) whatever the file holds."""
    short = reprlib.Repr()
    short.maxlevel, short.maxdict, short.maxlist, short.maxstring = 2, 3, 3, QUOTE_LIMIT
    text = short.repr(value)
    return text if len(text) <= QUOTE_LIMIT else text[:QUOTE_LIMIT - 3] + "..."


class StrictLoader(yaml.SafeLoader):
    """YAML without aliases (a few hundred bytes of nested aliases expand to billions of nodes) and without
    duplicate keys (where the last one would silently win)."""

    def compose_node(self, parent, index):
        if self.check_event(yaml.AliasEvent):
            event = self.peek_event()
            raise yaml.composer.ComposerError(None, None, f"aliases (*{event.anchor}) are not allowed",
                                              event.start_mark)
        return super().compose_node(parent, index)

    def construct_mapping(self, node, deep=False):
        seen = set()
        for key_node, _ in node.value:
            key = self.construct_object(key_node, deep=deep)
            if not isinstance(key, typing.Hashable):
                continue  # the SafeLoader reports an unhashable key itself
            if key in seen:
                raise yaml.constructor.ConstructorError(None, None, f"duplicate key {quoted(key)}",
                                                        key_node.start_mark)
            seen.add(key)
        return super().construct_mapping(node, deep)


class Problem(PipelineError):
    """Raised by a section's check(): `key` is relative to the section (the parser adds the section's path)."""

    def __init__(self, key: str, message: str) -> None:
        super().__init__(f"{key}: {message}")
        self.key, self.message = key, message


class Section:
    """Base of every section: validated at construction by its `check` (a no-op unless the section has rules)."""

    def __post_init__(self) -> None:
        self.check()

    def check(self) -> None:
        pass


def read_yaml(path: str | Path, what: str) -> object:
    """The data of the YAML file at `path` (JSON reads as YAML too), read strictly; `what` names the file's kind
    in the messages ("pipeline file not found")."""
    path = Path(path)
    if not path.is_file():
        raise PipelineError(f"{path}: {what} file not found")
    try:
        return yaml.load(path.read_text(encoding="utf-8"), Loader=StrictLoader)  # noqa: S506 (a SafeLoader)
    except yaml.YAMLError as exc:
        raise PipelineError(f"{path}: malformed YAML: {exc}") from None
    except RecursionError:
        raise PipelineError(f"{path}: nested too deeply to be a {what}") from None
    except (OSError, UnicodeDecodeError) as exc:
        raise PipelineError(f"{path}: cannot be read as UTF-8 text: {exc}") from None


def build(cls: type[T], data: object, where: str, prefix: str = "") -> T:
    """An instance of the dataclass `cls` from plain data, every value converted to its field's type hint.
    `where` names the file in messages; `prefix` is the key path of `data` in it ("" at the top)."""
    label = prefix or "top level"
    if not isinstance(data, dict):
        raise PipelineError(f"{where}: {label}: expected a mapping, got {quoted(data)}")
    hints = typing.get_type_hints(cls)
    fields = {f.name: f for f in dataclasses.fields(cls) if in_file(f)}
    unknown = sorted(set(data) - set(fields), key=str)
    if unknown:
        raise PipelineError(f"{where}: {label}: unknown key {quoted(unknown[0])} (allowed: {', '.join(fields)})")
    values = {}
    for name, f in fields.items():
        key = f"{prefix}.{name}" if prefix else name
        if name in data:
            values[name] = _convert(hints[name], data[name], key, where)
        elif f.default is dataclasses.MISSING and f.default_factory is dataclasses.MISSING:
            raise PipelineError(f"{where}: {key}: required key is missing ({_describe(hints[name])})")
    try:
        return cls(**values)
    except Problem as problem:
        key = f"{prefix}.{problem.key}" if prefix else problem.key
        raise PipelineError(f"{where}: {key}: {problem.message}") from None


def plain_data(instance: object) -> dict:
    """The dataclass `instance` as `build` reads it back: dicts and lists (JSON has no tuples), without the fields
    no file holds."""
    data = dataclasses.asdict(instance, dict_factory=lambda items: {k: _as_lists(v) for k, v in items})
    for f in dataclasses.fields(instance):
        if not in_file(f):
            data.pop(f.name)
    return data


def _as_lists(value: object) -> object:
    return [_as_lists(item) for item in value] if isinstance(value, tuple) else value


def _describe(hint: object) -> str:
    if typing.get_origin(hint) is Literal:
        return "one of " + ", ".join(repr(v) for v in typing.get_args(hint))
    if dataclasses.is_dataclass(hint):
        return "a mapping"
    return getattr(hint, "__name__", str(hint))


def _convert(hint: object, value: object, key: str, where: str) -> object:
    """`value` as the type `hint` names, by the kind of hint."""
    origin = typing.get_origin(hint)
    if origin in (typing.Union, types.UnionType):
        return _convert_union(hint, value, key, where)
    if origin is Literal:
        return _convert_literal(hint, value, key, where)
    if dataclasses.is_dataclass(hint):
        return build(hint, value, where, key)
    if origin is tuple:
        return _convert_tuple(hint, value, key, where)
    if hint is float:
        return _convert_float(value, key, where)
    return _convert_scalar(hint, value, key, where)


def _convert_union(hint: object, value: object, key: str, where: str) -> object:
    """X | None, or X | Y | None: null, else the first option the value converts to."""
    options = [h for h in typing.get_args(hint) if h is not type(None)]
    if value is None:
        return None
    if len(options) == 1:
        return _convert(options[0], value, key, where)
    for option in options:
        try:
            return _convert(option, value, key, where)
        except PipelineError:
            continue
    raise PipelineError(f"{where}: {key}: expected " + " or ".join(_describe(o) for o in options)
                        + f" (or null), got {quoted(value)}")


def _convert_literal(hint: object, value: object, key: str, where: str) -> object:
    allowed = typing.get_args(hint)
    if value not in allowed:
        raise PipelineError(f"{where}: {key}: {quoted(value)} is not allowed (allowed: "
                            + ", ".join(repr(v) for v in allowed) + ")")
    return value


def _convert_tuple(hint: object, value: object, key: str, where: str) -> tuple:
    """tuple[X, ...]: a YAML list."""
    if not isinstance(value, list | tuple):
        raise PipelineError(f"{where}: {key}: expected a list, got {quoted(value)}")
    item = typing.get_args(hint)[0]
    return tuple(_convert(item, element, f"{key}[{i}]", where) for i, element in enumerate(value))


def _convert_float(value: object, key: str, where: str) -> object:
    """A float, or an int taken as one (YAML writes 1.0 as 1 just as often); never infinite or NaN."""
    if isinstance(value, int) and not isinstance(value, bool):
        return float(value)
    if isinstance(value, float) and not math.isfinite(value):
        raise PipelineError(f"{where}: {key}: must be a finite number, got {quoted(value)}")
    return _convert_scalar(float, value, key, where)


def _convert_scalar(hint: object, value: object, key: str, where: str) -> object:
    """int, str and bool exactly (a bool is no int here); any other hint takes the value as it is."""
    if hint in (int, float, str, bool) and (type(value) is not hint):
        raise PipelineError(f"{where}: {key}: expected {_describe(hint)}, got {quoted(value)}")
    return value
