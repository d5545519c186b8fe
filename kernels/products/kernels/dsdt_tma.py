"""Persistent S^T @ B (the weight gradients) for regular topologies, tile and K loops fused by hand.

Output tile (tm, tn) is block column tm of S (an expert's slice of the weight) times a column strip
of B; its reduction runs over that expert's token blocks, so trip counts differ between experts and
the compiler's loop fusion (which needs loop-invariant bounds) does not apply. With few tokens per
expert (256 in the paper's models) each tile is only a few K steps long, and without fusion every
tile pays its pipeline fill alone.

So each program first counts the steps of all its tiles (one vectorised pass over its tiles'
column offsets), then runs ONE loop over them in the classic fused form: at a tile's first step
its coordinates are decoded (in a branch that holds nothing else), every step loads and
multiplies, and at a tile's last step a second branch stores the result. The software pipeline
can then prefetch the next tile's operands while the current tile finishes. A tile of an expert
without tokens takes one step that reads out of bounds (TMA returns zeros) and stores zeros.
Tiles are dealt to programs round-robin in GROUP_M-swizzled order for L2 reuse.

ACCUMULATE adds each tile to C (C += S^T @ B) through plain pointers (c_ptr, stride_cm) rather than
the TMA store, as in dsd_tma_kernel; c_desc is then unused (None). With OVERWRITE that epilogue
stores C = S^T @ B without reading C (an fp32 main_grad just zeroed). STRIPS > 0 (an fp32 C under
16-bit operands, TMA-ready, not accumulated): C = S^T @ B through TMA stores instead, c_desc's
block [BS, BLOCK_N // STRIPS], one column strip of the fp32 tile at a time staged in shared memory
beside the pipeline's buffers (a whole fp32 [128, 256] tile would not fit) and written
asynchronously, which halves the call against the pointer epilogue's add where main_grad's traffic
bounds it (docs/kernels.md, "Weight gradients into main_grad"). Adding through TMA strips (reading C's strip
first) measured no faster than the pointer epilogue.
"""
import triton
import triton.language as tl

from .dsd_tma import add_tile_to_output, halves
from .tile_mapping import grouped_tile

TILE_COUNT_CHUNK = 64  # the kernel's COUNT_CHUNK: tiles whose block counts one pass loads


@triton.jit
def _store_in_strips(c_desc, acc, row0, col0, BS: tl.constexpr, BLOCK_N: tl.constexpr, STRIPS: tl.constexpr):
    # up to four strips: the tile halved once or twice
    if STRIPS == 4:
        left, right = halves(acc, BS, BLOCK_N)
        q0, q1 = halves(left, BS, BLOCK_N // 2)
        q2, q3 = halves(right, BS, BLOCK_N // 2)
        c_desc.store([row0, col0], q0)
        c_desc.store([row0, col0 + BLOCK_N // 4], q1)
        c_desc.store([row0, col0 + BLOCK_N // 2], q2)
        c_desc.store([row0, col0 + 3 * BLOCK_N // 4], q3)
    elif STRIPS == 2:
        left, right = halves(acc, BS, BLOCK_N)
        c_desc.store([row0, col0], left)
        c_desc.store([row0, col0 + BLOCK_N // 2], right)
    else:
        c_desc.store([row0, col0], acc)


@triton.jit(do_not_specialize=["N", "out_block_rows", "blocks_per_row", "num_programs", "s_rows", "b_rows"])
def dsdt_tma_kernel(
    s_desc, b_desc, c_desc,
    column_offsets_ptr, row_indices_t_ptr, block_offsets_t_ptr,
    N, out_block_rows, blocks_per_row, num_programs, s_rows, b_rows,
    BS: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, GROUP_M: tl.constexpr,
    OUT_DTYPE: tl.constexpr, DOT_PRECISION: tl.constexpr, COUNT_CHUNK: tl.constexpr,
    c_ptr, stride_cm, ACCUMULATE: tl.constexpr, OVERWRITE: tl.constexpr,
    STRIPS: tl.constexpr,
):
    pid = tl.program_id(0)
    KSTEPS: tl.constexpr = BS // BLOCK_K
    num_n = tl.cdiv(N, BLOCK_N)
    num_tiles = out_block_rows * num_n
    my_tiles = tl.cdiv(tl.maximum(num_tiles - pid, 0), num_programs)

    # Pass 1: total steps of this program (each tile at least one).
    total = 0
    for base in range(0, my_tiles, COUNT_CHUNK):
        j = base + tl.arange(0, COUNT_CHUNK)
        valid = j < my_tiles
        t = pid + j * num_programs
        t_m, t_n = grouped_tile(t, out_block_rows, num_n, GROUP_M, PAST_END=True)  # masked lanes run past
        lo = tl.load(column_offsets_ptr + t_m, mask=valid, other=0)
        hi = tl.load(column_offsets_ptr + t_m + 1, mask=valid, other=0)
        total += tl.sum(tl.where(valid, tl.maximum((hi - lo) * KSTEPS, 1), 0))

    # Pass 2: one loop over every step of every tile of this program.
    tile = pid - num_programs
    ki = -1
    steps = 0  # steps of the current tile (at least 1)
    live_steps = 0  # steps that read data (0 for an expert without tokens)
    tm = 0
    tn = 0
    first = 0
    blk0 = 0
    acc = tl.zeros((BS, BLOCK_N), dtype=tl.float32)
    for _ in range(total):
        ki = tl.where(ki == steps - 1, 0, ki + 1)
        if ki == 0:
            tile += num_programs
            tm, tn = grouped_tile(tile, out_block_rows, num_n, GROUP_M, PAST_END=True)
            lo = tl.load(column_offsets_ptr + tm)
            hi = tl.load(column_offsets_ptr + tm + 1)
            first = tl.load(row_indices_t_ptr + lo, mask=hi > lo, other=0)
            blk0 = tl.load(block_offsets_t_ptr + lo, mask=hi > lo, other=0)
            live_steps = (hi - lo) * KSTEPS
            steps = tl.maximum(live_steps, 1)
        live = ki < live_steps
        s_row = tl.where(live, (blk0 + (ki // KSTEPS) * blocks_per_row) * BS + (ki % KSTEPS) * BLOCK_K, s_rows)
        b_row = tl.where(live, first * BS + ki * BLOCK_K, b_rows)
        s = s_desc.load([s_row, 0]).T
        b = b_desc.load([b_row, tn * BLOCK_N])
        acc = tl.dot(s, b, acc, input_precision=DOT_PRECISION)
        if ki == steps - 1:
            if ACCUMULATE:
                add_tile_to_output(c_ptr, stride_cm, N, tm * BS, tn * BLOCK_N, acc, BS, BLOCK_N, not OVERWRITE)
            elif STRIPS > 0:
                _store_in_strips(c_desc, acc, tm * BS, tn * BLOCK_N, BS, BLOCK_N, STRIPS)
            else:
                c_desc.store([tm * BS, tn * BLOCK_N], acc.to(OUT_DTYPE))
            acc = tl.zeros((BS, BLOCK_N), dtype=tl.float32)
