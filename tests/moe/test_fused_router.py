"""The fused router (dmoe_kernels.fused_route) in a whole MoE layer against the torch router.

On CPU the fused router runs only when forced (router_impl fused), through Triton's interpreter
(tests/conftest.py sets it up); its logits are fp32, so the layer runs in fp32 here.
"""
import copy
import dataclasses

import pytest
import torch

from megatron_dmoe.moe import MoELayer, MoEOptions, TopKRouter, load_balancing_loss
from moe_reference import make_config

S, B, H, F, E, K = 11, 3, 12, 16, 8, 2  # 33 tokens: no multiple of the kernels' row block
# CPU layers with the router forced onto the kernels need Triton's interpreter, which tests/conftest.py
# sets up only where there is no GPU; test_auto_router_is_fused_on_cuda_and_matches_torch is their GPU twin
interpreter_only = pytest.mark.skipif(torch.cuda.is_available(), reason="CPU interpreter test (GPU: the gpu twin)")

CASES = {  # load-balancing type, padding mask, renormalised and scaled weights
    "micro-batch": dict(aux_type="aux_loss", mask=False, renorm=False, scale=None),
    "micro-batch-masked-renorm": dict(aux_type="aux_loss", mask=True, renorm=True, scale=2.0),
    # the sequence-wise loss reads the scores: their gradient goes through the fused backward
    "sequence-masked": dict(aux_type="seq_aux_loss", mask=True, renorm=False, scale=None),
}


def _layer(case):
    config = make_config(H, F, E, K, dtype=torch.float32, moe_aux_loss_coeff=0.3, moe_z_loss_coeff=0.01,
                         moe_router_load_balancing_type=case["aux_type"],
                         moe_router_topk_scaling_factor=case["scale"])
    torch.manual_seed(0)
    layer = MoELayer(config, backend="reference", renormalize=case["renorm"])
    # as in dmoe-train: without megatron's tracker, the fused router's layer takes the loss and the
    # metrics' sums from one kernel (dmoe_kernels.balance_loss) when no token is padding
    layer.run_state.metrics.megatron_tracker = False
    layer.train()
    return layer


def _step(layer, x, dy, mask):
    x = x.clone().requires_grad_()
    out, _ = layer(x, padding_mask=mask)
    out.backward(dy)
    record = layer.run_state.metrics.snapshot()["layers"][layer.layer_number]
    grads = {"x": x.grad, **{name: p.grad for name, p in layer.named_parameters()}}
    return out.detach(), grads, (record["lb_loss"], record["load"])


@interpreter_only
@pytest.mark.parametrize("name", list(CASES))
def test_layer_with_fused_router_matches_torch_router(name):
    case = CASES[name]
    torch_layer = _layer(case)
    fused_layer = copy.deepcopy(torch_layer)
    torch_layer.router.fused, fused_layer.router.fused = False, True
    g = torch.Generator().manual_seed(1)
    x = torch.randn(S, B, H, generator=g)
    dy = torch.randn(S, B, H, generator=g)
    mask = (torch.rand(B, S, generator=g) < 0.25) if case["mask"] else None

    routing = fused_layer.router(x.view(-1, H))
    assert routing.prob_colsum is not None  # the fused kernels really ran
    assert torch_layer.router(x.view(-1, H)).prob_colsum is None

    out_t, grads_t, lb_t = _step(torch_layer, x, dy, mask)
    out_f, grads_f, lb_f = _step(fused_layer, x, dy, mask)
    assert (out_f - out_t).abs().max() <= 1e-6 * out_t.abs().max()
    assert lb_f[0] == pytest.approx(lb_t[0], rel=1e-6) and lb_f[1] == lb_t[1]
    assert set(grads_f) == set(grads_t) and "router.weight" in grads_f
    for key, want in grads_t.items():
        got = grads_f[key]
        assert got is not None and want is not None, key
        assert (got - want).norm() <= 1e-5 * want.norm(), key


