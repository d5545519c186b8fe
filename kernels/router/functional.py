"""Differentiable softmax top-k routing on the fused kernels of ops.py.

  fused_route(logits, top_k, renormalize=False, scale=1.0, valid=None)
      -> (indices [T, k] int64, weights [T, k], scores [T, E], colsum [E])

The same values as torch's softmax -> topk -> gather (-> renormalisation -> scale) with the
load-balancing loss's column sums of the probabilities over the valid tokens, in one forward
kernel and one reduction; the backward takes the gradients of weights, colsum and scores (any
may be absent) and returns d_logits in one launch. indices carry no gradient.

  balance_loss(colsum, counts, scale, record=None) -> loss (0-dim)
      scale * <counts, colsum>: the load-balancing loss from those column sums, one launch forward
      (which can also add to the metrics' running sums) and one backward.
"""
from __future__ import annotations

from typing import Optional

import torch

from ..launch import bind_device
from . import ops as _ops


class _FusedRoute(torch.autograd.Function):
    @staticmethod
    def forward(ctx, logits, top_k, renormalize, scale, valid):
        indices, weights, scores, colsum = _ops.route_forward(logits, top_k, renormalize, scale, valid)
        ctx.save_for_backward(scores, indices, valid)
        ctx.renormalize, ctx.scale = renormalize, scale
        ctx.mark_non_differentiable(indices)
        # an unused output's gradient stays None (not zeros): route_backward then skips its term
        ctx.set_materialize_grads(False)
        return indices, weights, scores, colsum

    @staticmethod
    def backward(ctx, d_indices, d_weights, d_scores, d_colsum):
        scores, indices, valid = ctx.saved_tensors
        if d_weights is None and d_scores is None and d_colsum is None:
            return None, None, None, None, None
        bind_device(scores)
        d_logits = _ops.route_backward(scores, indices, d_weights, d_colsum, d_scores,
                                       ctx.renormalize, ctx.scale, valid)
        return d_logits, None, None, None, None


def fused_route(logits: torch.Tensor, top_k: int, renormalize: bool = False, scale: float = 1.0,
                valid: Optional[torch.Tensor] = None):
    """(indices, weights, scores, colsum) of fp32 logits [T, E] (see ops.route_forward)."""
    return _FusedRoute.apply(logits, int(top_k), bool(renormalize), float(scale), valid)


class _BalanceLoss(torch.autograd.Function):
    @staticmethod
    def forward(ctx, colsum, counts, scale, record):
        ctx.save_for_backward(counts)
        ctx.scale = scale
        return _ops.balance_loss(colsum, counts, scale, record)

    @staticmethod
    def backward(ctx, d_loss):
        (counts,) = ctx.saved_tensors
        bind_device(counts)
        return _ops.balance_loss_backward(d_loss, counts, ctx.scale), None, None, None


def balance_loss(colsum: torch.Tensor, counts: torch.Tensor, scale: float, record=None) -> torch.Tensor:
    """scale * <counts, colsum>, differentiable in colsum (fused_route's fourth output), one launch
    each way; record: running sums updated by the forward (see ops.balance_loss)."""
    return _BalanceLoss.apply(colsum, counts, float(scale), record)
