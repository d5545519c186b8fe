"""The symmetric-memory exchange's kernels and offsets, with the ranks simulated in one process.

Under Triton's interpreter the push kernels write through a table of addresses exactly as on GPUs
(where the addresses are peer mappings); here every "rank" is a CPU buffer. Each rank's routed
copies must arrive where the NCCL path delivers them (runs of local-expert groups per source rank,
token order within), come back to the sender's sorted order, and respect the capacity. The real
multi-GPU exchange is checked against the single-process layer in test_ep_nccl.py.
"""
import pytest
import torch

from dmoe_kernels.exchange.ops import exchange_plan, post_counts, push_copies, push_rows
from dmoe_kernels.permutation.ops import expert_histogram, padded_positions, positions_from_histogram
from megatron_dmoe.moe.exchange.dispatcher import ExpertParallelDispatcher
from megatron_dmoe.moe.experts.arrival import compact_offsets
from megatron_dmoe.parallel.expert_layout import ExpertLayout


def _addresses(buffers):
    return torch.tensor([b.data_ptr() for b in buffers], dtype=torch.int64)


def _routing(ranks, local_experts, k, seed):
    """Per rank: tokens [T, H] and virtual-expert choices [T, k]; rank 1 sends nothing, the last
    rank's experts receive nothing, and token counts differ per rank."""
    g = torch.Generator().manual_seed(seed)
    V, H = ranks * local_experts, 24  # H not a power of two: masked columns
    routed = []
    for r in range(ranks):
        T = 0 if r == 1 else 5 + 3 * r
        choices = torch.stack([torch.randperm(V - local_experts, generator=g)[:k] for _ in range(T)]) if T else \
            torch.zeros(0, k, dtype=torch.int64)
        routed.append((torch.randn(T, H, generator=g), choices))
    return routed, V, H


def _counts(choices, V):
    return torch.bincount(choices.reshape(-1), minlength=V).to(torch.int32)


def _host_sizes(plan, inbox, me, local_experts):
    """The plan with its exact row counts from the count matrix (the exchange itself uses bounds)."""
    ranks = inbox.shape[0]
    matrix = inbox.reshape(ranks, ranks, local_experts).sum(-1)
    plan.send_rows, plan.recv_rows = int(matrix[me].sum()), int(matrix[:, me].sum())
    return plan


def _sorted_positions(choices, V):
    """Row of each copy when the copies are sorted by virtual expert (token order within one)."""
    counts = _counts(choices, V)
    return padded_positions(choices, counts, compact_offsets(counts))


