"""Checkpoints through megatron-core's dist_checkpointing.

Layout under the checkpoint root:
    iter_0000100/     one complete dist_checkpointing directory per saved iteration
    latest            the iteration of the newest COMPLETE checkpoint (written last, atomically)
A checkpoint is written to `iter_N.tmp`, renamed once every rank has finished, and only then named
in `latest`; an interrupted save therefore never becomes the checkpoint a resume loads. Older
checkpoints beyond `keep_last` are deleted after the new one is in place, and the staging
directories of killed saves when the next save starts. A save that fails for space or permissions
removes its staging directory and says so in one line (CheckpointError); `latest` keeps naming
the last complete checkpoint.
"""
from __future__ import annotations

import contextlib
import os
import random
import shutil
import warnings
from dataclasses import dataclass
from pathlib import Path
from typing import List, Optional

import numpy as np
import torch
import torch.distributed as dist
from megatron.core import dist_checkpointing
from megatron.core.dist_checkpointing.core import CheckpointingException
from megatron.core.dist_checkpointing.mapping import ShardedObject
from megatron.core.tensor_parallel import get_cuda_rng_tracker
from torch.distributed.checkpoint.api import CheckpointException

from megatron_dmoe.compat import mcore as mcore_compat
from megatron_dmoe.compat.distopt_empty_step import share_step_with_empty_parts
from megatron_dmoe.compat.distopt_state import fix_reshardable_offsets
from megatron_dmoe.parallel.distributed import barrier
from megatron_dmoe.training.checkpoint_damage import damage_message, iteration_of, newest_whole_before
from megatron_dmoe.training.checkpoint_writer import InProcessSaveStrategy
from megatron_dmoe.training.optimizer_switch import load_switched_optimizer_state, saved_with_distributed_optimizer
from megatron_dmoe.training.stops import resume_command
from megatron_dmoe.training.write_errors import causes, free_space, write_failure

LATEST = "latest"


class CheckpointError(RuntimeError):
    pass


@dataclass
class Progress:
    """Where training stands; saved with every checkpoint."""

    iteration: int = 0
    consumed_samples: int = 0
    world_size: int = 1
    train_time_s: float = 0.0  # seconds spent in training steps, for training.time_limit_minutes


def checkpoint_dir(root: Path, iteration: int) -> Path:
    return Path(root) / f"iter_{iteration:07d}"


def latest_iteration(root: Path) -> Optional[int]:
    """The newest complete checkpoint's iteration, or None when there is none."""
    marker = Path(root) / LATEST
    if not marker.exists():
        return None
    text = marker.read_text().strip()
    if not text.isdigit():
        older = newest_whole_before(root, None)
        offer = (f"the newest complete checkpoint is {older}: write {iteration_of(older)} into it to continue "
                 "from there" if older is not None else "delete it to start over")
        raise CheckpointError(f"{marker} is damaged (it holds {text!r}, not an iteration); {offer}")
    if not checkpoint_dir(root, int(text)).is_dir():
        raise CheckpointError(
            f"{marker} names iteration {text!r}, but {checkpoint_dir(root, int(text))} "
            "is missing; restore it or delete the marker to start over"
        )
    return int(text)


def _rng_state() -> dict:
    state = {
        "random": random.getstate(),
        "numpy": np.random.get_state(),
        "torch": torch.get_rng_state(),
        "tracker": portable_tracker_states(get_cuda_rng_tracker().get_states()),
    }
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        state["cuda"] = torch.cuda.get_rng_state()
    return state


def _state_tensor(state):
    return state.get_state() if isinstance(state, torch.Generator) else state


def portable_tracker_states(states: dict) -> dict:
    """The named RNG streams as state tensors: a captured run's tracker keeps graph-safe
    generators, an eager run's keeps tensors; saved as tensors, either run resumes the other's."""
    return {name: _state_tensor(state) for name, state in states.items()}


def restore_tracker_states(tracker, saved: dict) -> None:
    """Set the tracker's streams to the saved states (tensors or generators), in the tracker's own
    kind: a graph-safe generator is kept and its state set, since the CUDA graphs register that
    very object; a tensor state is replaced."""
    current = tracker.get_states()
    states = {}
    for name, state in saved.items():
        state = _state_tensor(state)
        mine = current.get(name)
        if isinstance(mine, torch.Generator):
            mine.set_state(state)
            states[name] = mine
        else:
            states[name] = state
    tracker.set_states(states)


