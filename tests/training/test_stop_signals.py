"""Ctrl-C (SIGINT) saves a checkpoint like SIGTERM and says how to resume; a second one aborts.

The run is in this process; the signal goes to it and to its data-loader workers, as a terminal's
Ctrl-C reaches the whole foreground process group. A KeyboardInterrupt escaping to pytest would
stop the session, so it is turned into a failure.
"""
import os
import signal
import threading
import time

import psutil
import pytest
import torch

from megatron_dmoe.training.stops import PreemptionWatcher
from train_helpers import small_args, snapshot


def _ctrl_c_after(metrics, lines, seen, timeout=120):
    deadline = time.time() + timeout
    while not (metrics.exists() and len(metrics.read_text().splitlines()) >= lines):
        if time.time() > deadline:
            return
        time.sleep(0.05)
    seen["before"] = snapshot(metrics.parent)
    seen["logged"] = metrics.read_text()
    me = psutil.Process()
    for process in [me] + me.children(recursive=True):
        os.kill(process.pid, signal.SIGINT)


def test_ctrl_c_saves_a_checkpoint_and_the_run_resumes(cli_run, tmp_path, corpus_cache):
    run = tmp_path / "run"
    metrics = run / "metrics.jsonl"
    seen = {}
    threading.Thread(target=_ctrl_c_after, args=(metrics, 2, seen), daemon=True).start()
    try:
        result = cli_run(run, *small_args(corpus_cache, 500, "data.num_workers=1"))
    except KeyboardInterrupt:
        pytest.fail("Ctrl-C ended the run with KeyboardInterrupt instead of saving")

    assert result.returncode == 130, result.stderr[-3000:]
    stopped = int((run / "checkpoints" / "latest").read_text())
    assert stopped < 500
    assert (f"stopping at step {stopped} on SIGINT; continue with: dmoe-train --run-dir {run} --resume"
            in result.stdout)
    assert (run / "checkpoints" / f"iter_{stopped:07d}" / "metadata.json").exists()
    after = snapshot(run)
    for name, digest in seen["before"].items():  # metrics.jsonl only grew; the rest is as it was
        assert name in after, name
        assert name == "metrics.jsonl" or after[name] == digest, name
    assert metrics.read_text().startswith(seen["logged"])

    resumed = cli_run(run, f"training.train_iters={stopped + 1}", "--resume")
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    assert f"resumed from {run / 'checkpoints' / f'iter_{stopped:07d}'}" in resumed.stdout


def _interrupt():
    os.kill(os.getpid(), signal.SIGINT)
    time.sleep(0.05)  # the handler runs between bytecodes


def test_a_second_ctrl_c_aborts_at_once():
    # the handler to come back: Python's default, or SIG_IGN where the shell started us in the background
    before = signal.getsignal(signal.SIGINT)
    watcher = PreemptionWatcher(device=torch.device("cpu"), repeat_after=0.3)
    try:
        try:
            _interrupt()
            _interrupt()  # the same Ctrl-C forwarded by torchrun: still a request to save
        except KeyboardInterrupt:
            pytest.fail("a first Ctrl-C raised KeyboardInterrupt instead of asking for a save")
        assert watcher.should_stop() == "SIGINT"
        time.sleep(0.3)
        with pytest.raises(KeyboardInterrupt):
            _interrupt()
    finally:
        watcher.close()
    assert signal.getsignal(signal.SIGINT) is before
