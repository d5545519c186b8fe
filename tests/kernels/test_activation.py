"""Activations on block-sparse data against torch autograd in float64, over the first nnz blocks only."""
import pytest
import torch
import torch.nn.functional as F

import dmoe_kernels as dk
from dmoe_kernels.activations.ops import activation_backward, activation_forward

TOL = {torch.float32: 1e-6, torch.float16: 2e-3}


def _err(a, b):
    a, b = a.detach().double().cpu(), b.detach().double().cpu()
    assert torch.isfinite(a).all()
    return float((a - b).norm() / b.norm().clamp_min(1e-30))


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16], ids=["fp32", "fp16"])
@pytest.mark.parametrize("activation", ["gelu", "swiglu"])
def test_activation_forward_and_backward(activation, dtype, device):
    # 71 copies over 5 experts at bs 16: 6 block rows used of the bound's 9, so blocks past nnz exist
    topo = dk.Topology.for_experts(torch.tensor([0, 30, 1, 40, 0], device=device), 71, 32, 16)
    nnz = int(topo.nnz)
    assert nnz < topo.max_blocks
    shape = topo.data_shape()
    h1 = (2 * torch.randn(shape, device=device)).to(dtype)
    h2 = torch.randn(shape, device=device).to(dtype) if activation == "swiglu" else None
    grad = torch.randn(shape, device=device).to(dtype)

    a = activation_forward(activation, h1, h2, topo.nnz)
    x1 = h1[:nnz].double().requires_grad_()
    x2 = h2[:nnz].double().requires_grad_() if h2 is not None else None
    ref = F.gelu(x1) if activation == "gelu" else F.silu(x1) * x2
    ref.backward(grad[:nnz].double())
    assert a.dtype == dtype and _err(a[:nnz], ref) < TOL[dtype]

    untouched = grad[nnz:].clone()
    d1, d2 = activation_backward(activation, grad, h1, h2, topo.nnz)
    assert d1 is grad  # written in place: the backward needs no extra buffer for it
    assert torch.equal(grad[nnz:], untouched)  # blocks past nnz are skipped
    assert _err(d1[:nnz], x1.grad) < TOL[dtype]
    if activation == "swiglu":
        assert _err(d2[:nnz], x2.grad) < TOL[dtype]
    else:
        assert d2 is None


def test_activation_rejects_mismatched_operands(device):
    topo = dk.Topology.for_experts(torch.tensor([3, 4], device=device), 7, 16, 16)
    h = torch.randn(topo.data_shape(), device=device)
    with pytest.raises(ValueError, match="swiglu needs both"):
        activation_forward("swiglu", h, None, topo.nnz)
    with pytest.raises(ValueError, match="not supported"):
        activation_forward("relu", h, None, topo.nnz)
    with pytest.raises(ValueError, match="one shape and dtype"):
        activation_forward("swiglu", h, h.half(), topo.nnz)


@pytest.mark.parametrize("activation", ["gelu", "swiglu"])
def test_weighted_backward_gives_row_dots_and_weighted_gradients(activation, device):
    """d/dh of sum(row_w[row] * act(h) * g) and the per-row sums of g * act, on a dMoE topology."""
    import dmoe_kernels.reference as ref

    topo = dk.Topology.for_experts(torch.tensor([20, 0, 3, 26], device=device), 49, 48, 16)  # F = 3
    nnz, rows = int(topo.nnz), topo.shape[0]
    shape = topo.data_shape()
    h1 = 2 * torch.randn(shape, device=device)
    h2 = torch.randn(shape, device=device) if activation == "swiglu" else None
    grad = torch.randn(shape, device=device)
    row_w = torch.rand(rows, device=device)
    act = activation_forward(activation, h1, h2, topo.nnz)
    g_dense = ref.to_dense(grad.double(), topo)

    x1 = ref.to_dense(h1.double(), topo).requires_grad_()
    x2 = ref.to_dense(h2.double(), topo).requires_grad_() if h2 is not None else None
    a_dense = F.gelu(x1) if activation == "gelu" else F.silu(x1) * x2
    (a_dense * row_w.double()[:, None] * g_dense).sum().backward()
    expected_dots = (g_dense * ref.to_dense(act.double(), topo)).sum(1)

    d1, d2, row_dot = dk.activation.activation_backward_weighted(activation, grad, h1, h2, row_w, topo)
    used = int(topo.expert_offsets[-1])
    assert row_dot.shape == (rows, 3)
    assert _err(row_dot[:used].sum(1), expected_dots[:used]) < 1e-6
    assert _err(ref.to_dense(d1, topo)[:used], x1.grad[:used]) < 1e-6
    assert d1.data_ptr() == grad.data_ptr() and nnz < topo.max_blocks
    if activation == "swiglu":
        assert _err(ref.to_dense(d2, topo)[:used], x2.grad[:used]) < 1e-6


