"""Megatron's parallel layouts on two GPUs, one per process (NCCL), against one GPU: the layouts,
the run both sides make and the checks, shared by the test_two_gpu_layouts*.py files (one file per
precision and two for captured layers, so that each fits one short GPU call)."""
import pytest
import torch

from ep_runs import EP_KEY, assert_captured_run_matches_eager, assert_same_steps, records, train
from train_helpers import small_args

STEPS = list(range(1, 21))
LAYOUTS = {
    "tp2-sp": ["parallel.tensor_model_parallel_size=2", "parallel.sequence_parallel=true"],
    "pp2": ["parallel.pipeline_model_parallel_size=2"],
    "pp2-vpp2": ["parallel.pipeline_model_parallel_size=2", "parallel.virtual_pipeline_model_parallel_size=2"],
    "ep2-distopt": [f"{EP_KEY}=2", "training.use_distributed_optimizer=true"],
    # every expert's FFN split over the two tensor ranks (expert tensor parallelism)
    "tp2-sp-etp2": ["parallel.tensor_model_parallel_size=2", "parallel.sequence_parallel=true",
                    "parallel.expert_tensor_parallel_size=2"],
}
DTYPES = {"fp32": (["training.bf16=false"], 1e-4), "bf16": (["training.bf16=true"], 2e-2)}
# four layers (two virtual stages of one layer per pipeline rank), four micro-batches at one GPU;
# weights initialised whole on the CPU, so every layout starts from the same model
BASE = ["model.use_cpu_initialization=true", "model.num_layers=4", "training.micro_batch_size=2",
        "training.global_batch_size=8", "moe.backend=sparse", "checkpoint.save_interval=0",
        "training.cuda_graphs=false"]
# captured against eager: two files of two layouts each (test_two_gpu_layouts_graphs*.py)
GRAPH_LAYOUTS = {"tensor-expert": ["tp2-sp", "ep2-distopt"], "pipeline": ["pp2", "pp2-vpp2"]}


def needs_two_gpus():
    if torch.cuda.device_count() < 2:
        pytest.skip(f"needs 2 CUDA GPUs (one per process), found {torch.cuda.device_count()}")


def check_layouts_train_like_one_gpu(tmp_path, corpus_cache, dtype):
    """20 steps at the same global batch and seed: every layout's per-step losses and grad norms are
    one GPU's, within the precision's tolerance (fp32 1e-4, bf16 2e-2)."""
    needs_two_gpus()
    extra, rel = DTYPES[dtype]
    args = small_args(corpus_cache, len(STEPS), *BASE, *extra)
    train(1, tmp_path / "one", *args, device="cuda")
    one = records(tmp_path / "one")
    assert sorted(one) == STEPS
    for name, layout in LAYOUTS.items():
        train(2, tmp_path / name, *args, *layout, device="cuda")
        assert_same_steps(one, records(tmp_path / name), STEPS, rel=rel)


def check_captured_layout_matches_eager(tmp_path, corpus_cache, name):
    """With `training.cuda_graphs: true` the layout's captured run matches its eager one (losses
    within 1e-5, grad norms within 1e-4), fp32, 5 steps."""
    needs_two_gpus()
    args = small_args(corpus_cache, 5, *BASE, "training.bf16=false", *LAYOUTS[name])
    assert_captured_run_matches_eager(tmp_path, args)
