"""Topology metadata: hand-checked arrays, and the device-built dMoE pattern against a loop."""
import pytest
import torch

from dmoe_kernels import Topology, max_padded_rows, padded_expert_offsets


def _i32(values):
    return torch.tensor(values, dtype=torch.int32)


def test_from_mask_arrays_by_hand():
    # Block mask (3 x 4):   row 0: . X . X    row 1: . . . .    row 2: X X . .
    mask = torch.tensor([[0, 1, 0, 1], [0, 0, 0, 0], [1, 1, 0, 0]], dtype=torch.bool)
    t = Topology.from_mask(mask, block_size=16, max_blocks=6)
    assert t.shape == (48, 64) and t.max_blocks == 6 and int(t.nnz) == 4
    # BCSR order: (0,1) (0,3) (2,0) (2,1), then two padding entries.
    assert torch.equal(t.row_indices, _i32([0, 0, 2, 2, 0, 0]))
    assert torch.equal(t.column_indices, _i32([1, 3, 0, 1, 0, 0]))
    assert torch.equal(t.offsets, _i32([0, 2, 2, 4]))
    # Column order: col 0: (2,0)=blk 2; col 1: (0,1)=blk 0, (2,1)=blk 3; col 2: none; col 3: (0,3)=blk 1.
    assert torch.equal(t.column_offsets, _i32([0, 1, 3, 3, 4]))
    assert torch.equal(t.row_indices_t, _i32([2, 0, 2, 0, 0, 0]))
    assert torch.equal(t.block_offsets_t, _i32([2, 0, 3, 1, 0, 0]))
    assert t.blocks_per_row is None  # row 1 is empty but row 2 is not
    for name in ("row_indices", "column_indices", "offsets", "column_offsets", "row_indices_t", "block_offsets_t",
                 "nnz"):
        assert getattr(t, name).dtype == torch.int32, name


def test_from_mask_detects_the_expert_structure():
    mask = torch.zeros(5, 9, dtype=torch.bool)
    mask[0:2, 0:3] = mask[2:4, 6:9] = True  # groups 0 and 2 (group 1 empty), then an empty row
    assert Topology.from_mask(mask, 16).blocks_per_row == 3
    shifted = mask.clone()
    shifted[2:4] = False
    shifted[2:4, 4:7] = True  # columns not aligned to a group of 3
    assert Topology.from_mask(shifted, 16).blocks_per_row is None
    unsorted = mask.clone()
    unsorted[4, 0:3] = True  # group 0 again after group 2: its column's rows are not consecutive
    assert Topology.from_mask(unsorted, 16).blocks_per_row is None
    ragged = mask.clone()
    ragged[1, 2] = False
    assert Topology.from_mask(ragged, 16).blocks_per_row is None


def _expert_mask_by_loop(counts, ffn, bs, num_routed):
    """The dMoE block mask written out expert by expert (independent of the device builder)."""
    E = len(counts)
    F = ffn // bs
    rows = max_padded_rows(num_routed, E, bs) // bs
    mask = torch.zeros(rows, E * F, dtype=torch.bool)
    starts, r = [], 0
    for e, c in enumerate(counts):
        starts.append(r * bs)
        nb = (c + bs - 1) // bs
        mask[r:r + nb, e * F:(e + 1) * F] = True
        r += nb
    starts.append(r * bs)
    return mask, starts


