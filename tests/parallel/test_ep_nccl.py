"""Expert parallelism on GPUs, one per process: the checks of test_ep_layer.py and
test_ep_training.py on the path that real runs take (CUDA tensors, NCCL, the symmetric-memory
exchange that `auto` picks on one host, the Triton `sparse` backend that `auto` picks on CUDA,
megatron-core's optimizer and its distributed variant).

  * layer: the EP layer's output and gradients equal the single-process layer's (ep_layer_checks)
    in float32 with the sparse and reference backends, and in bfloat16 with the sparse backend,
    each with both expert exchanges (NCCL all-to-all and symmetric memory);
  * training: EP = 2 on 2 GPUs (also with the distributed optimizer) logs the losses and grad norms
    of EP = 1 on the same 2 GPUs;
  * checkpoints: saved at EP = 4 on 4 GPUs, resumed at EP = 2 on 2 and EP = 1 on 1.
"""
import pytest
import torch

from ep_layer_checks import LAYER_CASES, check_layer_cases
from ep_runs import (
    EP_KEY,
    assert_captured_run_matches_eager,
    assert_same_expert_loads,
    assert_same_steps,
    check_ep4_checkpoint_continues_at_ep2_and_ep1,
    records,
    train,
)
from exchange_checks import check_exchange_matches_nccl
from process_group import run_in_processes
from train_helpers import SMALL

pytestmark = pytest.mark.gpu


def needs_gpus(count):
    return pytest.mark.skipif(torch.cuda.device_count() < count,
                              reason=f"needs {count} CUDA GPUs (one per process), found {torch.cuda.device_count()}")


# The sparse kernels need each rank's expert width to be a multiple of 16: 128 / 4 ranks = 32.
HIDDEN, FFN = 64, 128
# fp32 products are full precision in both backends (no TF32), so only summation order differs;
# bf16 keeps 8 significant bits.
TOLERANCES = {torch.float32: 1e-4, torch.bfloat16: 3e-2}
# the CPU cases' memory-optimised case pins the grouped backend; this one runs on the two here
MEMORY_OPTIMIZED = {"ep2-E4-top2-memopt-swiglu-rank1-idle": dict(ep=2, E=4, k=2, activation="swiglu",
                                                                   memory_optimized=True, dead=[2, 3], aux=0.05)}
BF16_CASES = ("ep2-E4-top2-padding", "ep4-E2-split2-top2-swiglu")


def gpu_layer_cases(max_ep, exchanges=("nccl", "symmetric")):
    """The CPU cases that fit in `max_ep` processes, each in float32 with both backends, and the
    BF16_CASES among them in bfloat16 with the sparse backend; every one with each of `exchanges`."""
    base = {name: case for name, case in {**LAYER_CASES, **MEMORY_OPTIMIZED}.items()
            if case["ep"] <= max_ep and "backend" not in case}
    cases = {}
    for name, case in base.items():
        for exchange in exchanges:
            for backend in ("sparse", "reference"):
                cases[f"{name}-{backend}-fp32-{exchange}"] = dict(case, backend=backend, dtype=torch.float32,
                                                                  exchange=exchange)
            if name in BF16_CASES:
                cases[f"{name}-sparse-bf16-{exchange}"] = dict(case, backend="sparse", dtype=torch.bfloat16,
                                                               exchange=exchange)
    return cases


@needs_gpus(2)
def test_layer_matches_single_process_layer_over_nccl_in_two_processes():
    cases = gpu_layer_cases(max_ep=2)
    assert {case["ep"] for case in cases.values()} == {2}
    run_in_processes(2, check_layer_cases, cases, "cuda", HIDDEN, FFN, TOLERANCES, device="cuda", timeout=500)


@needs_gpus(4)
def test_layer_matches_single_process_layer_over_nccl_in_four_processes():
    """EP = 2 (two expert-parallel groups) and EP = 4: whole experts, FFNs split over 2 and 4 ranks,
    ranks that receive no token."""
    cases = gpu_layer_cases(max_ep=4)
    assert {case["ep"] for case in cases.values()} == {2, 4}
    assert any(case["ep"] == 4 and case["E"] == 2 for case in cases.values())
    run_in_processes(4, check_layer_cases, cases, "cuda", HIDDEN, FFN, TOLERANCES, device="cuda", timeout=500)


