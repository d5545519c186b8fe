"""Launchers of the symmetric-memory exchange kernels (kernels.py): the offsets of an exchange from
every rank's counts, and the stores of rows into the peers' buffers. megatron_dmoe's
moe/exchange/symmetric.py owns the buffers, the barriers and the autograd around them.

  exchange_plan(inbox, me, local_experts)   ExchangePlan: every offset, from the count matrix, one launch
  post_counts(counts, inbox_ptrs, me)       my counts into row `me` of every rank's inbox
  push_rows(src, starts, dest_base, dest_ptrs, capacity, me)
                                            rows already in destination order to each rank
  push_copies(x, experts, positions, plan, dest_ptrs, capacity, local_experts)
                                            each routed copy of a token row to its expert's rank
  return_targets(pos, plan, padded_rows)    where each row of the experts' padded buffer returns to
  push_to_targets(src, targets, dest_ptrs)  rows to those targets (RowTargets.push)
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

import torch

from ..launch import cdiv, direct, multiprocessors, next_power_of_2
from . import kernels as _kernels


@dataclass
class ExchangePlan:
    """Where rows go, on the device (int64), plus the host-known bounds of the exchange's sizes."""

    send_starts: torch.Tensor  # [R + 1]: my sorted rows for rank d are [send_starts[d], send_starts[d+1])
    dest_base: torch.Tensor  # [R]: first row of my rows in rank d's to_experts buffer
    recv_starts: torch.Tensor  # [R + 1]: rows from rank s in my to_experts buffer
    return_base: torch.Tensor  # [R]: first row, in rank s's sorted order, of the rows s sent me
    counts_by_source: torch.Tensor  # int32 [R, local experts]: rows received per source and expert
    tokens_per_expert: torch.Tensor  # int64 [local experts]: rows received per local expert
    offsets: torch.Tensor  # int32 [V + 1]: group starts of my copies in virtual-expert order
    counts: torch.Tensor  # int32 [V]: my copies per virtual expert
    send_rows: int = -1  # host: rows I send (= my routed copies, T*K)
    recv_rows: int = -1  # host: bound on the rows I receive (>= ranks * T*K); the real count is on the device


def exchange_plan(inbox: torch.Tensor, me: int, local_experts: int) -> ExchangePlan:
    """Offsets of the exchange from the count matrix inbox int32 [R, V] (row s: rank s's counts per
    virtual expert; rank d owns virtual experts [d * local_experts, (d + 1) * local_experts)), in
    one kernel launch."""
    ranks, V = inbox.shape
    device = inbox.device
    packed = torch.empty(4 * ranks + 2, dtype=torch.int64, device=device)
    counts_by_source = torch.empty(ranks, local_experts, dtype=torch.int32, device=device)
    tokens_per_expert = torch.empty(local_experts, dtype=torch.int64, device=device)
    offsets = torch.empty(V + 1, dtype=torch.int32, device=device)
    counts = torch.empty(V, dtype=torch.int32, device=device)
    direct(_kernels.exchange_plan_kernel)[(1,)](
        inbox, packed, counts_by_source, tokens_per_expert, offsets, counts, me, ranks, local_experts,
        R_P2=next_power_of_2(ranks), L_P2=next_power_of_2(local_experts), V_P2=next_power_of_2(V),
    )
    send_starts, dest_base, recv_starts, return_base = packed.split([ranks + 1, ranks, ranks + 1, ranks])
    return ExchangePlan(send_starts, dest_base, recv_starts, return_base, counts_by_source, tokens_per_expert,
                        offsets, counts)


def post_counts(counts: torch.Tensor, inbox_ptrs: torch.Tensor, me: int) -> None:
    """counts [V] (any integer dtype and stride) into row `me` of every rank's int32 inbox
    (inbox_ptrs: their addresses)."""
    direct(_kernels.post_counts_kernel)[(inbox_ptrs.numel(),)](
        counts, counts.stride(0), inbox_ptrs, me, counts.numel(), BLOCK=1024
    )


def _launch_shape(src: torch.Tensor, programs: Optional[int]):
    """(programs, BLOCK_H, warps) of a push kernel; by default two programs per multiprocessor."""
    if programs is None:
        programs = 2 * multiprocessors(src.device)
    block_h = min(1024, next_power_of_2(src.shape[1]))
    return programs, block_h, (8 if block_h >= 512 else 4)


