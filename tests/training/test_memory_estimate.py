"""The start-up memory estimate: each term against a hand computation, the parameter term against
built models, the zoo's Small models against the 80 GB card, and the refusal's one line."""
import pytest

from megatron_dmoe.config import ConfigError, load_config, resolve, validate
from megatron_dmoe.config.environment import megatron_core_release
from megatron_dmoe.training import memory_estimate as me
from train_helpers import snapshot

H100_80GB = 85_031_714_816  # total_memory of an H100 80GB HBM3, as torch reports it


def _cfg(*overrides):
    return resolve(load_config(None, ["training.device=cpu", *overrides]))


# a 3-layer model whose first layer is dense: h 64, 4 heads, ffn 256, 8 experts of 128, top-2
TINY = ["model.num_layers=3", "model.hidden_size=64", "model.num_attention_heads=4", "model.ffn_hidden_size=256",
        "model.seq_length=32", "moe.num_experts=8", "moe.top_k=2", "moe.ffn_hidden_size=128",
        "moe.first_dense_layers=1", "moe.block_size=64", "training.micro_batch_size=2", "training.global_batch_size=4"]


def test_parameters_by_hand():
    cfg = _cfg(*TINY)
    h, vocab = 64, 128  # 100 padded to 128
    attention = 3 * h * h + 3 * h + h * h + h + 2 * 2 * h  # qkv, proj (with biases), two LayerNorms
    dense = 256 * h + 256 + h * 256 + h
    moe_layer = 8 * h + 2 * 8 * 128 * h  # router; w1, w2 of 8 experts (no biases)
    embeddings = vocab * h + 32 * h  # words, positions (tied output layer)
    expected = 3 * attention + dense + 2 * moe_layer + embeddings + 2 * h  # + the final LayerNorm
    assert me.rank_parameters(cfg, 100) == (expected, 2 * 2 * 8 * 128 * h)


