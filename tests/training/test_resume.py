"""SIGTERM mid-run, then --resume: the losses continue exactly as an uninterrupted run's."""
import os
import signal
import subprocess
import time
from pathlib import Path

from train_helpers import SMALL, losses, train_command

ITERS = 16


def _wait_for_step(run_dir: Path, step: int, proc: subprocess.Popen, timeout: float = 300) -> None:
    deadline = time.time() + timeout
    metrics = run_dir / "metrics.jsonl"
    while time.time() < deadline:
        if proc.poll() is not None:
            raise AssertionError(f"training ended early:\n{proc.stdout.read()}")
        if metrics.exists() and len(metrics.read_text().splitlines()) >= step:
            return
        time.sleep(0.2)
    raise AssertionError(f"step {step} not reached in {timeout} s")


def test_sigterm_then_resume_matches_uninterrupted_run(cli_run, tmp_path, corpus_cache):
    args = SMALL + [
        f"training.train_iters={ITERS}",
        "training.eval_interval=0",
        "checkpoint.save_interval=100",
        f"data.cache_dir={corpus_cache}",
    ]
    # the uninterrupted run and the resume in this process; the interrupted run in a process of its
    # own, which the signal is sent to
    full = cli_run(tmp_path / "full", *args)
    assert full.returncode == 0, full.stderr[-3000:]
    reference = losses(tmp_path / "full")
    assert sorted(reference) == list(range(1, ITERS + 1))

    run_dir = tmp_path / "interrupted"
    proc = subprocess.Popen(
        train_command(run_dir, *args),
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        env=dict(os.environ, PYTHONUNBUFFERED="1"),
        start_new_session=True,
    )
    _wait_for_step(run_dir, 5, proc)
    # As a scheduler does: the whole process group, data-loader workers included, gets SIGTERM.
    os.killpg(proc.pid, signal.SIGTERM)
    out, _ = proc.communicate(timeout=300)
    assert proc.returncode == 0, out[-3000:]
    assert "SIGTERM" in out
    stopped_at = int((run_dir / "checkpoints" / "latest").read_text())
    assert 5 <= stopped_at < ITERS

    resumed = cli_run(run_dir, "--resume")
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    assert "resumed from" in resumed.stdout
    continued = losses(run_dir)
    assert sorted(continued) == list(range(1, ITERS + 1))
    for step in range(1, ITERS + 1):
        assert continued[step] == reference[step], (step, continued[step], reference[step])
