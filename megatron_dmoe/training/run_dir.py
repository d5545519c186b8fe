"""The run directory: what a run writes there (resolved config, checkpoints, metrics,
TensorBoard events, plots), whether a run may write or reuse it, and whether a resume's requested
config fits the checkpoints saved in it.

A checkpoint fixes the shapes of every weight and of the optimizer state, and megatron-core's
learning-rate scheduler refuses a checkpoint whose schedule differs. Comparing the run's saved,
resolved config.yaml with the requested one before a resume builds anything finds such a mismatch
in a second and names the key, instead of a shape-mismatch traceback after the model is built.
"""
from __future__ import annotations

import importlib.metadata
import os
import platform
import shutil
import time
import warnings
from pathlib import Path
from typing import Any, List, Optional, Tuple

import torch.distributed as dist

from megatron_dmoe.config import ConfigWarning, RunConfig, config_to_dict, load_config, resolve, save_config
from megatron_dmoe.config.resolve import DERIVED_FROM
from megatron_dmoe.training.metrics_log import METRICS_FILE, TENSORBOARD_DIR
from megatron_dmoe.training.write_errors import write_failure

CONFIG_FILE = "config.yaml"
CHECKPOINTS = "checkpoints"
# Everything a run writes into its directory; a directory holding any of them belongs to a run
# and is not reused without --resume or --overwrite.
WANDB_DIR = "wandb"  # W&B's local files unless logging.wandb_save_dir names another folder
RUN_FILES = (CONFIG_FILE, CHECKPOINTS, METRICS_FILE, TENSORBOARD_DIR, "loss.png", "expert_load.png", WANDB_DIR)


class RunDirError(RuntimeError):
    """The run directory cannot be written; the message is one line naming the path."""


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


def unstarted_run_note(run_dir: Optional[Path]) -> Optional[str]:
    """For a run directory whose previous run stopped before its first step (its config.yaml
    written, no checkpoint, no step in metrics.jsonl: refused memory, a failed first step): the
    line saying a new run takes its place; None for any other directory. Such a run left nothing to
    continue, so it needs neither --resume nor --overwrite."""
    files = previous_run_files(run_dir)
    checkpoints = checkpoint_root(run_dir) if files else None
    if not files or (checkpoints.is_dir() and any(checkpoints.iterdir())) or checkpoints.is_file():
        return None
    metrics = Path(run_dir) / METRICS_FILE
    try:
        if metrics.is_file() and metrics.read_text(encoding="utf-8").strip():
            return None
    except (OSError, UnicodeDecodeError):
        return None
    return f"{run_dir} holds a run that stopped before its first step ({', '.join(files)}): this run replaces it"


def remove_run_files(run_dir: Path) -> None:
    """Delete a previous run's files (for --overwrite); other files in the directory stay."""
    for name in previous_run_files(run_dir):
        path = Path(run_dir) / name
        if path.is_dir() and not path.is_symlink():
            shutil.rmtree(path)
        else:
            path.unlink()


def _why_unwritable(path: Path) -> str:
    try:
        read_only = bool(os.statvfs(path).f_flag & os.ST_RDONLY)
    except OSError:
        read_only = False
    return "a read-only file system" if read_only else "no write permission"


def unwritable_run_dir(run_dir: Path) -> Optional[str]:
    """Why a run cannot write into ``run_dir`` (None when it can); reads, never writes.

    Checked before anything is built: the run directory (or, when it does not exist yet, the
    nearest existing folder above it, where it will be created) and its checkpoints/ folder.
    """
    run_dir = Path(run_dir)
    places = [p for p in (run_dir, checkpoint_root(run_dir)) if p.is_dir()]
    if not places:
        parent = run_dir.absolute().parent
        while not parent.exists() and parent != parent.parent:
            parent = parent.parent
        places = [parent]
    for place in places:
        # access() answers for the caller (root included) and reports a read-only mount
        if not os.access(place, os.W_OK | os.X_OK):
            what = "its checkpoints" if place.name == CHECKPOINTS and place.parent == run_dir else (
                "the run directory" if place == run_dir else "the folder to create the run directory in")
            return (f"cannot write to {place} ({what}): {_why_unwritable(place)}; make it writable "
                    "or choose another --run-dir")
    return None


def write_run_config(cfg: RunConfig, run_dir: Path, overwrite: bool, versions: dict) -> None:
    """Create the run directory (deleting a previous run's files for --overwrite) and write the
    resolved config into it; a refused write raises RunDirError (one line) instead of OSError."""
    try:
        if overwrite:
            remove_run_files(run_dir)
        run_dir.mkdir(parents=True, exist_ok=True)
        save_config(cfg, run_dir / CONFIG_FILE, versions=versions)
    except OSError as err:
        reason = write_failure(err) or (err.strerror or str(err))
        raise RunDirError(f"cannot write the run directory {run_dir}: {reason} "
                          f"({err.filename or run_dir}); make it writable or choose another "
                          "--run-dir") from err


