"""Pipeline parallelism end to end on CPU (gloo), through megatron-core's schedules: 10 steps at
PP = 2, PP = 2 with two virtual stages per rank (the interleaved schedule) and PP = 2 x EP = 2
log the one-process run's losses and grad norms (and its validation loss, evaluated through the
schedule too); a checkpoint saved at PP = 2 with the distributed optimizer, its MoE layers all on
the second stage, continues at PP = 2 as the run itself continued, and dmoe-eval reads the
interleaved run's checkpoint in one process."""
import json
import os
import shutil
import subprocess
import sys

from ep_runs import EP_KEY, assert_same_steps, records, train
from megatron_dmoe.training.checkpoint import LATEST, checkpoint_dir
from train_helpers import SMALL

PP_KEY = "parallel.pipeline_model_parallel_size"
VPP_KEY = "parallel.virtual_pipeline_model_parallel_size"
STEPS = list(range(1, 11))


def _args(corpus_cache, *extra):
    # four layers (two chunks of one layer per rank with virtual stages), four micro-batches a step
    return SMALL + ["model.num_layers=4", "training.micro_batch_size=2", "training.train_iters=10",
                    "training.eval_interval=0", "checkpoint.save_interval=0", f"data.cache_dir={corpus_cache}",
                    *extra]


def test_pipeline_and_interleaved_train_like_one_process_and_a_distopt_checkpoint_resumes(tmp_path, corpus_cache):
    # tied embeddings: the last stage's output layer is a copy of the first stage's embedding, kept
    # in step by megatron's embedding group (the other test unties them)
    # layers 0 and 1 dense: at PP = 2 the first stage (rank 0) holds no expert, and its distributed
    # optimizer's expert part no parameter; the interleaved run has an MoE layer on each rank
    evaluated = ("training.eval_interval=10", "training.eval_iters=1", "moe.first_dense_layers=2")
    train(1, tmp_path / "one", *_args(corpus_cache, *evaluated))
    train(2, tmp_path / "pp2", *_args(corpus_cache, f"{PP_KEY}=2", "checkpoint.save_interval=5",
                                      "checkpoint.keep_last=0", "moe.first_dense_layers=2",
                                      "training.use_distributed_optimizer=true"))
    train(2, tmp_path / "vpp", *_args(corpus_cache, f"{PP_KEY}=2", f"{VPP_KEY}=2", *evaluated,
                                      "checkpoint.save_interval=10"))
    one = records(tmp_path / "one")
    assert sorted(one) == STEPS
    for name in ("pp2", "vpp"):
        other = records(tmp_path / name)
        assert sorted(other) == STEPS, name
        assert_same_steps(one, other, STEPS)
        # every stage's MoE layers reach rank 0's log
        assert [r["moe_layers"] for r in other.values()] == [r["moe_layers"] for r in one.values()]
    vpp = records(tmp_path / "vpp")
    assert_same_steps(one, vpp, [10], keys=("val_loss",))

    evaluation = subprocess.run([sys.executable, "-m", "megatron_dmoe.inference.eval_cli", str(tmp_path / "vpp"),
                                 "--no-progress"], capture_output=True, text=True, timeout=300,
                                env=dict(os.environ, OMP_NUM_THREADS="1"))
    assert evaluation.returncode == 0, evaluation.stderr[-3000:]
    assert abs(json.loads(evaluation.stdout)["loss"] - vpp[10]["val_loss"]) <= 1e-5 * vpp[10]["val_loss"]

    # the experts' Adam step comes from the common state rank 0 saved (step 7 on depends on it)
    run_dir = tmp_path / "from_pp2"
    shutil.copytree(checkpoint_dir(tmp_path / "pp2" / "checkpoints", 5), checkpoint_dir(run_dir / "checkpoints", 5))
    (run_dir / "checkpoints" / LATEST).write_text("5")
    shutil.copy(tmp_path / "pp2" / "config.yaml", run_dir / "config.yaml")
    train(2, run_dir, "--resume", "checkpoint.save_interval=0")
    continued = records(run_dir)
    assert sorted(continued) == STEPS[5:]
    assert_same_steps(records(tmp_path / "pp2"), continued, STEPS[5:])


def test_pipeline_with_expert_parallel_trains_like_one_process(tmp_path, corpus_cache):
    train(1, tmp_path / "one", *_args(corpus_cache, "model.untie_embeddings_and_output_weights=true"))
    train(4, tmp_path / "pp2ep2", *_args(corpus_cache, "model.untie_embeddings_and_output_weights=true",
                                         f"{PP_KEY}=2", f"{EP_KEY}=2"))
    one, other = records(tmp_path / "one"), records(tmp_path / "pp2ep2")
    assert sorted(one) == sorted(other) == STEPS
    assert_same_steps(one, other, STEPS)
