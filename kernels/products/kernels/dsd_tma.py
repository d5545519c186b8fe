"""Persistent DSD (C = S @ B or S^T @ B) for regular (dMoE) topologies, with TMA descriptors.

Regular means: the used block rows come first and each holds F blocks of consecutive columns. Then
a row's blocks sit at consecutive positions and multiply consecutive rows of B; a column's blocks
are consecutive block rows, F positions apart in the data. No index is read inside the K loop.

A fixed grid of programs walks the output tiles [BS, BLOCK_N] in groups of GROUP_M tile rows.
For S @ B the tiles of used rows all have the same trip count (F blocks), a bound the compiler sees
as loop-invariant, so FLATTEN can fuse the tile and K loops; the rows past the used ones are then
filled with zeros. For S^T @ B (weight gradients) the trip count of a tile is the number of blocks
of the expert that owns its column: uneven, so the compiler cannot fuse the loops (fusing them by
hand, with the tile bookkeeping inside one loop, measured slower on an H200:
docs/kernels.md, "Weight-gradient loop fusion").

ACCUMULATE (C += the product, for weight gradients added straight into an fp32 main_grad) reads and
writes C through plain pointers (c_ptr, stride_cm) instead of the TMA store: staging an fp32
[128, 256] tile in shared memory would not fit beside the pipeline's buffers. c_desc is then unused
(None), and the rows past the used ones are left as they are (they gain nothing). With OVERWRITE
the same epilogue stores C = the product without reading C (a main_grad just zeroed): the stores
need no wait, so the tile's epilogue no longer stalls on C's old values.

FROM_SLOT (S @ B only): S is one slot of stacked data (a weight-gradient window's, products/window.py), the slot
read from slot_ptr on the device, so that a replayed graph reads whichever slot is current.
"""
import triton
import triton.language as tl

from .tile_mapping import grouped_tile


@triton.jit
def _add_part(c_ptr, stride_cm, N, row0, col0, part, BS: tl.constexpr, WIDTH: tl.constexpr, ADD: tl.constexpr):
    rows = row0.to(tl.int64) + tl.arange(0, BS)
    cols = col0 + tl.arange(0, WIDTH)
    ptrs = c_ptr + rows[:, None] * stride_cm + cols[None, :]
    mask = cols[None, :] < N
    if ADD:
        part += tl.load(ptrs, mask=mask, other=0.0).to(tl.float32)
    tl.store(ptrs, part.to(c_ptr.dtype.element_ty), mask=mask)


