"""Ctrl-C (SIGINT) saves a checkpoint like SIGTERM and says how to resume; a second one aborts."""
import os
import signal
import subprocess
import time

import pytest

from megatron_dmoe.training.preemption import PreemptionWatcher
from train_helpers import small_args, snapshot, train_command


def _wait_for_lines(path, count, proc, timeout=120):
    deadline = time.time() + timeout
    while time.time() < deadline:
        if proc.poll() is not None:
            raise AssertionError(f"training ended early:\n{proc.stdout.read()}")
        if path.exists() and len(path.read_text().splitlines()) >= count:
            return
        time.sleep(0.1)
    raise AssertionError(f"{count} lines of {path} not written in {timeout} s")


def test_ctrl_c_saves_a_checkpoint_and_the_run_resumes(cli_run, tmp_path, corpus_cache):
    run = tmp_path / "run"
    proc = subprocess.Popen(
        train_command(run, *small_args(corpus_cache, 500)),
        stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
        env=dict(os.environ, PYTHONUNBUFFERED="1"), start_new_session=True)
    metrics = run / "metrics.jsonl"
    _wait_for_lines(metrics, 2, proc)
    before = snapshot(run)
    logged = metrics.read_text()
    os.killpg(proc.pid, signal.SIGINT)  # as a terminal does: the whole foreground group
    out, _ = proc.communicate(timeout=120)

    assert proc.returncode == 130, out[-3000:]
    assert "Traceback" not in out and "KeyboardInterrupt" not in out, out[-3000:]
    stopped = int((run / "checkpoints" / "latest").read_text())
    assert f"stopping at step {stopped} on SIGINT; continue with: dmoe-train --run-dir {run} --resume" in out
    assert (run / "checkpoints" / f"iter_{stopped:07d}" / "metadata.json").exists()
    after = snapshot(run)
    assert after["config.yaml"] == before["config.yaml"]
    assert metrics.read_text().startswith(logged)

    resumed = cli_run(run, f"training.train_iters={stopped + 1}", "--resume")
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    assert f"resumed from {run / 'checkpoints' / f'iter_{stopped:07d}'}" in resumed.stdout


def test_a_second_ctrl_c_aborts_at_once():
    watcher = PreemptionWatcher(device=__import__("torch").device("cpu"))
    try:
        os.kill(os.getpid(), signal.SIGINT)
        time.sleep(0.05)  # the handler runs between bytecodes
        assert watcher.should_stop() == "SIGINT"
        with pytest.raises(KeyboardInterrupt):
            os.kill(os.getpid(), signal.SIGINT)
            time.sleep(1)
    finally:
        watcher.close()
    assert signal.getsignal(signal.SIGINT) is signal.default_int_handler