@interpreter_only
@pytest.mark.parametrize("name", ["micro-batch", "micro-batch-masked-renorm"])
def test_router_aux_gradient_alone_goes_through_the_column_sums(name):
    """A zero output gradient leaves the load-balancing loss's gradient alone at the router: the
    fused backward's column-sum term (from the balance-loss kernel's backward without padding),
    against torch's sum over the probabilities."""
    case = CASES[name]
    torch_layer = _layer(case)
    fused_layer = copy.deepcopy(torch_layer)
    torch_layer.router.fused, fused_layer.router.fused = False, True
    for layer in (torch_layer, fused_layer):
        layer.options.z_loss_coeff = 0.0
    x = torch.randn(S, B, H, generator=torch.Generator().manual_seed(2))
    mask = None
    if case["mask"]:
        mask = torch.zeros(B, S, dtype=torch.bool)
        mask[0, :4] = True
    _, grads_t, _ = _step(torch_layer, x, torch.zeros(S, B, H), mask)
    _, grads_f, _ = _step(fused_layer, x, torch.zeros(S, B, H), mask)
    want, got = grads_t["router.weight"], grads_f["router.weight"]
    assert want.norm() > 0 and (got - want).norm() <= 1e-5 * want.norm()


def test_fused_choice_auto_forced_and_refused():
    opts = MoEOptions(hidden_size=8, ffn_hidden_size=8, num_experts=4, top_k=2)
    x = torch.randn(5, 8)
    assert TopKRouter(opts).fused is None
    assert TopKRouter(opts)(x).prob_colsum is None  # auto: CPU logits take torch's path
    assert TopKRouter(opts).uses_fused(torch.zeros(5, 4)) is False
    forced = dataclasses.replace(opts, router_impl="fused")
    assert TopKRouter(forced).uses_fused(torch.zeros(5, 4)) is True
    with pytest.raises(ValueError, match="float64"):
        TopKRouter(forced, dtype=torch.float64)(x.double())
    for kwargs, message in ((dict(score_function="sigmoid"), "score_function 'sigmoid'"),
                            (dict(pre_softmax=False), "pre_softmax false"),
                            (dict(num_experts=8, router_num_groups=2, router_group_topk=1), "router_num_groups 2"),
                            (dict(num_experts=300), "num_experts 300")):
        bad = MoEOptions(**{**dict(hidden_size=8, ffn_hidden_size=8, num_experts=4, top_k=2), **kwargs})
        with pytest.raises(ValueError, match=message):
            dataclasses.replace(bad, router_impl="fused")
        router = TopKRouter(bad)
        assert router.uses_fused(torch.zeros(5, bad.num_experts)) is False
        router.fused = True  # switched on by hand: refused, not routed wrongly
        with pytest.raises(ValueError, match=message):
            router.uses_fused(torch.zeros(5, bad.num_experts))
    with pytest.raises(ValueError, match="router_impl"):
        MoEOptions(hidden_size=8, ffn_hidden_size=8, num_experts=4, router_impl="yes")


def test_router_impl_option_picks_the_path_and_is_checked():
    config = make_config(8, 8, 4, 2)
    paths = {impl: MoELayer(config, backend="reference", router_impl=impl).router.fused
             for impl in ("auto", "fused", "torch")}
    assert paths == {"auto": None, "fused": True, "torch": False}
    with pytest.raises(ValueError, match="router_impl.*fused cannot route with score_function 'sigmoid'"):
        MoEOptions(hidden_size=8, ffn_hidden_size=8, num_experts=4, top_k=2, score_function="sigmoid",
                   router_impl="fused")
    with pytest.raises(ValueError, match="router_impl"):
        MoEOptions(hidden_size=8, ffn_hidden_size=8, num_experts=4, router_impl="triton")


