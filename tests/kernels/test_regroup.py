"""regroup: the micro-batches' S_m^T @ B_m summed in one product over rows regrouped by expert,
against the float64 sum of the separate products (fp32/fp16 on the device fixture's device: the
interpreter on CPU; bf16 on the GPU)."""
import pytest
import torch

import dmoe_kernels as dk
from dmoe_kernels import reference as ref
from dmoe_kernels.permutation.ops import gather_block_rows, regroup_by_expert, summed_transposed_products

BS, F, H, E = 16, 2, 40, 4


def _micro_batch(counts, device, dtype, generator):
    """(data, topology, B) of one micro-batch with these tokens per expert; padding rows of B zero."""
    counts = torch.tensor(counts, device=device)
    topology = dk.Topology.for_experts(counts, int(counts.sum()), F * BS, block_size=BS)
    rows, cols = topology.shape
    dense = torch.randn(rows, cols, generator=generator).to(device, dtype)
    data = ref.from_dense(dense, topology)
    b = torch.randn(rows, H, generator=generator).to(device, dtype)
    return data, topology, b


# Experts without tokens in some micro-batches, and in all of them (expert 2 of the second case).
CASES = {
    "three-uneven": [[5, 0, 33, 16], [17, 1, 0, 0], [0, 40, 2, 9]],
    "expert-never-routed": [[3, 9, 0, 20], [16, 16, 0, 1]],
    "one": [[7, 20, 1, 0]],
}


def _check(case, device, dtype, tol):
    g = torch.Generator().manual_seed(11)
    parts = [_micro_batch(c, device, dtype, g) for c in CASES[case]]
    datas, topologies, dense = zip(*parts)
    start = torch.randn(E * F * BS, H, generator=g).to(device)  # a main_grad with old values
    expected = start.double() + sum(
        ref.dsd(d.double(), t, b.double(), transpose=True) for d, t, b in parts)
    out = start.clone()
    summed_transposed_products(datas, topologies, dense, out)
    err = (out.double() - expected).abs().max() / expected.abs().max()
    assert err < tol, err


# Every operand is exact in float64 and the products accumulate into fp32 whatever the operands'
# dtype: only fp32 rounding separates the result from the reference (about 1e-7 on CPU).
FP32_SUM_TOL = 1e-6


@pytest.mark.parametrize("case", CASES)
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.slow
def test_sum_of_products_matches_float64(case, dtype, device):
    _check(case, device, dtype, FP32_SUM_TOL)


@pytest.mark.gpu
@pytest.mark.parametrize("case", CASES)
def test_sum_of_products_bf16_on_gpu(case):
    _check(case, "cuda", torch.bfloat16, 1e-5)


def test_regrouped_topology_is_the_dmoe_topology_of_the_summed_counts():
    g = torch.Generator().manual_seed(3)
    parts = [_micro_batch(c, "cpu", torch.float32, g) for c in CASES["three-uneven"]]
    topologies = [t for _, t, _ in parts]
    topology, source_tensor, source_row = regroup_by_expert(topologies)
    padded = torch.tensor(CASES["three-uneven"]).add(BS - 1).div(BS, rounding_mode="floor").mul(BS).sum(0)
    assert topology.expert_offsets.tolist() == [0] + padded.cumsum(0).tolist()
    # Expert 0: micro-batch 0's one block row, then micro-batch 1's two (none from micro-batch 2).
    assert list(zip(source_tensor[:3].tolist(), source_row[:3].tolist())) == [(0, 0), (1, 0), (1, 1)]
    used = [int(t.expert_offsets[-1]) // BS for t in topologies]
    taken = sorted(zip(source_tensor[:sum(used)].tolist(), source_row[:sum(used)].tolist()))
    assert taken == [(m, r) for m, n in enumerate(used) for r in range(n)], "every used row once"
    assert (source_tensor[sum(used):] == -1).all(), "rows past the used ones are skipped"


def test_gather_copies_the_rows_and_skips_the_unused(device):
    g = torch.Generator().manual_seed(4)
    tensors = [torch.randn(3 * 4, 5, generator=g).to(device), torch.randn(2 * 4, 5, generator=g).to(device)]
    source_tensor = torch.tensor([1, 0, -1, 0, 1], dtype=torch.int32, device=device)
    source_row = torch.tensor([1, 2, 0, 0, 0], dtype=torch.int32, device=device)
    out = gather_block_rows(tensors, source_tensor, source_row, [3, 2])
    assert out.shape == (5 * 4, 5)
    for r, (m, row) in enumerate(zip(source_tensor.tolist(), source_row.tolist())):
        if m >= 0:
            assert torch.equal(out[4 * r:4 * r + 4], tensors[m][4 * row:4 * row + 4])


def test_mismatched_topologies_are_refused():
    g = torch.Generator().manual_seed(1)
    a = _micro_batch([1, 2, 3, 4], "cpu", torch.float32, g)[1]
    b = dk.Topology.for_experts(torch.tensor([1, 2, 3]), 6, F * BS, block_size=BS)
    with pytest.raises(ValueError, match="differ"):
        regroup_by_expert([a, b])
    mask = dk.Topology.from_mask(torch.ones(2, 2, dtype=torch.bool), BS)
    with pytest.raises(ValueError, match="dMoE topologies"):
        regroup_by_expert([a, mask])

