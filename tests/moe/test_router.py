"""Router choices and weights against numbers written out by hand."""
import math

import pytest
import torch

from megatron_dmoe.moe import MoELayer, MoEOptions, TopKRouter, route
from megatron_dmoe.moe.router import count_assignments
from moe_reference import make_config

e = math.exp
LOGITS = torch.tensor([[1.0, 2.0, 0.0, -1.0], [0.5, -0.5, 3.0, 0.0]], dtype=torch.float64)
Z0 = e(1) + e(2) + e(0) + e(-1)
Z1 = e(0.5) + e(-0.5) + e(3) + e(0)


def sig(v):
    return 1.0 / (1.0 + e(-v))


def check(actual_idx, actual_w, idx, w):
    assert actual_idx.tolist() == idx
    assert torch.allclose(actual_w, torch.tensor(w, dtype=torch.float64), rtol=1e-12, atol=0)


def test_softmax_pre_softmax_top2():
    idx, w, scores = route(LOGITS, 2, "softmax", pre_softmax=True)
    check(idx, w, [[1, 0], [2, 0]], [[e(2) / Z0, e(1) / Z0], [e(3) / Z1, e(0.5) / Z1]])
    assert torch.allclose(scores[0, 3], torch.tensor(e(-1) / Z0, dtype=torch.float64))


def test_softmax_pre_softmax_renormalised_and_scaled():
    idx, w, _ = route(LOGITS, 2, "softmax", pre_softmax=True, renormalize=True, topk_scaling_factor=2.5)
    r0 = 2.5 / (e(2) + e(1))
    r1 = 2.5 / (e(3) + e(0.5))
    check(idx, w, [[1, 0], [2, 0]], [[e(2) * r0, e(1) * r0], [e(3) * r1, e(0.5) * r1]])


def test_softmax_after_topk():
    idx, w, _ = route(LOGITS, 2, "softmax", pre_softmax=False)
    # softmax over the two chosen logits only
    check(idx, w, [[1, 0], [2, 0]], [[e(2) / (e(2) + e(1)), e(1) / (e(2) + e(1))],
                                     [e(3) / (e(3) + e(0.5)), e(0.5) / (e(3) + e(0.5))]])


def test_softmax_top1_pre_softmax():
    idx, w, _ = route(LOGITS, 1, "softmax", pre_softmax=True, topk_scaling_factor=3.0)
    check(idx, w, [[1], [2]], [[3.0 * e(2) / Z0], [3.0 * e(3) / Z1]])


def test_sigmoid_with_and_without_renormalisation():
    idx, w, scores = route(LOGITS, 2, "sigmoid")
    check(idx, w, [[1, 0], [2, 0]], [[sig(2), sig(1)], [sig(3), sig(0.5)]])
    assert torch.allclose(scores[1, 1], torch.tensor(sig(-0.5), dtype=torch.float64))
    idx, w, _ = route(LOGITS, 2, "sigmoid", renormalize=True)
    s0, s1 = sig(2) + sig(1), sig(3) + sig(0.5)
    check(idx, w, [[1, 0], [2, 0]], [[sig(2) / s0, sig(1) / s0], [sig(3) / s1, sig(0.5) / s1]])


def test_expert_bias_changes_choice_not_weights():
    bias = torch.tensor([0.0, 0.0, 0.0, 5.0])
    idx, w, _ = route(LOGITS, 2, "sigmoid", expert_bias=bias)
    # expert 3 (logits -1 and 0) wins through the bias; its weight is its own sigmoid score
    check(idx, w, [[3, 1], [3, 2]], [[sig(-1), sig(2)], [sig(0), sig(3)]])
    idx, w, _ = route(LOGITS, 2, "sigmoid", renormalize=True, expert_bias=bias)
    check(idx, w, [[3, 1], [3, 2]], [[sig(-1) / (sig(-1) + sig(2)), sig(2) / (sig(-1) + sig(2))],
                                     [sig(0) / (sig(0) + sig(3)), sig(3) / (sig(0) + sig(3))]])


def test_count_assignments_skips_padding():
    idx = torch.tensor([[0, 2], [2, 1], [2, 0]])
    assert count_assignments(idx, 4).tolist() == [2, 1, 3, 0]
    assert count_assignments(idx, 4, torch.tensor([True, False, True])).tolist() == [2, 0, 2, 0]


def test_router_logits_in_fp32_for_bf16_inputs_and_fp64_for_fp64():
    opts = MoEOptions(hidden_size=8, ffn_hidden_size=8, num_experts=4, top_k=2)
    router = TopKRouter(opts, dtype=torch.bfloat16)
    x = torch.randn(5, 8).bfloat16()
    routing = router(x)
    assert routing.logits.dtype == torch.float32 and routing.weights.dtype == torch.float32
    expected = x.float() @ router.weight.float().t()
    assert torch.allclose(routing.logits, expected, rtol=1e-6, atol=1e-6)
    router64 = TopKRouter(opts, dtype=torch.float64)
    assert router64(torch.randn(5, 8, dtype=torch.float64)).logits.dtype == torch.float64


