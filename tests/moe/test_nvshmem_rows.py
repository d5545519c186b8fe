"""The rows the NVSHMEM exchange can move (config/nvshmem_rows.py): the bytes that torch's
all-to-all kernel divides each peer's share by, at the grid the exchange's send buffers fix."""
import math

import pytest

from megatron_dmoe.config.nvshmem_rows import (
    GRID_FIXING_BYTES,
    LARGEST_GRIDS,
    row_bytes_problem,
    row_multiple,
    send_rows,
)


def _grid(send_bytes, ranks, max_blocks):
    """torch's grid for a send tensor of send_bytes (64 KiB pieces, rounded up to the group, capped)."""
    pieces = -(-send_bytes // (64 * 1024))
    return min(-(-pieces // ranks) * ranks, max_blocks)


@pytest.mark.parametrize("ranks", [2, 3, 4, 6, 8, 16, 32, 64])
@pytest.mark.parametrize("row_bytes", [2, 6, 80, 144, 160, 256, 1000, 1024, 4096, 5120])
def test_accepted_rows_divide_at_every_row_count_and_grid_the_buffers_allow(ranks, row_bytes):
    ok = row_bytes_problem(row_bytes, ranks) is None
    for max_blocks in LARGEST_GRIDS:
        for rows in (1, 7, 13, 3000):
            grid = _grid(send_rows(rows, row_bytes) * row_bytes, ranks, max_blocks)
            assert grid == max_blocks or grid == -(-max_blocks // ranks) * ranks  # the cap, or the group's multiple
            per_peer = max(grid // ranks, 1)
            if ok:
                for peer_rows in (0, 1, 5, 13, 999):
                    assert (peer_rows * row_bytes) % per_peer == 0, (rows, per_peer)
    # refused exactly where some row count would not divide at one of the largest grids
    would_fail = any(row_bytes % max(g // ranks, 1) for g in LARGEST_GRIDS)
    assert ok == (not would_fail)


def test_send_buffers_fix_the_grid_at_its_largest():
    for row_bytes in (2, 160, 4096):
        assert send_rows(1, row_bytes) * row_bytes >= GRID_FIXING_BYTES
        assert send_rows(10**7, row_bytes) == 10**7
    assert _grid(GRID_FIXING_BYTES, 2, 64) == 64 and _grid(GRID_FIXING_BYTES, 2, 16) == 16


def test_the_refusal_names_the_multiple_and_the_other_exchanges():
    problem = row_bytes_problem(144, 2)
    assert "multiple of 32 bytes" in problem and "144 bytes" in problem and "symmetric" in problem
    assert row_multiple(3) == math.lcm(21, 5)
    assert row_bytes_problem(256 * 2, 2) is None  # hidden 256 in bf16
