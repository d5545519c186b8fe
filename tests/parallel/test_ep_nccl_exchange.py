"""The expert-parallel exchange on GPUs, one per process: the device-side exchanges (symmetric
memory, NVSHMEM) move what NCCL's all-to-all moves; the layer over them reads nothing on the host
(torch's sync-debug "error" mode) and replays as a CUDA graph. The layer against one process:
test_ep_nccl.py."""
import pytest

from ep_runs import needs_gpus
from exchange_checks import check_exchange_matches_nccl
from process_group import run_in_processes

pytestmark = pytest.mark.gpu


@needs_gpus(2)
@pytest.mark.parametrize("exchange", ["symmetric", "nvshmem"])
def test_device_side_exchange_matches_nccl_exchange_in_two_processes(exchange):
    run_in_processes(2, check_exchange_matches_nccl, 2, exchange, device="cuda", timeout=300)


@needs_gpus(4)
@pytest.mark.parametrize("exchange", ["symmetric", "nvshmem"])
def test_device_side_exchange_matches_nccl_exchange_in_four_processes(exchange):
    run_in_processes(4, check_exchange_matches_nccl, 4, exchange, device="cuda", timeout=300)


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
