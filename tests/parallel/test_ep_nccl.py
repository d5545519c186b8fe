"""The expert-parallel layer on GPUs, one per process: test_ep_layer.py's checks on the path that
real runs take (CUDA tensors, NCCL, the symmetric-memory exchange that `auto` picks on one host,
the Triton `sparse` backend that `auto` picks on CUDA). The EP layer's output and gradients equal
the single-process layer's (ep_layer_checks) in float32 with the sparse and reference backends,
and in bfloat16 with the sparse backend, over NCCL's all-to-all and over NVSHMEM (over symmetric
memory: test_ep_nccl_symmetric.py). The exchanges alone, host reads and graph replay:
test_ep_nccl_exchange.py; training over these layers: test_ep_nccl_training*.py,
test_ep_nccl_window.py and test_ep_nccl_graphs.py (several files, so that each fits one short GPU
call)."""
import pytest

from ep_gpu_layer_cases import FFN, HIDDEN, TOLERANCES, gpu_layer_cases
from ep_layer_checks import check_layer_cases
from ep_runs import needs_gpus
from process_group import run_in_processes

pytestmark = pytest.mark.gpu


@needs_gpus(2)
def test_layer_matches_single_process_layer_over_nccl_in_two_processes():
    cases = gpu_layer_cases(max_ep=2, exchanges=("nccl",))
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
def test_layer_over_nvshmem_matches_single_process_layer_in_two_processes():
    """The NVSHMEM exchange (the across-hosts path, forced on one host): processes of their own, since
    a process keeps the symmetric-memory backend it allocated with first."""
    cases = gpu_layer_cases(max_ep=2, exchanges=("nvshmem",))
    run_in_processes(2, check_layer_cases, cases, "cuda", HIDDEN, FFN, TOLERANCES, device="cuda", timeout=500)
