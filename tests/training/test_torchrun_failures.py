"""Under torchrun (2 CPU processes, expert parallelism 2): a bad data path is told once, by rank 0,
with no other rank's connection traceback; a Ctrl-C (SIGINT to the whole process group, as a
terminal sends it) is acknowledged once at once, saves, and prints the command that resumes this
layout (dmoe-train --nproc-per-node). Plain torchrun's agent gets the Ctrl-C too and prints its own
SignalException traceback (torchrun's code, not this package's): that is the only traceback allowed."""
import os
import re
import signal
import subprocess
import sys
import time

import pytest

from train_helpers import small_args

pytestmark = pytest.mark.slow


def _torchrun(run_dir, args, **popen):
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2",
           "-m", "megatron_dmoe", *args, "--run-dir", str(run_dir)]
    env = dict(os.environ, PYTHONUNBUFFERED="1", OMP_NUM_THREADS="1")
    return subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env, **popen)


def test_bad_data_path_and_ctrl_c_under_torchrun(tmp_path, corpus_cache):
    from megatron_dmoe.data import prepare_builtin_corpus

    _, tokenizer = prepare_builtin_corpus(4096, corpus_cache)
    bad = _torchrun(tmp_path / "bad", [f"data.data_path=[{tmp_path}/missing_text_document]",
                                       f"data.tokenizer_model={tokenizer}"])
    out, _ = bad.communicate(timeout=300)
    assert out.count("dmoe-train: error: data files not found (data.data_path):") == 1, out
    assert not re.search(r"Connection|DistBackendError|gloo", out), out
    assert not (tmp_path / "bad").exists()

    run = tmp_path / "ep2"
    proc = _torchrun(run, small_args(corpus_cache, 500, "parallel.expert_model_parallel_size=2"),
                     start_new_session=True)  # its own process group, as a terminal's foreground job
    metrics = run / "metrics.jsonl"
    while not (metrics.exists() and len(metrics.read_text().splitlines()) >= 2):
        # a run that ended before two steps has failed (a hang is pytest-timeout's to stop)
        assert proc.poll() is None, proc.communicate()[0][-3000:]
        time.sleep(0.1)
    os.killpg(proc.pid, signal.SIGINT)
    out, _ = proc.communicate(timeout=300)
    assert out.count("dmoe-train: SIGINT: stopping after this step, then saving") == 1, out
    stopped = int((run / "checkpoints" / "latest").read_text())
    assert (f"stopping at step {stopped} on SIGINT; continue with: dmoe-train --nproc-per-node 2 "
            f"--run-dir {run} --resume") in out
    assert not list(run.rglob("*.tmp"))
    # the only traceback is torchrun's agent's own, after the workers saved
    assert out.count("Traceback") <= 1 and ("Traceback" not in out or "SignalException" in out), out
