"""Which expert shares each expert-parallel rank holds, and the virtual-expert expansion (one process)."""
import pytest
import torch

from megatron_dmoe.moe.dispatch.expert_parallel import expand_to_virtual_experts
from megatron_dmoe.parallel.expert_layout import ExpertLayout

LAYOUTS = [(8, 1), (8, 2), (8, 4), (4, 4), (2, 4), (1, 4), (2, 8)]  # (experts, EP)


@pytest.mark.parametrize("experts,ep", LAYOUTS)
def test_ranks_partition_the_global_experts(experts, ep):
    ffn, hidden = 16, 3
    full = torch.randn(experts, ffn, hidden, generator=torch.Generator().manual_seed(experts * 10 + ep))
    layouts = [ExpertLayout(experts, ffn, ep, rank) for rank in range(ep)]
    parts = [layout.local_slice(full) for layout in layouts]
    shards = max(1, ep // experts)
    for rank, (layout, part) in enumerate(zip(layouts, parts)):
        assert part.shape == layout.local_shape(hidden) == (max(1, experts // ep), ffn // shards, hidden)
        # the checkpoint offsets name the same place of the global tensor as the slice
        start = [0, 0]
        for axis, index, count in layout.global_offsets():
            start[axis] = index * full.shape[axis] // count
        region = full[start[0] : start[0] + part.shape[0], start[1] : start[1] + part.shape[1]]
        assert torch.equal(region, part), rank
    # contiguous blocks in rank order: rank r holds experts r*E/EP.. (or shard r % S of expert r // S)
    assert torch.equal(parts[0][0], full[0, : ffn // shards])
    assert torch.equal(layouts[0].assemble(parts), full)
    # every element is held by exactly one rank: assemble ones from one rank at a time and add up
    cover = torch.zeros(experts, ffn)
    for layout in layouts:
        only_this_rank = [torch.full(layout.local_shape(1), float(r == layout.ep_rank)) for r in range(ep)]
        cover += layout.assemble(only_this_rank)[..., 0]
    assert torch.equal(cover, torch.ones(experts, ffn))


def test_invalid_layouts_say_what_to_use():
    with pytest.raises(ValueError, match="expert_model_parallel_size=3 neither divides num_experts=8"):
        ExpertLayout(8, 16, 3, 0)
    with pytest.raises(ValueError, match="ffn_hidden_size=15 is not divisible by 2"):
        ExpertLayout(2, 15, 4, 0)
    with pytest.raises(ValueError, match="rank 4 of size 4"):
        ExpertLayout(8, 16, 4, 4)
    with pytest.raises(ValueError, match=r"expected \[8, 16, ...\]"):
        ExpertLayout(8, 16, 2, 0).local_slice(torch.zeros(4, 16, 2))


def test_assignments_expand_to_every_shard_of_their_expert_with_the_same_weight():
    indices = torch.tensor([[1, 0], [2, 1]])
    weights = torch.tensor([[0.75, 0.25], [0.5, 0.5]])
    virtual, virtual_weights = expand_to_virtual_experts(indices, weights, 2)
    assert virtual.tolist() == [[2, 3, 0, 1], [4, 5, 2, 3]]
    assert virtual_weights.tolist() == [[0.75, 0.75, 0.25, 0.25], [0.5, 0.5, 0.5, 0.5]]
    same, same_weights = expand_to_virtual_experts(indices, weights, 1)
    assert same is indices and same_weights is weights
