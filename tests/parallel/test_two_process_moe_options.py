"""In 2 gloo processes: the global aux loss over both ranks equals the loss over both ranks' tokens
at once (tests/moe/global_aux_case.py); upcycling at expert-parallel size 2 gives each rank its
share of the dense MLP pieces and the dense model's loss (upcycle_checks.py)."""
from process_group import run_in_processes
from two_process_checks import run_all


def test_global_aux_loss_and_upcycling_over_two_ranks(tmp_path):
    run_in_processes(2, run_all, str(tmp_path / "dense"))
