"""Expert-parallel training on 2 GPUs with captured layers (training.cuda_graphs: true): the
captured run replays the eager one's losses and grad norms, over the symmetric exchange `auto`
picks on one host and over NVSHMEM. Weight-gradient windows: test_ep_nccl_window.py."""
import pytest

from ep_runs import (
    EP_KEY,
    GPU_TRAINING,
    assert_captured_run_matches_eager,
    needs_gpus,
)
from train_helpers import SMALL

pytestmark = pytest.mark.gpu


@needs_gpus(2)
@pytest.mark.parametrize("exchange", ["auto", "nvshmem"])
def test_two_gpu_expert_parallel_training_with_layer_graphs_matches_eager(tmp_path, corpus_cache, exchange):
    """training.cuda_graphs with EP = 2 (the symmetric exchange auto picks on one host): the captured
    layers replay the eager run's losses and grad norms step for step; so do they over the NVSHMEM
    exchange (the across-hosts path, forced here)."""
    args = SMALL + GPU_TRAINING + ["training.train_iters=5", "training.eval_interval=0",
                                   "checkpoint.save_interval=0", f"data.cache_dir={corpus_cache}", f"{EP_KEY}=2",
                                   f"moe.ep_exchange={exchange}"]
    assert_captured_run_matches_eager(tmp_path, args)
