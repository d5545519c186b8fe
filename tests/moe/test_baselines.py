"""The dMoE layer against the paper's baselines: a dense MLP and token-dropping capacity MoE."""
import pytest
import torch
import torch.nn.functional as F

from megatron_dmoe.moe import MoELayer
from moe_reference import make_config, reference_moe, rel_err


def dense_mlp(x, w1, v1, w2, activation):
    """Plain torch dense MLP: fc1 (h -> f), activation, fc2 (f -> h)."""
    h = F.linear(x, w1)
    a = F.gelu(h) if activation == "gelu" else F.silu(h) * F.linear(x, v1)
    return F.linear(a, w2.t())


@pytest.mark.parametrize("backend", ["reference", "grouped"])
@pytest.mark.parametrize("activation", ["gelu", "swiglu"])
def test_one_expert_top1_is_a_dense_mlp(activation, backend):
    dtype = torch.float64 if backend == "reference" else torch.float32
    h, f = 16, 24
    config = make_config(h, f, 1, 1, activation=activation, dtype=dtype, moe_aux_loss_coeff=0.01)
    layer = MoELayer(config, backend=backend)
    layer.train()
    x = torch.randn(9, 3, h, dtype=dtype, requires_grad=True)
    out, _ = layer(x)
    g = torch.randn_like(out)
    out.backward(g)

    ex = layer.experts
    w1, w2 = ex.w1.detach()[0].clone().requires_grad_(), ex.w2.detach()[0].clone().requires_grad_()
    v1 = ex.v1.detach()[0].clone().requires_grad_() if ex.v1 is not None else None
    x_ref = x.detach().clone().requires_grad_()
    ref = dense_mlp(x_ref, w1, v1, w2, activation)
    ref.backward(g)
    tol = 1e-12 if dtype == torch.float64 else 1e-5
    assert rel_err(out, ref) < tol
    assert rel_err(x.grad, x_ref.grad) < tol
    assert rel_err(ex.w1.grad[0], w1.grad) < tol and rel_err(ex.w2.grad[0], w2.grad) < tol
    if v1 is not None:
        assert rel_err(ex.v1.grad[0], v1.grad) < tol
    # one expert: its probability is always 1, so the router gets no gradient at all
    assert layer.router.weight.grad.abs().max() == 0


def _pair(hidden, ffn, experts, top_k, capacity_factor, policy="probs", memory_optimized=False, **extra):
    """A dMoE layer and a capacity-factor layer with the same weights."""
    dropless = MoELayer(make_config(hidden, ffn, experts, top_k, **extra), backend="reference")
    dropping = MoELayer(
        make_config(hidden, ffn, experts, top_k, moe_expert_capacity_factor=capacity_factor,
                    moe_token_drop_policy=policy, **extra),
        backend="reference",
        memory_optimized=memory_optimized,
    )
    dropping.load_state_dict(dropless.state_dict())
    return dropless, dropping


@pytest.mark.parametrize("memory_optimized", [False, True])
@pytest.mark.parametrize("activation", ["gelu", "swiglu"])
def test_capacity_layer_with_room_for_everything_equals_dmoe(activation, memory_optimized):
    E, k, T = 6, 2, 23
    dropless, dropping = _pair(
        12, 20, E, k, capacity_factor=float(E), activation=activation, moe_aux_loss_coeff=0.05,
        moe_z_loss_coeff=0.01, memory_optimized=memory_optimized,
    )
    with torch.no_grad():  # wide router weights so that the load is uneven
        dropless.router.weight.normal_(0, 1.0)
        dropping.router.weight.copy_(dropless.router.weight)
    x = torch.randn(T, 1, 12, dtype=torch.float64)
    g = torch.randn(T, 1, 12, dtype=torch.float64)
    results = []
    for layer in (dropless, dropping):
        layer.train()
        xi = x.clone().requires_grad_()
        out, _ = layer(xi)
        out.backward(g)
        results.append((out, xi.grad, {n: p.grad for n, p in layer.named_parameters()}))
    (out_a, gx_a, gp_a), (out_b, gx_b, gp_b) = results
    assert rel_err(out_b, out_a) < 1e-12 and rel_err(gx_b, gx_a) < 1e-12
    assert gp_a.keys() == gp_b.keys()
    for name in gp_a:
        assert rel_err(gp_b[name], gp_a[name]) < 1e-12, name
    # and both equal the per-token reference
    ex = dropless.experts
    ref, _, _ = reference_moe(
        x.view(T, 12), dropless.router.weight.detach(), ex.w1.detach(),
        None if ex.v1 is None else ex.v1.detach(), ex.w2.detach(), top_k=k, activation=activation,
    )
    assert rel_err(out_a.view(T, 12), ref) < 1e-12


@pytest.mark.parametrize("policy,dropped", [("position", 2), ("probs", 0)])
def test_capacity_factor_one_drops_exactly_the_overflow(policy, dropped):
    """Hand-built top-1 routing: logits (x0, -x0), so x0 > 0 picks expert 0 with weight sigmoid(2 x0)."""
    dropless, dropping = _pair(4, 8, 2, 1, capacity_factor=1.0, policy=policy)
    with torch.no_grad():
        for layer in (dropless, dropping):
            layer.router.weight.copy_(torch.tensor([[1.0, 0, 0, 0], [-1.0, 0, 0, 0]]))
    x = torch.randn(4, 1, 4, dtype=torch.float64)
    # tokens 0, 1, 2 -> expert 0 (weights 0.65, 0.88, 0.77); token 3 -> expert 1. Capacity 2:
    # 'position' drops token 2 (the last of expert 0), 'probs' drops token 0 (the lowest weight)
    x[:, 0, 0] = torch.tensor([0.3, 1.0, 0.6, -0.5], dtype=torch.float64)
    ref, _ = dropless(x)
    xi = x.clone().requires_grad_()
    out, _ = dropping(xi)
    out.sum().backward()
    for t in range(4):
        if t == dropped:
            assert torch.all(out[t] == 0)
            assert torch.all(xi.grad[t] == 0)  # a dropped token gets no gradient either
        else:
            assert torch.allclose(out[t], ref[t], rtol=1e-12, atol=0)
            assert xi.grad[t].abs().max() > 0
