"""backend='sparse' (block-sparse kernels; Triton's interpreter on CPU) against the float64 per-token
reference: the layer's output and every gradient, GELU and SwiGLU, memory-optimised on and off,
balanced and skewed routing with experts that get nothing."""
import pytest
import torch

from dmoe_kernels import max_padded_rows
from megatron_dmoe.moe import MoELayer
from megatron_dmoe.moe.experts import BACKEND_REGISTRY, resolve_backend
from megatron_dmoe.moe.experts.sparse import block_size_for
from moe_reference import (
    _min_selection_gap,
    draw_inputs,
    load_weights,
    make_config,
    rel_err,
    run_layer,
    run_reference,
)

HIDDEN = 12
AUX = dict(aux=0.05, z=0.01)
TOL = 2e-5  # the kernels in fp32 against float64

# (tokens = s*b, experts, top_k, router settings, experts without tokens, expert taking most tokens, ffn, block)
CASES = {
    "top1-skewed-bs16": dict(s=37, b=1, E=4, k=1, score="softmax", pre=True, renorm=False, scale=1.0,
                             dead=[2], hot=1, ffn=32, bs=16),
    "top2-post-softmax-bs32": dict(s=9, b=3, E=6, k=2, score="softmax", pre=False, renorm=False, scale=1.0,
                                   dead=[0, 5], hot=None, ffn=64, bs=32),
    "top3-sigmoid-hot": dict(s=13, b=2, E=8, k=3, score="sigmoid", pre=True, renorm=True, scale=2.5,
                             dead=[4, 6], hot=3, ffn=48, bs=16),
}


def draw(case, seed, dtype=torch.float32):
    """Inputs as draw_inputs makes them; with a hot expert, its router weight on the feature every
    token has is raised so that it takes most tokens (redrawn while a choice nearly ties)."""
    for attempt in range(20):
        weights = draw_inputs(case, seed * 100 + attempt, dtype, HIDDEN, case["ffn"])
        if case["hot"] is None:
            return weights
        weights[1][case["hot"], 0] = 2.0
        weights[1] = weights[1].to(dtype).double()
        if _min_selection_gap(weights[0] @ weights[1].t(), case) > 1e-5:
            return weights
    raise AssertionError("no draw without near-ties")


@pytest.mark.parametrize("memory_optimized", [False, True], ids=["plain", "memopt"])
@pytest.mark.parametrize("activation", ["gelu", "swiglu"])
@pytest.mark.parametrize("name", list(CASES))
@pytest.mark.slow
def test_sparse_layer_matches_per_token_reference(name, activation, memory_optimized):
    case = CASES[name]
    seed = sorted(CASES).index(name) * 4 + ["gelu", "swiglu"].index(activation) * 2 + memory_optimized
    weights = draw(case, seed)
    out_grad = torch.randn(weights[0].shape, generator=torch.Generator().manual_seed(seed), dtype=torch.float64)
    out, grads, load = run_layer(case, activation, "sparse", memory_optimized, weights, out_grad, torch.float32,
                                 block_size=case["bs"], **AUX)
    ref_out, ref_grads, chosen = run_reference(case, activation, weights, out_grad, **AUX)

    assert [sum(e in c for c in chosen) for e in range(case["E"])] == load
    assert all(load[e] == 0 for e in case["dead"])
    if case["hot"] is not None:
        assert load[case["hot"]] > 0.5 * sum(load) / case["k"]  # most tokens chose it
    assert rel_err(out, ref_out) < TOL
    for key in ("x", "router", "w1", "w2") + (("v1",) if activation == "swiglu" else ()):
        assert rel_err(grads[key], ref_grads[key]) < TOL, key
    assert grads["w1"][case["dead"]].abs().max() == 0  # experts without tokens get zero gradients


@pytest.mark.slow
def test_sparse_equals_reference_backend_with_padding_tokens():
    """Padding tokens are left out of the aux losses and loads but still computed, as the reference
    backend does; fp16 kernels against the fp32 reference backend."""
    case = dict(s=11, b=3, E=5, k=2, score="softmax", pre=True, renorm=False, scale=1.0, dead=[3])
    x, router_w, w1, v1, w2 = draw_inputs(case, 3, torch.float16, HIDDEN, 32)
    config = make_config(HIDDEN, 32, 5, 2, moe_aux_loss_coeff=0.05, dtype=torch.float32)
    padding = torch.zeros(3, 11, dtype=torch.bool)
    padding[1, 7:] = padding[2, 2:] = True
    results = {}
    for backend, dtype in (("reference", torch.float32), ("sparse", torch.float16)):
        layer = MoELayer(config, backend=backend, block_size=16)
        load_weights(layer, router_w, w1, v1, w2)
        layer.to(dtype).train()
        inp = x.to(dtype).view(11, 3, HIDDEN).requires_grad_()
        out, _ = layer(inp, padding_mask=padding)
        out.float().square().sum().backward()
        load = layer.run_state.metrics.snapshot()["layers"][layer.layer_number]["load"]
        results[backend] = (out, inp.grad, layer.router.weight.grad, layer.experts.w1.grad, layer.experts.w2.grad, load)
    ref, got = results["reference"], results["sparse"]
    assert got[5] == ref[5] and sum(got[5]) == 2 * int((~padding).sum())
    for a, b in zip(got[:5], ref[:5]):
        assert rel_err(a, b) < 5e-3  # fp16 against fp32