# Keys that may differ on resume: how long to train, how to evaluate, log and checkpoint, how the
# work is laid out (dist_checkpointing reshards) and which kernels compute the same model.
MAY_CHANGE_SECTIONS = ("parallel", "checkpoint", "logging")
MAY_CHANGE = {
    "model.hidden_dropout", "model.attention_dropout", "model.init_method_std",
    "model.cross_entropy_loss_fusion", "model.cross_entropy_fusion_impl",
    "moe.backend", "moe.block_size", "moe.memory_optimized", "moe.expert_wgrad_per_step",
    "moe.expert_wgrad_window",
    "moe.ep_exchange", "moe.aux_loss_coeff", "moe.z_loss_coeff", "moe.router_bias_update_rate",
    "moe.input_jitter_eps", "moe.router_force_load_balancing",
    "training.train_iters", "training.time_limit_minutes", "training.micro_batch_size", "training.eval_interval",
    "training.eval_iters", "training.recompute_granularity", "training.cuda_graphs",
    "training.device", "training.clip_grad", "training.adam_beta1", "training.adam_beta2",
    "training.adam_eps", "training.loss_scale", "training.initial_loss_scale", "training.use_distributed_optimizer",
    "training.memory_check", "data.cache_dir", "data.num_workers",
}

# What a run saved without data (its own tokenizer, no data.data_path: dmoe-import's) is given at
# its first resume; its checkpoint has read no data yet
DATA_GIVEN_LATER = {"data.data_path", "data.valid_data_path", "data.split"}

Mismatch = Tuple[str, Any, Any]  # (dotted key, saved value, requested value)


def _differences(saved: RunConfig, requested: RunConfig) -> List[Mismatch]:
    old, new = config_to_dict(saved), config_to_dict(requested)
    return [(f"{section}.{key}", value, new[section][key]) for section, values in old.items()
            for key, value in values.items() if new[section][key] != value]


def _follows_its_sources(dotted: str, saved: RunConfig, requested: RunConfig) -> bool:
    """Set by neither run: derived from other keys (the learning rate's decay length from
    training.train_iters), it follows their new values."""
    return dotted in saved.derived and dotted in requested.derived


def resume_mismatches(saved: RunConfig, requested: RunConfig) -> List[Mismatch]:
    """Keys the run's checkpoints depend on whose values differ; both configs resolved."""
    without_data = not saved.data.data_path and bool(saved.data.tokenizer_type or saved.data.tokenizer_model)
    return [(dotted, old, new) for dotted, old, new in _differences(saved, requested)
            if dotted.split(".")[0] not in MAY_CHANGE_SECTIONS and dotted not in MAY_CHANGE
            and not (without_data and dotted in DATA_GIVEN_LATER)
            and not _follows_its_sources(dotted, saved, requested)]


def resume_notes(run_dir: Optional[Path], requested: RunConfig) -> List[str]:
    """For a resume: one line naming the keys the run never set that change with the keys they
    follow (the learning rate's decay length with training.train_iters); [] when none do. Where the
    learning rate then jumps back up at the resumed step, a ConfigWarning says so."""
    saved_path = Path(run_dir) / CONFIG_FILE if run_dir is not None else None
    if saved_path is None or not has_checkpoints(run_dir) or not saved_path.is_file():
        return []
    saved = resolve(load_config(str(saved_path)))
    changed = [(dotted, old, new) for dotted, old, new in _differences(saved, requested)
               if _follows_its_sources(dotted, saved, requested)]
    if not changed:
        return []
    from megatron_dmoe.training.checkpoint import latest_iteration
    from megatron_dmoe.training.schedule_extension import lr_jump_warning

    jump = lr_jump_warning(saved, requested, latest_iteration(checkpoint_root(run_dir)) or 0)
    if jump:
        warnings.warn(ConfigWarning("training.train_iters", jump), stacklevel=2)
    what = "; ".join(f"{dotted} {old} -> {new} (follows {', '.join(DERIVED_FROM[dotted])})"
                     for dotted, old, new in changed)
    return [f"resuming with {what}; set a key to keep its saved value"]


def mismatch_message(run_dir, mismatches: List[Mismatch]) -> str:
    """One line: what differs, and what to do."""
    differences = "; ".join(f"{key} was {saved!r}, now {requested!r}" for key, saved, requested in mismatches)
    return (f"cannot resume {run_dir}: its checkpoints were saved with a different configuration "
            f"({differences}); drop those overrides to continue the run (its config.yaml has the saved "
            f"values), or start a new run with another --run-dir")
