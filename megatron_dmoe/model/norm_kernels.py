"""The Triton kernels and autograd function behind model/norm.py (imported only when they run:
triton is a Linux-only dependency, and the module must build everywhere)."""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from dmoe_kernels.launch import bind_device, cdiv, direct, next_power_of_2, persistent_programs


@triton.jit
def _norm_forward_kernel(x_ptr, w_ptr, b_ptr, y_ptr, mean_ptr, rstd_ptr, N, eps, stride_x, stride_y,
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
def _norm_backward_kernel(x_ptr, w_ptr, dy_ptr, dx_ptr, mean_ptr, rstd_ptr, partial_ptr,
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


def _launch(device: torch.device, block_n: int) -> dict:
    if device.type != "cuda":
        return {}
    return {"num_warps": 4 if block_n <= 1024 else 8 if block_n <= 4096 else 16}


class FusedNormFunction(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, weight, bias, eps, rms):
        n = x.shape[-1]
        rows = x.reshape(-1, n)
        if rows.stride(-1) != 1:
            rows = rows.contiguous()
        m = rows.shape[0]
        y = torch.empty((m, n), dtype=x.dtype, device=x.device)
        mean = torch.empty(m, dtype=torch.float32, device=x.device)
        rstd = torch.empty(m, dtype=torch.float32, device=x.device)
        block_n = next_power_of_2(n)
        if m:
            direct(_norm_forward_kernel)[(m,)](
                rows, weight, bias if bias is not None else weight, y, mean, rstd, n, eps,
                rows.stride(0), y.stride(0), RMS=rms, HAS_BIAS=bias is not None,
                BLOCK_N=block_n, **_launch(x.device, block_n),
            )
        ctx.save_for_backward(rows, weight, bias, mean, rstd)
        ctx.rms, ctx.input_shape = rms, x.shape
        return y.view(x.shape)

    @staticmethod
    def backward(ctx, dy):
        rows, weight, bias, mean, rstd = ctx.saved_tensors
        m, n = rows.shape
        bind_device(dy)  # autograd's worker thread
        dy = dy.reshape(m, n)
        if dy.stride(-1) != 1:
            dy = dy.contiguous()
        dx = torch.empty((m, n), dtype=rows.dtype, device=rows.device)
        programs = max(1, min(m, persistent_programs(rows.device, per_sm=4)))
        # per-program sums of dw (and db), added up by one torch reduction
        partial = torch.empty((1 if bias is None else 2, programs, n), dtype=torch.float32, device=rows.device)
        block_n = next_power_of_2(n)
        if m:
            direct(_norm_backward_kernel)[(programs,)](
                rows, weight, dy, dx, mean, rstd, partial,
                m, n, rows.stride(0), dy.stride(0), dx.stride(0), cdiv(m, programs), programs,
                RMS=ctx.rms, HAS_BIAS=bias is not None, BLOCK_N=block_n, **_launch(rows.device, block_n))
            sums = partial.sum(1)
            dw = sums[0].to(weight.dtype)
            db = sums[1].to(bias.dtype) if bias is not None else None
        else:
            dw = torch.zeros_like(weight)
            db = torch.zeros_like(bias) if bias is not None else None
        return dx.view(ctx.input_shape), dw, db, None, None
