"""The sparse experts with training.fp8: blockwise (moe/experts/products.py): the forward against a
float64 emulation of the same recipe (x in 1 x 128 row tiles, the activation in 1 x bs tiles of each
block, weights in 128 x 128 blocks), and every gradient against float64 without quantization within
the recipe's error; both entry points (the experts alone and with the weighted combine), GELU and
SwiGLU. On CPU through Triton's interpreter in fp32 (its fp8 dots decode to fp16 exactly), on a
Hopper GPU in bf16."""
import pytest
import torch
import torch.nn.functional as F

import dmoe_kernels as dk
import dmoe_kernels.reference as ref
from dmoe_kernels.fp8 import reference as fp8_ref
from megatron_dmoe.moe.experts.sparse import sparse_expert_mlp, sparse_experts_combine

# e4m3 keeps 3 mantissa bits: each operand element is off by up to 2^-4 of its tile's scale; the
# products' relative error over K terms of random signs stays near 2^-4 / sqrt(3) per operand
QUANTIZED_TOL = 0.08
COUNTS = (37, 0, 9, 50)
E, F_, H, BS = 4, 64, 96, 32


def _device_dtype():
    if torch.cuda.is_available():
        if torch.cuda.get_device_capability()[0] < 9:
            pytest.skip("the fp8 products need Hopper")
        return torch.device("cuda"), torch.bfloat16
    return torch.device("cpu"), torch.float32


def _rel(a, b):
    a, b = a.detach().double().cpu(), b.detach().double().cpu()
    return float((a - b).norm() / b.norm())


def _inputs(device, dtype, swiglu, seed):
    g = torch.Generator().manual_seed(seed)
    counts = torch.tensor(COUNTS, device=device)
    topo = dk.Topology.for_experts(counts, sum(COUNTS), F_, BS)
    rows = topo.shape[0]
    x = torch.zeros(rows, H)
    offsets = topo.expert_offsets.cpu().tolist()
    for e, n in enumerate(COUNTS):  # padding rows stay zero, as the permutation writes them
        x[offsets[e]:offsets[e] + n] = torch.randn(n, H, generator=g) * torch.logspace(-1, 0.5, H)
    weights = [torch.randn(E, F_, H, generator=g) * 0.05 for _ in range(3 if swiglu else 2)]
    return topo, x, weights


def _emulated_forward(topo, x, w1, v1, w2, activation, dtype):
    """float64 on the operands the fp8 products see: each quantized as the recipe says, from the
    inputs in `dtype`, with h1 (h2) and the activation rounded to `dtype` as the kernels store them."""
    def rounded(t):
        return t.to(dtype).double()

    xq = fp8_ref.dequantize_rows(*fp8_ref.quantize_rows(rounded(x)), torch.float64)

    def up(w):
        wq = fp8_ref.dequantize_blocks(*fp8_ref.quantize_blocks(rounded(w.reshape(E * F_, H))), torch.float64)
        return rounded(xq @ wq.t())

    mask = ref.block_mask_dense(topo).cpu().double()
    h1 = up(w1) * mask
    a = rounded(F.gelu(h1) if activation == "gelu" else F.silu(h1) * (up(v1) * mask))
    # the activation's blocks quantized one row of one block at a time (1 x bs tiles along K)
    tiles = a.view(a.shape[0], -1, BS)
    scale = tiles.abs().amax(-1, keepdim=True)
    aq = fp8_ref.dequantize_rows(*fp8_ref.quantize_rows(tiles.reshape(-1, BS)), torch.float64).view_as(tiles)
    aq = torch.where(scale > 0, aq, torch.zeros_like(aq)).reshape_as(a) * mask
    w2q = fp8_ref.dequantize_blocks(*fp8_ref.quantize_blocks(rounded(w2.reshape(E * F_, H))), torch.float64)
    return aq @ w2q


def _plain(x, w1, v1, w2, activation, topo):
    """float64, no quantization: the model the fp8 run approximates."""
    mask = ref.block_mask_dense(topo).cpu().double()
    h1 = (x @ w1.reshape(E * F_, H).t()) * mask
    a = F.gelu(h1) if activation == "gelu" else F.silu(h1) * ((x @ v1.reshape(E * F_, H).t()) * mask)
    return a @ w2.reshape(E * F_, H)


