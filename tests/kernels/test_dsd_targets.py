"""ops.dsd(data, topology, b, targets=RowTargets(...)): S @ b's rows stored into other buffers (one
per "rank", addressed through a table as the symmetric-memory peers are on GPUs) instead of a
local output: row r to row targets[r] // R of buffer targets[r] % R, negative targets nowhere.
Against the local product's rows placed by hand, for the persistent TMA kernel (whose epilogue
stores them) and the generic one (the product, then a push), from a slot too; on CPU through
Triton's interpreter."""
import pytest
import torch

import dmoe_kernels as dk
from dmoe_kernels import ops
from dmoe_kernels.products.ops import RowTargets

PATHS = {"tma": dk.DsdConfig(block_n=32, block_k=16, group_m=2, persistent=True),
         "tma-wide": dk.DsdConfig(block_n=256, block_k=16, group_m=2, persistent=True),
         "generic": dk.DsdConfig(block_n=32, block_k=16, group_m=2, persistent=False)}


def _addresses(buffers):
    return torch.tensor([b.data_ptr() for b in buffers], dtype=torch.int64, device=buffers[0].device)


def _random_targets(rows, used_rows, ranks, capacity, generator):
    """A target for every used row that is not padding (a random one of them), each (rank, row)
    at most once; -1 elsewhere."""
    targets = torch.full((rows,), -1, dtype=torch.int64)
    live = torch.randperm(used_rows, generator=generator)[: min(used_rows * 2 // 3, ranks * capacity)]
    slots = torch.randperm(ranks * capacity, generator=generator)[: live.numel()]
    targets[live] = (slots % capacity) * ranks + slots // capacity
    return targets


@pytest.mark.parametrize("path", list(PATHS))
@pytest.mark.parametrize("ranks", [1, 3])
def test_rows_land_at_their_targets_and_nowhere_else(path, ranks, device):
    g = torch.Generator().manual_seed(17 + ranks)
    topo = dk.Topology.for_experts(torch.tensor([20, 0, 3, 26], device=device), 70, 48, 16)
    data = torch.randn(*topo.data_shape(), generator=g).to(device)
    N = 40 if path != "tma-wide" else 300  # widths past the tile: masked columns
    b = torch.randn(topo.shape[1], N, generator=g).to(device)
    expected_rows = ops.dsd(data, topo, b, config=PATHS[path])
    used = int(topo.nnz.item()) // topo.blocks_per_row * topo.block_size
    capacity = 60
    targets = _random_targets(topo.shape[0], used, ranks, capacity, g).to(device)
    buffers = [torch.full((capacity, N), 7.0, device=device) for _ in range(ranks)]
    assert ops.dsd(data, topo, b, config=PATHS[path], targets=RowTargets(targets, _addresses(buffers))) is None
    expected = [torch.full((capacity, N), 7.0, device=device) for _ in range(ranks)]
    for r, t in enumerate(targets.tolist()):
        if t >= 0:
            expected[t % ranks][t // ranks] = expected_rows[r]
    for got, want in zip(buffers, expected):
        assert torch.equal(got, want)


@pytest.mark.parametrize("path", ["tma", "generic"])
def test_rows_from_a_slot_land_at_their_targets(path, device):
    g = torch.Generator().manual_seed(5)
    topo = dk.Topology.for_experts(torch.tensor([9, 17], device=device), 40, 32, 16)
    stacked = torch.randn(2, *topo.data_shape(), generator=g).to(device)
    b = torch.randn(topo.shape[1], 24, generator=g).to(device)
    counter = torch.tensor([1], dtype=torch.int32, device=device)
    targets = torch.arange(topo.shape[0], dtype=torch.int64, device=device) * 2  # all to "rank" 0
    buffers = [torch.zeros(topo.shape[0], 24, device=device), torch.zeros(1, 24, device=device)]
    ops.dsd(stacked, topo, b, config=PATHS[path], slot=counter, targets=RowTargets(targets, _addresses(buffers)))
    expected = ops.dsd(stacked[1].clone(), topo, b, config=PATHS[path])
    used = int(topo.nnz.item()) // topo.blocks_per_row * topo.block_size
    assert torch.equal(buffers[0][:used], expected[:used])


def test_targets_need_s_at_b_into_no_out_and_one_int64_per_row(device):
    topo = dk.Topology.for_experts(torch.tensor([16, 16], device=device), 32, 32, 16)
    data = torch.randn(*topo.data_shape(), device=device)
    b = torch.randn(topo.shape[1], 8, device=device)
    ptrs = torch.zeros(1, dtype=torch.int64, device=device)
    good = RowTargets(torch.zeros(topo.shape[0], dtype=torch.int64, device=device), ptrs)
    with pytest.raises(ValueError, match="targets are for S @ b"):
        ops.dsd(data, topo, torch.randn(topo.shape[0], 8, device=device), transpose=True, targets=good)
    with pytest.raises(ValueError, match="targets are for S @ b"):
        ops.dsd(data, topo, b, out=torch.empty(topo.shape[0], 8, device=device), targets=good)
    with pytest.raises(ValueError, match=r"targets must be int64 \[64\]"):
        ops.dsd(data, topo, b, targets=RowTargets(torch.zeros(topo.shape[0], dtype=torch.int32, device=device), ptrs))
