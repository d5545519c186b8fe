"""A megatron-core GPTModel with our MoE layers, built from YAML, trains on CPU."""
import pytest
import torch
from megatron.core.models.gpt import GPTModel
from megatron.core.transformer.mlp import MLP
from megatron.core.transformer.transformer_layer import TransformerLayer

from megatron_dmoe.config import load_config, resolve, validate
from megatron_dmoe.model.gpt import build_gpt_model, padded_vocab_size
from megatron_dmoe.model.spec import dmoe_layer_spec
from megatron_dmoe.model.transformer_config import to_transformer_config
from megatron_dmoe.moe import MoELayer

YAML = """
model:
  num_layers: 2
  hidden_size: 32
  num_attention_heads: 4
  seq_length: 16
  vocab_size: 50
moe:
  num_experts: 4
  top_k: 2
  ffn_hidden_size: 64
  block_size: 64
training:
  train_iters: 20
  micro_batch_size: 4
  global_batch_size: 4
  lr_warmup_iters: 0
"""


def _config(tmp_path, *overrides):
    path = tmp_path / "run.yaml"
    path.write_text(YAML)
    cfg = resolve(load_config(str(path), list(overrides)))
    validate(cfg, world_size=1)
    return cfg


def _batch(cfg, vocab):
    g = torch.Generator().manual_seed(0)
    s, b = cfg.model.seq_length, cfg.training.micro_batch_size
    tokens = torch.randint(0, vocab, (b, s + 1), generator=g)
    return tokens[:, :-1], tokens[:, 1:], torch.arange(s).expand(b, s)


@pytest.mark.slow
def test_dmoe_gpt_from_yaml_learns_a_fixed_batch(cpu_dist, tmp_path):
    cfg = _config(tmp_path)
    model = build_gpt_model(cfg, vocab_size=50, on_cuda=False)
    assert isinstance(model, GPTModel)
    assert all(isinstance(layer.mlp, MoELayer) for layer in model.decoder.layers)
    assert model.embedding.word_embeddings.weight.shape[0] == padded_vocab_size(50, cfg) == 128
    tokens, labels, positions = _batch(cfg, 50)
    optimizer = torch.optim.AdamW(model.parameters(), lr=3e-3)
    losses = []
    for _ in range(20):
        optimizer.zero_grad()
        loss = model(tokens, positions, None, labels=labels).mean()
        loss.backward()
        for name, p in model.named_parameters():
            assert p.grad is not None and torch.isfinite(p.grad).all(), name
        optimizer.step()
        losses.append(loss.item())
    assert losses[-1] < 0.67 * losses[0], losses


def test_layer_freq_mixes_dense_and_moe_layers(cpu_dist, tmp_path):
    cfg = _config(tmp_path, "model.num_layers=4", "moe.layer_freq=2")
    model = build_gpt_model(cfg, vocab_size=50, on_cuda=False)
    kinds = [type(layer.mlp) for layer in model.decoder.layers]
    assert kinds == [MoELayer, MLP, MoELayer, MLP]


@pytest.mark.parametrize("freq, first_dense, expected", [(1, 2, "ddmm"), (2, 1, "ddmd"), (1, 0, "mmmm")])
@pytest.mark.slow
def test_first_dense_layers_keep_the_dense_mlp(cpu_dist, tmp_path, freq, first_dense, expected):
    cfg = _config(tmp_path, "model.num_layers=4", f"moe.layer_freq={freq}", f"moe.first_dense_layers={first_dense}")
    model = build_gpt_model(cfg, vocab_size=50, on_cuda=False)
    kinds = "".join("m" if isinstance(layer.mlp, MoELayer) else "d" for layer in model.decoder.layers)
    assert kinds == expected
    assert all(type(layer.mlp) is MLP for layer in model.decoder.layers if not isinstance(layer.mlp, MoELayer))
    # megatron-core's own form of the pattern: the integer, or one 0/1 per layer
    config = to_transformer_config(cfg, on_cuda=False)
    assert config.moe_layer_freq == (freq if not first_dense else [int(c == "m") for c in expected])


def test_dense_and_capacity_models_build_and_run(cpu_dist, tmp_path):
    for overrides in (["moe.num_experts=0"], ["moe.expert_capacity_factor=1.0"]):
        cfg = _config(tmp_path, *overrides)
        model = build_gpt_model(cfg, vocab_size=50, on_cuda=False)
        tokens, labels, positions = _batch(cfg, 50)
        loss = model(tokens, positions, None, labels=labels).mean()
        loss.backward()
        assert torch.isfinite(loss)


