"""YAML reading and writing with the scalar rules a config needs.

PyYAML follows YAML 1.1, which surprises config files: ``lr: 1e-3`` is read as a string,
``progress_bar: off`` as False and ``010`` as 8. This loader reads plain scalars as YAML 1.2 does
(only true/false are booleans, decimal integers, floats with or without a dot) and rejects a key
written twice in one mapping instead of silently keeping the last. The dumper quotes every string
that either rule set would read as something else, so files it writes read back the same anywhere.
"""
from __future__ import annotations

import copy
import functools
import re

import yaml

_BOOL = re.compile(r"^(?:true|True|TRUE|false|False|FALSE)$")
_INT = re.compile(r"^(?:[-+]?[0-9]+|0x[0-9a-fA-F]+|0o[0-7]+)$")
_FLOAT = re.compile(
    r"^(?:[-+]?(?:\.[0-9]+|[0-9]+(?:\.[0-9]*)?)(?:[eE][-+]?[0-9]+)?"
    r"|[-+]?\.(?:inf|Inf|INF)|\.(?:nan|NaN|NAN))$"
)
_REPLACED_TAGS = {
    "tag:yaml.org,2002:bool",
    "tag:yaml.org,2002:int",
    "tag:yaml.org,2002:float",
    "tag:yaml.org,2002:timestamp",
}


def _strip_resolvers(resolvers: dict) -> dict:
    return {
        first: [(tag, regexp) for tag, regexp in entries if tag not in _REPLACED_TAGS]
        for first, entries in resolvers.items()
    }


class ConfigLoader(yaml.SafeLoader):
    """Safe loader with YAML 1.2 plain scalars and an error for duplicate keys."""

    def construct_mapping(self, node, deep=False):
        if isinstance(node, yaml.MappingNode):
            seen = {}
            for key_node, _ in node.value:
                if key_node.tag == "tag:yaml.org,2002:merge":
                    continue
                key = self.construct_object(key_node, deep=True)
                try:
                    hash(key)
                except TypeError:
                    continue  # the base class reports unhashable keys
                if key in seen:
                    raise yaml.constructor.ConstructorError(
                        "while reading a mapping", node.start_mark,
                        f"key {key!r} appears twice (first {seen[key]})", key_node.start_mark,
                    )
                seen[key] = f"on line {key_node.start_mark.line + 1}"
        return super().construct_mapping(node, deep=deep)

    def construct_yaml_int(self, node):
        text = self.construct_scalar(node)
        if text.startswith(("0x", "0o")):
            return int(text, 0)
        return int(text, 10)  # "010" is ten, as in YAML 1.2


ConfigLoader.yaml_implicit_resolvers = _strip_resolvers(yaml.SafeLoader.yaml_implicit_resolvers)
ConfigLoader.add_implicit_resolver("tag:yaml.org,2002:bool", _BOOL, list("tTfF"))
ConfigLoader.add_implicit_resolver("tag:yaml.org,2002:int", _INT, list("-+0123456789"))
ConfigLoader.add_implicit_resolver("tag:yaml.org,2002:float", _FLOAT, list("-+0123456789."))
ConfigLoader.add_constructor("tag:yaml.org,2002:int", ConfigLoader.construct_yaml_int)


class ConfigDumper(yaml.SafeDumper):
    """Safe dumper that also quotes strings the loader above would read as numbers."""


ConfigDumper.add_implicit_resolver("tag:yaml.org,2002:float", _FLOAT, list("-+0123456789."))
ConfigDumper.add_implicit_resolver("tag:yaml.org,2002:int", _INT, list("-+0123456789"))


def parse_yaml(text: str):
    """Parse one YAML document with the config rules; raises yaml.YAMLError. The caller owns the
    result (a copy): a sweep resolves hundreds of configs from the same files and overrides."""
    return copy.deepcopy(_parse_yaml_once(text))


@functools.lru_cache(maxsize=4096)
def _parse_yaml_once(text: str):
    return yaml.load(text, Loader=ConfigLoader)


def dump_yaml(data) -> str:
    """Block-style YAML, keys in the given order."""
    return yaml.dump(data, Dumper=ConfigDumper, sort_keys=False, default_flow_style=False,
                     allow_unicode=True)


def yaml_error_text(err: yaml.YAMLError) -> str:
    """A parse error as one readable phrase with 1-based positions, e.g. "line 3, column 16:
    expected ',' or ']', but got '<stream end>' (while parsing a flow sequence that starts at
    line 2, column 14)"; PyYAML's own text spans several lines and calls the file "<unicode string>"."""
    problem = getattr(err, "problem", None)
    mark = getattr(err, "problem_mark", None)
    if problem is None:
        return " ".join(str(err).split())
    text = f"line {mark.line + 1}, column {mark.column + 1}: {problem}" if mark else problem
    context, context_mark = getattr(err, "context", None), getattr(err, "context_mark", None)
    if context:
        where = (f" that starts at line {context_mark.line + 1}, column {context_mark.column + 1}"
                 if context_mark and (mark is None or context_mark.line != mark.line
                                      or context_mark.column != mark.column) else "")
        text += f" ({context}{where})"
    return text
