"""Every expert on this rank, grouped_mm or reference experts: rows sorted by expert, the experts'
backend on them, the weighted combine (moe/dispatch/dropless.py); each its own autograd function, the aux
losses riding on the experts' input."""
from __future__ import annotations

from ..dispatch.dropless import DroplessDispatcher
from .base import DispatchedPath


class LocalDroplessPath(DispatchedPath):
    name = "local_dropless"

    def __init__(self, dispatcher: DroplessDispatcher, backend):
        super().__init__(dispatcher)
        self.backend = backend  # the experts' backend, resolved for the weights' device and dtype

    def run_experts(self, layer, rows, tokens_per_expert, state):
        experts, opts = layer.experts, layer.experts.options
        return self.backend.mlp(rows, tokens_per_expert, experts.w1, experts.v1, experts.w2, opts.activation,
                                opts.memory_optimized, experts.wgrad_stash, opts.fp8)
