"""Triton kernels that store rows straight into other GPUs' memory (symmetric memory peers).

Each kernel gets a table of base addresses, one per rank of the group (int64; the local rank's own
buffer among them), and writes through it; a barrier afterwards makes the writes visible to their
owners. Under TRITON_INTERPRET=1 the same kernels run on CPU tensors, the "ranks" being buffers of
one process (how the tests check the index arithmetic).

  post_counts   every rank's counts [V] into row `me` of every rank's inbox [ranks, V]
  push_rows     for each destination d: rows [starts[d], starts[d+1]) of the source to d's
                buffer, from row dest_base[d] on
  push_copies   each routed copy (t, j) of a token row to its expert's rank, at the row that its
                sorted position gives (no sorted copy of the tokens is made)
  push_to_targets
                each row r of the source to row targets[r] // R of rank targets[r] % R
  return_targets
                for each row of the experts' padded buffer, where its output returns to: the
                targets push_to_targets takes
Rows at or past `capacity` are not written.
"""
from __future__ import annotations

import triton
import triton.language as tl


@triton.jit
def post_counts_kernel(counts_ptr, counts_stride, inbox_ptrs, me, V, BLOCK: tl.constexpr):
    dest_rank = tl.program_id(0)
    inbox = tl.load(inbox_ptrs + dest_rank).to(tl.pointer_type(tl.int32))
    for start in range(0, V, BLOCK):
        offs = start + tl.arange(0, BLOCK)
        mask = offs < V
        counts = tl.load(counts_ptr + offs * counts_stride, mask=mask).to(tl.int32)
        tl.store(inbox + me * V + offs, counts, mask=mask)


