"""Megatron's four-GPU layouts, one GPU per process (NCCL), against one GPU: 10 steps of a small
dMoE (fp32, TF32 off) at the same global batch and seed give one GPU's per-step losses and grad
norms for TP 2 + SP x DP 2 x EP 2 with the distributed optimizer, TP 2 + SP x PP 2 x EP 2,
PP 2 x virtual 2 x DP 2 x EP 2, and DP 4 x EP 4 with the distributed optimizer. Only the float32
reduction order differs, so they agree to REL; the largest relative difference of each layout is
printed (pytest -s) for the record. One layout also runs captured (training.cuda_graphs: true)
and matches its eager run."""
import pytest
import torch

from ep_runs import EP_KEY, assert_captured_run_matches_eager, records, train
from train_helpers import small_args

pytestmark = pytest.mark.gpu

STEPS = list(range(1, 11))
REL = 1e-6
TP2_SP = ["parallel.tensor_model_parallel_size=2", "parallel.sequence_parallel=true"]
DISTOPT = ["training.use_distributed_optimizer=true"]
LAYOUTS = {
    "tp2-sp-dp2-ep2-distopt": [*TP2_SP, f"{EP_KEY}=2", *DISTOPT],
    "tp2-sp-pp2-ep2": [*TP2_SP, "parallel.pipeline_model_parallel_size=2", f"{EP_KEY}=2"],
    "pp2-vpp2-dp2-ep2": ["parallel.pipeline_model_parallel_size=2",
                         "parallel.virtual_pipeline_model_parallel_size=2", f"{EP_KEY}=2"],
    "dp4-ep4-distopt": [f"{EP_KEY}=4", *DISTOPT],
}
# four layers (two virtual stages of one layer per pipeline rank), eight micro-batches of 2 at one
# GPU; weights initialised whole on the CPU, so every layout starts from the same model
BASE = ["model.use_cpu_initialization=true", "model.num_layers=4", "training.micro_batch_size=2",
        "training.global_batch_size=16", "moe.backend=sparse", "checkpoint.save_interval=0",
        "training.cuda_graphs=false", "training.bf16=false"]


def _needs_four_gpus():
    if torch.cuda.device_count() < 4:
        pytest.skip(f"needs 4 CUDA GPUs (one per process), found {torch.cuda.device_count()}")


def largest_difference(expected, actual):
    """The largest |a - b| / |a| over the steps, for loss and grad norm."""
    assert sorted(expected) == sorted(actual) == STEPS, (sorted(expected), sorted(actual))
    return {key: max(abs(expected[s][key] - actual[s][key]) / abs(expected[s][key]) for s in STEPS)
            for key in ("loss", "grad_norm")}


def test_four_gpu_layouts_train_like_one_gpu(tmp_path, corpus_cache):
    _needs_four_gpus()
    args = small_args(corpus_cache, len(STEPS), *BASE)
    train(1, tmp_path / "one", *args, device="cuda")
    one = records(tmp_path / "one")
    worst = {}
    for name, layout in LAYOUTS.items():
        train(4, tmp_path / name, *args, *layout, device="cuda")
        worst[name] = largest_difference(one, records(tmp_path / name))
        print(f"{name}: largest relative difference from one GPU: loss {worst[name]['loss']:.2e}, "
              f"grad norm {worst[name]['grad_norm']:.2e}")
    assert all(d <= REL for diffs in worst.values() for d in diffs.values()), worst


def test_four_gpu_layout_captured_matches_eager(tmp_path, corpus_cache):
    _needs_four_gpus()
    args = small_args(corpus_cache, 5, *BASE, *LAYOUTS["tp2-sp-dp2-ep2-distopt"])
    assert_captured_run_matches_eager(tmp_path, args, nproc=4)
