"""Expert activations on block-sparse data, in one pass and over the existing blocks only.

Sparse data is [max_blocks, bs, bs] sized by an upper bound; only the first ``nnz`` blocks (a device
tensor) exist. These kernels read nnz and skip the rest, where an element-wise torch op would
process the whole bound; SwiGLU's forward and backward are one pass each instead of several ops.

  activation_forward(name, h1, h2, nnz)          gelu(h1)  |  silu(h1) * h2
  activation_backward(name, grad, h1, h2, nnz)   (d_h1, d_h2); d_h1 overwrites grad in place
  activation_backward_weighted(name, grad, h1, h2, row_weights, topology)
      the same for rows that a router weight multiplies later, plus per-row <grad, act> partial
      sums (the router weights' gradient) in the same pass, act recomputed from h in registers

Both backwards take `slots`: the weight-gradient windows (products/window.py) of the down-projection
(act is its gradient's left operand) and of the up-projection(s) (d_h1, d_h2 are theirs), as
(stacked slot buffer, device counter) pairs. The pass then also stores act, d_h1 (and d_h2) into
slot `counter` of each, so that no copy reads them back for the window. With keep=False the
gradients go to the slots only (the up-projection's input gradient then reads them there:
products.ops.dsd's `slot`), and the backward returns None for them.

GELU is the exact erf form (torch's default). Math runs in fp32; results take the input dtype.
Elements of blocks past nnz are left undefined, like the products' outputs.
"""
from __future__ import annotations

from typing import Optional, Tuple

import torch

from ..launch import cdiv, check_launchable, direct
from . import kernels as _kernels

ACTIVATIONS = ("gelu", "swiglu")
_BLOCK = 1024


def _check(name: str, nnz: torch.Tensor, *tensors: Optional[torch.Tensor]) -> None:
    if name not in ACTIVATIONS:
        raise ValueError(f"activation={name!r} is not supported; use one of {ACTIVATIONS}")
    first = tensors[0]
    if first.dim() != 3 or first.shape[1] != first.shape[2]:
        raise ValueError(f"sparse data must be [max_blocks, bs, bs], got shape {tuple(first.shape)}")
    for t in tensors:
        if t is None:
            continue
        if t.shape != first.shape or t.dtype != first.dtype or not t.is_contiguous():
            raise ValueError("activation operands must be contiguous sparse data of one shape and dtype")
    if (name == "swiglu") != (len(tensors) > 1 and tensors[-1] is not None):
        raise ValueError("swiglu needs both pre-activations (h1, h2); gelu takes h1 alone")
    if nnz.numel() != 1 or nnz.device != first.device:
        raise ValueError("nnz must be the topology's one-element device tensor")


Slot = Tuple[torch.Tensor, torch.Tensor]  # (stacked slots [W, *data shape], int32 [1] counter)


def _slot_args(grad: torch.Tensor, slots: Optional[Tuple[Slot, Slot, Optional[Slot]]], swiglu: bool) -> tuple:
    """Kernel arguments of the window slots (act's, d_h1's, d_h2's): pointers, counters and one
    slot's elements; placeholders when there are none."""
    if slots is None:
        return (grad, grad, grad, grad, grad, grad, 0)
    act_slot, d1_slot, d2_slot = slots
    if (d2_slot is not None) != swiglu:
        raise ValueError("slots: swiglu stores d_h2 into a third slot, gelu has none")
    args = []
    for stacked, counter in (act_slot, d1_slot, d2_slot if swiglu else d1_slot):
        if (stacked.shape[1:] != grad.shape or stacked.dtype != grad.dtype or not stacked.is_contiguous()
                or stacked.device != grad.device or counter.numel() != 1 or counter.dtype != torch.int32):
            raise ValueError(f"slots must be contiguous [W, {', '.join(map(str, grad.shape))}] {grad.dtype} "
                             f"buffers with an int32 counter, got {tuple(stacked.shape)} {stacked.dtype}")
        args += [stacked, counter]
    return (*args, grad.numel())


def _check_keep(slots, keep: bool) -> None:
    if not keep and slots is None:
        raise ValueError("keep=False stores the gradients into the slots only; pass slots")


def _launch(kernel, data: torch.Tensor, *args, **constexprs) -> None:
    if data.numel() == 0:
        return
    check_launchable(kernel, data.device)
    block_elements = data.shape[1] * data.shape[2]
    direct(kernel)[(cdiv(data.numel(), _BLOCK),)](*args, block_elements, **constexprs, BLOCK=_BLOCK, num_warps=4)


