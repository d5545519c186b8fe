"""Grouped matrix products, the one primitive the gemm-based expert backends differ in.

Rows of the left operand come grouped by expert (group e = the rows of expert e, in expert
order); every weight is stored [E, M, K] (w1, v1, w2 are all [E, ffn, hidden]).
"""
from __future__ import annotations

import abc

import torch


class GroupedGemm(abc.ABC):
    @abc.abstractmethod
    def nt(self, x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
        """x [N, K], w [E, M, K] -> [N, M]: x_e @ w[e]^T per group."""

    @abc.abstractmethod
    def nn(self, x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
        """x [N, M], w [E, M, K] -> [N, K]: x_e @ w[e] per group."""

    @abc.abstractmethod
    def tn(self, a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
        """a [N, M], b [N, K] -> [E, M, K]: a_e^T @ b_e per group (weight gradients); 0 for empty groups."""


class BatchedGemm(GroupedGemm):
    """Groups of equal size (the capacity buffer [E, capacity, h] flattened): plain torch.bmm."""

    def __init__(self, num_experts: int, rows_per_expert: int):
        self.E, self.C = num_experts, rows_per_expert

    def nt(self, x, w):
        return torch.bmm(x.view(self.E, self.C, -1), w.transpose(1, 2)).reshape(self.E * self.C, -1)

    def nn(self, x, w):
        return torch.bmm(x.view(self.E, self.C, -1), w).reshape(self.E * self.C, -1)

    def tn(self, a, b):
        return torch.bmm(a.view(self.E, self.C, -1).transpose(1, 2), b.view(self.E, self.C, -1))
