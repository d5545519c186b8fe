"""A two-run sweep trained here, one run after another; started again, it skips the finished runs."""
import os
import signal
import sys

import pytest

from megatron_dmoe.cli import sweep_main
from megatron_dmoe.config import Environment, load_config
from megatron_dmoe.sweep import load_sweep, local, plan_runs
from megatron_dmoe.training.metrics_log import read_metrics


@pytest.mark.slow
def test_local_sweep_trains_each_run_then_skips_finished_ones(tmp_path, small_run, capsys):
    overrides = [o for o in small_run(3, "training.eval_interval=3", "training.eval_iters=1")
                 if not o.startswith(("moe.top_k=", "training.eval_interval=0"))]
    sweep = tmp_path / "sweep.yaml"
    sweep.write_text("base: tiny\noverrides:\n"
                     + "".join(f"  {o.replace('=', ': ', 1)}\n" for o in overrides)
                     + "grid:\n  moe.top_k: [1, 2]\n")
    runs, plot = tmp_path / "runs", tmp_path / "loss.png"
    assert sweep_main([str(sweep), "--runs-dir", str(runs), "--plot", str(plot)]) == 0
    out = capsys.readouterr().out
    assert f"[1/2] top_k=1: training in {runs / 'top_k=1'}" in out
    assert f"[2/2] top_k=2: training in {runs / 'top_k=2'}" in out
    for top_k in (1, 2):
        run_dir = runs / f"top_k={top_k}"
        assert load_config(str(run_dir / "config.yaml")).moe.top_k == top_k
        records = read_metrics(run_dir)
        assert [r["step"] for r in records] == [1, 2, 3]
        assert f"run directory: {run_dir} (step 3" in (run_dir / "train.log").read_text()
        row = next(line.split() for line in out.splitlines() if line.startswith(f"top_k={top_k} "))
        assert row == [f"top_k={top_k}", "3/3", f"{records[-1]['loss']:.4f}",
                       f"{records[-1]['val_loss']:.4f}",
                       f"{sum(r['tokens_per_s'] for r in records[1:]) / 2:.0f}"]
    assert plot.read_bytes()[:4] == b"\x89PNG"

    assert sweep_main([str(sweep), "--runs-dir", str(runs)]) == 0  # started again
    out = capsys.readouterr().out
    assert "[1/2] top_k=1: finished (3 steps) earlier, skipped" in out
    assert "[2/2] top_k=2: finished (3 steps) earlier, skipped" in out
    assert "training in" not in out


def test_a_failing_run_is_reported_and_the_sweep_fails(tmp_path, capsys):
    sweep = tmp_path / "sweep.yaml"
    missing = tmp_path / "no_such_corpus"
    sweep.write_text(f"base: tiny\ngrid:\n  data.data_path: [[{missing}]]\n")
    runs = tmp_path / "runs"
    assert sweep_main([str(sweep), "--runs-dir", str(runs)]) == 1
    out = capsys.readouterr().out
    run_dir = runs / f"data_path={str(missing).replace('/', '-')}"
    assert f"failed with exit status 2; its output is in {run_dir / 'train.log'}" in out
    assert "1 of 1 runs failed" in out and "1 of 1 runs not finished" in out
    assert "dmoe-train: error: data." in (run_dir / "train.log").read_text()


# Stand-in for training: prints "ready", then waits; on SIGTERM it notes it and exits 0, as a
# training run does after saving. With an argument it starts itself as a child and waits for
# it, like torchrun (noting a SIGTERM it gets itself).
FAKE_TRAINING = """
import pathlib, signal, subprocess, sys, time
mark = pathlib.Path(sys.argv[1])
def on_term(*_):
    mark.write_text(mark.read_text() + sys.argv[2] + " got SIGTERM\\n")
    sys.exit(0)
signal.signal(signal.SIGTERM, on_term)
if sys.argv[2] == "launcher":
    sys.exit(subprocess.call([sys.executable, __file__, sys.argv[1], "worker"]))
print("ready", flush=True)
time.sleep(60)
"""


class _SignalWhenReady:
    """An output stream that sends this process SIGTERM when the training says it is ready."""

    def __init__(self):
        self.text = ""

    def write(self, text):
        self.text += text
        if text.startswith("ready"):
            os.kill(os.getpid(), signal.SIGTERM)

    def flush(self):
        pass


@pytest.mark.parametrize("nproc", [1, 2], ids=["plain", "torchrun"])
def test_sigterm_stops_the_running_training_and_the_sweep(tmp_path, monkeypatch, nproc):
    script, mark = tmp_path / "fake_training.py", tmp_path / "signals"
    script.write_text(FAKE_TRAINING)
    mark.write_text("")
    role = "launcher" if nproc > 1 else "worker"
    monkeypatch.setattr(local, "train_command",
                        lambda run_dir, n: [sys.executable, str(script), str(mark), role])
    sweep = tmp_path / "sweep.yaml"
    sweep.write_text("base: tiny\ngrid: {moe.top_k: [1, 2]}\n")
    planned = plan_runs(load_sweep(sweep), tmp_path / "runs", Environment.detect())
    out, handler = _SignalWhenReady(), signal.getsignal(signal.SIGTERM)
    first, second = local.run_locally(planned, nproc_per_node=nproc, out=out)
    assert first.returncode == 0 and not first.failed
    assert second.returncode is None and not second.skipped  # not started after the SIGTERM
    # only the training process got it: a torchrun-like launcher is left to end on its own
    assert mark.read_text() == "worker got SIGTERM\n"
    assert "[2/2]" not in out.text
    assert signal.getsignal(signal.SIGTERM) is handler  # the sweep's handler is removed again
