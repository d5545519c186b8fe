"""The global aux loss over 2 gloo ranks equals the loss over both ranks' tokens at once."""
from global_aux_case import check_two_ranks
from process_group import run_in_processes


def test_global_aux_loss_over_two_ranks():
    run_in_processes(2, check_two_ranks)
