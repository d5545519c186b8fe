"""ops.dsd(stacked, topology, b, slot=counter): S @ b for S = slot `counter` of stacked sparse data
[W, blocks, bs, bs], the slot read on the device (a weight-gradient window's slots, which the
activation's backward fills). Against the same product on that slot's data alone, for the
persistent TMA kernel and the generic one, every slot; on CPU through Triton's interpreter."""
import pytest
import torch

import dmoe_kernels as dk
from dmoe_kernels import ops

PATHS = {"tma": dk.DsdConfig(block_n=32, block_k=16, group_m=2, persistent=True),
         "generic": dk.DsdConfig(block_n=32, block_k=16, group_m=2, persistent=False)}


@pytest.mark.parametrize("path", list(PATHS))
def test_product_reads_the_slot_the_counter_names(path, device):
    topo = dk.Topology.for_experts(torch.tensor([20, 0, 3, 26], device=device), 70, 48, 16)
    stacked = torch.randn(3, *topo.data_shape(), device=device)
    b = torch.randn(topo.shape[1], 40, device=device)
    for slot in (2, 0, 1):
        counter = torch.tensor([slot], dtype=torch.int32, device=device)
        got = ops.dsd(stacked, topo, b, config=PATHS[path], slot=counter)
        expected = ops.dsd(stacked[slot].clone(), topo, b, config=PATHS[path])
        assert torch.equal(got, expected), slot


def test_slot_needs_stacked_data_an_int32_counter_and_s_at_b(device):
    topo = dk.Topology.for_experts(torch.tensor([16, 16], device=device), 32, 32, 16)
    stacked = torch.randn(2, *topo.data_shape(), device=device)
    b = torch.randn(topo.shape[1], 8, device=device)
    with pytest.raises(ValueError, match="slot must be an int32"):
        ops.dsd(stacked, topo, b, slot=torch.tensor([0], device=device))
    with pytest.raises(ValueError, match="slot must be an int32"):
        ops.dsd(stacked[0], topo, b, slot=torch.tensor([0], dtype=torch.int32, device=device))
    with pytest.raises(ValueError, match="slot is for S @ b"):
        ops.dsd(stacked, topo, b, transpose=True, slot=torch.tensor([0], dtype=torch.int32, device=device))
