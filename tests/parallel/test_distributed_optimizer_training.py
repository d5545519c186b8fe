"""megatron-core's distributed optimizer on CPU (gloo): DP = 4 with EP = 2 (dense parameters sharded
over four ranks, expert parameters over their expert-data-parallel pair) logs the losses and grad
norms of one process with megatron's other optimizer for 10 steps. Checkpoints continue across the
switch, optimizer state included: the four-process run's at step 5 in one process without the
distributed optimizer, and the one-process run's in two processes with it, each as the run it
came from continued."""
import shutil

from ep_runs import EP_KEY, assert_same_steps, records, train
from megatron_dmoe.training.checkpoint import LATEST, checkpoint_dir
from train_helpers import SMALL

STEPS = list(range(1, 11))
DISTOPT = "training.use_distributed_optimizer"


def _resume_at_step_5(source, run_dir, nproc, *overrides):
    shutil.copytree(checkpoint_dir(source / "checkpoints", 5), checkpoint_dir(run_dir / "checkpoints", 5))
    (run_dir / "checkpoints" / LATEST).write_text("5")
    shutil.copy(source / "config.yaml", run_dir / "config.yaml")
    train(nproc, run_dir, "--resume", *overrides, "checkpoint.save_interval=0")
    continued = records(run_dir)
    assert sorted(continued) == STEPS[5:]
    return continued


def test_distributed_optimizer_with_expert_parallel_trains_and_resumes_across_the_switch(tmp_path, corpus_cache):
    args = SMALL + ["training.micro_batch_size=2", "training.train_iters=10", "training.eval_interval=0",
                    f"data.cache_dir={corpus_cache}", "checkpoint.save_interval=5", "checkpoint.keep_last=0"]
    train(1, tmp_path / "one", *args, f"{DISTOPT}=false")
    train(4, tmp_path / "dp4ep2", *args, f"{EP_KEY}=2", f"{DISTOPT}=true")
    one, four = records(tmp_path / "one"), records(tmp_path / "dp4ep2")
    assert sorted(one) == sorted(four) == STEPS
    assert_same_steps(one, four, STEPS)

    # step 7 on depends on the Adam moments and step counts saved at step 5
    off = _resume_at_step_5(tmp_path / "dp4ep2", tmp_path / "dp4ep2_at_one", 1, f"{EP_KEY}=1", f"{DISTOPT}=false")
    assert_same_steps(four, off, STEPS[5:])
    on = _resume_at_step_5(tmp_path / "one", tmp_path / "one_at_dp2", 2, f"{DISTOPT}=true")
    assert_same_steps(one, on, STEPS[5:])
