"""What ends a run before training.train_iters: a stop signal (SIGTERM, Ctrl-C) or
training.time_limit_minutes spent. Every rank gets the same answer, so all ranks stop, evaluate
and save at the same step.

SIGTERM (a scheduler's preemption notice) and Ctrl-C (SIGINT) mean 'save a checkpoint, then exit
cleanly'. A second Ctrl-C aborts at once, without saving. A run file that rank 0 could not write
(metrics.jsonl on a full disk) stops every rank the same way: save, then exit with the reason.
"""
from __future__ import annotations

import os
import signal
import time
from pathlib import Path
from typing import Optional

import torch
import torch.distributed as dist

# Signal -> code shared across ranks (the largest wins, so Ctrl-C on any rank is reported).
STOP_SIGNALS = {signal.SIGTERM: 1, signal.SIGINT: 2}
WRITE_FAILED = "a failed write"  # what should_stop() answers after write_failed()
NAMES = {1: "SIGTERM", 2: "SIGINT", 3: WRITE_FAILED}


def resume_command(run_dir: Path) -> str:
    """The command that continues this run with the layout it runs with now: dmoe-train, with as
    many processes (and nodes) as this run has."""
    world = int(os.environ.get("WORLD_SIZE", 1))
    tail = f"--run-dir {run_dir} --resume"
    if world == 1:
        return f"dmoe-train {tail}"
    per_node = int(os.environ.get("LOCAL_WORLD_SIZE", world))
    if per_node >= world:
        return f"dmoe-train --nproc-per-node {world} {tail}"
    return f"dmoe-train --nnodes {world // per_node} --nproc-per-node {per_node} (and this job's rendezvous) {tail}"


def _tell(text: str) -> None:
    """One line on stderr from a signal handler, on rank 0 only: os.write, as print() may be in the
    middle of writing to the same stream when the signal arrives."""
    if os.environ.get("RANK", "0") == "0":
        os.write(2, f"dmoe-train: {text}\n".encode())


class PreemptionWatcher:
    """Records stop signals; `should_stop()` agrees across ranks so every rank saves at the same step."""

    def __init__(self, device: torch.device, repeat_after: float = 1.0, saves: bool = True):
        self.device = device
        self.saves = saves  # whether a stop saves a checkpoint (not with checkpoint.save_interval 0)
        self.code = 0
        # One Ctrl-C can arrive twice within milliseconds: from the terminal, and forwarded by
        # torchrun to its workers. Only a SIGINT this many seconds after the first one aborts.
        self.repeat_after = repeat_after
        self._first_interrupt: Optional[float] = None
        self._previous = {sig: signal.signal(sig, self._on_signal) for sig in STOP_SIGNALS}

    @property
    def received(self) -> bool:
        return self.code > 0

    def _on_signal(self, signum, frame):
        if signum == signal.SIGINT:
            now = time.monotonic()
            if self._first_interrupt is None:
                self._first_interrupt = now
            elif now - self._first_interrupt >= self.repeat_after:
                raise KeyboardInterrupt  # a second Ctrl-C: the user does not want to wait for the save
        if self.code == 0:  # said at once: a step can take minutes
            if self.saves:
                again = "; Ctrl-C again to stop without saving" if signum == signal.SIGINT else ""
                _tell(f"{signal.Signals(signum).name}: stopping after this step, then saving{again}")
            else:
                _tell(f"{signal.Signals(signum).name}: stopping after this step (checkpoint.save_interval is 0: "
                      "no checkpoint)")
        self.code = max(self.code, STOP_SIGNALS[signum])

    def write_failed(self) -> None:
        """This rank could not write a run file: every rank stops at this step (and saves)."""
        self.code = max(self.code, 3)

    def should_stop(self) -> Optional[str]:
        """The name of the stop signal any rank received, or None to go on."""
        flag = torch.tensor([float(self.code)], device=self.device)
        if dist.is_initialized() and dist.get_world_size() > 1:
            dist.all_reduce(flag, op=dist.ReduceOp.MAX)
        return NAMES.get(int(flag.item()))

    def close(self) -> None:
        for sig, previous in self._previous.items():
            signal.signal(sig, previous)


def time_limit_reached(train_time_s: float, limit_minutes: Optional[float],
                       device: torch.device) -> bool:
    """Whether `train_time_s` seconds of training reach `limit_minutes` (None: no limit).

    Every rank gets the same answer (any rank's clock decides).
    """
    if limit_minutes is None:
        return False
    reached = train_time_s >= limit_minutes * 60
    if not (dist.is_initialized() and dist.get_world_size() > 1):
        return reached
    flag = torch.tensor([1.0 if reached else 0.0], device=device)
    dist.all_reduce(flag, op=dist.ReduceOp.MAX)
    return bool(flag.item())
