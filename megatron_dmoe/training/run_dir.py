"""The run directory: resolved config, checkpoints, metrics, TensorBoard events, plots."""
from __future__ import annotations

import importlib.metadata
import platform
import shutil
import time
from pathlib import Path
from typing import List, Optional

import torch.distributed as dist

from megatron_dmoe.training.metrics import METRICS_FILE, TENSORBOARD_DIR

CONFIG_FILE = "config.yaml"
CHECKPOINTS = "checkpoints"
# Everything a run writes into its directory; a directory holding any of them belongs to a run
# and is not reused without --resume or --overwrite.
RUN_FILES = (CONFIG_FILE, CHECKPOINTS, METRICS_FILE, TENSORBOARD_DIR, "loss.png", "expert_load.png")


def software_versions() -> dict:
    versions = {"python": platform.python_version()}
    for dist_name in ("torch", "megatron-core", "triton", "megatron-dmoe", "transformer-engine", "apex"):
        try:
            versions[dist_name] = importlib.metadata.version(dist_name)
        except importlib.metadata.PackageNotFoundError:
            pass
    return versions


def default_run_dir(config_name: str) -> Path:
    """runs/<config>-<timestamp>, the same on every rank (rank 0's clock decides)."""
    name = [f"runs/{Path(config_name).stem}-{time.strftime('%Y%m%d-%H%M%S')}"]
    if dist.is_initialized():
        dist.broadcast_object_list(name, src=0)
    return Path(name[0])


def checkpoint_root(run_dir: Path) -> Path:
    return Path(run_dir) / CHECKPOINTS


def has_checkpoints(run_dir: Optional[Path]) -> bool:
    return run_dir is not None and (checkpoint_root(run_dir) / "latest").exists()


def previous_run_files(run_dir: Optional[Path]) -> List[str]:
    """The names of a previous run's files present in ``run_dir`` (empty when there are none)."""
    if run_dir is None or not Path(run_dir).is_dir():
        return []
    return [name for name in RUN_FILES if (Path(run_dir) / name).exists()]


def remove_run_files(run_dir: Path) -> None:
    """Delete a previous run's files (for --overwrite); other files in the directory stay."""
    for name in previous_run_files(run_dir):
        path = Path(run_dir) / name
        if path.is_dir() and not path.is_symlink():
            shutil.rmtree(path)
        else:
            path.unlink()
