"""The fused LayerNorm / RMSNorm as an autograd function, its kernels in kernels.py (megatron_dmoe's
model/norm.py imports it only when it runs: triton is a Linux-only dependency)."""
from __future__ import annotations

import torch

from ..launch import bind_device, cdiv, direct, next_power_of_2, persistent_programs
from . import kernels as _kernels


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
            direct(_kernels.norm_forward_kernel)[(m,)](
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
            direct(_kernels.norm_backward_kernel)[(programs,)](
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
