"""Which expert shares each expert-parallel rank holds, and the virtual-expert expansion (one process)."""
import pytest
import torch

from megatron_dmoe.moe.exchange.dispatcher import expand_to_virtual_experts
from megatron_dmoe.parallel.expert_layout import ExpertLayout

# (experts, EP, ETP): the exchange has EP x ETP ranks
LAYOUTS = [(8, 1, 1), (8, 2, 1), (8, 4, 1), (4, 4, 1), (2, 4, 1), (1, 4, 1), (2, 8, 1),
           (8, 1, 2), (8, 2, 2), (4, 4, 2), (2, 4, 2), (8, 1, 4)]


@pytest.mark.parametrize("experts,ep,etp", LAYOUTS)
def test_ranks_partition_the_global_experts(experts, ep, etp):
    ffn, hidden, ranks = 16, 3, ep * etp
    full = torch.randn(experts, ffn, hidden, generator=torch.Generator().manual_seed(experts * 10 + ep + 100 * etp))
    layouts = [ExpertLayout(experts, ffn, ranks, rank, etp) for rank in range(ranks)]
    parts = [layout.local_slice(full) for layout in layouts]
    shards = etp * max(1, ep // experts)
    for rank, (layout, part) in enumerate(zip(layouts, parts)):
        assert part.shape == layout.local_shape(hidden) == (max(1, experts // ep), ffn // shards, hidden)
        # megatron's rank order (etp fastest): expert-parallel rank g // ETP holds the experts of
        # its block, expert-tensor rank g % ETP the same ffn shard of each
        block, etp_rank = divmod(rank, etp)
        if ep <= experts:
            per, width = experts // ep, ffn // etp
            assert torch.equal(part, full[block * per : (block + 1) * per, etp_rank * width : (etp_rank + 1) * width])
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
        only_this_rank = [torch.full(layout.local_shape(1), float(r == layout.ep_rank)) for r in range(ranks)]
        cover += layout.assemble(only_this_rank)[..., 0]
    assert torch.equal(cover, torch.ones(experts, ffn))


def test_invalid_layouts_say_what_to_use():
    with pytest.raises(ValueError, match="expert_model_parallel_size=3 neither divides num_experts=8"):
        ExpertLayout(8, 16, 3, 0)
    with pytest.raises(ValueError, match="ffn_hidden_size=15 is not divisible by 2"):
        ExpertLayout(2, 15, 4, 0)
    with pytest.raises(ValueError, match="rank 4 of size 4"):
        ExpertLayout(8, 16, 4, 4)
    with pytest.raises(ValueError, match="expert_tensor_parallel_size=3 does not divide the 4 ranks"):
        ExpertLayout(8, 16, 4, 0, 3)
    with pytest.raises(ValueError, match="expert_tensor_parallel_size=2 splits each of the 8 experts into 2 ffn "
                                         "shards, but the expert ffn_hidden_size=15"):
        ExpertLayout(8, 15, 4, 0, 2)
    with pytest.raises(ValueError, match=r"expected \[8, 16, ...\]"):
        ExpertLayout(8, 16, 2, 0).local_slice(torch.zeros(4, 16, 2))


@pytest.mark.parametrize("experts,ep,etp", LAYOUTS)
def test_assignments_expand_to_every_shard_of_their_expert_with_the_same_weight(experts, ep, etp):
    layout = ExpertLayout(experts, 16, ep * etp, 0, etp)
    S = layout.shards_per_expert
    g = torch.Generator().manual_seed(3)
    indices = torch.randint(0, experts, (5, 2), generator=g)
    weights = torch.rand(5, 2, generator=g)
    virtual, virtual_weights = expand_to_virtual_experts(layout, indices, weights)
    if S == 1:
        assert virtual is indices and virtual_weights is weights
        return
    assert virtual.shape == virtual_weights.shape == (5, 2 * S)
    for t in range(5):
        for j in range(2):
            owners = [layout.virtual_owner(int(v)) for v in virtual[t, j * S : (j + 1) * S]]
            assert owners == [(int(indices[t, j]), s) for s in range(S)]
            assert torch.equal(virtual_weights[t, j * S : (j + 1) * S], weights[t, j].expand(S))


def test_two_shards_per_expert_numbered_side_by_side():
    layout = ExpertLayout(2, 16, 4, 0)  # more ranks than experts: expert e's shards are 2e, 2e + 1
    virtual, _ = expand_to_virtual_experts(layout, torch.tensor([[1, 0]]), torch.ones(1, 2))
    assert virtual.tolist() == [[2, 3, 0, 1]]
