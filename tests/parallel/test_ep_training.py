"""End-to-end expert parallelism: torchrun on CPU (gloo) trains like one process (the sparse experts
at EP = 2, their weight gradients added once per step), and a checkpoint saved at EP = 4 continues
at EP = 2 and EP = 1 as the EP = 4 run itself continued."""
from ep_runs import (
    EP_KEY,
    assert_same_expert_loads,
    assert_same_steps,
    check_ep4_checkpoint_continues_at_ep2_and_ep1,
    records,
    train,
)
from train_helpers import SMALL


def test_two_process_expert_parallel_with_gradients_once_per_step_trains_like_one_process(tmp_path, corpus_cache):
    """EP = 2 on the block-sparse experts (interpreter), two micro-batches per rank and step, the
    experts' weight gradients added once per step, against one process that adds them once per
    micro-batch (on the grouped experts): the same losses, grad norms and expert loads. A dense
    first layer (as the zoo's Small MoE models have), then two MoE layers: the dense MLP is
    replicated and reduced over every rank while the experts are split, and both must train as in
    one process; the micro-batches receive different row counts from the exchange, so their
    topologies differ from step to step, layer to layer and rank to rank."""
    # two steps: the second's loss already depends on the first update (the interpreter makes each
    # costly); 32 tokens a sequence: the interpreter runs a program per token in the permutations
    args = SMALL + ["training.train_iters=2", "training.eval_interval=0", "checkpoint.save_interval=0",
                    "training.micro_batch_size=2", "model.seq_length=32", "moe.backend=sparse", "moe.block_size=64",
                    f"data.cache_dir={corpus_cache}", "model.num_layers=3", "moe.first_dense_layers=1"]
    # the one-process reference on the grouped experts (torch's grouped products, no interpreter):
    # the same sums as the sparse kernels' in another order
    train(1, tmp_path / "single", *args, "moe.backend=grouped")
    train(2, tmp_path / "ep2", *args, f"{EP_KEY}=2", "moe.expert_wgrad_per_step=true")
    one, two = records(tmp_path / "single"), records(tmp_path / "ep2")
    assert sorted(one) == sorted(two) == [1, 2]
    assert_same_steps(one, two, one)
    assert_same_expert_loads(one, two, assignments=8 * 32 * 2)  # 8 sequences of 32 tokens, top-2


def test_checkpoint_from_ep4_continues_at_ep2_and_ep1(tmp_path, corpus_cache):
    check_ep4_checkpoint_continues_at_ep2_and_ep1(tmp_path, corpus_cache)
