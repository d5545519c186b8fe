"""Read a sweep file: the base config, overrides for every run, and the values to vary.

    base: tiny                       # a config file (relative to this file) or a shipped name
    overrides:                       # applied to every run
      training.train_iters: 500
    grid:                            # every combination of these values (cartesian product)
      moe.top_k: [1, 2]
    zip:                             # these lists are walked together: run i takes value i of each
      training.lr: [1.0e-3, 2.0e-3]
      training.min_lr: [1.0e-4, 2.0e-4]
    slurm:                           # sbatch options of the job array (dmoe-sweep --slurm)
      partition: gpu
      time: "04:00:00"

Parsing checks the file's shape and that every key exists in the run configuration (with the
config's did-you-mean hints); whether each run's values make sense is checked by `points.py`.
"""
from __future__ import annotations

import dataclasses
import difflib
import os
import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Dict, List, Optional, Sequence

import yaml

from megatron_dmoe.config import ConfigError
from megatron_dmoe.config.fields import section_types, unknown_key_message, unknown_section_message
from megatron_dmoe.config.load import find_config, parse_overrides
from megatron_dmoe.config.schema import SECTIONS
from megatron_dmoe.config.yaml_io import parse_yaml, yaml_error_text

from .errors import Problem, SweepError

TOP_LEVEL_KEYS = ("base", "overrides", "grid", "zip", "slurm")
# sbatch options that dmoe-sweep sets itself for the job array.
RESERVED_SBATCH_OPTIONS = ("array", "export", "parsable", "wrap")
_SBATCH_OPTION = re.compile(r"^[a-z][a-z0-9-]*$")


@dataclass(frozen=True)
class SweepSpec:
    path: Path  # the sweep file
    base: Path  # the base config file
    overrides: Dict[str, Any] = field(default_factory=dict)  # dotted key -> value, every run
    grid: Dict[str, List[Any]] = field(default_factory=dict)  # dotted key -> values, all combinations
    zip: Dict[str, List[Any]] = field(default_factory=dict)  # dotted key -> values, walked together
    slurm: Dict[str, Any] = field(default_factory=dict)  # sbatch long option (no dashes) -> value

    @property
    def name(self) -> str:
        return self.path.stem


def load_sweep(path: os.PathLike) -> SweepSpec:
    """Parse and check a sweep file; raises SweepError listing every problem found."""
    path = Path(path)
    source = str(path)
    try:
        data = parse_yaml(path.read_text(encoding="utf-8"))
    except OSError as err:
        raise SweepError(source, [(source, f"cannot read the sweep file: {err.strerror or err}")])
    except yaml.YAMLError as err:
        raise SweepError(source, [(source, "not valid YAML at " + yaml_error_text(err))])
    if not isinstance(data, dict):
        raise SweepError(source, [(source, "expected a mapping with base:, and optionally "
                                           "overrides:, grid:, zip:, slurm:")])
    problems: List[Problem] = []
    for key in data:
        if key not in TOP_LEVEL_KEYS:
            close = difflib.get_close_matches(str(key), TOP_LEVEL_KEYS, n=1)
            hint = f"did you mean {close[0]}? " if close else ""
            problems.append((str(key), f"unknown key; {hint}the keys of a sweep file are: "
                                       f"{', '.join(TOP_LEVEL_KEYS)}"))
    base = _base(path, data.get("base"), problems)
    overrides = _mapping(data, "overrides", problems)
    grid = _value_lists(data, "grid", problems)
    zipped = _value_lists(data, "zip", problems)
    slurm = _sbatch_options(data, problems)
    for section_name, keys in (("overrides", overrides), ("grid", grid), ("zip", zipped)):
        for key in keys:
            message = config_key_problem(key)
            if message:
                problems.append((f"{section_name}: {key}", message))
    lengths = {key: len(values) for key, values in zipped.items()}
    if len(set(lengths.values())) > 1:
        listed = ", ".join(f"{key} has {n}" for key, n in lengths.items())
        problems.append(("zip", f"the lists have different lengths ({listed}); zip walks them "
                                "together, so give every key the same number of values"))
    for key in grid:
        if key in zipped:
            problems.append((key, "is in both grid and zip; vary it in one of them"))
    for key in overrides:
        if key in grid or key in zipped:
            where = "grid" if key in grid else "zip"
            problems.append((key, f"is set in overrides and varied in {where}; remove it from "
                                  "overrides"))
    if problems:
        raise SweepError(source, problems)
    return SweepSpec(path=path, base=base, overrides=overrides, grid=grid, zip=zipped, slurm=slurm)


