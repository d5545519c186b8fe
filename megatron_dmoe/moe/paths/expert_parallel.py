"""Experts spread over the expert-parallel group: rows sorted by destination and exchanged (NCCL
all-to-all or the symmetric exchange, moe/ep_dispatcher.py), the local experts on them in arrival
order, the outputs sent back and summed per token. The shared experts run on a side stream while
the exchange is in flight."""
from __future__ import annotations

from ..aux_loss import AuxLossScaler
from .base import MoEPath


class ExpertParallelPath(MoEPath):
    name = "expert_parallel"

    def __init__(self, dispatcher, backend):
        self.dispatcher = dispatcher  # an ExpertParallelDispatcher
        self.backend = backend  # the experts' backend, resolved for the weights' device and dtype

    def use_run_state(self, state) -> None:
        self.dispatcher.exchanges = state.exchanges  # exchange buffers shared by every layer

    def forward(self, layer, x, valid, num_sequences):
        routing = layer.router(x, valid)
        x_recv, _, state = self.dispatcher.dispatch(x, routing.indices, routing.weights)
        aux_loss = layer.aux_losses(routing, valid, num_sequences)
        if aux_loss is not None:
            x_recv = AuxLossScaler.apply(x_recv, aux_loss, False)
        # issued while the dispatch exchange is in flight, before anything waits on its result
        shared = layer.shared_experts.start(x) if layer.shared_experts is not None else None
        experts, opts = layer.experts, layer.experts.options
        y_recv = self.backend.mlp_in_arrival_order(
            x_recv, self.dispatcher.counts_by_source(state), experts.w1, experts.v1, experts.w2, opts.activation,
            opts.memory_optimized, experts.wgrad_stash,
        )
        y = self.dispatcher.combine(y_recv, state)
        return y if shared is None else y + layer.shared_experts.finish(shared)
