"""A resumed run whose saved parallel layout does not fit the processes it was started with: one
line naming the saved config file and its keys, and the commands that work (dmoe-train with enough
processes, or this process count with the sizes overridden: parallel sizes may change on resume)."""
from __future__ import annotations

import copy
import math
import shlex
from pathlib import Path
from typing import List, Optional, Sequence

from megatron_dmoe.config import RunConfig, find_problems

_SIZES = ("tensor_model_parallel_size", "pipeline_model_parallel_size", "virtual_pipeline_model_parallel_size",
          "expert_model_parallel_size", "expert_tensor_parallel_size", "context_parallel_size")


def _layout_problems(cfg: RunConfig, world_size: int) -> List[str]:
    return [key for key, _ in find_problems(cfg, world_size=world_size) if key.startswith("parallel.")]


def _smallest_world(cfg: RunConfig) -> Optional[int]:
    """The fewest processes the layout fits: a multiple of tensor x pipeline (x context) for the dense
    part and of expert x expert-tensor x pipeline for the experts; None when that is not enough
    (another layout problem, which no process count mends)."""
    par = cfg.parallel
    dense = par.tensor_model_parallel_size * par.pipeline_model_parallel_size * par.context_parallel_size
    experts = par.expert_model_parallel_size * par.expert_tensor_parallel_size * par.pipeline_model_parallel_size
    needed = math.lcm(dense, experts)
    return needed if not _layout_problems(cfg, needed) else None


def _fitting_overrides(cfg: RunConfig, world_size: int) -> Optional[List[str]]:
    """The overrides that make the layout fit `world_size` processes (every size 1), or None."""
    single = copy.deepcopy(cfg)
    changes = []
    for key in _SIZES:
        value = getattr(single.parallel, key)
        target = None if key == "virtual_pipeline_model_parallel_size" else 1
        if value not in (1, None):
            setattr(single.parallel, key, target)
            changes.append(f"parallel.{key}={'null' if target is None else target}")
    if single.parallel.sequence_parallel:
        single.parallel.sequence_parallel = False
        changes.append("parallel.sequence_parallel=false")
    return changes if changes and not _layout_problems(single, world_size) else None


def saved_layout_message(run_dir: Path, saved_config: Path, cfg: RunConfig, problem_keys: Sequence[str],
                         overrides: Sequence[str], world_size: int) -> Optional[str]:
    """The line for a resume refused only for its saved parallel layout (None for anything else:
    another problem, or a layout key the user overrode)."""
    overridden = {item.partition("=")[0].strip() for item in overrides}
    if not problem_keys or any(not key.startswith("parallel.") or key in overridden for key in problem_keys):
        return None
    saved = [f"{key}: {getattr(cfg.parallel, key)}" for key in _SIZES
             if getattr(cfg.parallel, key) not in (1, None)]
    needed = _smallest_world(cfg)
    if not saved or needed is None:
        return None
    extra = (" " + shlex.join(overrides)) if overrides else ""
    processes = f"{world_size} process" + ("es" if world_size > 1 else "")
    ways = [f"dmoe-train --nproc-per-node {needed} --run-dir {run_dir} --resume{extra}"]
    fitting = _fitting_overrides(cfg, world_size)
    if fitting:
        command = (f"dmoe-train --run-dir {run_dir} --resume" if world_size == 1 else
                   f"dmoe-train --nproc-per-node {world_size} --run-dir {run_dir} --resume")
        ways.append(f"{command} {' '.join(fitting)}{extra} (parallel sizes may change on resume)")
    return (f"cannot resume {run_dir} with {processes}: its saved config {saved_config} sets "
            f"parallel.{', parallel.'.join(saved)}, a layout of {needed} processes; continue with: "
            + ", or: ".join(ways))