@triton.jit
def push_rows_kernel(
    src_ptr, starts_ptr, dest_base_ptr, dest_ptrs, capacity, me, ranks, H, src_stride,
    BLOCK_R: tl.constexpr, BLOCK_H: tl.constexpr,
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
        src_rows = rows.to(tl.int64)
        dest_rows = dest_rows.to(tl.int64)
        for h0 in range(0, H, BLOCK_H):
            cols = h0 + tl.arange(0, BLOCK_H)
            m = mask[:, None] & (cols[None, :] < H)
            values = tl.load(src_ptr + src_rows[:, None] * src_stride + cols[None, :], mask=m)
            tl.store(dest + dest_rows[:, None] * H + cols[None, :], values, mask=m)


@triton.jit
def push_copies_kernel(
    src_ptr, experts_ptr, positions_ptr, starts_ptr, dest_base_ptr, dest_ptrs, capacity, n_copies, local_experts,
    H, src_stride,
    K: tl.constexpr, BLOCK_R: tl.constexpr, BLOCK_H: tl.constexpr,
):
    # Copies in token order: consecutive tokens choose experts on every rank, so each program
    # writes to all destinations at once and no receiver is crowded (as push_rows' staggering does).
    # copy i = (token i // K, slot i % K): virtual expert experts[i], sorted position positions[i].
    for start in range(tl.program_id(0) * BLOCK_R, n_copies, tl.num_programs(0) * BLOCK_R):
        copies = start + tl.arange(0, BLOCK_R)
        valid = copies < n_copies
        dest_rank = tl.load(experts_ptr + copies, mask=valid, other=0) // local_experts
        sorted_row = tl.load(positions_ptr + copies, mask=valid, other=0)
        dest_rows = tl.load(dest_base_ptr + dest_rank, mask=valid, other=0) + sorted_row \
            - tl.load(starts_ptr + dest_rank, mask=valid, other=0)
        mask = valid & (dest_rows < capacity)
        dest = tl.load(dest_ptrs + dest_rank, mask=mask, other=0).to(tl.pointer_type(src_ptr.dtype.element_ty))
        src_rows = (copies // K).to(tl.int64)
        dest_rows = dest_rows.to(tl.int64)
        for h0 in range(0, H, BLOCK_H):
            cols = h0 + tl.arange(0, BLOCK_H)
            m = mask[:, None] & (cols[None, :] < H)
            values = tl.load(src_ptr + src_rows[:, None] * src_stride + cols[None, :], mask=m)
            tl.store(dest[:, None] + dest_rows[:, None] * H + cols[None, :], values, mask=m)


@triton.jit
def exchange_plan_kernel(inbox_ptr, plan_ptr, counts_by_source_ptr, tokens_per_expert_ptr, offsets_ptr, counts_ptr,
                         me, ranks, local_experts,
                         R_P2: tl.constexpr, L_P2: tl.constexpr, V_P2: tl.constexpr):
    # inbox [ranks, ranks * local_experts]: row s = rank s's counts per virtual expert. The matrix
    # M[s, d] = rows s sends d; plan = [send_starts (R+1) | dest_base (R) | recv_starts (R+1) |
    # return_base (R)] as in ops.ExchangePlan. Also: rows received per source and
    # local expert, their sum per local expert, and my own counts [V] and group starts [V+1].
    s = tl.arange(0, R_P2)
    d = tl.arange(0, R_P2)
    V = ranks * local_experts
    valid = (s[:, None] < ranks) & (d[None, :] < ranks)
    matrix = tl.zeros((R_P2, R_P2), dtype=tl.int64)
    for v in range(0, local_experts):
        matrix += tl.load(inbox_ptr + s[:, None] * V + d[None, :] * local_experts + v, mask=valid, other=0)
    send = tl.sum(tl.where(s[:, None] == me, matrix, 0), axis=0)  # over destinations d
    dest_base = tl.sum(tl.where(s[:, None] < me, matrix, 0), axis=0)
    recv = tl.sum(tl.where(d[None, :] == me, matrix, 0), axis=1)  # over sources s
    return_base = tl.sum(tl.where(d[None, :] < me, matrix, 0), axis=1)
    in_range = s < ranks
    tl.store(plan_ptr + s, 0, mask=s == 0)
    tl.store(plan_ptr + 1 + d, tl.cumsum(send, axis=0), mask=in_range)
    tl.store(plan_ptr + ranks + 1 + d, dest_base, mask=in_range)
    tl.store(plan_ptr + 2 * ranks + 1 + s, 0, mask=s == 0)
    tl.store(plan_ptr + 2 * ranks + 2 + s, tl.cumsum(recv, axis=0), mask=in_range)
    tl.store(plan_ptr + 3 * ranks + 2 + s, return_base, mask=in_range)

    e = tl.arange(0, L_P2)
    m = (s[:, None] < ranks) & (e[None, :] < local_experts)
    counts = tl.load(inbox_ptr + s[:, None] * V + me * local_experts + e[None, :], mask=m, other=0)
    tl.store(counts_by_source_ptr + s[:, None] * local_experts + e[None, :], counts, mask=m)
    tl.store(tokens_per_expert_ptr + e, tl.sum(counts.to(tl.int64), axis=0), mask=e < local_experts)

    v = tl.arange(0, V_P2)
    mine = tl.load(inbox_ptr + me * V + v, mask=v < V, other=0)
    tl.store(counts_ptr + v, mine, mask=v < V)
    ends = tl.cumsum(mine, axis=0)
    tl.store(offsets_ptr + v, 0, mask=v == 0)
    tl.store(offsets_ptr + 1 + v, ends, mask=v < V)


@triton.jit
def push_to_targets_kernel(src_ptr, targets_ptr, dest_ptrs, n_rows, used_ptr, ranks, H, src_stride,
                           HAS_USED: tl.constexpr, BLOCK_R: tl.constexpr, BLOCK_H: tl.constexpr):
    if HAS_USED:  # rows from *used_ptr on hold nothing to push (a bound-sized buffer's tail)
        n_rows = tl.minimum(n_rows, tl.load(used_ptr).to(tl.int32))
    for start in range(tl.program_id(0) * BLOCK_R, n_rows, tl.num_programs(0) * BLOCK_R):
        rows = start + tl.arange(0, BLOCK_R)
        targets = tl.load(targets_ptr + rows, mask=rows < n_rows, other=-1)
        live = targets >= 0
        rank = tl.where(live, targets % ranks, 0)
        dest = tl.load(dest_ptrs + rank, mask=live, other=0).to(tl.pointer_type(src_ptr.dtype.element_ty))
        dest_rows = targets // ranks
        for h0 in range(0, H, BLOCK_H):
            cols = h0 + tl.arange(0, BLOCK_H)
            m = live[:, None] & (cols[None, :] < H)
            values = tl.load(src_ptr + rows.to(tl.int64)[:, None] * src_stride + cols[None, :], mask=m)
            tl.store(dest[:, None] + dest_rows[:, None] * H + cols[None, :], values, mask=m)


@triton.jit
def return_targets_kernel(pos_ptr, recv_starts_ptr, return_base_ptr, targets_ptr, n_rows, ranks,
                          BLOCK: tl.constexpr, R_P2: tl.constexpr):
    # received row a (arrival order) came from the source s with recv_starts[s] <= a < recv_starts[s+1],
    # where it was row return_base[s] + a - recv_starts[s] of s's sorted order; it sits at row pos[a]
    # of the padded buffer. Rows past recv_starts[ranks] are not real and set nothing.
    s = tl.arange(0, R_P2)
    starts = tl.load(recv_starts_ptr + s, mask=s <= ranks, other=0)
    ends = tl.load(recv_starts_ptr + s + 1, mask=s < ranks, other=0)
    bases = tl.load(return_base_ptr + s, mask=s < ranks, other=0)
    for start in range(tl.program_id(0) * BLOCK, n_rows, tl.num_programs(0) * BLOCK):
        a = start + tl.arange(0, BLOCK)
        inside = (a[:, None] >= starts[None, :]) & (a[:, None] < ends[None, :]) & (s[None, :] < ranks)
        source = tl.sum(tl.where(inside, s[None, :], 0), axis=1)
        real = tl.sum(inside.to(tl.int32), axis=1) > 0
        row = tl.sum(tl.where(inside, bases[None, :] - starts[None, :], 0), axis=1) + a
        padded = tl.load(pos_ptr + a, mask=real, other=0).to(tl.int64)
        tl.store(targets_ptr + padded, row * ranks + source, mask=real)
