"""The expert-parallel layer on GPUs, one per process: test_ep_layer.py's checks on the path that
real runs take (CUDA tensors, NCCL, the symmetric-memory exchange that `auto` picks on one host,
the Triton `sparse` backend that `auto` picks on CUDA). The EP layer's output and gradients equal
the single-process layer's (ep_layer_checks) in float32 with the sparse and reference backends,
and in bfloat16 with the sparse backend, each with both expert exchanges (NCCL all-to-all and
symmetric memory); the device-side exchanges match NCCL's; the layer reads nothing on the host and
replays as a CUDA graph. Training over these layers: test_ep_nccl_training.py and
test_ep_nccl_graphs.py (one file each, so that each fits one short GPU call)."""
import pytest
import torch

from ep_layer_checks import LAYER_CASES, check_layer_cases
from ep_runs import needs_gpus
from exchange_checks import check_exchange_matches_nccl
from process_group import run_in_processes

pytestmark = pytest.mark.gpu


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
