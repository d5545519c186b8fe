"""linear: y = x W^T (+ bias) with its three products in block-scaled fp8, as DeepSeek-V3 trains.

  forward        x's rows (1 x 128 along K)       @ W^T (128 x 128 blocks)
  input grad     dy's rows (1 x 128 along N)      @ W   (the same blocks: W^T's are W's)
  weight grad    dy^T's rows (1 x 128 along tokens) @ x  (x^T's rows, 1 x 128 along tokens)
each accumulated in fp32 and promoted every 128 of K (reference.matmul). The weight itself is only
read: the master copy and its optimizer state are as in bf16 training; y and dx come out in x's
dtype, dW in W's. With fp8_wgrad=False the weight gradient is x's dtype's product dy^T x instead
(no transposed quantizations: the choice of the model's fp8 linears, see docs/kernels.md).
"""
from __future__ import annotations

from typing import Optional

import torch

IMPLS = ("auto", "torch", "triton", "cublas")


def _ops(impl: str, device: torch.device):
    if impl not in IMPLS:
        raise ValueError(f"fp8 linear: impl must be one of {', '.join(IMPLS)}, got {impl!r}")
    if impl in ("triton", "cublas") or (impl == "auto" and device.type == "cuda"):
        from . import ops
        return ops
    from . import reference
    return reference


def _product(impl, ops, a, a_scale, b, b_scale, out_dtype):
    """a @ b: through cuBLAS where impl allows it and it takes these operands (fp8/cublas.py),
    else through ops.matmul."""
    if impl in ("auto", "cublas"):
        from . import cublas

        if cublas.supported(a, b):
            return cublas.matmul(a, a_scale, b, b_scale, out_dtype)
    return ops.matmul(a, a_scale, b, b_scale, out_dtype=out_dtype)


class _Fp8Linear(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, weight, impl, fp8_wgrad):
        ops = _ops(impl, x.device)
        x2 = x.reshape(-1, x.shape[-1])
        xq, xs = ops.quantize_rows(x2)
        wq, ws = ops.quantize_blocks(weight)
        y = _product(impl, ops, xq, xs, wq.t(), ws.t(), x.dtype)
        # x as a bf16 linear keeps it (the weight gradient quantizes it along the tokens), and the
        # weight itself (a parameter: no memory of its own), quantized again as W^T in backward
        ctx.save_for_backward(x, weight)
        ctx.impl, ctx.weight_dtype, ctx.fp8_wgrad = impl, weight.dtype, fp8_wgrad
        return y.reshape(*x.shape[:-1], weight.shape[0])

    @staticmethod
    def backward(ctx, dy):
        x, weight = ctx.saved_tensors
        ops = _ops(ctx.impl, x.device)
        dy2 = dy.reshape(-1, dy.shape[-1])
        dx = dw = None
        if ctx.needs_input_grad[0]:
            gq, gs = ops.quantize_rows(dy2)
            # dx = dy W with W K-major (the transpose of a row-major W^T): fp8 tensor cores read
            # their right operand K-major, and cuBLAS wants it column-major; W^T's 128 x 128 blocks
            # and scales are W's, so this is W's quantization, laid out for the product
            wtq, wts = ops.quantize_blocks(weight.t())
            dx = _product(ctx.impl, ops, gq, gs, wtq.t(), wts.t(), x.dtype).reshape(x.shape)
        if ctx.needs_input_grad[1] and not ctx.fp8_wgrad:
            dw = (dy2.t() @ x.reshape(-1, x.shape[-1])).to(ctx.weight_dtype)
        elif ctx.needs_input_grad[1]:
            gtq, gts = ops.quantize_rows(dy2.t())
            xtq, xts = ops.quantize_rows(x.reshape(-1, x.shape[-1]).t())
            dw = ops.matmul(gtq, gts, xtq.t(), xts.t(), out_dtype=ctx.weight_dtype)
        return dx, dw, None, None


def linear(x: torch.Tensor, weight: torch.Tensor, bias: Optional[torch.Tensor] = None,
           impl: str = "auto", fp8_wgrad: bool = True) -> torch.Tensor:
    """torch.nn.functional.linear in block-scaled fp8. x [..., K], weight [N, K]. impl: torch (the
    reference, any device), triton (the kernels: CUDA, or CPU under TRITON_INTERPRET=1), cublas
    (the forward and input-gradient products through torch._scaled_mm where it takes them,
    fp8/cublas.py, else as triton), auto (cublas on CUDA tensors, else torch). fp8_wgrad: the
    weight gradient as an fp8 product too (else in x's dtype, as torch.nn.functional.linear's)."""
    if weight.dim() != 2 or x.shape[-1] != weight.shape[1]:
        raise ValueError(f"fp8 linear: expects x [..., K] and weight [N, K], got {tuple(x.shape)} and "
                         f"{tuple(weight.shape)}")
    y = _Fp8Linear.apply(x, weight, impl, fp8_wgrad)
    return y if bias is None else y + bias