def test_load_balancing_loss_from_a_precomputed_column_sum_is_the_same_loss():
    g = torch.Generator().manual_seed(3)
    probs = torch.softmax(torch.randn(9, 5, generator=g, dtype=torch.float64), dim=-1)
    valid = torch.tensor([True, True, False, True, True, True, False, True, True])
    counts = torch.tensor([3, 0, 5, 2, 4])
    for mask in (None, valid):
        kept = probs if mask is None else probs * mask[:, None]
        colsum = kept.sum(dim=0).requires_grad_()
        expected = load_balancing_loss(probs, counts, 2, 0.3, valid=mask)
        got = load_balancing_loss(probs, counts, 2, 0.3, valid=mask, column_sum=colsum)
        assert got.item() == pytest.approx(expected.item(), rel=1e-14)
        got.backward()
        tokens = 9 if mask is None else int(mask.sum())
        assert torch.allclose(colsum.grad, 0.3 * 5 / 2 * counts.double() / tokens**2, rtol=1e-12)


@interpreter_only
def test_fused_layer_runs_no_torch_softmax_topk_or_probability_sum():
    """The ops the fused router replaces, forward and backward, are gone from the layer's step
    (torch's profiler on CPU sees the ops a GPU step would launch kernels for)."""
    from torch.profiler import ProfilerActivity, profile

    replaced = {"aten::softmax", "aten::_softmax", "aten::topk", "aten::_softmax_backward_data"}
    x = torch.randn(S, B, H, generator=torch.Generator().manual_seed(4))
    ops = {}
    for fused in (False, True):
        layer = _layer(CASES["micro-batch"])
        layer.router.fused = fused
        layer.options.z_loss_coeff = 0.0  # its logsumexp sums [T, E] too
        with profile(activities=[ProfilerActivity.CPU], record_shapes=True) as prof:
            _step(layer, x, torch.ones(S, B, H), None)
        ops[fused] = {(e.key, tuple(map(tuple, e.input_shapes[:1])))
                      for e in prof.key_averages(group_by_input_shape=True)}
    prob_sum = ("aten::sum", ((S * B, E),))
    assert replaced <= {name for name, _ in ops[False]} and prob_sum in ops[False]
    assert not replaced & {name for name, _ in ops[True]} and prob_sum not in ops[True]


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("backend,masked", [("reference", True), ("sparse", False)])
def test_auto_router_is_fused_on_cuda_and_matches_torch(dtype, backend, masked):
    """On a GPU the default router takes the fused kernels (compiled, not interpreted) and gives the
    torch router's layer output, gradients and metrics (fp32 logits either way; bf16 experts: bf16
    tolerance); without padding the loss and metrics come from the balance-loss kernel."""
    case = CASES["micro-batch-masked-renorm"]
    config = make_config(64, 128, 16, 4, dtype=dtype, moe_aux_loss_coeff=0.3, moe_z_loss_coeff=0.01,
                         moe_router_topk_scaling_factor=case["scale"])
    torch.manual_seed(0)
    auto_layer = MoELayer(config, backend=backend, renormalize=True).cuda().train()
    auto_layer.run_state.metrics.megatron_tracker = False
    torch_layer = copy.deepcopy(auto_layer)
    torch_layer.router.fused = False
    g = torch.Generator(device="cuda").manual_seed(1)
    x = torch.randn(128, 4, 64, generator=g, device="cuda").to(dtype)
    dy = torch.randn(128, 4, 64, generator=g, device="cuda").to(dtype)
    mask = (torch.rand(4, 128, generator=g, device="cuda") < 0.2) if masked else None
    assert auto_layer.router.fused is None and auto_layer.router(x.view(-1, 64)).prob_colsum is not None
    tol = 1e-5 if dtype == torch.float32 else 2e-2
    out_t, grads_t, lb_t = _step(torch_layer, x, dy, mask)
    out_f, grads_f, lb_f = _step(auto_layer, x, dy, mask)
    assert (out_f - out_t).float().norm() <= tol * out_t.float().norm()
    assert lb_f[0] == pytest.approx(lb_t[0], rel=1e-5) and lb_f[1] == lb_t[1]
    for key, want in grads_t.items():
        assert (grads_f[key] - want).float().norm() <= tol * want.float().norm(), key
