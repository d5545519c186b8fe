"""Copy block rows from several tensors into one, regrouped by expert (see ../ops.py, "Regrouping").

Output-driven: program (r, chunk) copies `BLOCK` elements of output row r from row
source_row[r] of tensor source_tensor[r], whose address comes from a table (the tensors are
separate allocations, one per micro-batch). Rows whose source_tensor is negative (past the rows in
use) are skipped: nothing reads them.
"""
import triton
import triton.language as tl


@triton.jit
def gather_rows_kernel(out_ptr, addresses_ptr, source_tensor_ptr, source_row_ptr, row_width,
                       BLOCK: tl.constexpr):
    r = tl.program_id(0)
    chunk = tl.program_id(1)
    m = tl.load(source_tensor_ptr + r)
    if m >= 0:
        src_row = tl.load(source_row_ptr + r).to(tl.int64)
        src = tl.load(addresses_ptr + m).to(tl.pointer_type(out_ptr.dtype.element_ty))
        offs = chunk * BLOCK + tl.arange(0, BLOCK)
        mask = offs < row_width
        values = tl.load(src + src_row * row_width + offs, mask=mask)
        tl.store(out_ptr + r.to(tl.int64) * row_width + offs, values, mask=mask)