def test_jitter_scales_router_input_in_training_only():
    eps = 0.1
    opts = MoEOptions(hidden_size=1, ffn_hidden_size=4, num_experts=2, top_k=1, input_jitter_eps=eps)
    router = TopKRouter(opts, dtype=torch.float64)
    with torch.no_grad():
        router.weight.copy_(torch.tensor([[1.0], [-1.0]]))
    x = torch.linspace(0.5, 2.0, 200, dtype=torch.float64)[:, None]
    router.train()
    factor = router(x).logits[:, 0] / x[:, 0]
    assert factor.min() >= 1 - eps and factor.max() <= 1 + eps
    assert factor.std() > eps / 4  # really random, roughly uniform over the interval
    router.eval()
    assert torch.equal(router(x).logits[:, 0], x[:, 0])
    # bf16 inputs: the noise is drawn in fp32, finer than bf16's 2**-7 steps around 1
    router16 = TopKRouter(opts, dtype=torch.bfloat16)
    with torch.no_grad():
        router16.weight.copy_(torch.tensor([[1.0], [-1.0]]))
    router16.train()
    x16 = torch.ones(400, 1, dtype=torch.bfloat16)
    assert router16(x16).logits[:, 0].unique().numel() > 100


@pytest.mark.parametrize(
    "kwargs,message",
    [
        (dict(top_k=5), "top_k"),
        (dict(top_k=1, pre_softmax=False), "pre_softmax"),
        (dict(top_k=1, renormalize=True), "renormalize"),
        (dict(expert_bias=True), "expert_bias"),
        (dict(activation="relu"), "activation"),
        (dict(token_drop_policy="random"), "token_drop_policy"),
        (dict(capacity_factor=0.0), "capacity_factor"),
        (dict(block_size=100), "block_size"),
        (dict(input_jitter_eps=1.5), "input_jitter_eps"),
        (dict(aux_loss_coeff=-1.0), "aux_loss_coeff"),
    ],
)
def test_options_reject_bad_values_naming_the_key(kwargs, message):
    base = dict(hidden_size=8, ffn_hidden_size=8, num_experts=4, top_k=2)
    with pytest.raises(ValueError, match=message):
        MoEOptions(**{**base, **kwargs})


def test_renormalize_default_depends_on_score_function():
    base = dict(hidden_size=8, ffn_hidden_size=8, num_experts=4)
    assert MoEOptions(**base, top_k=2, score_function="sigmoid").renormalize is True
    assert MoEOptions(**base, top_k=1, score_function="sigmoid").renormalize is False
    assert MoEOptions(**base, top_k=2).renormalize is False


def test_options_from_transformer_config_reads_megatron_fields():
    import torch.nn.functional as F

    config = make_config(
        16, 24, 8, 2, activation="swiglu", score_function="sigmoid", pre_softmax=False,
        moe_aux_loss_coeff=0.02, moe_z_loss_coeff=0.003, moe_input_jitter_eps=0.01,
        moe_router_topk_scaling_factor=2.0, moe_router_enable_expert_bias=True,
        moe_router_bias_update_rate=0.005, moe_expert_capacity_factor=1.25, moe_token_drop_policy="position",
        init_method_std=0.01,
    )
    opts = MoEOptions.from_transformer_config(config, backend="reference", memory_optimized=True, block_size=64)
    assert (opts.hidden_size, opts.ffn_hidden_size, opts.num_experts, opts.top_k) == (16, 24, 8, 2)
    assert (opts.activation, opts.score_function, opts.pre_softmax) == ("swiglu", "sigmoid", False)
    assert (opts.aux_loss_coeff, opts.z_loss_coeff, opts.input_jitter_eps) == (0.02, 0.003, 0.01)
    assert (opts.topk_scaling_factor, opts.expert_bias, opts.bias_update_rate) == (2.0, True, 0.005)
    assert (opts.capacity_factor, opts.token_drop_policy, opts.init_method_std) == (1.25, "position", 0.01)
    assert (opts.backend, opts.memory_optimized, opts.block_size, opts.renormalize) == ("reference", True, 64, True)
    # megatron's defaults: no scaling factor, no z-loss, GELU without gating
    plain = MoEOptions.from_transformer_config(make_config(16, 24, 8, 2))
    assert (plain.topk_scaling_factor, plain.z_loss_coeff, plain.activation) == (1.0, 0.0, "gelu")
    with pytest.raises(TypeError, match="bakend"):
        MoEOptions.from_transformer_config(config, bakend="grouped")
    gated_gelu = make_config(16, 24, 8, 2, activation="gelu")
    gated_gelu.gated_linear_unit = True
    with pytest.raises(ValueError, match="activation_func"):
        MoEOptions.from_transformer_config(gated_gelu)
    relu = make_config(16, 24, 8, 2)
    relu.activation_func = F.relu
    with pytest.raises(ValueError, match="activation_func"):
        MoEOptions.from_transformer_config(relu)


