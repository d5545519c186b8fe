"""The run directory: resolved config, checkpoints, metrics, TensorBoard events, plots."""
from __future__ import annotations

import importlib.metadata
import platform
import time
from pathlib import Path
from typing import Optional

import torch.distributed as dist

CONFIG_FILE = "config.yaml"
CHECKPOINTS = "checkpoints"


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
