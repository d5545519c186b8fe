"""Tensor parallelism without Transformer Engine or apex, in 2 gloo processes: every gradient of
the GPT model (dense and MoE, with sequence parallelism, expert parallelism folded over the
tensor group) equals one process's in float64 (tensor_parallel_checks)."""
from process_group import run_in_processes
from tensor_parallel_checks import check_all_cases


def test_tensor_parallel_gradients_equal_one_process():
    run_in_processes(2, check_all_cases)
