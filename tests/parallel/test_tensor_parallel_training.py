"""dmoe-train with tensor parallelism on CPU (gloo, fp32), without Transformer Engine or apex:
10 steps of the tiny models at the same global batch and seed give one process's losses and
gradient norms (1e-4 relative): dense and MoE at TP = 2 with sequence parallelism, MoE at
TP = 2 x EP = 2 x DP = 2 (expert parallelism folded over the tensor group), and experts split over
ranks (expert tensor parallelism, ETP = 2) alone and with EP = 2 and the distributed optimizer,
whose checkpoint continues in one process as the run itself continued."""
import json
import os
import shutil
import subprocess
import sys

from ep_runs import EP_KEY, assert_same_steps, records, train
from megatron_dmoe.training.checkpoint import LATEST, checkpoint_dir
from train_helpers import small_args

TP2_SP = ["parallel.tensor_model_parallel_size=2", "parallel.sequence_parallel=true"]
ETP2 = ["parallel.expert_tensor_parallel_size=2"]
STEPS = list(range(1, 11))


def test_tensor_parallel_trains_like_one_process(tmp_path, corpus_cache):
    args = small_args(corpus_cache, 10, "checkpoint.save_interval=0")
    dense = [*args, "moe.num_experts=0"]
    train(1, tmp_path / "dense", *dense, device="cpu")
    train(2, tmp_path / "dense-tp2", *dense, *TP2_SP, device="cpu")
    assert_same_steps(records(tmp_path / "dense"), records(tmp_path / "dense-tp2"), STEPS)

    train(1, tmp_path / "moe", *args, device="cpu")
    one = records(tmp_path / "moe")
    assert sorted(one) == STEPS
    train(2, tmp_path / "moe-tp2", *args, *TP2_SP, device="cpu")
    assert_same_steps(one, records(tmp_path / "moe-tp2"), STEPS)
    train(4, tmp_path / "moe-tp2-ep2", *args, *TP2_SP, f"{EP_KEY}=2", device="cpu")
    assert_same_steps(one, records(tmp_path / "moe-tp2-ep2"), STEPS)


def test_experts_split_over_ranks_train_and_resume_like_one_process(tmp_path, corpus_cache):
    args = small_args(corpus_cache, 10)
    train(1, tmp_path / "one", *args, "checkpoint.save_interval=0", device="cpu")
    one = records(tmp_path / "one")
    train(2, tmp_path / "tp2-etp2", *args, *TP2_SP, *ETP2, "checkpoint.save_interval=0", device="cpu")
    assert_same_steps(one, records(tmp_path / "tp2-etp2"), STEPS)
    split = tmp_path / "tp2-ep2-etp2"
    train(4, split, *args, *TP2_SP, *ETP2, f"{EP_KEY}=2", "training.use_distributed_optimizer=true",
          "checkpoint.save_interval=5", "checkpoint.keep_last=0", "training.eval_interval=10", "training.eval_iters=1",
          device="cpu")
    every = records(split)
    assert_same_steps(one, every, STEPS)

    # the step-5 checkpoint (expert shards and their Adam moments) in one process, whole experts
    run_dir = tmp_path / "from_split"
    shutil.copytree(checkpoint_dir(split / "checkpoints", 5), checkpoint_dir(run_dir / "checkpoints", 5))
    (run_dir / "checkpoints" / LATEST).write_text("5")
    shutil.copy(split / "config.yaml", run_dir / "config.yaml")
    train(1, run_dir, "--resume", "parallel.tensor_model_parallel_size=1", "parallel.sequence_parallel=false",
          "parallel.expert_tensor_parallel_size=1", f"{EP_KEY}=1", "training.use_distributed_optimizer=false",
          "checkpoint.save_interval=5")
    continued = records(run_dir)
    assert sorted(continued) == STEPS[5:]
    assert_same_steps(every, continued, STEPS[5:])
    assert_same_steps(every, continued, [10], keys=("val_loss",))
    # dmoe-eval reads the split run's last checkpoint as it reads the one-process continuation's
    losses = [_eval_loss(d) for d in (split, run_dir)]
    assert abs(losses[0] - losses[1]) <= 1e-4 * losses[1], losses


def _eval_loss(run_dir):
    result = subprocess.run([sys.executable, "-m", "megatron_dmoe.inference.eval_cli", str(run_dir), "--no-progress",
                             "--device", "cpu"], capture_output=True, text=True, timeout=300,
                            env=dict(os.environ, OMP_NUM_THREADS="1"))
    assert result.returncode == 0, result.stderr[-3000:]
    return json.loads(result.stdout)["loss"]
