"""`dmoe-train --nproc-per-node 2` on a CPU (gloo), as a user runs it: a misspelled key, a bad value
and a missing tokenizer are each one line and exit 2, told before any worker starts; a refusal a
worker makes (a model too large for this machine's memory) is its rank 0's one line, exit 2; no
traceback and no torchrun summary from anyone; the launched run trains, and a Ctrl-C stops it with
a checkpoint and exit 130, without the agent's traceback."""
import os
import signal
import subprocess
import sys
import time

import pytest

from train_helpers import small_args

NOISE = ("Traceback", "ChildFailedError", "torch.distributed.elastic", "OMP_NUM_THREADS", "SIGTERM")


def _launch(tmp_path, *args):
    env = dict(os.environ, PYTHONUNBUFFERED="1")
    env.pop("OMP_NUM_THREADS", None)  # what torchrun's banner is about
    return subprocess.run([sys.executable, "-m", "megatron_dmoe", "--nproc-per-node", "2", *args,
                           "--run-dir", str(tmp_path / "run")], capture_output=True, text=True, timeout=300, env=env)


def _one_error_line(proc):
    out = proc.stdout + proc.stderr
    assert proc.returncode == 2, out
    assert not any(word in out for word in NOISE), out
    errors = [line for line in out.splitlines() if line.startswith("dmoe-train: error: ")]
    assert len(errors) == 1, out
    return errors[0]


@pytest.mark.parametrize("override, message", [
    ("training.trian_iters=3", "training.trian_iters: unknown key; did you mean training.train_iters?"),
    ("moe.top_k=0", "moe.top_k: 0 is out of range"),
    ("data.tokenizer_model=MISSING", "data.tokenizer_model: tokenizer model not found"),
])
def test_refusals_before_the_workers_start_are_one_line(override, message, tmp_path):
    args = [override.replace("MISSING", str(tmp_path / "missing.model"))]
    if override.startswith("data."):
        args.append(f"data.data_path=[{tmp_path}/corpus_text_document]")
    proc = _launch(tmp_path, *args)
    assert message in _one_error_line(proc)
    assert proc.stdout.strip() == ""  # nothing but the line (on stderr)
    assert not (tmp_path / "run").exists()


def test_a_workers_refusal_is_its_rank_0s_one_line(tmp_path):
    """A model whose estimate exceeds any machine's memory: refused on a CPU before its data or
    model, by rank 0 only."""
    proc = _launch(tmp_path, "model.hidden_size=16384", "model.num_attention_heads=16", "moe.num_experts=512",
                   "moe.ffn_hidden_size=65536")
    line = _one_error_line(proc)
    assert "GiB per process estimated" in line and "x 2 processes" in line and "this machine has available" in line
    assert not (tmp_path / "run").exists()


def test_the_launched_run_trains_and_stops_on_ctrl_c_without_a_traceback(tmp_path, corpus_cache):
    """A Ctrl-C reaches the launcher and its workers (one process group, as a terminal sends it): the
    workers save and say how to continue; the launcher exits 130 with nothing of its own."""
    run = tmp_path / "run"
    proc = subprocess.Popen([sys.executable, "-m", "megatron_dmoe", "--nproc-per-node", "2",
                             *small_args(corpus_cache, 500), "--run-dir", str(run)],
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, start_new_session=True,
                            env=dict(os.environ, PYTHONUNBUFFERED="1"))
    metrics = run / "metrics.jsonl"
    while not (metrics.exists() and len(metrics.read_text().splitlines()) >= 2):
        assert proc.poll() is None, proc.communicate()[0][-3000:]  # a hang is pytest-timeout's to stop
        time.sleep(0.1)
    os.killpg(proc.pid, signal.SIGINT)
    out, _ = proc.communicate(timeout=300)
    assert proc.returncode == 130, out[-3000:]
    assert "device: cpu, 2 processes (gloo), fp32" in out
    stopped = int((run / "checkpoints" / "latest").read_text())
    assert f"stopping at step {stopped} on SIGINT; continue with: dmoe-train --nproc-per-node 2 --run-dir {run} " \
           "--resume" in out
    assert not any(word in out for word in NOISE), out
