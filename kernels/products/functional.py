"""Differentiable block-sparse products: each backward is made of the other products.

  sdd(a, b, topology)                    -> data      sparse a @ b
  dsd(data, topology, b, transpose)      -> dense     S @ b   or S^T @ b
  dds(a, data, topology, transpose)      -> dense     a @ S   or a @ S^T

The gradient of sparse data is sparse data at the same topology (blocks past nnz are undefined and
never read). With expert weights w1, w2 [E*f, d] the expert MLP is
  h = sdd(x, w1.t()),  y = dsd(a, w2)
and its backward runs sdd(dy, w2.t()) for da, dsd(a, dy, transpose=True) for dw2,
dsd(dh, w1) for dx and dsd(dh, x, transpose=True) for dw1.
"""
from __future__ import annotations

import torch

from ..launch import bind_device
from . import ops
from .topology import Topology


class _SDD(torch.autograd.Function):
    @staticmethod
    def forward(ctx, a, b, topology):
        ctx.topology = topology
        ctx.save_for_backward(a, b)
        return ops.sdd(a, b, topology)

    @staticmethod
    def backward(ctx, grad):
        a, b = ctx.saved_tensors
        topo = ctx.topology
        bind_device(grad)
        grad = grad.contiguous()
        da = db = None
        if ctx.needs_input_grad[0]:
            da = ops.dsd(grad, topo, b.t())  # dC @ b^T
        if ctx.needs_input_grad[1]:
            db = ops.dsd(grad, topo, a, transpose=True).t()  # (dC^T @ a)^T = a^T @ dC
        return da, db, None


class _DSD(torch.autograd.Function):
    @staticmethod
    def forward(ctx, data, topology, b, transpose):
        ctx.topology = topology
        ctx.transpose = transpose
        ctx.save_for_backward(data, b)
        return ops.dsd(data, topology, b, transpose=transpose)

    @staticmethod
    def backward(ctx, grad):
        data, b = ctx.saved_tensors
        topo = ctx.topology
        bind_device(grad)
        ddata = db = None
        if ctx.needs_input_grad[0]:
            # C = S @ b: dS = mask(dC @ b^T).  C = S^T @ b: dS = mask(b @ dC^T).
            ddata = ops.sdd(b, grad.t(), topo) if ctx.transpose else ops.sdd(grad, b.t(), topo)
        if ctx.needs_input_grad[2]:
            # C = S @ b: db = S^T @ dC.  C = S^T @ b: db = S @ dC.
            db = ops.dsd(data, topo, grad, transpose=not ctx.transpose)
        return ddata, None, db, None


class _DDS(torch.autograd.Function):
    @staticmethod
    def forward(ctx, a, data, topology, transpose):
        ctx.topology = topology
        ctx.transpose = transpose
        ctx.save_for_backward(a, data)
        return ops.dds(a, data, topology, transpose=transpose)

    @staticmethod
    def backward(ctx, grad):
        a, data = ctx.saved_tensors
        topo = ctx.topology
        bind_device(grad)
        da = ddata = None
        if ctx.needs_input_grad[0]:
            # C = a @ S: da = dC @ S^T.  C = a @ S^T: da = dC @ S.
            da = ops.dds(grad, data, topo, transpose=not ctx.transpose)
        if ctx.needs_input_grad[1]:
            # C = a @ S: dS = mask(a^T @ dC).  C = a @ S^T: dS = mask(dC^T @ a).
            ddata = ops.sdd(grad.t(), a, topo) if ctx.transpose else ops.sdd(a.t(), grad, topo)
        return da, ddata, None, None


def sdd(a: torch.Tensor, b: torch.Tensor, topology: Topology) -> torch.Tensor:
    """Sparse data [max_blocks, bs, bs] of a @ b at the topology's blocks; a [rows, K], b [K, cols]."""
    return _SDD.apply(a, b, topology)


def dsd(data: torch.Tensor, topology: Topology, b: torch.Tensor, transpose: bool = False) -> torch.Tensor:
    """Dense S @ b, or S^T @ b when transpose; S = (data, topology)."""
    return _DSD.apply(data, topology, b, transpose)


def dds(a: torch.Tensor, data: torch.Tensor, topology: Topology, transpose: bool = False) -> torch.Tensor:
    """Dense a @ S, or a @ S^T when transpose; S = (data, topology)."""
    return _DDS.apply(a, data, topology, transpose)