@pytest.mark.parametrize("activation", ["gelu", "swiglu"])
@pytest.mark.slow
def test_backend_on_rows_grouped_without_padding(activation):
    """SparseBackend.mlp takes unpadded expert-grouped rows (as the expert-parallel dispatcher gives
    them) and matches the reference backend, gradients included."""
    E, f, h = 5, 48, 16
    counts = torch.tensor([7, 0, 19, 1, 12])
    x = torch.randn(int(counts.sum()), h)
    w = [0.3 * torch.randn(E, f, h) for _ in range(3)]
    dy = torch.randn_like(x)
    results = []
    for name in ("reference", "sparse"):
        xs = x.clone().requires_grad_()
        ws = [t.clone().requires_grad_() for t in w]
        v1 = ws[1] if activation == "swiglu" else None
        y = BACKEND_REGISTRY[name].mlp(xs, counts, ws[0], v1, ws[2], activation, False)
        y.backward(dy)
        results.append([y, xs.grad, ws[0].grad, ws[2].grad] + ([ws[1].grad] if v1 is not None else []))
    for a, b in zip(results[1], results[0]):
        assert rel_err(a, b) < TOL


@pytest.mark.parametrize("activation,plain,optimized", [("gelu", 2, 1), ("swiglu", 3, 2)])
@pytest.mark.slow
def test_memory_optimized_keeps_only_the_pre_activations(activation, plain, optimized):
    config = make_config(HIDDEN, 32, 4, 2, activation=activation, dtype=torch.float32)
    x = torch.randn(7, 2, HIDDEN)
    counts = {}
    for mode in (False, True):
        layer = MoELayer(config, backend="sparse", memory_optimized=mode, block_size=16)
        layer.train()
        saved = []
        with torch.autograd.graph.saved_tensors_hooks(lambda t: saved.append(tuple(t.shape)) or t, lambda t: t):
            out, _ = layer(x)
        out.sum().backward()
        # sparse data [max_blocks, 16, 16]: pre-activation(s), and the activation unless optimised
        counts[mode] = sum(1 for s in saved if len(s) == 3 and s[1:] == (16, 16))
        # of the padded [rows, hidden] buffers only the expert input: the router-weight gradient
        # comes from the activation's backward, not from a kept expert output
        rows = max_padded_rows(14 * 2, 4, 16)
        assert saved.count((rows, HIDDEN)) == 1
    assert counts == {False: plain, True: optimized}


def test_backend_choice_and_errors():
    cpu = torch.device("cpu")
    assert resolve_backend("auto", cpu, torch.float32, 16, 128).name == "reference"  # auto stays on CPU
    assert resolve_backend("sparse", cpu, torch.float32, 16, 128).name == "sparse"
    with pytest.raises(ValueError, match="bfloat16"):
        resolve_backend("sparse", cpu, torch.bfloat16, 16, 128)
    with pytest.raises(ValueError, match="float64"):
        resolve_backend("sparse", cpu, torch.float64, 16, 128)
    with pytest.raises(ValueError, match="ffn_hidden_size=24"):
        resolve_backend("sparse", cpu, torch.float32, 16, 24)
    assert [block_size_for(f, 128) for f in (384, 192, 96, 48, 24)] == [128, 64, 32, 16, None]
    assert block_size_for(384, 64) == 64
    message = r"MoE option 'ffn_hidden_size'=48: 48 is not a multiple of block_size \(128\)"
    with pytest.raises(ValueError, match=message):
        MoELayer(make_config(HIDDEN, 48, 4, 2), backend="sparse")


@pytest.mark.slow
def test_separate_permutation_and_combine_equal_the_fused_path():
    """permute -> experts -> unpermute (separate functions) against the layer's one function for the
    permutation, experts and combine."""
    from dmoe_kernels import permute, unpermute
    from megatron_dmoe.moe.dispatch.padded import PaddedDispatcher, padded_experts_combine
    from megatron_dmoe.moe.experts.sparse import sparse_expert_mlp

    config = make_config(HIDDEN, 32, 5, 2, activation="swiglu", dtype=torch.float32)
    layer = MoELayer(config, backend="sparse", block_size=16)
    x = torch.randn(19, HIDDEN)
    routing = layer.router(x)
    dispatcher = PaddedDispatcher(5, 32, 16)
    results = []
    for fused in (False, True):
        xs = x.clone().requires_grad_()
        w = routing.weights.detach().clone().requires_grad_()
        for p in layer.experts.parameters():
            p.grad = None
        if fused:
            y = padded_experts_combine(layer.experts, xs, dispatcher.plan(routing.indices, w))
        else:
            state = dispatcher.plan(routing.indices, w)
            assert torch.equal(state.counts, torch.bincount(routing.indices.flatten(), minlength=5))
            topo, e = state.topology, layer.experts
            x_pad = permute(xs, state.positions, topo.shape[0], topo.expert_offsets, state.counts)
            y_pad = sparse_expert_mlp(x_pad, e.w1, e.v1, e.w2, topo, "swiglu")
            y = unpermute(y_pad, state.positions, topo.expert_offsets, state.counts, state.weights)
        y.square().sum().backward()
        results.append([y, xs.grad, w.grad] + [p.grad.clone() for p in layer.experts.parameters()])
    for a, b in zip(*results):
        assert rel_err(a, b) < 1e-5
