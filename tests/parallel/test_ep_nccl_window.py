"""Expert-parallel training on 2 GPUs with weight-gradient windows (moe.expert_wgrad_window): a
window of 2 trains eagerly as per-micro-batch gradients do, and captured as eagerly."""
import pytest

from ep_runs import (
    EP_KEY,
    GPU_TRAINING,
    assert_captured_run_matches_eager,
    assert_same_steps,
    needs_gpus,
    records,
    train,
)
from train_helpers import SMALL

pytestmark = pytest.mark.gpu


@needs_gpus(2)
def test_two_gpu_weight_gradient_windows_train_as_per_micro_batch_eager_and_captured(tmp_path, corpus_cache):
    """moe.expert_wgrad_window: 2 at EP = 2, two micro-batches per rank and step: eagerly the losses
    and grad norms of the gradients added once per micro-batch, and captured layers replay them."""
    args = SMALL + GPU_TRAINING + ["training.train_iters=5", "training.eval_interval=0", "checkpoint.save_interval=0",
                                   f"data.cache_dir={corpus_cache}", f"{EP_KEY}=2", "training.global_batch_size=16"]
    train(2, tmp_path / "per-micro-batch", *args, device="cuda")
    window = [*args, "moe.expert_wgrad_window=2"]
    assert_captured_run_matches_eager(tmp_path, window)
    expected, eager = records(tmp_path / "per-micro-batch"), records(tmp_path / "eager")
    assert sorted(expected) == sorted(eager) == [1, 2, 3, 4, 5]
    assert_same_steps(expected, eager, expected, keys=("loss",), rel=1e-5)
    assert_same_steps(expected, eager, expected, keys=("grad_norm",), rel=1e-4)
