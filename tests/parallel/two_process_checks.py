"""Checks of the newer MoE options that need 2 gloo processes, in one spawn (start-up dominates)."""
from global_aux_case import check_two_ranks
from upcycle_checks import check_upcycle_at_ep2


def run_all(run_dir: str) -> None:
    check_two_ranks()  # megatron's groups as the harness made them (data-parallel 2)
    check_upcycle_at_ep2(run_dir)  # re-initialises them with expert parallelism 2
