"""The token-dropping baseline (GShard / Switch style): a capacity buffer per expert, batched
matmuls over [E, capacity, h], dropped assignments adding nothing (moe/dispatch/capacity.py)."""
from __future__ import annotations

from .base import DispatchedPath


class CapacityPath(DispatchedPath):
    name = "capacity"

    def run_experts(self, layer, rows, tokens_per_expert, state):
        return layer.experts.forward_batched(rows)