def _set_rng_state(state: dict) -> None:
    random.setstate(state["random"])
    np.random.set_state(state["numpy"])
    torch.set_rng_state(state["torch"])
    restore_tracker_states(get_cuda_rng_tracker(), state["tracker"])
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state(state["cuda"])


def _rng_object(data) -> ShardedObject:
    # Each rank keeps its own streams: dropout and jitter differ per rank by design.
    return ShardedObject("rng_state", data, (dist.get_world_size(),), (dist.get_rank(),), replica_id=0)


def _unwrap(chunk):
    """The model inside the DDP and 16-bit wrappers: checkpoints name parameters without their prefixes."""
    from megatron.core.utils import unwrap_model

    return unwrap_model(chunk)


def _optimizer_metadata(optimizer) -> Optional[dict]:
    """How the distributed optimizer's state is laid out in a checkpoint: 'fully_reshardable' (one
    tensor per parameter and state, as without the distributed optimizer), which loads at any
    TP, PP, EP and DP size; the keys without the chained optimizers' prefixes (as Megatron-LM
    saves). None for other optimizers: their state is already per parameter."""
    from megatron.core.optimizer.distrib_optimizer import DistributedOptimizer

    parts = getattr(optimizer, "chained_optimizers", [optimizer])
    if not any(isinstance(part, DistributedOptimizer) for part in parts):
        return None
    fix_reshardable_offsets()
    share_step_with_empty_parts(optimizer)  # a stage without experts (compat/distopt_empty_step.py)
    return {"distrib_optim_sharding_type": "fully_reshardable", "chained_optim_avoid_prefix": True,
            "singleton_local_shards": False}


def _state_dict(model_chunks, optimizer, scheduler, progress: Progress, rng, is_loading: bool) -> dict:
    model_sd = {}
    for i, chunk in enumerate(model_chunks):
        key = "model" if len(model_chunks) == 1 else f"model{i}"
        model_sd[key] = _unwrap(chunk).sharded_state_dict()
    state = dict(model_sd)
    if optimizer is not None:
        flat = model_sd["model"] if len(model_chunks) == 1 else model_sd
        metadata = _optimizer_metadata(optimizer)
        extra = {} if metadata is None else {"metadata": metadata}
        state["optimizer"] = optimizer.sharded_state_dict(flat, is_loading=is_loading, **extra)
    if scheduler is not None:
        state["scheduler"] = scheduler.state_dict()
    state["progress"] = vars(progress).copy()
    if rng is not None:
        state["rng_state"] = _rng_object(rng)
    return state


def _rank0_progress(progress: Progress) -> Progress:
    """Rank 0's progress: each rank times its own steps, and megatron-core warns of a common state
    that differs between ranks (train_time_s) on every save."""
    if dist.get_world_size() == 1:
        return progress
    shared = [vars(progress).copy()]
    dist.broadcast_object_list(shared, src=0)
    return Progress(**shared[0])


def save_checkpoint(root: Path, model_chunks: List, optimizer, scheduler, progress: Progress, keep_last: int) -> Path:
    root = Path(root)
    final = checkpoint_dir(root, progress.iteration)
    staging = final.with_name(final.name + ".tmp")
    try:
        if dist.get_rank() == 0:
            root.mkdir(parents=True, exist_ok=True)
            for stale in root.glob("iter_*.tmp"):  # left by a save that was killed
                shutil.rmtree(stale, ignore_errors=True)
            staging.mkdir()
        barrier()
        state = _state_dict(model_chunks, optimizer, scheduler, _rank0_progress(progress), _rng_state(),
                            is_loading=False)
        dist_checkpointing.save(state, str(staging), sharded_strategy=InProcessSaveStrategy())
        barrier()
        if dist.get_rank() == 0:
            if final.exists():
                shutil.rmtree(final)
            os.replace(staging, final)
            marker_tmp = root / (LATEST + ".tmp")
            marker_tmp.write_text(str(progress.iteration))
            os.replace(marker_tmp, root / LATEST)
    except BaseException as err:  # torch's CheckpointException is a BaseException
        reason = write_failure(err)
        if reason is None:
            if isinstance(err, KeyboardInterrupt) and dist.get_rank() == 0:
                # a second Ctrl-C stops the save: its staging directory (the size of a checkpoint) goes
                shutil.rmtree(staging, ignore_errors=True)
            raise
        if dist.get_rank() == 0:
            shutil.rmtree(staging, ignore_errors=True)  # frees what the failed save took
            with contextlib.suppress(OSError):  # a read-only folder refuses this too; the error below says why
                (root / (LATEST + ".tmp")).unlink(missing_ok=True)
        kept = latest_iteration(root) if root.is_dir() else None
        kept_text = (f"{checkpoint_dir(root, kept)} stays latest" if kept is not None
                     else "there is no earlier checkpoint")
        raise CheckpointError(
            f"cannot save the checkpoint of step {progress.iteration} to {staging}: {reason} "
            f"({free_space(root)} free there); {kept_text}; make room (or fix the permissions), then "
            f"continue with: {resume_command(root.parent)}") from err
    if dist.get_rank() == 0:
        prune_checkpoints(root, keep_last, keep=progress.iteration)
    barrier()
    return final


