"""Run a sweep's runs one after another on this machine, each as `dmoe-train --run-dir DIR --resume`.

Runs already finished are skipped and interrupted ones continue from their last checkpoint, so a
sweep that was stopped continues where it was when started again. Each run's output goes to the
terminal and to RUN_DIR/train.log. A SIGTERM to the sweep is passed on to the running training
processes (which save a checkpoint and stop) and no further run is started.
"""
from __future__ import annotations

import os
import signal
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import List, Optional, TextIO

from .runs import PlannedRun
from .status import run_status

LOG_FILE = "train.log"


@dataclass(frozen=True)
class LocalResult:
    run: PlannedRun
    returncode: Optional[int]  # None: skipped (finished earlier) or not started (sweep stopped)
    skipped: bool = False

    @property
    def failed(self) -> bool:
        return self.returncode not in (None, 0)


def train_command(run_dir: Path, nproc_per_node: int = 1) -> List[str]:
    """dmoe-train on the run directory's own config.yaml, continuing from its checkpoints."""
    tail = ["-m", "megatron_dmoe", "--run-dir", str(run_dir), "--resume"]
    if nproc_per_node == 1:
        return [sys.executable] + tail
    return [sys.executable, "-m", "torch.distributed.run", "--standalone",
            f"--nproc_per_node={nproc_per_node}"] + tail


def run_locally(planned: List[PlannedRun], nproc_per_node: int = 1,
                out: Optional[TextIO] = None) -> List[LocalResult]:
    out = out or sys.stdout
    results: List[LocalResult] = []
    child: List[subprocess.Popen] = []  # the running training, for the signal handler
    stop = []

    def on_term(signum, frame):
        stop.append(signum)
        if child and child[0].poll() is None:
            stop_training(child[0], under_torchrun=nproc_per_node > 1)

    previous = signal.signal(signal.SIGTERM, on_term)
    try:
        for number, run in enumerate(planned, start=1):
            head = f"[{number}/{len(planned)}] {run.point.name}"
            if stop:
                results.append(LocalResult(run, None))
                continue
            status = run_status(run.run_dir)
            if status.finished:
                print(f"{head}: {status.describe()} earlier, skipped", file=out, flush=True)
                results.append(LocalResult(run, None, skipped=True))
                continue
            print(f"{head}: training in {run.run_dir}", file=out, flush=True)
            code = _run_one(train_command(run.run_dir, nproc_per_node), run.run_dir, child, out)
            child.clear()
            results.append(LocalResult(run, code))
            if code != 0:
                print(f"{head}: failed with exit status {code}; its output is in "
                      f"{run.run_dir / LOG_FILE}", file=out, flush=True)
    finally:
        signal.signal(signal.SIGTERM, previous)
    return results


def stop_training(proc: subprocess.Popen, under_torchrun: bool) -> None:
    """SIGTERM to the training processes: the child itself, or torchrun's children. torchrun would
    pass a SIGTERM on to their whole process groups, data-loader workers included, which can
    break the checkpoint they save on the way out."""
    targets = [proc.pid]
    if under_torchrun:
        import psutil

        try:
            targets = [c.pid for c in psutil.Process(proc.pid).children()] or targets
        except psutil.NoSuchProcess:
            return
    for pid in targets:
        try:
            os.kill(pid, signal.SIGTERM)
        except ProcessLookupError:
            pass


def _run_one(command: List[str], run_dir: Path, child: list, out: TextIO) -> int:
    env = dict(os.environ, PYTHONUNBUFFERED="1")
    run_dir.mkdir(parents=True, exist_ok=True)
    with open(run_dir / LOG_FILE, "a", encoding="utf-8") as log:
        proc = subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                                errors="replace", env=env)
        child.append(proc)
        for line in proc.stdout:
            out.write(line)
            out.flush()
            log.write(line)
        return proc.wait()
