"""Plan a sweep's run directories (checking everything, writing nothing), then write them.

A sweep's runs live in one folder (default runs/<sweep name>): a directory per run holding the
resolved config.yaml that `dmoe-train --run-dir DIR --resume` trains from, and next to them
runs.txt (the run directories in sweep order, one absolute path per line: task i of a job array
runs line i+1) and sweep.yaml (a copy of the sweep file).
"""
from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path
from typing import List, Optional

from megatron_dmoe.config import ConfigError, Environment, RunConfig, config_to_dict, load_config, save_config

from .errors import Problem, SweepError
from .points import SweepPoint, build_configs, expand, format_value
from .spec import SweepSpec
from .status import CONFIG_FILE

RUN_LIST = "runs.txt"
SWEEP_COPY = "sweep.yaml"


@dataclass(frozen=True)
class PlannedRun:
    point: SweepPoint
    run_dir: Path
    config: RunConfig  # resolved and validated


def default_runs_dir(spec: SweepSpec) -> Path:
    return Path("runs") / spec.name


def plan_runs(spec: SweepSpec, runs_dir: os.PathLike,
              env: Optional[Environment] = None) -> List[PlannedRun]:
    """Every run of the sweep with its directory and validated config; writes nothing.

    Raises SweepError when a run's config is invalid for ``env`` (None: this machine), or when a
    run directory already holds a config.yaml that differs (its checkpoints belong to another run).
    """
    runs_dir = Path(runs_dir)
    points = expand(spec)
    configs = build_configs(spec, points, env)
    planned = [PlannedRun(point=p, run_dir=runs_dir / p.name, config=c)
               for p, c in zip(points, configs)]
    problems = [problem for run in planned for problem in _existing_config_problems(run)]
    if problems:
        raise SweepError(str(spec.path), problems)
    return planned


# settings whose `auto` is resolved when a run starts (its config.yaml records the outcome): `auto`
# asks for whatever the earlier run resolved it to
RESOLVED_AT_START = {("training", "cuda_graphs"), ("moe", "expert_wgrad_window")}


def _existing_config_problems(run: PlannedRun) -> List[Problem]:
    path = run.run_dir / CONFIG_FILE
    if not path.exists():
        return []
    fix = "choose another --runs-dir, or delete that run directory to start it over"
    try:
        existing = load_config(str(path))
    except ConfigError as err:
        return [(str(path), f"cannot read the existing config ({err}); {fix}")]
    old, new = config_to_dict(existing), config_to_dict(run.config)
    changed = [f"{section}.{key}: {format_value(old[section][key])} -> {format_value(value)}"
               for section, values in new.items() for key, value in values.items()
               if old[section][key] != value and not (value == "auto" and (section, key) in RESOLVED_AT_START)]
    if not changed:
        return []
    shown = ", ".join(changed[:4]) + (f" and {len(changed) - 4} more" if len(changed) > 4 else "")
    return [(str(path), f"an earlier run with another config is there ({shown}); {fix}")]


def write_runs(spec: SweepSpec, planned: List[PlannedRun], runs_dir: os.PathLike) -> Path:
    """Write each run's config.yaml, runs.txt and sweep.yaml; returns runs.txt's path."""
    runs_dir = Path(runs_dir)
    runs_dir.mkdir(parents=True, exist_ok=True)
    for run in planned:
        save_config(run.config, run.run_dir / CONFIG_FILE)
    run_list = runs_dir / RUN_LIST
    run_list.write_text("".join(f"{run.run_dir.resolve()}\n" for run in planned), encoding="utf-8")
    (runs_dir / SWEEP_COPY).write_text(spec.path.read_text(encoding="utf-8"), encoding="utf-8")
    return run_list
