"""The GELU epilogues of SDD (ops.sdd_gelu, ops.sdd_gelu_backward) against float64 torch, on dMoE
topologies with blocks past nnz; the persistent kernel's epilogues on CPU (interpreter) and GPU."""
import pytest
import torch
import torch.nn.functional as F

import dmoe_kernels as dk
import dmoe_kernels.reference as ref
from dmoe_kernels import ops

TOL = {torch.float32: 1e-5, torch.float16: 3e-3}


def _err(a, b):
    a, b = a.detach().double().cpu(), b.detach().double().cpu()
    assert torch.isfinite(a).all()
    return float((a - b).norm() / b.norm().clamp_min(1e-30))


def _case(device, dtype, f=64, counts=(20, 0, 3, 26)):
    # bs 16, f 64: four blocks per row (two-block tiles); 49 copies use fewer rows than the bound
    topo = dk.Topology.for_experts(torch.tensor(counts, device=device), sum(counts), f, 16)
    rows, cols = topo.shape
    used = int(topo.expert_offsets[-1])
    x = torch.randn(rows, 24, device=device)
    x[used:] = 0
    w = torch.randn(cols, 24, device=device) / 5  # a weight [E*f, h]: b = w.t(), the layer's layout
    return topo, x.to(dtype), w.to(dtype), used


def _no_separate_passes(monkeypatch, topo, x, dtype):
    """Where the persistent kernel applies (the interpreter, Hopper), the epilogue must do the work:
    the separate activation passes fail the test if called."""
    from dmoe_kernels.tuning import sdd_config

    if not sdd_config(topo.block_size, topo.blocks_per_row, x.shape[1], x.device, dtype).persistent:
        return

    def fail(*args, **kwargs):
        raise AssertionError("the fused epilogue was not used")

    for name in ("activation_forward", "activation_backward", "activation_backward_weighted"):
        monkeypatch.setattr(dk.activation, name, fail)


def _dense_mask(topo):
    return ref.to_dense(torch.ones(topo.data_shape(), dtype=torch.float64, device=topo.device), topo) > 0


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16], ids=["fp32", "fp16"])
def test_sdd_gelu_matches_product_then_gelu(dtype, device, monkeypatch):
    topo, x, w, used = _case(device, dtype)
    nnz = int(topo.nnz)
    assert nnz < topo.max_blocks
    _no_separate_passes(monkeypatch, topo, x, dtype)
    h, act = ops.sdd_gelu(x, w.t(), topo)
    mask = _dense_mask(topo)
    expected_h = (x.double() @ w.double().t()) * mask
    assert h.dtype == act.dtype == dtype
    assert _err(ref.to_dense(h, topo), expected_h) < TOL[dtype]
    # GELU of h as stored: the same values the separate activation pass would give
    assert _err(act[:nnz], F.gelu(h[:nnz].double())) < TOL[dtype]


# the pointer kernel's config: the product, then the separate activation passes
UNFUSED = dk.SddConfig(blocks_per_program=1, block_k=16, group_m=2, persistent=False)


def test_sdd_gelu_without_the_persistent_kernel(device):
    topo, x, w, _ = _case(device, torch.float32)
    h, act = ops.sdd_gelu(x, w.t(), topo, config=UNFUSED)
    fused_h, fused_act = ops.sdd_gelu(x, w.t(), topo)
    nnz = int(topo.nnz)
    assert _err(h[:nnz], fused_h[:nnz]) < 1e-5 and _err(act[:nnz], fused_act[:nnz]) < 1e-5


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16], ids=["fp32", "fp16"])
@pytest.mark.parametrize("weighted", [False, True], ids=["plain", "row-weighted"])
@pytest.mark.parametrize("fused", [True, False], ids=["fused", "unfused"])
def test_sdd_gelu_backward_matches_autograd(fused, weighted, dtype, device, monkeypatch):
    topo, dy, w2, used = _case(device, dtype, counts=(7, 33, 0, 9))
    if fused:
        _no_separate_passes(monkeypatch, topo, dy, dtype)
    rows = topo.shape[0]
    h = (2 * torch.randn(topo.data_shape(), device=device)).to(dtype)
    row_w = torch.rand(rows, device=device) if weighted else None

    # reference: loss = sum(row_w[row] * gelu(h) * (dy @ w2^T)) over the topology's blocks
    mask = _dense_mask(topo)
    da = (dy.double() @ w2.double().t()) * mask
    hd = ref.to_dense(h.double(), topo).requires_grad_()
    scale = row_w.double()[:, None] if weighted else 1.0
    (F.gelu(hd) * scale * da).sum().backward()

    d_h, row_dot = ops.sdd_gelu_backward(dy, w2.t(), topo, h, row_weights=row_w, config=None if fused else UNFUSED)
    assert d_h.dtype == dtype and d_h.data_ptr() != h.data_ptr()
    assert _err(ref.to_dense(d_h, topo)[:used], hd.grad[:used]) < TOL[dtype]
    if weighted:
        assert row_dot.shape == (rows, topo.blocks_per_row) and row_dot.dtype == torch.float32
        expected = (da * F.gelu(ref.to_dense(h.double(), topo)) * mask).sum(1)
        assert _err(row_dot[:used].sum(1), expected[:used]) < TOL[dtype]
    else:
        assert row_dot is None


def test_sdd_gelu_backward_rejects_bad_operands(device):
    topo, dy, w2, _ = _case(device, torch.float32)
    h = torch.randn(topo.data_shape(), device=device)
    with pytest.raises(ValueError, match="h must be contiguous sparse data of dtype"):
        ops.sdd_gelu_backward(dy, w2.t(), topo, h.half())
    with pytest.raises(ValueError, match="row_weights must be"):
        ops.sdd_gelu_backward(dy, w2.t(), topo, h, row_weights=torch.rand(3, device=device))


@pytest.mark.parametrize("accumulate", [False, True], ids=["new", "accumulate"])
def test_weight_gradient_applies_gelu_to_its_sparse_operand(accumulate, device, monkeypatch):
    """dsd(h, topology, b, transpose=True, s_activation="gelu") = gelu(h)^T @ b, GELU applied as the
    weight-gradient kernel loads h (no separate pass where that kernel runs)."""
    from dmoe_kernels.tuning import dsd_config

    topo, dy, w2, used = _case(device, torch.float32, counts=(7, 33, 0, 9))
    h = (2 * torch.randn(topo.data_shape(), device=device))
    cols = topo.shape[1]
    if dsd_config(topo.block_size, dy.shape[1], True, device, True, torch.float32).persistent:
        _no_separate_passes(monkeypatch, topo, dy, torch.float32)
    out = torch.randn(cols, dy.shape[1], device=device) if accumulate else None
    before = out.clone() if accumulate else 0.0
    got = ops.dsd(h, topo, dy, transpose=True, s_activation="gelu", out=out, accumulate=accumulate)
    act = F.gelu(ref.to_dense(h.double(), topo)) * _dense_mask(topo)
    expected = act.t() @ dy.double() + (before.double() if accumulate else 0.0)
    assert _err(got, expected) < 1e-5
    with pytest.raises(ValueError, match="s_activation='relu' is not supported"):
        ops.dsd(h, topo, dy, transpose=True, s_activation="relu")
