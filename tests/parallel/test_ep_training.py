"""End-to-end expert parallelism: torchrun on CPU (gloo) trains like one process, and a checkpoint
saved at EP = 4 continues at EP = 2 and EP = 1 as the EP = 4 run itself continued."""
from ep_runs import (
    EP_KEY,
    assert_same_expert_loads,
    assert_same_steps,
    check_ep4_checkpoint_continues_at_ep2_and_ep1,
    records,
    train,
)
from train_helpers import SMALL


def test_two_process_expert_parallel_matches_one_process(tmp_path, corpus_cache):
    # a dense first layer (as the zoo's Small MoE models have): its MLP is replicated and reduced
    # over every rank while the MoE layer's experts are split, and both must train as in one process
    args = SMALL + ["training.train_iters=5", "training.eval_interval=0", "checkpoint.save_interval=0",
                    f"data.cache_dir={corpus_cache}", "moe.first_dense_layers=1"]
    train(1, tmp_path / "single", *args)
    train(2, tmp_path / "ep2", *args, f"{EP_KEY}=2")
    one, two = records(tmp_path / "single"), records(tmp_path / "ep2")
    assert sorted(one) == sorted(two) == [1, 2, 3, 4, 5]
    assert_same_steps(one, two, one)
    assert_same_expert_loads(one, two, assignments=8 * 64 * 2)  # 8 sequences of 64 tokens, top-2


def test_checkpoint_from_ep4_continues_at_ep2_and_ep1(tmp_path, corpus_cache):
    check_ep4_checkpoint_continues_at_ep2_and_ep1(tmp_path, corpus_cache)


def test_expert_parallel_gradients_once_per_step_train_like_once_per_micro_batch(tmp_path, corpus_cache):
    """EP = 2 on the block-sparse experts (interpreter), two micro-batches per rank and step: the
    experts' weight gradients added once per step give the per-micro-batch run's losses and grad
    norms (micro-batches receive different row counts from the exchange, so their topologies differ)."""
    # two steps: the second's loss already depends on the first update (the interpreter makes each
    # costly); 32 tokens a sequence: the interpreter runs a program per token in the permutations
    args = SMALL + ["training.train_iters=2", "training.eval_interval=0", "checkpoint.save_interval=0",
                    "training.micro_batch_size=2", "model.seq_length=32", "moe.backend=sparse", "moe.block_size=64",
                    f"data.cache_dir={corpus_cache}", f"{EP_KEY}=2"]
    train(2, tmp_path / "per-micro-batch", *args)
    train(2, tmp_path / "per-step", *args, "moe.expert_wgrad_per_step=true")
    one, two = records(tmp_path / "per-micro-batch"), records(tmp_path / "per-step")
    assert sorted(one) == sorted(two) == [1, 2]
    assert_same_steps(one, two, one)
