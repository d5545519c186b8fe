"""Expert-parallel token dispatch: sort rows by destination, exchange them with all-to-all.

dispatch:
  1. each assignment (token, expert e) becomes S assignments to the virtual experts of e (see
     ExpertLayout; S = 1 unless experts are split over ranks), all with the assignment's weight;
  2. counts per virtual expert are exchanged first (all_to_all on the device) and their sums start
     their way to the host (the split sizes of the row exchange);
  3. meanwhile one pass copies the rows into virtual-expert order; each rank owns consecutive
     virtual experts, so the rows for rank i form one contiguous block;
  4. the rows travel (variable-split all_to_all) and arrive as one run of local-expert groups per
     source rank. They are NOT regrouped here: the experts take them in arrival order
     (`ExpertMLP(..., counts_by_source=...)`), and the block-sparse backend writes them straight
     into its padded buffer, the copy it makes in a single-GPU layer too.
combine sends the outputs back and sums the k*S weighted outputs of each token in one pass: that
sum adds the partial outputs of split experts. Autograd flows through both exchanges.

On CUDA the two passes are the fused Triton permutation kernels; elsewhere torch gathers.

`exchange` picks how rows travel: "nccl" (steps 2-4 above: variable-split all_to_all, whose split
sizes must reach the host first), "symmetric" (symmetric.py: rows stored straight into
the peers' memory by Triton kernels, offsets computed on the device, the sort into destination
order fused into the store; ranks of one host; nothing read on the host, so it runs inside CUDA
graphs: the received rows are a bound-sized view whose real count stays on the device) or "auto"
(symmetric where the group allows it, decided at the first dispatch, else nccl).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import List, Optional

import torch

from megatron_dmoe.parallel.expert_layout import ExpertLayout

from ..dispatch.base import TokenDispatcher, sort_by_expert, weighted_sum
from ..experts.arrival import compact_offsets
from ..options import EP_EXCHANGES
from ..router import count_assignments
from .all_to_all import differentiable_all_to_all, exchange_counts
from .symmetric import SymmetricExchange


@dataclass
class ExpertParallelState:
    positions: torch.Tensor  # [T, k*S]: row of the sorted send buffer holding copy (t, j)
    weights: torch.Tensor  # [T, k*S]
    offsets: Optional[torch.Tensor]  # int32 [V + 1] group starts of the send buffer (fused kernels)
    counts: torch.Tensor  # [V] rows per virtual expert in the send buffer
    counts_by_source: torch.Tensor  # [ranks, local experts]: rows received per source and expert
    send_splits: Optional[List[int]] = None  # nccl: rows this rank sent to each rank
    recv_splits: Optional[List[int]] = None  # nccl: rows each rank sent to this rank
    plan: Optional[object] = None  # symmetric: the ExchangePlan
    exchange: Optional[object] = None  # symmetric: the SymmetricExchange; nvshmem: the NvshmemExchange
    device_splits: Optional[tuple] = None  # nvshmem: rows sent to / received from each rank, on the device
    returned_by_experts: bool = False  # symmetric: the experts store their outputs (and the received
    # rows' gradients) straight into the senders' to_sources buffers (experts/sparse_returning.py)


def expand_to_virtual_experts(layout: ExpertLayout, indices: torch.Tensor, weights: torch.Tensor):
    """[T, k] assignments to experts -> [T, k*S] to the virtual experts holding their S shards
    (ExpertLayout), weights repeated."""
    shards = layout.shards_per_expert
    if shards == 1:
        return indices, weights
    return layout.virtual_experts(indices), weights.repeat_interleave(shards, dim=1)



def _sorted_by_destination(x, virtual, counts):
    """(group offsets, sorted row of each copy, the rows in virtual-expert order) on CUDA: a
    counting sort and one pass of the fused permutation kernel."""
    from dmoe_kernels.permutation.functional import permute
    from dmoe_kernels.permutation.ops import padded_positions

    offsets = compact_offsets(counts)
    positions = padded_positions(virtual, counts, offsets)
    return offsets, positions, permute(x, positions, positions.numel(), offsets, counts)

class _HostCopy:
    """A small device tensor on its way to the host: on CUDA an asynchronous copy into pinned
    memory and an event, so work queued after it keeps the GPU busy while the host waits."""

    def __init__(self, t: torch.Tensor):
        self.event = None
        if t.is_cuda:
            self.host = torch.empty(t.shape, dtype=t.dtype, pin_memory=True)
            self.host.copy_(t, non_blocking=True)
            self.event = torch.cuda.Event()
            self.event.record()
        else:
            self.host = t

    def tolist(self) -> list:
        if self.event is not None:
            self.event.synchronize()
        return self.host.tolist()


class ExpertParallelDispatcher(TokenDispatcher):
    """dispatch -> (received rows, rows per local expert [num_local_experts], state); the rows come
    as one run of local-expert groups per source rank (state.counts_by_source). `group` is the
    expert-parallel process group.

    With the symmetric exchange the received rows are a view of a buffer that the next exchange
    overwrites: they are cloned unless `rows_consumed_at_once` says the experts copy them before
    anything else runs (the sparse backend's permutation does; its execution path says so).
    `experts_return_rows`: over the symmetric exchange the experts store their outputs into the
    senders' buffers themselves (state.returned_by_experts; the path then calls `sum_copies`
    instead of `combine`), and in backward the received rows' gradients too."""

    def __init__(self, layout: ExpertLayout, group, exchange: str = "auto", rows_consumed_at_once: bool = False,
                 experts_return_rows: bool = False):
        if exchange not in EP_EXCHANGES:
            raise ValueError(f"expert exchange {exchange!r} is not supported; use one of {EP_EXCHANGES}")
        self.layout = layout
        self.group = group
        self.exchange = exchange
        self.rows_consumed_at_once = rows_consumed_at_once
        self.experts_return_rows = experts_return_rows
        # the run's SymmetricExchanges (moe/run_state.py), set by the layer: exchanges and their
        # buffers are shared by every layer of a model
        self.exchanges = None
        self._resolved = None  # the exchange, or False for NCCL: decided at the first dispatch (collective)

    def _resolve(self, device: torch.device):
        """The exchange object (SymmetricExchange or NvshmemExchange), or None for NCCL; decided at
        the first dispatch, collectively (every rank reaches the same answer)."""
        if self.exchange == "nccl":
            return None
        if self._resolved is None:
            if self.exchanges is None:
                from .symmetric import SymmetricExchanges

                self.exchanges = SymmetricExchanges()  # a dispatcher used on its own
            exchange, reason = None, ""
            if self.exchange in ("auto", "symmetric"):
                exchange, reason = self.exchanges.get(self.group, self.layout.num_virtual_experts, device)
            if self.exchange == "nvshmem":  # asked for only: auto leaves it until runs across hosts have shown it
                exchange, reason = self.exchanges.nvshmem.get(self.group, device)
            if exchange is None and self.exchange != "auto":
                raise RuntimeError(f"expert exchange {self.exchange!r} cannot run here: {reason}; use 'nccl' or 'auto'")
            self._resolved = exchange if exchange is not None else False
        return self._resolved or None

    def dispatch(self, x, indices, weights):
        layout = self.layout
        ranks, per_rank = layout.ep_size, layout.num_local_experts
        virtual, virtual_weights = expand_to_virtual_experts(layout, indices, weights)
        exchange = self._resolve(x.device)
        if isinstance(exchange, SymmetricExchange):
            return self._dispatch_symmetric(x, virtual, virtual_weights)
        if exchange is not None:
            return self._dispatch_nvshmem(x, virtual, virtual_weights, exchange)
        if x.is_cuda and torch.cuda.is_current_stream_capturing():
            raise RuntimeError(
                "the NCCL expert-parallel exchange reads its split sizes on the host and cannot run inside a CUDA "
                "graph; use moe.ep_exchange: symmetric (GPUs of one host), nvshmem (any hosts) or "
                "training.cuda_graphs: false"
            )
        counts = count_assignments(virtual, layout.num_virtual_experts)
        counts_by_rank = counts.view(ranks, per_rank)
        received = exchange_counts(counts_by_rank, self.group)  # [source rank, local expert]
        # the one device-to-host copy (split sizes of the row exchange), overlapped with the sort
        sizes = _HostCopy(torch.cat([counts_by_rank.sum(1), received.sum(1)]))

        offsets = None
        if x.is_cuda:
            offsets, positions, x_sorted = _sorted_by_destination(x, virtual, counts)
        else:
            order, positions = sort_by_expert(virtual)
            x_sorted = x.index_select(0, order // positions.shape[1])

        split_sizes = sizes.tolist()
        send_splits, recv_splits = split_sizes[:ranks], split_sizes[ranks:]
        x_recv = differentiable_all_to_all(x_sorted, recv_splits, send_splits, self.group)
        state = ExpertParallelState(positions, virtual_weights, offsets, counts, received, send_splits, recv_splits)
        return x_recv, received.sum(0), state

    def _dispatch_symmetric(self, x, virtual, virtual_weights):
        from dmoe_kernels.permutation.ops import expert_histogram, positions_from_histogram

        from .symmetric import send_to_experts

        exchange = self._resolved
        cumulative = expert_histogram(virtual, self.layout.num_virtual_experts)  # last column: counts
        plan = exchange.plan(cumulative[:, -1])  # counts posted to every rank; offsets on the device
        positions = positions_from_histogram(virtual, cumulative, plan.offsets)  # sorted row of each copy
        x_recv = send_to_experts(x, virtual, positions, exchange, plan, returned=self.experts_return_rows)
        if not self.rows_consumed_at_once:
            x_recv = x_recv.clone()
        state = ExpertParallelState(positions, virtual_weights, plan.offsets, plan.counts, plan.counts_by_source,
                                    plan=plan, exchange=exchange, returned_by_experts=self.experts_return_rows)
        return x_recv, plan.tokens_per_expert, state

    def _dispatch_nvshmem(self, x, virtual, virtual_weights, exchange):
        """As the NCCL path, with the split sizes kept on the device (nvshmem.py)."""
        from .nvshmem import send_to_experts

        layout = self.layout
        counts = count_assignments(virtual, layout.num_virtual_experts)
        counts_by_rank = counts.view(layout.ep_size, layout.num_local_experts)
        received = exchange_counts(counts_by_rank, self.group)  # [source rank, local expert]
        offsets, positions, x_sorted = _sorted_by_destination(x, virtual, counts)
        splits = (counts_by_rank.sum(1).to(torch.int64), received.sum(1).to(torch.int64))
        x_recv = send_to_experts(x_sorted, exchange, *splits, site=id(self))
        if not self.rows_consumed_at_once:
            x_recv = x_recv.clone()
        state = ExpertParallelState(positions, virtual_weights, offsets, counts, received, exchange=exchange,
                                    device_splits=splits)
        return x_recv, received.sum(0), state

    def counts_by_source(self, state: ExpertParallelState) -> torch.Tensor:
        return state.counts_by_source

    def combine(self, y_recv, state: ExpertParallelState):
        """Outputs in arrival order -> y [T, h] = sum over copies of weight * output."""
        if state.returned_by_experts:
            raise RuntimeError("these experts' outputs were stored into the senders' buffers by the experts: "
                               "sum them with sum_copies")
        if state.device_splits is not None:
            from .nvshmem import send_to_sources

            sent, received = state.device_splits
            y_sorted = send_to_sources(y_recv, state.exchange, received, sent, state.positions.numel(), site=id(self))
        elif state.plan is not None:
            from .symmetric import send_to_sources

            y_sorted = send_to_sources(y_recv, state.exchange, state.plan)
        else:
            y_sorted = differentiable_all_to_all(y_recv, state.send_splits, state.recv_splits, self.group)
        return self.sum_copies(y_sorted, state)

    def sum_copies(self, y_sorted, state: ExpertParallelState):
        """This rank's copies' outputs back in its sorted order -> y [T, h] = sum over each token's
        copies of weight * output."""
        # a view of the exchange's buffer, which the next exchange reuses
        transient = state.plan is not None or state.device_splits is not None
        if state.offsets is not None:
            from dmoe_kernels.permutation.functional import unpermute

            # the rows the weights' gradient needs are copied out of the buffer by the same pass
            return unpermute(y_sorted, state.positions, state.offsets, state.counts, state.weights,
                             transient_input=transient)
        return weighted_sum(y_sorted.index_select(0, state.positions.reshape(-1)), state.weights)
