"""The dMoE layer's output and every gradient against the float64 per-token loop reference."""
import pytest
import torch

from megatron_dmoe.moe import MoELayer
from moe_reference import draw_inputs, load_weights, make_config, reference_moe, rel_err, run_layer, run_reference

HIDDEN, FFN = 12, 20  # multiples of 4: grouped_mm's 16-byte strides in fp32
AUX, ZLOSS = 0.05, 0.01

# (seq, batch, experts, top_k, router settings, experts that must get no token)
CASES = {
    "top1-37tok": dict(s=37, b=1, E=4, k=1, score="softmax", pre=True, renorm=False, scale=1.0, dead=[2]),
    "top2-post-softmax": dict(s=5, b=3, E=6, k=2, score="softmax", pre=False, renorm=False, scale=1.0, dead=[0, 5]),
    "top3-sigmoid-scaled": dict(s=13, b=2, E=8, k=3, score="sigmoid", pre=True, renorm=True, scale=2.5, dead=[4]),
    "top4-sigmoid-raw": dict(s=7, b=3, E=7, k=4, score="sigmoid", pre=True, renorm=False, scale=1.0, dead=[1, 6]),
    "top8-renorm": dict(s=9, b=2, E=10, k=8, score="softmax", pre=True, renorm=True, scale=1.0, dead=[3]),
    "top5-of-5": dict(s=3, b=5, E=5, k=5, score="softmax", pre=True, renorm=False, scale=1.0, dead=[]),
}


@pytest.mark.parametrize("memory_optimized", [False, True], ids=["plain", "memopt"])
@pytest.mark.parametrize("backend", ["reference", "grouped"])
@pytest.mark.parametrize("activation", ["gelu", "swiglu"])
@pytest.mark.parametrize("name", list(CASES))
@pytest.mark.slow
def test_layer_matches_per_token_reference(name, activation, backend, memory_optimized):
    case = CASES[name]
    # the reference backend runs in float64; grouped_mm has no float64, so it runs in fp32
    dtype, tol = (torch.float64, 1e-10) if backend == "reference" else (torch.float32, 2e-5)
    seed = sorted(CASES).index(name) * 4 + ["gelu", "swiglu"].index(activation)
    weights = draw_inputs(case, seed, dtype, HIDDEN, FFN)
    out_grad = torch.randn(weights[0].shape, generator=torch.Generator().manual_seed(seed), dtype=torch.float64)
    kwargs = dict(aux=AUX, z=ZLOSS)
    out, grads, load = run_layer(case, activation, backend, memory_optimized, weights, out_grad, dtype, **kwargs)
    ref_out, ref_grads, chosen = run_reference(case, activation, weights, out_grad, **kwargs)

    # the case really has experts without tokens, and the layer counted what the reference chose
    assert [sum(e in c for c in chosen) for e in range(case["E"])] == load
    assert all(load[e] == 0 for e in case["dead"])
    assert rel_err(out, ref_out) < tol
    for key in ("x", "router", "w1", "w2") + (("v1",) if activation == "swiglu" else ()):
        assert rel_err(grads[key], ref_grads[key]) < tol, key
    if activation == "gelu":
        assert grads["v1"] is None


@pytest.mark.parametrize("scale", [1.0, 0.25])
@pytest.mark.parametrize("score", ["softmax", "sigmoid"])
def test_router_gradient_from_aux_losses_alone(score, scale):
    """With a zero output gradient, the router's gradient is the aux losses' gradient alone,
    times the scale the training loop sets."""
    from megatron_dmoe.moe import AuxLossScaler

    case = dict(s=6, b=2, E=5, k=2, score=score, pre=True, renorm=False, scale=1.0, dead=[1])
    weights = draw_inputs(case, 99, torch.float64, HIDDEN, FFN)
    zero = torch.zeros_like(weights[0])
    AuxLossScaler.set_loss_scale(scale)
    try:
        _, grads, _ = run_layer(case, "gelu", "reference", False, weights, zero, torch.float64, aux=AUX, z=ZLOSS)
    finally:
        AuxLossScaler.set_loss_scale(1.0)
    _, ref_grads, _ = run_reference(case, "gelu", weights, zero, aux=AUX, z=ZLOSS)
    assert ref_grads["router"].abs().max() > 1e-4
    assert rel_err(grads["router"], scale * ref_grads["router"]) < 1e-10
    assert rel_err(grads["x"], scale * ref_grads["x"]) < 1e-10
    assert grads["w1"].abs().max() == 0 and grads["w2"].abs().max() == 0


def test_eval_forward_has_no_aux_gradient_and_equals_training_output():
    case = CASES["top2-post-softmax"]
    x, router_w, w1, v1, w2 = draw_inputs(case, 5, torch.float64, HIDDEN, FFN)
    config = make_config(HIDDEN, FFN, case["E"], case["k"], pre_softmax=False, moe_aux_loss_coeff=AUX)
    layer = MoELayer(config, backend="reference")
    load_weights(layer, router_w, w1, v1, w2)
    x_in = x.view(case["s"], case["b"], HIDDEN)
    layer.train()
    train_out, _ = layer(x_in)
    layer.eval()
    eval_out, _ = layer(x_in)
    assert torch.equal(train_out, eval_out)
    eval_out.sum().backward()
    ref = x.clone().requires_grad_()
    leaves = [t.clone().requires_grad_() for t in (router_w, w1, v1, w2)]
    y, _, _ = reference_moe(ref, *leaves, top_k=case["k"], pre_softmax=False)
    y.sum().backward()
    assert rel_err(layer.router.weight.grad, leaves[0].grad) < 1e-10  # no aux term in eval
