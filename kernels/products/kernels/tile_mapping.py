"""The grouped ("swizzled") order in which the product kernels walk their output tiles.

Tiles form a [num_rows x num_cols] grid. Consecutive tile numbers run down GROUP_M rows of one
column before moving to the next column, group after group, so the programs in flight share a
few rows of one operand and a few columns of the other while these are hot in L2. The last group
holds the rows left over (num_rows need not be a multiple of GROUP_M).
"""
import triton
import triton.language as tl


@triton.jit
def grouped_tile(tile, num_rows, num_cols, GROUP_M: tl.constexpr, PAST_END: tl.constexpr = False):
    """(row, col) of tile number ``tile`` (a scalar or a tensor of them) in the grouped order.

    Tiles 0 .. num_rows * num_cols - 1 cover every (row, col) exactly once. With PAST_END, tiles
    from there on (masked lanes, programs past the last tile) may be asked for too: no division
    by zero, and each such tile gets row >= num_rows or col >= num_cols, by which callers tell it.
    """
    tiles_per_group = GROUP_M * num_cols
    first_row = (tile // tiles_per_group) * GROUP_M
    group_size = tl.minimum(num_rows - first_row, GROUP_M)
    if PAST_END:
        # A tile past the last group has a group of <= 0 rows: one row past the end then.
        group_size = tl.maximum(group_size, 1)
    local = tile % tiles_per_group
    return first_row + local % group_size, local // group_size