@triton.jit
def halves(t, BS: tl.constexpr, WIDTH: tl.constexpr):
    """The left and right column halves of a [BS, WIDTH] tile."""
    return tl.split(tl.permute(tl.reshape(t, (BS, 2, WIDTH // 2)), (0, 2, 1)))


@triton.jit
def _add_halves(c_ptr, stride_cm, N, row0, col0, acc, BS: tl.constexpr, WIDTH: tl.constexpr, ADD: tl.constexpr):
    left, right = halves(acc, BS, WIDTH)
    _add_part(c_ptr, stride_cm, N, row0, col0, left, BS, WIDTH // 2, ADD)
    _add_part(c_ptr, stride_cm, N, row0, col0 + WIDTH // 2, right, BS, WIDTH // 2, ADD)


@triton.jit
def add_tile_to_output(c_ptr, stride_cm, N, row0, col0, acc, BS: tl.constexpr, BLOCK_N: tl.constexpr,
                       ADD: tl.constexpr = True):
    """C[row0 : row0 + BS, col0 : col0 + BLOCK_N] += acc (ADD) or = acc through pointers, in fp32,
    stored in C's dtype. Rows are whole blocks (never past the end); columns past N are masked. In
    column strips of at most 64: the layout conversion between the accumulator and C's pointers goes
    through shared memory, and a whole fp32 [128, 256] tile (128 KB) would not fit beside the pipeline."""
    if BLOCK_N > 128:
        left, right = halves(acc, BS, BLOCK_N)
        _add_halves(c_ptr, stride_cm, N, row0, col0, left, BS, BLOCK_N // 2, ADD)
        _add_halves(c_ptr, stride_cm, N, row0, col0 + BLOCK_N // 2, right, BS, BLOCK_N // 2, ADD)
    elif BLOCK_N > 64:
        _add_halves(c_ptr, stride_cm, N, row0, col0, acc, BS, BLOCK_N, ADD)
    else:
        _add_part(c_ptr, stride_cm, N, row0, col0, acc, BS, BLOCK_N, ADD)


@triton.jit(do_not_specialize=["N", "out_block_rows", "blocks_per_row", "num_programs"])
def dsd_tma_kernel(
    s_desc, b_desc, c_desc,
    offsets_ptr, indices_ptr, positions_ptr, nnz_ptr,
    N, out_block_rows, blocks_per_row, num_programs,
    BS: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, GROUP_M: tl.constexpr,
    TRANS_S: tl.constexpr, FLATTEN: tl.constexpr,
    OUT_DTYPE: tl.constexpr, DOT_PRECISION: tl.constexpr,
    c_ptr, stride_cm, ACCUMULATE: tl.constexpr, OVERWRITE: tl.constexpr,
    slot_ptr, slot_rows, FROM_SLOT: tl.constexpr,
):
    pid = tl.program_id(0)
    num_n = tl.cdiv(N, BLOCK_N)
    s_row0 = 0
    if FROM_SLOT:  # S is slot `*slot_ptr` of stacked data, s_desc over all of it (read on the device)
        s_row0 = tl.load(slot_ptr) * slot_rows
    if TRANS_S:
        busy_rows = out_block_rows  # every block column; an empty expert's tiles store zeros
    else:
        busy_rows = tl.load(nnz_ptr) // blocks_per_row
    KSTEPS: tl.constexpr = BS // BLOCK_K
    for tile in tl.range(pid, busy_rows * num_n, num_programs, flatten=FLATTEN):
        tm, tn = grouped_tile(tile, busy_rows, num_n, GROUP_M)
        start = tl.load(offsets_ptr + tm)
        end = tl.load(offsets_ptr + tm + 1)
        has_blocks = end > start
        first = tl.load(indices_ptr + start, mask=has_blocks, other=0)
        if TRANS_S:
            blk0 = tl.load(positions_ptr + start, mask=has_blocks, other=0)
            blk_step = blocks_per_row
        else:
            blk0 = start
            blk_step = 1
        if TRANS_S:
            trip = (end - start) * KSTEPS
        else:
            trip = blocks_per_row * KSTEPS  # every used row holds F blocks: a loop-invariant bound
        acc = tl.zeros((BS, BLOCK_N), dtype=tl.float32)
        for i in range(trip):
            blk = blk0 + (i // KSTEPS) * blk_step
            kk = (i % KSTEPS) * BLOCK_K
            if TRANS_S:
                s = s_desc.load([blk * BS + kk, 0]).T
            else:
                s = s_desc.load([s_row0 + blk * BS, kk])
            b = b_desc.load([first * BS + i * BLOCK_K, tn * BLOCK_N])
            acc = tl.dot(s, b, acc, input_precision=DOT_PRECISION)
        if ACCUMULATE:
            add_tile_to_output(c_ptr, stride_cm, N, tm * BS, tn * BLOCK_N, acc, BS, BLOCK_N, not OVERWRITE)
        else:
            c_desc.store([tm * BS, tn * BLOCK_N], acc.to(OUT_DTYPE))
    if not TRANS_S and not ACCUMULATE:
        zeros = tl.zeros((BS, BLOCK_N), dtype=OUT_DTYPE)
        for t in range(pid, (out_block_rows - busy_rows) * num_n, num_programs):
            c_desc.store([(busy_rows + t // num_n) * BS, (t % num_n) * BLOCK_N], zeros)
    if not TRANS_S and OVERWRITE:
        for t in range(pid, (out_block_rows - busy_rows) * num_n, num_programs):
            add_tile_to_output(c_ptr, stride_cm, N, (busy_rows + t // num_n) * BS, (t % num_n) * BLOCK_N,
                               tl.zeros((BS, BLOCK_N), dtype=tl.float32), BS, BLOCK_N, False)
