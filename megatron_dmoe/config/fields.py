"""What the schema allows for each key: types, value checks, names, and did-you-mean hints."""
from __future__ import annotations

import dataclasses
import difflib
import functools
import typing
from typing import Any, Dict, List, Optional, Tuple

from . import schema
from .megatron_names import megatron_match
from .schema import SECTIONS, RunConfig


@functools.lru_cache(maxsize=None)
def section_types() -> Dict[str, Dict[str, Any]]:
    """{section: {field: type annotation}} in schema order."""
    hints = typing.get_type_hints(RunConfig)
    out = {}
    for section in SECTIONS:
        cls = hints[section]
        field_hints = typing.get_type_hints(cls, vars(schema))
        out[section] = {f.name: field_hints[f.name] for f in dataclasses.fields(cls)}
    return out


@functools.lru_cache(maxsize=None)
def section_class(section: str) -> type:
    return typing.get_type_hints(RunConfig)[section]


def did_you_mean(name: str, candidates: List[str]) -> Optional[str]:
    matches = difflib.get_close_matches(name, candidates, n=1, cutoff=0.6)
    return matches[0] if matches else None


def unknown_key_message(section: str, key: str) -> str:
    """'unknown key; did you mean moe.top_k?' for a key that is not in its section."""
    fields = section_types()[section]
    match = megatron_match(key, section)
    if match and match[1].split(":")[0].split(".")[-1] != key:  # a name of ours elsewhere: see below
        flag, ours = "--" + match[0].replace("_", "-"), match[1]
        return f"unknown key; did you mean {ours}? (what Megatron-LM calls {flag})"
    close = did_you_mean(key, list(fields))
    if close:
        return f"unknown key; did you mean {section}.{close}?"
    elsewhere = [s for s, f in section_types().items() if key in f]
    if elsewhere:
        return f"unknown key in section '{section}'; it belongs to {elsewhere[0]}.{key}"
    return f"unknown key; the keys of '{section}' are: {', '.join(fields)}"


def unknown_section_message(name: str) -> str:
    close = did_you_mean(name, list(SECTIONS))
    if close:
        return f"unknown section; did you mean {close}?"
    owners = [s for s, f in section_types().items() if name in f]
    if owners:
        return f"unknown section; a key of this name belongs in a section: {owners[0]}.{name}"
    return f"unknown section; the sections are: {', '.join(SECTIONS)}"


def _describe_value(value: Any) -> str:
    if value is None:
        return "null"
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, dict):
        return f"a mapping {value!r}"
    if isinstance(value, list):
        return f"a list {value!r}"
    return repr(value)


def _type_name(annotation: Any) -> str:
    origin = typing.get_origin(annotation)
    if origin is typing.Union:
        args = typing.get_args(annotation)
        names = " or ".join(_type_name(a) for a in args if a is not type(None))
        return names + " or null" if type(None) in args else names
    if origin in (list, List):
        return "a list of " + _type_name(typing.get_args(annotation)[0]).replace("a ", "", 1) + "s"
    names = {int: "an integer", float: "a number", bool: "true or false", str: "a string"}
    return names[annotation]


def coerce(value: Any, annotation: Any) -> Tuple[Any, Optional[str]]:
    """Check ``value`` against a schema annotation.

    Returns (value to store, None) or (value, message). Integers are accepted for floats (and stored
    as floats); booleans accept only true/false; null only for Optional keys. For the list of
    strings (data.data_path) numbers are accepted and written as strings, since Megatron-style
    blend weights appear as numbers in YAML, and a single string stands for a one-element list.
    """
    origin = typing.get_origin(annotation)
    if origin is typing.Union:
        args = typing.get_args(annotation)
        inner = [a for a in args if a is not type(None)]
        if value is None and len(inner) < len(args):
            return None, None
        if len(inner) > 1:  # a value of any of the types (training.cuda_graphs: true, false or auto)
            for kind in inner:
                coerced, problem = coerce(value, kind)
                if problem is None:
                    return coerced, None
            return value, f"expected {_type_name(annotation)}, got {_describe_value(value)}"
        value, problem = coerce(value, inner[0])
        return value, (problem and problem.replace(_type_name(inner[0]), _type_name(annotation), 1))
    expected = _type_name(annotation)
    problem = f"expected {expected}, got {_describe_value(value)}"
    if origin in (list, List):
        if isinstance(value, str):
            value = [value]
        if not isinstance(value, list):
            return value, problem
        items = []
        for item in value:
            if isinstance(item, (int, float)) and not isinstance(item, bool):
                item = str(item)
            if not isinstance(item, str):
                return value, f"expected {expected}, got {_describe_value(item)} in the list"
            items.append(item)
        return items, None
    if annotation is bool:
        return value, None if isinstance(value, bool) else problem
    if annotation is int:
        if isinstance(value, int) and not isinstance(value, bool):
            return value, None
        if isinstance(value, float) and value.is_integer():
            return value, f"{problem} (write {int(value)})"
        return value, problem
    if annotation is float:
        if isinstance(value, (int, float)) and not isinstance(value, bool):
            return float(value), None
        return value, problem
    if annotation is str:
        return value, None if isinstance(value, str) else problem
    raise TypeError(f"unsupported schema annotation {annotation!r}")


def check_type(value: Any, annotation: Any) -> Optional[str]:
    """The problem with ``value`` as stored in a RunConfig, or None.

    Stricter than coerce() for lists: a stored list must already hold strings.
    """
    coerced, problem = coerce(value, annotation)
    if problem is None and isinstance(coerced, list) and coerced is not value and coerced != value:
        problem = f"expected {_type_name(annotation)}, got {_describe_value(value)}"
    return problem


def default_of(section: str, key: str) -> Any:
    for f in dataclasses.fields(section_class(section)):
        if f.name == key:
            if f.default is not dataclasses.MISSING:
                return f.default
            return f.default_factory()
    raise KeyError(f"{section}.{key}")
