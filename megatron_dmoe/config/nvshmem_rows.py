"""Which rows the NVSHMEM exchange (moe/exchange/nvshmem.py) can move: a rule that the exchange and
the configuration check (config/section_checks/training.py) share.

torch's NVSHMEM all-to-all kernel (allToAllV, behind `torch.ops.symm_mem.all_to_all_vdev`) divides
each peer's bytes evenly between the thread blocks it gives that peer, and stops on a device
assertion where they do not divide. Its grid is the send tensor's size in 64 KiB pieces, rounded up
to the group size, at most 64 blocks within a host and 16 across hosts. Left to the size it takes
odd block counts, for which most row counts do not divide; so the exchange's send buffers hold at
least GRID_FIXING_BYTES, which fixes the grid at its largest, and a row's bytes must then be a
multiple of the blocks per peer of both largest grids.
"""
from __future__ import annotations

import math
from typing import Optional

GRID_FIXING_BYTES = 64 * 64 * 1024  # 64 pieces of 64 KiB: the largest grid, within a host or across
LARGEST_GRIDS = (64, 16)  # torch's most blocks within one host, and across hosts


def row_multiple(ranks: int) -> int:
    """The bytes a row must be a multiple of, in an expert-parallel group of `ranks`."""
    return math.lcm(*(max(grid // ranks, 1) for grid in LARGEST_GRIDS))


def row_bytes_problem(row_bytes: int, ranks: int) -> Optional[str]:
    """None when the NVSHMEM exchange can move rows of `row_bytes` in a group of `ranks`, else why
    not (one line, with what to do)."""
    multiple = row_multiple(ranks)
    if row_bytes % multiple == 0:
        return None
    return (f"the NVSHMEM exchange (torch's all_to_all_vdev) needs rows of a multiple of {multiple} bytes in an "
            f"expert-parallel group of {ranks}, but a row of hidden states is {row_bytes} bytes (hidden size x "
            f"element size); use moe.ep_exchange: symmetric (GPUs of one host) or nccl")


def send_rows(rows: int, row_bytes: int) -> int:
    """Rows of a send buffer that holds `rows` and at least GRID_FIXING_BYTES."""
    return max(rows, -(-GRID_FIXING_BYTES // row_bytes))
