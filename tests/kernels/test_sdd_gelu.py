"""The GELU epilogue of SDD (ops.sdd_gelu) against float64 torch, on dMoE topologies with blocks past
nnz; the persistent kernel's epilogue on CPU (interpreter) and GPU, the separate passes otherwise."""
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
    the separate activation pass fails the test if called."""
    from dmoe_kernels.products.tuning import sdd_config

    if not sdd_config(topo.block_size, topo.blocks_per_row, x.shape[1], x.device, dtype).persistent:
        return

    def fail(*args, **kwargs):
        raise AssertionError("the fused epilogue was not used")

    monkeypatch.setattr(dk.activation, "activation_forward", fail)


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
