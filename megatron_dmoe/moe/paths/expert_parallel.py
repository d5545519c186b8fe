"""Experts spread over the expert-parallel group: rows sorted by destination and exchanged (NCCL
all-to-all or the symmetric exchange, moe/exchange/dispatcher.py), the local experts on them in arrival
order, the outputs sent back and summed per token. The shared experts run on a side stream while
the exchange is in flight. Over the symmetric exchange the sparse experts store their outputs into
the senders' buffers themselves (experts/sparse_returning.py), so no combine push runs."""
from __future__ import annotations

from .base import DispatchedPath


class ExpertParallelPath(DispatchedPath):
    name = "expert_parallel"

    def __init__(self, dispatcher, backend):
        super().__init__(dispatcher)  # an ExpertParallelDispatcher
        self.backend = backend  # the experts' backend, resolved for the weights' device and dtype

    def use_run_state(self, state) -> None:
        self.dispatcher.exchanges = state.exchanges  # exchange buffers shared by every layer

    def run_experts(self, layer, rows, tokens_per_expert, state):
        experts, opts = layer.experts, layer.experts.options
        return self.backend.mlp_in_arrival_order(
            rows, self.dispatcher.counts_by_source(state), experts.w1, experts.v1, experts.w2, opts.activation,
            opts.memory_optimized, experts.wgrad_stash, opts.fp8,
        )

    def experts_and_combine(self, layer, rows, tokens_per_expert, state):
        if not state.returned_by_experts:
            return super().experts_and_combine(layer, rows, tokens_per_expert, state)
        # only the sparse backend's dispatcher says so (moe/paths/choose.py)
        from ..experts.sparse_returning import sparse_experts_returning

        experts, opts = layer.experts, layer.experts.options
        y_sorted = sparse_experts_returning(
            rows, experts.w1, experts.v1, experts.w2, state.exchange, state.plan, opts.activation,
            opts.memory_optimized, experts.wgrad_stash, self.backend.block_size, opts.fp8,
        )
        return self.dispatcher.sum_copies(y_sorted, state)
