"""Rows that arrive as runs of expert groups (one run per sending rank, as the expert-parallel
all-to-all delivers them) and where each row belongs in an expert-grouped buffer.

Received rows are ordered [source rank][local expert]; the experts want them grouped by expert.
`arrival_positions` maps every received row to its row in a buffer grouped by expert, with each
expert's group starting at any offsets (compact, or padded to whole blocks for the block-sparse
backend), so one gather or scatter pass regroups them: no sort, nothing read back to the host.
"""
from __future__ import annotations

import torch


def arrival_positions(counts_by_source: torch.Tensor, group_offsets: torch.Tensor, num_rows: int) -> torch.Tensor:
    """int32 [num_rows, 1]: row of each received row in the expert-grouped buffer.

    counts_by_source [R, E]: rows source r sent for expert e, in arrival order (r major).
    group_offsets [E + 1]: first row of expert e's group; the last entry ends the used rows.
    Within a group, rows keep arrival order (source rank, then the sender's order). num_rows, known
    on the host, may exceed counts.sum() (a bound-sized receive buffer): the rows past the real
    ones map to rows group_offsets[E], group_offsets[E] + 1, ... past every group, which the
    experts never read, so their contents do not matter.
    """
    counts = counts_by_source.to(torch.int64)
    runs = counts.reshape(-1)
    run_end = torch.cumsum(runs, 0)
    run_start = run_end - runs
    # expert e's run from source r lands after the rows of e from sources before r
    before = torch.cumsum(counts, 0) - counts
    offsets = group_offsets.to(torch.int64)
    run_dest = (offsets[: counts.shape[1]].view(1, -1) + before).reshape(-1)
    row = torch.arange(num_rows, device=counts.device)
    run = torch.searchsorted(run_end, row, right=True)
    last = max(runs.numel() - 1, 0)
    inside = run_dest[run.clamp(max=last)] + row - run_start[run.clamp(max=last)]
    past = offsets[counts.shape[1]] + row - run_end[-1:]
    return torch.where(run <= last, inside, past).to(torch.int32).view(num_rows, 1)


def compact_offsets(tokens_per_expert: torch.Tensor) -> torch.Tensor:
    """int32 [E + 1]: group starts of an unpadded expert-grouped buffer."""
    ends = torch.cumsum(tokens_per_expert.to(torch.int64), 0)
    return torch.cat([ends.new_zeros(1), ends]).to(torch.int32)


def group_rows(x: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
    """Received rows -> the compact expert-grouped buffer (positions from `arrival_positions` with
    `compact_offsets`, a permutation). A gather whose gradient is a gather back (no atomics)."""
    flat = positions.reshape(-1).long()
    source_row = torch.empty_like(flat)
    source_row[flat] = torch.arange(flat.numel(), device=flat.device)
    return x.index_select(0, source_row)


def ungroup_rows(y: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
    """The compact expert-grouped buffer -> rows in arrival order."""
    return y.index_select(0, positions.reshape(-1).long())
