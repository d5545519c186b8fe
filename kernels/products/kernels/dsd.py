"""Triton kernel of DSD: dense C = S @ B, or C = S^T @ B, for a block-sparse S and a dense B.

One program computes a [BS, BLOCK_N] tile of C: block row ``tm`` of S (or block column ``tm`` of S
when TRANS_S) times a column strip of B. It walks that row's (column's) blocks through the BCSR
offsets (the transposed view's offsets), reading each block as is or transposed: S^T is never
materialised. The reduction over the blocks and over the BLOCK_K slices inside a block is one flat
loop, so the software pipeline keeps loads in flight across block boundaries. Rows without blocks
store zeros. Programs are ordered in groups of GROUP_M tile rows for L2 reuse of B.

ACCUMULATE adds the product to C instead (C += S @ B): the tile's old values are read, widened to
fp32, added to the accumulator and stored in C's dtype (fp32 for a weight gradient's main_grad).
"""
import triton
import triton.language as tl

from .tile_mapping import grouped_tile


@triton.jit
def dsd_kernel(
    s_ptr, b_ptr, c_ptr,
    offsets_ptr, indices_ptr, positions_ptr,
    N, out_block_rows, blocks_per_row,
    stride_bk, stride_bn, stride_cm, stride_cn,
    BS: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, GROUP_M: tl.constexpr,
    TRANS_S: tl.constexpr, REGULAR: tl.constexpr, EVEN_N: tl.constexpr, DOT_PRECISION: tl.constexpr,
    ACCUMULATE: tl.constexpr,
    slot_ptr, slot_elements, FROM_SLOT: tl.constexpr,
):
    pid = tl.program_id(0)
    if FROM_SLOT:  # S is slot `*slot_ptr` of stacked data (read on the device)
        s_ptr += tl.load(slot_ptr).to(tl.int64) * slot_elements
    num_n = tl.cdiv(N, BLOCK_N)
    tm, tn = grouped_tile(pid, out_block_rows, num_n, GROUP_M)

    start = tl.load(offsets_ptr + tm)
    end = tl.load(offsets_ptr + tm + 1)

    KSTEPS: tl.constexpr = BS // BLOCK_K
    offs_m = tl.arange(0, BS)
    offs_n = tn * BLOCK_N + tl.arange(0, BLOCK_N)
    offs_k = tl.arange(0, BLOCK_K)
    if TRANS_S:
        # Tile element (p, q) of S^T is element (q, p) of the stored block.
        s_offs = offs_k[None, :] * BS + offs_m[:, None]
        k_step = BLOCK_K * BS
    else:
        s_offs = offs_m[:, None] * BS + offs_k[None, :]
        k_step = BLOCK_K
    b_offs = offs_k[:, None] * stride_bk + offs_n[None, :] * stride_bn
    n_mask = offs_n[None, :] < N

    acc = tl.zeros((BS, BLOCK_N), dtype=tl.float32)
    if REGULAR:
        # Regular topology: a row's blocks have consecutive columns (a column's blocks consecutive
        # rows, F positions apart), so no index is loaded inside the loop and it pipelines freely.
        has_blocks = end > start
        first = tl.load(indices_ptr + start, mask=has_blocks, other=0)
        block_elems = tl.full((), BS * BS, tl.int64)  # 64-bit: block offsets can pass 2**31
        if TRANS_S:
            blk0 = tl.load(positions_ptr + start, mask=has_blocks, other=0)
            blk_step = block_elems * blocks_per_row
        else:
            blk0 = start
            blk_step = block_elems
        s_base = s_ptr + blk0 * block_elems + s_offs
        b_ptrs = b_ptr + first.to(tl.int64) * BS * stride_bk + b_offs
        for i in range(0, (end - start) * KSTEPS):
            s_off = (i // KSTEPS) * blk_step + (i % KSTEPS) * k_step
            s = tl.load(s_base + s_off)
            if EVEN_N:
                b = tl.load(b_ptrs)
            else:
                b = tl.load(b_ptrs, mask=n_mask, other=0.0)
            acc = tl.dot(s, b, acc, input_precision=DOT_PRECISION)
            b_ptrs += BLOCK_K * stride_bk
    else:
        for i in range(0, (end - start) * KSTEPS):
            pos = start + i // KSTEPS
            kk = i % KSTEPS
            kblock = tl.load(indices_ptr + pos)  # the block's column of S (its row when TRANS_S)
            if TRANS_S:
                blk = tl.load(positions_ptr + pos)
            else:
                blk = pos
            s = tl.load(s_ptr + blk.to(tl.int64) * (BS * BS) + kk * k_step + s_offs)
            b_row = kblock.to(tl.int64) * BS + kk * BLOCK_K
            if EVEN_N:
                b = tl.load(b_ptr + b_row * stride_bk + b_offs)
            else:
                b = tl.load(b_ptr + b_row * stride_bk + b_offs, mask=n_mask, other=0.0)
            acc = tl.dot(s, b, acc, input_precision=DOT_PRECISION)

    c_ptrs = (c_ptr + tm.to(tl.int64) * BS * stride_cm
              + offs_m[:, None] * stride_cm + offs_n[None, :] * stride_cn)
    if ACCUMULATE:
        if EVEN_N:
            acc += tl.load(c_ptrs).to(tl.float32)
        else:
            acc += tl.load(c_ptrs, mask=n_mask, other=0.0).to(tl.float32)
    if EVEN_N:
        tl.store(c_ptrs, acc.to(c_ptr.dtype.element_ty))
    else:
        tl.store(c_ptrs, acc.to(c_ptr.dtype.element_ty), mask=n_mask)