@pytest.mark.parametrize("keep", [True, False], ids=["kept", "slots-only"])
@pytest.mark.parametrize("weighted", [False, True], ids=["plain", "weighted"])
@pytest.mark.parametrize("activation", ["gelu", "swiglu"])
def test_backward_stores_the_window_operands_into_slot_counter(activation, weighted, keep, device):
    """With slots, the pass also stores act, d_h1 (and d_h2) into slot `counter` of each window
    (counters read on the device, each its own), over the first nnz blocks; other slots and the
    blocks past nnz keep what they held. Kept, the in-place results are those of the pass without
    slots; otherwise grad is left as it was and nothing is returned for the gradients."""
    topo = dk.Topology.for_experts(torch.tensor([20, 0, 3, 26], device=device), 49, 48, 16)
    nnz, shape = int(topo.nnz), topo.data_shape()
    assert nnz < topo.max_blocks
    h1 = 2 * torch.randn(shape, device=device)
    h2 = torch.randn(shape, device=device) if activation == "swiglu" else None
    grad = torch.randn(shape, device=device)
    row_w = torch.rand(topo.shape[0], device=device)

    def backward(g, slots=None, keep=True):
        if weighted:
            return dk.activation.activation_backward_weighted(activation, g, h1, h2, row_w, topo, slots, keep)[:2]
        return dk.activation.activation_backward(activation, g, h1, h2, topo.nnz, slots, keep)

    ref_d1, ref_d2 = backward(grad.clone())
    ref_act = activation_forward(activation, h1, h2, topo.nnz)
    names = ("act", "d1", "d2") if activation == "swiglu" else ("act", "d1")
    stacked = {n: torch.randn(3, *shape, device=device) for n in names}
    counters = {n: torch.tensor([c], dtype=torch.int32, device=device) for n, c in zip(names, (1, 2, 0))}
    before = {n: t.clone() for n, t in stacked.items()}
    slots = tuple((stacked[n], counters[n]) if n in stacked else None for n in ("act", "d1", "d2"))
    grad_before = grad.clone()
    d1, d2 = backward(grad, slots, keep)

    if keep:
        assert torch.equal(d1[:nnz], ref_d1[:nnz])
    else:
        assert d1 is None and d2 is None and torch.equal(grad, grad_before)
    expected = {"act": ref_act, "d1": ref_d1, "d2": ref_d2}
    for n in names:
        c = int(counters[n])
        assert torch.equal(stacked[n][c, :nnz], expected[n][:nnz]), n
        assert torch.equal(stacked[n][c, nnz:], before[n][c, nnz:]), n
        for other in {0, 1, 2} - {c}:
            assert torch.equal(stacked[n][other], before[n][other]), (n, other)
    with pytest.raises(ValueError, match="slots"):
        backward(grad, (slots[0], slots[1], slots[0] if activation == "gelu" else None))
    with pytest.raises(ValueError, match="pass slots"):
        backward(grad, None, keep=False)
