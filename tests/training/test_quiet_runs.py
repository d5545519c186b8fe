"""A run's console says only what the user can act on, once: no notices about optional
accelerators (Transformer Engine, apex) or about torch's and megatron-core's internals, and under
torchrun each message comes from rank 0 alone."""
import os
import subprocess
import sys
import textwrap

from train_helpers import small_args

# one interpreter for several commands: dmoe-sweep --help, a new run, its resume
SCRIPT = textwrap.dedent("""
    import sys
    from megatron_dmoe.cli import sweep_main, train_main
    try:
        sweep_main(["--help"])
    except SystemExit:
        pass
    run, args = sys.argv[1], sys.argv[2:]
    assert train_main([*args, "training.train_iters=1", "--run-dir", run]) == 0
    assert train_main([*args, "training.train_iters=2", "--run-dir", run, "--resume"]) == 0
""")


def test_sweep_help_training_and_resume_print_no_notices(tmp_path, corpus_cache):
    # a constant rate: extending the run moves no rate (a jump back up would be a warning)
    args = [a for a in small_args(corpus_cache, 1, "checkpoint.save_interval=1", "training.lr_decay_style=constant")
            if "train_iters" not in a]
    done = subprocess.run([sys.executable, "-c", SCRIPT, str(tmp_path / "run"), *args], capture_output=True,
                          text=True, timeout=300, env=dict(os.environ, PYTHONUNBUFFERED="1"))
    assert done.returncode == 0, done.stderr[-3000:]
    assert "usage: dmoe-sweep" in done.stdout and "resumed from" in done.stdout
    assert done.stderr == "", done.stderr


def _torchrun(run_dir, *args):
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2",
           "-m", "megatron_dmoe", *args, "--run-dir", str(run_dir)]
    return subprocess.run(cmd, capture_output=True, text=True, timeout=300,
                          env=dict(os.environ, OMP_NUM_THREADS="1", PYTHONUNBUFFERED="1"))


def test_torchrun_tells_each_message_once(tmp_path, corpus_cache):
    bad = _torchrun(tmp_path / "bad", "moe.top_k=9", "training.lr_warmup_iters=-1")
    assert bad.returncode != 0
    errors = [line for line in bad.stderr.splitlines() if line.startswith("dmoe-train: error:")]
    assert len(errors) == 1, bad.stderr[-3000:]
    assert "moe.top_k" in bad.stderr

    # a warmup as long as a run of 100 steps is a warning (the time limit stops it after its first
    # step); two ranks save a checkpoint; the distributed optimizer's collectives are ones torch
    # deprecates (megatron-core calls them)
    good = _torchrun(tmp_path / "good", *small_args(corpus_cache, 100, "checkpoint.save_interval=1",
                                                    "training.lr_warmup_iters=100",
                                                    "training.time_limit_minutes=0.0001",
                                                    "training.use_distributed_optimizer=true"))
    assert good.returncode == 0, good.stderr[-3000:]
    warned = [line for line in good.stderr.splitlines() if line.startswith("dmoe-train: warning:")]
    assert len(warned) == 1, good.stderr
    assert "Warning:" not in good.stderr, good.stderr  # no Python warnings, from any rank
    assert "differs" not in good.stderr, good.stderr  # megatron-core's check of the ranks' common state
    assert good.stdout.count("run directory:") == 2, good.stdout  # the first line and the summary, rank 0's
