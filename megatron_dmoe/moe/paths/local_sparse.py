"""Every expert on this rank, block-sparse kernels: the router, the block-padded plan, and one
autograd function for the permutation, the experts, the weighted combine and the aux losses'
gradient (moe/dispatch/padded.py, moe/experts/sparse.py)."""
from __future__ import annotations

from ..dispatch.padded import PaddedDispatcher, padded_experts_combine
from .base import MoEPath


class LocalSparsePath(MoEPath):
    name = "local_sparse"

    def __init__(self, dispatcher: PaddedDispatcher):
        self.dispatcher = dispatcher

    def forward(self, layer, x, valid, num_sequences):
        # the block-padded plan counts every copy anyway: without padding tokens, those are the counts
        routing = layer.router(x, valid, count=valid is not None)
        state = self.dispatcher.plan(routing.indices, routing.weights)
        if valid is None:
            routing.tokens_per_expert = state.counts
            layer.router.record_load(state.counts)
        aux_loss = layer.aux_losses(routing, valid, num_sequences)
        shared = layer.shared_experts.start(x) if layer.shared_experts is not None else None
        y = padded_experts_combine(layer.experts, x, state, aux_loss)
        return y if shared is None else y + layer.shared_experts.finish(shared)
