"""Expert activations and their hand-written backward (used when the activation is recomputed)."""
from __future__ import annotations

from typing import Optional, Tuple

import torch
import torch.nn.functional as F


def activate(activation: str, h1: torch.Tensor, h2: Optional[torch.Tensor] = None) -> torch.Tensor:
    """gelu: gelu(h1) (exact erf form, megatron's F.gelu); swiglu: silu(h1) * h2."""
    if activation == "gelu":
        return F.gelu(h1)
    if activation == "swiglu":
        return F.silu(h1) * h2
    raise ValueError(f"activation={activation!r} is not supported; use 'gelu' or 'swiglu'.")


def activate_backward(
    activation: str, grad: torch.Tensor, h1: torch.Tensor, h2: Optional[torch.Tensor] = None
) -> Tuple[torch.Tensor, Optional[torch.Tensor]]:
    """Gradients of `activate` with respect to (h1, h2); h2's is None for gelu."""
    if activation == "gelu":
        return torch.ops.aten.gelu_backward(grad, h1), None
    if activation == "swiglu":
        # in fp32 at least: low-precision intermediates would add rounding twice
        dtype = torch.promote_types(grad.dtype, torch.float32)
        g, a, b = grad.to(dtype), h1.to(dtype), h2.to(dtype)
        sig = torch.sigmoid(a)
        silu = a * sig
        d_h1 = g * b * sig * (1.0 + a * (1.0 - sig))
        d_h2 = g * silu
        return d_h1.to(h1.dtype), d_h2.to(h2.dtype)
    raise ValueError(f"activation={activation!r} is not supported; use 'gelu' or 'swiglu'.")
