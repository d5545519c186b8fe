"""bf16 (and fp32) checks on a GPU at training block sizes: dMoE topologies from counts, poisoned outputs.

Relative error against a float64 reference within bf16 tolerance; every output is first filled with
NaN so that an unwritten block or element fails the test. The topology build and the products must
not copy anything to the host (CUDA sync debug mode turns a copy into an error).
"""

import pytest
import torch

import dmoe_kernels as dk
from dmoe_kernels import reference as ref

pytestmark = [pytest.mark.gpu, pytest.mark.usefixtures("seeded_by_name")]  # every draw seeded
BF16_TOL = 1e-2


def _rel_err(out, expected):
    assert torch.isfinite(out).all(), "non-finite values: an output was not written"
    return float((out.double() - expected.double()).norm() / expected.double().norm().clamp_min(1e-30))


def _counts(kind, num_experts, num_routed, device):
    g = None  # torch's generator, seeded per test (_seeded)
    if kind == "balanced":
        counts = torch.full((num_experts,), num_routed // num_experts)
        counts[: num_routed - int(counts.sum())] += 1
    elif kind == "empty-experts":
        p = torch.rand(num_experts, generator=g)
        p[::3] = 0  # every third expert gets nothing
        counts = torch.multinomial(p, num_routed, replacement=True, generator=g).bincount(minlength=num_experts)
    else:  # skewed: one expert takes most tokens
        p = torch.full((num_experts,), 0.2 / num_experts)
        p[1] = 0.8
        counts = torch.multinomial(p, num_routed, replacement=True, generator=g).bincount(minlength=num_experts)
    assert int(counts.sum()) == num_routed
    return counts.to(device)


CASES = [
    # (routing, experts, routed tokens, ffn, d, block size)
    ("balanced", 4, 1024, 512, 384, 128),
    ("empty-experts", 8, 1000, 256, 320, 128),  # d=320: not a multiple of the tiles
    ("skewed", 6, 1500, 384, 256, 128),
    ("skewed", 5, 700, 192, 200, 64),
    ("empty-experts", 8, 900, 256, 128, 64),
    ("balanced", 4, 512, 256, 100, 128),  # rows of 200 bytes: no TMA, the generic kernels run
]


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])  # fp32: its own configs (shared memory)
@pytest.mark.parametrize("routing, E, num_routed, ffn, d, bs", CASES)
def test_six_products(routing, E, num_routed, ffn, d, bs, dtype):
    dev = torch.device("cuda")
    counts = _counts(routing, E, num_routed, dev)
    torch.cuda.set_sync_debug_mode("error")
    try:
        topo = dk.Topology.for_experts(counts, num_routed, ffn, bs)
    finally:
        torch.cuda.set_sync_debug_mode(0)
    rows = topo.shape[0]
    bf = dtype
    tol = BF16_TOL if dtype == torch.bfloat16 else 1e-5
    x = torch.randn(rows, d, device=dev, dtype=bf)
    dy = torch.randn(rows, d, device=dev, dtype=bf)
    w1 = torch.randn(E * ffn, d, device=dev, dtype=bf)
    w2 = torch.randn(E * ffn, d, device=dev, dtype=bf)
    a = torch.randn(topo.data_shape(), device=dev, dtype=bf)
    n = int(topo.nnz)

    def poisoned(shape):
        return torch.full(shape, float("nan"), device=dev, dtype=bf)

    torch.cuda.set_sync_debug_mode("error")
    try:
        h = dk.ops.sdd(x, w1.t(), topo, out=poisoned(topo.data_shape()))  # forward SDD
        da = dk.ops.sdd(dy, w2.t(), topo, out=poisoned(topo.data_shape()))  # backward SDD
        y = dk.ops.dsd(a, topo, w2, out=poisoned((rows, d)))  # forward DSD
        dx = dk.ops.dsd(a, topo, w1, out=poisoned((rows, d)))  # data-gradient DSD
        dw2 = dk.ops.dsd(a, topo, dy, transpose=True, out=poisoned((E * ffn, d)))  # weight gradient
        dw1 = dk.ops.dsd(a, topo, x, transpose=True, out=poisoned((E * ffn, d)))
    finally:
        torch.cuda.set_sync_debug_mode(0)

    x64, dy64, w164, w264 = (t.double() for t in (x, dy, w1, w2))
    a64 = a.double()
    assert _rel_err(h[:n], ref.sdd(x64, w164.t(), topo)[:n]) < tol
    assert _rel_err(da[:n], ref.sdd(dy64, w264.t(), topo)[:n]) < tol
    assert _rel_err(y, ref.dsd(a64, topo, w264)) < tol
    assert _rel_err(dx, ref.dsd(a64, topo, w164)) < tol
    assert _rel_err(dw2, ref.dsd(a64, topo, dy64, transpose=True)) < tol
    assert _rel_err(dw1, ref.dsd(a64, topo, x64, transpose=True)) < tol