def push_rows(
    src: torch.Tensor, starts: torch.Tensor, dest_base: torch.Tensor, dest_ptrs: torch.Tensor,
    capacity: int, me: int, programs_per_destination: Optional[int] = None,
) -> None:
    """Rows [starts[d], starts[d+1]) of src to rank d's buffer (address dest_ptrs[d], rows of
    src.shape[1] elements) from row dest_base[d] on."""
    ranks = dest_ptrs.numel()
    src = src if src.stride(1) == 1 else src.contiguous()
    programs, block_h, warps = _launch_shape(src, None if programs_per_destination is None
                                             else programs_per_destination * ranks)
    per_destination = max(1, programs // ranks)
    direct(_kernels.push_rows_kernel)[(ranks * per_destination,)](
        src, starts, dest_base, dest_ptrs, capacity, me, ranks, src.shape[1], src.stride(0),
        BLOCK_R=8, BLOCK_H=block_h, num_warps=warps,
    )


def push_copies(
    x: torch.Tensor, experts: torch.Tensor, positions: torch.Tensor, plan: ExchangePlan, dest_ptrs: torch.Tensor,
    capacity: int, local_experts: int, programs: Optional[int] = None,
) -> None:
    """Each routed copy (t, j) of x[t] (experts/positions [T, K]: virtual expert and sorted position)
    to its expert's rank, at arrival row dest_base[d] + position - send_starts[d]."""
    x = x if x.stride(1) == 1 else x.contiguous()
    programs, block_h, warps = _launch_shape(x, programs)
    direct(_kernels.push_copies_kernel)[(programs,)](
        x, experts, positions, plan.send_starts, plan.dest_base, dest_ptrs, capacity, experts.numel(), local_experts,
        x.shape[1], x.stride(0),
        K=experts.shape[1], BLOCK_R=8, BLOCK_H=block_h, num_warps=warps,
    )


@dataclass
class RowTargets:
    """Where rows go in other ranks' buffers: row r to row targets[r] // R of the buffer at address
    dest_ptrs[targets[r] % R], R = dest_ptrs.numel(); a negative target sends the row nowhere. The
    buffers are row-major, of the rows' width and dtype (symmetric-memory peers, whose owners see
    the rows after a barrier)."""

    targets: torch.Tensor  # int64 [rows]
    dest_ptrs: torch.Tensor  # int64 [R]
    used_rows: Optional[torch.Tensor] = None  # one integer on the device: rows from it on go nowhere

    def push(self, src: torch.Tensor) -> None:
        push_to_targets(src, self.targets, self.dest_ptrs, used_rows=self.used_rows)


def return_targets(pos: torch.Tensor, plan: ExchangePlan, padded_rows: int) -> torch.Tensor:
    """int64 [padded_rows]: for each row of the experts' padded buffer, where its output returns
    (RowTargets): row * R + s for row `row` of source s's sorted order (the row that
    rank's `to_sources` buffer receives it at), -1 for padding and rows past the real ones. pos
    int32 [recv_rows, 1]: the padded row of each received row (arrival order)."""
    ranks = plan.return_base.numel()
    targets = torch.full((padded_rows,), -1, dtype=torch.int64, device=pos.device)
    n_rows = pos.shape[0]
    block = 256
    programs = max(1, min(cdiv(n_rows, block), 4 * multiprocessors(pos.device)))
    direct(_kernels.return_targets_kernel)[(programs,)](
        pos, plan.recv_starts, plan.return_base, targets, n_rows, ranks, BLOCK=block, R_P2=next_power_of_2(ranks),
    )
    return targets


def push_to_targets(src: torch.Tensor, targets: torch.Tensor, dest_ptrs: torch.Tensor,
                    programs: Optional[int] = None, used_rows: Optional[torch.Tensor] = None) -> None:
    """Row r of src [rows, H] to row targets[r] // R of the buffer at dest_ptrs[targets[r] % R]
    (R = dest_ptrs.numel(); rows with a negative target stay). used_rows: a one-element integer
    tensor on the device; rows from its value on are not even looked at (a bound-sized buffer's
    unused tail)."""
    src = src if src.stride(1) == 1 else src.contiguous()
    programs, block_h, warps = _launch_shape(src, programs)
    direct(_kernels.push_to_targets_kernel)[(programs,)](
        src, targets, dest_ptrs, src.shape[0], used_rows, dest_ptrs.numel(), src.shape[1], src.stride(0),
        HAS_USED=used_rows is not None, BLOCK_R=8, BLOCK_H=block_h, num_warps=warps,
    )
