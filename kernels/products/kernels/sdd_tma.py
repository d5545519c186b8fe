"""Persistent SDD for regular (dMoE) topologies, with tensor-memory-accelerator (TMA) descriptors.

A fixed grid of programs walks the output tiles (NB neighbouring blocks of one block row each),
GROUP_M block rows at a time for L2 reuse. With FLATTEN the compiler fuses the tile loop and the
K loop into one software pipeline, so a tile's epilogue overlaps the next tile's first loads: that
matters when K (the model width) is short. Descriptors zero-fill reads past the edges of A and B,
so K need not be a multiple of BLOCK_K. The tile count comes from nnz on the device.

GELU_OUT (the GELU expert MLP's forward): besides out = h (rounded to the output dtype), act_desc
gets gelu(h) of that rounded h, so that no separate pass reads h back. (The backward's GELU in the
epilogue of the product that gives its gradient measured slower than the separate pass:
docs/kernels.md, "Fused epilogues".)
"""
import triton
import triton.language as tl

from ...activations.kernels import gelu
from .dsd_tma import halves
from .tile_mapping import grouped_tile


@triton.jit
def _store_tile(desc, out, blk, BS: tl.constexpr, NB: tl.constexpr, ROWS: tl.constexpr, within):
    # Each block of the tile is a separate [BS, BS] slab of the data tensor; the tile holds ROWS of
    # each block's rows, from row `within` of the block on.
    if NB == 1:
        desc.store([blk * BS + within, 0], out)
    else:
        o0, o1 = halves(out, ROWS, 2 * BS)
        desc.store([blk * BS + within, 0], o0)
        desc.store([(blk + 1) * BS + within, 0], o1)


@triton.jit(do_not_specialize=["K", "blocks_per_row", "num_programs"])
def sdd_tma_kernel(
    a_desc, b_desc, out_desc,
    column_indices_ptr, nnz_ptr,
    K, blocks_per_row, num_programs,
    act_desc,
    BS: tl.constexpr, NB: tl.constexpr, BLOCK_K: tl.constexpr, GROUP_M: tl.constexpr,
    B_KMAJOR: tl.constexpr, FLATTEN: tl.constexpr,
    OUT_DTYPE: tl.constexpr, DOT_PRECISION: tl.constexpr,
    GELU_OUT: tl.constexpr,
):
    nnz = tl.load(nnz_ptr)
    runs_per_row = blocks_per_row // NB
    num_rows = nnz // blocks_per_row
    num_tiles = num_rows * runs_per_row
    k_tiles = tl.cdiv(K, BLOCK_K)
    for tile in tl.range(tl.program_id(0), num_tiles, num_programs, flatten=FLATTEN):
        row, run = grouped_tile(tile, num_rows, runs_per_row, GROUP_M)
        blk = row * blocks_per_row + run * NB
        col = tl.load(column_indices_ptr + blk)
        acc = tl.zeros((BS, NB * BS), dtype=tl.float32)
        for ki in range(k_tiles):
            a = a_desc.load([row * BS, ki * BLOCK_K])
            if B_KMAJOR:  # b given as the transpose of a row-major [N, K] matrix (a weight)
                b = b_desc.load([col * BS, ki * BLOCK_K]).T
            else:
                b = b_desc.load([ki * BLOCK_K, col * BS])
            acc = tl.dot(a, b, acc, input_precision=DOT_PRECISION)
        out = acc.to(OUT_DTYPE)
        if GELU_OUT and NB == 2:
            # block by block: the GELU of one block at a time is live, not of the whole tile (that
            # spilled registers at 128 x 256)
            o0, o1 = halves(out, BS, 2 * BS)
            out_desc.store([blk * BS, 0], o0)
            act_desc.store([blk * BS, 0], gelu(o0.to(tl.float32)).to(OUT_DTYPE))
            out_desc.store([(blk + 1) * BS, 0], o1)
            act_desc.store([(blk + 1) * BS, 0], gelu(o1.to(tl.float32)).to(OUT_DTYPE))
        else:
            _store_tile(out_desc, out, blk, BS, NB, BS, 0)
            if GELU_OUT:
                _store_tile(act_desc, gelu(out.to(tl.float32)).to(OUT_DTYPE), blk, BS, NB, BS, 0)
