"""Run a sweep's runs on this machine, each as `dmoe-train --run-dir DIR --resume`: one after
another, or up to N at once on GPUs of their own (`dmoe-sweep --concurrent N`).

Runs already finished are skipped and interrupted ones continue from their last checkpoint, so a
sweep that was stopped continues where it was when started again. Each run's output goes to the
terminal (with several at once, each line prefixed with the run's name) and, unprefixed, to
RUN_DIR/train.log. A SIGTERM to the sweep is passed on to every running training process (each
saves a checkpoint and stops), no further run is started, and the sweep waits for them to end.
"""
from __future__ import annotations

import os
import queue
import signal
import subprocess
import sys
import threading
from dataclasses import dataclass
from pathlib import Path
from typing import Dict, List, Optional, TextIO

# imported here, not in the signal handler: a second SIGTERM during that import would find the
# module half made
import psutil

from .gpu_slots import gpu_count, slot_devices
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
                out: Optional[TextIO] = None, concurrent: int = 1,
                device_count: Optional[int] = None) -> List[LocalResult]:
    """Train the runs in order, up to ``concurrent`` at once; a run starts in the first slot that
    is free. ``device_count``: the GPUs to share out (None: those torch sees). Raises ValueError
    before starting anything when the slots need more GPUs than there are."""
    if device_count is None:
        device_count = gpu_count() if concurrent > 1 else 0
    devices = slot_devices(concurrent, nproc_per_node, device_count,
                           os.environ.get("CUDA_VISIBLE_DEVICES"))
    printer = _Printer(out or sys.stdout)
    under_torchrun = nproc_per_node > 1
    codes: Dict[int, Optional[int]] = {}  # planned index -> exit status; absent: not started
    skipped = set()
    running: Dict[int, "_Child"] = {}  # slot -> its training
    free = list(range(concurrent))
    ended: "queue.Queue[_Ended]" = queue.Queue()
    stop = []  # the signal (or the output error) that stops the sweep
    errors: List[BaseException] = []

    def on_term(signum, frame):
        stop.append(signum)
        for child in list(running.values()):
            child.stop(under_torchrun)

    def wait_for_one():
        done = ended.get()  # a signal handler still runs while this waits
        child = running.pop(done.slot)
        child.reader.join()
        free.append(done.slot)
        free.sort()
        codes[child.index] = done.returncode
        head = child.head
        if done.error is not None:
            errors.append(done.error)
            stop.append(None)
        if done.returncode != 0:
            printer.line(f"{head}: failed with exit status {done.returncode}; its output is in "
                         f"{child.run.run_dir / LOG_FILE}")
        elif concurrent > 1:  # with several at once, say which one ended
            printer.line(f"{head}: ended (exit status 0)")

    previous = signal.signal(signal.SIGTERM, on_term)
    try:
        for index, run in enumerate(planned):
            if not free:
                wait_for_one()
            if stop:
                break
            head = f"[{index + 1}/{len(planned)}] {run.point.name}"
            status = run_status(run.run_dir)
            if status.finished:
                printer.line(f"{head}: {status.describe()} earlier, skipped")
                skipped.add(index)
                continue
            printer.line(f"{head}: training in {run.run_dir}")
            slot = free.pop(0)
            prefix = f"[{run.point.name}] " if concurrent > 1 else ""
            running[slot] = _start(index, run, head, slot, nproc_per_node, devices[slot], prefix,
                                   printer, ended)
            if stop:  # the signal came while it was starting: it missed this one
                running[slot].stop(under_torchrun)
        while running:
            wait_for_one()
    finally:
        signal.signal(signal.SIGTERM, previous)
    if errors:
        raise errors[0]
    return [LocalResult(run, codes.get(i), skipped=i in skipped) for i, run in enumerate(planned)]


def stop_training(proc: subprocess.Popen, under_torchrun: bool) -> None:
    """SIGTERM to the training processes: the child itself, or torchrun's children. torchrun would
    pass a SIGTERM on to their whole process groups, data-loader workers included, which can
    break the checkpoint they save on the way out."""
    targets = [proc.pid]
    if under_torchrun:
        try:
            targets = [c.pid for c in psutil.Process(proc.pid).children()] or targets
        except psutil.NoSuchProcess:
            return
    for pid in targets:
        try:
            os.kill(pid, signal.SIGTERM)
        except ProcessLookupError:
            pass


class _Printer:
    """Whole lines to the terminal, one writer at a time (the children's readers and the sweep)."""

    def __init__(self, out: TextIO):
        self.out = out
        self.lock = threading.Lock()

    def line(self, text: str) -> None:
        with self.lock:
            self.out.write(text if text.endswith("\n") else text + "\n")
            self.out.flush()


@dataclass
class _Child:
    index: int
    run: PlannedRun
    head: str
    proc: subprocess.Popen
    reader: threading.Thread
    stopped: bool = False

    def stop(self, under_torchrun: bool) -> None:
        """Tell the training to save and stop, once: a second SIGTERM could reach it after its
        own handler is gone, while it exits, and kill it."""
        if not self.stopped and self.proc.poll() is None:
            self.stopped = True
            stop_training(self.proc, under_torchrun)


@dataclass(frozen=True)
class _Ended:
    slot: int
    returncode: int
    error: Optional[BaseException]  # writing its output failed


def _start(index: int, run: PlannedRun, head: str, slot: int, nproc_per_node: int,
           devices: Optional[str], prefix: str, printer: _Printer, ended: queue.Queue) -> _Child:
    env = dict(os.environ, PYTHONUNBUFFERED="1")
    if devices is not None:
        env["CUDA_VISIBLE_DEVICES"] = devices
    run.run_dir.mkdir(parents=True, exist_ok=True)
    log = open(run.run_dir / LOG_FILE, "a", encoding="utf-8")
    try:
        proc = subprocess.Popen(train_command(run.run_dir, nproc_per_node), stdout=subprocess.PIPE,
                                stderr=subprocess.STDOUT, text=True, errors="replace", env=env)
    except BaseException:
        log.close()
        raise
    # not a daemon: after a Ctrl-C (which the children get too) the sweep exits only once their
    # output, written while they save, has been copied
    reader = threading.Thread(target=_copy_output, args=(proc, log, prefix, printer, slot, ended),
                              name=f"output of {run.point.name}")
    reader.start()
    return _Child(index, run, head, proc, reader)


def _copy_output(proc: subprocess.Popen, log: TextIO, prefix: str, printer: _Printer, slot: int,
                 ended: queue.Queue) -> None:
    error = None
    try:
        with log:
            for line in proc.stdout:
                printer.line(prefix + line)
                log.write(line)
    except BaseException as err:  # reported by the sweep, which stops starting runs
        error = err
    finally:
        proc.stdout.close()  # a reader that failed must not leave its child blocked on a full pipe
        ended.put(_Ended(slot, proc.wait(), error))
