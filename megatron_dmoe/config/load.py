"""Build a RunConfig from YAML files, `extends:` chains and `section.key=value` overrides.

Loading checks structure only: unknown sections and keys (with a did-you-mean), value types, YAML
syntax and `extends:` problems, all reported together in one ConfigError. Whether the values make
sense together is `validate.py`'s job.
"""
from __future__ import annotations

import copy
import dataclasses
import importlib.resources
import os
from pathlib import Path
from typing import Any, Dict, Iterable, List, Optional, Sequence, Tuple

import yaml

from .errors import ConfigError, Problem
from .fields import coerce, did_you_mean, section_class, section_types, unknown_key_message, unknown_section_message
from .megatron_names import key_for_megatron_name
from .schema import SECTIONS, RunConfig
from .yaml_io import parse_yaml, yaml_error_text

SHIPPED_PACKAGE = "megatron_dmoe_configs"
DEFAULT_CONFIG = "tiny.yaml"
EXTENDS_KEY = "extends"
DERIVED_KEY = "derived"  # a run's config.yaml: the keys whose values resolve() derived
# Top-level blocks that describe a run without configuring it (written by save_config).
IGNORED_KEYS = ("versions", DERIVED_KEY)


def load_config(path_or_name: Optional[str] = None, overrides: Sequence[str] = ()) -> RunConfig:
    """Read a config file (or a shipped config by name; None = the shipped tiny.yaml).

    ``overrides`` are ``section.key=value`` strings whose values are read as YAML
    (``moe.top_k=2``, ``data.data_path=[0.3,a,0.7,b]``, ``moe.expert_capacity_factor=null``);
    they apply after the file and its ``extends:`` chain. Raises ConfigError.
    """
    cfg, problems = load_config_partly(path_or_name, overrides)
    if problems:
        raise ConfigError(problems)
    return cfg


def load_config_partly(path_or_name: Optional[str] = None,
                       overrides: Sequence[str] = ()) -> Tuple[RunConfig, List[Problem]]:
    """load_config that does not stop at the first bad key: the config built from every key and
    override that could be read (the others keep their defaults), and the problems of the rest
    (malformed overrides, unknown keys, wrong types), so that a caller can validate the config
    and report every problem at once. A file that cannot be used at all still raises ConfigError."""
    path = find_config(path_or_name)
    merged = read_with_extends(path)
    _refuse_sweep_file(path, merged)
    override_values, problems = parse_overrides(overrides)
    # an override that names no key or has the wrong type is left out, so its key keeps the file's value
    override_problems: List[Problem] = []
    _build_config(override_values, override_problems)
    bad = {key for key, _ in override_problems}
    override_values = {section: {key: value for key, value in body.items() if f"{section}.{key}" not in bad}
                       for section, body in override_values.items() if section not in bad}
    cfg = _build_config(deep_merge(merged, override_values), problems)
    cfg.derived = _still_derived(merged.get(DERIVED_KEY), override_values, problems)
    return cfg, problems + override_problems


def _still_derived(listed: Any, override_values: Dict[str, Dict[str, Any]], problems: List[Problem]):
    """The keys a run's config.yaml lists as derived (`derived:`, written by save_config) that no
    override sets: resolve() derives them again from their sources."""
    if listed is None:
        return ()
    if not isinstance(listed, list) or not all(isinstance(key, str) for key in listed):
        problems.append((DERIVED_KEY, f"expected a list of keys such as training.lr_decay_iters, got "
                                      f"{listed!r}; remove the block to keep the values written"))
        return ()
    overridden = {f"{section}.{key}" for section, body in override_values.items() for key in body}
    return tuple(key for key in listed if key not in overridden)


# a sweep file's top-level keys (megatron_dmoe/sweep/spec.py reads them)
_SWEEP_KEYS = ("base", "grid", "zip", "overrides", "slurm")


def _refuse_sweep_file(path: Path, data: Dict[str, Any]) -> None:
    if "base" in data and not any(section in data for section in SECTIONS):
        keys = ", ".join(f"{k}:" for k in _SWEEP_KEYS if k in data)
        raise ConfigError([(str(path), f"this is a sweep file ({keys}), not a run config: run it "
                                       f"with dmoe-sweep {path}")])


def shipped_configs_dir() -> Path:
    return Path(str(importlib.resources.files(SHIPPED_PACKAGE)))


def shipped_config_names() -> List[str]:
    root = shipped_configs_dir()
    return sorted(str(p.relative_to(root).with_suffix("")) for p in root.rglob("*.yaml"))


