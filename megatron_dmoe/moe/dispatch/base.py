"""What every token dispatcher is: dispatch (permute tokens into expert-grouped rows) and combine
(un-permute and weight), plus the helpers they share.

An MoE path (moe/paths/) talks to a `TokenDispatcher` only, so an expert-parallel dispatcher
(all-to-all between the permutation and the experts) can replace the local one without touching it.
"""
from __future__ import annotations

import abc
from typing import Any, Optional, Tuple

import torch


class TokenDispatcher(abc.ABC):
    @abc.abstractmethod
    def dispatch(
        self, x: torch.Tensor, indices: torch.Tensor, weights: torch.Tensor
    ) -> Tuple[torch.Tensor, torch.Tensor, Any]:
        """x [T, h], indices/weights [T, k] -> (x_perm, tokens_per_expert, state).

        x_perm holds the rows the experts compute on; tokens_per_expert [E] (int64, on device)
        how many of them each expert owns; state whatever `combine` needs.
        """

    @abc.abstractmethod
    def combine(self, y_perm: torch.Tensor, state: Any) -> torch.Tensor:
        """Expert outputs in x_perm's layout -> y [T, h] = sum_j weights[t, j] * expert output."""

    def counts_by_source(self, state: Any) -> Optional[torch.Tensor]:
        """[sources, experts] when x_perm holds one run of expert groups per source rank instead of
        rows grouped by expert (see moe/experts/arrival.py); None when grouped by expert."""
        return None


def weighted_sum(y_assign: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
    """y_assign [T*k, h] in (token, slot) order, weights [T, k] -> [T, h].

    A batched matmul: deterministic (no atomics) and its backward yields the weights' gradient.
    """
    num_tokens, top_k = weights.shape
    y = torch.bmm(weights.to(y_assign.dtype).unsqueeze(1), y_assign.view(num_tokens, top_k, -1))
    return y.squeeze(1)


def sort_by_expert(indices: torch.Tensor):
    """Routed copies [T, k] sorted by expert, token order kept within an expert: (order [T*k], the
    copy at each sorted row; positions [T, k], the sorted row of each copy)."""
    # int32 keys: half the radix-sort passes of int64 (expert ids are small)
    order = torch.sort(indices.reshape(-1).to(torch.int32), stable=True).indices
    positions = torch.empty_like(order)
    positions[order] = torch.arange(order.numel(), device=order.device)
    return order, positions.view(indices.shape)
