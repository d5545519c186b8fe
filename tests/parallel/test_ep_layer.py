"""Expert parallelism in 4 gloo processes, against the single-process layer and global quantities.

One spawn runs every check (process start-up dominates the time on two cores):
  * the EP layer's output and every gradient equal the single-process layer's (ep_layer_checks),
    for EP = 2 (two expert-parallel groups) and 4, whole experts and FFNs split over ranks, top-1
    and top-k, experts and whole ranks that receive no token, padding, both expert backends;
  * the clipping norm is the global gradient norm; initialisation does not depend on EP; the
    experts' checkpoint tensors are indexed globally and written once (ep_state_checks).
"""
from ep_state_checks import check_layer_and_state
from process_group import run_in_processes


def test_expert_parallel_layer_and_state_in_four_processes():
    run_in_processes(4, check_layer_and_state)