def runnable_config_names() -> List[str]:
    """The shipped configs a run can start from: without the sweep files (sweeps/) and the
    fragments other configs extend (the shared `base` settings, the zoo's model `sizes/`)."""
    names = []
    for name in shipped_config_names():
        parts = Path(name).parts
        if parts[0] == "sweeps" or parts[-1] == "base" or "sizes" in parts[:-1]:
            continue
        names.append(name)
    return names


def _closest_config(name: str) -> Optional[str]:
    """The runnable config `name` most likely means (a typo, or the name without its folder)."""
    names = runnable_config_names()
    stem = name[:-5] if name.endswith(".yaml") else name
    by_leaf = {Path(n).name: n for n in names}
    close = did_you_mean(stem, names) or did_you_mean(Path(stem).name, list(by_leaf))
    return by_leaf.get(close, close)


def find_config(path_or_name: Optional[str]) -> Path:
    """An existing file as given, else a config shipped with the package (`tiny`, `zoo/x.yaml`)."""
    if path_or_name is None:
        path_or_name = DEFAULT_CONFIG
    given = Path(os.path.expanduser(str(path_or_name)))
    if given.is_file():
        return given.resolve()
    shipped = _shipped(str(path_or_name))
    if shipped is not None:
        return shipped
    if given.is_dir():
        hint = "it is a folder; name a .yaml file"
    else:
        close = _closest_config(str(path_or_name))
        guess = f"did you mean {close}? " if close else ""
        hint = (f"no such file, and no shipped config of that name; {guess}shipped configs: "
                + ", ".join(runnable_config_names()))
    raise ConfigError([(str(path_or_name), f"config not found: {hint}")])


def _shipped(name: str) -> Optional[Path]:
    if Path(name).is_absolute():
        return None
    root = shipped_configs_dir()
    for candidate in (name, name + ".yaml"):
        path = (root / candidate).resolve()
        if path.is_file() and path.suffix == ".yaml":
            return path
    return None


def read_with_extends(path: Path, _chain: Tuple[Path, ...] = ()) -> Dict[str, Any]:
    """The file's mapping with its `extends:` bases merged underneath (later bases win)."""
    path = path.resolve()
    if path in _chain:
        cycle = " -> ".join(str(p) for p in _chain + (path,))
        raise ConfigError([(str(path), f"extends cycle: {cycle}; remove one of these extends")])
    data = read_yaml_mapping(path)
    bases = data.pop(EXTENDS_KEY, None)
    if bases is None:
        return data
    if isinstance(bases, str):
        bases = [bases]
    if not isinstance(bases, list) or not all(isinstance(b, str) for b in bases):
        raise ConfigError([(f"{path}: {EXTENDS_KEY}",
                            f"expected a path or a list of paths, got {bases!r}")])
    merged: Dict[str, Any] = {}
    for base in bases:
        merged = deep_merge(merged, read_with_extends(_find_base(path, base), _chain + (path,)))
    return deep_merge(merged, data)


def _find_base(child: Path, base: str) -> Path:
    candidate = Path(os.path.expanduser(base))
    if not candidate.is_absolute():
        candidate = child.parent / candidate
    if candidate.is_file():
        return candidate
    shipped = _shipped(base)
    if shipped is not None:
        return shipped
    raise ConfigError([(f"{child}: {EXTENDS_KEY}",
                        f"base config '{base}' not found (looked for {candidate} and among the "
                        f"shipped configs); paths are relative to the file that names them")])


def read_yaml_mapping(path: Path) -> Dict[str, Any]:
    try:
        text = path.read_text(encoding="utf-8")
    except OSError as err:
        raise ConfigError([(str(path), f"cannot read the config file: {err.strerror or err}")])
    try:
        data = parse_yaml(text)
    except yaml.YAMLError as err:
        raise ConfigError([(str(path), "not valid YAML at " + yaml_error_text(err))])
    if data is None:
        return {}
    if not isinstance(data, dict):
        raise ConfigError([(str(path), f"expected a mapping of sections at the top level, got "
                                       f"{type(data).__name__}")])
    return data


def deep_merge(base: Dict[str, Any], top: Dict[str, Any]) -> Dict[str, Any]:
    """A new dict: mappings merge key by key, everything else (lists too) is replaced by `top`."""
    out = copy.deepcopy(base)
    for key, value in top.items():
        if isinstance(value, dict) and isinstance(out.get(key), dict):
            out[key] = deep_merge(out[key], value)
        else:
            out[key] = copy.deepcopy(value)
    return out