def with_overrides(spec: SweepSpec, items: Sequence[str]) -> SweepSpec:
    """The sweep with command-line `section.key=value` overrides added to every run (over the sweep
    file's own overrides); raises SweepError listing every problem (a malformed override, an unknown
    key, a key the sweep varies)."""
    if not items:
        return spec
    nested, problems = parse_overrides(items)
    extra = {f"{section}.{key}": value for section, values in nested.items() for key, value in values.items()}
    for key in extra:
        message = config_key_problem(key)
        if message:
            problems.append((key, message))
        elif key in spec.grid or key in spec.zip:
            where = "grid" if key in spec.grid else "zip"
            problems.append((key, f"is varied in the sweep's {where}; leave it out of the command line's overrides"))
    if problems:
        raise SweepError(f"{spec.path} with the command line's overrides", problems)
    return dataclasses.replace(spec, overrides={**spec.overrides, **extra})


def config_key_problem(key: Any) -> Optional[str]:
    """What is wrong with a dotted run-config key (``moe.top_k``), or None when it exists."""
    if not isinstance(key, str) or key.count(".") != 1 or not all(key.split(".")):
        return "a key must look like section.key, e.g. moe.top_k"
    section, name = key.split(".")
    if section not in SECTIONS:
        return unknown_section_message(section)
    if name not in section_types()[section]:
        return unknown_key_message(section, name)
    return None


def _base(sweep_path: Path, base: Any, problems: List[Problem]) -> Path:
    if base is None:
        problems.append(("base", "missing; name the config every run starts from: a YAML file "
                                 "(relative to the sweep file) or a shipped config such as tiny"))
        return Path()
    if not isinstance(base, str) or not base.strip():
        problems.append(("base", f"expected a config file or shipped config name, got {base!r}"))
        return Path()
    beside = sweep_path.parent / os.path.expanduser(base)
    if beside.is_file():
        return beside.resolve()
    try:
        return find_config(base)
    except ConfigError as err:
        problems.append(("base", f"config '{base}' not found next to the sweep file, as a path, "
                                 f"or among the shipped configs ({err.problems[0][1]})"))
        return Path()


def _mapping(data: Dict[str, Any], key: str, problems: List[Problem]) -> Dict[str, Any]:
    value = data.get(key)
    if value is None:
        return {}
    if not isinstance(value, dict):
        problems.append((key, f"expected a mapping of section.key: value, got {value!r}"))
        return {}
    return dict(value)


def _value_lists(data: Dict[str, Any], key: str, problems: List[Problem]) -> Dict[str, List[Any]]:
    out = {}
    for name, values in _mapping(data, key, problems).items():
        if not isinstance(values, list):
            problems.append((f"{key}: {name}", f"expected a list of values, got {values!r}; write "
                                               f"{name}: [{values!r}] for a single value"))
        elif not values:
            problems.append((f"{key}: {name}", "empty list; give at least one value"))
        else:
            out[name] = list(values)
    return out


def _sbatch_options(data: Dict[str, Any], problems: List[Problem]) -> Dict[str, Any]:
    options = _mapping(data, "slurm", problems)
    for name, value in options.items():
        where = f"slurm: {name}"
        if not isinstance(name, str) or not _SBATCH_OPTION.match(name):
            problems.append((where, "expected an sbatch long option without dashes, such as "
                                    "partition or gpus-per-node"))
        elif name in RESERVED_SBATCH_OPTIONS:
            problems.append((where, "is set by dmoe-sweep for the job array; remove it"))
        elif value is None or isinstance(value, (dict, list)):
            problems.append((where, f"expected a single value (true for a flag), got {value!r}"))
        elif value is False:
            problems.append((where, "false is not an sbatch option; remove the key"))
    return options