@pytest.mark.parametrize(
    "counts, ffn, bs",
    [
        ([5, 0, 40, 17], 64, 16),  # an empty expert, partial blocks
        ([0, 0, 70, 1, 0], 48, 16),  # skewed, odd blocks per row
        ([32, 32, 32, 32], 32, 32),  # balanced, exact blocks
        ([0, 0, 0], 32, 16),  # nothing routed
        ([1], 128, 64),  # one expert, one token
        ([130, 3], 256, 128),
    ],
)
@pytest.mark.parametrize("builder", ["triton", "torch"])
def test_for_experts_matches_loop(counts, ffn, bs, builder, device):
    num_routed = sum(counts)
    t = Topology.for_experts(torch.tensor(counts, device=device), num_routed, ffn, bs, builder=builder)
    mask, starts = _expert_mask_by_loop(counts, ffn, bs, num_routed)
    expected = Topology.from_mask(mask, bs, max_blocks=t.max_blocks)
    assert t.shape == expected.shape and t.blocks_per_row == ffn // bs
    assert t.max_blocks == mask.shape[0] * (ffn // bs)
    for name in ("nnz", "row_indices", "column_indices", "offsets", "column_offsets", "row_indices_t",
                 "block_offsets_t"):
        got, want = getattr(t, name).cpu(), getattr(expected, name).cpu()
        assert got.dtype == torch.int32, name
        assert torch.equal(got, want), f"{name}: {got.tolist()} != {want.tolist()}"
    assert t.expert_offsets.cpu().tolist() == starts
    assert padded_expert_offsets(torch.tensor(counts, device=device), bs).cpu().tolist() == starts


@pytest.mark.parametrize("builder", ["triton", "torch"])
@pytest.mark.slow
def test_for_experts_more_than_32767_blocks(builder, device):
    # 64 experts x 1024 tokens, bs 16, ffn 256: 65536 + padding rows x 16 blocks: indices beyond int16.
    counts = torch.full((64,), 1024, device=device)
    t = Topology.for_experts(counts, 64 * 1024, 256, 16, builder=builder)
    assert int(t.nnz) == 4096 * 16 > 32767
    assert int(t.column_indices[int(t.nnz) - 1]) == 64 * 16 - 1
    assert int(t.block_offsets_t[int(t.nnz) - 1]) == int(t.nnz) - 1


def test_builders_agree_on_random_counts(device):
    """The two-launch Triton builder and the torch-op builder give identical arrays, also when the
    counts exceed num_routed (both clamp to the buffers instead of writing past them)."""
    g = torch.Generator().manual_seed(3)
    names = ("nnz", "row_indices", "column_indices", "offsets", "column_offsets", "row_indices_t",
             "block_offsets_t", "expert_offsets")
    for _ in range(12):
        E = int(torch.randint(1, 40, (1,), generator=g))
        bs = (16, 32, 64, 128)[int(torch.randint(0, 4, (1,), generator=g))]
        F = int(torch.randint(1, 5, (1,), generator=g))
        counts = torch.randint(0, 3 * bs, (E,), generator=g) * (torch.rand(E, generator=g) > 0.3)
        num_routed = int(counts.sum())
        for lie in (0, 1):
            c = (counts * (1 + lie) + lie).to(device)
            a = Topology.for_experts(c, num_routed, F * bs, bs, builder="torch")
            b = Topology.for_experts(c, num_routed, F * bs, bs, builder="triton")
            for name in names:
                assert torch.equal(getattr(a, name), getattr(b, name)), (name, counts.tolist(), lie)
            assert int(b.nnz) <= b.max_blocks


def test_for_experts_errors():
    counts = torch.tensor([3, 4])
    with pytest.raises(ValueError, match="ffn_hidden_size=100 is not a multiple of block_size=64"):
        Topology.for_experts(counts, 7, 100, 64)
    with pytest.raises(ValueError, match="block_size=48"):
        Topology.for_experts(counts, 7, 96, 48)
    with pytest.raises(ValueError, match="tokens_per_expert must be a 1-D integer tensor"):
        Topology.for_experts(counts.float(), 7, 128, 64)
    with pytest.raises(ValueError, match="sums to 7, but num_routed=9"):
        Topology.for_experts(counts, 9, 128, 64, check=True)
    with pytest.raises(ValueError, match="builder='cuda'"):
        Topology.for_experts(counts, 7, 128, 64, builder="cuda")
    with pytest.raises(ValueError, match="at least one expert"):
        Topology.for_experts(counts[:0], 0, 128, 64)


def test_from_mask_errors():
    with pytest.raises(ValueError, match="mask must be 2-D"):
        Topology.from_mask(torch.ones(2, 2, 2, dtype=torch.bool), 16)
    with pytest.raises(ValueError, match="max_blocks=1 is smaller than the 4 nonzero blocks"):
        Topology.from_mask(torch.ones(2, 2, dtype=torch.bool), 16, max_blocks=1)


def test_block_sizes_match_the_moe_rules():
    """moe/options.py keeps its own copy (it must import without triton); the two must agree."""
    from dmoe_kernels.products import topology
    from megatron_dmoe.moe.options import BLOCK_SIZES

    assert sorted(BLOCK_SIZES) == sorted(topology.BLOCK_SIZES)
