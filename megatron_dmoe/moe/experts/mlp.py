"""The expert MLP over expert-grouped rows, written once for every gemm-based backend.

y = act(x w1^T [, x v1^T]) w2 per expert. For backward it keeps the input, the pre-activation(s)
and the activation; memory-optimised mode drops the activation and recomputes it in backward.
"""
from __future__ import annotations

import abc
from typing import Optional

import torch

from .activations import activate, activate_backward
from .arrival import arrival_positions, compact_offsets, group_rows, ungroup_rows
from .gemm import GroupedGemm


class ExpertBackend(abc.ABC):
    """How the expert MLP runs on rows grouped by expert. A backend that is not gemm-based (block-
    sparse kernels, say) implements `mlp` directly; `backends.py` lists them all by name."""

    name: str

    @abc.abstractmethod
    def unsupported_reason(self, device, dtype, hidden_size: int, ffn_hidden_size: int) -> Optional[str]:
        """None when the backend runs these shapes on this device and dtype, else why not."""

    @abc.abstractmethod
    def mlp(self, x, tokens_per_expert, w1, v1, w2, activation: str, memory_optimized: bool,
            wgrad_stash=None, fp8=None) -> torch.Tensor:
        """x [N, h] grouped by expert, tokens_per_expert [E] -> [N, h]. wgrad_stash: the run's
        WgradStash, for a backend that can defer weight gradients to the step's end (else unused).
        fp8: None, or "blockwise" where the backend has block-scaled fp8 products (else refused)."""

    def mlp_in_arrival_order(self, x, counts_by_source, w1, v1, w2, activation: str, memory_optimized: bool,
                             wgrad_stash=None, fp8=None):
        """x [N, h] as runs of expert groups, one run per source (counts_by_source [R, E], see
        arrival.py) -> [N, h] in the same order. Regrouped by expert around `mlp`, unless the rows
        are grouped already (one source or one expert)."""
        tokens_per_expert = counts_by_source.sum(0)
        if 1 in counts_by_source.shape:
            return self.mlp(x, tokens_per_expert, w1, v1, w2, activation, memory_optimized, wgrad_stash, fp8)
        positions = arrival_positions(counts_by_source, compact_offsets(tokens_per_expert), x.shape[0])
        y = self.mlp(group_rows(x, positions), tokens_per_expert, w1, v1, w2, activation, memory_optimized,
                     wgrad_stash, fp8)
        return ungroup_rows(y, positions)


class GemmBackend(ExpertBackend):
    @abc.abstractmethod
    def make_gemm(self, tokens_per_expert: torch.Tensor) -> GroupedGemm:
        ...

    def mlp(self, x, tokens_per_expert, w1, v1, w2, activation, memory_optimized, wgrad_stash=None, fp8=None):
        if fp8 is not None:
            raise ValueError(f"the {self.name!r} expert backend has no fp8 products; fp8={fp8!r} needs "
                             "backend='sparse' (or 'auto' on a GPU)")
        return expert_mlp(x, w1, v1, w2, self.make_gemm(tokens_per_expert), activation, memory_optimized)


def expert_mlp(
    x: torch.Tensor,
    w1: torch.Tensor,
    v1: Optional[torch.Tensor],
    w2: torch.Tensor,
    gemm: GroupedGemm,
    activation: str,
    memory_optimized: bool = False,
) -> torch.Tensor:
    """x [N, h] grouped by expert; w1, v1 (SwiGLU only), w2 [E, f, h] -> [N, h]."""
    return _ExpertMLPFunction.apply(x, w1, v1, w2, gemm, activation, memory_optimized)


class _ExpertMLPFunction(torch.autograd.Function):
    """Forward and backward by hand, so every backend saves exactly x, the pre-activation(s) and,
    unless memory_optimized, the activation; and so each gemm sees contiguous operands (grouped_mm
    rejects the zero-stride gradients autograd can hand over)."""

    @staticmethod
    def forward(ctx, x, w1, v1, w2, gemm, activation, memory_optimized):
        h1 = gemm.nt(x, w1)
        h2 = gemm.nt(x, v1) if v1 is not None else None
        act = activate(activation, h1, h2)
        y = gemm.nn(act, w2)
        ctx.save_for_backward(x, w1, v1, w2, h1, h2, None if memory_optimized else act)
        ctx.gemm, ctx.activation = gemm, activation
        return y

    @staticmethod
    def backward(ctx, dy):
        x, w1, v1, w2, h1, h2, act = ctx.saved_tensors
        gemm, activation = ctx.gemm, ctx.activation
        need_x, need_w1, need_v1, need_w2 = ctx.needs_input_grad[:4]
        dy = dy.contiguous()
        if need_w2:
            if act is None:  # memory-optimised: recompute the activation instead of having kept it
                act = activate(activation, h1, h2)
            dw2 = gemm.tn(act, dy)
        else:
            dw2 = None
        del act
        d_h1, d_h2 = activate_backward(activation, gemm.nt(dy, w2), h1, h2)
        dx = None
        if need_x:
            dx = gemm.nn(d_h1, w1)
            if v1 is not None:
                dx = dx + gemm.nn(d_h2, v1)
        dw1 = gemm.tn(d_h1, x) if need_w1 else None
        dv1 = gemm.tn(d_h2, x) if v1 is not None and need_v1 else None
        return dx, dw1, dv1, dw2, None, None, None
