"""Check a RunConfig before anything is built, reporting every problem at once.

Each problem names its dotted key, the value found and what is allowed. Checks read the config
only: no model is built, no data file is opened (data files are checked where data is built).
Derived defaults are checked as `resolve()` would fill them, so raw and resolved configs validate
alike. Checks that depend on the machine (CUDA, Transformer Engine, apex) use an Environment,
detected here unless one is passed. The checks themselves are in config/section_checks/, one module
per config section, run here in a fixed order.
"""
from __future__ import annotations

import warnings
from typing import List, Optional

from .environment import Environment
from .errors import ConfigError, ConfigWarning, Problem
from .resolve import resolve
from .schema import RunConfig
from .section_checks import data, fp8, latent_attention, logs, model, moe, parallel, training, upcycle, values
from .section_checks.state import CheckState

# The cross-key checks, in the order their problems are reported (after each key's own checks).
SECTION_CHECKS = (model.check, latent_attention.check, moe.check, upcycle.check, parallel.check_layout,
                  parallel.check_world_size, parallel.check_overlap, training.check, fp8.check, data.check,
                  logs.check)


def validate(cfg: RunConfig, world_size: Optional[int] = None, *,
             env: Optional[Environment] = None) -> None:
    """Raise one ConfigError listing every problem of ``cfg``; return None when there is none.

    ``world_size`` (number of processes), when known, enables the batch-size and parallel-size
    checks that depend on it. ``env`` describes the machine; None probes this one.
    """
    state = _check(cfg, world_size, env)
    if state.problems:
        raise ConfigError(state.problems)
    for key, message in state.warnings:
        warnings.warn(ConfigWarning(key, message), stacklevel=2)


def find_problems(cfg: RunConfig, world_size: Optional[int] = None, *,
                  env: Optional[Environment] = None) -> List[Problem]:
    """The (key, message) problems of ``cfg``; an empty list when it is valid."""
    return _check(cfg, world_size, env).problems


def find_warnings(cfg: RunConfig, world_size: Optional[int] = None, *,
                  env: Optional[Environment] = None) -> List[Problem]:
    """The (key, message) settings of ``cfg`` that run but are likely not meant (validate() warns
    of them with ConfigWarning)."""
    return _check(cfg, world_size, env).warnings


def _check(cfg: RunConfig, world_size: Optional[int], env: Optional[Environment]) -> CheckState:
    state = CheckState(cfg, world_size, env)
    values.check_types(state)
    state.sane = values.sanitized(state)
    state.resolved = resolve(state.sane)
    values.check_choices(state)
    values.check_ranges(state)
    for check in SECTION_CHECKS:
        check(state)
    return state