def test_megatron_lm_ready_spec_builds_from_transformer_config(cpu_dist, tmp_path):
    """pretrain_gpt.py --spec imports `dmoe_layer_spec` and hands it to GPTModel unchanged."""
    assert dmoe_layer_spec.module is TransformerLayer
    assert dmoe_layer_spec.submodules.mlp.module is MoELayer
    cfg = _config(tmp_path)
    config = to_transformer_config(cfg, on_cuda=False)
    model = GPTModel(config, dmoe_layer_spec, vocab_size=128, max_sequence_length=16)
    assert all(isinstance(layer.mlp, MoELayer) for layer in model.decoder.layers)
    assert model.decoder.layers[0].mlp.router.weight.shape == (4, 32)
    tokens, labels, positions = _batch(cfg, 50)
    assert torch.isfinite(model(tokens, positions, None, labels=labels).mean())


@pytest.mark.slow
def test_full_activation_recompute_gives_the_same_gradients(cpu_dist, tmp_path):
    from megatron_dmoe.moe import AuxLossScaler, run_state_of
    from megatron_dmoe.parallel.distributed import seed_everything

    grads, lb = [], []
    for granularity in ("null", "full"):
        cfg = _config(tmp_path, f"training.recompute_granularity={granularity}")
        seed_everything(7, cpu_dist)
        model = build_gpt_model(cfg, vocab_size=50, on_cuda=False)
        tokens, labels, positions = _batch(cfg, 50)
        AuxLossScaler.set_loss_scale(1.0)
        model(tokens, positions, None, labels=labels).mean().backward()
        grads.append({n: p.grad.clone() for n, p in model.named_parameters()})
        lb.append(run_state_of(model).metrics.snapshot()["lb_loss"])
    assert grads[0].keys() == grads[1].keys()
    for name in grads[0]:
        torch.testing.assert_close(grads[1][name], grads[0][name], rtol=1e-5, atol=1e-7, msg=name)
    assert lb[1] == pytest.approx(lb[0], rel=1e-6)  # recorded once per forward, not twice


@pytest.mark.parametrize("virtual", [None, 2])
def test_pipeline_exchange_is_the_one_the_cpu_runs_check(tmp_path, virtual):
    """The interleaved schedule's point-to-point exchange is the same on CUDA as on CPU, where the
    pipeline training tests run it: a batched exchange matches two ranks' messages in posting order
    (NCCL as gloo), which swaps activations and gradients when both neighbours are one rank (two
    stages); on two GPUs that trained with grad norms 6.6x one GPU's."""
    cfg = _config(tmp_path, "model.num_layers=4")
    cfg.parallel.pipeline_model_parallel_size = 2
    cfg.parallel.virtual_pipeline_model_parallel_size = virtual
    cpu, cuda = (to_transformer_config(cfg, on_cuda=on_cuda) for on_cuda in (False, True))
    assert cpu.batch_p2p_comm is False
    if virtual:
        exchange = (cuda.batch_p2p_comm, cuda.overlap_p2p_comm)
        assert exchange == (cpu.batch_p2p_comm, cpu.overlap_p2p_comm) == (False, True)
    else:
        assert (cuda.batch_p2p_comm, cuda.overlap_p2p_comm) == (True, False)


@pytest.mark.parametrize("dropout, ours", [(0.0, True), (0.1, False)])
@pytest.mark.slow
def test_selective_recompute_is_the_sdpa_attentions_own_without_dropout(cpu_dist, tmp_path, dropout, ours):
    """Without attention dropout the SDPA core attention checkpoints itself (capturable) and
    megatron's reentrant checkpoint is off; with dropout megatron's stays (it replays the RNG)."""
    from megatron_dmoe.model.attention import SDPAttention

    cfg = _config(tmp_path, "training.recompute_granularity=selective", f"model.attention_dropout={dropout}")
    model = build_gpt_model(cfg, vocab_size=50, on_cuda=False)
    attentions = [layer.self_attention for layer in model.decoder.layers]
    assert attentions and all(isinstance(a.core_attention, SDPAttention) for a in attentions)
    assert all(a.core_attention.recompute is ours for a in attentions)
    assert all(a.checkpoint_core_attention is not ours for a in attentions)
    tokens, labels, positions = _batch(cfg, 50)
    loss = model(tokens, positions, None, labels=labels).mean()
    loss.backward()  # trains either way
    assert all(p.grad is not None for p in model.parameters() if p.requires_grad)
