"""The runs of a sweep: every grid combination times every zip position, each with a name, and
its full run configuration validated by the project's config checks."""
from __future__ import annotations

import copy
import hashlib
import itertools
import re
from collections import defaultdict
from dataclasses import dataclass
from typing import Any, Dict, List, Optional, Tuple

from megatron_dmoe.config import ConfigError, Environment, RunConfig, config_from_dict, find_problems, resolve
from megatron_dmoe.config.load import deep_merge, read_with_extends

from .errors import Problem, SweepError
from .spec import SweepSpec

MAX_NAME_LENGTH = 200  # file names may have 255 bytes; leave room for suffixes
_UNSAFE = re.compile(r"[^A-Za-z0-9._+-]+")


@dataclass(frozen=True)
class SweepPoint:
    index: int  # position in the sweep (the job array's task id)
    name: str  # the run directory's name
    values: Dict[str, Any]  # dotted key -> value of the varied keys, grid keys first


def expand(spec: SweepSpec) -> List[SweepPoint]:
    """One point per grid combination and zip position: the grid's last key varies fastest, and
    each grid combination is run with every zip position in turn. Raises SweepError when two
    points would get the same directory name (repeated values)."""
    grid_keys, zip_keys = list(spec.grid), list(spec.zip)
    combos = list(itertools.product(*(spec.grid[k] for k in grid_keys)))
    zip_rows = list(zip(*(spec.zip[k] for k in zip_keys))) if zip_keys else [()]
    labels = key_labels(grid_keys + zip_keys)
    points, seen = [], {}
    for combo in combos:
        for row in zip_rows:
            values = dict(zip(grid_keys, combo))
            values.update(zip(zip_keys, row))
            name = point_name(values, labels, default=spec.name)
            if name in seen:
                raise SweepError(str(spec.path), [(
                    name, f"two runs get this directory name ({format_overrides(seen[name])} and "
                          f"{format_overrides(values)}); make the values of each key distinct")])
            seen[name] = values
            points.append(SweepPoint(index=len(points), name=name, values=values))
    return points


def key_labels(keys: List[str]) -> Dict[str, str]:
    """Each key's label in run names: the part after the section, or the whole dotted key where
    two sections share that name (model.ffn_hidden_size and moe.ffn_hidden_size)."""
    short = [k.split(".", 1)[-1] for k in keys]
    return {k: s if short.count(s) == 1 else k for k, s in zip(keys, short)}


def point_name(values: Dict[str, Any], labels: Dict[str, str], default: str) -> str:
    """``top_k=2,lr=0.001``: label=value pairs (list items joined by ``+``), characters other than
    letters, digits and ``._+-`` replaced by ``-``; long names are cut and made unique with a hash."""
    if not values:
        return _UNSAFE.sub("-", default).strip("-.") or "run"
    name = ",".join(f"{labels[k]}={_name_value(v)}" for k, v in values.items())
    if len(name) > MAX_NAME_LENGTH:
        digest = hashlib.sha1(name.encode()).hexdigest()[:10]
        name = f"{name[:MAX_NAME_LENGTH - 11]}-{digest}"
    return name


def format_value(value: Any) -> str:
    """A value as written in YAML or a key=value override: null, true, 0.001, [a,b]."""
    if value is None:
        return "null"
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, list):
        return "[" + ",".join(format_value(v) for v in value) + "]"
    if isinstance(value, dict):
        return "{" + ",".join(f"{k}:{format_value(v)}" for k, v in value.items()) + "}"
    return str(value) if not isinstance(value, float) else repr(value)


def format_overrides(values: Dict[str, Any]) -> str:
    return " ".join(f"{key}={format_value(value)}" for key, value in values.items())


def _name_value(value: Any) -> str:
    if isinstance(value, list):
        return "+".join(_name_value(v) for v in value) or "[]"
    return _UNSAFE.sub("-", format_value(value)) or "-"


def point_overrides(spec: SweepSpec, point: SweepPoint) -> Dict[str, Any]:
    """Every key this run sets on top of the base config: the sweep's overrides, then its values."""
    return {**spec.overrides, **point.values}


def point_config(base: Dict[str, Any], overrides: Dict[str, Any]) -> RunConfig:
    """The resolved RunConfig of ``base`` (a config mapping) with dotted-key ``overrides``;
    raises ConfigError for unknown keys or values of the wrong type."""
    nested: Dict[str, Dict[str, Any]] = {}
    for key, value in overrides.items():
        section, name = key.split(".")
        nested.setdefault(section, {})[name] = copy.deepcopy(value)
    return resolve(config_from_dict(deep_merge(base, nested)))


def build_configs(spec: SweepSpec, points: List[SweepPoint],
                  env: Optional[Environment] = None) -> List[RunConfig]:
    """Each point's resolved config, validated for the machine ``env`` describes (None: this one).

    Raises one SweepError with every problem; a problem shared by several runs is listed once
    with the runs it concerns.
    """
    source = str(spec.path)
    try:
        base = read_with_extends(spec.base)
    except ConfigError as err:
        raise SweepError(source, [(f"base {key}", message) for key, message in err.problems])
    env = env or Environment.detect()
    configs, found = [], defaultdict(list)  # (key, message) -> names of the runs
    for point in points:
        try:
            cfg = point_config(base, point_overrides(spec, point))
        except ConfigError as err:
            problems: List[Problem] = err.problems
        else:
            configs.append(cfg)
            problems = find_problems(cfg, env=env)
        for problem in problems:
            found[problem].append(point.name)
    if found:
        raise SweepError(source, [_shared(problem, names, len(points))
                                  for problem, names in found.items()])
    return configs


def _shared(problem: Tuple[str, str], names: List[str], total: int) -> Problem:
    key, message = problem
    if total == 1:
        return key, message
    if len(names) == total:
        return key, f"{message} (every run)"
    return key, f"{message} (run{'s' if len(names) > 1 else ''} {', '.join(names)})"
