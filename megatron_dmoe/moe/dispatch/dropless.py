"""The dropless dispatcher of the grouped and reference experts: every routed copy kept, rows sorted
by expert with torch ops (the block-sparse experts use padded.py instead)."""
from __future__ import annotations

from dataclasses import dataclass

import torch

from ..router import count_assignments
from .base import TokenDispatcher, sort_by_expert, weighted_sum


@dataclass
class DroplessState:
    inverse_order: torch.Tensor  # [T*k]: row of x_perm that holds assignment (t, j)
    weights: torch.Tensor  # [T, k]


class DroplessDispatcher(TokenDispatcher):
    """Every assignment is kept: x_perm [T*k, h] holds the rows grouped by expert, in expert order
    and, within an expert, in token order."""

    def __init__(self, num_experts: int):
        self.num_experts = num_experts

    def dispatch(self, x, indices, weights):
        order, positions = sort_by_expert(indices)
        x_perm = x.index_select(0, order // indices.shape[1])
        tokens_per_expert = count_assignments(indices, self.num_experts)
        return x_perm, tokens_per_expert, DroplessState(positions.reshape(-1), weights)

    def combine(self, y_perm, state: DroplessState):
        return weighted_sum(y_perm.index_select(0, state.inverse_order), state.weights)
