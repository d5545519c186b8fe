"""`dmoe-train --nproc-per-node 2` on a CPU (gloo), as a user runs it: a misspelled key, a bad value
and a missing tokenizer are each one line and exit 2, told before any worker starts; a refusal a
worker makes (a model too large for this machine's memory) is its rank 0's one line, exit 2; no
traceback and no torchrun summary from anyone; and the launched run trains."""
import os
import subprocess
import sys

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


def test_the_launched_run_trains(tmp_path, corpus_cache):
    proc = _launch(tmp_path, *small_args(corpus_cache, 2))
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "device: cpu, 2 processes (gloo), fp32" in proc.stdout
    assert f"run directory: {tmp_path / 'run'} (step 2" in proc.stdout
    assert not any(word in proc.stdout + proc.stderr for word in NOISE), proc.stdout + proc.stderr
