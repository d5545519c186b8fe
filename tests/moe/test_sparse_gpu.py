"""backend='sparse' on CUDA: bf16 against the float64 per-token reference, larger shapes against the
fp32 reference backend, no device-to-host synchronisation in forward + backward, CUDA-graph capture."""
import pytest
import torch

from megatron_dmoe.moe import MoELayer
from moe_reference import draw_inputs, make_config, rel_err, run_layer, run_reference

pytestmark = pytest.mark.gpu

HIDDEN = 64
AUX = dict(aux=0.05, z=0.01)
TOL = 2e-2  # bf16 keeps 8 significant bits
CASES = {
    "top2-256tok-bs128": dict(s=64, b=4, E=8, k=2, score="softmax", pre=True, renorm=False, scale=1.0, dead=[5],
                              ffn=256, bs=128),
    "top4-sigmoid-bs64": dict(s=45, b=3, E=16, k=4, score="sigmoid", pre=True, renorm=True, scale=1.0, dead=[2, 9],
                              ffn=192, bs=64),
}
_references = {}


def reference(name, activation):
    key = (name, activation)
    if key not in _references:
        case = CASES[name]
        seed = sorted(CASES).index(name) * 2 + ["gelu", "swiglu"].index(activation)
        weights = draw_inputs(case, seed, torch.bfloat16, HIDDEN, case["ffn"])
        g = torch.Generator().manual_seed(seed)
        out_grad = torch.randn(weights[0].shape, generator=g, dtype=torch.float64).bfloat16().double()
        _references[key] = (weights, out_grad, run_reference(case, activation, weights, out_grad, **AUX))
    return _references[key]


@pytest.mark.parametrize("memory_optimized", [False, True], ids=["plain", "memopt"])
@pytest.mark.parametrize("activation", ["gelu", "swiglu"])
@pytest.mark.parametrize("name", list(CASES))
def test_bf16_sparse_layer_matches_reference(name, activation, memory_optimized):
    case = CASES[name]
    weights, out_grad, (ref_out, ref_grads, chosen) = reference(name, activation)
    out, grads, load = run_layer(case, activation, "sparse", memory_optimized, weights, out_grad, torch.bfloat16,
                                 device="cuda", block_size=case["bs"], **AUX)
    assert load == [sum(e in c for c in chosen) for e in range(case["E"])]
    assert rel_err(out.cpu(), ref_out) < TOL
    for key in ("x", "router", "w1", "w2") + (("v1",) if activation == "swiglu" else ()):
        assert rel_err(grads[key].cpu(), ref_grads[key]) < TOL, key


def _layer(config, backend, seed, **kwargs):
    torch.manual_seed(seed)
    return MoELayer(config, backend=backend, **kwargs).cuda().train()


# (T, d, f, E, k): several tiles per product; and the zoo's Small MoE layer (hidden 768, 64 experts of
# width 3072, top-1) at a 16-sequence micro-batch, whose hidden size spans several chunks of the
# permutation kernels' rows
SHAPES = {"tiles": (2048, 512, 768, 16, 4), "small-model": (16384, 768, 3072, 64, 1)}