def test_weights_grads_optimizer_by_precision_and_layout():
    params, experts = me.rank_parameters(_cfg(*TINY), 100)
    fp32 = me.estimate_memory(_cfg(*TINY), 100, on_cuda=False)
    assert (fp32.weights, fp32.grads, fp32.optimizer, fp32.parameters) == (4 * params, 4 * params, 8 * params, params)
    bf16 = me.estimate_memory(_cfg(*TINY, "training.bf16=true"), 100)
    # bf16 weights, fp32 main_grad, fp32 master weights and two moments
    assert (bf16.weights, bf16.grads, bf16.optimizer) == (2 * params, 4 * params, 12 * params)
    # the distributed optimizer on 4 ranks with EP 2: dense state over 4 data-parallel ranks, the experts'
    # over 2 expert-data-parallel ranks, each holding half of the experts
    cfg = _cfg(*TINY, "training.bf16=true", "training.use_distributed_optimizer=true",
               "parallel.expert_model_parallel_size=2", "training.global_batch_size=8")
    params_ep, experts_ep = me.rank_parameters(cfg, 100)
    assert experts_ep == experts // 2 and params_ep == params - experts // 2
    est = me.estimate_memory(cfg, 100, world_size=4)
    assert est.optimizer == 12 * ((params_ep - experts_ep) // 4 + experts_ep // 2)
    assert est.allowance == me.ALLOWANCE_BYTES and bf16.total == sum(
        (bf16.weights, bf16.grads, bf16.optimizer, bf16.activations, bf16.graphs, bf16.allowance))


def test_activations_by_hand():
    cfg = _cfg(*TINY, "training.bf16=true", "model.cross_entropy_loss_fusion=true")
    T, h, e = 2 * 32, 64, 2
    attention = (5 * T * h + T * 3 * h) * e + 4 * T * 4  # five [T, h] copies, qkv, the norms' statistics
    dense, dense_transient = me.layer_activations(cfg, moe=False, on_cuda=True)
    assert dense == attention + T * 256 * 2 * e
    assert dense_transient == 2 * T * 256 * e + T * h * e
    # block-sparse buffers: T*k routed copies + E*(block-1) rows
    rows = T * 2 + 8 * 63
    assert me.sparse_rows(cfg, T) == rows
    moe, moe_transient = me.layer_activations(cfg, moe=True, on_cuda=True)
    router = 2 * T * 8 * 4 + T * 2 * 16
    assert moe == attention + (rows * h + 2 * rows * 128) * e + router
    assert moe_transient == (2 * rows * h + 2 * rows * 128) * e
    # moe.memory_optimized recomputes the activation: one [rows, width] buffer fewer
    optimized, _ = me.layer_activations(_cfg(*TINY, "training.bf16=true", "moe.memory_optimized=true"), True, True)
    assert moe - optimized == rows * 128 * e
    # the fused loss keeps the bf16 logits only; megatron's unfused one an fp32 softmax besides
    assert me.logits_bytes(cfg, 100, on_cuda=True) == T * 128 * e
    assert me.logits_bytes(cfg, 100, on_cuda=False) == T * 128 * (e + 8)
    head = T * 128 * e + 2 * T * h * e + 128 * h * e  # logits, the final norm's tensors, the output gradient
    peak, layers = me.rank_activations(cfg, 100, 0, 1, on_cuda=True)
    assert layers == dense + 2 * moe
    assert peak == max(head, dense_transient, moe_transient) == moe_transient  # tiny vocabulary: a layer's
    eager = me.estimate_memory(cfg, 100)
    assert eager.activations == peak + layers and eager.graphs == 0
    # captured layers: what they keep lives in the graphs' pool, the total is the same
    graphs = me.estimate_memory(cfg, 100, graphs=True)
    assert (graphs.activations, graphs.graphs, graphs.total) == (peak, layers, eager.total)
    # full recompute keeps each layer's input and, for a moment, one layer's all
    full = me.rank_activations(_cfg(*TINY, "training.bf16=true", "model.cross_entropy_loss_fusion=true",
                                    "training.recompute_granularity=full"), 100, 0, 1, on_cuda=True)
    assert full == (moe + moe_transient, 3 * T * h * e)


@pytest.mark.parametrize("overrides", [
    [],
    ["model.activation=swiglu", "model.normalization=RMSNorm", "model.add_bias_linear=false",
     "model.num_query_groups=2", "model.position_embedding_type=rope", "model.untie_embeddings_and_output_weights=true",
     "moe.shared_expert_ffn_hidden_size=128", "moe.shared_expert_gate=true", "moe.layer_freq=2",
     "moe.first_dense_layers=0"],
    ["model.qk_layernorm=true", "model.kv_channels=32"],  # a norm per head of queries and keys, wider heads
    ["model.qk_layernorm=true", "model.qk_layernorm_scope=projection", "model.normalization=RMSNorm",
     "model.num_query_groups=2"],
    # multi-latent attention, with a query latent and latent norms, and without either
    ["model.multi_latent_attention=true", "model.position_embedding_type=rope", "model.normalization=RMSNorm",
     "model.qk_layernorm=true", "model.q_lora_rank=24", "model.kv_lora_rank=16", "model.qk_head_dim=8",
     "model.qk_pos_emb_head_dim=4", "model.v_head_dim=12"],
    ["model.multi_latent_attention=true", "model.position_embedding_type=rope", "model.kv_lora_rank=16",
     "model.qk_head_dim=8", "model.qk_pos_emb_head_dim=4", "model.v_head_dim=12"],
])
@pytest.mark.slow
def test_parameter_term_equals_a_built_model(cpu_dist, overrides):
    from megatron_dmoe.model.gpt import build_gpt_model

    cfg = _cfg(*TINY, *overrides)
    if "model.qk_layernorm_scope=projection" in overrides and megatron_core_release() >= (0, 19):
        with pytest.raises(ConfigError, match="model.qk_layernorm_scope: projection"):
            validate(cfg, world_size=1)  # megatron-core 0.19 builds per-head query/key norms only
        return
    validate(cfg, world_size=1)
    model = build_gpt_model(cfg, vocab_size=100, on_cuda=False)
    built = sum(p.numel() for p in model.parameters())
    experts = sum(p.numel() for n, p in model.named_parameters() if ".experts." in n)
    assert me.rank_parameters(cfg, 100) == (built, experts)
    assert me.estimate_memory(cfg, 100, on_cuda=False).parameters == built


def test_pipeline_ranks_hold_their_layers_and_the_largest_counts():
    cfg = _cfg(*TINY, "model.num_layers=4", "parallel.pipeline_model_parallel_size=2", "training.bf16=true",
               "training.global_batch_size=8")
    first, _ = me.rank_parameters(cfg, 100, pp_rank=0)
    last, _ = me.rank_parameters(cfg, 100, pp_rank=1)
    whole, _ = me.rank_parameters(_cfg(*TINY, "model.num_layers=4"), 100)
    assert first + last == whole + 128 * 64  # the last stage's copy of the tied embedding
    ranks = [me.estimate_rank(cfg, 100, 2, r) for r in (0, 1)]
    assert me.estimate_memory(cfg, 100, world_size=2).total == max(r.total for r in ranks)


def _zoo(name, *overrides):
    return resolve(load_config(name, ["training.device=cpu", *overrides]))


@pytest.mark.parametrize("overrides, refused", [
    (["moe.first_dense_layers=0"], True),  # every layer MoE at micro-batch 32: 74.8 GiB eagerly, then out of memory
    (["moe.first_dense_layers=0", "training.micro_batch_size=16"], False),
    ([], False),  # as shipped: 59.4 GiB
])
def test_zoo_dmoe_small_on_an_80gb_card(overrides, refused):
    cfg = _zoo("zoo/dmoe_small", *overrides)
    if not refused:
        assert me.check_memory(cfg, me.known_vocab_size(cfg), 1, H100_80GB).startswith("memory: ~")
        return
    with pytest.raises(me.MemoryCheckError) as err:
        me.check_memory(cfg, me.known_vocab_size(cfg), 1, H100_80GB)
    line = str(err.value)
    assert "\n" not in line and "training.memory_check" in line
    assert "training.micro_batch_size=16" in line and "GPUs with parallel.expert_model_parallel_size=" in line


def test_memory_check_setting():
    cfg = _zoo("zoo/dmoe_small", "moe.first_dense_layers=0", "training.memory_check=false")
    assert me.check_memory(cfg, 32000, 1, H100_80GB).endswith("of 79.2 GiB")
    est = me.estimate_memory(cfg, 32000)
    assert me.memory_limit(cfg, H100_80GB) is None
    assert me.memory_limit(_zoo("zoo/dmoe_small"), 1000) == 900
    assert me.memory_limit(_zoo("zoo/dmoe_small", "training.memory_check=0.5"), 1000) == 500
    assert me.refusal(_zoo("zoo/dmoe_small", "training.memory_check=true"), est, 32000, 1, 2 * est.total) is None
    with pytest.raises(ConfigError, match="training.memory_check"):
        validate(_cfg("training.memory_check=1.5"), world_size=1)
    validate(_cfg("training.memory_check=0.8"), world_size=1)


def test_known_vocabulary():
    assert me.known_vocab_size(_cfg()) == 4096  # the built-in corpus's tokenizer
    assert me.known_vocab_size(_cfg("model.vocab_size=77")) == 77
    assert me.known_vocab_size(_cfg("data.tokenizer_type=NullTokenizer", "data.vocab_size=50")) == 51
    assert me.known_vocab_size(_cfg("data.data_path=[x]", "data.tokenizer_model=t.model")) is None


def test_a_refused_run_is_one_line_exit_2_before_anything(cli_run, tmp_path, monkeypatch):
    """The refusal reaches the command line as one line and exit status 2, before any data or model
    (the check is made to refuse here: tests/training/test_host_memory.py refuses for real)."""
    from megatron_dmoe.training import setup

    def refuse(cfg, env, vocab_size):
        raise me.MemoryCheckError("~90.0 GiB per GPU estimated (...), more than training.memory_check allows")

    monkeypatch.setattr(setup, "memory_line", refuse)
    monkeypatch.setattr(setup, "prepare_run_data", lambda *a: pytest.fail("data prepared before the check"))
    run = tmp_path / "run"
    result = cli_run(run, "model.num_layers=1", "logging.progress_bar=off")
    assert result.returncode == 2
    assert result.stderr.strip().splitlines() == [
        "dmoe-train: error: ~90.0 GiB per GPU estimated (...), more than training.memory_check allows"]
    assert snapshot(run) == {}


def test_expert_parallel_buffers_are_sized_by_the_exchange_receive_bound():
    """The device-side exchanges deliver into a buffer of ranks x T x k rows, and the sparse experts'
    padded buffers take that bound: at EP 2 on CUDA the MoE layer keeps those rows; over NCCL (split
    sizes read on the host) about T x k. The windows' slots are sized alike."""
    ep2 = [*TINY, "moe.backend=sparse", "parallel.expert_model_parallel_size=2"]
    tokens, k, h, e = 2 * 32, 2, 64, 4
    width, experts, block = 128, 4, 64  # 8 experts over 2 ranks; block 64 divides the width
    kept_symmetric, _ = me.moe_mlp_activations(_cfg(*ep2), on_cuda=True)
    kept_nccl, _ = me.moe_mlp_activations(_cfg(*ep2, "moe.ep_exchange=nccl"), on_cuda=True)
    bound_rows = 2 * tokens * k + experts * (block - 1)
    nccl_rows = tokens * k + experts * (block - 1)
    per_row = (h + 2 * width) * e  # the experts' input rows, pre-activation and activation
    exchange = tokens * k * h * e  # one more T x k rows of receive buffer
    assert kept_symmetric - kept_nccl == (bound_rows - nccl_rows) * per_row + exchange
    window = me.wgrad_window_bytes(_cfg(*ep2, "moe.expert_wgrad_window=2"), pp_rank=0, on_cuda=True)
    assert window == 2 * 2 * 2 * bound_rows * (width + h) * e  # 2 MoE layers x w1, w2 x 2 slots


def test_a_window_keeps_no_activation():
    """With weight-gradient windows the activation's backward recomputes the activation into its
    slot, so the forward keeps the experts' activation no longer: one rows x width less per layer."""
    cfg = [*TINY, "moe.backend=sparse"]
    kept, _ = me.moe_mlp_activations(_cfg(*cfg), on_cuda=True)
    kept_window, _ = me.moe_mlp_activations(_cfg(*cfg, "moe.expert_wgrad_window=2"), on_cuda=True)
    kept_memopt, _ = me.moe_mlp_activations(_cfg(*cfg, "moe.memory_optimized=true"), on_cuda=True)
    rows = me.sparse_rows(_cfg(*cfg), 2 * 32)
    assert kept - kept_window == rows * 128 * 4 and kept_window == kept_memopt


def test_per_step_weight_gradients_keep_the_micro_batches_of_one_data_parallel_rank():
    """moe.expert_wgrad_per_step keeps every micro-batch's weight-gradient operands until the step's
    end: at data-parallel 2 each rank runs half the step's micro-batches, so it keeps half of them."""
    cfg = _cfg(*TINY, "moe.backend=sparse", "training.global_batch_size=16", "training.micro_batch_size=2")
    per_step = _cfg(*TINY, "moe.backend=sparse", "training.global_batch_size=16", "training.micro_batch_size=2",
                    "moe.expert_wgrad_per_step=true")
    plain, _ = me.moe_mlp_activations(cfg, on_cuda=True)
    one = me.moe_mlp_activations(per_step, on_cuda=True, world_size=1)[0] - plain
    two = me.moe_mlp_activations(per_step, on_cuda=True, world_size=2)[0] - plain
    assert me.micro_batches_per_step(per_step, 1) == 8 and me.micro_batches_per_step(per_step, 2) == 4
    assert one == 2 * two > 0
    # the rank's whole estimate follows
    assert (me.rank_activations(per_step, 4096, 0, 2, True)[1]
            < me.rank_activations(per_step, 4096, 0, 1, True)[1])


def test_fp8_experts_keep_their_activation_and_weight_copies():
    """training.fp8 with a weight-gradient window: the activation is kept (the fp8 products do not
    store into the windows' slots), and each forward keeps the weights' e4m3 copies (one byte an
    element), which the backward makes again in the other layouts."""
    base = [*TINY, "moe.backend=sparse", "moe.expert_wgrad_window=2"]
    plain, fp8 = (me.moe_mlp_activations(_cfg(*base, *extra), on_cuda=True)
                  for extra in ([], ["training.fp8=blockwise"]))
    rows = me.sparse_rows(_cfg(*base), 2 * 32)
    copies = 8 * 128 * 64 * 2  # w1 and w2 of 8 experts of 128 x 64
    assert fp8[0] - plain[0] == rows * 128 * 4 + copies  # fp32 on CPU: the activation's 4 bytes
    assert fp8[1] - plain[1] == copies
