"""megatron-core's aux-loss scale (`MoEAuxLossAutoScaler.main_loss_backward_scale`) kept as one
tensor on the aux losses' device and written in place.

Every megatron-core release this project supports (0.16 through 0.19) keeps the scale as a class
attribute that its `set_loss_scale` replaces by the first tensor it is given and copies later ones
into. Two cases break that, so both are handled here: a scale given as a Python float (made on the
CPU, which a CUDA aux loss cannot be multiplied by) and a scale tensor on another device than the
losses. The tensor is then replaced once by one on the losses' device; later scales are copied into
it, so a backward captured in a CUDA graph reads each one from the same address. Upstream would
have to keep the scale on the device its losses live on for this to go.
"""
from __future__ import annotations

from typing import Optional

import torch
from megatron.core.transformer.moe.moe_utils import MoEAuxLossAutoScaler


class _TracedScale:
    """The scale tensor as a plain class attribute, the form in which torch.compile can read it."""

    tensor: Optional[torch.Tensor] = None


def scale_on(device: torch.device) -> torch.Tensor:
    """megatron-core's scale tensor, on `device` (moved there once if it lives elsewhere).

    While torch.compile traces, the tensor the last eager call returned: dynamo cannot read an
    attribute of an autograd.Function class. Later scales are written into that same tensor, so a
    compiled graph reads each one."""
    if torch.compiler.is_compiling():
        if _TracedScale.tensor is None:
            raise RuntimeError("the aux-loss scale is read in a compiled graph before any eager use: set it "
                               "first (set_aux_loss_scale), or run one step eagerly")
        return _TracedScale.tensor
    current = MoEAuxLossAutoScaler.main_loss_backward_scale
    if current is None or current.device != torch.device(device):
        value = 1.0 if current is None else current.detach().to(device)
        MoEAuxLossAutoScaler.main_loss_backward_scale = torch.ones(1, dtype=torch.float32, device=device) * value
    _TracedScale.tensor = MoEAuxLossAutoScaler.main_loss_backward_scale
    return _TracedScale.tensor


def set_scale(scale) -> None:
    """Write `scale` (a float or a tensor of one element) into megatron-core's one scale tensor, in
    place where it already lives on the same device."""
    scale = torch.as_tensor(scale, dtype=torch.float32).detach().reshape(-1)
    if scale.numel() != 1:
        raise ValueError(f"the aux-loss scale must be one number, got a tensor of shape {tuple(scale.shape)}")
    buffer = scale_on(scale.device)
    buffer.copy_(scale.to(buffer.dtype).reshape(buffer.shape), non_blocking=True)
