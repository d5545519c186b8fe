"""checkpoint.upcycle_from: an MoE model built from a dense run's checkpoint computes the dense
model's function at step 0."""
import pytest
import torch

from megatron_dmoe.config import load_config, resolve, validate
from megatron_dmoe.config.dump import save_config
from megatron_dmoe.model.gpt import build_gpt_model
from megatron_dmoe.moe import MoELayer
from megatron_dmoe.training.checkpoint import Progress, save_checkpoint
from megatron_dmoe.training.upcycle import UpcycleError, upcycle_dense_checkpoint

VOCAB = 50
BASE = ["model.num_layers=2", "model.hidden_size=32", "model.num_attention_heads=4", "model.seq_length=16",
        "model.ffn_hidden_size=64", "model.add_bias_linear=false", "training.micro_batch_size=2",
        "training.global_batch_size=2", "moe.num_experts=0"]


def _cfg(*overrides):
    cfg = resolve(load_config("tiny", BASE + list(overrides)))
    validate(cfg, world_size=1)
    return cfg


def _dense_run(tmp_path, *overrides, bias=False):
    """A dense model with weights away from their initial values, saved as a run directory."""
    cfg = _cfg(*overrides)
    model = build_gpt_model(cfg, vocab_size=VOCAB, on_cuda=False)
    g = torch.Generator().manual_seed(7)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if bias or not name.endswith("mlp.linear_fc1.bias"):
                p.add_(0.05 * torch.randn(p.shape, generator=g))
    run = tmp_path / "dense"
    save_config(cfg, run / "config.yaml")
    save_checkpoint(run / "checkpoints", [model], None, None, Progress(), keep_last=1)
    return run, model


def _loss(model, seed=0):
    g = torch.Generator().manual_seed(seed)
    tokens = torch.randint(0, VOCAB, (2, 17), generator=g)
    positions = torch.arange(16).expand(2, 16)
    model.eval()
    with torch.no_grad():
        return model(tokens[:, :-1], positions, None, labels=tokens[:, 1:]).float().mean()


def _upcycled(run, *overrides):
    cfg = _cfg(f"checkpoint.upcycle_from={run}", *overrides)
    model = build_gpt_model(cfg, vocab_size=VOCAB, on_cuda=False)
    upcycle_dense_checkpoint(cfg, [model])
    return cfg, model


@pytest.mark.parametrize("activation", ["gelu", "swiglu"])
@pytest.mark.slow
def test_upcycled_moe_gives_the_dense_models_outputs_and_loss(cpu_dist, tmp_path, activation):
    run, dense = _dense_run(tmp_path, f"model.activation={activation}")
    cfg, moe = _upcycled(run, f"model.activation={activation}", "moe.num_experts=4", "moe.top_k=2",
                         "moe.ffn_hidden_size=64", "moe.router_renormalize=true",
                         "moe.shared_expert_ffn_hidden_size=16")
    layers = [layer.mlp for layer in moe.decoder.layers]
    assert all(isinstance(m, MoELayer) for m in layers)
    # every expert is the dense MLP; the router keeps its initialisation
    fc2 = dense.decoder.layers[0].mlp.linear_fc2.weight
    assert all(torch.equal(layers[0].experts.w2[e], fc2.t()) for e in range(4))
    assert layers[0].router.weight.abs().max() > 0
    assert torch.equal(moe.embedding.word_embeddings.weight, dense.embedding.word_embeddings.weight)
    # same logits, hence the same loss, on a batch
    for seed in (0, 1):
        assert abs(float(_loss(moe, seed)) - float(_loss(dense, seed))) < 1e-5
    g = torch.Generator().manual_seed(3)
    x = torch.randn(16, 2, 32, generator=g)
    dense_out, dense_bias = dense.decoder.layers[1].mlp(x)
    assert dense_bias is None
    moe_out, _ = layers[1].eval()(x)
    torch.testing.assert_close(moe_out, dense_out, rtol=1e-5, atol=1e-6)


def test_a_dense_first_layer_is_copied_as_it_is(cpu_dist, tmp_path):
    run, dense = _dense_run(tmp_path)
    cfg, moe = _upcycled(run, "moe.num_experts=4", "moe.top_k=2", "moe.ffn_hidden_size=64",
                         "moe.router_renormalize=true", "moe.first_dense_layers=1")
    first, second = (layer.mlp for layer in moe.decoder.layers)
    assert not isinstance(first, MoELayer) and isinstance(second, MoELayer)
    assert torch.equal(first.linear_fc1.weight, dense.decoder.layers[0].mlp.linear_fc1.weight)
    assert abs(float(_loss(moe)) - float(_loss(dense))) < 1e-5


def test_granularity_splits_the_dense_mlp_into_pieces(cpu_dist, tmp_path):
    """Two pieces of half width, each token on both with weight 1/2 (a zero router): the pieces
    sum to the dense MLP once scaled by the granularity."""
    run, dense = _dense_run(tmp_path)
    cfg, moe = _upcycled(run, "moe.num_experts=2", "moe.top_k=2", "moe.ffn_hidden_size=32",
                         "moe.upcycle_granularity=2", "moe.router_renormalize=true")
    layer = moe.decoder.layers[0].mlp
    fc1 = dense.decoder.layers[0].mlp.linear_fc1.weight
    assert torch.equal(layer.experts.w1[0], fc1[:32]) and torch.equal(layer.experts.w1[1], fc1[32:])
    with torch.no_grad():
        for layer in moe.decoder.layers:
            layer.mlp.router.weight.zero_()
    assert abs(float(_loss(moe)) - float(_loss(dense))) < 1e-5


def test_a_dense_mlp_with_biases_is_refused(cpu_dist, tmp_path):
    run, _ = _dense_run(tmp_path, "model.add_bias_linear=true", bias=True)
    with pytest.raises(UpcycleError, match="non-zero bias .*model.add_bias_linear: false"):
        _upcycled(run, "model.add_bias_linear=true", "moe.num_experts=2", "moe.ffn_hidden_size=64")


def test_another_model_shape_and_a_missing_checkpoint_are_named(cpu_dist, tmp_path):
    run, _ = _dense_run(tmp_path)
    with pytest.raises(UpcycleError, match="model.num_layers is 2 there, 3 here"):
        _upcycled(run, "model.num_layers=3", "moe.num_experts=2", "moe.ffn_hidden_size=64")
    with pytest.raises(UpcycleError, match="holds no checkpoint"):
        _upcycled(tmp_path / "nowhere", "moe.num_experts=2", "moe.ffn_hidden_size=64")