@pytest.mark.parametrize("shape", list(SHAPES))
@pytest.mark.parametrize("activation", ["gelu", "swiglu"])
def test_bf16_sparse_layer_at_tile_sizes_with_skewed_routing(activation, shape):
    """One expert taking most tokens, two taking none: bf16 sparse against the fp32 reference
    backend on the same weights."""
    T, d, f, E, k = SHAPES[shape]
    config = make_config(d, f, E, k, activation=activation, dtype=torch.float32, moe_aux_loss_coeff=0.01)
    ref = _layer(config, "reference", 7)
    sparse = _layer(config, "sparse", 7).to(torch.bfloat16)
    with torch.no_grad():
        ref.router.weight[:, 0] = 0.0
        ref.router.weight[3, 0] = 3.0  # the hot expert
        ref.router.weight[[6, 11], 0] = -30.0  # experts without tokens
        for p_ref, p_sparse in zip(ref.parameters(), sparse.parameters()):
            p_sparse.copy_(p_ref)
            p_ref.copy_(p_sparse)  # bf16 values in both: the fp32 router then picks the same experts
    x = torch.randn(T, 1, d, device="cuda").bfloat16().float()
    x[..., 0] = 1.0  # the feature the router's bias column reads
    dy = torch.randn_like(x).bfloat16().float()
    results = []
    for layer, dtype in ((ref, torch.float32), (sparse, torch.bfloat16)):
        inp = x.to(dtype).detach().requires_grad_()  # a leaf of its own for each layer
        out, _ = layer(inp)
        out.backward(dy.to(dtype))
        load = layer.run_state.metrics.snapshot()["layers"][layer.layer_number]["load"]
        layer.run_state.metrics.reset()
        results.append((load, out, inp.grad, layer.router.weight.grad, layer.experts.w1.grad, layer.experts.w2.grad)
                       + ((layer.experts.v1.grad,) if activation == "swiglu" else ()))
    (ref_load, *ref_t), (load, *got) = results
    assert load == ref_load and load[6] == load[11] == 0 and load[3] > T / 2
    for a, b in zip(got, ref_t):
        assert rel_err(a.float(), b) < TOL


def _step_layer(activation="gelu", memory_optimized=False):
    T, d, f, E, k = 1024, 256, 512, 8, 2
    config = make_config(d, f, E, k, activation=activation, dtype=torch.bfloat16,
                         moe_aux_loss_coeff=0.01, moe_z_loss_coeff=0.001)
    layer = _layer(config, "sparse", 3, memory_optimized=memory_optimized)
    x = torch.randn(T, 1, d, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    dy = torch.randn_like(x)
    return layer, x, dy


@pytest.mark.parametrize("activation,memory_optimized", [("gelu", False), ("swiglu", True)])
def test_forward_backward_never_synchronises_with_the_host(activation, memory_optimized):
    layer, x, dy = _step_layer(activation, memory_optimized)
    out, _ = layer(x)  # first step outside: Triton compiles and loads its kernels
    out.backward(dy)
    torch.cuda.synchronize()
    expected = [out.detach().clone(), x.grad.clone(), layer.experts.w1.grad.clone()]
    x.grad = None
    for p in layer.parameters():
        p.grad = None
    torch.cuda.set_sync_debug_mode("error")
    try:
        out, _ = layer(x)
        out.backward(dy)
    finally:
        torch.cuda.set_sync_debug_mode(0)
    torch.cuda.synchronize()
    for a, b in zip([out, x.grad, layer.experts.w1.grad], expected):
        assert rel_err(a.float(), b.float()) < 1e-3


def test_forward_backward_replays_as_a_cuda_graph():
    layer, x, dy = _step_layer()
    params = list(layer.parameters())
    static_x = x.detach().clone().requires_grad_()
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):  # warm up (compile) on a side stream, as capture requires
        for _ in range(2):
            out, _ = layer(static_x)
            out.backward(dy)
    torch.cuda.current_stream().wait_stream(stream)
    for t in params + [static_x]:
        t.grad = None
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        static_out, _ = layer(static_x)
        static_out.backward(dy)

    new_x = torch.randn_like(x)
    static_x.data.copy_(new_x)
    graph.replay()
    torch.cuda.synchronize()
    graph_results = [static_out.clone(), static_x.grad.clone(), layer.experts.w2.grad.clone(),
                     layer.router.weight.grad.clone()]

    eager_x = new_x.clone().requires_grad_()
    for t in params:
        t.grad = None
    out, _ = layer(eager_x)
    out.backward(dy)
    for a, b in zip(graph_results, [out, eager_x.grad, layer.experts.w2.grad, layer.router.weight.grad]):
        assert rel_err(a.float(), b.float()) < 1e-6
