"""LayerNorm and RMSNorm in Triton, for the layer spec without Transformer Engine or apex.

    y = (x - mean(x)) * rstd * weight + bias      LayerNorm
    y = x * rstd * weight                          RMSNorm, rstd = 1 / sqrt(mean(x^2) + eps)

Forward: one program per row, statistics in fp32, mean and rstd kept for backward. Backward: each
program takes a run of rows, writes their input gradients and sums its rows' weight and bias
gradients in fp32 registers; the per-program partial sums (a few hundred rows of width N) are then
added by torch. No atomics, so the result does not depend on scheduling.

torch's own LayerNorm backward spends most of its time on the weight and bias gradients (on an H200,
77 us per [16384, 768] bf16 call, where reading x and dy once takes about 12 us): 15 ms of a 304 ms
GPT Small training step. On CPU tensors the module uses torch's functional norms; the kernels run
there only when called directly under Triton's interpreter (the tests do).
"""
from __future__ import annotations

import functools
from typing import Optional

import torch
import torch.nn.functional as F
import triton
import triton.language as tl

MAX_FUSED_WIDTH = 16384  # a row must fit one program's registers; wider rows use torch


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


@functools.lru_cache(maxsize=None)
def _sm_count(device_index: int) -> int:
    return torch.cuda.get_device_properties(device_index).multi_processor_count


def _backward_programs(rows: int, device: torch.device) -> int:
    if device.type != "cuda":
        return max(1, min(rows, 3))  # the interpreter: a few programs, several rows each
    index = device.index if device.index is not None else torch.cuda.current_device()
    return max(1, min(rows, 4 * _sm_count(index)))


def _launch(device: torch.device, block_n: int) -> dict:
    if device.type != "cuda":
        return {}
    return {"num_warps": 4 if block_n <= 1024 else 8 if block_n <= 4096 else 16}


class _FusedNorm(torch.autograd.Function):
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
        block_n = triton.next_power_of_2(n)
        if m:
            _norm_forward_kernel[(m,)](rows, weight, bias if bias is not None else weight, y, mean, rstd, n, eps,
                                  rows.stride(0), y.stride(0), RMS=rms, HAS_BIAS=bias is not None,
                                  BLOCK_N=block_n, **_launch(x.device, block_n))
        ctx.save_for_backward(rows, weight, bias, mean, rstd)
        ctx.rms, ctx.input_shape = rms, x.shape
        return y.view(x.shape)

    @staticmethod
    def backward(ctx, dy):
        rows, weight, bias, mean, rstd = ctx.saved_tensors
        m, n = rows.shape
        if dy.is_cuda:
            torch.cuda.set_device(dy.device)  # autograd's worker thread
        dy = dy.reshape(m, n)
        if dy.stride(-1) != 1:
            dy = dy.contiguous()
        dx = torch.empty((m, n), dtype=rows.dtype, device=rows.device)
        programs = _backward_programs(m, rows.device)
        # per-program sums of dw (and db), added up by one torch reduction
        partial = torch.empty((1 if bias is None else 2, programs, n), dtype=torch.float32, device=rows.device)
        block_n = triton.next_power_of_2(n)
        if m:
            _norm_backward_kernel[(programs,)](
                rows, weight, dy, dx, mean, rstd, partial,
                m, n, rows.stride(0), dy.stride(0), dx.stride(0), triton.cdiv(m, programs), programs,
                RMS=ctx.rms, HAS_BIAS=bias is not None, BLOCK_N=block_n, **_launch(rows.device, block_n))
            sums = partial.sum(1)
            dw = sums[0].to(weight.dtype)
            db = sums[1].to(bias.dtype) if bias is not None else None
        else:
            dw = torch.zeros_like(weight)
            db = torch.zeros_like(bias) if bias is not None else None
        return dx.view(ctx.input_shape), dw, db, None, None


def fused_norm(x: torch.Tensor, weight: torch.Tensor, bias: Optional[torch.Tensor], eps: float,
               rms: bool = False) -> torch.Tensor:
    """LayerNorm (rms=False; bias may be None) or RMSNorm (rms=True, bias None) over x's last
    dimension with the Triton kernels; output in x's dtype, statistics in fp32."""
    if rms and bias is not None:
        raise ValueError("fused_norm: RMSNorm takes no bias")
    if weight.shape != (x.shape[-1],) or (bias is not None and bias.shape != weight.shape):
        raise ValueError(f"fused_norm: weight {tuple(weight.shape)} and bias "
                         f"{None if bias is None else tuple(bias.shape)} must be [{x.shape[-1]}] for x {tuple(x.shape)}")
    return _FusedNorm.apply(x, weight, bias, float(eps), rms)


class FusedNorm(torch.nn.Module):
    """Drop-in for megatron-core's WrappedTorchNorm (same constructor, the same parameters as
    torch.nn.LayerNorm / RMSNorm, so checkpoints are interchangeable): the Triton kernels on CUDA
    tensors, torch's functional norms elsewhere."""

    def __init__(self, config, hidden_size: int, eps: float = 1e-5, persist_layer_norm: bool = False,
                 zero_centered_gamma: bool = False, normalization: str = "LayerNorm"):
        super().__init__()
        kind = config.normalization
        if kind not in ("LayerNorm", "RMSNorm"):
            raise ValueError(f"FusedNorm supports LayerNorm and RMSNorm, not {kind!r}")
        for flag in ("layernorm_zero_centered_gamma", "persist_layer_norm", "sequence_parallel",
                     "memory_efficient_layer_norm"):
            if getattr(config, flag, False):
                raise ValueError(f"FusedNorm does not support TransformerConfig.{flag}=True "
                                 "(use Transformer Engine's norm)")
        self.rms = kind == "RMSNorm"
        self.eps = eps
        self.normalized_shape = (hidden_size,)
        self.weight = torch.nn.Parameter(torch.ones(hidden_size))
        self.bias = None if self.rms else torch.nn.Parameter(torch.zeros(hidden_size))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if x.is_cuda and x.shape[-1] <= MAX_FUSED_WIDTH:
            return fused_norm(x, self.weight, self.bias, self.eps, self.rms)
        if self.rms:
            return F.rms_norm(x, self.normalized_shape, self.weight, self.eps)
        return F.layer_norm(x, self.normalized_shape, self.weight, self.bias, self.eps)

    def extra_repr(self) -> str:
        return f"{self.normalized_shape}, eps={self.eps}, {'RMSNorm' if self.rms else 'LayerNorm'}"
