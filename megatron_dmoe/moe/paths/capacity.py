"""The token-dropping baseline (GShard / Switch style): a capacity buffer per expert, batched
matmuls over [E, capacity, h], dropped assignments adding nothing (moe/capacity.py)."""
from __future__ import annotations

from ..aux_loss import AuxLossScaler
from ..capacity import CapacityDispatcher
from .base import MoEPath


class CapacityPath(MoEPath):
    name = "capacity"

    def __init__(self, dispatcher: CapacityDispatcher):
        self.dispatcher = dispatcher

    def forward(self, layer, x, valid, num_sequences):
        routing = layer.router(x, valid)
        x_buf, _, state = self.dispatcher.dispatch(x, routing.indices, routing.weights)
        aux_loss = layer.aux_losses(routing, valid, num_sequences)
        if aux_loss is not None:
            x_buf = AuxLossScaler.apply(x_buf, aux_loss, False)
        shared = layer.shared_experts.start(x) if layer.shared_experts is not None else None
        y = self.dispatcher.combine(layer.experts.forward_batched(x_buf), state)
        return y if shared is None else y + layer.shared_experts.finish(shared)
