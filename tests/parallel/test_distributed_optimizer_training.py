"""megatron-core's distributed optimizer on CPU (gloo): DP = 4 with EP = 2 (dense parameters sharded
over four ranks, expert parameters over their expert-data-parallel pair) logs the one-process run's
losses and grad norms for 10 steps, and its checkpoint (optimizer state included, in the
reshardable format) continues in one process as the four-process run itself continued."""
import shutil

from ep_runs import EP_KEY, assert_same_steps, records, train
from megatron_dmoe.training.checkpoint import LATEST, checkpoint_dir
from train_helpers import SMALL

STEPS = list(range(1, 11))


def test_distributed_optimizer_with_expert_parallel_trains_and_resumes_like_one_process(tmp_path, corpus_cache):
    args = SMALL + ["training.micro_batch_size=2", "training.train_iters=10", "training.eval_interval=0",
                    f"data.cache_dir={corpus_cache}", "training.use_distributed_optimizer=true"]
    train(1, tmp_path / "one", *args, "checkpoint.save_interval=0")
    train(4, tmp_path / "dp4ep2", *args, f"{EP_KEY}=2", "checkpoint.save_interval=5", "checkpoint.keep_last=0")
    one, four = records(tmp_path / "one"), records(tmp_path / "dp4ep2")
    assert sorted(one) == sorted(four) == STEPS
    assert_same_steps(one, four, STEPS)

    run_dir = tmp_path / "from_dp4ep2_at_one"
    shutil.copytree(checkpoint_dir(tmp_path / "dp4ep2" / "checkpoints", 5), checkpoint_dir(run_dir / "checkpoints", 5))
    (run_dir / "checkpoints" / LATEST).write_text("5")
    shutil.copy(tmp_path / "dp4ep2" / "config.yaml", run_dir / "config.yaml")
    train(1, run_dir, "--resume", f"{EP_KEY}=1", "checkpoint.save_interval=0")
    continued = records(run_dir)
    assert sorted(continued) == STEPS[5:]
    # step 7 on depends on the Adam moments and step counts saved at step 5
    assert_same_steps(four, continued, STEPS[5:])
