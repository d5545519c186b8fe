"""Expert-parallel training on GPUs, one per process (NCCL, the Triton `sparse` backend, fp32,
eager): EP = 2 on 2 GPUs (also with the distributed optimizer and each exchange) logs the losses,
grad norms and expert loads of EP = 1 on the same 2 GPUs; expert weight gradients once per step
train as once per micro-batch; a checkpoint saved at EP = 4 on 4 GPUs resumes at EP = 2 on 2 and
EP = 1 on 1."""
import pytest

from ep_runs import (
    EP_KEY,
    GPU_TRAINING,
    assert_same_expert_loads,
    assert_same_steps,
    check_ep4_checkpoint_continues_at_ep2_and_ep1,
    needs_gpus,
    records,
    train,
)
from train_helpers import SMALL

pytestmark = pytest.mark.gpu


@needs_gpus(2)
def test_two_gpu_expert_parallel_training_matches_ep1(tmp_path, corpus_cache):
    """The same 2-GPU world (2 data-parallel ranks) at EP = 1 and EP = 2: the same samples and
    global weights, so the same losses, grad norms and expert loads; the distributed optimizer
    (its state sharded over the data-parallel ranks, expert state over none at EP = 2) too, and
    the NCCL exchange as well as the symmetric one that auto picks."""
    args = SMALL + GPU_TRAINING + ["training.train_iters=5", "training.eval_interval=0",
                                   "checkpoint.save_interval=0", f"data.cache_dir={corpus_cache}"]
    train(2, tmp_path / "ep1", *args, f"{EP_KEY}=1", device="cuda")
    train(2, tmp_path / "ep2", *args, f"{EP_KEY}=2", device="cuda")
    train(2, tmp_path / "ep2-distopt", *args, f"{EP_KEY}=2", "training.use_distributed_optimizer=true",
          device="cuda")
    train(2, tmp_path / "ep2-nccl", *args, f"{EP_KEY}=2", "moe.ep_exchange=nccl", device="cuda")
    train(2, tmp_path / "ep2-nvshmem", *args, f"{EP_KEY}=2", "moe.ep_exchange=nvshmem", device="cuda")
    one = records(tmp_path / "ep1")
    assert sorted(one) == [1, 2, 3, 4, 5]
    for run in ("ep2", "ep2-distopt", "ep2-nccl", "ep2-nvshmem"):
        other = records(tmp_path / run)
        assert sorted(other) == sorted(one), run
        assert_same_steps(one, other, one)
        assert_same_expert_loads(one, other, assignments=8 * 64 * 2)  # 8 sequences of 64 tokens, top-2


@needs_gpus(4)
@pytest.mark.timeout(900)
def test_checkpoint_from_ep4_on_four_gpus_continues_at_ep2_and_ep1(tmp_path, corpus_cache):
    check_ep4_checkpoint_continues_at_ep2_and_ep1(tmp_path, corpus_cache, *GPU_TRAINING, device="cuda")


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
