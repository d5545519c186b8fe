"""Triton kernels that store rows straight into other GPUs' memory (symmetric memory peers).

Each kernel gets a table of base addresses, one per rank of the group (int64; the local rank's own
buffer among them), and writes through it; a barrier afterwards makes the writes visible to their
owners. Under TRITON_INTERPRET=1 the same kernels run on CPU tensors, the "ranks" being buffers of
one process (how the tests check the index arithmetic).

  post_counts   every rank's counts [V] into row `me` of every rank's inbox [ranks, V]
  push_rows     for each destination d: rows [starts[d], starts[d+1]) of the source (optionally
                gathered: source row = gather[r] // gather_div) to d's buffer, from row
                dest_base[d] on; rows at or past `capacity` are not written
"""
from __future__ import annotations

import triton
import triton.language as tl


@triton.jit
def post_counts_kernel(counts_ptr, inbox_ptrs, me, V, BLOCK: tl.constexpr):
    dest_rank = tl.program_id(0)
    inbox = tl.load(inbox_ptrs + dest_rank).to(tl.pointer_type(tl.int32))
    for start in range(0, V, BLOCK):
        offs = start + tl.arange(0, BLOCK)
        mask = offs < V
        tl.store(inbox + me * V + offs, tl.load(counts_ptr + offs, mask=mask), mask=mask)


@triton.jit
def push_rows_kernel(
    src_ptr, gather_ptr, gather_div, starts_ptr, dest_base_ptr, dest_ptrs, capacity, me, ranks,
    H, src_stride,
    GATHER: tl.constexpr, BLOCK_R: tl.constexpr, BLOCK_H: tl.constexpr,
):
    # The grid is ranks x programs_per_destination. Program p writes to rank (me + p) % ranks: every
    # sender feeds all destinations at once, each starting with a different one, so no receiver's
    # links are crowded by all senders together (rank-major order halves the bandwidth).
    pid = tl.program_id(0)
    per_dest = tl.num_programs(0) // ranks
    dest_rank = (me + pid % ranks) % ranks
    lane = pid // ranks
    lo = tl.load(starts_ptr + dest_rank)
    hi = tl.load(starts_ptr + dest_rank + 1)
    base_row = tl.load(dest_base_ptr + dest_rank)
    dest = tl.load(dest_ptrs + dest_rank).to(tl.pointer_type(src_ptr.dtype.element_ty))
    for start in range(lo + lane * BLOCK_R, hi, per_dest * BLOCK_R):
        rows = start + tl.arange(0, BLOCK_R)
        dest_rows = base_row + (rows - lo)
        mask = (rows < hi) & (dest_rows < capacity)
        if GATHER:
            src_rows = tl.load(gather_ptr + rows, mask=mask, other=0) // gather_div
        else:
            src_rows = rows
        src_rows = src_rows.to(tl.int64)
        dest_rows = dest_rows.to(tl.int64)
        for h0 in range(0, H, BLOCK_H):
            cols = h0 + tl.arange(0, BLOCK_H)
            m = mask[:, None] & (cols[None, :] < H)
            values = tl.load(src_ptr + src_rows[:, None] * src_stride + cols[None, :], mask=m)
            tl.store(dest + dest_rows[:, None] * H + cols[None, :], values, mask=m)
