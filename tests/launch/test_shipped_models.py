"""Every shipped config builds its model on CPU and runs forward and backward.

Sizes are cut down (layers, widths, sequence, expert count) so that the largest zoo entry builds in
a moment, but each config's structure is kept: dense or MoE, which layers are MoE (layer_freq),
activation, normalisation, position embedding, top-k, capacity factor. Sweep files are skipped.
"""
from pathlib import Path

import pytest
import torch
from megatron.core.transformer.mlp import MLP

from megatron_dmoe.config import load_config, resolve, validate
from megatron_dmoe.model.gpt import build_gpt_model
from megatron_dmoe.moe import MoELayer

CONFIGS_DIR = Path(__file__).resolve().parents[2] / "configs"
RUN_CONFIGS = sorted(p for p in CONFIGS_DIR.rglob("*.yaml") if "sweeps" not in p.parts)
VOCAB = 100

pytestmark = pytest.mark.slow  # every shipped config builds a model


def reduced(path):
    """The config at CPU-test size, and the original it came from."""
    original = resolve(load_config(str(path)))
    m, moe = original.model, original.moe
    overrides = [
        f"model.num_layers={max(2, 2 * moe.layer_freq) + moe.first_dense_layers}",
        "model.hidden_size=32", "model.num_attention_heads=4", "model.ffn_hidden_size=64",
        "model.seq_length=16", "model.max_position_embeddings=16",
        "training.micro_batch_size=2", "training.global_batch_size=2", "training.device=cpu",
        "training.bf16=false", "training.fp16=false", "training.use_distributed_optimizer=false",
        "parallel.tensor_model_parallel_size=1", "parallel.pipeline_model_parallel_size=1",
        "parallel.expert_model_parallel_size=1", "parallel.sequence_parallel=false",
    ]
    if m.num_query_groups != m.num_attention_heads:  # keep grouped-query attention
        overrides.append("model.num_query_groups=2")
    if moe.num_experts > 0:
        experts = min(moe.num_experts, max(4, 2 * moe.top_k))
        overrides += [f"moe.num_experts={experts}", "moe.ffn_hidden_size=64"]
    cfg = resolve(load_config(str(path), overrides))
    validate(cfg, world_size=1)  # a valid run on this machine
    return cfg, original


@pytest.mark.parametrize("path", RUN_CONFIGS, ids=lambda p: p.relative_to(CONFIGS_DIR).as_posix())
def test_shipped_config_builds_and_runs(path, cpu_dist):
    cfg, original = reduced(path)
    model = build_gpt_model(cfg, vocab_size=VOCAB, on_cuda=False)

    freq, moe = original.moe.layer_freq, original.moe
    expected = [moe.num_experts > 0 and i % freq == 0 and i >= moe.first_dense_layers
                for i in range(cfg.model.num_layers)]
    mlps = [layer.mlp for layer in model.decoder.layers]
    states = {id(mlp.run_state) for mlp in mlps if isinstance(mlp, MoELayer)}
    assert len(states) <= 1, "the model's MoE layers share one run state"
    assert [isinstance(mlp, MoELayer) for mlp in mlps] == expected
    assert all(isinstance(mlp, (MoELayer, MLP)) for mlp in mlps)
    for mlp in mlps:
        if isinstance(mlp, MoELayer):
            opts = mlp.options
            assert opts.activation == original.model.activation
            assert opts.top_k == moe.top_k
            assert opts.capacity_factor == moe.expert_capacity_factor
            assert mlp.token_dropping == (moe.expert_capacity_factor is not None)
            assert (opts.router_num_groups, opts.router_group_topk) == (moe.router_num_groups, moe.router_group_topk)
            assert opts.shared_expert_ffn_hidden_size == moe.shared_expert_ffn_hidden_size
            assert opts.aux_loss_type == (moe.aux_loss_type if moe.aux_loss_coeff > 0 else "micro_batch")
        else:
            assert mlp.config.gated_linear_unit == (original.model.activation == "swiglu")
    assert model.config.normalization == original.model.normalization
    assert model.position_embedding_type == original.model.position_embedding_type

    g = torch.Generator().manual_seed(0)
    b, s = cfg.training.micro_batch_size, cfg.model.seq_length
    tokens = torch.randint(0, VOCAB, (b, s + 1), generator=g)
    positions = torch.arange(s).expand(b, s)
    logits = model(tokens[:, :-1], positions, None)
    assert logits.shape[:2] == (b, s) and logits.shape[2] >= VOCAB
    assert torch.isfinite(logits).all()
    loss = model(tokens[:, :-1], positions, None, labels=tokens[:, 1:])
    assert loss.shape == (b, s) and torch.isfinite(loss).all()
    loss.mean().backward()
    for name, p in model.named_parameters():
        assert p.grad is not None and torch.isfinite(p.grad).all(), name
