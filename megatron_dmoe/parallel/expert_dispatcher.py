"""Expert-parallel token dispatch: permute locally, exchange with all-to-all, regroup by local expert.

dispatch:
  1. each assignment (token, expert e) becomes S assignments to the virtual experts of e (see
     ExpertLayout; S = 1 unless experts are split over ranks), all with the assignment's weight;
  2. local permutation into rows grouped by virtual expert (DroplessDispatcher); since each rank
     owns consecutive virtual experts, the rows for rank i are one contiguous block;
  3. counts per virtual expert are exchanged first (all_to_all on the device), then their sums
     come to the host once (the split sizes), then the rows (variable-split all_to_all);
  4. received rows arrive grouped by source rank, then by local expert; a stable sort regroups
     them by local expert (source order kept), which is the layout the expert MLPs take.
combine runs the same steps backwards and sums the k*S weighted outputs of each token: that sum
adds the partial outputs of split experts. Autograd flows through both exchanges.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import List, Optional

import torch

from megatron_dmoe.moe.dispatcher import DroplessDispatcher, DroplessState, TokenDispatcher
from megatron_dmoe.parallel.all_to_all import differentiable_all_to_all, exchange_counts
from megatron_dmoe.parallel.expert_layout import ExpertLayout


@dataclass
class ExpertParallelState:
    local: DroplessState  # un-permutation of this rank's own assignments
    send_splits: List[int]  # rows this rank sent to each rank
    recv_splits: List[int]  # rows each rank sent to this rank
    ungroup: Optional[torch.Tensor]  # [received rows]: expert-grouped row of each received row; None = same order


def expand_to_virtual_experts(indices: torch.Tensor, weights: torch.Tensor, shards: int):
    """[T, k] assignments to experts -> [T, k*shards] to virtual experts e*shards + s, weights repeated."""
    if shards == 1:
        return indices, weights
    offsets = torch.arange(shards, device=indices.device, dtype=indices.dtype)
    virtual = (indices.unsqueeze(-1) * shards + offsets).flatten(1)
    return virtual, weights.repeat_interleave(shards, dim=1)


class ExpertParallelDispatcher(TokenDispatcher):
    """dispatch -> (rows of this rank's local experts grouped by local expert, counts per local
    expert [num_local_experts], state). `group` is the expert-parallel process group."""

    def __init__(self, layout: ExpertLayout, group):
        self.layout = layout
        self.group = group
        self.local = DroplessDispatcher(layout.num_virtual_experts)

    def dispatch(self, x, indices, weights):
        layout = self.layout
        ranks, per_rank = layout.ep_size, layout.num_local_experts
        virtual, virtual_weights = expand_to_virtual_experts(indices, weights, layout.shards_per_expert)
        x_sorted, counts, local_state = self.local.dispatch(x, virtual, virtual_weights)

        counts = counts.view(ranks, per_rank)
        received = exchange_counts(counts, self.group)  # [source rank, local expert]
        # the one device-to-host copy: split sizes of the row exchange
        sizes = torch.cat([counts.sum(1), received.sum(1)]).tolist()
        send_splits, recv_splits = sizes[:ranks], sizes[ranks:]
        x_recv = differentiable_all_to_all(x_sorted, recv_splits, send_splits, self.group)

        ungroup = None
        if per_rank > 1:
            # local expert of every received row, then a stable sort: grouped by expert, source order kept
            expert_ids = torch.arange(per_rank, device=x.device).repeat(ranks)
            row_expert = torch.repeat_interleave(expert_ids, received.reshape(-1), output_size=x_recv.shape[0])
            regroup = torch.argsort(row_expert, stable=True)
            ungroup = torch.empty_like(regroup)
            ungroup[regroup] = torch.arange(regroup.numel(), device=regroup.device)
            x_recv = x_recv.index_select(0, regroup)
        tokens_per_local_expert = received.sum(0)
        return x_recv, tokens_per_local_expert, ExpertParallelState(local_state, send_splits, recv_splits, ungroup)

    def combine(self, y_local, state: ExpertParallelState):
        if state.ungroup is not None:
            y_local = y_local.index_select(0, state.ungroup)
        y_sorted = differentiable_all_to_all(y_local, state.send_splits, state.recv_splits, self.group)
        return self.local.combine(y_sorted, state.local)
