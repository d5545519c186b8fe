"""Triton kernel of SDD: sparse output = dense A [M, K] @ dense B [K, N], only at the topology's blocks.

One program computes NB neighbouring blocks of one block row: a [BS, NB*BS] tile. NB > 1 needs a
topology whose rows hold runs of consecutive columns (``Topology.blocks_per_row``); that regular
layout also lets programs walk GROUP_M block rows column by column, so that a group's rows of A and
columns of B are reused from L2 while they are hot.

Programs past the number of existing blocks (``nnz``, read on the device) exit at once.
"""
import triton
import triton.language as tl

from .tile_mapping import grouped_tile


@triton.jit
def sdd_kernel(
    a_ptr, b_ptr, out_ptr,
    row_indices_ptr, column_indices_ptr, nnz_ptr,
    K, blocks_per_row,
    stride_am, stride_ak, stride_bk, stride_bn,
    BS: tl.constexpr, NB: tl.constexpr, BLOCK_K: tl.constexpr, GROUP_M: tl.constexpr,
    REGULAR: tl.constexpr, EVEN_K: tl.constexpr, DOT_PRECISION: tl.constexpr,
):
    pid = tl.program_id(0)
    nnz = tl.load(nnz_ptr)
    if REGULAR:
        # Rows 0..R-1 each hold blocks_per_row blocks; pid -> (row, run of NB blocks), grouped.
        runs_per_row = blocks_per_row // NB
        num_rows = nnz // blocks_per_row
        # The grid covers max_blocks, past the existing blocks: those programs exit.
        row, run = grouped_tile(pid, num_rows, runs_per_row, GROUP_M, PAST_END=True)
        if (row >= num_rows) | (run >= runs_per_row):
            return
        blk = row * blocks_per_row + run * NB
        col = tl.load(column_indices_ptr + blk)
    else:
        blk = pid * NB
        if blk >= nnz:
            return
        row = tl.load(row_indices_ptr + blk)
        col = tl.load(column_indices_ptr + blk)

    TILE_N: tl.constexpr = NB * BS
    offs_m = tl.arange(0, BS)
    offs_n = tl.arange(0, TILE_N)
    offs_k = tl.arange(0, BLOCK_K)
    # 64-bit base offsets once per program; the loop only adds small strides.
    a_ptrs = (a_ptr + row.to(tl.int64) * BS * stride_am
              + offs_m[:, None] * stride_am + offs_k[None, :] * stride_ak)
    b_ptrs = (b_ptr + col.to(tl.int64) * BS * stride_bn
              + offs_k[:, None] * stride_bk + offs_n[None, :] * stride_bn)

    acc = tl.zeros((BS, TILE_N), dtype=tl.float32)
    for k in range(0, tl.cdiv(K, BLOCK_K)):
        if EVEN_K:
            a = tl.load(a_ptrs)
            b = tl.load(b_ptrs)
        else:
            k_left = K - k * BLOCK_K
            a = tl.load(a_ptrs, mask=offs_k[None, :] < k_left, other=0.0)
            b = tl.load(b_ptrs, mask=offs_k[:, None] < k_left, other=0.0)
        acc = tl.dot(a, b, acc, input_precision=DOT_PRECISION)
        a_ptrs += BLOCK_K * stride_ak
        b_ptrs += BLOCK_K * stride_bk

    # Column j of the tile lands in block blk + j // BS, which is contiguous [BS, BS] row-major.
    out_offs = ((offs_n // BS) * (BS * BS) + offs_n % BS)[None, :] + offs_m[:, None] * BS
    tl.store(out_ptr + blk.to(tl.int64) * (BS * BS) + out_offs, acc.to(out_ptr.dtype.element_ty))
