"""dmoe-train with tensor parallelism on CPU (gloo, fp32), without Transformer Engine or apex:
10 steps of a tiny model (a dense first layer, then MoE) at the same global batch and seed give one
process's losses and gradient norms (1e-4 relative): TP = 2 with sequence parallelism (the dense
MLP and the MoE layer split over the tensor group in one run), MoE at TP = 2 x EP = 2 x DP = 2
(expert parallelism folded over the tensor group), and experts split over ranks (expert tensor
parallelism, ETP = 2) alone and with EP = 2 and the distributed optimizer, whose checkpoint continues
in one process as the run itself continued. The one-process run is trained once for the module;
models without any MoE layer are trained at TP = 2 with SP by test_layouts.py."""
import contextlib
import io
import json
import shutil

import pytest

from ep_runs import EP_KEY, assert_same_steps, records, train
from megatron_dmoe.training.checkpoint import LATEST, checkpoint_dir
from train_helpers import small_args

TP2_SP = ["parallel.tensor_model_parallel_size=2", "parallel.sequence_parallel=true"]
ETP2 = ["parallel.expert_tensor_parallel_size=2"]
STEPS = list(range(1, 11))


def _args(corpus_cache, *extra):
    # layer 1 dense (its MLP split over the tensor group as megatron-core's), layer 2 MoE
    return small_args(corpus_cache, 10, "moe.first_dense_layers=1", *extra)


@pytest.fixture(scope="module")
def one(tmp_path_factory, corpus_cache):
    """The one-process run's logged steps, the reference of every layout here."""
    run_dir = tmp_path_factory.mktemp("one_process") / "run"
    train(1, run_dir, *_args(corpus_cache, "checkpoint.save_interval=0"), device="cpu")
    steps = records(run_dir)
    assert sorted(steps) == STEPS
    return steps


def test_tensor_parallel_trains_like_one_process(tmp_path, corpus_cache, one):
    args = _args(corpus_cache, "checkpoint.save_interval=0")
    train(2, tmp_path / "tp2", *args, *TP2_SP, device="cpu")
    assert_same_steps(one, records(tmp_path / "tp2"), STEPS)
    train(4, tmp_path / "tp2-ep2", *args, *TP2_SP, f"{EP_KEY}=2", device="cpu")
    assert_same_steps(one, records(tmp_path / "tp2-ep2"), STEPS)


def test_experts_split_over_ranks_train_and_resume_like_one_process(tmp_path, corpus_cache, one):
    args = _args(corpus_cache)
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
    """dmoe-eval's loss of the run's last checkpoint, evaluated in this process."""
    from megatron_dmoe.inference.eval_cli import eval_main

    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        code = eval_main([str(run_dir), "--no-progress", "--device", "cpu"])
    assert code == 0, err.getvalue()[-3000:]
    return json.loads(out.getvalue())["loss"]
