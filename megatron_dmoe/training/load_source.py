"""checkpoint.load (Megatron-LM's --load): the checkpoint it names, and what a run takes from it."""
from __future__ import annotations

from pathlib import Path
from typing import List, Tuple

from megatron_dmoe.config import RunConfig
from megatron_dmoe.training.checkpoint import (
    LATEST,
    CheckpointError,
    Progress,
    checkpoint_dir,
    latest_iteration,
    load_checkpoint,
)
from megatron_dmoe.training.run_dir import CHECKPOINTS


def named_checkpoint(source, key: str, whose: str = "the run") -> Path:
    """The checkpoint directory `source` names: a run directory, its checkpoints/ folder (newest
    complete checkpoint), or one iter_N checkpoint; a CheckpointError naming `key` otherwise."""
    source = Path(source)
    if (source / "metadata.json").exists():
        return source
    for root in (source / CHECKPOINTS, source):
        if (root / LATEST).exists():
            return checkpoint_dir(root, latest_iteration(root))
    raise CheckpointError(
        f"{key}={str(source)!r} holds no checkpoint (no {CHECKPOINTS}/{LATEST} marker, no {LATEST} marker, no "
        f"metadata.json); give {whose}'s directory, its {CHECKPOINTS} folder or one iter_N checkpoint")


def load_start(cfg: RunConfig, model: List, optimizer, scheduler, world_size: int) -> Tuple[Progress, Path]:
    """A new run started from checkpoint.load, as Megatron-LM's --load: the weights; with
    checkpoint.finetune only them, from step 0; else also the schedule, the optimizer state (unless
    checkpoint.load_optim is false), the RNG states (unless checkpoint.load_rng is false)
    and the step with the data position. Returns the progress and the checkpoint read."""
    ck = cfg.checkpoint
    path = named_checkpoint(ck.load, "checkpoint.load")
    if ck.finetune:
        load_checkpoint(path, model)
        return Progress(world_size=world_size), path
    # the schedule follows the loaded step either way
    progress = load_checkpoint(path, model, optimizer if ck.load_optim else None, scheduler, rng=ck.load_rng)
    progress.world_size = world_size
    return progress, path
