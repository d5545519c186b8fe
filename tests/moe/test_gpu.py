"""The layer in bf16 on CUDA, both backends, against the float64 per-token reference on CPU."""
import pytest
import torch

from moe_reference import draw_inputs, rel_err, run_layer, run_reference

pytestmark = pytest.mark.gpu

CASES = {
    "top2-128tok": dict(s=32, b=4, E=8, k=2, score="softmax", pre=True, renorm=False, scale=1.0, dead=[5]),
    "top1-135tok": dict(s=45, b=3, E=6, k=1, score="softmax", pre=True, renorm=False, scale=1.0, dead=[0]),
    "top4-sigmoid": dict(s=25, b=2, E=16, k=4, score="sigmoid", pre=True, renorm=True, scale=1.0, dead=[2, 9]),
}
HIDDEN, FFN = 64, 96  # multiples of 8: grouped_mm's 16-byte strides in bf16
TOL = 2e-2  # bf16 keeps 8 significant bits
AUX = dict(aux=0.05, z=0.01)
_references = {}


def reference(name, activation):
    """Inputs and the (slow, per-token) reference result, once per case and activation."""
    key = (name, activation)
    if key not in _references:
        case = CASES[name]
        seed = sorted(CASES).index(name) * 2 + ["gelu", "swiglu"].index(activation)
        weights = draw_inputs(case, seed, torch.bfloat16, HIDDEN, FFN)
        g = torch.Generator().manual_seed(seed)
        out_grad = torch.randn(weights[0].shape, generator=g, dtype=torch.float64).bfloat16().double()
        _references[key] = (weights, out_grad, run_reference(case, activation, weights, out_grad, **AUX))
    return _references[key]


def check(out, grads, ref_out, ref_grads, activation):
    assert rel_err(out.cpu(), ref_out) < TOL
    for key in ("x", "router", "w1", "w2") + (("v1",) if activation == "swiglu" else ()):
        assert rel_err(grads[key].cpu(), ref_grads[key]) < TOL, key


@pytest.mark.parametrize("memory_optimized", [False, True], ids=["plain", "memopt"])
@pytest.mark.parametrize("backend", ["reference", "grouped"])
@pytest.mark.parametrize("activation", ["gelu", "swiglu"])
@pytest.mark.parametrize("name", list(CASES))
def test_bf16_layer_on_cuda_matches_reference(name, activation, backend, memory_optimized):
    case = CASES[name]
    weights, out_grad, (ref_out, ref_grads, chosen) = reference(name, activation)
    out, grads, load = run_layer(
        case, activation, backend, memory_optimized, weights, out_grad, torch.bfloat16, device="cuda", **AUX
    )
    assert load == [sum(e in c for c in chosen) for e in range(case["E"])]
    check(out, grads, ref_out, ref_grads, activation)


@pytest.mark.parametrize("activation", ["gelu", "swiglu"])
def test_bf16_capacity_layer_on_cuda_with_room_for_everything(activation):
    case = CASES["top2-128tok"]
    weights, out_grad, (ref_out, ref_grads, _) = reference("top2-128tok", activation)
    out, grads, _ = run_layer(
        case, activation, "auto", False, weights, out_grad, torch.bfloat16, device="cuda",
        capacity_factor=float(case["E"]), **AUX
    )
    check(out, grads, ref_out, ref_grads, activation)


def test_auto_backend_on_cuda_picks_sparse_for_bf16_and_grouped_for_untileable_widths():
    from megatron_dmoe.moe.experts import resolve_backend

    assert resolve_backend("auto", torch.device("cuda"), torch.bfloat16, HIDDEN, FFN).name == "sparse"
    assert resolve_backend("auto", torch.device("cuda"), torch.bfloat16, HIDDEN, 200).name == "grouped"


@pytest.mark.gpu
def test_shared_expert_on_a_side_stream_gives_the_same_output_and_gradients():
    """SharedExpertMLP.overlap (set by the layer under expert parallelism): forward and backward on a
    side stream give what the same module gives on the current stream, bit for bit."""
    from megatron_dmoe.moe import MoEOptions, SharedExpertMLP

    opts = MoEOptions(hidden_size=256, ffn_hidden_size=256, num_experts=4, shared_expert_ffn_hidden_size=512,
                      shared_expert_gate=True)
    mlp = SharedExpertMLP(opts, dtype=torch.bfloat16, device="cuda")
    x = torch.randn(4096, 256, device="cuda", dtype=torch.bfloat16)
    dy = torch.randn_like(x)
    results = []
    for overlap in (False, True):
        mlp.overlap = overlap
        mlp.zero_grad(set_to_none=True)
        inp = x.clone().requires_grad_()
        y = mlp.start(inp)
        busy = torch.randn(4096, 4096, device="cuda") @ torch.randn(4096, 4096, device="cuda")  # main stream work
        out = mlp.finish(y) + 0 * busy[:1, :1].to(y.dtype)
        out.backward(dy)
        results.append([out.detach(), inp.grad] + [p.grad for p in mlp.parameters()])
    assert mlp._side_streams, "the overlapped call used no side stream"
    for a, b in zip(*results):
        assert torch.equal(a, b)
