"""test_ep_nccl.py's layer cases over the symmetric-memory exchange, the one `auto` picks on one
host: the expert-parallel layer's output and gradients equal the single-process layer's."""
import pytest

from ep_gpu_layer_cases import FFN, HIDDEN, TOLERANCES, gpu_layer_cases
from ep_layer_checks import check_layer_cases
from ep_runs import needs_gpus
from process_group import run_in_processes

pytestmark = pytest.mark.gpu


@needs_gpus(2)
def test_layer_matches_single_process_layer_over_symmetric_memory_in_two_processes():
    cases = gpu_layer_cases(max_ep=2, exchanges=("symmetric",))
    assert {case["ep"] for case in cases.values()} == {2}
    run_in_processes(2, check_layer_cases, cases, "cuda", HIDDEN, FFN, TOLERANCES, device="cuda", timeout=500)
