"""Pure-torch versions of the library's ops, written plainly: the tests' ground truth, on any device.

Block-sparse products (products/): dense masked matmuls. They materialise the dense [rows x cols]
matrix, so they suit tests and small problems, not training at scale. They read ``nnz`` on the
device (no host copy) and compute in the inputs' dtype, or in float64 when given float64 tensors.

Permutation (permutation/ops.py): padded_positions, expand, reduce. They loop on the host where that
is clearest (positions) and zero the whole output buffer. Sums run in the inputs' dtype, or float64
when given float64.

Loss (loss/): cross_entropy, in fp32 or wider.
"""
from __future__ import annotations

from typing import Optional

import torch

from .products.topology import Topology


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


# permutation

def padded_positions(indices: torch.Tensor, num_experts: int, block_size: int) -> torch.Tensor:
    """int64 [T, K]: row of copy (t, j) in the padded buffer, by walking experts and tokens in order."""
    T, K = indices.shape
    flat = indices.reshape(-1).tolist()
    pos = [0] * len(flat)
    row = 0
    for e in range(num_experts):
        for i, expert in enumerate(flat):  # copies in token order, then slot order
            if expert == e:
                pos[i] = row
                row += 1
        row = -(-row // block_size) * block_size  # the next group starts at a block boundary
    return torch.tensor(pos, dtype=torch.int64).view(T, K).to(indices.device)


def expand(src: torch.Tensor, pos: torch.Tensor, rows: int, scale: Optional[torch.Tensor] = None,
           other: Optional[torch.Tensor] = None):
    """out[pos[t, j]] = scale[t, j] * src[t], every other row zero; with other, also the dot products."""
    T, K = pos.shape
    out = torch.zeros(rows, src.shape[1], dtype=src.dtype, device=src.device)
    for t in range(T):
        for j in range(K):
            s = 1.0 if scale is None else scale[t, j].to(src.dtype)
            out[pos[t, j]] = s * src[t]
    if other is None:
        return out
    dot = torch.stack([torch.stack([src[t] @ other[pos[t, j]] for j in range(K)]) for t in range(T)]) \
        if T * K else torch.zeros(T, K, dtype=src.dtype, device=src.device)
    return out, dot


def reduce(src: torch.Tensor, pos: torch.Tensor, scale: Optional[torch.Tensor] = None) -> torch.Tensor:
    """dst[t] = sum_j scale[t, j] * src[pos[t, j]]."""
    rows = src[pos.long()]  # [T, K, H]
    if scale is not None:
        rows = rows * scale.to(src.dtype)[..., None]
    return rows.sum(1)


# loss

def cross_entropy(logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    """Per-token loss of logits [*, V] against labels [*] (loss.functional.fused_cross_entropy), in
    fp32 or wider."""
    vocab = logits.shape[-1]
    wide = logits if logits.dtype == torch.float64 else logits.float()
    loss = torch.nn.functional.cross_entropy(wide.reshape(-1, vocab), labels.reshape(-1).long(), reduction="none")
    return loss.view(labels.shape)
