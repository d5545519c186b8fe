"""Row buffers of the expert-parallel exchanges (symmetric.py, nvshmem.py): how large they grow.

Buffers are allocated collectively (symmetric memory), so every rank of the group must agree on
their size; they hold a bound that any routing fits, and grow only when a rank passes more tokens
than any did before.
"""
from __future__ import annotations

from typing import Optional

import torch
import torch.distributed as dist

ROW_ALIGN = 256


def grown_capacity(capacity: int, rows: int, kind: str, group, device: torch.device) -> Optional[int]:
    """None when a buffer of `capacity` rows holds `rows`, else the capacity to grow it to: the
    largest any rank of `group` asks for, aligned. Collective whenever it grows (every rank passes
    the same token count, so all grow in the same call). Never while a CUDA graph is captured."""
    if capacity >= rows:
        return None
    if torch.cuda.is_current_stream_capturing():
        raise RuntimeError(
            f"the expert-parallel exchange needs a larger {kind} buffer ({rows} rows) while a CUDA graph is "
            "captured; run the same token count eagerly once before capturing"
        )
    needed = torch.tensor([rows], dtype=torch.int64, device=device)
    dist.all_reduce(needed, op=dist.ReduceOp.MAX, group=group)
    return -(-int(needed.item()) // ROW_ALIGN) * ROW_ALIGN

