"""Triton kernels that build the dMoE topology from tokens-per-expert counts in two launches.

The torch-op version in ../topology.py takes some twenty small launches, which cost more host time
than the GPU needs. Here one program computes the per-expert prefix sums (clamped so that wrong
counts can never index past the buffers), then a grid fills every index array: each position finds
its expert by a binary search over those prefix sums.
"""
import triton
import triton.language as tl


@triton.jit
def expert_prefix_kernel(
    counts_ptr, row_start_ptr, row_end_ptr, expert_offsets_ptr, nnz_ptr,
    num_experts, blocks_per_row, max_rows,
    BS: tl.constexpr, E_POW2: tl.constexpr,
):
    e = tl.arange(0, E_POW2)
    emask = e < num_experts
    counts = tl.load(counts_ptr + e, mask=emask, other=0).to(tl.int32)
    nb = (counts + BS - 1) // BS
    inclusive = tl.cumsum(nb, 0)
    row_end = tl.minimum(inclusive, max_rows)
    row_start = tl.minimum(inclusive - nb, max_rows)
    used_rows = tl.max(tl.where(emask, row_end, 0), 0)
    tl.store(row_start_ptr + e, row_start, mask=emask)
    tl.store(row_end_ptr + e, row_end, mask=emask)
    tl.store(expert_offsets_ptr + e, row_start * BS, mask=emask)
    tl.store(expert_offsets_ptr + num_experts, used_rows * BS)
    tl.store(nnz_ptr, used_rows * blocks_per_row)


@triton.jit
def expert_index_kernel(
    row_start_ptr, row_end_ptr, nnz_ptr,
    row_indices_ptr, column_indices_ptr, offsets_ptr,
    column_offsets_ptr, row_indices_t_ptr, block_offsets_t_ptr,
    num_experts, blocks_per_row, max_rows, max_blocks,
    SEARCH_STEPS: tl.constexpr, BLOCK: tl.constexpr,
):
    F = blocks_per_row
    nnz = tl.load(nnz_ptr)
    used_rows = nnz // F
    i = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)

    # BCSR order: position i is in row i // F; its expert is the first one whose rows end past it.
    row = i // F
    lo = tl.zeros_like(i)
    hi = tl.zeros_like(i) + num_experts
    for _ in range(SEARCH_STEPS):  # first expert whose rows end past `row`
        active = lo < hi
        mid = (lo + hi) // 2
        right = tl.load(row_end_ptr + mid, mask=active, other=0) <= row
        lo = tl.where(active & right, mid + 1, lo)
        hi = tl.where(active & ~right, mid, hi)
    valid = row < used_rows
    in_range = i < max_blocks
    tl.store(row_indices_ptr + i, tl.where(valid, row, 0), mask=in_range)
    tl.store(column_indices_ptr + i, tl.where(valid, lo * F + i % F, 0), mask=in_range)

    # Column order: expert e's columns start at row_start[e] * F; the last expert starting at or
    # before p (an empty expert shares its start with the next one) owns position p.
    lo = tl.zeros_like(i)
    hi = tl.zeros_like(i) + num_experts
    for _ in range(SEARCH_STEPS):  # first expert whose columns start past position i
        active = lo < hi
        mid = (lo + hi) // 2
        right = tl.load(row_start_ptr + mid, mask=active, other=0) * F <= i
        lo = tl.where(active & right, mid + 1, lo)
        hi = tl.where(active & ~right, mid, hi)
    p_expert = tl.maximum(lo - 1, 0)
    start = tl.load(row_start_ptr + p_expert, mask=in_range, other=0)
    rows_e = tl.load(row_end_ptr + p_expert, mask=in_range, other=0) - start
    local = i - start * F
    n_e = tl.maximum(rows_e, 1)
    block_row = start + local % n_e
    valid_t = i < nnz
    tl.store(row_indices_t_ptr + i, tl.where(valid_t, block_row, 0), mask=in_range)
    tl.store(block_offsets_t_ptr + i, tl.where(valid_t, block_row * F + local // n_e, 0), mask=in_range)

    # Row offsets [max_rows + 1] and column offsets [E * F + 1].
    tl.store(offsets_ptr + i, tl.minimum(i, used_rows) * F, mask=i <= max_rows)
    c_expert = tl.minimum(i // F, num_experts - 1)
    c_start = tl.load(row_start_ptr + c_expert, mask=i <= num_experts * F, other=0)
    c_rows = tl.load(row_end_ptr + c_expert, mask=i <= num_experts * F, other=0) - c_start
    col_off = tl.where(i < num_experts * F, c_start * F + (i % F) * c_rows, nnz)
    tl.store(column_offsets_ptr + i, col_off, mask=i <= num_experts * F)
