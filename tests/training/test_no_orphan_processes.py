"""No process outlives a run, however it ends: kill -9 during a checkpoint save included.

megatron-core's checkpoint writer starts helper processes (a multiprocessing Manager and its
resource tracker, forked writers) that nothing ties to the training process; the run saves in
process instead (training/checkpoint_writer.py).

The training command runs with dist_checkpointing.save wrapped: the second save, its files written
to the staging folder but neither renamed nor marked latest, touches a file and waits there, so the
kill lands inside a save every time. Each wait below ends as soon as its condition holds; its
deadline only ends a hang.
"""
import os
import signal
import subprocess
import sys
import time

import psutil

from train_helpers import small_args

# dmoe-train, its second checkpoint save held once written (megatron_dmoe first: it decides how
# megatron-core's fusions load, compat/eager_fusions.py)
PAUSED_IN_A_SAVE = """
import pathlib, sys, threading
import megatron_dmoe
from megatron.core import dist_checkpointing
from megatron_dmoe.cli import main

marker = pathlib.Path(sys.argv.pop(1))
real_save, saves = dist_checkpointing.save, []

def save_then_wait(*args, **kwargs):
    result = real_save(*args, **kwargs)
    saves.append(None)
    if len(saves) == 2:
        marker.touch()
        threading.Event().wait()  # until killed
    return result

dist_checkpointing.save = save_then_wait
sys.argv[0] = "dmoe-train"
main()
"""
HANG = 300  # s: a deadline only a hung run reaches


def _alive(processes):
    alive = []
    for p in processes:
        try:
            if p.is_running() and p.status() != psutil.STATUS_ZOMBIE:
                alive.append(p)
        except psutil.NoSuchProcess:
            pass
    return alive


def test_kill_9_during_a_save_leaves_no_process_behind(cli_run, tmp_path, corpus_cache):
    run, marker = tmp_path / "run", tmp_path / "in-second-save"
    command = [sys.executable, "-c", PAUSED_IN_A_SAVE, str(marker),
               *small_args(corpus_cache, 3, "checkpoint.save_interval=1"), "--run-dir", str(run)]
    log = (tmp_path / "train.log").open("w")
    proc = subprocess.Popen(command, stdout=log, stderr=subprocess.STDOUT,
                            env=dict(os.environ, PYTHONUNBUFFERED="1"), start_new_session=True)
    trainer = psutil.Process(proc.pid)
    checkpoints = run / "checkpoints"
    seen = set()
    try:
        deadline = time.monotonic() + HANG
        while not marker.exists():
            assert proc.poll() is None, ("training ended before its second save",
                                         (tmp_path / "train.log").read_text()[-3000:])
            assert time.monotonic() < deadline, f"no second save within {HANG} s"
            seen.update(trainer.children(recursive=True))
            time.sleep(0.05)
        seen.update(trainer.children(recursive=True))
        assert int((checkpoints / "latest").read_text()) == 1 and list(checkpoints.glob("iter_*.tmp"))
        os.kill(proc.pid, signal.SIGKILL)
        proc.wait(timeout=HANG)
        # data-loader workers poll for their parent every 5 s (torch's MP_STATUS_CHECK_INTERVAL)
        deadline = time.monotonic() + HANG
        while _alive(seen) and time.monotonic() < deadline:
            time.sleep(0.2)
        left = [(p.pid, " ".join(p.cmdline())[:200]) for p in _alive(seen)]
        assert not left, f"still running {HANG} s after the trainer was killed: {left}"
    finally:
        log.close()
        for p in _alive(seen | {trainer}):
            p.kill()
    # nothing lost: the newest complete checkpoint is still `latest`, and the run resumes from it
    latest = int((checkpoints / "latest").read_text())
    resumed = cli_run(run, f"training.train_iters={latest + 1}", "--resume")
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    assert f"resumed from {checkpoints / f'iter_{latest:07d}'}" in resumed.stdout
    assert not list(checkpoints.glob("*.tmp"))  # the killed save's staging is cleared by the next save
