"""Row buffers of the expert-parallel exchanges (symmetric.py, nvshmem.py): whether every rank
could make them, and how large they grow.

Buffers are allocated collectively (symmetric memory), so every rank of the group must agree on
whether the exchange exists and on their size; they hold a bound that any routing fits, and grow
only when a rank passes more tokens than any did before.
"""
from __future__ import annotations

from typing import Callable, Optional, Tuple, TypeVar

import torch
import torch.distributed as dist

ROW_ALIGN = 256

T = TypeVar("T")


def built_on_every_rank(build: Callable[[], T], what: str, group, device: torch.device,
                        unavailable: Optional[str] = None) -> Tuple[Optional[T], str]:
    """(build(), "") where it succeeded on every rank of `group`, else (None, why not): collective,
    and every rank reaches the same answer. unavailable: why this rank cannot even try (no build)."""
    made, reason = None, unavailable
    if reason is None:
        try:
            made = build()
        except Exception as exc:  # the driver, peer mappings, NVSHMEM's heap or transports
            reason = f"{what} failed on rank {dist.get_rank()}: {exc}"
    ok = torch.tensor([0 if made is None else 1], device=device)
    dist.all_reduce(ok, op=dist.ReduceOp.MIN, group=group)
    if not ok.item():
        return None, reason or f"{what} failed on another rank of the group"
    return made, ""


def grown_capacity(capacity: int, rows: int, kind: str, group, device: torch.device) -> Optional[int]:
    """None when a buffer of `capacity` rows holds `rows`, else the capacity to grow it to: the
    largest any rank of `group` asks for, aligned. Collective whenever it grows (every rank passes
    the same token count, so all grow in the same call). Never while a CUDA graph is captured."""
    if capacity >= rows:
        return None
    if device.type == "cuda" and torch.cuda.is_current_stream_capturing():
        raise RuntimeError(
            f"the expert-parallel exchange needs a larger {kind} buffer ({rows} rows) while a CUDA graph is "
            "captured; run the same token count eagerly once before capturing"
        )
    needed = torch.tensor([rows], dtype=torch.int64, device=device)
    dist.all_reduce(needed, op=dist.ReduceOp.MAX, group=group)
    return -(-int(needed.item()) // ROW_ALIGN) * ROW_ALIGN