@pytest.mark.parametrize("activation", ["gelu", "swiglu"])
def test_fp8_experts_forward_and_gradients(activation):
    device, dtype = _device_dtype()
    swiglu = activation == "swiglu"
    topo, x, weights = _inputs(device, dtype, swiglu, seed=7 + swiglu)
    w1, *rest = weights
    v1, w2 = (rest[0], rest[1]) if swiglu else (None, rest[0])
    used = int(topo.nnz) // topo.blocks_per_row * BS

    params = [t.to(device, dtype).clone().requires_grad_() for t in (x, w1, *([v1] if swiglu else []), w2)]
    xd, w1d, *restd = params
    v1d, w2d = (restd[0], restd[1]) if swiglu else (None, restd[0])
    y = sparse_expert_mlp(xd, w1d, v1d, w2d, topo, activation, fp8="blockwise")
    emulated = _emulated_forward(topo, x, w1, v1, w2, activation, dtype)
    # the kernels sum in another order (and within 128 of K, on Hopper, in the tensor cores' own
    # precision): an element of h1 near a rounding edge can round the other way, and move the
    # activation's e4m3 value by one step; bf16's output rounding adds 2^-9
    assert _rel(y[:used], emulated[:used]) < (1e-2 if dtype == torch.bfloat16 else 2e-3)

    dy = torch.randn(y.shape, generator=torch.Generator().manual_seed(3)) * 0.1
    dy[used:] = 0
    y.backward(dy.to(device, dtype))

    plain = [t.double().clone().requires_grad_() for t in (x, w1, *([v1] if swiglu else []), w2)]
    px, pw1, *prest = plain
    pv1, pw2 = (prest[0], prest[1]) if swiglu else (None, prest[0])
    y64 = _plain(px, pw1, pv1, pw2, activation, topo)
    y64.backward(dy.double())
    assert _rel(y[:used], y64[:used]) < QUANTIZED_TOL
    for name, got, want in zip(["x", "w1", *(["v1"] if swiglu else []), "w2"], params, plain):
        error = _rel(got.grad, want.grad)
        # within the recipe's error, and not exact: the products did run on quantized operands
        assert 1e-4 < error < QUANTIZED_TOL, (name, error)


def test_fp8_experts_with_the_weighted_combine():
    device, dtype = _device_dtype()
    g = torch.Generator().manual_seed(11)
    tokens, top_k = 48, 2
    indices = torch.stack([torch.randperm(E, generator=g)[:top_k] for _ in range(tokens)]).to(device)
    from dmoe_kernels.permutation.ops import expert_histogram, positions_from_histogram

    cumulative = expert_histogram(indices, E)
    counts = cumulative[:, -1].to(torch.int64)
    topo = dk.Topology.for_experts(counts, tokens * top_k, F_, BS)
    positions = positions_from_histogram(indices, cumulative, topo.expert_offsets)
    x = (torch.randn(tokens, H, generator=g)).to(device, dtype)
    router = torch.rand(tokens, top_k, generator=g).to(device, dtype)
    w1, w2 = (torch.randn(E, F_, H, generator=g) * 0.05 for _ in range(2))

    def run(fp8, cast):
        leaves = [t.to(device, cast).detach().requires_grad_() for t in (x, w1, w2, router)]
        y = sparse_experts_combine(leaves[0], leaves[1], None, leaves[2], leaves[3], topo, positions, counts,
                                   "gelu", fp8=fp8)
        y.float().pow(2).sum().backward()
        return y, [t.grad for t in leaves]

    y8, grads8 = run("blockwise", dtype)
    y_ref, grads_ref = run(None, torch.float32 if device.type == "cpu" else dtype)
    assert 1e-4 < _rel(y8, y_ref) < QUANTIZED_TOL
    for name, got, want in zip(["x", "w1", "w2", "router weights"], grads8, grads_ref):
        assert _rel(got, want) < QUANTIZED_TOL, name


def test_other_backends_refuse_fp8():
    from megatron_dmoe.moe.experts import BACKEND_REGISTRY

    x = torch.randn(4, H)
    w = torch.randn(2, F_, H)
    with pytest.raises(ValueError, match="has no fp8 products"):
        BACKEND_REGISTRY["reference"].mlp(x, torch.tensor([2, 2]), w, None, w, "gelu", False, None, "blockwise")


