"""dmoe-train with tensor parallelism on CPU (gloo, fp32), without Transformer Engine or apex:
10 steps of the tiny models at the same global batch and seed give one process's losses and
gradient norms (1e-4 relative): dense and MoE at TP = 2 with sequence parallelism, and MoE at
TP = 2 x EP = 2 x DP = 2 (expert parallelism folded over the tensor group)."""
from ep_runs import EP_KEY, assert_same_steps, records, train
from train_helpers import small_args

TP2_SP = ["parallel.tensor_model_parallel_size=2", "parallel.sequence_parallel=true"]
STEPS = list(range(1, 11))


def test_tensor_parallel_trains_like_one_process(tmp_path, corpus_cache):
    args = small_args(corpus_cache, 10, "checkpoint.save_interval=0")
    dense = [*args, "moe.num_experts=0"]
    train(1, tmp_path / "dense", *dense, device="cpu")
    train(2, tmp_path / "dense-tp2", *dense, *TP2_SP, device="cpu")
    assert_same_steps(records(tmp_path / "dense"), records(tmp_path / "dense-tp2"), STEPS)

    train(1, tmp_path / "moe", *args, device="cpu")
    one = records(tmp_path / "moe")
    assert sorted(one) == STEPS
    train(2, tmp_path / "moe-tp2", *args, *TP2_SP, device="cpu")
    assert_same_steps(one, records(tmp_path / "moe-tp2"), STEPS)
    train(4, tmp_path / "moe-tp2-ep2", *args, *TP2_SP, f"{EP_KEY}=2", device="cpu")
    assert_same_steps(one, records(tmp_path / "moe-tp2-ep2"), STEPS)
