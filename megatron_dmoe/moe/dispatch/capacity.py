"""Token-dropping MoE with a capacity factor (the paper's baseline; GShard / Switch style).

Each expert gets a fixed buffer of `capacity` rows; assignments beyond it are dropped and add
nothing to the output. The experts then run as one batched matmul over [E, capacity, h].
"""
from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from ..router import count_assignments
from .base import TokenDispatcher, weighted_sum


def expert_capacity(num_tokens: int, top_k: int, num_experts: int, capacity_factor: float) -> int:
    """Rows per expert: ceil(capacity_factor * T * k / E)."""
    return max(1, math.ceil(capacity_factor * num_tokens * top_k / num_experts))


@dataclass
class CapacityState:
    slot: torch.Tensor  # [T*k]: buffer row of assignment (t, j); E*capacity when dropped
    weights: torch.Tensor  # [T, k]
    capacity: int


class CapacityDispatcher(TokenDispatcher):
    """dispatch returns x_perm as the [E, capacity, h] buffer (zero rows where unused) and the
    kept assignments per expert.

    drop_policy 'probs' keeps, per expert, the assignments with the highest router weights;
    'position' keeps the earliest tokens in token order.
    """

    def __init__(self, num_experts: int, capacity_factor: float, drop_policy: str = "probs"):
        if drop_policy not in ("probs", "position"):
            raise ValueError(f"token_drop_policy={drop_policy!r} is not supported; use 'probs' or 'position'.")
        self.num_experts = num_experts
        self.capacity_factor = capacity_factor
        self.drop_policy = drop_policy

    def dispatch(self, x, indices, weights):
        num_tokens, top_k = indices.shape
        E = self.num_experts
        capacity = expert_capacity(num_tokens, top_k, E, self.capacity_factor)
        device = indices.device
        flat = indices.reshape(-1)
        n = flat.numel()
        # priority order of the assignments; a stable sort by expert keeps it inside each expert
        if self.drop_policy == "probs":
            priority = torch.argsort(weights.detach().reshape(-1), descending=True, stable=True)
        else:
            priority = torch.arange(n, device=device)
        order = priority[torch.argsort(flat[priority], stable=True)]
        expert_sorted = flat[order]
        counts = count_assignments(indices, E)
        starts = torch.cumsum(counts, 0) - counts
        rank = torch.arange(n, device=device) - starts[expert_sorted]
        kept = rank < capacity
        trash = E * capacity  # dropped assignments point here, one row past the buffer
        slot_sorted = torch.where(kept, expert_sorted * capacity + rank, torch.full_like(rank, trash))
        slot = torch.empty_like(slot_sorted)
        slot[order] = slot_sorted
        # which token fills each buffer row; unused rows read an appended zero row (index T)
        row_token = torch.full((trash + 1,), num_tokens, dtype=torch.int64, device=device)
        row_token[slot_sorted] = order // top_k
        row_token[trash:].fill_(num_tokens)  # a fill kernel (an indexed scalar store copies from the host)
        x_ext = torch.cat([x, x.new_zeros(1, x.shape[1])])
        x_buf = x_ext.index_select(0, row_token[:trash]).view(E, capacity, x.shape[1])
        return x_buf, counts.clamp(max=capacity), CapacityState(slot, weights, capacity)

    def combine(self, y_perm, state: CapacityState):
        y_buf = y_perm.reshape(-1, y_perm.shape[-1])
        y_ext = torch.cat([y_buf, y_buf.new_zeros(1, y_buf.shape[1])])  # dropped -> zero row
        return weighted_sum(y_ext.index_select(0, state.slot), state.weights)
