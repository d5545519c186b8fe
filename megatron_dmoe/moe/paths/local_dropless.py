"""Every expert on this rank, grouped_mm or reference experts: rows sorted by expert, the experts'
backend on them, the weighted combine (moe/dispatcher.py); each its own autograd function, the aux
losses riding on the experts' input."""
from __future__ import annotations

from ..aux_loss import AuxLossScaler
from ..dispatcher import DroplessDispatcher
from .base import MoEPath


class LocalDroplessPath(MoEPath):
    name = "local_dropless"

    def __init__(self, dispatcher: DroplessDispatcher, backend):
        self.dispatcher = dispatcher
        self.backend = backend  # the experts' backend, resolved for the weights' device and dtype

    def forward(self, layer, x, valid, num_sequences):
        routing = layer.router(x, valid)
        x_perm, tokens_per_expert, state = self.dispatcher.dispatch(x, routing.indices, routing.weights)
        aux_loss = layer.aux_losses(routing, valid, num_sequences)
        if aux_loss is not None:
            # the experts' input is not modified in place, so it is returned as is (a view)
            x_perm = AuxLossScaler.apply(x_perm, aux_loss, False)
        shared = layer.shared_experts.start(x) if layer.shared_experts is not None else None
        experts, opts = layer.experts, layer.experts.options
        y_perm = self.backend.mlp(x_perm, tokens_per_expert, experts.w1, experts.v1, experts.w2, opts.activation,
                                  opts.memory_optimized, experts.wgrad_stash)
        y = self.dispatcher.combine(y_perm, state)
        return y if shared is None else y + layer.shared_experts.finish(shared)
