"""LayerNorm and RMSNorm in Triton, for the layer spec without Transformer Engine or apex.

    y = (x - mean(x)) * rstd * weight + bias      LayerNorm
    y = x * rstd * weight                          RMSNorm, rstd = 1 / sqrt(mean(x^2) + eps)

Forward: one program per row, statistics in fp32, mean and rstd kept for backward. Backward: each
program takes a run of rows, writes their input gradients and sums its rows' weight and bias
gradients in fp32 registers; the per-program partial sums (a few hundred rows of width N) are then
added by torch. No atomics, so the result does not depend on scheduling.

The kernels live in dmoe_kernels.norms, imported on first use (triton is a Linux-only dependency).
torch's own LayerNorm backward spends most of its time on the weight and bias gradients, several
times what reading x and dy once costs, and that was a visible share of a GPT Small training step
(docs/performance.md, "LayerNorm backward in torch"). On CPU tensors the module uses torch's
functional norms; the kernels run there only when called directly under Triton's interpreter (the
tests do).
"""
from __future__ import annotations

from typing import Optional

import torch
import torch.nn.functional as F

from megatron_dmoe.parallel.param_roles import mark_sequence_parallel

MAX_FUSED_WIDTH = 16384  # a row must fit one program's registers; wider rows use torch


def fused_norm(x: torch.Tensor, weight: torch.Tensor, bias: Optional[torch.Tensor], eps: float,
               rms: bool = False) -> torch.Tensor:
    """LayerNorm (rms=False; bias may be None) or RMSNorm (rms=True, bias None) over x's last
    dimension with the Triton kernels; output in x's dtype, statistics in fp32."""
    if rms and bias is not None:
        raise ValueError("fused_norm: RMSNorm takes no bias")
    if weight.shape != (x.shape[-1],) or (bias is not None and bias.shape != weight.shape):
        raise ValueError(f"fused_norm: weight {tuple(weight.shape)} and bias "
                         f"{None if bias is None else tuple(bias.shape)} must be [{x.shape[-1]}] "
                         f"for x {tuple(x.shape)}")
    from dmoe_kernels.norms.functional import FusedNormFunction  # triton: Linux only

    return FusedNormFunction.apply(x, weight, bias, float(eps), rms)


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
        for flag in ("layernorm_zero_centered_gamma", "persist_layer_norm", "memory_efficient_layer_norm"):
            if getattr(config, flag, False):
                raise ValueError(f"FusedNorm does not support TransformerConfig.{flag}=True "
                                 "(use Transformer Engine's norm)")
        self.rms = kind == "RMSNorm"
        self.eps = eps
        self.normalized_shape = (hidden_size,)
        self.weight = torch.nn.Parameter(torch.ones(hidden_size))
        self.bias = None if self.rms else torch.nn.Parameter(torch.zeros(hidden_size))
        if getattr(config, "sequence_parallel", False):
            # each tensor-parallel rank normalises its own sequence shard: megatron's
            # finalize_model_grads sums the gradients of parameters so marked over the group
            for param in self.parameters():
                mark_sequence_parallel(param)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if x.is_cuda and x.shape[-1] <= MAX_FUSED_WIDTH:
            return fused_norm(x, self.weight, self.bias, self.eps, self.rms)
        if self.rms:
            return F.rms_norm(x, self.normalized_shape, self.weight, self.eps)
        return F.layer_norm(x, self.normalized_shape, self.weight, self.bias, self.eps)

    def extra_repr(self) -> str:
        return f"{self.normalized_shape}, eps={self.eps}, {'RMSNorm' if self.rms else 'LayerNorm'}"