def test_fp8_experts_in_arrival_order():
    """The expert-parallel path's entry (rows in runs of expert groups, one run per source rank):
    the same fp8 products as the rows grouped by expert."""
    from megatron_dmoe.moe.experts.sparse import SparseBackend

    device, dtype = _device_dtype()
    g = torch.Generator().manual_seed(5)
    counts_by_source = torch.tensor([[5, 0, 9, 3], [7, 4, 0, 11]])
    x = torch.randn(int(counts_by_source.sum()), H, generator=g).to(device, dtype)
    w1, w2 = (torch.randn(E, F_, H, generator=g).mul(0.05).to(device, dtype) for _ in range(2))
    backend = SparseBackend(block_size=BS)
    y = backend.mlp_in_arrival_order(x, counts_by_source.to(device), w1, None, w2, "gelu", False, fp8="blockwise")
    # the same rows regrouped by expert, through the one-source path
    order = []
    starts = counts_by_source.flatten().cumsum(0) - counts_by_source.flatten()
    for e in range(E):
        for r in range(2):
            n = int(counts_by_source[r, e])
            s = int(starts[r * E + e])
            order += list(range(s, s + n))
    order = torch.tensor(order, device=device)
    grouped = backend.mlp(x[order], counts_by_source.sum(0).to(device), w1, None, w2, "gelu", False, fp8="blockwise")
    torch.testing.assert_close(y[order], grouped)
    plain = backend.mlp(x[order], counts_by_source.sum(0).to(device), w1, None, w2, "gelu", False)
    assert 1e-4 < _rel(grouped, plain) < QUANTIZED_TOL


@pytest.mark.parametrize("kind", ["expert_mlp", "combine"])
def test_fp8_weight_gradient_windows_equal_one_product_per_micro_batch(kind):
    """With a weight-gradient window the fp8 products' backward hands its rows to the window as
    copies (products.Fp8Products.windows is False): main_grad after the window equals the
    per-micro-batch accumulation (fp32 sums in another order), the input gradients are the same."""
    if torch.cuda.is_available():
        pytest.skip("the window's CPU harness (tests/moe/test_fused_wgrad.py) runs on CPU")
    from megatron_dmoe.moe.experts.per_step_wgrad import WgradStash
    from test_fused_wgrad import HIDDEN, T, _leaf_params, _problem

    def run(window, params):
        stash = WgradStash()
        stash.use_window(window)
        dxs, changed = [], []
        for seed in (31, 32, 33, 34):
            before = [p.main_grad.clone() for p in params if p is not None]
            x_in, state, _ = _problem(seed, "gelu", torch.float32, kind=kind)
            x = x_in.clone().requires_grad_()
            w1, _, w2 = params
            if kind == "expert_mlp":
                y = sparse_expert_mlp(x, w1, None, w2, state.topology, "gelu", wgrad_stash=stash, fp8="blockwise")
            else:
                y = sparse_experts_combine(x, w1, None, w2, state.weights, state.topology, state.positions,
                                           state.counts, "gelu", wgrad_stash=stash, fp8="blockwise")
            rows = T if kind == "combine" else x_in.shape[0]
            y.backward(torch.randn(rows, HIDDEN, generator=torch.Generator().manual_seed(seed + 100)))
            dxs.append(x.grad)
            changed.append(any(not torch.equal(p.main_grad, b)
                               for p, b in zip([p for p in params if p is not None], before)))
        return dxs, changed

    _, _, weights = _problem(30, "gelu", torch.float32)
    per_micro = _leaf_params(weights, torch.float32, seed=5, main_grad_only=True)
    windowed = _leaf_params(weights, torch.float32, seed=5, main_grad_only=True)
    (dx_micro, _), (dx_window, changed) = run(1, per_micro), run(2, windowed)
    assert changed == [False, True, False, True]  # main_grad moves only when a window is full
    for a, b in zip(dx_window, dx_micro):
        assert torch.equal(a, b)
    for name, p, q in zip(("w1", "v1", "w2"), windowed, per_micro):
        if p is not None:
            assert p.grad is None, name
            assert _rel(p.main_grad, q.main_grad) < 1e-6, name
