"""Aux-loss-free balancing: bias updates, and a bias that moves the choice but not the weights."""
import torch

from megatron_dmoe.moe import MoELayer, update_expert_biases
from moe_reference import load_weights, make_config, reference_moe, rel_err

RATE = 0.01


def biased_layer(top_k=2, experts=4, hidden=8, ffn=8, **extra):
    config = make_config(
        hidden, ffn, experts, top_k, score_function="sigmoid", moe_router_enable_expert_bias=True,
        moe_router_bias_update_rate=RATE, **extra,
    )
    return MoELayer(config, backend="reference")


def test_update_moves_bias_against_the_load_and_resets_counts():
    layer = biased_layer()
    layer.train()
    with torch.no_grad():  # experts 0 and 1 are preferred, 2 and 3 lose
        layer.router.weight.copy_(torch.zeros(4, 8))
        layer.router.weight[:, 0] = torch.tensor([3.0, 2.0, 0.5, -3.0], dtype=torch.float64)
    x = torch.randn(10, 3, 8, dtype=torch.float64)
    x[..., 0] = x[..., 0].abs() + 0.5
    layer(x)
    layer(x[:4])
    with torch.no_grad():
        routing = [layer.router(t.reshape(-1, 8)).indices for t in (x, x[:4])]
    load = torch.bincount(torch.cat([r.flatten() for r in routing]), minlength=4).double()
    assert layer.router.local_tokens_per_expert.tolist() == load.long().tolist()
    # eval and no-grad forwards do not count
    layer.eval()
    layer(x)
    layer.train()
    with torch.no_grad():
        layer(x)
    assert layer.router.local_tokens_per_expert.tolist() == load.long().tolist()

    assert update_expert_biases(layer) == 1
    expected = [RATE * (1 if n < load.mean() else -1 if n > load.mean() else 0) for n in load.tolist()]
    assert torch.allclose(layer.router.expert_bias, torch.tensor(expected))
    assert layer.router.expert_bias[0] < 0 and layer.router.expert_bias[3] > 0
    assert layer.router.local_tokens_per_expert.tolist() == [0, 0, 0, 0]
    # a second update with no new tokens: every load equals the mean, nothing moves
    layer.update_expert_bias()
    assert torch.allclose(layer.router.expert_bias, torch.tensor(expected))


def test_bias_changes_selection_not_weights():
    layer = biased_layer(top_k=2, experts=5)
    g = torch.Generator().manual_seed(3)
    x = torch.randn(11, 8, generator=g, dtype=torch.float64)
    router_w = torch.randn(5, 8, generator=g, dtype=torch.float64)
    w1, v1, w2 = (0.3 * torch.randn(5, 8, 8, generator=g, dtype=torch.float64) for _ in range(3))
    load_weights(layer, router_w, w1, v1, w2)
    before = layer.router(x)
    with torch.no_grad():
        layer.router.expert_bias.copy_(torch.tensor([0.0, 0.0, 0.0, 0.0, 2.0]))
    after = layer.router(x)
    assert (after.indices == 4).any(dim=1).all()  # every token now picks expert 4
    assert not torch.equal(before.indices, after.indices)
    # weights are the (renormalised) sigmoid scores of the chosen experts, bias-free
    s = torch.sigmoid(x @ router_w.t())
    chosen = s.gather(1, after.indices)
    assert torch.allclose(after.weights, chosen / chosen.sum(1, keepdim=True), rtol=1e-12, atol=0)
    out, _ = layer(x.view(11, 1, 8))
    ref, _, _ = reference_moe(
        x, router_w, w1, v1, w2, top_k=2, score_function="sigmoid", renormalize=True,
        expert_bias=layer.router.expert_bias.double(),
    )
    assert rel_err(out.view(11, 8), ref) < 1e-12


def test_bias_stays_fp32_under_low_precision_casts_and_is_checkpointed():
    layer = biased_layer()
    with torch.no_grad():
        layer.router.expert_bias.copy_(torch.tensor([1e-3, 1.0 + 1e-4, -2e-3, 0.0]))
    exact = layer.router.expert_bias.clone()
    layer.bfloat16()
    assert layer.router.weight.dtype == torch.bfloat16
    assert layer.router.expert_bias.dtype == torch.float32 and torch.equal(layer.router.expert_bias, exact)
    state = layer.state_dict()
    assert "router.expert_bias" in state and "router.local_tokens_per_expert" not in state


def test_update_expert_biases_visits_every_layer_in_model_chunks():
    a, b, plain = biased_layer(), biased_layer(), MoELayer(make_config(8, 8, 4, 2), backend="reference")
    model = torch.nn.Sequential(a, torch.nn.Sequential(b, plain))
    for layer in (a, b):
        layer.train()
        # tokens routed to expert 0 only, so loads are uneven and every bias must move
        x = torch.randn(64, 2, 8, dtype=torch.float64)
        with torch.no_grad():
            layer.router.weight.zero_()
            layer.router.weight[0] = x.reshape(-1, 8).mean(0) * 100
        layer(x)
    assert update_expert_biases([model]) == 2
    assert a.router.expert_bias.abs().sum() > 0 and b.router.expert_bias.abs().sum() > 0
    assert plain.router.expert_bias is None
