"""Pure-torch versions of the permutation ops (permute_ops.py), written plainly: the tests' ground truth.

They loop on the host where that is clearest (positions) and zero the whole output buffer, so they
suit tests and small problems. Sums run in the inputs' dtype, or float64 when given float64.
"""
from __future__ import annotations

from typing import Optional

import torch


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
