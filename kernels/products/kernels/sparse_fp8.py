"""Block-sparse products of block-scaled fp8 (e4m3) operands, DeepSeek-V3's recipe
(dmoe_kernels.fp8): the expert MLP's forward and input-gradient products for dMoE (regular)
topologies, persistent and read through TMA as sdd_tma.py and dsd_tma.py, with each step of K one
scale tile whose fp8 product is promoted into the fp32 accumulator with its two scales.

  sdd_fp8_kernel   sparse out = a @ b at the topology's blocks: a [rows, K] with 1 x 128 row scales
                   (a_scale [rows, ceil(K/128)], any strides: M-major reads a step's scales
                   from consecutive addresses), b the transpose of a row-major [cols, K] weight
                   with 128 x 128 block scales (b_scale [ceil(cols/128), ceil(K/128)]); K steps of 128
  dsd_fp8_kernel   dense C = S @ b: S's blocks in e4m3 with one scale per row of each block
                   (s_scale [max_blocks * BS]: 1 x BS tiles along K), b [K, N] with 128 x 128 block
                   scales (b_scale [ceil(K/128), ceil(N/128)]), given row-major or, B_KMAJOR, as the
                   row-major [N, K] transpose (fp8 tensor cores read b K-major: a row-major b is
                   transposed in shared memory at every step); K steps of one block

Both split a block's rows into SPLIT tiles of BS / SPLIT rows: the promotion waits for each step's
product, so smaller tiles let two programs share a multiprocessor and one's tensor-core work
overlaps the other's scaling.

Within a step Hopper's fp8 tensor cores sum at reduced precision for up to IMPRECISE_ACC products of
K before Triton adds them in fp32 (0: after every instruction); the interpreter sums in fp32.
"""
import triton
import triton.language as tl

from .sdd_tma import _store_tile
from .tile_mapping import grouped_tile


@triton.jit(do_not_specialize=["K", "blocks_per_row", "num_programs"])
def sdd_fp8_kernel(
    a_desc, b_desc, out_desc, a_scale_ptr, b_scale_ptr,
    column_indices_ptr, nnz_ptr,
    K, blocks_per_row, num_programs, stride_asr, stride_ask, stride_bs,
    BS: tl.constexpr, NB: tl.constexpr, SPLIT: tl.constexpr, TILE: tl.constexpr, GROUP_M: tl.constexpr,
    FLATTEN: tl.constexpr, OUT_DTYPE: tl.constexpr, IMPRECISE_ACC: tl.constexpr,
):
    SUB: tl.constexpr = BS // SPLIT
    nnz = tl.load(nnz_ptr)
    runs_per_row = blocks_per_row // NB
    num_rows = nnz // blocks_per_row * SPLIT  # rows of tiles
    num_tiles = num_rows * runs_per_row
    k_tiles = tl.cdiv(K, TILE)
    for tile in tl.range(tl.program_id(0), num_tiles, num_programs, flatten=FLATTEN):
        sub_row, run = grouped_tile(tile, num_rows, runs_per_row, GROUP_M)
        row = sub_row // SPLIT
        blk = row * blocks_per_row + run * NB
        col = tl.load(column_indices_ptr + blk)
        first = sub_row * SUB  # the tile's first row of a
        rows = first.to(tl.int64) + tl.arange(0, SUB)
        cols = col.to(tl.int64) * BS + tl.arange(0, NB * BS)
        acc = tl.zeros((SUB, NB * BS), dtype=tl.float32)
        for ki in range(k_tiles):
            a = a_desc.load([first, ki * TILE])
            b = b_desc.load([col * BS, ki * TILE]).T
            sa = tl.load(a_scale_ptr + rows * stride_asr + ki * stride_ask)
            part = tl.dot(a, b, out_dtype=tl.float32, max_num_imprecise_acc=IMPRECISE_ACC)
            if TILE % (NB * BS) == 0:  # one scale of b for the whole tile: scale rows, not every element twice
                sb = tl.load(b_scale_ptr + ((col * BS) // TILE) * stride_bs + ki)
                acc += part * (sa * sb)[:, None]
            else:
                sb = tl.load(b_scale_ptr + (cols // TILE) * stride_bs + ki)
                acc += part * (sa[:, None] * sb[None, :])
        _store_tile(out_desc, acc.to(OUT_DTYPE), blk, BS, NB, SUB, (sub_row % SPLIT) * SUB)


@triton.jit(do_not_specialize=["N", "out_block_rows", "blocks_per_row", "num_programs"])
def dsd_fp8_kernel(
    s_desc, b_desc, c_desc, s_scale_ptr, b_scale_ptr,
    column_indices_ptr, nnz_ptr,
    N, out_block_rows, blocks_per_row, num_programs, stride_bsk, stride_bsn,
    BS: tl.constexpr, BLOCK_N: tl.constexpr, SPLIT: tl.constexpr, B_KMAJOR: tl.constexpr, TILE: tl.constexpr,
    GROUP_M: tl.constexpr, OUT_DTYPE: tl.constexpr, IMPRECISE_ACC: tl.constexpr,
):
    # Tiles of the used block rows first, then the rows past them, which get zeros (as dsd_tma's).
    SUB: tl.constexpr = BS // SPLIT
    nnz = tl.load(nnz_ptr)
    used_rows = nnz // blocks_per_row
    col_tiles = tl.cdiv(N, BLOCK_N)
    for tile in tl.range(tl.program_id(0), out_block_rows * SPLIT * col_tiles, num_programs):
        sub_row, ct = grouped_tile(tile, out_block_rows * SPLIT, col_tiles, GROUP_M)
        row = sub_row // SPLIT
        within = (sub_row % SPLIT) * SUB
        cols = ct * BLOCK_N + tl.arange(0, BLOCK_N)
        acc = tl.zeros((SUB, BLOCK_N), dtype=tl.float32)
        if row < used_rows:
            first = row * blocks_per_row
            rows = first.to(tl.int64) * BS + within + tl.arange(0, SUB)  # the tile's rows in s_scale, at j = 0
            # a row's blocks hold consecutive columns: no index load inside the loop (it would keep
            # the pipeliner from prefetching, docs/kernels.md, "Tile configurations")
            first_col = tl.load(column_indices_ptr + first)
            for j in range(blocks_per_row):
                blk = first + j
                k_block = first_col + j  # the rows of b this block multiplies, in blocks
                s = s_desc.load([blk * BS + within, 0])
                if B_KMAJOR:
                    b = b_desc.load([ct * BLOCK_N, k_block * BS]).T
                else:
                    b = b_desc.load([k_block * BS, ct * BLOCK_N])
                ss = tl.load(s_scale_ptr + rows + j * BS)
                part = tl.dot(s, b, out_dtype=tl.float32, max_num_imprecise_acc=IMPRECISE_ACC)
                if TILE % BLOCK_N == 0:  # one scale of b for the tile's columns
                    sb = tl.load(b_scale_ptr + ((k_block * BS) // TILE) * stride_bsk
                                 + ((ct * BLOCK_N) // TILE) * stride_bsn)
                    acc += part * (ss * sb)[:, None]
                else:
                    sb = tl.load(b_scale_ptr + ((k_block * BS) // TILE) * stride_bsk + (cols // TILE) * stride_bsn,
                                 mask=cols < N, other=0.0)
                    acc += part * (ss[:, None] * sb[None, :])
        c_desc.store([row * BS + within, ct * BLOCK_N], acc.to(OUT_DTYPE))