def activation_forward(name: str, h1: torch.Tensor, h2: Optional[torch.Tensor], nnz: torch.Tensor) -> torch.Tensor:
    """gelu(h1) or silu(h1) * h2 on the first nnz blocks, as new sparse data."""
    _check(name, nnz, h1, h2)
    out = torch.empty_like(h1)
    swiglu = name == "swiglu"
    _launch(_kernels.activation_forward_kernel, h1, h1, h2 if swiglu else h1, out, nnz, SWIGLU=swiglu)
    return out


def activation_backward(
    name: str, grad: torch.Tensor, h1: torch.Tensor, h2: Optional[torch.Tensor], nnz: torch.Tensor,
    slots: Optional[Tuple[Slot, Slot, Optional[Slot]]] = None,
    keep: bool = True,
) -> Tuple[Optional[torch.Tensor], Optional[torch.Tensor]]:
    """(d_h1, d_h2) of activation_forward; d_h1 is written into grad (returned), d_h2 is new (swiglu).
    slots: also store act, d_h1 (, d_h2) into these windows' slots; keep=False: the gradients go
    there only, (None, None) returned (see the module's note)."""
    _check(name, nnz, grad, h1, h2)
    _check_keep(slots, keep)
    swiglu = name == "swiglu"
    d2 = torch.empty_like(grad) if swiglu and keep else None
    _launch(_kernels.activation_backward_kernel, grad, grad, h1, h2 if swiglu else h1, grad if d2 is None else d2,
            nnz, *_slot_args(grad, slots, swiglu), SWIGLU=swiglu, SLOTS=slots is not None, KEEP=keep)
    return (grad, d2) if keep else (None, None)


def activation_backward_weighted(
    name: str,
    grad: torch.Tensor,
    h1: torch.Tensor,
    h2: Optional[torch.Tensor],
    row_weights: torch.Tensor,
    topology,
    slots: Optional[Tuple[Slot, Slot, Optional[Slot]]] = None,
    keep: bool = True,
) -> Tuple[Optional[torch.Tensor], Optional[torch.Tensor], torch.Tensor]:
    """Backward of row_weights[row] * act(h) for an output whose rows are later weighted.

    grad is the gradient of the UNWEIGHTED activation (dy @ w2^T with unit router weights).
    Returns (d_h1, d_h2, row_dot): d_h = act'(h) * row_weights[row] * grad (d_h1 written into
    grad), and row_dot [rows, F] fp32 = per row and block column, the sum of
    grad * act(h), whose sum over F is the gradient of that row's router weight (act(h) recomputed
    and rounded to h's dtype, as activation_forward gives it).
    Needs the dMoE topology's regular layout (``topology.blocks_per_row``). slots: as for
    activation_backward (act is the recomputed, rounded one), and keep.
    """
    _check(name, topology.nnz, grad, h1, h2)
    _check_keep(slots, keep)
    F = topology.blocks_per_row
    if not F:
        raise ValueError("activation_backward_weighted needs a dMoE topology (blocks_per_row set)")
    rows = topology.shape[0]
    if row_weights.shape != (rows,) or row_weights.device != grad.device:
        raise ValueError(f"row_weights must be [{rows}] on {grad.device}, got {tuple(row_weights.shape)}")
    swiglu = name == "swiglu"
    d2 = torch.empty_like(grad) if swiglu and keep else None
    row_dot = torch.empty(rows, F, dtype=torch.float32, device=grad.device)
    bs = topology.block_size
    if topology.max_blocks:
        check_launchable(_kernels.weighted_backward_kernel, grad.device)
        rows_per_program = max(1, min(bs, 2048 // bs))
        direct(_kernels.weighted_backward_kernel)[(topology.max_blocks * (bs // rows_per_program),)](
            grad, h1, h2 if swiglu else h1, grad if d2 is None else d2, row_weights.contiguous(), row_dot,
            topology.nnz, *_slot_args(grad, slots, swiglu), F, SWIGLU=swiglu, SLOTS=slots is not None, KEEP=keep,
            BS=bs, ROWS=rows_per_program, num_warps=4,
        )
    return (grad, d2, row_dot) if keep else (None, None, row_dot)
