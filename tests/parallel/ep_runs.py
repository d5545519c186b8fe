"""dmoe-train runs for the expert-parallel tests and comparisons of their logged steps, shared by
the CPU (gloo) and the GPU (NCCL) tests."""
import contextlib
import io
import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from megatron_dmoe.training.checkpoint import LATEST, checkpoint_dir
from process_group import NCCL_ENV
from train_helpers import SMALL, train_command

EP_KEY = "parallel.expert_model_parallel_size"
# fp32 training with the block-sparse kernels (SMALL's expert width 128 is a multiple of tiny's block
# 64), eager unless a test captures: training.cuda_graphs: auto would capture where it can
GPU_TRAINING = ["moe.backend=sparse", "training.bf16=false", "training.cuda_graphs=false"]


def needs_gpus(count):
    return pytest.mark.skipif(torch.cuda.device_count() < count,
                              reason=f"needs {count} CUDA GPUs (one per process), found {torch.cuda.device_count()}")


def train(nproc, run_dir, *args, device=None):
    """dmoe-train in `nproc` processes (torchrun for more than one; one process is this one, or a
    subprocess on CUDA); `device` ('cpu' or 'cuda', one GPU per process) overrides training.device,
    else the config's choice stands."""
    if device is not None:
        args = (*args, f"training.device={device}")
    if nproc == 1 and device != "cuda":
        _train_here(run_dir, args)
        return
    if nproc == 1:
        cmd = train_command(run_dir, *args)
        env = dict(os.environ, PYTHONUNBUFFERED="1", **NCCL_ENV)
    else:
        # --standalone: a rendezvous on a free port, so concurrent runs on one machine cannot collide
        cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", str(nproc),
               "-m", "megatron_dmoe", *args, "--run-dir", str(run_dir)]
        env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONUNBUFFERED="1", **NCCL_ENV)
    result = subprocess.run(cmd, capture_output=True, text=True, timeout=600, env=env)
    assert result.returncode == 0, (nproc, args, result.stderr[-3000:])


def _train_here(run_dir, args):
    """dmoe-train in this process: a new interpreter would spend several CPU seconds importing torch
    and megatron-core (one-process reference runs and resumes are most of these tests' runs)."""
    from megatron_dmoe.cli import train_main

    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        code = train_main([*args, "--run-dir", str(run_dir)])
    assert code == 0, (1, args, err.getvalue()[-3000:])


def records(run_dir):
    lines = (Path(run_dir) / "metrics.jsonl").read_text().splitlines()
    return {rec["step"]: rec for rec in map(json.loads, lines)}


def assert_same_steps(expected, actual, steps, keys=("loss", "grad_norm"), rel=1e-4):
    for step in steps:
        for key in keys:
            a, b = expected[step][key], actual[step][key]
            # same samples and weights: only float32 reduction order differs
            assert abs(a - b) <= rel * abs(a), (step, key, a, b)


def assert_captured_run_matches_eager(tmp_path, args, nproc=2):
    """`nproc` GPUs: 5 steps with `args` (fp32) eagerly and with training.cuda_graphs=true give the same
    losses and grad norms to 1e-5 and 1e-4: the graphs run the same kernels, and a wrong saved
    activation shows at once (a chunk's first layer reading its input buffer after megatron-core 0.16
    had handed it on put grad norms 0.2-1.4 % off while losses matched)."""
    train(nproc, tmp_path / "eager", *args, device="cuda")
    train(nproc, tmp_path / "graphs", *args, "training.cuda_graphs=true", device="cuda")
    eager, graphs = records(tmp_path / "eager"), records(tmp_path / "graphs")
    assert sorted(eager) == sorted(graphs) == [1, 2, 3, 4, 5]
    assert_same_steps(eager, graphs, eager, keys=("loss",), rel=1e-5)
    assert_same_steps(eager, graphs, eager, keys=("grad_norm",), rel=1e-4)


def assert_same_expert_loads(expected, actual, assignments):
    """Loads of every expert summed over all ranks: each layer's total is `assignments` (tokens x
    top-k); a routing near-tie flipped by reduction-order noise may move one assignment, a lost
    reduction halves them."""
    for step in expected:
        for a, b in zip(expected[step]["expert_load"], actual[step]["expert_load"]):
            assert sum(a) == sum(b) == assignments and sum(abs(x - y) for x, y in zip(a, b)) <= 2, (step, a, b)


def check_ep4_checkpoint_continues_at_ep2_and_ep1(tmp_path, corpus_cache, *extra, device=None):
    """2 experts over 4 ranks (each FFN split in two) -> whole experts on 2 ranks -> one process.

    5 steps at EP = 4 in 4 processes, saved at step 3; that checkpoint resumed at EP = 2 in 2
    processes and at EP = 1 in one gives the EP = 4 run's losses and grad norms at steps 4 and 5:
    weights, Adam moments and the step count all travelled (step 5 depends on the moments).
    `extra`: more overrides for every run.
    """
    args = SMALL + ["moe.num_experts=2", "moe.top_k=1", "training.micro_batch_size=2", "training.train_iters=5",
                    "training.eval_interval=0", f"data.cache_dir={corpus_cache}", *extra]
    train(4, tmp_path / "ep4", *args, f"{EP_KEY}=4", "checkpoint.save_interval=3", "checkpoint.keep_last=0",
          device=device)
    reference = records(tmp_path / "ep4")
    assert sorted(reference) == [1, 2, 3, 4, 5]

    saved = tmp_path / "ep4" / "checkpoints"
    for ep in (2, 1):
        run_dir = tmp_path / f"from_ep4_at_ep{ep}"
        # the EP = 4 run as it stood at step 3: its config and that checkpoint
        shutil.copytree(checkpoint_dir(saved, 3), checkpoint_dir(run_dir / "checkpoints", 3))
        (run_dir / "checkpoints" / LATEST).write_text("3")
        shutil.copy(tmp_path / "ep4" / "config.yaml", run_dir / "config.yaml")
        train(ep, run_dir, "--resume", f"{EP_KEY}={ep}", "checkpoint.save_interval=0", device=device)
        continued = records(run_dir)
        assert sorted(continued) == [4, 5], (ep, sorted(continued))
        assert_same_steps(reference, continued, [4, 5])


def check_ep2_runs_match_ep1(tmp_path, corpus_cache, runs):
    """5 eager fp32 steps on 2 GPUs at EP = 1, then at EP = 2 with each of `runs` (name: extra
    keys): the same samples and global weights, so the same losses, grad norms and expert loads."""
    args = SMALL + GPU_TRAINING + ["training.train_iters=5", "training.eval_interval=0",
                                   "checkpoint.save_interval=0", f"data.cache_dir={corpus_cache}"]
    train(2, tmp_path / "ep1", *args, f"{EP_KEY}=1", device="cuda")
    one = records(tmp_path / "ep1")
    assert sorted(one) == [1, 2, 3, 4, 5]
    for run, extra in runs.items():
        train(2, tmp_path / run, *args, f"{EP_KEY}=2", *extra, device="cuda")
        other = records(tmp_path / run)
        assert sorted(other) == sorted(one), run
        assert_same_steps(one, other, one)
        assert_same_expert_loads(one, other, assignments=8 * 64 * 2)  # 8 sequences of 64 tokens, top-2
