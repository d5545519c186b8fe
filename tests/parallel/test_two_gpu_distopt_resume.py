"""A distributed-optimizer checkpoint whose first pipeline stage holds no MoE layer, on two GPUs
(NCCL, one per process): PP 2 with the first two of four layers dense, saved at step 3 and resumed
at PP 2, logs the losses and grad norms the run itself logged at steps 4 to 6 (step 5 on depends on
the experts' Adam step, which rank 0 saves without holding an expert). test_pipeline_training
checks this on CPUs with torch's Adam; here the step lives where the GPU's optimizer keeps it
(torch's fused Adam: on the device; Transformer Engine's or apex's FusedAdam, where installed: in
the parameter groups)."""
import shutil

import pytest
import torch

from ep_runs import assert_same_steps, records, train
from megatron_dmoe.training.checkpoint import LATEST, checkpoint_dir
from train_helpers import small_args

pytestmark = pytest.mark.gpu

STEPS = list(range(1, 7))
ARGS = ["model.use_cpu_initialization=true", "model.num_layers=4", "moe.first_dense_layers=2",
        "training.micro_batch_size=2", "training.global_batch_size=8", "training.bf16=false",
        "training.cuda_graphs=false", "parallel.pipeline_model_parallel_size=2",
        "training.use_distributed_optimizer=true"]


def test_distopt_checkpoint_of_a_stage_without_experts_resumes_on_two_gpus(tmp_path, corpus_cache):
    if torch.cuda.device_count() < 2:
        pytest.skip(f"needs 2 CUDA GPUs (one per process), found {torch.cuda.device_count()}")
    args = small_args(corpus_cache, len(STEPS), *ARGS)
    train(2, tmp_path / "pp2", *args, "checkpoint.save_interval=3", "checkpoint.keep_last=0", device="cuda")
    uninterrupted = records(tmp_path / "pp2")
    assert sorted(uninterrupted) == STEPS

    run_dir = tmp_path / "resumed"
    shutil.copytree(checkpoint_dir(tmp_path / "pp2" / "checkpoints", 3), checkpoint_dir(run_dir / "checkpoints", 3))
    (run_dir / "checkpoints" / LATEST).write_text("3")
    shutil.copy(tmp_path / "pp2" / "config.yaml", run_dir / "config.yaml")
    train(2, run_dir, "--resume", "checkpoint.save_interval=0", device="cuda")
    resumed = records(run_dir)
    assert sorted(resumed) == STEPS[3:]
    assert_same_steps(uninterrupted, resumed, STEPS[3:])