@pytest.mark.parametrize("ranks,local_experts,k", [(2, 3, 2), (3, 2, 1), (4, 2, 3)])
def test_rows_reach_the_arrival_order_of_the_nccl_path_and_come_back_sorted(ranks, local_experts, k):
    routed, V, H = _routing(ranks, local_experts, k, seed=ranks * 10 + k)

    # as the dispatcher does: counts from the positions kernels' cumulative histogram (a strided view)
    inboxes = [torch.full((ranks, V), -1, dtype=torch.int32) for _ in range(ranks)]
    histograms = [expert_histogram(choices, V) for _, choices in routed]
    for me, cumulative in enumerate(histograms):
        post_counts(cumulative[:, -1], _addresses(inboxes), me)
    expected_matrix = torch.stack([_counts(c, V) for _, c in routed])
    for inbox in inboxes:
        assert torch.equal(inbox, expected_matrix)

    plans = [_host_sizes(exchange_plan(inboxes[me], me, local_experts), inboxes[me], me, local_experts)
             for me in range(ranks)]
    for me, plan in enumerate(plans):
        assert torch.equal(plan.offsets, compact_offsets(expected_matrix[me]))
        assert torch.equal(plan.counts, expected_matrix[me])
        assert torch.equal(plan.tokens_per_expert, plan.counts_by_source.sum(0))
    capacity = max(p.recv_rows for p in plans)
    to_experts = [torch.zeros(capacity + 3, H) for _ in range(ranks)]
    positions = [positions_from_histogram(choices, cumulative, plan.offsets)
                 for (_, choices), cumulative, plan in zip(routed, histograms, plans)]
    assert all(torch.equal(p, _sorted_positions(c, V)) for p, (_, c) in zip(positions, routed))
    for me, (x, choices) in enumerate(routed):
        push_copies(x, choices, positions[me], plans[me], _addresses(to_experts), capacity, local_experts, programs=3)

    for dest in range(ranks):
        # what NCCL delivers: per source rank, per local expert, the copies in token order
        expected, per_source = [], []
        for x, choices in routed:
            counts = []
            for e in range(dest * local_experts, (dest + 1) * local_experts):
                tokens = (choices == e).any(1).nonzero().flatten()
                expected.append(x[tokens])
                counts.append(len(tokens))
            per_source.append(counts)
        expected = torch.cat(expected)
        assert plans[dest].recv_rows == expected.shape[0]
        assert torch.equal(to_experts[dest][: expected.shape[0]], expected), dest
        assert not to_experts[dest][expected.shape[0]:].any()  # nothing written past the received rows
        assert plans[dest].counts_by_source.tolist() == per_source

    # back: every received row (scaled by a per-rank factor) returns to the sender's sorted order
    to_sources = [torch.zeros(max(p.send_rows for p in plans) + 2, H) for _ in range(ranks)]
    for me in range(ranks):
        outputs = to_experts[me][: plans[me].recv_rows] * (me + 2)
        push_rows(outputs, plans[me].recv_starts, plans[me].return_base, _addresses(to_sources),
                  to_sources[0].shape[0], me, programs_per_destination=3)
    for me, (x, choices) in enumerate(routed):
        owner = choices // local_experts  # rank that computed each copy
        for t in range(x.shape[0]):
            for j in range(k):
                row = to_sources[me][positions[me][t, j]]
                assert torch.equal(row, x[t] * (owner[t, j] + 2)), (me, t, j)


def test_rows_in_sorted_order_reach_the_same_arrival_rows():
    """The combine's backward sends rows already in sorted order (push_rows): same destinations."""
    ranks, local_experts, k = 3, 2, 2
    routed, V, H = _routing(ranks, local_experts, k, seed=7)
    inbox = torch.stack([_counts(c, V) for _, c in routed])
    plans = [_host_sizes(exchange_plan(inbox, me, local_experts), inbox, me, local_experts) for me in range(ranks)]
    capacity = max(p.recv_rows for p in plans)
    by_copies = [torch.zeros(capacity, H) for _ in range(ranks)]
    by_rows = [torch.zeros(capacity, H) for _ in range(ranks)]
    for me, (x, choices) in enumerate(routed):
        positions = _sorted_positions(choices, V)
        push_copies(x, choices, positions, plans[me], _addresses(by_copies), capacity, local_experts, programs=2)
        x_sorted = torch.empty(x.shape[0] * k, H)
        x_sorted[positions.flatten().long()] = x.repeat_interleave(k, dim=0)
        push_rows(x_sorted, plans[me].send_starts, plans[me].dest_base, _addresses(by_rows), capacity, me,
                  programs_per_destination=2)
    assert sum(int(a.any(1).sum()) for a in by_copies) == sum(p.recv_rows for p in plans) > 0
    for a, b in zip(by_copies, by_rows):
        assert torch.equal(a, b)


def test_rows_past_the_capacity_are_not_written():
    routed, V, H = _routing(2, 2, 1, seed=3)
    inbox = torch.stack([_counts(c, V) for _, c in routed])
    plan = exchange_plan(inbox, 0, 2)
    buffers = [torch.zeros(40, H) for _ in range(2)]
    x, choices = routed[0]
    push_copies(x, choices, _sorted_positions(choices, V), plan, _addresses(buffers), 2, 2, programs=2)
    for buffer in buffers:
        assert not buffer[2:].any()  # capacity 2 rows
    assert buffers[0][:2].any()  # rank 0's experts received rows from rank 0


