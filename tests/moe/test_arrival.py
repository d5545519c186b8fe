"""Rows in the expert-parallel exchange's arrival order (one run of expert groups per source rank):
positions into expert-grouped buffers against a per-row loop, and every backend's
`mlp_in_arrival_order` (output and all gradients) against a float64 per-row expert MLP."""
import pytest
import torch

from megatron_dmoe.moe.experts import BACKEND_REGISTRY
from megatron_dmoe.moe.experts.arrival import arrival_positions, compact_offsets, group_rows, ungroup_rows
from moe_reference import gelu, rel_err, silu


def _loop_positions(counts, offsets):
    """Row of every arrival by walking the runs in order."""
    filled = [int(o) for o in offsets[: counts.shape[1]]]
    rows = []
    for source in range(counts.shape[0]):
        for expert in range(counts.shape[1]):
            for _ in range(int(counts[source, expert])):
                rows.append(filled[expert])
                filled[expert] += 1
    return rows


@pytest.mark.parametrize("seed", range(4))
def test_arrival_positions_match_a_walk_over_the_runs(seed):
    g = torch.Generator().manual_seed(seed)
    sources, experts = 1 + seed, 3 + seed % 2
    counts = torch.randint(0, 5, (sources, experts), generator=g)
    counts[0, 0] = 0  # empty runs, and (seed 0) an expert nobody sends to
    if seed == 0:
        counts[:, 1] = 0
    n = int(counts.sum())
    compact = compact_offsets(counts.sum(0))
    padded = torch.tensor([0, 8, 16, 24, 32, 40][: experts + 1], dtype=torch.int32)
    for offsets in (compact, padded):
        pos = arrival_positions(counts, offsets, n)
        assert pos.shape == (n, 1) and pos.dtype == torch.int32
        assert pos.view(-1).tolist() == _loop_positions(counts, offsets)
    x = torch.randn(n, 5, generator=g)
    pos = arrival_positions(counts, compact, n)
    grouped = group_rows(x, pos)
    assert torch.equal(grouped[pos.view(-1).long()], x) and torch.equal(ungroup_rows(grouped, pos), x)


def _reference(x, counts, w1, v1, w2, activation):
    """Per-row float64 MLP of the expert each arrival belongs to."""
    experts = [e for source in range(counts.shape[0]) for e in range(counts.shape[1])
               for _ in range(int(counts[source, e]))]
    rows = []
    for row, e in zip(x.double(), experts):
        h = row @ w1[e].double().t()
        a = silu(h) * (row @ v1[e].double().t()) if activation == "swiglu" else gelu(h)
        rows.append(a @ w2[e].double())
    return torch.stack(rows)


@pytest.mark.parametrize("activation", ["gelu", "swiglu"])
@pytest.mark.parametrize("backend", ["reference", "grouped", "sparse"])
@pytest.mark.slow
def test_backends_run_arrival_order_like_a_per_row_loop(backend, activation):
    g = torch.Generator().manual_seed(7)
    hidden, ffn, experts = 8, 32, 3
    counts = torch.tensor([[3, 0, 2], [1, 4, 0], [0, 2, 5]])  # 3 sources, empty runs
    n = int(counts.sum())
    x = torch.randn(n, hidden, generator=g).requires_grad_()
    w1, v1, w2 = (0.3 * torch.randn(experts, ffn, hidden, generator=g).requires_grad_() for _ in range(3))
    v1_used = v1 if activation == "swiglu" else None
    impl = BACKEND_REGISTRY[backend]
    if backend == "sparse":
        impl = type(impl)(block_size=16)
    reason = impl.unsupported_reason(torch.device("cpu"), torch.float32, hidden, ffn)
    if reason is not None:
        pytest.skip(reason)
    y = impl.mlp_in_arrival_order(x, counts, w1, v1_used, w2, activation, False)
    dy = torch.randn(y.shape, generator=g)
    params = [x, w1, w2] + ([v1] if v1_used is not None else [])
    grads = torch.autograd.grad(y, params, dy)

    xd, w1d, v1d, w2d = (t.detach().double().requires_grad_() for t in (x, w1, v1, w2))
    ref = _reference(xd, counts, w1d, v1d, w2d, activation)
    ref_params = [xd, w1d, w2d] + ([v1d] if v1_used is not None else [])
    ref_grads = torch.autograd.grad(ref, ref_params, dy.double())
    assert rel_err(y, ref) < 2e-5
    for name, got, want in zip(["x", "w1", "w2", "v1"], grads, ref_grads):
        assert rel_err(got, want) < 2e-5, name


def test_rows_past_the_real_ones_map_past_every_group():
    """A bound-sized receive buffer (the symmetric exchange's): rows past counts.sum() go to rows
    offsets[E], offsets[E] + 1, ... which no expert group covers."""
    counts = torch.tensor([[2, 0, 1], [1, 3, 0]])
    n, extra = int(counts.sum()), 5
    for offsets in (compact_offsets(counts.sum(0)), torch.tensor([0, 16, 32, 48], dtype=torch.int32)):
        pos = arrival_positions(counts, offsets, n + extra).view(-1)
        assert pos[:n].tolist() == _loop_positions(counts, offsets)
        assert pos[n:].tolist() == [int(offsets[-1]) + i for i in range(extra)]


@pytest.mark.parametrize("backend", ["reference", "grouped", "sparse"])
@pytest.mark.slow
def test_rows_past_the_real_ones_change_nothing(backend):
    """Junk (NaN) rows past the received ones: the real rows' outputs and every weight gradient are
    those of the exact-size call, and the junk rows' gradients stay in the junk rows."""
    g = torch.Generator().manual_seed(3)
    hidden, ffn, experts = 8, 32, 3
    counts = torch.tensor([[3, 0, 2], [1, 4, 0]])
    n, extra = int(counts.sum()), 7
    impl = BACKEND_REGISTRY[backend]
    if backend == "sparse":
        impl = type(impl)(block_size=16)
    reason = impl.unsupported_reason(torch.device("cpu"), torch.float32, hidden, ffn)
    if reason is not None:
        pytest.skip(reason)
    x = torch.randn(n, hidden, generator=g)
    w1, w2 = (0.3 * torch.randn(experts, ffn, hidden, generator=g) for _ in range(2))
    dy = torch.randn(n, hidden, generator=g)
    results = []
    for rows in (n, n + extra):
        xi = torch.cat([x, torch.full((rows - n, hidden), float("nan"))]).requires_grad_()
        w1i, w2i = w1.clone().requires_grad_(), w2.clone().requires_grad_()
        y = impl.mlp_in_arrival_order(xi, counts, w1i, None, w2i, "gelu", False)
        assert y.shape == (rows, hidden)
        dyi = torch.cat([dy, torch.full((rows - n, hidden), float("nan"))])
        dx, dw1, dw2 = torch.autograd.grad(y, [xi, w1i, w2i], dyi)
        results.append((y[:n], dx[:n], dw1, dw2))
    for exact, bounded in zip(*results):
        assert torch.isfinite(bounded).all()
        assert rel_err(bounded, exact) < 1e-6
