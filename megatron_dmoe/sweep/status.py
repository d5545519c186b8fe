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
from megatron_dmoe.training.metrics_log import METRICS_FILE, read_metrics

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
    time_limit_minutes: Optional[float] = None  # training.time_limit_minutes
    train_time_s: Optional[float] = None  # the last metrics record's training time

    @property
    def out_of_time(self) -> bool:
        """Stopped by training.time_limit_minutes, with its checkpoint at that step when it saves."""
        if self.time_limit_minutes is None or self.train_time_s is None or self.logged_step is None:
            return False
        saved = not self.saves_checkpoints or (self.checkpoint_step or 0) >= self.logged_step
        return saved and self.train_time_s >= self.time_limit_minutes * 60

    @property
    def finished(self) -> bool:
        """Training reached train_iters (or its time limit), and its final checkpoint is complete
        when it saves any."""
        if self.train_iters is None:
            return False
        done = self.checkpoint_step if self.saves_checkpoints else self.logged_step
        return (done is not None and done >= self.train_iters) or self.out_of_time

    def describe(self) -> str:
        if self.train_iters is None:
            return "not started (no config.yaml)"
        if self.out_of_time and (self.logged_step or 0) < self.train_iters:
            return (f"finished (training.time_limit_minutes={self.time_limit_minutes} at step "
                    f"{self.logged_step} of {self.train_iters})")
        if self.finished:
            return f"finished ({self.train_iters} steps)"
        step = max(self.checkpoint_step or 0, self.logged_step or 0)
        return f"step {step} of {self.train_iters}"


def run_status(run_dir) -> RunStatus:
    run_dir = Path(run_dir)
    train_iters, saves, limit = None, True, None
    if (run_dir / CONFIG_FILE).is_file():
        try:
            cfg = load_config(str(run_dir / CONFIG_FILE))
        except ConfigError:
            pass  # unreadable: treated as not started; training itself will report the problem
        else:
            train_iters, saves = cfg.training.train_iters, cfg.checkpoint.save_interval != 0
            limit = cfg.training.time_limit_minutes
    last = last_record(run_dir)
    train_time = last.get("train_time_s") if last else None
    return RunStatus(run_dir=run_dir, train_iters=train_iters, saves_checkpoints=saves,
                     checkpoint_step=checkpoint_step(run_dir),
                     logged_step=last["step"] if last else None, time_limit_minutes=limit,
                     train_time_s=train_time if isinstance(train_time, (int, float)) else None)


def checkpoint_step(run_dir: Path) -> Optional[int]:
    marker = Path(run_dir) / CHECKPOINTS / LATEST
    try:
        text = marker.read_text().strip()
    except OSError:
        return None
    return int(text) if text.isdigit() else None


def last_record(run_dir: Path) -> Optional[dict]:
    if not (Path(run_dir) / METRICS_FILE).is_file():
        return None
    try:
        records = read_metrics(run_dir)
    except ValueError:
        return None
    return records[-1] if records else None


def logged_step(run_dir: Path) -> Optional[int]:
    last = last_record(run_dir)
    return last["step"] if last else None


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
