"""End-to-end expert parallelism: torchrun on CPU (gloo) trains like one process, and a checkpoint
saved at EP = 4 continues at EP = 2 and EP = 1 as the EP = 4 run itself continued."""
import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

from train_helpers import SMALL, run_train

EP_KEY = "parallel.expert_model_parallel_size"


def _train(nproc, run_dir, *args):
    """dmoe-train in `nproc` processes (torchrun for more than one)."""
    if nproc == 1:
        result = run_train(run_dir, *args)
    else:
        # --standalone: a rendezvous on a free port, so concurrent runs on one machine cannot collide
        cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", str(nproc),
               "-m", "megatron_dmoe", *args, "--run-dir", str(run_dir)]
        env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONUNBUFFERED="1")
        result = subprocess.run(cmd, capture_output=True, text=True, timeout=600, env=env)
    assert result.returncode == 0, (nproc, args, result.stderr[-3000:])


def _records(run_dir):
    lines = (Path(run_dir) / "metrics.jsonl").read_text().splitlines()
    return {rec["step"]: rec for rec in map(json.loads, lines)}


def _assert_same_steps(expected, actual, steps, keys=("loss", "grad_norm")):
    for step in steps:
        for key in keys:
            a, b = expected[step][key], actual[step][key]
            # same samples and weights: only float32 reduction order differs
            assert abs(a - b) <= 1e-4 * abs(a), (step, key, a, b)


def test_two_process_expert_parallel_matches_one_process(tmp_path, corpus_cache):
    args = SMALL + ["training.train_iters=5", "training.eval_interval=0", "checkpoint.save_interval=0",
                    f"data.cache_dir={corpus_cache}"]
    _train(1, tmp_path / "single", *args)
    _train(2, tmp_path / "ep2", *args, f"{EP_KEY}=2")
    one, two = _records(tmp_path / "single"), _records(tmp_path / "ep2")
    assert sorted(one) == sorted(two) == [1, 2, 3, 4, 5]
    _assert_same_steps(one, two, one)
    for step in one:
        # loads of all 4 experts summed over both ranks (8 * 64 tokens * top-2 per layer); a routing
        # near-tie flipped by reduction-order noise may move one assignment, a lost reduction halves them
        for a, b in zip(one[step]["expert_load"], two[step]["expert_load"]):
            assert sum(a) == sum(b) == 8 * 64 * 2 and sum(abs(x - y) for x, y in zip(a, b)) <= 2, (step, a, b)


def test_checkpoint_from_ep4_continues_at_ep2_and_ep1(tmp_path, corpus_cache):
    """2 experts over 4 ranks (each FFN split in two) -> whole experts on 2 ranks -> one process.
    Losses and grad norms after the checkpoint match the uninterrupted EP = 4 run: weights, Adam
    moments and the step count all travelled (step 5 depends on the moments)."""
    args = SMALL + ["moe.num_experts=2", "moe.top_k=1", "training.micro_batch_size=2", "training.train_iters=5",
                    "training.eval_interval=0", f"data.cache_dir={corpus_cache}"]
    _train(4, tmp_path / "ep4", *args, f"{EP_KEY}=4", "checkpoint.save_interval=3", "checkpoint.keep_last=0")
    reference = _records(tmp_path / "ep4")
    assert sorted(reference) == [1, 2, 3, 4, 5]

    for ep in (2, 1):
        run_dir = tmp_path / f"from_ep4_at_ep{ep}"
        # the EP = 4 run as it stood at step 3: its config and that checkpoint
        shutil.copytree(tmp_path / "ep4" / "checkpoints" / "iter_0000003", run_dir / "checkpoints" / "iter_0000003")
        (run_dir / "checkpoints" / "latest").write_text("3")
        shutil.copy(tmp_path / "ep4" / "config.yaml", run_dir / "config.yaml")
        _train(ep, run_dir, "--resume", f"{EP_KEY}={ep}", "checkpoint.save_interval=0")
        continued = _records(run_dir)
        assert sorted(continued) == [4, 5], (ep, sorted(continued))
        _assert_same_steps(reference, continued, [4, 5])
