"""No process outlives a run, however it ends: kill -9 during a checkpoint save included.

megatron-core's checkpoint writer starts helper processes (a multiprocessing Manager and its
resource tracker, forked writers) that nothing ties to the training process; the run saves in
process instead (training/checkpoint_writer.py).
"""
import os
import signal
import subprocess
import time

import psutil

from train_helpers import small_args, train_command


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
    run = tmp_path / "run"
    proc = subprocess.Popen(train_command(run, *small_args(corpus_cache, 500, "checkpoint.save_interval=1")),
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
                            env=dict(os.environ, PYTHONUNBUFFERED="1"), start_new_session=True)
    trainer = psutil.Process(proc.pid)
    checkpoints = run / "checkpoints"
    seen = set()
    try:
        # after the first complete save, catch the next one in flight (500 steps, each saved: a run
        # that ends without one being caught fails here)
        while not (checkpoints / "latest").exists() or not list(checkpoints.glob("*.tmp")):
            assert proc.poll() is None, "training ended before a checkpoint save was caught in flight"
            seen.update(trainer.children(recursive=True))
            time.sleep(0.01)
        seen.update(trainer.children(recursive=True))
        os.kill(proc.pid, signal.SIGKILL)
        proc.wait(timeout=30)
        # data-loader workers poll for their parent every 5 s (torch's MP_STATUS_CHECK_INTERVAL)
        deadline = time.time() + 15
        while _alive(seen) and time.time() < deadline:
            time.sleep(0.2)
        left = [(p.pid, " ".join(p.cmdline())[:200]) for p in _alive(seen)]
        assert not left, f"still running after the trainer was killed: {left}"
    finally:
        for p in _alive(seen | {trainer}):
            p.kill()
    # nothing lost: the newest complete checkpoint is still `latest`, and the run resumes from it
    latest = int((checkpoints / "latest").read_text())
    resumed = cli_run(run, f"training.train_iters={latest + 1}", "--resume")
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    assert f"resumed from {checkpoints / f'iter_{latest:07d}'}" in resumed.stdout
    assert not list(checkpoints.glob("*.tmp"))  # the killed save's staging is cleared by the next save
