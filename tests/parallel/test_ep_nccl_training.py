"""Expert-parallel training on GPUs, one per process (NCCL, the Triton `sparse` backend, fp32,
eager): EP = 2 on 2 GPUs (also with the distributed optimizer) logs the losses, grad norms and
expert loads of EP = 1 on the same 2 GPUs; a checkpoint saved at EP = 4 on 4 GPUs resumes at EP = 2
on 2 and EP = 1 on 1. The other exchanges and per-step weight gradients:
test_ep_nccl_training_exchanges.py."""
import pytest

from ep_runs import GPU_TRAINING, check_ep2_runs_match_ep1, check_ep4_checkpoint_continues_at_ep2_and_ep1, needs_gpus

pytestmark = pytest.mark.gpu


@needs_gpus(2)
def test_two_gpu_expert_parallel_training_matches_ep1(tmp_path, corpus_cache):
    """The same 2-GPU world (2 data-parallel ranks) at EP = 1 and EP = 2: the same samples and
    global weights, so the same losses, grad norms and expert loads; the distributed optimizer
    (its state sharded over the data-parallel ranks, expert state over none at EP = 2) too. Over
    the other exchanges: test_ep_nccl_training_exchanges.py."""
    check_ep2_runs_match_ep1(tmp_path, corpus_cache,
                             {"ep2": [], "ep2-distopt": ["training.use_distributed_optimizer=true"]})


@needs_gpus(4)
@pytest.mark.timeout(900)
def test_checkpoint_from_ep4_on_four_gpus_continues_at_ep2_and_ep1(tmp_path, corpus_cache):
    check_ep4_checkpoint_continues_at_ep2_and_ep1(tmp_path, corpus_cache, *GPU_TRAINING, device="cuda")
