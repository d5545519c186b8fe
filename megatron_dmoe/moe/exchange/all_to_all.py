"""Variable-split all-to-all with autograd: the backward is the same exchange in reverse.

Works with any torch.distributed backend that implements all_to_all_single with uneven splits
(NCCL on GPUs, gloo between CPU processes).
"""
from __future__ import annotations

from typing import List, Sequence

import torch
import torch.distributed as dist


def all_to_all(x: torch.Tensor, output_splits: Sequence[int], input_splits: Sequence[int], group) -> torch.Tensor:
    """Rows x[sum(input_splits[:i]) : ...+input_splits[i]] go to rank i of `group`; the result
    holds, in rank order, the rows every rank sent here (output_splits[i] of them from rank i)."""
    out = x.new_empty((sum(output_splits),) + tuple(x.shape[1:]))
    dist.all_to_all_single(
        out, x.contiguous(), output_split_sizes=list(output_splits), input_split_sizes=list(input_splits), group=group
    )
    return out


class _AllToAll(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, output_splits, input_splits, group):
        ctx.output_splits, ctx.input_splits, ctx.group = output_splits, input_splits, group
        return all_to_all(x, output_splits, input_splits, group)

    @staticmethod
    def backward(ctx, grad):
        # the gradient of each received row goes back to the rank that sent the row
        return all_to_all(grad, ctx.input_splits, ctx.output_splits, ctx.group), None, None, None


def differentiable_all_to_all(
    x: torch.Tensor, output_splits: List[int], input_splits: List[int], group
) -> torch.Tensor:
    """`all_to_all` whose gradient flows back to the sending ranks.

    Every rank of `group` must run the backward too (each rank's loss depends on the exchanged
    rows), since the backward is itself a collective.
    """
    return _AllToAll.apply(x, list(output_splits), list(input_splits), group)


def exchange_counts(counts: torch.Tensor, group) -> torch.Tensor:
    """counts [ranks, n]: row i is what this rank sends rank i. Returns [ranks, n] whose row i is
    what rank i sends this rank. Stays on the device (no host sync)."""
    received = torch.empty_like(counts)
    dist.all_to_all_single(received, counts.contiguous(), group=group)
    return received