def test_sparse_backend_refuses_an_expert_width_its_blocks_cannot_tile():
    message = r"MoE option 'ffn_hidden_size'=24: 24 is not a multiple of block_size \(128\)"
    with pytest.raises(ValueError, match=message):
        MoELayer(make_config(16, 24, 4, 2), backend="sparse")


def test_grouped_backend_refuses_unaligned_sizes_and_auto_falls_back():
    config = make_config(10, 6, 4, 2, dtype=torch.float32)
    layer = MoELayer(config, backend="grouped")
    x = torch.randn(3, 2, 10)
    with pytest.raises(ValueError, match="hidden_size=10"):
        layer(x)
    auto = MoELayer(config, backend="auto")
    assert auto.experts.backend_for(x.view(-1, 10)).name == "reference"
    assert auto(x)[0].shape == x.shape
    # On CPU 'auto' keeps the per-expert matmuls even where grouped_mm could run: they are faster.
    aligned = MoELayer(make_config(12, 8, 4, 2, dtype=torch.float32), backend="auto")
    assert aligned.experts.backend_for(torch.randn(4, 12)).name == "reference"


def test_layer_rejects_expert_parallelism_without_groups_and_bad_shapes():
    with pytest.raises(RuntimeError, match="expert_model_parallel_size=2"):
        MoELayer(make_config(16, 24, 4, 2, expert_model_parallel_size=2))
    layer = MoELayer(make_config(16, 24, 4, 2))
    with pytest.raises(ValueError, match="hidden_size"):
        layer(torch.randn(3, 2, 8, dtype=torch.float64))
    with pytest.raises(ValueError, match="padding_mask"):
        layer(torch.randn(3, 2, 16, dtype=torch.float64), padding_mask=torch.zeros(3, 2, dtype=torch.bool))


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_half_input_logits_equal_an_fp32_gemm_of_the_upcast_operands(dtype):
    """The tensor-core path: forward as exact as fp32 on the same half values; gradients within
    half precision of the float64 ones."""
    from megatron_dmoe.moe.router import router_logits

    g = torch.Generator(device="cuda").manual_seed(3)
    x = torch.randn(1000, 256, device="cuda", generator=g).to(dtype).requires_grad_()
    w = (0.05 * torch.randn(24, 256, device="cuda", generator=g)).to(dtype).requires_grad_()
    logits = router_logits(x, w)
    assert logits.dtype == torch.float32
    expected = x.detach().double() @ w.detach().double().t()
    assert ((logits.double() - expected).norm() / expected.norm()).item() < 1e-6
    grad = torch.randn(logits.shape, device="cuda", generator=g)
    dx, dw = torch.autograd.grad(logits, [x, w], grad)
    assert dx.dtype == dtype and dw.dtype == dtype
    for got, want in ((dx, grad.double() @ w.detach().double()), (dw, grad.double().t() @ x.detach().double())):
        assert ((got.double() - want).norm() / want.norm()).item() < 1e-2


def test_forced_load_balancing_spreads_collapsed_routing_and_passes_gradients_through():
    # every token the same: the router's own logits send all of them to one expert
    opts = MoEOptions(hidden_size=8, ffn_hidden_size=16, num_experts=8, top_k=2, router_impl="torch",
                      force_load_balancing=True)
    router = TopKRouter(opts, dtype=torch.float64)
    x = torch.ones(4096, 8, dtype=torch.float64, requires_grad=True)
    torch.manual_seed(7)
    routing = router(x)
    counts = routing.tokens_per_expert.double()
    assert counts.sum().item() == 4096 * 2
    assert counts.max().item() / counts.mean().item() < 1.15  # 1024 per expert, a few % of noise
    own = router_logits_of(router, x)
    assert not torch.equal(routing.logits, own)
    # straight through: d(sum of logits * g)/d(router weight) is what the router's own logits give
    g = torch.randn_like(routing.logits)
    (routing.logits * g).sum().backward()
    expected = g.t() @ x.detach()
    assert torch.allclose(router.weight.grad, expected, rtol=1e-12, atol=1e-12)


def router_logits_of(router, x):
    from megatron_dmoe.moe.router import router_logits

    return router_logits(x.detach(), router.weight.detach())


def test_forced_load_balancing_is_megatron_lm_s_flag():
    from megatron_dmoe.config.megatron_names import flags_to_overrides

    assert flags_to_overrides(["--moe-router-force-load-balancing"], []) == (
        [], ["moe.router_force_load_balancing=true"], [], [])