def parse_overrides(overrides: Iterable[str]) -> Tuple[Dict[str, Any], List[Problem]]:
    """``["moe.top_k=2", ...]`` -> ({"moe": {"top_k": 2}}, problems). Later overrides win."""
    if isinstance(overrides, str):
        overrides = [overrides]
    values: Dict[str, Any] = {}
    problems: List[Problem] = []
    for item in overrides:
        key, sep, text = item.partition("=")
        key = key.strip()
        parts = key.split(".")
        if not sep and looks_like_key(key):
            problems.append((item, "an override must look like section.key=value, and this malformed "
                                   f"override has no value; write {key}=VALUE"))
            continue
        if not sep or len(parts) != 2 or not all(parts):
            problems.append((item, "an override must look like section.key=value, "
                                   "e.g. moe.top_k=2" + _key_hint(key, text if sep else None)))
            continue
        try:
            value = parse_yaml(text) if text.strip() else None
        except yaml.YAMLError as err:
            problems.append((key, f"cannot read the value {text!r} of the override as YAML: "
                                  + yaml_error_text(err)))
            continue
        values.setdefault(parts[0], {})[parts[1]] = value
    return values, problems


def looks_like_key(text: str) -> bool:
    """Whether `text` is shaped like a config key (`training.train_iters`): a section's name, a dot
    and a name; such an argument without `=value` is a malformed override, not a config name."""
    section, dot, key = text.partition(".")
    return bool(dot) and section in SECTIONS and key.isidentifier()


def _key_hint(name: str, value: Optional[str]) -> str:
    """'; did you mean training.micro_batch_size=4?' for a key without its section (ours or
    Megatron-LM's name)."""
    if "." in name or not name:
        return ""
    ours = key_for_megatron_name(name)
    if ours is None:
        owners = [f"{s}.{name}" for s, fields in section_types().items() if name in fields]
        ours = owners[0] if owners else None
    if ours is None:
        return ""
    if ":" in ours:  # a Megatron-LM switch that sets a value
        return f"; did you mean {ours.replace(': ', '=')}?"
    return f"; did you mean {ours}={value if value is not None else '...'}?"


def config_from_dict(data: Dict[str, Any]) -> RunConfig:
    """A RunConfig from ``{section: {key: value}}``; missing keys take the schema defaults.

    Unknown sections or keys and wrong types raise one ConfigError listing all of them.
    Top-level ``versions:`` (written by save_config) is ignored.
    """
    problems: List[Problem] = []
    cfg = _build_config(data, problems)
    if problems:
        raise ConfigError(problems)
    return cfg


def _build_config(data: Dict[str, Any], problems: List[Problem]) -> RunConfig:
    """A RunConfig from every key of ``data`` that can be used; the others go to ``problems``."""
    if not isinstance(data, dict):
        raise ConfigError([("config", f"expected a mapping of sections, got "
                                      f"{type(data).__name__}")])
    sections = {}
    # Report in schema order, whatever order files and overrides were merged in.
    ordered = [s for s in SECTIONS if s in data] + [k for k in data if k not in SECTIONS]
    for name in ordered:
        body = data[name]
        if name in IGNORED_KEYS:
            continue
        if name == EXTENDS_KEY:
            problems.append((name, "extends is only understood in files read by load_config"))
            continue
        if name not in SECTIONS:
            problems.append((str(name), unknown_section_message(str(name))))
            continue
        if body is None:
            body = {}
        if not isinstance(body, dict):
            problems.append((name, f"expected a mapping of keys, got {body!r}"))
            continue
        sections[name] = _section_from_dict(name, body, problems)
    return RunConfig(**sections)


def _section_from_dict(section: str, body: Dict[str, Any], problems: List[Problem]):
    types = section_types()[section]
    kwargs = {}
    for key, value in body.items():
        dotted = f"{section}.{key}"
        if key not in types:
            problems.append((dotted, unknown_key_message(section, str(key))))
            continue
        value, problem = coerce(value, types[key])
        if problem:
            problems.append((dotted, problem))
            continue
        kwargs[key] = value
    return section_class(section)(**kwargs)


def config_to_dict(cfg: RunConfig) -> Dict[str, Dict[str, Any]]:
    """``{section: {key: value}}`` in schema order; plain Python values, safe to modify."""
    return {section: dataclasses.asdict(getattr(cfg, section)) for section in SECTIONS}
