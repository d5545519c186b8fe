"""Expert-parallel training on 2 GPUs over the exchanges `auto` does not pick on one host (NCCL's
all-to-all, NVSHMEM): the losses, grad norms and expert loads of EP = 1 on the same 2 GPUs; and
expert weight gradients once per step train as once per micro-batch (test_ep_nccl_training.py's
setting)."""
import pytest

from ep_runs import EP_KEY, GPU_TRAINING, assert_same_steps, check_ep2_runs_match_ep1, needs_gpus, records, train
from train_helpers import SMALL

pytestmark = pytest.mark.gpu


@needs_gpus(2)
def test_two_gpu_expert_parallel_training_over_nccl_and_nvshmem_matches_ep1(tmp_path, corpus_cache):
    check_ep2_runs_match_ep1(tmp_path, corpus_cache, {"ep2-nccl": ["moe.ep_exchange=nccl"],
                                                      "ep2-nvshmem": ["moe.ep_exchange=nvshmem"]})


@needs_gpus(2)
def test_two_gpu_expert_gradients_once_per_step_train_like_once_per_micro_batch(tmp_path, corpus_cache):
    """EP = 2 over NCCL with the exchange auto picks (symmetric memory on one host), two
    micro-batches per rank and step: expert weight gradients once per step give the same steps."""
    args = SMALL + GPU_TRAINING + ["training.train_iters=3", "training.eval_interval=0",
                                   "checkpoint.save_interval=0", "training.micro_batch_size=2",
                                   f"data.cache_dir={corpus_cache}", f"{EP_KEY}=2"]
    train(2, tmp_path / "per-micro-batch", *args, device="cuda")
    train(2, tmp_path / "per-step", *args, "moe.expert_wgrad_per_step=true", device="cuda")
    one, two = records(tmp_path / "per-micro-batch"), records(tmp_path / "per-step")
    assert sorted(one) == sorted(two) == [1, 2, 3]
    assert_same_steps(one, two, one)
