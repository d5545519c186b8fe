"""Checks run inside every process (see process_group.run_in_processes): the symmetric-memory
exchange, or the NVSHMEM one, against the NCCL one on the same routing, call after call with growing and shrinking
batches (so the shared buffers are created, grown and reused, and stale rows would show).

Both are pure data movement around the same weighted sum, so in float32 the received rows, counts,
outputs and gradients must be bitwise equal.
"""
import torch
import torch.distributed as dist
from megatron.core import parallel_state as ps

from megatron_dmoe.moe.exchange.dispatcher import ExpertParallelDispatcher
from megatron_dmoe.parallel.distributed import init_distributed
from megatron_dmoe.parallel.expert_layout import ExpertLayout

EXPERTS, TOP_K, HIDDEN = 8, 2, 40
# per call on rank 0; other ranks scale these differently. A buffer grows collectively, so ranks
# must agree on when: every rank outgrows the symmetric exchange's buffers in calls 1 and 3; the
# NVSHMEM exchange's send floor (config/nvshmem_rows.py, 26,215 rows of HIDDEN fp32) raises its
# buffers at call 0, which calls 1 and 2 stay under on every rank (up to 4) and call 3 outgrows on
# every rank. In training every rank passes the same token count.
TOKENS = (13, 1000, 400, 30000)


def _exchange(dispatcher, x, indices, weights):
    x = x.clone().requires_grad_()
    w = weights.clone().requires_grad_()
    x_recv, tokens_per_expert, state = dispatcher.dispatch(x, indices, w)
    received = x_recv.detach().clone()
    counts = dispatcher.counts_by_source(state).to(torch.int64).clone()
    y = dispatcher.combine(x_recv * 2.0, state)  # the "experts" double every row
    g = torch.randn(y.shape, generator=torch.Generator(device=y.device).manual_seed(5), device=y.device)
    (y * g).sum().backward()
    return received, tokens_per_expert.to(torch.int64), counts, y.detach(), x.grad, w.grad


def check_exchange_matches_nccl(ep: int, exchange: str = "symmetric") -> None:
    """exchange: symmetric or nvshmem (one per process: torch allows one symmetric-memory backend)."""
    init_distributed("cuda", expert_model_parallel_size=ep)
    device = torch.device("cuda", torch.cuda.current_device())
    group = ps.get_expert_model_parallel_group()
    layout = ExpertLayout(EXPERTS, 64, ep, ps.get_expert_model_parallel_rank())
    nccl = ExpertParallelDispatcher(layout, group, "nccl")
    other = ExpertParallelDispatcher(layout, group, exchange)
    rank = dist.get_rank()
    for call, tokens in enumerate(TOKENS):
        tokens = tokens * (1 + rank) // (1 + call % 2)  # ranks and calls differ in size
        g = torch.Generator(device=device).manual_seed(100 * call + rank)
        x = torch.randn(tokens, HIDDEN, device=device, generator=g)
        scores = torch.rand(tokens, EXPERTS, device=device, generator=g)
        if call == 1:
            scores[:, 0] += 1.0  # most copies go to rank 0's first expert: its buffer must grow
        weights, indices = torch.topk(scores, TOP_K, dim=-1)
        expected = _exchange(nccl, x, indices, weights)
        got = _exchange(other, x, indices, weights)
        # the device-side exchanges receive into a bound-sized view: the real rows come first
        received = int(expected[1].sum())
        assert got[0].shape[0] >= ep * tokens * TOP_K, (call, rank, "received view smaller than the bound")
        got = (got[0][:received],) + got[1:]
        names = ("received rows", "tokens per expert", "counts by source", "output", "x grad", "weights grad")
        for name, a, b in zip(names, got, expected):
            assert a.shape == b.shape and torch.equal(a, b), (call, rank, name)
    assert other._resolved and other._resolved.buffers, f"the {exchange} path did not run"