@needs_gpus(2)
@pytest.mark.parametrize("exchange", ["symmetric", "nvshmem"])
def test_device_side_exchange_matches_nccl_exchange_in_two_processes(exchange):
    run_in_processes(2, check_exchange_matches_nccl, 2, exchange, device="cuda", timeout=300)


@needs_gpus(4)
@pytest.mark.parametrize("exchange", ["symmetric", "nvshmem"])
def test_device_side_exchange_matches_nccl_exchange_in_four_processes(exchange):
    run_in_processes(4, check_exchange_matches_nccl, 4, exchange, device="cuda", timeout=300)


@needs_gpus(2)
def test_layer_over_nvshmem_matches_single_process_layer_in_two_processes():
    """The NVSHMEM exchange (the across-hosts path, forced on one host): processes of their own, since
    a process keeps the symmetric-memory backend it allocated with first."""
    cases = gpu_layer_cases(max_ep=2, exchanges=("nvshmem",))
    run_in_processes(2, check_layer_cases, cases, "cuda", HIDDEN, FFN, TOLERANCES, device="cuda", timeout=500)


# fp32 training with the block-sparse kernels (SMALL's expert width 128 is a multiple of tiny's block 64)
# eager unless a test captures: training.cuda_graphs: auto would capture where it can
GPU_TRAINING = ["moe.backend=sparse", "training.bf16=false", "training.cuda_graphs=false"]


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


@needs_gpus(2)
@pytest.mark.parametrize("exchange", ["symmetric", "nvshmem"])
def test_expert_parallel_layer_reads_nothing_on_the_host(exchange):
    """EP = 2 over a device-side exchange, bf16, sparse experts: forward + backward under torch's
    sync-debug "error" mode (any device-to-host synchronisation raises)."""
    from ep_graph_checks import check_no_host_sync

    run_in_processes(2, check_no_host_sync, exchange, device="cuda", timeout=300)


@needs_gpus(2)
@pytest.mark.parametrize("exchange", ["symmetric", "nvshmem"])
def test_expert_parallel_layer_captures_as_a_cuda_graph(exchange):
    from ep_graph_checks import check_graph_replay_equals_eager

    run_in_processes(2, check_graph_replay_equals_eager, exchange, device="cuda", timeout=300)


@needs_gpus(2)
def test_two_gpu_weight_gradient_windows_train_as_per_micro_batch_eager_and_captured(tmp_path, corpus_cache):
    """moe.expert_wgrad_window: 2 at EP = 2, two micro-batches per rank and step: eagerly the losses
    and grad norms of the gradients added once per micro-batch, and captured layers replay them."""
    args = SMALL + GPU_TRAINING + ["training.train_iters=5", "training.eval_interval=0", "checkpoint.save_interval=0",
                                   f"data.cache_dir={corpus_cache}", f"{EP_KEY}=2", "training.global_batch_size=16"]
    train(2, tmp_path / "per-micro-batch", *args, device="cuda")
    window = [*args, "moe.expert_wgrad_window=2"]
    assert_captured_run_matches_eager(tmp_path, window)
    expected, eager = records(tmp_path / "per-micro-batch"), records(tmp_path / "eager")
    assert sorted(expected) == sorted(eager) == [1, 2, 3, 4, 5]
    assert_same_steps(expected, eager, expected, keys=("loss",), rel=1e-5)
    assert_same_steps(expected, eager, expected, keys=("grad_norm",), rel=1e-4)


@needs_gpus(2)
@pytest.mark.parametrize("exchange", ["auto", "nvshmem"])
def test_two_gpu_expert_parallel_training_with_layer_graphs_matches_eager(tmp_path, corpus_cache, exchange):
    """training.cuda_graphs with EP = 2 (the symmetric exchange auto picks on one host): the captured
    layers replay the eager run's losses and grad norms step for step; so do they over the NVSHMEM
    exchange (the across-hosts path, forced here)."""
    args = SMALL + GPU_TRAINING + ["training.train_iters=5", "training.eval_interval=0",
                                   "checkpoint.save_interval=0", f"data.cache_dir={corpus_cache}", f"{EP_KEY}=2",
                                   f"moe.ep_exchange={exchange}"]
    assert_captured_run_matches_eager(tmp_path, args)
