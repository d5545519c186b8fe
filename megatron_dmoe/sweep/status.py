"""How far a run directory has come: is there anything left to train?

Reads only files (config.yaml, checkpoints/latest, metrics.jsonl): no torch, no process groups, so
launchers can ask cheaply. As a program it answers through its exit status:

    python -m megatron_dmoe.sweep.status RUN_DIR    # 0: finished, 1: not finished, 2: error
"""
from __future__ import annotations

import argparse
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import List, Optional

from megatron_dmoe.config import ConfigError, load_config
from megatron_dmoe.training.metrics import METRICS_FILE, read_metrics

# The run directory's layout as training writes it (training.run_dir.CONFIG_FILE and CHECKPOINTS,
# training.checkpoint.LATEST); kept here so that reading it does not import torch.
CONFIG_FILE = "config.yaml"
CHECKPOINTS = "checkpoints"
LATEST = "latest"


@dataclass(frozen=True)
class RunStatus:
    run_dir: Path
    train_iters: Optional[int]  # from config.yaml; None when the run has no readable config yet
    saves_checkpoints: bool  # checkpoint.save_interval != 0
    checkpoint_step: Optional[int]  # the newest complete checkpoint's step
    logged_step: Optional[int]  # the last step in metrics.jsonl

    @property
    def finished(self) -> bool:
        """Training reached train_iters, and its final checkpoint is complete when it saves any."""
        if self.train_iters is None:
            return False
        done = self.checkpoint_step if self.saves_checkpoints else self.logged_step
        return done is not None and done >= self.train_iters

    def describe(self) -> str:
        if self.train_iters is None:
            return "not started (no config.yaml)"
        if self.finished:
            return f"finished ({self.train_iters} steps)"
        step = max(self.checkpoint_step or 0, self.logged_step or 0)
        return f"step {step} of {self.train_iters}"


def run_status(run_dir) -> RunStatus:
    run_dir = Path(run_dir)
    train_iters, saves = None, True
    if (run_dir / CONFIG_FILE).is_file():
        try:
            cfg = load_config(str(run_dir / CONFIG_FILE))
        except ConfigError:
            pass  # unreadable: treated as not started; training itself will report the problem
        else:
            train_iters, saves = cfg.training.train_iters, cfg.checkpoint.save_interval != 0
    return RunStatus(run_dir=run_dir, train_iters=train_iters, saves_checkpoints=saves,
                     checkpoint_step=checkpoint_step(run_dir), logged_step=logged_step(run_dir))


def checkpoint_step(run_dir: Path) -> Optional[int]:
    marker = Path(run_dir) / CHECKPOINTS / LATEST
    try:
        text = marker.read_text().strip()
    except OSError:
        return None
    return int(text) if text.isdigit() else None


def logged_step(run_dir: Path) -> Optional[int]:
    if not (Path(run_dir) / METRICS_FILE).is_file():
        return None
    try:
        records = read_metrics(run_dir)
    except ValueError:
        return None
    return records[-1]["step"] if records else None


def main(argv: Optional[List[str]] = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m megatron_dmoe.sweep.status",
        description="Print how far a run directory has come; exit 0 when its training is "
                    "finished, 1 when not (or not started), 2 on a usage error.")
    parser.add_argument("run_dir", type=Path, metavar="RUN_DIR", help="a dmoe-train run directory")
    ns = parser.parse_args(argv)
    status = run_status(ns.run_dir)
    print(f"{ns.run_dir}: {status.describe()}")
    return 0 if status.finished else 1


if __name__ == "__main__":
    sys.exit(main())
