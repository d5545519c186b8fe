"""Pure-torch versions of every block-sparse op: dense masked matmuls, on any device.

They materialise the dense [rows x cols] matrix, so they suit tests and small problems, not training
at scale. They read ``nnz`` on the device (no host copy) and compute in the inputs' dtype, or in
float64 when given float64 tensors, which makes them the ground truth of the tests.
"""
from __future__ import annotations

import torch

from .topology import Topology


def _valid_blocks(topology: Topology) -> torch.Tensor:
    ids = torch.arange(topology.max_blocks, device=topology.device)
    return ids < topology.nnz.to(torch.int64)


def to_dense(data: torch.Tensor, topology: Topology) -> torch.Tensor:
    """The dense [rows, cols] matrix of the sparse (data, topology); zeros outside the blocks."""
    topology.check_data(data)
    bs = topology.block_size
    valid = _valid_blocks(topology)
    blocks = torch.where(valid[:, None, None], data, torch.zeros((), dtype=data.dtype, device=data.device))
    grid = torch.zeros(
        topology.block_rows, topology.block_cols, bs, bs, dtype=data.dtype, device=data.device
    )
    # Blocks past nnz carry index (0, 0) and zero values: adding them changes nothing.
    grid.index_put_(
        (topology.row_indices.long(), topology.column_indices.long()), blocks, accumulate=True
    )
    return grid.permute(0, 2, 1, 3).reshape(topology.shape)


def from_dense(dense: torch.Tensor, topology: Topology) -> torch.Tensor:
    """The topology's blocks of a dense [rows, cols] matrix, as data [max_blocks, bs, bs].

    Blocks past nnz are zero here (the kernels leave them undefined).
    """
    if tuple(dense.shape) != tuple(topology.shape):
        raise ValueError(f"dense has shape {tuple(dense.shape)}, the topology {tuple(topology.shape)}")
    bs = topology.block_size
    grid = dense.reshape(topology.block_rows, bs, topology.block_cols, bs).permute(0, 2, 1, 3)
    blocks = grid[topology.row_indices.long(), topology.column_indices.long()]
    valid = _valid_blocks(topology)
    return torch.where(valid[:, None, None], blocks, torch.zeros((), dtype=dense.dtype, device=dense.device))


def block_mask_dense(topology: Topology, dtype=torch.bool) -> torch.Tensor:
    """Element mask [rows, cols]: one inside the topology's blocks."""
    ones = torch.ones(topology.data_shape(), dtype=torch.float32, device=topology.device)
    return to_dense(ones, topology).to(dtype)


def sdd(a: torch.Tensor, b: torch.Tensor, topology: Topology) -> torch.Tensor:
    """Blocks of a @ b at the topology's blocks."""
    return from_dense(a @ b, topology)


def dsd(data: torch.Tensor, topology: Topology, b: torch.Tensor, transpose: bool = False) -> torch.Tensor:
    """S @ b, or S^T @ b when transpose."""
    s = to_dense(data, topology)
    return (s.t() if transpose else s) @ b


def dds(a: torch.Tensor, data: torch.Tensor, topology: Topology, transpose: bool = False) -> torch.Tensor:
    """a @ S, or a @ S^T when transpose."""
    s = to_dense(data, topology)
    return a @ (s.t() if transpose else s)
