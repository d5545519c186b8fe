"""Every axis at once on CPU (gloo, fp32): TP 2 with SP x PP 2 x DP 2, the experts over EP 2 (folded
over the tensor and data ranks), with the distributed optimizer, in 8 processes, logs one process's
losses and grad norms for 10 steps; its checkpoint at step 5 (optimizer state included) continues
at TP 2 x EP 2 in two processes as the 8-process run itself continued."""
import shutil

from ep_runs import EP_KEY, assert_same_steps, records, train
from megatron_dmoe.training.checkpoint import LATEST, checkpoint_dir
from train_helpers import SMALL

STEPS = list(range(1, 11))
TP2_SP = ["parallel.tensor_model_parallel_size=2", "parallel.sequence_parallel=true"]
PP_KEY = "parallel.pipeline_model_parallel_size"


def test_tp2_pp2_dp2_ep2_with_the_distributed_optimizer_trains_and_resumes_like_one_process(tmp_path, corpus_cache):
    args = SMALL + ["training.micro_batch_size=2", "training.train_iters=10", "training.eval_interval=0",
                    f"data.cache_dir={corpus_cache}", "training.use_distributed_optimizer=true"]
    train(1, tmp_path / "one", *args, "checkpoint.save_interval=0")
    train(8, tmp_path / "all", *args, *TP2_SP, f"{PP_KEY}=2", f"{EP_KEY}=2",
          "checkpoint.save_interval=5", "checkpoint.keep_last=0")
    one, every = records(tmp_path / "one"), records(tmp_path / "all")
    assert sorted(one) == sorted(every) == STEPS
    assert_same_steps(one, every, STEPS)

    # the tied embedding has a bucket of its own under pipelines: its optimizer state must travel
    run_dir = tmp_path / "from_all_at_tp2"
    shutil.copytree(checkpoint_dir(tmp_path / "all" / "checkpoints", 5), checkpoint_dir(run_dir / "checkpoints", 5))
    (run_dir / "checkpoints" / LATEST).write_text("5")
    shutil.copy(tmp_path / "all" / "config.yaml", run_dir / "config.yaml")
    train(2, run_dir, "--resume", f"{PP_KEY}=1", "checkpoint.save_interval=0")
    continued = records(run_dir)
    assert sorted(continued) == STEPS[5:]
    assert_same_steps(every, continued, STEPS[5:])
