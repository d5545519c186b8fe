"""Triton kernels of the fused LayerNorm / RMSNorm (launched by functional.py).

  norm_forward_kernel    one program per row: y = (x - mean) * rstd * w (+ b), or x * rstd * w for
                         RMS; stores the row's mean and rstd for the backward
  norm_backward_kernel   persistent programs over rows: dx, and each program's partial sums of dw
                         (and db), added up afterwards by one torch reduction
"""
import triton
import triton.language as tl


@triton.jit
def norm_forward_kernel(x_ptr, w_ptr, b_ptr, y_ptr, mean_ptr, rstd_ptr, N, eps, stride_x, stride_y,
                         RMS: tl.constexpr, HAS_BIAS: tl.constexpr, BLOCK_N: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    cols = tl.arange(0, BLOCK_N)
    mask = cols < N
    x = tl.load(x_ptr + row * stride_x + cols, mask=mask, other=0.0).to(tl.float32)
    if RMS:
        centred = x
    else:
        mean = tl.sum(x, 0) / N
        centred = tl.where(mask, x - mean, 0.0)
        tl.store(mean_ptr + row, mean)
    rstd = 1.0 / tl.sqrt(tl.sum(centred * centred, 0) / N + eps)
    tl.store(rstd_ptr + row, rstd)
    y = centred * rstd * tl.load(w_ptr + cols, mask=mask, other=0.0).to(tl.float32)
    if HAS_BIAS:
        y += tl.load(b_ptr + cols, mask=mask, other=0.0).to(tl.float32)
    tl.store(y_ptr + row * stride_y + cols, y.to(y_ptr.dtype.element_ty), mask=mask)


@triton.jit
def norm_backward_kernel(x_ptr, w_ptr, dy_ptr, dx_ptr, mean_ptr, rstd_ptr, partial_ptr,
                          M, N, stride_x, stride_dy, stride_dx, rows_per_program, num_programs,
                          RMS: tl.constexpr, HAS_BIAS: tl.constexpr, BLOCK_N: tl.constexpr):
    """partial_ptr: [1 or 2, num_programs, N] fp32, this program's sums of dw (and db) at pid."""
    pid = tl.program_id(0)
    cols = tl.arange(0, BLOCK_N)
    col_mask = cols < N
    w = tl.load(w_ptr + cols, mask=col_mask, other=0.0).to(tl.float32)
    dw = tl.zeros([BLOCK_N], dtype=tl.float32)
    db = tl.zeros([BLOCK_N], dtype=tl.float32)
    first = pid.to(tl.int64) * rows_per_program
    for i in range(rows_per_program):
        row = first + i
        mask = cols < tl.where(row < M, N, 0)  # rows past M read zeros and store nothing
        x = tl.load(x_ptr + row * stride_x + cols, mask=mask, other=0.0).to(tl.float32)
        dy = tl.load(dy_ptr + row * stride_dy + cols, mask=mask, other=0.0).to(tl.float32)
        stats_row = tl.minimum(row, M - 1)  # a real row's statistics; x and dy are zeros past M
        rstd = tl.load(rstd_ptr + stats_row)
        if RMS:
            xhat = x * rstd
        else:
            mean = tl.load(mean_ptr + stats_row)
            xhat = tl.where(mask, (x - mean) * rstd, 0.0)
        wdy = w * dy
        c1 = tl.sum(xhat * wdy, 0) / N
        if RMS:
            dx = (wdy - xhat * c1) * rstd
        else:
            dx = (wdy - (xhat * c1 + tl.sum(wdy, 0) / N)) * rstd
        tl.store(dx_ptr + row * stride_dx + cols, dx.to(dx_ptr.dtype.element_ty), mask=mask)
        dw += dy * xhat
        if HAS_BIAS:
            db += dy
    tl.store(partial_ptr + pid * N + cols, dw, mask=col_mask)
    if HAS_BIAS:
        tl.store(partial_ptr + (num_programs + pid) * N + cols, db, mask=col_mask)
