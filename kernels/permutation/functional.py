"""Differentiable dMoE permutation on the fused kernels of ops.py.

  permute(x, pos, rows, expert_offsets, counts)            x [T, H] -> padded buffer [rows, H]
  unpermute(y_pad, pos, expert_offsets, counts, weights)   padded buffer -> y [T, H]
                                                           y[t] = sum_j weights[t, j] * y_pad[pos[t, j]]
      transient_input=True: y_pad will be overwritten before the backward; the rows the weights'
      gradient needs are copied out in the same pass

Each backward is the other kernel: permute's is a sum of the K copies' gradients; unpermute's
writes weights[t, j] * dy[t] to the copies' rows (padding rows zero, so the weight-gradient products
read zeros there) and, in the same pass, the router-weight gradient <dy[t], y_pad[pos[t, j]]>.
"""
from __future__ import annotations

from typing import Optional

import torch

from ..launch import bind_device
from . import ops as _ops


class _Permute(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, pos, rows, expert_offsets, counts, valid_rows):
        ctx.save_for_backward(pos, valid_rows)
        return _ops.expand(x, pos, rows, expert_offsets, counts, valid_rows=valid_rows)

    @staticmethod
    def backward(ctx, grad):
        pos, valid_rows = ctx.saved_tensors
        bind_device(grad)
        return _ops.reduce(grad, pos, valid_rows=valid_rows), None, None, None, None, None


class _Unpermute(torch.autograd.Function):
    @staticmethod
    def forward(ctx, y_pad, pos, weights, expert_offsets, counts, transient_input, valid_rows):
        weights_grad = weights is not None and ctx.needs_input_grad[2]
        kept = torch.empty_like(y_pad) if weights_grad and transient_input else None
        saved_rows = (kept if kept is not None else y_pad) if weights_grad else None
        ctx.save_for_backward(pos, weights, expert_offsets, counts, saved_rows, valid_rows)
        ctx.rows = y_pad.shape[0]
        return _ops.reduce(y_pad, pos, weights, copy=kept, valid_rows=valid_rows)

    @staticmethod
    def backward(ctx, grad):
        pos, weights, expert_offsets, counts, y_pad, valid_rows = ctx.saved_tensors
        bind_device(grad)
        d_weights = None
        if y_pad is not None:
            d_y_pad, dot = _ops.expand(grad, pos, ctx.rows, expert_offsets, counts, scale=weights, other=y_pad,
                                       valid_rows=valid_rows)
            d_weights = dot.to(weights.dtype)
        else:
            d_y_pad = _ops.expand(grad, pos, ctx.rows, expert_offsets, counts, scale=weights, valid_rows=valid_rows)
        return d_y_pad, None, d_weights, None, None, None, None


def permute(x: torch.Tensor, pos: torch.Tensor, rows: int, expert_offsets: torch.Tensor,
            counts: torch.Tensor, valid_rows: Optional[torch.Tensor] = None) -> torch.Tensor:
    """The expert-grouped, block-padded buffer [rows, H] of x [T, H] (see permute.expand).
    valid_rows (one-element integer tensor on the device): only x's rows before it move, either way;
    the gradient of the rows after it is undefined."""
    return _Permute.apply(x, pos, rows, expert_offsets, counts, valid_rows)


def unpermute(y_pad: torch.Tensor, pos: torch.Tensor, expert_offsets: torch.Tensor, counts: torch.Tensor,
              weights: Optional[torch.Tensor] = None, transient_input: bool = False,
              valid_rows: Optional[torch.Tensor] = None) -> torch.Tensor:
    """y [T, H] = sum over j of weights[t, j] * y_pad[pos[t, j]] (weights None: plain sum).
    transient_input: y_pad is overwritten before the backward (copied out in the same pass).
    valid_rows: only y's rows before it are written (the others undefined), and only their copies'
    gradients flow back."""
    return _Unpermute.apply(y_pad, pos, weights, expert_offsets, counts, transient_input, valid_rows)
