"""grouped_tile, the tile order every product kernel walks, against a plain loop over the groups."""
import pytest
import torch
import triton
import triton.language as tl

from dmoe_kernels.products.kernels.tile_mapping import grouped_tile

# (rows, cols, GROUP_M): rows a multiple of GROUP_M or not, fewer rows than GROUP_M, one row/column.
SHAPES = [(1, 1, 1), (5, 3, 2), (7, 4, 4), (8, 3, 4), (3, 5, 8), (10, 1, 3), (6, 2, 1)]


def reference_order(num_rows, num_cols, group_m):
    """(row, col) of tile 0, 1, ...: GROUP_M rows (fewer in the last group) down each column in turn."""
    order = []
    for first_row in range(0, num_rows, group_m):
        rows = range(first_row, min(first_row + group_m, num_rows))
        order += [(row, col) for col in range(num_cols) for row in rows]
    return order


@triton.jit
def _one_tile_per_program(rows_ptr, cols_ptr, num_rows, num_cols, GROUP_M: tl.constexpr):
    tile = tl.program_id(0)  # a scalar, as in dsd_kernel
    row, col = grouped_tile(tile, num_rows, num_cols, GROUP_M)
    tl.store(rows_ptr + tile, row)
    tl.store(cols_ptr + tile, col)


@triton.jit
def _tiles_as_a_vector(rows_ptr, cols_ptr, num_rows, num_cols, GROUP_M: tl.constexpr, BLOCK: tl.constexpr):
    tile = tl.arange(0, BLOCK)  # a tensor of tiles, past the last one too, as in dsdt_tma_kernel
    row, col = grouped_tile(tile, num_rows, num_cols, GROUP_M, PAST_END=True)
    tl.store(rows_ptr + tile, row)
    tl.store(cols_ptr + tile, col)


def _pairs(rows, cols):
    return list(zip(rows.tolist(), cols.tolist()))


def test_reference_order_by_hand():
    assert reference_order(3, 2, 2) == [(0, 0), (1, 0), (0, 1), (1, 1), (2, 0), (2, 1)]


@pytest.mark.parametrize("num_rows,num_cols,group_m", SHAPES)
def test_each_tile_once_in_grouped_order(device, num_rows, num_cols, group_m):
    n = num_rows * num_cols
    rows = torch.full((n,), -1, dtype=torch.int32, device=device)
    cols = torch.full((n,), -1, dtype=torch.int32, device=device)
    _one_tile_per_program[(n,)](rows, cols, num_rows, num_cols, GROUP_M=group_m)
    got = _pairs(rows.cpu(), cols.cpu())
    assert got == reference_order(num_rows, num_cols, group_m)
    assert sorted(got) == [(r, c) for r in range(num_rows) for c in range(num_cols)]


@pytest.mark.parametrize("num_rows,num_cols,group_m", SHAPES + [(0, 3, 4)])
@pytest.mark.filterwarnings("error:divide by zero:RuntimeWarning")  # the interpreter's; a GPU's is silent
def test_past_the_end_tiles_fall_outside_the_grid(device, num_rows, num_cols, group_m):
    n = num_rows * num_cols
    # past the last tile by more than a whole group, as a program grid sized for max_blocks is
    block = triton.next_power_of_2(n + 2 * group_m * num_cols)
    rows = torch.full((block,), -1, dtype=torch.int32, device=device)
    cols = torch.full((block,), -1, dtype=torch.int32, device=device)
    _tiles_as_a_vector[(1,)](rows, cols, num_rows, num_cols, GROUP_M=group_m, BLOCK=block)
    got = _pairs(rows.cpu(), cols.cpu())
    assert got[:n] == reference_order(num_rows, num_cols, group_m)
    outside = [(r, c) for r, c in got[n:] if r >= num_rows or c >= num_cols]
    assert outside == got[n:]
