"""train_step and evaluate (training/step.py) against a float64 hand computation: the masked-mean
loss over padded micro-batches, its mean over micro-batches and data-parallel ranks, the grad norm,
and two clipped AdamW steps of a bigram model (loss_checks), with megatron's Adam and with its
distributed optimizer, in one process and in two; the clip fires at every step of each."""
import pytest

from loss_checks import check_with_both_optimizers
from process_group import run_in_processes


def test_one_process_steps_and_evaluates_as_computed_by_hand(cpu_dist):
    check_with_both_optimizers()


@pytest.mark.slow
def test_two_data_parallel_processes_average_as_computed_by_hand():
    """With megatron's Adam, then with its distributed optimizer, in the same two processes."""
    run_in_processes(2, check_with_both_optimizers, timeout=240)