def test_exchange_choice_on_cpu():
    """auto falls back to NCCL-style collectives off CUDA; asking for symmetric or nvshmem there says why."""
    layout = ExpertLayout(4, 8, 2, 0)
    assert ExpertParallelDispatcher(layout, None, "auto")._resolve(torch.device("cpu")) is None
    assert ExpertParallelDispatcher(layout, None, "nccl")._resolve(torch.device("cpu")) is None
    with pytest.raises(RuntimeError, match="symmetric memory needs CUDA.*use 'nccl' or 'auto'"):
        ExpertParallelDispatcher(layout, None, "symmetric")._resolve(torch.device("cpu"))
    with pytest.raises(RuntimeError, match="'nvshmem' cannot run here: NVSHMEM needs CUDA.*use 'nccl' or 'auto'"):
        ExpertParallelDispatcher(layout, None, "nvshmem")._resolve(torch.device("cpu"))
    with pytest.raises(ValueError, match="'shmem'.*nvshmem"):
        ExpertParallelDispatcher(layout, None, "shmem")


@pytest.mark.parametrize("ranks,local_experts,k", [(2, 3, 2), (4, 2, 3)])
def test_padded_rows_return_to_the_senders_sorted_order(ranks, local_experts, k):
    """The combine pushed from the experts' padded buffer (return_targets, push_to_targets) lands
    where push_rows from arrival order does; padding rows, the receive buffer's rows past the real
    ones and the padded rows past the last group go nowhere."""
    import dmoe_kernels as dk
    from dmoe_kernels.exchange.ops import push_to_targets, return_targets
    from megatron_dmoe.moe.experts.arrival import arrival_positions

    routed, V, H = _routing(ranks, local_experts, k, seed=40 + ranks)
    inbox = torch.stack([_counts(c, V) for _, c in routed])
    plans = [_host_sizes(exchange_plan(inbox, me, local_experts), inbox, me, local_experts) for me in range(ranks)]
    bound = max(p.recv_rows for p in plans) + 5  # a bound-sized receive buffer: its tail is not real
    to_experts = [torch.zeros(bound, H) for _ in range(ranks)]
    for me, (x, choices) in enumerate(routed):
        push_copies(x, choices, _sorted_positions(choices, V), plans[me], _addresses(to_experts), bound,
                    local_experts, programs=2)
    send_rows = max(p.send_rows for p in plans) + 2
    by_targets = [torch.full((send_rows, H), 9.0) for _ in range(ranks)]
    by_rows = [torch.full((send_rows, H), 9.0) for _ in range(ranks)]
    for me in range(ranks):
        to_experts[me][plans[me].recv_rows:] = 1e6  # junk past the real rows must not travel
        plan = plans[me]
        topo = dk.Topology.for_experts(plan.tokens_per_expert, bound, 32, 16, builder="torch")
        pos = arrival_positions(plan.counts_by_source, topo.expert_offsets, bound)
        padded = torch.full((topo.shape[0], H), -5.0)  # padding rows: -5, never to arrive anywhere
        padded[pos[: plan.recv_rows, 0].long()] = to_experts[me][: plan.recv_rows] * (me + 2)
        targets = return_targets(pos, plan, topo.shape[0])
        assert int((targets >= 0).sum()) == plan.recv_rows
        used = topo.expert_offsets[-1:]  # the padded rows end with the last group
        assert int((targets[int(used):] >= 0).sum()) == 0
        junk = targets.clone()
        junk[int(used):] = 0  # a row past the used ones would land on row 0 of rank 0: it must not be looked at
        push_to_targets(padded, junk, _addresses(by_targets), programs=3, used_rows=used)
        push_rows(to_experts[me][: plan.recv_rows] * (me + 2), plan.recv_starts, plan.return_base,
                  _addresses(by_rows), send_rows, me, programs_per_destination=2)
    for a, b in zip(by_targets, by_rows):
        assert torch.equal(a, b)