def prune_checkpoints(root: Path, keep_last: int, keep: int) -> List[Path]:
    """Delete the checkpoints older than the newest `keep_last` (0 keeps all), never iteration
    `keep`; returns the deleted directories, oldest first."""
    if keep_last <= 0:
        return []
    done = sorted(p for p in Path(root).glob("iter_*") if p.is_dir() and not p.name.endswith(".tmp"))
    deleted = [old for old in done[:-keep_last] if old != checkpoint_dir(root, keep)]
    for old in deleted:
        shutil.rmtree(old, ignore_errors=True)
    return deleted


@contextlib.contextmanager
def _quiet_loading():
    """torch's and megatron-core's deprecation notices about their own internals (load_state_dict,
    ShardedTensor) on every load, and torch's notes when megatron-core 0.19 reads a checkpoint's
    common state through torch.distributed.checkpoint in one process: nothing a user can act on."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", FutureWarning)
        warnings.filterwarnings("ignore", message="torch.distributed is disabled, unavailable or uninitialized")
        warnings.filterwarnings("ignore", message="The argument order of load has been changed")
        yield


def load_checkpoint(path: Path, model_chunks: List, optimizer=None, scheduler=None,
                    rng: Optional[bool] = None) -> Progress:
    """Load a checkpoint directory into the model (and optimizer, scheduler when given; the RNG
    states when `rng`, by default with the optimizer, and only at the layout they were saved at)."""
    path = Path(path)
    problem = damage_message(path)  # a file cut off or missing, named with the checkpoint before it
    if problem:
        raise CheckpointError(problem)
    problem = mcore_compat.checkpoint_format_problem(path)  # a newer megatron-core's format
    if problem:
        raise CheckpointError(problem)
    with _quiet_loading():
        common = dist_checkpointing.load_common_state_dict(str(path))
    saved = Progress(**common["progress"])
    same_layout = saved.world_size == dist.get_world_size()
    rng = optimizer is not None if rng is None else rng
    rng_template = _rng_state() if (rng and same_layout) else None
    if optimizer is not None:
        from megatron_dmoe.training.optim import init_empty_adam_states

        init_empty_adam_states(optimizer)
    saved_distributed = saved_with_distributed_optimizer(common.get("optimizer"))
    # the distributed optimizer switched on or off since the save: its state is read separately
    switched = optimizer is not None and saved_distributed != (_optimizer_metadata(optimizer) is not None)
    template = _state_dict(model_chunks, None if switched else optimizer, scheduler, saved, rng_template,
                           is_loading=True)
    try:
        with _quiet_loading():
            loaded = dist_checkpointing.load(template, str(path))
    except (CheckpointingException, CheckpointException) as err:
        # torch's CheckpointException wraps megatron's, whose first line says what differs
        cause = next((e for e in causes(err) if isinstance(e, CheckpointingException)), err)
        first_line = (str(cause).strip() or type(cause).__name__).splitlines()[0]
        raise CheckpointError(f"cannot load {path} into this model: {first_line}; resume with the "
                              "configuration the run was saved with (its config.yaml)") from err
    for i, chunk in enumerate(model_chunks):
        _unwrap(chunk).load_state_dict(loaded["model" if len(model_chunks) == 1 else f"model{i}"])
    if switched:
        load_switched_optimizer_state(path, model_chunks, [_unwrap(c).sharded_state_dict() for c in model_chunks],
                                      optimizer, saved_distributed, common["optimizer"])
    elif optimizer is not None:
        from megatron_dmoe.training.optim import unshare_adam_steps

        optimizer.load_state_dict(loaded["optimizer"])
        unshare_adam_steps(optimizer)
    if scheduler is not None:
        scheduler.load_state_dict(loaded["scheduler"])
    if rng_template is not None:
        _set_rng_state(loaded["rng_state"])
    return saved