@pytest.mark.parametrize("transpose", [False, True])
def test_random_mask_and_dds_bf16(transpose):
    dev = torch.device("cuda")
    g = torch.Generator().manual_seed(7)
    mask = torch.rand(6, 9, generator=g) < 0.3
    mask[4] = False
    topo = dk.Topology.from_mask(mask.to(dev), 128, max_blocks=int(mask.sum()) + 5)
    bf = torch.bfloat16
    data = torch.randn(topo.data_shape(), device=dev, dtype=bf)
    rows, cols = topo.shape
    s_rows, s_cols = (cols, rows) if transpose else (rows, cols)
    b = torch.randn(s_cols, 300, device=dev, dtype=bf)
    out = torch.full((s_rows, 300), float("nan"), device=dev, dtype=bf)
    dk.ops.dsd(data, topo, b, transpose=transpose, out=out)
    assert _rel_err(out, ref.dsd(data.double(), topo, b.double(), transpose)) < BF16_TOL
    a = torch.randn(200, s_rows, device=dev, dtype=bf)
    out = torch.full((200, s_cols), float("nan"), device=dev, dtype=bf)
    dk.ops.dds(a, data, topo, transpose=transpose, out=out)
    assert _rel_err(out, ref.dds(a.double(), data.double(), topo, transpose)) < BF16_TOL


def test_expert_mlp_autograd_bf16():
    """Forward and backward of sdd -> gelu -> dsd in bf16 against float64 dense math."""
    dev = torch.device("cuda")
    E, ffn, d, bs = 8, 256, 384, 128
    counts = _counts("skewed", E, 2000, dev)
    topo = dk.Topology.for_experts(counts, 2000, ffn, bs)
    rows = topo.shape[0]
    bf = torch.bfloat16
    x = torch.randn(rows, d, device=dev, dtype=bf, requires_grad=True)
    w1 = (torch.randn(E * ffn, d, device=dev) * d ** -0.5).to(bf).requires_grad_()
    w2 = (torch.randn(E * ffn, d, device=dev) * ffn ** -0.5).to(bf).requires_grad_()
    y = dk.dsd(torch.nn.functional.gelu(dk.sdd(x, w1.t(), topo)), topo, w2)
    grad = torch.randn_like(y)
    y.backward(grad)
    x64, w164, w264 = (t.detach().double().requires_grad_() for t in (x, w1, w2))
    mask = ref.block_mask_dense(topo, torch.float64)
    y64 = (torch.nn.functional.gelu(x64 @ w164.t()) * mask) @ w264
    y64.backward(grad.double())
    assert _rel_err(y, y64) < BF16_TOL
    for got, want in ((x.grad, x64.grad), (w1.grad, w164.grad), (w2.grad, w264.grad)):
        assert _rel_err(got, want) < BF16_TOL


@pytest.mark.parametrize("routing, E, num_routed, ffn, d, bs", CASES)
def test_gelu_epilogue_bf16(routing, E, num_routed, ffn, d, bs):
    """sdd_gelu (the layer's GELU forward) against float64."""
    import torch.nn.functional as F

    dev = torch.device("cuda")
    topo = dk.Topology.for_experts(_counts(routing, E, num_routed, dev), num_routed, ffn, bs)
    rows, bf, n = topo.shape[0], torch.bfloat16, int(topo.nnz)
    x = torch.randn(rows, d, device=dev, dtype=bf)
    w1 = (torch.randn(E * ffn, d, device=dev) * d ** -0.5).to(bf)
    torch.cuda.set_sync_debug_mode("error")
    try:
        h, act = dk.ops.sdd_gelu(x, w1.t(), topo)
    finally:
        torch.cuda.set_sync_debug_mode(0)
    assert _rel_err(h[:n], ref.sdd(x.double(), w1.double().t(), topo)[:n]) < BF16_TOL
    assert _rel_err(act[:n], F.gelu(h[:n].double())) < BF16_TOL
