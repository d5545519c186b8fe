"""Teardown after a failure: the process groups are aborted, not destroyed gracefully (a graceful
NCCL teardown waits for peers stuck in a collective the failed rank will never join), and nothing
stays initialised. Gloo cannot show the hang itself; this checks the abort path in 2 processes."""
from process_group import run_in_processes


def _abort_after_failure() -> None:
    import torch.distributed as dist
    from megatron.core import parallel_state as ps

    from megatron_dmoe.parallel.distributed import destroy_distributed, init_distributed

    init_distributed("cpu", expert_model_parallel_size=2)
    destroy_distributed(abort=True)
    assert not dist.is_initialized() and not ps.model_parallel_is_initialized()


def test_abort_leaves_no_process_group_behind():
    run_in_processes(2, _abort_after_failure)
